// Shared experts in the routed launch: a layer with S shared experts (LayerProblem::num_shared)
// runs its experts on the list [T, K+S], each token's K routed pairs then its S shared pairs
// (experts E..E+S-1, score 1 or the token's shared_scores[t]). The router and its backward keep
// their [T, K] arrays; these two calls convert between the two (kernels/layer/shared_pairs.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace machmoe::detail {

// list_scores / list_experts [T, K+S] from the router's scores / experts [T, K]; shared_scores [T]
// fp32 or null (score 1).
void append_shared_pairs(const float* scores, const int32_t* experts, const float* shared_scores, int64_t T,
                         int64_t K, int64_t S, int64_t E, float* list_scores, int32_t* list_experts,
                         cudaStream_t stream);

// experts / d_scores [T, K] of the routed pairs out of the list's [T, K+S], and d_shared [T] = the
// sum of a token's S shared pairs' d scores (null: not written).
void split_shared_pairs(const int32_t* list_experts, const float* list_d_scores, int64_t T, int64_t K, int64_t S,
                        int32_t* experts, float* d_scores, float* d_shared, cudaStream_t stream);

}  // namespace machmoe::detail
