// Device helpers shared by the FP8 (E4M3) quantisation kernels (rows.cuh, columns.cuh,
// weights.cuh): the tile amax on bf16 bit patterns, the tile scale, the quantisation of eight bf16
// values, and the lane-pair exchange that turns two 8-byte halves into one 16-byte store.
// Header-only, no kernels here (each family has its own file and launcher).
//
// The recipe (DeepSeek-V3's; docs in include/machmoe/fp8.hpp): one fp32 scale per tile,
//   amax = max |x| over the tile's real elements (exact: bf16 -> fp32 is exact),
//   s    = max(amax / 448, 2^-126) (fp32, round to nearest; floored at the smallest normal fp32
//          so that 1/s is finite: a tile with amax below 448·2^-126 ≈ 5e-36 uses less of E4M3's
//          range), q = E4M3(x · (1/s)) (1/s rounded to fp32 once per tile, then an fp32 product;
//          RNE, satfinite: a division per element would be the kernels' largest cost),
// amax = 0: s = 1 (all codes ±0); a NaN or ±Inf in the tile: s = NaN (bits 0x7fc00000) and
// every real element's code 0x7f (E4M3's NaN), so that the tile can never dequantise to a finite
// value (propagate, never hide). The CPU reference (src/reference/fp8.cpp) computes bitwise the same.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace machmoe::kernels::fp8 {

constexpr int kTile = 128;                       // elements per scale along the reduction dim
constexpr float kE4M3Max = 448.f;                // largest finite E4M3
constexpr float kMinScale = 1.17549435e-38f;     // 2^-126, the smallest normal fp32: 1/s stays finite
constexpr uint32_t kBf16AbsMask2 = 0x7fff7fffu;  // |.| of two packed bf16
constexpr uint32_t kBf16InfBits = 0x7f80u;       // |bits| >= this: Inf or NaN
constexpr uint32_t kBf16NanBits = 0x7fc0u;       // a NaN: marks a row whose gather index is out of range
constexpr uint32_t kNanScaleBits = 0x7fc00000u;  // the scale of a non-finite tile (one fixed pattern,
                                                 // so that the GPU and the reference agree bitwise)
constexpr uint32_t kE4M3Nan4 = 0x7f7f7f7fu;      // four E4M3 NaN codes

// |x| of bf16 as its bit pattern orders like |x| as an unsigned integer, with every NaN above Inf
// above every finite value. So a plain unsigned max is the amax, exact and order-independent, and
// a NaN anywhere wins (fmaxf would drop it). v: 8 bf16 -> the largest |bits| (0..0x7fff).
__device__ __forceinline__ uint32_t abs_max_bits8(const uint4& v) {
  uint32_t m = __vmaxu2(v.x & kBf16AbsMask2, v.y & kBf16AbsMask2);
  m = __vmaxu2(m, v.z & kBf16AbsMask2);
  m = __vmaxu2(m, v.w & kBf16AbsMask2);
  return max(m & 0xffffu, m >> 16);
}

// Max over groups of `kWidth` consecutive lanes (kWidth a power of two <= 32); every lane of the
// group gets the group's max.
template <int kWidth>
__device__ __forceinline__ uint32_t group_max_bits(uint32_t v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

struct TileScale {
  float s;    // the fp32 scale written out
  bool bad;   // the tile holds a NaN or Inf: its codes are all 0x7f
  float inv;  // 1/s rounded to nearest (finite: s >= 2^-126): codes are E4M3(x · inv)
};

// The scale of a tile from its amax bit pattern (bf16 |bits|).
__device__ __forceinline__ TileScale tile_scale(uint32_t amax_bits) {
  if (amax_bits >= kBf16InfBits) return {__uint_as_float(kNanScaleBits), true, __uint_as_float(kNanScaleBits)};
  if (amax_bits == 0) return {1.f, false, 1.f};
  // IEEE division and reciprocal, round to nearest (the reference computes the same fp32 values).
  const float s = fmaxf(__fdiv_rn(__uint_as_float(amax_bits << 16), kE4M3Max), kMinScale);
  return {s, false, __frcp_rn(s)};
}

// Two packed bf16 (low half first) -> two E4M3 codes in the low 16 bits (low byte first).
// The tile's quotient x · (1/s), the product rounded to nearest (__fmul_rn: never contracted).
__device__ __forceinline__ float quotient(float x, const TileScale& t) { return __fmul_rn(x, t.inv); }

__device__ __forceinline__ uint32_t quantize2(uint32_t w, const TileScale& t) {
  const float lo = quotient(__uint_as_float(w << 16), t);
  const float hi = quotient(__uint_as_float(w & 0xffff0000u), t);
  // cvt.rn.satfinite.e4m3x2.f32: round to nearest even, |x| beyond 448 saturates to ±448.
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// Four packed bf16 (two words) -> four codes in one word, in memory order.
__device__ __forceinline__ uint32_t quantize4(uint32_t w0, uint32_t w1, const TileScale& t) {
  return quantize2(w0, t) | (quantize2(w1, t) << 16);
}

// Eight bf16 (16 bytes) -> eight E4M3 codes (8 bytes). A bad tile's codes are all NaN (0x7f),
// whatever the division gave.
__device__ __forceinline__ uint2 quantize8(const uint4& v, const TileScale& t) {
  uint2 q = make_uint2(quantize4(v.x, v.y, t), quantize4(v.z, v.w, t));
  if (t.bad) q = make_uint2(kE4M3Nan4, kE4M3Nan4);
  return q;
}

// Lanes 2k and 2k+1 each hold 8 output bytes of two load instructions, `a` and `b`, where in each
// instruction lane 2k's bytes come just before lane 2k+1's. One exchange of 8 bytes gives lane 2k
// the 16 bytes of `a` (its own, then its partner's) and lane 2k+1 the 16 bytes of `b` (its
// partner's, then its own): the loads stay whole-sector per instruction and the stores are 16
// bytes per lane. All 32 lanes must call it.
__device__ __forceinline__ uint4 pair_exchange(const uint2& a, const uint2& b, int lane) {
  const bool odd = lane & 1;
  const uint2 send = odd ? a : b;  // what the partner needs
  const uint32_t rx = __shfl_xor_sync(kFullMask, send.x, 1);
  const uint32_t ry = __shfl_xor_sync(kFullMask, send.y, 1);
  return odd ? make_uint4(rx, ry, b.x, b.y) : make_uint4(a.x, a.y, rx, ry);
}

// A 4 x 4 block of bytes turned: r_i byte j -> out_j byte i (r0 .. r3 the block's rows as words).
__device__ __forceinline__ uint4 transpose4x4_bytes(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  const uint32_t t0 = __byte_perm(r0, r1, 0x5140), t1 = __byte_perm(r0, r1, 0x7362);  // r0/r1 bytes 0,1 | 2,3
  const uint32_t t2 = __byte_perm(r2, r3, 0x5140), t3 = __byte_perm(r2, r3, 0x7362);
  return make_uint4(__byte_perm(t0, t2, 0x5410), __byte_perm(t0, t2, 0x7632), __byte_perm(t1, t3, 0x5410),
                    __byte_perm(t1, t3, 0x7632));
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ void store16(uint8_t* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

}  // namespace machmoe::kernels::fp8
