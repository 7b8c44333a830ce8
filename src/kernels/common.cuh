// Small device helpers shared by the kernel families: the fast sigmoid, the clamped SwiGLU's
// limits, ordered float keys, warp reductions, and 16-byte vector access of bf16/fp16/fp32 rows. Header-only, CUDA only (no PyTorch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace machmoe::kernels {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// 1 / (1 + e^-h) by ex2.approx.ftz and rcp.approx.ftz, two MUFU operations. __expf and
// __fdividef compile (without -ftz) to the same two plus a guard for the subnormal range: a
// compare and two predicated multiplies per element in the epilogues' SASS. With
// ftz, 2^x below 2^-126 becomes 0, where the sigmoid is 1 to fp32 precision anyway, and e^-h =
// inf gives 0, as it should.
__device__ __forceinline__ float sigmoid_approx(float h) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(h * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return r;
}

// The clamped SwiGLU's parameters as kernels take them (host/gemm/activation_params.hpp makes them
// from machmoe::GluClamp): its two variants as limits, +inf where a clamp is not applied, so that
// kernels have no branch. gc = min(g, gate_limit), σ = sigmoid(alpha·gc), f = min(gc·σ,
// act_limit), uc = clamp(u, ±up_limit) + up_offset, A = f·uc.
struct GluClampLimits {
  float alpha, gate_limit, act_limit, up_limit, up_offset;
};

// Maps a float to a uint32 whose unsigned order is the float order, with every NaN above +inf
// (LAYER.md: NaN counts as the largest logit, so it is selected and propagates). 0 is below the
// key of -inf, so 0 can mark "already taken".
__device__ __forceinline__ uint32_t ordered_key(float v) {
  if (v != v) return 0xffffffffu;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Selection key of (value, index): larger value first, then lower index. Packing both in 64 bits
// makes "the best candidate" a plain unsigned max, which is exact and order-independent.
__device__ __forceinline__ uint64_t selection_key(float v, int idx) {
  return (static_cast<uint64_t>(ordered_key(v)) << 32) | (0xffffffffu - static_cast<uint32_t>(idx));
}
__device__ __forceinline__ int key_index(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Exclusive block-wide prefix sum of one int per thread (blockDim.x a multiple of 32, <= 1024).
// Returns the exclusive prefix; *total receives the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* smem /*[32]*/, int* total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int incl = v;
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const int other = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += other;
  }
  if (lane == kWarpSize - 1) smem[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x / kWarpSize;
    int w = lane < nw ? smem[lane] : 0;
#pragma unroll
    for (int o = 1; o < kWarpSize; o <<= 1) {
      const int other = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += other;
    }
    if (lane < nw) smem[lane] = w;  // inclusive prefix of warp sums
  }
  __syncthreads();
  const int warp_base = warp > 0 ? smem[warp - 1] : 0;
  *total = smem[blockDim.x / kWarpSize - 1];
  __syncthreads();  // smem may be reused by the caller's next scan
  return warp_base + incl - v;
}

// The index of the calling warp across the grid: the kernels that give one warp to each token.
__device__ __forceinline__ int64_t global_warp_index() {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
}

// Softmax statistics of a row v[0..n) by one warp: max and Σ exp(v - max), both warp-uniform.
// softmax(v)_i = __expf(v_i - max) / sum.
struct SoftmaxStats {
  float max, sum;
};
__device__ __forceinline__ SoftmaxStats warp_softmax_stats(const float* v, int n, int lane) {
  float m = -INFINITY;
  for (int i = lane; i < n; i += kWarpSize) m = fmaxf(m, v[i]);
  m = warp_max(m);
  float s = 0.f;
  for (int i = lane; i < n; i += kWarpSize) s += __expf(v[i] - m);
  return {m, warp_sum(s)};
}

// Element type <-> float, for the dtypes rows and outputs may have.
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Two floats as a bf16 pair in one 32-bit word (lo at the lower address), each rounded to nearest
// even: the register form stmatrix takes.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A 16-byte vector of T: 8 bf16/fp16 or 4 fp32 elements, loaded and stored with one instruction.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
  union {
    uint4 raw;
    T elem[kElems];
  };
};

template <typename T>
__device__ __forceinline__ Vec16<T> load_vec16(const T* p) {
  Vec16<T> v;
  v.raw = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}

template <typename T>
__device__ __forceinline__ void store_vec16(T* p, const Vec16<T>& v) {
  *reinterpret_cast<uint4*>(p) = v.raw;
}

}  // namespace machmoe::kernels
