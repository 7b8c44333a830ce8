// Shared experts in the routed launch: a layer with S shared experts (LayerProblem::num_shared)
// runs its experts on the list [T, K+S], each token's K routed pairs then its S shared pairs
// (experts E..E+S-1, score 1 or the token's shared_scores[t]). The router and its backward keep
// their [T, K] arrays; these two calls convert between the two (kernels/layer/shared_pairs.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// list_scores / list_experts [T, K+S] from the router's scores / experts [T, K]; shared_scores [T]
// fp32 or null (score 1); gate_logits: shared_scores holds x·g and the score is its sigmoid.
void append_shared_pairs(const float* scores, const int32_t* experts, const float* shared_scores, bool gate_logits,
                         int64_t T, int64_t K, int64_t S, int64_t E, float* list_scores, int32_t* list_experts,
                         cudaStream_t stream);

// What split_shared_pairs writes besides the router's arrays; null members are not written.
struct SharedScoreGrads {
  float* d_shared = nullptr;            // [T] Σ_s of the token's shared pairs' d scores
  float* d_gate = nullptr;              // [T] ∂loss/∂(x·g) with Qwen's gate (needs list_scores)
  __nv_bfloat16* d_gate_bf16 = nullptr;  // [T] the same in bf16, with d_gate
};

// experts / d_scores [T, K] of the routed pairs out of the list's [T, K+S], and the shared pairs'
// score gradients (SharedScoreGrads; list_scores [T, K+S] is read for the gate's).
void split_shared_pairs(const int32_t* list_experts, const float* list_d_scores, const float* list_scores,
                        int64_t T, int64_t K, int64_t S, int32_t* experts, float* d_scores,
                        const SharedScoreGrads& grads, cudaStream_t stream);

// Runs m per shared expert in a weight-gradient GEMM of output [M, N] per expert. A shared
// expert has all T rows in only ceil(M/128)·ceil(N/128) output tiles: at small M, N fewer than the
// SMs, and 16 times as deep as a routed expert's at K = 8 of E = 128, so they would run alone at
// the end of the launch. Cut into m runs (of >= 1024 rows) the expert has m times as many tiles,
// up to 256 for its S experts: about two waves of a 132-SM Hopper part (a part with more SMs
// ends its last wave early, one with fewer runs a third). 1: no cut.
int64_t shared_wgrad_runs(int64_t T, int64_t S, int64_t M, int64_t N);

// Scratch of the cut weight gradients, for the layer's dW2 (M = d, N = n) and dW1 (M = d, N = n1):
// the runs' row offsets [S·m + 1] int32 and their fp32 gradients [S·m, M, N]; 0 bytes when neither
// GEMM is cut.
struct SharedWgradScratch {
  size_t offsets_bytes = 0, pieces_bytes = 0;
  SharedWgradScratch(int64_t T, int64_t S, int64_t d, int64_t n, int64_t n1);
};

// The weight-gradient GEMM `g` of a layer whose last S experts (of g.E = E + S) are shared, with
// T rows each: the routed experts' as one launch into g.c's first E experts, then each shared
// expert as m runs (shared_wgrad_runs) into the fp32 scratch `pieces`, summed per expert in run
// order into g.c's last S experts (deterministic). With m = 1, g as it is.
void shared_layer_wgrad(const GroupedWgradArgs& g, int64_t S, int64_t T, int32_t* run_offsets, float* pieces,
                        cudaStream_t stream);

}  // namespace machmoe::detail
