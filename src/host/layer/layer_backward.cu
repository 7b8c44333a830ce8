// The layer backward on the GPU (docs/LAYER.md "Backward", docs/BACKWARD.md), end to end on the
// caller's stream, no host synchronisation, no float atomics (bitwise deterministic):
//   the expert part (experts_backward.cu: rebuild row_token / token_offsets -> dH kernel (dA' =
//   dout·W2 gathered; epilogue: dH, A' = s·A, dS partials) -> d scores (+ ⟨dout, b2⟩) -> dW2, dW1
//   (varlen-K GEMMs) -> db2, db1 -> dX~ = dH·W1 -> dx (aggregate)) and the router backward (top-K
//   or token rounding) + aux backward -> d_logits -> dWr = d_logitsᵀ·x (cuBLAS) (and with Qwen's
//   shared-expert gate g: ∂loss/∂(x·g) -> d_g = xᵀ·that, dx += that ⊗ g), run between d
//   scores and dW2 so that the dx aggregation adds the router's part d_logits·Wr itself (or, where
//   it cannot: d % 8 != 0 or E > 256, after the expert part, with dx += d_logits·Wr by cuBLAS).
// Reads only x, the weights and what layer_forward left in `saved`; scratch in the backward
// workspace (host/layer/layer_layout.hpp).
#include <algorithm>
#include <string>

#include "host/common/check.hpp"
#include "host/common/cublas_internal.hpp"
#include "host/layer/call_rules.hpp"
#include "host/layer/experts_internal.hpp"
#include "host/layer/layer_layout.hpp"
#include "host/layer/shared_pairs.hpp"
#include "host/routing/routing_internal.hpp"
#include "kernels/layer/layer_backward.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::at;
using detail::check_cublas;
using detail::check_cuda;
using detail::check_launch;
using detail::LayerLayout;

namespace {

constexpr int kThreads = detail::kBackwardThreads;
using detail::blocks_for;
using detail::cuda_type;

void check_args(const ValidLayerProblem& valid, const LayerBackwardArgs& a) {
  constexpr const char* fn = "layer_backward";
  const LayerProblem& p = *valid;
  detail::require_gpu_problem(valid, fn);
  detail::require_given(fn, {{"router_weight", a.router_weight}, {"saved", a.saved},
                             {"d_router_weight", a.d_router_weight}, {"dw1", a.dw1}, {"dw2", a.dw2},
                             {"workspace", a.workspace}});
  if (p.precision == Precision::BF16)  // (with FP8 the copies in fp8_weights stand for them)
    detail::require_given(fn, {{"w1", a.w1}, {"w2", a.w2}}, "precision is BF16");
  // x, dout and dx have T rows: empty (and so possibly null, as an empty framework tensor is) when T = 0.
  if (p.T > 0) detail::require_given(fn, {{"x", a.x}, {"dout", a.dout}, {"dx", a.dx}}, "T > 0");
  detail::require_given_exactly_when(p.has_bias, "has_bias", fn,
                                     {{"b1", a.b1}, {"b2", a.b2}, {"db1", a.db1}, {"db2", a.db2}});
  detail::require_given_exactly_when(p.has_router_bias, "has_router_bias", fn, {{"d_router_bias", a.d_router_bias}});
  // [T]: empty (and so possibly null) when T = 0.
  if (p.T > 0)
    detail::require_given_exactly_when(p.has_shared_scores, "has_shared_scores", fn,
                                       {{"d_shared_scores", a.d_shared_scores}});
  detail::require_given_exactly_when(p.has_shared_gate, "has_shared_gate", fn,
                                     {{"shared_gate", a.shared_gate}, {"d_shared_gate", a.d_shared_gate}});
  detail::require_weight_grad_dtype(a.weight_grad_dtype, fn);
  detail::require_fp8_weights(p.precision, a.fp8_weights, true, fn);
  detail::require_block_aligned(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  detail::require_row_aligned(fn, {{"x", a.x}, {"router_weight", a.router_weight}, {"w1", a.w1}, {"w2", a.w2},
                                   {"dout", a.dout}, {"dx", a.dx}, {"b2", a.b2}, {"shared_gate", a.shared_gate}});
}

}  // namespace

void layer_backward(const ValidLayerProblem& valid, const LayerBackwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "layer_backward";
  const LayerProblem& p = *valid;
  check_args(valid, a);
  const LayerLayout L(valid);
  const int64_t R = L.R;  // T·(K+S), or the rounded list's capacity
  const bool shared = p.num_shared > 0;
  const int64_t weight_E = weight_experts(p);  // routed + shared
  if (p.T == 0) {  // no token: every gradient is zero (dx is empty)
    check_cuda(cudaMemsetAsync(a.d_router_weight, 0, static_cast<size_t>(p.E * p.d * dtype_size(a.weight_grad_dtype)),
                               stream),
               "layer_backward: zero d_router_weight");
    if (p.has_router_bias)
      check_cuda(cudaMemsetAsync(a.d_router_bias, 0, static_cast<size_t>(p.E * dtype_size(a.weight_grad_dtype)), stream),
                 "layer_backward: zero d_router_bias");
    if (p.has_shared_gate)
      check_cuda(cudaMemsetAsync(a.d_shared_gate, 0, static_cast<size_t>(p.d * dtype_size(a.weight_grad_dtype)), stream),
                 "layer_backward: zero d_shared_gate");
    detail::zero_expert_gradients(detail::experts_shape(p), a.dw1, a.db1, a.dw2, a.db2, a.weight_grad_dtype, fn,
                                  stream);
    return;
  }
  const void* s = a.saved;
  void* w = a.workspace;
  const bool rounded = p.rounding != TokenRounding::None;
  const float* logits = at<float>(s, L.logits);
  const float* scores = at<float>(s, L.scores);  // [pairs] top-K scores or the rounded list's
  const int32_t* expert_offsets = at<int32_t>(s, L.expert_offsets);
  // Each pair's expert, rebuilt (not saved): the expert whose rows hold the pair's row.
  int32_t* experts = at<int32_t>(w, L.b_experts);
  kernels::bwd_pair_experts<kThreads><<<blocks_for(R, kThreads), kThreads, 0, stream>>>(
      at<int32_t>(s, L.pair_row), expert_offsets, static_cast<int>(weight_E), R, experts);
  check_launch("layer_backward: pair experts");
  float* d_scores = at<float>(w, L.d_scores);
  float* d_logits = at<float>(w, L.d_logits);
  auto* d_logits_bf16 = at<__nv_bfloat16>(w, L.d_logits_bf16);
  // Qwen's gate: ∂loss/∂(x·g) [T], fp32 (the dx aggregation's rank-1 term) and bf16 (cuBLAS's operand)
  float* d_gate_logits = p.has_shared_gate ? at<float>(w, L.d_gate_logits) : nullptr;
  auto* d_gate_logits_bf16 = p.has_shared_gate ? at<__nv_bfloat16>(w, L.d_gate_logits_bf16) : nullptr;

  // 1-3, 7-11. The expert part: d scores [pairs], dW2, dW1, db2, db1 and dx's expert part.
  detail::ExpertsBackwardRun r;
  r.shape = detail::experts_shape(p);
  r.list.expert = experts;
  r.list.token = rounded ? at<int32_t>(s, L.list_token) : nullptr;
  r.list.scores = scores;
  r.list.pairs = R;
  r.list.K = p.K + p.num_shared;
  r.shared = p.num_shared;
  r.x = a.x, r.w1 = a.w1, r.w2 = a.w2, r.b2 = a.b2, r.dout = a.dout;
  r.h = at<void>(s, L.h);
  r.expert_offsets = expert_offsets;
  r.row_pair = at<int32_t>(s, L.row_pair);
  r.pair_row = at<int32_t>(s, L.pair_row);
  // Pairs of token t: the rounded list's saved offsets, or t·K for top-K (rebuilt into scratch).
  r.token_offsets = rounded ? at<int32_t>(s, L.list_token_offsets) : nullptr;
  r.topk_token_offsets = rounded ? nullptr : at<int32_t>(w, L.b_token_offsets);
  r.scratch = L.bwd;
  r.workspace = w;
  r.d_scores = d_scores;
  r.dx = a.dx, r.dw1 = a.dw1, r.db1 = a.db1, r.dw2 = a.dw2, r.db2 = a.db2;
  r.grad_dtype = a.weight_grad_dtype;
  r.fp8 = a.fp8_weights;
  // 4-6, 12 (first half): the router backward, once d_scores exists. Where the dx aggregation can
  // add the router's part d_logits·Wr itself (d % 8 == 0, E <= 256: router_dx_fusable), this runs
  // inside the expert part, between d scores and the aggregation, and dx is written once;
  // otherwise after it, and a cuBLAS GEMM adds the router's part to dx.
  cublasHandle_t h = nullptr;
  const int T = static_cast<int>(p.T), d = static_cast<int>(p.d);
  // 6. bf16 copy of d_logits: the router GEMMs' operand (fp32 accumulation there). The top-K
  //    router backward and the aux step write it with d_logits; after the token-rounding backward,
  //    whose kernel writes fp32 only, this conversion pass makes it.
  auto to_bf16 = [&] {
    kernels::bwd_to_bf16<kThreads>
        <<<blocks_for(p.T * p.E, kThreads * 4), kThreads, 0, stream>>>(d_logits, p.T * p.E, d_logits_bf16);
    check_launch("layer_backward: d_logits to bf16");
  };
  auto router_backward = [&] {
    // 4. Router backward: d scores -> d_logits [T, E] fp32 (every element written), and for top-K
    //    its bf16 copy in the same pass (the aux step below rewrites both where it adds).
    if (!rounded) {
      // With shared experts: the router's [T, K] experts and d scores out of the list's [T, K+S],
      // and the shared pairs' d scores summed per token into d_shared_scores.
      const float* router_scores = scores;
      const int32_t* router_experts = experts;
      const float* router_d_scores = d_scores;
      if (shared) {
        int32_t* e = at<int32_t>(w, L.b_router_experts);
        float* ds = at<float>(w, L.b_router_d_scores);
        detail::SharedScoreGrads g;
        g.d_shared = a.d_shared_scores;
        if (p.has_shared_gate) g.d_gate = d_gate_logits, g.d_gate_bf16 = d_gate_logits_bf16;
        detail::split_shared_pairs(experts, d_scores, scores, p.T, p.K, p.num_shared, e, ds, g, stream);
        router_scores = at<float>(s, L.router_scores), router_experts = e, router_d_scores = ds;
      }
      detail::topk_router_backward_bf16(logits, router_scores, router_experts, router_d_scores, p.T, p.E, p.K,
                                        p.routing, p.renormalize, router_options(p), d_logits, d_logits_bf16,
                                        stream);
    } else {
      token_rounding_backward(logits, at<float>(s, L.topk_scores), at<int32_t>(s, L.topk_experts), r.token_offsets,
                              experts, at<uint8_t>(s, L.list_padded), d_scores, p.T, p.E, p.K, d_logits, stream);
    }
    // 5. Aux loss: d_logits += d_aux · ∂aux/∂logits. A host d_aux of 0 (and no device scalar) adds
    //    nothing, so the kernels are skipped.
    if (rounded) to_bf16();  // (before the aux loss's backward, which updates both copies)
    if (a.d_aux_device != nullptr || a.d_aux != 0.f)
      detail::aux_loss_backward(logits, p.T, p.E, expert_offsets, a.d_aux, a.d_aux_device,
                                at<float>(w, L.b_aux_partials), at<float>(w, L.aux_grad), d_logits, d_logits_bf16,
                                stream, fn);
    // 12a. The router bias's gradient Σ_t d_logits (fp32 d_logits, fixed order); the aux partials'
    //      block is free again here and holds its partial sums.
    if (p.has_router_bias)
      detail::router_bias_grad(d_logits, p.T, p.E, at<float>(w, L.b_aux_partials), a.d_router_bias,
                               a.weight_grad_dtype, stream);
    // 12. dWr (cuBLAS, bf16 operands, fp32 accumulation), column-major views of row-major arrays:
    //     dWrᵀ [d, E] = xᵀ [d, T] · d_logits [T, E].
    h = detail::cublas_on(stream, at<void>(w, L.b_cublas), LayerLayout::kCublasWorkspace, fn);
    detail::router_weight_gradient(h, a.x, d_logits_bf16, p.T, p.E, p.d, a.d_router_weight, a.weight_grad_dtype, fn);
    const float one = 1.f, zero = 0.f;
    // 12c. Qwen's gate: d_shared_gate [d] = xᵀ [d, T] · ∂loss/∂(x·g) [T] (bf16 operands as dWr's).
    if (p.has_shared_gate)
      check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, 1, T, &one, a.x, CUDA_R_16BF, d, d_gate_logits_bf16,
                                CUDA_R_16BF, T, &zero, a.d_shared_gate, cuda_type(a.weight_grad_dtype), d,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "layer_backward: d_shared_gate GEMM (cublasGemmEx)");
  };
  const bool fused_dx = detail::router_dx_fusable(L.R, p.d, p.E);
  if (fused_dx) {
    r.after_scores = router_backward;
    r.router_d_logits = d_logits_bf16;
    r.router_weight = a.router_weight;
    r.router_E = p.E;
    r.router_rank1_coef = d_gate_logits;  // null without the gate
    r.router_rank1_row = a.shared_gate;
  }
  detail::experts_backward_run(r, stream);
  if (fused_dx) return;
  router_backward();
  // 12 (second half). dx += d_logits · Wr.
  detail::router_input_gradient(h, a.router_weight, d_logits_bf16, p.T, p.E, p.d, a.dx, true, fn);
  const float one = 1.f;
  // Qwen's gate: dxᵀ [d, T] += g [d, 1] · ∂loss/∂(x·g)ᵀ [1, T].
  if (p.has_shared_gate)
    check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, T, 1, &one, a.shared_gate, CUDA_R_16BF, d,
                              d_gate_logits_bf16, CUDA_R_16BF, 1, &one, a.dx, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 "layer_backward: dx shared gate GEMM (cublasGemmEx)");
}

}  // namespace machmoe
