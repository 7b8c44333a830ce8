// The aux load-balancing loss (docs/LAYER.md), deterministically:
//   aux = E · Σ_e (Σ_t P[t,e] / Σ_{t,e} P) · (freq_e / Σ freq),  P = softmax(logits [T, E])
// 1. Partial sums of P per 64 tokens -> partials [blocks, E] (no atomics): the top-K router kernel
//    writes them in its own pass where it can (E <= 256), aux_colsum_partial otherwise (block b
//    sums P over its kTokens tokens, each thread owning experts and adding tokens in order).
// 2. aux_finalize: one block sums the partials per expert in a fixed shape (aux_column_sums),
//    then the weighted sum.
// The backward (kernels/layer/layer_backward.cuh) reuses aux_colsum_partial, aux_column_sums and
// aux_block_sum for ∂aux/∂logits.
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

// Sum of v over a block of kThreads in a fixed shape (deterministic), returned to every thread.
template <int kThreads>
__device__ __forceinline__ float aux_block_sum(float v, float* red /*[32]*/) {
  v = warp_sum(v);
  if (threadIdx.x % kWarpSize == 0) red[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = threadIdx.x < kThreads / kWarpSize ? red[threadIdx.x] : 0.f;
  if (threadIdx.x < kWarpSize) r = warp_sum(r);
  if (threadIdx.x == 0) red[0] = r;
  __syncthreads();
  r = red[0];
  __syncthreads();  // red may be reused by the next call
  return r;
}

// Column sums of the partials, for aux_finalize and the backward's coefficients (one block of
// kThreads): colsum[e] = C_e = Σ_b partials[b, e], and this thread's shares of S = Σ_e C_e and of
// Σ_e C_e · count_e (count_e = rows of expert e). The partials [blocks, E] (blocks = T / 64: 384 x
// 128 on 7B-a, 512 x 256 on 30B-a) usually come from DRAM, so the sums are bound by load latency.
// Deterministic: the order of every sum is fixed by E, blocks and kThreads.
//   E % 4 == 0 (E <= 4·kThreads): thread t owns the column quad q = t % (E/4) and the rows
//     b ≡ t / (E/4) (mod P), P = kThreads / (E/4): float4 loads along a row, eight in flight, then
//     a fixed tree over the P row phases through `scratch` [4·kThreads]: more bytes in flight per
//     lane than the scalar path below, which loads one float per lane and is latency-bound.
//   otherwise: up to 8 lanes per expert, each with 4 loads in flight, then a fixed shuffle tree.
template <int kThreads>
__device__ __forceinline__ void aux_column_sums(const float* partials, int blocks, int E, const int32_t* expert_offsets,
                                                float* colsum, float* scratch, float& local_total,
                                                float& local_weighted) {
  auto finish = [&](int e, float acc) {
    colsum[e] = acc;
    local_total += acc;
    local_weighted += acc * static_cast<float>(expert_offsets[e + 1] - expert_offsets[e]);
  };
  if (E % 4 == 0 && E <= 4 * kThreads) {
    const int quads = E / 4, phases = kThreads / quads;
    const int q = threadIdx.x % quads, r = threadIdx.x / quads;
    float4 acc[4] = {};
    if (r < phases) {
      const float4* col = reinterpret_cast<const float4*>(partials) + q;
      auto at = [&](int b) { return __ldg(col + static_cast<int64_t>(b) * quads); };
      // Batches of eight loads, predicated (not a serial remainder loop): 7B-a's 12 rows per
      // thread are two round trips to memory.
      for (int b = r; b < blocks; b += 8 * phases) {
        float4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          v[i] = b + i * phases < blocks ? at(b + i * phases) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[i & 3].x += v[i].x, acc[i & 3].y += v[i].y, acc[i & 3].z += v[i].z, acc[i & 3].w += v[i].w;
        }
      }
      float4 sum;
      sum.x = (acc[0].x + acc[1].x) + (acc[2].x + acc[3].x);
      sum.y = (acc[0].y + acc[1].y) + (acc[2].y + acc[3].y);
      sum.z = (acc[0].z + acc[1].z) + (acc[2].z + acc[3].z);
      sum.w = (acc[0].w + acc[1].w) + (acc[2].w + acc[3].w);
      reinterpret_cast<float4*>(scratch)[r * quads + q] = sum;  // scratch [phases][E]
    }
    // Pairwise over the phases (a fixed tree: phase i takes i + h for h = 2^k .. 1): with small E
    // there are up to 1024 phases, too many for one thread's serial sum.
    int h = 1;
    while (2 * h < phases) h *= 2;
    for (; h >= 1; h /= 2) {
      __syncthreads();
      for (int i = threadIdx.x; i < h * E; i += kThreads)
        if (i / E + h < phases) scratch[i] += scratch[i + h * E];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kThreads) finish(e, scratch[e]);
    __syncthreads();  // scratch may be reused by the caller
    return;
  }
  const int fit = kThreads / E;
  const int lanes = fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
  const int group = threadIdx.x / lanes, sub = threadIdx.x % lanes, groups = kThreads / lanes;
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
    if (sub == 0 && e < E) finish(e, acc);
  }
}

// A template (on its block size) like every kernel here: the header is included by layer.cu and
// layer_backward.cu, and a non-template __global__ in two translation units would clash at link.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    aux_finalize(const float* partials, int blocks, int E, const int32_t* expert_offsets, float* colsum, float* aux) {
  __shared__ float red[32];
  __shared__ float4 scratch[kThreads];
  float local_total = 0.f, local_weighted = 0.f;
  aux_column_sums<kThreads>(partials, blocks, E, expert_offsets, colsum, reinterpret_cast<float*>(scratch), local_total,
                            local_weighted);
  const float total = aux_block_sum<kThreads>(local_total, red);
  const int rows = expert_offsets[E];
  const float weighted = aux_block_sum<kThreads>(local_weighted, red);
  if (threadIdx.x == 0)
    *aux = (rows > 0 && total > 0.f) ? static_cast<float>(E) * weighted / (total * static_cast<float>(rows)) : 0.f;
}

}  // namespace machmoe::kernels
