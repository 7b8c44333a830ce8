// The FP8 experts' SwiGLU backward (between the dA' GEMM and the dH GEMMs), one pass over the rows.
// Per row r of R (rows grouped by expert, as the GEMMs write them), with H dequantised from the
// forward's E4M3 H (machmoe/fp8.hpp: 1x128 tiles along a row) and s = scores[row_pair[r]]:
//   g, u = H[r, 2j], H[r, 2j+1] (gate/up interleaved);  σ = sigmoid(g);  act = g·σ;  A = act·u
//   d_scores[row_pair[r]] = Σ_j dA'[r, j]·A[r, j]                     (fp32, fixed order)
//   dH[r, 2j]   = s·dA'[r, j]·u·σ·(1 + g·(1 − σ))                     (bf16)
//   dH[r, 2j+1] = s·dA'[r, j]·act                                     (bf16)
//   A'[r, j]    = s·A                                                 (bf16, dW2's column operand)
// computed in fp32 from the bf16 dA' and the exact E4M3 values. With `clamp` (the clamped SwiGLU,
// machmoe::GluClamp): gc = min(g, limit) (clamp_after: g), σ = sigmoid(alpha·gc), f = gc·σ
// (clamp_after: min(gc·σ, limit)), uc = clamp(u, ±limit) + up_offset, A = f·uc; dH[r, 2j] =
// s·dA'·uc·σ·(1 + alpha·gc·(1 − σ)) where no clamp of the gate binds, else 0; dH[r, 2j+1] = s·dA'·f
// where |u| <= limit, else 0. A is recomputed from the saved
// E4M3 H (the forward's GLU epilogue computed its A from the fp32 H: the backward's A differs from
// it by H's quantisation, as in DeepSeek-V3's recipe, which recomputes the SwiGLU from its cached
// FP8 input).
// Rules: n >= 4 and a multiple of 4; 0 <= R < 2^31; h_scales has ceil(2n/128) columns; dA', dH,
// A' 16-byte aligned, hq 8-byte aligned; row_pair values index `scores` (not checked on the
// device). Asynchronous on `stream`; throws machmoe::Error(InvalidArgument) naming the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "machmoe/types.hpp"

namespace machmoe {

struct SwigluBackwardFp8Args {
  const void* da = nullptr;        // [R, n] bf16
  const uint8_t* hq = nullptr;     // [R, 2n] E4M3 codes
  const float* h_scales = nullptr; // [R, ceil(2n/128)]
  const float* scores = nullptr;   // [pairs] fp32
  const int32_t* row_pair = nullptr;  // [R]
  int64_t R = 0, n = 0;
  void* dh = nullptr;              // [R, 2n] bf16
  void* a_prime = nullptr;         // [R, n] bf16
  float* d_scores = nullptr;       // [pairs]: written at row_pair[r] for each row r
  // Optional: dH quantised along its rows as well (1x128 tiles, machmoe/fp8.hpp; bitwise what
  // quantize_rows_fp8 of the bf16 dH writes), for the dX~ GEMM without a pass over dH. Both or
  // neither; n a multiple of 8 with them (16-byte rows of codes).
  uint8_t* dh_q = nullptr;         // [R, 2n] E4M3 codes
  float* dh_scales = nullptr;      // [R, ceil(2n/128)]
  const GluClamp* clamp = nullptr; // the clamped SwiGLU's parameters, or null: SwiGLU
};
void swiglu_backward_fp8(const SwigluBackwardFp8Args& args, cudaStream_t stream);

}  // namespace machmoe
