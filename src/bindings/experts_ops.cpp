// PyTorch ops over the experts on a general routing list (docs/OPS.md), one call per direction on
// the current stream: experts_forward returns the output and the `saved` block; experts_backward
// reads that block back, with the same list, and returns every gradient, the scores' included.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "bindings/common.hpp"
#include "host/layer/saved_layout.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

// The problem of an experts call from the tensors' shapes (x [T, d], w1 [E, n1, d], w2 [E, d, n]),
// the list's length R and the string options, validated: the one validation of the call. fp8:
// precision FP8 (the call was given the weights' FP8 copies).
ValidExpertsProblem experts_problem(const Tensor& x, const Tensor& w1, const Tensor& w2, bool has_bias, int64_t R,
                                    const std::string& activation, const std::string& layout,
                                    at::ArrayRef<double> glu_clamp, bool fp8 = false) {
  ExpertsProblem p = problem_from_tensors<ExpertsProblem>(x, w1, w2, has_bias, activation, layout, glu_clamp);
  p.R = R;
  if (fp8) p.precision = Precision::FP8;
  return validate(p);
}

// x and the expert weights and biases of problem p: bf16, contiguous, on x's device, shaped as
// docs/LAYER.md.
void check_expert_tensors(const ExpertsProblem& p, const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                          const Tensor& w2, const std::optional<Tensor>& b2) {
  const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  const at::Device device = x.device();
  check_bf16(x, "x", {p.T, p.d});
  check_bf16(w1, "w1", {p.E, n1, p.d}, &device);
  check_bf16(w2, "w2", {p.E, p.d, p.n}, &device);
  MACHMOE_CHECK_VALUE(b1.has_value() == b2.has_value(), "b1 and b2 must be given together or not at all");
  if (b1) {
    check_bf16(*b1, "b1", {p.E, n1}, &device);
    check_bf16(*b2, "b2", {p.E, p.d}, &device);
  }
}

// The checked problem of an experts call on the list (token_idx, expert_idx) [R]: x, the expert
// weights and biases, and the list's tensors, their shapes, dtypes and devices.
ValidExpertsProblem checked_list_problem(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                                         const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& token_idx,
                                         const Tensor& expert_idx, const std::string& activation,
                                         const std::string& layout, at::ArrayRef<double> glu_clamp,
                                         bool fp8 = false) {
  check_dims(token_idx, "token_idx", 1);
  const ValidExpertsProblem valid =
      experts_problem(x, w1, w2, b1.has_value(), token_idx.numel(), activation, layout, glu_clamp, fp8);
  const ExpertsProblem& p = *valid;
  check_expert_tensors(p, x, w1, b1, w2, b2);
  const at::Device device = x.device();
  check_tensor(token_idx, "token_idx", at::kInt, {p.R}, &device);
  check_tensor(expert_idx, "expert_idx", at::kInt, {p.R}, &device);
  return valid;
}

// The checked problem of an experts_forward call (or part): the list's, and its scores [R].
ValidExpertsProblem checked_forward_problem(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                                            const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& scores,
                                            const Tensor& token_idx, const Tensor& expert_idx,
                                            const std::string& activation, const std::string& layout,
                                            at::ArrayRef<double> glu_clamp, bool fp8 = false) {
  check_dims(scores, "scores", 1);
  const ValidExpertsProblem valid =
      checked_list_problem(x, w1, b1, w2, b2, token_idx, expert_idx, activation, layout, glu_clamp, fp8);
  const at::Device device = x.device();
  check_tensor(scores, "scores", at::kFloat, {valid->R}, &device);
  return valid;
}

// The arguments of an experts_forward call (or part) writing into out, saved and workspace.
ExpertsForwardArgs forward_args(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
                                const std::optional<Tensor>& b2, const Tensor& scores, const Tensor& token_idx,
                                const Tensor& expert_idx, const Tensor& out, const Tensor& saved,
                                const Tensor& workspace) {
  ExpertsForwardArgs a;
  a.x = x.data_ptr();
  a.w1 = w1.data_ptr();
  a.b1 = b1 ? b1->data_ptr() : nullptr;
  a.w2 = w2.data_ptr();
  a.b2 = b2 ? b2->data_ptr() : nullptr;
  a.scores = scores.data_ptr<float>();
  a.pair_token = token_idx.data_ptr<int32_t>();
  a.pair_expert = expert_idx.data_ptr<int32_t>();
  a.out = out.data_ptr();
  a.saved = saved.data_ptr();
  a.workspace = workspace.data_ptr();
  return a;
}

std::tuple<Tensor, Tensor> op_experts_forward(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                                              const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& scores,
                                              const Tensor& token_idx, const Tensor& expert_idx,
                                              const std::string& activation, const std::string& layout,
                                              at::ArrayRef<double> glu_clamp,
                                              std::optional<at::TensorList> fp8_weights) {
  return translate_errors([&] {
    const ValidExpertsProblem valid = checked_forward_problem(x, w1, b1, w2, b2, scores, token_idx, expert_idx,
                                                              activation, layout, glu_clamp, fp8_weights.has_value());
    const ExpertsProblem& p = *valid;
    const std::optional<Fp8ExpertWeights> fp8 = optional_fp8_weights(fp8_weights, p, x.device());
    const c10::cuda::CUDAGuard guard(x.device());
    const WorkspacePlan plan = plan_workspace(valid);
    const auto bytes = x.options().dtype(at::kByte);
    Tensor out = at::empty({p.T, p.d}, x.options());
    Tensor saved = at::empty({static_cast<int64_t>(plan.saved_bytes)}, bytes);
    Tensor ws = at::empty({static_cast<int64_t>(plan.forward_workspace_bytes)}, bytes);
    ExpertsForwardArgs a = forward_args(x, w1, b1, w2, b2, scores, token_idx, expert_idx, out, saved, ws);
    a.fp8_weights = fp8 ? &*fp8 : nullptr;
    experts_forward(valid, a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(out, saved);
  });
}

ExpertsForwardPart parse_forward_part(const std::string& part) {
  if (part == "early_rows") return ExpertsForwardPart::EarlyRows;
  if (part == "late_rows") return ExpertsForwardPart::LateRows;
  if (part == "early_out") return ExpertsForwardPart::EarlyOut;
  MACHMOE_CHECK_VALUE(false, "part must be 'early_rows', 'late_rows' or 'early_out', got '", part, "'");
  return ExpertsForwardPart::All;
}

// One part of an experts_forward call split into early tokens [0, early_tokens) and late ones
// (machmoe::ExpertsForwardPart): writes its rows of `out`, and `saved` and `workspace`
// (experts_workspace_bytes: saved, forward workspace), which the caller keeps between the parts.
// max_ctas bounds the GEMMs' persistent CTAs (0: one per SM). x_early: "early_rows" only, x's early
// rows [early_tokens, d] apart (read instead of x's first rows).
void op_experts_forward_part(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
                             const std::optional<Tensor>& b2, const Tensor& scores, const Tensor& token_idx,
                             const Tensor& expert_idx, const Tensor& out, const Tensor& saved,
                             const Tensor& workspace, const std::string& part, int64_t early_tokens,
                             const std::string& activation, const std::string& layout,
                             at::ArrayRef<double> glu_clamp, int64_t max_ctas,
                             const std::optional<Tensor>& x_early) {
  translate_errors([&] {
    const ValidExpertsProblem valid = checked_forward_problem(x, w1, b1, w2, b2, scores, token_idx, expert_idx,
                                                              activation, layout, glu_clamp);
    const ExpertsProblem& p = *valid;
    const at::Device device = x.device();
    check_bf16(out, "out", {p.T, p.d}, &device);
    const WorkspacePlan plan = plan_workspace(valid);
    check_tensor(saved, "saved", at::kByte, {static_cast<int64_t>(plan.saved_bytes)}, &device);
    check_tensor(workspace, "workspace", at::kByte, {static_cast<int64_t>(plan.forward_workspace_bytes)}, &device);
    const c10::cuda::CUDAGuard guard(x.device());
    ExpertsForwardArgs a = forward_args(x, w1, b1, w2, b2, scores, token_idx, expert_idx, out, saved, workspace);
    a.part = parse_forward_part(part);
    a.early_tokens = early_tokens;
    a.max_ctas = static_cast<int>(std::clamp<int64_t>(max_ctas, -1, int64_t{1} << 30));
    if (x_early) {
      MACHMOE_CHECK_VALUE(early_tokens >= 0 && early_tokens <= p.T, "early_tokens must be in [0, T = ", p.T,
                          "]; got ", early_tokens);
      check_bf16(*x_early, "x_early", {early_tokens, p.d}, &device);
      a.x_early = x_early->data_ptr();
    }
    experts_forward(valid, a, at::cuda::getCurrentCUDAStream());
  });
}

using Grads = std::tuple<Tensor, Tensor, std::optional<Tensor>, Tensor, std::optional<Tensor>, Tensor>;

// The tensors of one experts_backward call (or part of one); those of a part not computed stay
// undefined. `workspace` is given to the weight part (the data part's), allocated otherwise.
struct BackwardTensors {
  Tensor dx, dw1, dw2, d_scores, workspace;
  Tensor dout_early;  // given by a split call's early part, or undefined
  std::optional<Tensor> db1, db2;
};

BackwardTensors run_experts_backward(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                                     const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& token_idx,
                                     const Tensor& expert_idx, const Tensor& saved, const Tensor& dout,
                                     const std::string& activation, const std::string& layout,
                                     at::ArrayRef<double> glu_clamp, ExpertsBackwardPart part,
                                     const Tensor* workspace, int64_t weights_max_ctas,
                                     const BackwardTensors* given = nullptr, int64_t early_tokens = 0,
                                     const std::optional<at::TensorList>& fp8_weights = std::nullopt) {
  const ValidExpertsProblem valid = checked_list_problem(x, w1, b1, w2, b2, token_idx, expert_idx, activation, layout,
                                                         glu_clamp, fp8_weights.has_value());
  const ExpertsProblem& p = *valid;
  const at::Device device = x.device();
  const std::optional<Fp8ExpertWeights> fp8 = optional_fp8_weights(fp8_weights, p, device);
  check_bf16(dout, "dout", {p.T, p.d}, &device);
  const WorkspacePlan plan = plan_workspace(valid);
  check_saved(saved, plan.saved_bytes, x.device(), "experts_forward");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  const bool data = part != ExpertsBackwardPart::WeightGradients;
  const bool weights = part == ExpertsBackwardPart::All || part == ExpertsBackwardPart::WeightGradients;
  BackwardTensors t;
  if (data && given) {  // a part of a split call: the caller's dx and d_scores
    check_bf16(given->dx, "dx", {p.T, p.d}, &device);
    check_tensor(given->d_scores, "d_scores", at::kFloat, {p.R}, &device);
    t.dx = given->dx;
    t.d_scores = given->d_scores;
  } else if (data) {
    t.dx = at::empty({p.T, p.d}, x.options());
    t.d_scores = at::empty({p.R}, x.options().dtype(at::kFloat));
  }
  if (weights) {
    t.dw1 = at::empty({p.E, n1, p.d}, x.options());
    t.dw2 = at::empty({p.E, p.d, p.n}, x.options());
    if (p.has_bias) {
      t.db1 = at::empty({p.E, n1}, x.options());
      t.db2 = at::empty({p.E, p.d}, x.options());
    }
  }
  const auto ws_bytes = static_cast<int64_t>(plan.backward_workspace_bytes);
  if (workspace) {
    check_tensor(*workspace, "workspace", at::kByte, {ws_bytes}, &device);
    t.workspace = *workspace;
  } else {
    t.workspace = at::empty({ws_bytes}, x.options().dtype(at::kByte));
  }
  ExpertsBackwardArgs a;
  a.x = x.data_ptr();
  a.w1 = w1.data_ptr();
  a.b1 = b1 ? b1->data_ptr() : nullptr;
  a.w2 = w2.data_ptr();
  a.b2 = b2 ? b2->data_ptr() : nullptr;
  a.pair_token = token_idx.data_ptr<int32_t>();
  a.pair_expert = expert_idx.data_ptr<int32_t>();
  a.saved = saved.data_ptr();
  a.dout = dout.data_ptr();
  a.dx = data ? t.dx.data_ptr() : nullptr;
  a.d_scores = data ? t.d_scores.data_ptr<float>() : nullptr;
  a.dw1 = weights ? t.dw1.data_ptr() : nullptr;
  a.dw2 = weights ? t.dw2.data_ptr() : nullptr;
  a.db1 = t.db1 ? t.db1->data_ptr() : nullptr;
  a.db2 = t.db2 ? t.db2->data_ptr() : nullptr;
  a.workspace = t.workspace.data_ptr();
  a.weight_grad_dtype = DType::BF16;
  a.part = part;
  // (experts_backward refuses a negative bound by name; past an int, the bound is no bound)
  a.weights_max_ctas = static_cast<int>(std::clamp<int64_t>(weights_max_ctas, -1, int64_t{1} << 30));
  a.early_tokens = early_tokens;
  a.dout_early = given && given->dout_early.defined() ? given->dout_early.data_ptr() : nullptr;
  a.fp8_weights = fp8 ? &*fp8 : nullptr;
  experts_backward(valid, a, at::cuda::getCurrentCUDAStream());
  return t;
}

// Gradients of experts_forward from its `saved` block and the same list and options; weight and
// bias gradients in the weights' dtype (bf16), d_scores fp32 [R] in the list's pair order.
Grads op_experts_backward(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
                          const std::optional<Tensor>& b2, const Tensor& token_idx, const Tensor& expert_idx,
                          const Tensor& saved, const Tensor& dout, const std::string& activation,
                          const std::string& layout, at::ArrayRef<double> glu_clamp,
                          std::optional<at::TensorList> fp8_weights) {
  return translate_errors([&] {
    BackwardTensors t = run_experts_backward(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, activation,
                                             layout, glu_clamp, ExpertsBackwardPart::All, nullptr, 0, nullptr, 0,
                                             fp8_weights);
    return Grads(t.dx, t.dw1, t.db1, t.dw2, t.db2, t.d_scores);
  });
}

// The backward in two calls: the data gradients first (dx, d_scores and the workspace the weight
// gradients read), then the weight gradients from that workspace, with the persistent weight
// GEMMs bounded to max_ctas CTAs (0: one per SM). Between them the caller may queue work on dx
// on another stream. Each gradient is bitwise experts_backward's. The weight part writes into the
// workspace (the bias gradients' partial sums), hence its schema marks it mutable.
std::tuple<Tensor, Tensor, Tensor> op_experts_backward_data(
    const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
    const std::optional<Tensor>& b2, const Tensor& token_idx, const Tensor& expert_idx, const Tensor& saved,
    const Tensor& dout, const std::string& activation, const std::string& layout, at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    BackwardTensors t = run_experts_backward(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, activation,
                                             layout, glu_clamp, ExpertsBackwardPart::DataGradients, nullptr, 0);
    return std::make_tuple(t.dx, t.d_scores, t.workspace);
  });
}

std::tuple<Tensor, std::optional<Tensor>, Tensor, std::optional<Tensor>> op_experts_backward_weights(
    const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
    const std::optional<Tensor>& b2, const Tensor& token_idx, const Tensor& expert_idx, const Tensor& saved,
    const Tensor& dout, const Tensor& workspace, const std::string& activation, const std::string& layout,
    at::ArrayRef<double> glu_clamp, int64_t max_ctas) {
  return translate_errors([&] {
    BackwardTensors t =
        run_experts_backward(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, activation, layout, glu_clamp,
                             ExpertsBackwardPart::WeightGradients, &workspace, max_ctas);
    return std::make_tuple(t.dw1, t.db1, t.dw2, t.db2);
  });
}

// One part of experts_backward_data split into early tokens [0, early_tokens) and late ones
// (machmoe::ExpertsBackwardPart): 'early_rows', then 'late_rows', into the caller's dx, d_scores and
// workspace (kept between the parts; the weight part then reads the workspace). dout_early:
// 'early_rows' only, dout's early rows [early_tokens, d] apart.
void op_experts_backward_data_part(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                                   const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& token_idx,
                                   const Tensor& expert_idx, const Tensor& saved, const Tensor& dout,
                                   const Tensor& dx, const Tensor& d_scores, const Tensor& workspace,
                                   const std::string& part, int64_t early_tokens, const std::string& activation,
                                   const std::string& layout, at::ArrayRef<double> glu_clamp,
                                   const std::optional<Tensor>& dout_early) {
  translate_errors([&] {
    MACHMOE_CHECK_VALUE(part == "early_rows" || part == "late_rows", "part must be 'early_rows' or 'late_rows', got '",
                        part, "'");
    BackwardTensors given;
    given.dx = dx;
    given.d_scores = d_scores;
    if (dout_early) {
      MACHMOE_CHECK_VALUE(early_tokens >= 0 && early_tokens <= dout.size(0), "early_tokens must be in [0, T = ",
                          dout.size(0), "]; got ", early_tokens);
      const at::Device device = x.device();
      check_bf16(*dout_early, "dout_early", {early_tokens, dout.size(1)}, &device);
      given.dout_early = *dout_early;
    }
    run_experts_backward(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, activation, layout, glu_clamp,
                         part == "early_rows" ? ExpertsBackwardPart::DataEarlyRows : ExpertsBackwardPart::DataLateRows,
                         &workspace, 0, &given, early_tokens);
  });
}

// [saved, forward workspace, backward workspace] bytes of an experts call (bf16): no GPU needed.
std::vector<int64_t> op_experts_workspace_bytes(int64_t T, int64_t d, int64_t n, int64_t E, int64_t R,
                                                const std::string& activation, bool bias) {
  return translate_errors([&] {
    ExpertsProblem p;
    p.T = T, p.d = d, p.n = n, p.E = E, p.R = R;
    p.activation = parse_activation(activation);
    p.has_bias = bias;
    const WorkspacePlan w = plan_workspace(p);
    return std::vector<int64_t>{static_cast<int64_t>(w.saved_bytes), static_cast<int64_t>(w.forward_workspace_bytes),
                                static_cast<int64_t>(w.backward_workspace_bytes)};
  });
}

// The saved block of an experts call as host/layer/saved_layout.hpp describes it (for every T and
// list length R; no part has a size in d): what the fake kernels size the block with. No GPU needed.
std::vector<int64_t> op_experts_saved_layout(int64_t n, int64_t E, const std::string& activation) {
  return translate_errors([&] {
    ExpertsProblem p;  // T = R = 0 and d = 1 stand for every T, R and d
    p.d = 1, p.n = n, p.E = E;
    p.activation = parse_activation(activation);
    return detail::experts_saved_layout_ints(validate(p));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("experts_forward(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor scores, Tensor token_idx,"
        " Tensor expert_idx, str activation, str layout, float[] glu_clamp=[], Tensor[]? fp8_weights=None)"
        " -> (Tensor out, Tensor saved)");
  m.def("experts_backward(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor token_idx,"
        " Tensor expert_idx, Tensor saved, Tensor dout, str activation, str layout, float[] glu_clamp=[],"
        " Tensor[]? fp8_weights=None) -> (Tensor dx, Tensor dw1, Tensor? db1, Tensor dw2, Tensor? db2,"
        " Tensor d_scores)");
  m.def("experts_backward_data(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor token_idx,"
        " Tensor expert_idx, Tensor saved, Tensor dout, str activation, str layout, float[] glu_clamp=[])"
        " -> (Tensor dx, Tensor d_scores, Tensor workspace)");
  m.def("experts_backward_weights(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor token_idx,"
        " Tensor expert_idx, Tensor saved, Tensor dout, Tensor(a!) workspace, str activation, str layout,"
        " float[] glu_clamp=[], int max_ctas=0) -> (Tensor dw1, Tensor? db1, Tensor dw2, Tensor? db2)");
  m.def("experts_forward_part(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor scores,"
        " Tensor token_idx, Tensor expert_idx, Tensor(a!) out, Tensor(b!) saved, Tensor(c!) workspace, str part,"
        " int early_tokens, str activation, str layout, float[] glu_clamp=[], int max_ctas=0, Tensor? x_early=None)"
        " -> ()");
  m.def("experts_backward_data_part(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor token_idx,"
        " Tensor expert_idx, Tensor saved, Tensor dout, Tensor(a!) dx, Tensor(b!) d_scores, Tensor(c!) workspace,"
        " str part, int early_tokens, str activation, str layout, float[] glu_clamp=[], Tensor? dout_early=None)"
        " -> ()");
  m.def("experts_workspace_bytes(int T, int d, int n, int E, int R, str activation, bool bias) -> int[]",
        &op_experts_workspace_bytes);
  m.def("experts_saved_layout(int n, int E, str activation) -> int[]", &op_experts_saved_layout);
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("experts_forward", &op_experts_forward);
  m.impl("experts_backward", &op_experts_backward);
  m.impl("experts_backward_data", &op_experts_backward_data);
  m.impl("experts_backward_weights", &op_experts_backward_weights);
  m.impl("experts_forward_part", &op_experts_forward_part);
  m.impl("experts_backward_data_part", &op_experts_backward_data_part);
}

}  // namespace machmoe::bindings
