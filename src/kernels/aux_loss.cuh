// The aux load-balancing loss (docs/LAYER.md), deterministically:
//   aux = E · Σ_e (Σ_t P[t,e] / Σ_{t,e} P) · (freq_e / Σ freq),  P = softmax(logits [T, E])
// 1. aux_colsum_partial: block b sums P over its kTokens tokens for every expert, each thread
//    owning experts and adding tokens in order -> partials [blocks, E] (no atomics).
// 2. aux_finalize: one block adds the partials in block order, then the weighted sum.
// The backward (kernels/layer_backward.cuh) reuses step 1 for ∂aux/∂logits.
#pragma once

#include "kernels/common.cuh"

namespace machmoe::kernels {

template <int kTokens>
__global__ void __launch_bounds__(256) aux_colsum_partial(const float* logits, int64_t T, int E, float* partials) {
  __shared__ float row_max[kTokens], row_inv_sum[kTokens];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokens;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int i = warp; i < kTokens; i += blockDim.x / kWarpSize) {  // one warp per token: max, Σ exp
    const int64_t t = t0 + i;
    const SoftmaxStats st = t < T ? warp_softmax_stats(logits + t * E, E, lane) : SoftmaxStats{0.f, 0.f};
    if (lane == 0) {
      row_max[i] = st.max;
      row_inv_sum[i] = t < T ? 1.f / st.sum : 0.f;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < kTokens && t0 + i < T; ++i)
      acc += __expf(logits[(t0 + i) * E + e] - row_max[i]) * row_inv_sum[i];
    partials[static_cast<int64_t>(blockIdx.x) * E + e] = acc;
  }
}

// A template (on its block size) like every kernel here: the header is included by layer.cu and
// layer_backward.cu, and a non-template __global__ in two translation units would clash at link.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) aux_finalize(const float* partials, int blocks, int E,
                                                         const int32_t* expert_offsets, float* colsum, float* aux) {
  __shared__ float red[32];
  __shared__ float s_total;
  // The partials were written long before (the router kernel writes them before the expert GEMMs
  // evict them from L2), so the sums are bound by load latency: up to 8 lanes per expert, each
  // with 4 loads in flight, then a fixed shuffle tree (deterministic for a given E and block).
  const int fit = kThreads / E;
  const int lanes = fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
  const int group = threadIdx.x / lanes, sub = threadIdx.x % lanes, groups = kThreads / lanes;
  float local_total = 0.f, local_weighted = 0.f;
  for (int e0 = 0; e0 < E; e0 += groups) {  // uniform trip count: the shuffles below need every lane
    const int e = e0 + group;
    float acc = 0.f;
    if (e < E) {
      const float* col = partials + e;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      int b = sub;
      for (; b + 3 * lanes < blocks; b += 4 * lanes) {
        a0 += col[static_cast<int64_t>(b) * E];
        a1 += col[static_cast<int64_t>(b + lanes) * E];
        a2 += col[static_cast<int64_t>(b + 2 * lanes) * E];
        a3 += col[static_cast<int64_t>(b + 3 * lanes) * E];
      }
      for (; b < blocks; b += lanes) a0 += col[static_cast<int64_t>(b) * E];
      acc = (a0 + a1) + (a2 + a3);
    }
    for (int o = lanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(kFullMask, acc, o);
    if (sub == 0 && e < E) {
      colsum[e] = acc;
      local_total += acc;
      local_weighted += acc * static_cast<float>(expert_offsets[e + 1] - expert_offsets[e]);
    }
  }
  // Fixed-shape block reduction: deterministic for a given E and block size.
  auto block_sum = [&](float v) {
    v = warp_sum(v);
    if (threadIdx.x % kWarpSize == 0) red[threadIdx.x / kWarpSize] = v;
    __syncthreads();
    float r = 0.f;
    if (threadIdx.x < kWarpSize) {
      r = threadIdx.x < blockDim.x / kWarpSize ? red[threadIdx.x] : 0.f;
      r = warp_sum(r);
    }
    __syncthreads();
    return r;  // valid in warp 0
  };
  const float total = block_sum(local_total);
  if (threadIdx.x == 0) s_total = total;
  __syncthreads();
  const int rows = expert_offsets[E];
  const float weighted = block_sum(local_weighted);
  if (threadIdx.x == 0)
    *aux = (rows > 0 && s_total > 0.f) ? static_cast<float>(E) * weighted / (s_total * static_cast<float>(rows)) : 0.f;
}

}  // namespace machmoe::kernels
