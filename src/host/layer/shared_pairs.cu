// Launchers of the shared experts' list kernels (kernels/layer/shared_pairs.cuh): the layer's
// routed top-K list extended by the S shared pairs of every token, and back.
#include <algorithm>

#include "host/layer/experts_internal.hpp"
#include "host/layer/shared_pairs.hpp"
#include "kernels/layer/shared_pairs.cuh"

namespace machmoe::detail {

void append_shared_pairs(const float* scores, const int32_t* experts, const float* shared_scores, bool gate_logits,
                         int64_t T, int64_t K, int64_t S, int64_t E, float* list_scores, int32_t* list_experts,
                         cudaStream_t stream) {
  if (T == 0) return;
  kernels::append_shared_pairs<kBackwardThreads>
      <<<blocks_for(T * (K + S), kBackwardThreads * 4), kBackwardThreads, 0, stream>>>(
          scores, experts, shared_scores, gate_logits, T, static_cast<int>(K), static_cast<int>(S),
          static_cast<int>(E), list_scores, list_experts);
  check_launch("layer_forward: shared experts' pairs");
}

void split_shared_pairs(const int32_t* list_experts, const float* list_d_scores, const float* list_scores,
                        int64_t T, int64_t K, int64_t S, int32_t* experts, float* d_scores,
                        const SharedScoreGrads& grads, cudaStream_t stream) {
  if (T == 0) return;
  kernels::split_shared_pairs<kBackwardThreads><<<blocks_for(T, kBackwardThreads), kBackwardThreads, 0, stream>>>(
      list_experts, list_d_scores, list_scores, T, static_cast<int>(K), static_cast<int>(S), experts, d_scores,
      grads.d_shared, grads.d_gate, grads.d_gate_bf16);
  check_launch("layer_backward: shared experts' pairs");
}

int64_t shared_wgrad_runs(int64_t T, int64_t S, int64_t M, int64_t N) {
  constexpr int64_t kTargetTiles = 256, kMinRunRows = 1024, kTile = 128;
  const int64_t tiles = std::max<int64_t>(S * ceil_div(M, kTile) * ceil_div(N, kTile), 1);
  return std::max<int64_t>(1, std::min(ceil_div(kTargetTiles, tiles), T / kMinRunRows));
}

SharedWgradScratch::SharedWgradScratch(int64_t T, int64_t S, int64_t d, int64_t n, int64_t n1) {
  if (S == 0) return;
  const int64_t m2 = shared_wgrad_runs(T, S, d, n), m1 = shared_wgrad_runs(T, S, d, n1);
  if (m1 == 1 && m2 == 1) return;
  offsets_bytes = static_cast<size_t>(S * std::max(m1, m2) + 1) * 4;
  pieces_bytes = static_cast<size_t>(std::max(S * m2 * n, S * m1 * n1) * d) * 4;
}

void shared_layer_wgrad(const GroupedWgradArgs& g, int64_t S, int64_t T, int32_t* run_offsets, float* pieces,
                        cudaStream_t stream) {
  const int64_t m = shared_wgrad_runs(T, S, g.M, g.N);
  if (S == 0 || m == 1) {
    grouped_gemm_wgrad(g, stream);
    return;
  }
  const int64_t E = g.E - S, count = g.M * g.N;
  GroupedWgradArgs routed = g;
  routed.E = E;
  grouped_gemm_wgrad(routed, stream);
  kernels::shared_row_pieces<kBackwardThreads><<<blocks_for(S * m + 1, kBackwardThreads), kBackwardThreads, 0, stream>>>(
      g.expert_offsets, static_cast<int>(E), static_cast<int>(S), static_cast<int>(m), run_offsets);
  check_launch("layer_backward: shared experts' row runs");
  GroupedWgradArgs runs = g;
  runs.expert_offsets = run_offsets;
  runs.E = S * m;
  runs.c = pieces;
  runs.c_dtype = DType::FP32;
  grouped_gemm_wgrad(runs, stream);
  const unsigned blocks = blocks_for(S * count, kBackwardThreads * 8);
  void* out = static_cast<char*>(g.c) + E * count * dtype_size(g.c_dtype);
  if (g.c_dtype == DType::FP32) {
    kernels::sum_shared_pieces<kBackwardThreads, float><<<blocks, kBackwardThreads, 0, stream>>>(
        pieces, count, static_cast<int>(S), static_cast<int>(m), static_cast<float*>(out));
  } else {
    kernels::sum_shared_pieces<kBackwardThreads, __nv_bfloat16><<<blocks, kBackwardThreads, 0, stream>>>(
        pieces, count, static_cast<int>(S), static_cast<int>(m), static_cast<__nv_bfloat16*>(out));
  }
  check_launch("layer_backward: shared experts' weight gradients");
}

}  // namespace machmoe::detail
