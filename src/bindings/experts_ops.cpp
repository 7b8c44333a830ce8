// PyTorch ops over the experts on a general routing list (docs/OPS.md), one call per direction on
// the current stream: experts_forward returns the output and the `saved` block; experts_backward
// reads that block back, with the same list, and returns every gradient, the scores' included.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

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
// the list's length R and the string options, validated: the one validation of the call.
ValidExpertsProblem experts_problem(const Tensor& x, const Tensor& w1, const Tensor& w2, bool has_bias, int64_t R,
                                    const std::string& activation, const std::string& layout,
                                    at::ArrayRef<double> glu_clamp) {
  ExpertsProblem p = problem_from_tensors<ExpertsProblem>(x, w1, w2, has_bias, activation, layout, glu_clamp);
  p.R = R;
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

std::tuple<Tensor, Tensor> op_experts_forward(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                                              const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& scores,
                                              const Tensor& token_idx, const Tensor& expert_idx,
                                              const std::string& activation, const std::string& layout,
                                              at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    check_dims(scores, "scores", 1);
    const ValidExpertsProblem valid =
        experts_problem(x, w1, w2, b1.has_value(), scores.numel(), activation, layout, glu_clamp);
    const ExpertsProblem& p = *valid;
    check_expert_tensors(p, x, w1, b1, w2, b2);
    const at::Device device = x.device();
    check_tensor(scores, "scores", at::kFloat, {p.R}, &device);
    check_tensor(token_idx, "token_idx", at::kInt, {p.R}, &device);
    check_tensor(expert_idx, "expert_idx", at::kInt, {p.R}, &device);
    const c10::cuda::CUDAGuard guard(x.device());
    const WorkspacePlan plan = plan_workspace(valid);
    const auto bytes = x.options().dtype(at::kByte);
    Tensor out = at::empty({p.T, p.d}, x.options());
    Tensor saved = at::empty({static_cast<int64_t>(plan.saved_bytes)}, bytes);
    Tensor ws = at::empty({static_cast<int64_t>(plan.forward_workspace_bytes)}, bytes);
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
    a.workspace = ws.data_ptr();
    experts_forward(valid, a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(out, saved);
  });
}

using Grads = std::tuple<Tensor, Tensor, std::optional<Tensor>, Tensor, std::optional<Tensor>, Tensor>;

// Gradients of experts_forward from its `saved` block and the same list and options; weight and
// bias gradients in the weights' dtype (bf16), d_scores fp32 [R] in the list's pair order.
Grads op_experts_backward(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
                          const std::optional<Tensor>& b2, const Tensor& token_idx, const Tensor& expert_idx,
                          const Tensor& saved, const Tensor& dout, const std::string& activation,
                          const std::string& layout, at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    check_dims(token_idx, "token_idx", 1);
    const ValidExpertsProblem valid =
        experts_problem(x, w1, w2, b1.has_value(), token_idx.numel(), activation, layout, glu_clamp);
    const ExpertsProblem& p = *valid;
    check_expert_tensors(p, x, w1, b1, w2, b2);
    const at::Device device = x.device();
    check_tensor(token_idx, "token_idx", at::kInt, {p.R}, &device);
    check_tensor(expert_idx, "expert_idx", at::kInt, {p.R}, &device);
    check_bf16(dout, "dout", {p.T, p.d}, &device);
    const WorkspacePlan plan = plan_workspace(valid);
    check_saved(saved, plan.saved_bytes, x.device(), "experts_forward");
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
    Tensor dx = at::empty({p.T, p.d}, x.options());
    Tensor dw1 = at::empty({p.E, n1, p.d}, x.options());
    Tensor dw2 = at::empty({p.E, p.d, p.n}, x.options());
    Tensor d_scores = at::empty({p.R}, x.options().dtype(at::kFloat));
    std::optional<Tensor> db1, db2;
    if (p.has_bias) {
      db1 = at::empty({p.E, n1}, x.options());
      db2 = at::empty({p.E, p.d}, x.options());
    }
    Tensor ws = at::empty({static_cast<int64_t>(plan.backward_workspace_bytes)}, x.options().dtype(at::kByte));
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
    a.dx = dx.data_ptr();
    a.dw1 = dw1.data_ptr();
    a.db1 = db1 ? db1->data_ptr() : nullptr;
    a.dw2 = dw2.data_ptr();
    a.db2 = db2 ? db2->data_ptr() : nullptr;
    a.d_scores = d_scores.data_ptr<float>();
    a.workspace = ws.data_ptr();
    a.weight_grad_dtype = DType::BF16;
    experts_backward(valid, a, at::cuda::getCurrentCUDAStream());
    return Grads(dx, dw1, db1, dw2, db2, d_scores);
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
        " Tensor expert_idx, str activation, str layout, float[] glu_clamp=[]) -> (Tensor out, Tensor saved)");
  m.def("experts_backward(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor token_idx,"
        " Tensor expert_idx, Tensor saved, Tensor dout, str activation, str layout, float[] glu_clamp=[])"
        " -> (Tensor dx, Tensor dw1, Tensor? db1, Tensor dw2, Tensor? db2, Tensor d_scores)");
  m.def("experts_workspace_bytes(int T, int d, int n, int E, int R, str activation, bool bias) -> int[]",
        &op_experts_workspace_bytes);
  m.def("experts_saved_layout(int n, int E, str activation) -> int[]", &op_experts_saved_layout);
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("experts_forward", &op_experts_forward);
  m.impl("experts_backward", &op_experts_backward);
}

}  // namespace machmoe::bindings
