// machmoe FP8 (E4M3) weight-gradient grouped GEMM: the varlen-K GEMM of the weight gradients on
// operands that quantize_columns_fp8 (machmoe/fp8.hpp) wrote, DeepSeek-V3's recipe for wgrad
// (both operands in 1x128 tiles along the reduction dimension, which is each expert's rows).
// Not yet used by the layer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "machmoe/fp8.hpp"
#include "machmoe/types.hpp"

namespace machmoe {

// For every expert e, with chunks c in [chunk_offsets[e], chunk_offsets[e+1]) (128 of its rows
// each, as quantize_columns_fp8 cut them):
//   C[e][m, n] = Σ_c sa[c, m] · sb[c, n] · Σ_{k < 128} Aqt[c, m, k] · Bqt[c, n, k]
//   a_qt [max_chunks, M, 128] e4m3, a_scales [max_chunks, M] fp32: quantize_columns_fp8 of A
//   (d = M); b_qt [max_chunks, N, 128] e4m3, b_scales [max_chunks, N] fp32: quantize_columns_fp8
//   of B (d = N), with the same (R, expert_offsets, E) as A, so that both share chunk_offsets and
//   max_chunks (fp8_columns_layout(R, E, d).max_chunks);
//   c: [E, M, N] row-major, fp32 or bf16 (c_dtype); with transpose_c, C[e]ᵀ into [E, N, M].
// dW1ᵀ = xᵀ·dH: A = x gathered (M = d), B = dH (N = n1), transpose_c stores dW1 [E, n1, d];
// dW2 = doutᵀ·A': A = dout gathered (M = d), B = A' (N = n).
// Each chunk's 128-deep product is summed by the tensor cores, then promoted in fp32 with its two
// scales (acc += sa·sb·block). Fixed K order: deterministic. An expert with no chunks gets
// C[e] = 0; every element of C is written. chunk_offsets must be what the quantiser wrote
// (nondecreasing within [0, max_chunks]); values outside are clamped on the device (no access
// leaves the buffers; the result is then meaningless). max_ctas: 0 for one persistent CTA per SM,
// else at most that many. Asynchronous on `stream`, no host synchronisation. Needs an sm_90 GPU.
// Rules (checked before any CUDA call, Error InvalidArgument naming the argument): 1 <= E <= 2^24;
// M, N in [16, 2^24] and multiples of 16 (quantize_columns_fp8's d); 0 <= max_chunks and
// 128·max_chunks < 2^31; E·ceil(M/128)·ceil(N/256) < 2^31 - 2^16 (the tiles); c_dtype FP32 or
// BF16; a_qt, b_qt, the scales and c 16-byte aligned (TMA), chunk_offsets 4-byte aligned; c and
// chunk_offsets not null, nor (with max_chunks > 0) the operands. With max_chunks = 0 (R = 0)
// the call zeroes C.
struct GroupedWgradFp8Args {
  const uint8_t* a_qt = nullptr;        // [max_chunks, M, 128] e4m3
  const float* a_scales = nullptr;      // [max_chunks, M]
  int64_t M = 0;
  const uint8_t* b_qt = nullptr;        // [max_chunks, N, 128] e4m3
  const float* b_scales = nullptr;      // [max_chunks, N]
  int64_t N = 0;
  const int32_t* chunk_offsets = nullptr;  // [E+1] device, from quantize_columns_fp8
  int64_t E = 0;
  int64_t max_chunks = 0;               // the operands' first dimension
  void* c = nullptr;                    // [E, M, N] (or [E, N, M] with transpose_c)
  DType c_dtype = DType::FP32;
  bool transpose_c = false;
  int max_ctas = 0;
};
void grouped_wgrad_fp8(const GroupedWgradFp8Args& args, cudaStream_t stream);

}  // namespace machmoe
