// The layer forward on the GPU, end to end on the caller's stream, no host synchronisation:
//   logits = x·Wrᵀ (cuBLAS, fp32 out) -> top-K router (or token rounding) -> the expert part
//   (experts.cpp: routing metadata -> up-projection (gathered rows, GLU/activation epilogue: H saved,
//   A scratch) -> down-projection (Y scratch) -> aggregation with scores); the aux loss runs between
//   the metadata and the up-projection.
// Buffers: host/layer/layer_layout.hpp. The backward is layer_backward.cu.
#include <string>

#include "host/common/check.hpp"
#include "host/layer/call_rules.hpp"
#include "host/layer/experts_internal.hpp"
#include "host/layer/layer_layout.hpp"
#include "host/layer/shared_pairs.hpp"
#include "host/routing/routing_internal.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::check_cuda;
using detail::check_launch;
using detail::LayerLayout;
using detail::at;
using detail::require_arg;


void layer_forward(const ValidLayerProblem& valid, const LayerForwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "layer_forward";
  const LayerProblem& p = *valid;
  detail::require_gpu_problem(valid, fn);
  detail::require_given(fn, {{"router_weight", a.router_weight}, {"aux_loss", a.aux_loss}, {"saved", a.saved},
                             {"workspace", a.workspace}});
  if (p.precision == Precision::BF16)  // (with FP8 the copies in fp8_weights stand for them)
    detail::require_given(fn, {{"w1", a.w1}, {"w2", a.w2}}, "precision is BF16");
  // x and out have T rows: empty (and so possibly null, as an empty framework tensor is) when T = 0.
  if (p.T > 0) detail::require_given(fn, {{"x", a.x}, {"out", a.out}}, "T > 0");
  detail::require_given_exactly_when(p.has_bias, "has_bias", fn, {{"b1", a.b1}, {"b2", a.b2}});
  require_arg(a.selection_bias == nullptr || is_gate_routing(p.routing), fn, "selection_bias",
              "is only used with routing=sigmoid or sqrt_softplus");
  detail::require_given_exactly_when(p.has_router_bias, "has_router_bias", fn, {{"router_bias", a.router_bias}});
  // [T]: empty (and so possibly null) when T = 0.
  if (p.T > 0)
    detail::require_given_exactly_when(p.has_shared_scores, "has_shared_scores", fn,
                                       {{"shared_scores", a.shared_scores}});
  detail::require_given_exactly_when(p.has_shared_gate, "has_shared_gate", fn, {{"shared_gate", a.shared_gate}});
  detail::require_block_aligned(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  detail::require_row_aligned(fn, {{"x", a.x}, {"w1", a.w1}, {"w2", a.w2}, {"b2", a.b2}});
  detail::require_fp8_weights(p.precision, a.fp8_weights, true, fn);
  const LayerLayout L(valid);
  if (p.T == 0) {
    check_cuda(cudaMemsetAsync(a.aux_loss, 0, sizeof(float), stream), "layer_forward: memset aux");
    return;
  }
  void* s = a.saved;
  void* w = a.workspace;
  float* logits = at<float>(s, L.logits);
  float* scores = at<float>(s, L.scores);
  int32_t* experts = at<int32_t>(w, L.experts);  // workspace: the backward rebuilds it
  int32_t* expert_offsets = at<int32_t>(s, L.expert_offsets);
  const bool rounded = p.rounding != TokenRounding::None;
  const int64_t R = L.R;  // T·(K+S), or the rounded list's capacity (its length stays on the device)
  const bool shared = p.num_shared > 0;

  if (p.has_router_bias) detail::router_bias_broadcast(a.router_bias, p.T, p.E, logits, stream);
  detail::router_gemm(a.x, a.router_weight, logits, p.T, p.E, p.d, p.has_router_bias, at<void>(w, L.cublas),
                      LayerLayout::kCublasWorkspace, stream, fn);
  // The expert part runs on the list the router made: top-K (token = pair / K) or the rounded list
  // (capacity rows, invalid past its length); `scores`/`experts` hold the list's scores and experts.
  detail::ExpertsForwardRun r;
  r.shape = detail::experts_shape(p);
  r.list.expert = experts;
  r.list.scores = scores;
  r.list.pairs = R;
  float* aux_partials = at<float>(w, L.aux_partials);
  static_assert(LayerLayout::kAuxTokensPerBlock == detail::kRouterAuxTokens,
                "the router kernel's aux partial sums use the aux loss's token blocks");
  bool have_aux_partials = false;
  if (!rounded) {
    // With shared experts the router writes its own [T, K] arrays, and the list [T, K+S] appends
    // each token's S shared pairs to them.
    float* router_scores = shared ? at<float>(s, L.router_scores) : scores;
    int32_t* router_experts = shared ? at<int32_t>(w, L.router_experts) : experts;
    have_aux_partials = detail::topk_router_with_aux(logits, p.T, p.E, p.K, p.routing, p.renormalize,
                                                     router_options(p), a.selection_bias, router_scores,
                                                     router_experts, aux_partials, stream);
    if (shared) {
      // Qwen's gate: its logits x·g [T] by the router's GEMM with one row (a GEMV), their sigmoid
      // the shared pairs' score.
      const float* shared_scores = a.shared_scores;
      if (p.has_shared_gate) {
        float* gate_logits = at<float>(w, L.gate_logits);
        detail::router_gemm(a.x, a.shared_gate, gate_logits, p.T, 1, p.d, false, at<void>(w, L.cublas),
                            LayerLayout::kCublasWorkspace, stream, fn);
        shared_scores = gate_logits;
      }
      detail::append_shared_pairs(router_scores, router_experts, shared_scores, p.has_shared_gate, p.T, p.K,
                                  p.num_shared, p.E, scores, experts, stream);
    }
    r.list.K = p.K + p.num_shared;
  } else {
    TokenRoundingOutputs tr;
    tr.topk_scores = at<float>(s, L.topk_scores);
    tr.topk_experts = at<int32_t>(s, L.topk_experts);
    tr.token = at<int32_t>(s, L.list_token);
    tr.expert = experts;
    tr.score = scores;
    tr.padded = at<uint8_t>(s, L.list_padded);
    tr.token_offsets = at<int32_t>(s, L.list_token_offsets);
    tr.count_topk = at<int32_t>(s, L.count_topk);
    tr.count_rounded = at<int32_t>(s, L.count_rounded);
    token_rounding(logits, p.T, p.E, p.K, p.rounding, p.rounding_tile_m, a.seed, tr, at<void>(w, L.rounding),
                   token_rounding_workspace_bytes(p.T, p.E, p.K), stream);
    r.list.token = tr.token;
  }
  r.x = a.x, r.w1 = a.w1, r.b1 = a.b1, r.w2 = a.w2, r.b2 = a.b2;
  r.out = a.out;
  r.h = a.write_h ? at<void>(s, L.h) : nullptr;  // inference: H is not written
  r.md.expert_offsets = expert_offsets;
  r.md.row_pair = at<int32_t>(s, L.row_pair);
  r.md.pair_row = at<int32_t>(s, L.pair_row);
  r.md.token_offsets = at<int32_t>(w, L.token_offsets);
  r.scratch = L.fwd;
  r.workspace = w;
  r.fp8 = a.fp8_weights;
  detail::experts_forward_metadata(r, stream);

  // The aux loss needs the partial sums and the expert counts only: it runs before the expert
  // GEMMs, while the partials (and the logits) are still in L2; run after the GEMMs, the same
  // single block read them back from DRAM and took 7.8 µs at the 7B-a configuration.
  detail::aux_loss_forward(logits, p.T, p.E, expert_offsets, have_aux_partials, aux_partials, at<float>(w, L.aux_colsum),
                           a.aux_loss, stream, fn);

  detail::experts_forward_gemms(r, stream);
}

}  // namespace machmoe
