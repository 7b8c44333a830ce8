// The grouped GEMMs' tile-offset table when it does not fit the kernels' shared memory (more than
// kGemmSmemTileE experts): one block scans the experts' tile counts. A kernel of its own file, so
// that one translation unit (host/gemm/grouped_gemm.cu) defines it and every GEMM launcher calls
// it through detail::launch_gemm_tile_offsets.
#pragma once

#include "kernels/gemm/scheduler.cuh"

namespace machmoe::kernels {

// tile_offsets[e] = Σ_{e' < e} ceil(rows_e' / BM) · n_tiles, rows_e = ends[e] - begins[e], one block.
__global__ void __launch_bounds__(1024) grouped_gemm_tile_offsets(const int32_t* begins, const int32_t* ends, int E,
                                                                   int n_tiles, int32_t* tile_offsets) {
  __shared__ int smem[32];
  int carry = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int tiles = e < E ? gemm_expert_tiles(begins, ends, e, n_tiles) : 0;
    int total;
    const int excl = block_exclusive_scan(tiles, smem, &total);
    if (e < E) tile_offsets[e] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) tile_offsets[E] = carry;
}

}  // namespace machmoe::kernels
