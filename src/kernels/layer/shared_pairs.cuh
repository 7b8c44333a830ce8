// Shared experts in the routed launch (host/layer/shared_pairs.cu): the layer's list of pairs is
// each token's K routed pairs followed by its S shared pairs, so one routing metadata, one set of
// expert GEMMs and one aggregation serve both kinds of expert. Shapes: T tokens, K routed and S
// shared experts per token, E routed experts (the shared ones are experts E..E+S-1 of the weights).
//   append_shared_pairs  the router's top-K [T, K] -> the list [T, K+S] (forward)
//   split_shared_pairs   the list's d scores [T, K+S] -> the router's [T, K] and the shared
//                        experts' gate gradient [T] (backward)
//   shared_row_pieces    each shared expert's rows cut into m runs, as the segments of a
//                        weight-gradient GEMM (backward; see host/layer/shared_pairs.hpp)
//   sum_shared_pieces    the m runs' fp32 weight gradients summed into the expert's
// Templates only: a non-template __global__ in a header included by two TUs would clash at link.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace machmoe::kernels {

// The shared pairs' score from Qwen's gate logit x·g: sigmoid, in the accurate expf (the
// backward reads it back from the list as s and uses s·(1 - s)).
__device__ __forceinline__ float shared_gate_sigmoid(float logit) { return 1.f / (1.f + expf(-logit)); }

// list_scores / list_experts [T, K+S]: row t = the router's K pairs of token t (scores [T, K],
// experts [T, K]), then experts E..E+S-1 with score shared_scores[t] (fp32; its sigmoid when
// gate_logits: Qwen's gate, shared_scores then holding x·g) or 1 when shared_scores is null. One
// thread per list entry.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    append_shared_pairs(const float* scores, const int32_t* experts, const float* shared_scores, bool gate_logits,
                        int64_t T, int K, int S, int E, float* list_scores, int32_t* list_experts) {
  const int W = K + S;
  const int64_t total = T * W, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / W;
    const int k = static_cast<int>(i - t * W);
    if (k < K) {
      list_scores[i] = scores[t * K + k];
      list_experts[i] = experts[t * K + k];
    } else {
      const float v = shared_scores != nullptr ? shared_scores[t] : 1.f;
      list_scores[i] = gate_logits ? shared_gate_sigmoid(v) : v;
      list_experts[i] = E + (k - K);
    }
  }
}

// The inverse for the backward: the router's experts [T, K] and d scores [T, K] back out of the
// list's [T, K+S], and d_shared[t] = Σ_s d_list[t, K+s] (the gate is one value per token that
// weights all S shared pairs; summed in s order: deterministic), skipped when d_shared is null.
// With Qwen's gate (d_gate non-null): the shared pairs' score is s = sigmoid(x·g) (list_scores),
// and d_gate[t] = d_shared[t]·s·(1 - s) = ∂loss/∂(x[t]·g), in fp32 and in bf16 (d_gate_bf16).
// One thread per token.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    split_shared_pairs(const int32_t* list_experts, const float* list_d_scores, const float* list_scores, int64_t T,
                       int K, int S, int32_t* experts, float* d_scores, float* d_shared, float* d_gate,
                       __nv_bfloat16* d_gate_bf16) {
  const int W = K + S;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < T; t += stride) {
    const int64_t in = t * W, out = t * K;
    for (int k = 0; k < K; ++k) {
      experts[out + k] = list_experts[in + k];
      d_scores[out + k] = list_d_scores[in + k];
    }
    if (d_shared != nullptr || d_gate != nullptr) {
      float sum = 0.f;
      for (int s = 0; s < S; ++s) sum += list_d_scores[in + K + s];
      if (d_shared != nullptr) d_shared[t] = sum;
      if (d_gate != nullptr) {
        const float g = list_scores[in + K];  // the token's sigmoid(x·g), every shared pair's score
        const float dg = sum * (g * (1.f - g));
        d_gate[t] = dg;
        d_gate_bf16[t] = __float2bfloat16_rn(dg);
      }
    }
  }
}

// pieces [S·m + 1]: shared expert s's rows [off[E+s], off[E+s+1]) (expert_offsets [E+S+1]) cut
// into m consecutive runs of near-equal length; run j of expert s is segment s·m + j.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    shared_row_pieces(const int32_t* expert_offsets, int E, int S, int m, int32_t* pieces) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i > S * m) return;
  const int s = i / m, j = i - s * m;
  if (s == S) {  // the end of the last run
    pieces[i] = expert_offsets[E + S];
    return;
  }
  const int64_t begin = expert_offsets[E + s], rows = expert_offsets[E + s + 1] - begin;
  pieces[i] = static_cast<int32_t>(begin + rows * j / m);
}

// out[s] = Σ_j piece[s·m + j] for s < S (piece fp32 [S·m, count], out [S, count] in T = float or
// bf16), j in order: deterministic. One thread per output element.
template <int kThreads, typename T>
__global__ void __launch_bounds__(kThreads)
    sum_shared_pieces(const float* piece, int64_t count, int S, int m, T* out) {
  const int64_t total = count * S, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t s = i / count, k = i - s * count;
    const float* p = piece + s * m * count + k;
    float sum = 0.f;
    for (int j = 0; j < m; ++j) sum += p[j * count];
    out[i] = static_cast<T>(sum);
  }
}

}  // namespace machmoe::kernels
