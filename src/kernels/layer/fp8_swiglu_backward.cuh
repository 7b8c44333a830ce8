// The FP8 experts' SwiGLU backward between the dA' GEMM and the dH GEMMs, in one pass over the
// rows (host/quant/fp8_swiglu_backward.cu; machmoe/fp8_swiglu.hpp states the math). Per row r of
// R (rows grouped by expert), with H dequantised from the forward's E4M3 H and its 1x128 scales:
//   g, u = H[r, 2j], H[r, 2j+1];  σ = sigmoid(g);  act = g·σ;  A = act·u;  s = scores[row_pair[r]]
//   (kClamped: the clamped SwiGLU's A and derivatives, fp8_swiglu_math.cuh)
//   d_scores[row_pair[r]] = Σ_j dA'[r, j]·A[r, j]
//   dH[r, 2j]   = s·dA'·u·σ·(1 + g·(1 − σ)),  dH[r, 2j+1] = s·dA'·act     (bf16)
//   A'[r, j]    = s·A                                                     (bf16, dW2's operand)
// All in fp32 from the bf16 dA' and the exact E4M3 values (fp8_swiglu_math.cuh). One warp per
// row; lane l takes groups of four j (8 bytes of dA', 8 of H, one scale: the group's eight H
// columns lie in one 128-column tile); the d score's sum is the warp's, in a fixed order:
// deterministic.
// Optionally (dh_q given) dH is also quantised along its rows, 1x128 tiles, from the bf16 values
// written (bitwise what fp8_quantize_rows of dH gives): in an iteration the warp's 32 groups are
// 256 columns, two tiles, one per half-warp, whose amax is a 16-lane shuffle reduction.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/layer/fp8_swiglu_math.cuh"
#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels {

struct Fp8SwigluBackwardParams {
  const __nv_bfloat16* da;  // [R, n] dA'
  const uint8_t* hq;        // [R, 2n] E4M3, gate j at column 2j, up j at 2j+1
  const float* h_scales;    // [R, h_tiles], h_tiles = ceil(2n / 128)
  const float* scores;      // [pairs] fp32, the list's scores
  const int32_t* row_pair;  // [R] row -> pair
  int64_t R;
  int n, h_tiles;
  __nv_bfloat16* dh;        // [R, 2n]
  __nv_bfloat16* a_prime;   // [R, n]
  float* d_scores;          // [pairs], written at row_pair[r]
  uint8_t* dh_q;            // [R, 2n] E4M3 of dH, or null (not quantised)
  float* dh_scales;         // [R, h_tiles] with dh_q
  GluClampLimits clamp;     // kClamped: the clamped SwiGLU's parameters
};

template <int kWarps, bool kClamped>
__global__ void __launch_bounds__(kWarps * 32) fp8_swiglu_backward(const Fp8SwigluBackwardParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int groups = p.n / 4;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < p.R; r += warps) {
    const int32_t pair = p.row_pair[r];
    const float s = p.scores[pair];
    const __nv_bfloat16* da_row = p.da + r * p.n;
    const uint8_t* h_row = p.hq + r * 2 * p.n;
    const float* sc_row = p.h_scales + r * p.h_tiles;
    float dot = 0.f;
    // Every lane runs every iteration (the dH quantisation's shuffles need the whole warp); lanes
    // past the row's groups hold zeros, which leave a tile's amax as it is.
    for (int c0 = 0; c0 < groups; c0 += 32) {
      const int c = c0 + lane;
      const bool in_row = c < groups;
      uint4 dh8 = make_uint4(0, 0, 0, 0);  // this group's eight dH columns, bf16
      if (in_row) {
        const uint2 da4 = *reinterpret_cast<const uint2*>(da_row + 4 * c);
        const uint2 h8 = *reinterpret_cast<const uint2*>(h_row + 8 * c);
        const float hs = sc_row[(8 * c) / 128];
        const SwigluGroup gr = swiglu_backward_group<kClamped>(da4, h8, hs, s, dot, p.clamp);
        dh8 = gr.dh8;
        *reinterpret_cast<uint4*>(p.dh + r * 2 * p.n + 8 * c) = dh8;
        *reinterpret_cast<uint2*>(p.a_prime + r * p.n + 4 * c) = gr.a4;
      }
      if (p.dh_q != nullptr) {  // (uniform over the grid)
        const fp8::TileScale t = fp8::tile_scale(fp8::group_max_bits<16>(fp8::abs_max_bits8(dh8)));
        if (in_row) {
          *reinterpret_cast<uint2*>(p.dh_q + r * 2 * p.n + 8 * c) = fp8::quantize8(dh8, t);
          if (lane % 16 == 0) p.dh_scales[r * p.h_tiles + (8 * c) / 128] = t.s;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) p.d_scores[pair] = dot;
  }
}

}  // namespace machmoe::kernels
