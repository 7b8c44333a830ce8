// Launchers of the shared experts' list kernels (kernels/layer/shared_pairs.cuh): the layer's
// routed top-K list extended by the S shared pairs of every token, and back.
#include "host/layer/experts_internal.hpp"
#include "host/layer/shared_pairs.hpp"
#include "kernels/layer/shared_pairs.cuh"

namespace machmoe::detail {

void append_shared_pairs(const float* scores, const int32_t* experts, const float* shared_scores, int64_t T,
                         int64_t K, int64_t S, int64_t E, float* list_scores, int32_t* list_experts,
                         cudaStream_t stream) {
  if (T == 0) return;
  kernels::append_shared_pairs<kBackwardThreads>
      <<<blocks_for(T * (K + S), kBackwardThreads * 4), kBackwardThreads, 0, stream>>>(
          scores, experts, shared_scores, T, static_cast<int>(K), static_cast<int>(S), static_cast<int>(E),
          list_scores, list_experts);
  check_launch("layer_forward: shared experts' pairs");
}

void split_shared_pairs(const int32_t* list_experts, const float* list_d_scores, int64_t T, int64_t K, int64_t S,
                        int32_t* experts, float* d_scores, float* d_shared, cudaStream_t stream) {
  if (T == 0) return;
  kernels::split_shared_pairs<kBackwardThreads><<<blocks_for(T, kBackwardThreads), kBackwardThreads, 0, stream>>>(
      list_experts, list_d_scores, T, static_cast<int>(K), static_cast<int>(S), experts, d_scores, d_shared);
  check_launch("layer_backward: shared experts' pairs");
}

}  // namespace machmoe::detail
