// The grouped GEMMs' tile-offset table for more experts than the kernels' shared-memory table
// holds (kernels/gemm/tile_offsets.cuh): one launcher, defined in grouped_gemm.cu, for every
// GEMM family that uses the tile schedule (the bf16 and FP8 grouped GEMMs).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace machmoe::detail {

// tile_offsets [E+1] = the prefix sum of the experts' tile counts (ceil(rows / BM) · n_tiles, the
// rows of expert e [begins[e], ends[e])), on `stream`; `what` names the caller in a launch error.
void launch_gemm_tile_offsets(const int32_t* begins, const int32_t* ends, int E, int n_tiles, int32_t* tile_offsets,
                              const char* what, cudaStream_t stream);

}  // namespace machmoe::detail
