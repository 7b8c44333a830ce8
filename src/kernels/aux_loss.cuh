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
  float local_total = 0.f;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float acc = 0.f;
    for (int b = 0; b < blocks; ++b) acc += partials[static_cast<int64_t>(b) * E + e];
    colsum[e] = acc;
    local_total += acc;
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
  float local = 0.f;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    local += colsum[e] * static_cast<float>(expert_offsets[e + 1] - expert_offsets[e]);
  const float weighted = block_sum(local);
  if (threadIdx.x == 0)
    *aux = (rows > 0 && s_total > 0.f) ? static_cast<float>(E) * weighted / (s_total * static_cast<float>(rows)) : 0.f;
}

}  // namespace machmoe::kernels
