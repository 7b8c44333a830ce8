// The per-element math of the FP8 experts' SwiGLU backward (machmoe/fp8_swiglu.hpp states it), for
// one group of four j, plain or clamped (kClamped): the unfused kernel (fp8_swiglu_backward.cuh)
// and the fused one with the column operands (fp8_swiglu_columns.cuh) both call it, so that their
// dH, A' and d-score partial sums are bitwise the same (the same fp32 operations in the same order,
// the same roundings).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace machmoe::kernels {

// Two E4M3 codes (low byte first) times the tile's scale, in fp32 (E4M3 is exact in half).
__device__ __forceinline__ float2 fp8x2_value(uint32_t two_codes, float s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes), __NV_E4M3);
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return make_float2(v.x * s, v.y * s);
}

// One group: dA'[r, 4c .. 4c+4) (four bf16, da4), H[r, 8c .. 8c+8) (eight E4M3 codes, gate/up
// interleaved, h8) with its tile's scale hs, the row's score s. Returns the group's eight dH
// values (bf16, columns 8c .. 8c+8, in memory order) and its four A' values (bf16, a4); adds
// dA'·A to `dot` for j = 4c, 4c+1, 4c+2, 4c+3 in that order.
//   plain:   σ = sigmoid(g), A = g·σ·u;  dgate = s·dA'·u·σ·(1 + g·(1 − σ)),  dup = s·dA'·g·σ
//   clamped (c: kernels/common.cuh's GluClampLimits): A = f·uc;  dgate = s·dA'·uc·σ·(1 + alpha·gc·
//            (1 − σ)) where neither clamp of the gate binds (g <= gate_limit, gc·σ <= act_limit),
//            else 0;  dup = s·dA'·f where |u| <= up_limit, else 0 (torch.clamp's gradient, bounds
//            included, as the bf16 backward).
struct SwigluGroup {
  uint4 dh8;
  uint2 a4;
};
template <bool kClamped>
__device__ __forceinline__ SwigluGroup swiglu_backward_group(const uint2& da4, const uint2& h8, float hs, float s,
                                                             float& dot, const GluClampLimits& c) {
  const float2 d01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&da4.x));
  const float2 d23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&da4.y));
  const float da[4] = {d01.x, d01.y, d23.x, d23.y};
  const float2 gu[4] = {fp8x2_value(h8.x & 0xffffu, hs), fp8x2_value(h8.x >> 16, hs),
                        fp8x2_value(h8.y & 0xffffu, hs), fp8x2_value(h8.y >> 16, hs)};
  __nv_bfloat162 dh[4];
  float ap[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float g = gu[k].x, u = gu[k].y;
    if constexpr (kClamped) {
      const float gc = fminf(g, c.gate_limit);
      const float sig = sigmoid_approx(c.alpha * gc);
      const float f = fminf(gc * sig, c.act_limit);
      const float uc = fminf(fmaxf(u, -c.up_limit), c.up_limit) + c.up_offset;
      const float a = f * uc;
      dot += da[k] * a;
      const float sda = s * da[k];
      const bool gate_passes = g <= c.gate_limit && gc * sig <= c.act_limit;
      const bool up_passes = fabsf(u) <= c.up_limit;
      const float df = sig * (1.f + c.alpha * gc * (1.f - sig));
      dh[k] = __floats2bfloat162_rn(gate_passes ? sda * df * uc : 0.f, up_passes ? sda * f : 0.f);
      ap[k] = s * a;
    } else {
      const float sig = 1.f / (1.f + __expf(-g));
      const float act = g * sig, a = act * u;
      dot += da[k] * a;
      const float sda = s * da[k];
      dh[k] = __floats2bfloat162_rn(sda * u * sig * (1.f + g * (1.f - sig)), sda * act);
      ap[k] = s * a;
    }
  }
  SwigluGroup out;
  out.dh8 = *reinterpret_cast<const uint4*>(dh);
  const __nv_bfloat162 a01 = __floats2bfloat162_rn(ap[0], ap[1]), a23 = __floats2bfloat162_rn(ap[2], ap[3]);
  out.a4.x = *reinterpret_cast<const uint32_t*>(&a01);
  out.a4.y = *reinterpret_cast<const uint32_t*>(&a23);
  return out;
}

}  // namespace machmoe::kernels
