// The W-way sum of a reduce-scatter's received blocks (the launcher and the rules are
// src/host/exchange/sum_blocks.cu and machmoe/sum_blocks.hpp): out = Σ_q parts[q], float32 in
// list order, rounded once. One pass: each block is read once and out written once, (W + 1)
// block-sizes of memory traffic, where a float32 buffer and one PyTorch add per block move
// 4W + 1 (bf16 parts).
//
// Work split: the blocks seen as runs of 16-byte units (8 bf16 or 4 float32), shared by a grid
// sized from the SM count in grid strides, kSumUnroll units per thread per step so that several
// loads of every block are in flight. The elements past the last whole unit (and every element
// when some address is not 16-byte aligned) go one at a time, with the same order of additions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace machmoe::kernels {

constexpr int kSumThreads = 256;
constexpr int kSumMaxBlocks = 64;  // the blocks' addresses travel in the kernel parameters
constexpr int kSumUnroll = 2;      // 16-byte units per thread per step

struct SumBlocksParams {
  const void* parts[kSumMaxBlocks];
  int32_t count;
  int64_t elems;
  int64_t units;  // whole 16-byte units handled vectorised (0 when an address is misaligned)
  void* out;
};

template <typename T>
struct SumUnit;

template <>
struct SumUnit<__nv_bfloat16> {
  static constexpr int kElems = 8;
  static __device__ __forceinline__ void add(float (&acc)[8], const uint4& v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += __uint_as_float(w[i] << 16);
      acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ uint4 round(const float (&acc)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ __forceinline__ float load(const void* p, int64_t i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
};

template <>
struct SumUnit<float> {
  static constexpr int kElems = 4;
  static __device__ __forceinline__ void add(float (&acc)[4], const uint4& v) {
    acc[0] += __uint_as_float(v.x), acc[1] += __uint_as_float(v.y);
    acc[2] += __uint_as_float(v.z), acc[3] += __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 round(const float (&acc)[4]) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  }
  static __device__ __forceinline__ float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
};

// acc starts at -0.0f, the identity of IEEE addition (-0 + x = x for every x, +0 and -0
// included): the first addition gives parts[0] exactly, as PyTorch's sum, which starts from it.
template <typename T>
__global__ void __launch_bounds__(kSumThreads) sum_blocks_kernel(const SumBlocksParams p) {
  using U = SumUnit<T>;
  const int64_t stride = int64_t{gridDim.x} * kSumThreads * kSumUnroll;
  // Vectorised: units [0, units).
  for (int64_t base = (int64_t{blockIdx.x} * kSumThreads) * kSumUnroll + threadIdx.x; base < p.units;
       base += stride) {
    float acc[kSumUnroll][U::kElems];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
      for (int e = 0; e < U::kElems; ++e) acc[u][e] = -0.f;
    for (int q = 0; q < p.count; ++q) {
      const uint4* part = static_cast<const uint4*>(p.parts[q]);
      uint4 v[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int64_t i = base + int64_t{u} * kSumThreads;
        v[u] = i < p.units ? part[i] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) U::add(acc[u], v[u]);
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const int64_t i = base + int64_t{u} * kSumThreads;
      if (i < p.units) static_cast<uint4*>(p.out)[i] = U::round(acc[u]);
    }
  }
  // One element at a time: those past the whole units.
  const int64_t first = p.units * U::kElems;
  for (int64_t i = first + int64_t{blockIdx.x} * kSumThreads + threadIdx.x; i < p.elems;
       i += int64_t{gridDim.x} * kSumThreads) {
    float acc = -0.f;
    for (int q = 0; q < p.count; ++q) acc += U::load(p.parts[q], i);
    U::store(p.out, i, acc);
  }
}

}  // namespace machmoe::kernels
