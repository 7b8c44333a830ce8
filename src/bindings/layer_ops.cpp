// PyTorch ops over the layer (docs/OPS.md), one call per direction on the current stream:
// layer_forward returns the output, the aux loss and the `saved` block; layer_backward reads that
// block back and returns every gradient.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "bindings/common.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

// The router options of a layer call (docs/LAYER.md "Routing"): router bias, scaling, groups.
struct RouterArgs {
  bool has_router_bias = false;
  double routed_scaling_factor = 1.0;
  int64_t n_group = 1, topk_group = 1;
};

// The shared experts of a layer call (docs/LAYER.md "Shared experts"): their weights [S, ...]
// beside the routed experts' [E, ...], and whether a per-token score (given, or Qwen's gate
// computed by the layer) weights them.
struct SharedArgs {
  const std::optional<Tensor>& w1;
  const std::optional<Tensor>& b1;
  const std::optional<Tensor>& w2;
  const std::optional<Tensor>& b2;
  bool has_scores = false;
  const std::optional<Tensor>& gate;  // [1, d] bf16
  int64_t count() const { return w1 ? w1->size(0) : 0; }
};

// Routed weights w [E, ...] and the shared experts' ws [S, ...] as the one [E+S, ...] tensor the
// layer reads. No copy when ws starts where w ends (machmoe.MoE allocates both in one block); a
// concatenated copy otherwise. Both bf16 and contiguous (checked by the caller).
Tensor with_shared(const Tensor& w, const std::optional<Tensor>& ws) {
  if (!ws) return w;
  std::vector<int64_t> sizes(w.sizes().begin(), w.sizes().end());
  sizes[0] += ws->size(0);
  const char* end = static_cast<const char*>(w.data_ptr()) + w.nbytes();
  if (ws->numel() == 0 || static_cast<const void*>(end) == ws->data_ptr())
    return at::from_blob(w.data_ptr(), sizes, w.options());  // views the two inputs, alive for the call
  return at::cat({w, *ws});
}

// The problem of a layer call from the tensors' shapes and the string options, validated: the one
// validation of the call (plan_workspace and the C++ call take the validated problem as it is).
// fp8: precision FP8 (the call was given the weights' FP8 copies).

ValidLayerProblem layer_problem(const Tensor& x, const Tensor& w1, const Tensor& w2, bool has_bias, int64_t K,
                                const std::string& activation, const std::string& layout, const std::string& routing,
                                bool renormalize, const std::string& rounding, int64_t tile_m, const RouterArgs& r,
                                at::ArrayRef<double> glu_clamp, const SharedArgs& shared, bool fp8) {
  LayerProblem p = problem_from_tensors<LayerProblem>(x, w1, w2, has_bias, activation, layout, glu_clamp);
  if (fp8) p.precision = Precision::FP8;
  if (shared.w1) check_dims(*shared.w1, "w1_shared", 3);
  p.num_shared = shared.count();
  p.has_shared_scores = shared.has_scores;
  p.has_shared_gate = shared.gate.has_value();
  p.K = K;
  p.routing = parse_routing(routing);
  p.renormalize = renormalize;
  p.rounding = parse_token_rounding(rounding);
  p.rounding_tile_m = tile_m;
  p.has_router_bias = r.has_router_bias;
  p.routed_scaling_factor = r.routed_scaling_factor;
  p.n_group = r.n_group;
  p.topk_group = r.topk_group;
  return validate(p);
}

// x, router weight, expert weights and biases of problem p (the shared experts' too): bf16,
// contiguous, on x's device, shaped as docs/LAYER.md.
void check_layer_tensors(const LayerProblem& p, const Tensor& x, const Tensor& router_weight, const Tensor& w1,
                         const std::optional<Tensor>& b1, const Tensor& w2, const std::optional<Tensor>& b2,
                         const SharedArgs& shared) {
  const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  const at::Device device = x.device();
  check_bf16(x, "x", {p.T, p.d});
  check_bf16(router_weight, "router_weight", {p.E, p.d}, &device);
  check_bf16(w1, "w1", {p.E, n1, p.d}, &device);
  check_bf16(w2, "w2", {p.E, p.d, p.n}, &device);
  MACHMOE_CHECK_VALUE(b1.has_value() == b2.has_value(), "b1 and b2 must be given together or not at all");
  if (b1) {
    check_bf16(*b1, "b1", {p.E, n1}, &device);
    check_bf16(*b2, "b2", {p.E, p.d}, &device);
  }
  const int64_t S = p.num_shared;
  MACHMOE_CHECK_VALUE(shared.w1.has_value() == shared.w2.has_value(),
                      "w1_shared and w2_shared must be given together or not at all");
  if (!shared.w1) {
    MACHMOE_CHECK_VALUE(!shared.b1 && !shared.b2, "b1_shared and b2_shared need w1_shared and w2_shared");
    return;
  }
  if (shared.gate) check_bf16(*shared.gate, "shared_gate", {1, p.d}, &device);
  MACHMOE_CHECK_VALUE(S >= 1, "w1_shared must hold at least one shared expert, got shape ", shared.w1->sizes());
  check_bf16(*shared.w1, "w1_shared", {S, n1, p.d}, &device);
  check_bf16(*shared.w2, "w2_shared", {S, p.d, p.n}, &device);
  MACHMOE_CHECK_VALUE(shared.b1.has_value() == b1.has_value() && shared.b2.has_value() == b1.has_value(),
                      "b1_shared and b2_shared must be given exactly when b1 and b2 are");
  if (shared.b1) {
    check_bf16(*shared.b1, "b1_shared", {S, n1}, &device);
    check_bf16(*shared.b2, "b2_shared", {S, p.d}, &device);
  }
}

// The optional bias of the routed and shared experts as one tensor (or none).
std::optional<Tensor> bias_with_shared(const std::optional<Tensor>& b, const std::optional<Tensor>& bs) {
  return b ? std::optional<Tensor>(with_shared(*b, bs)) : std::nullopt;
}

std::tuple<Tensor, Tensor, Tensor> op_layer_forward(const Tensor& x, const Tensor& router_weight, const Tensor& w1,
                                                    const std::optional<Tensor>& b1, const Tensor& w2,
                                                    const std::optional<Tensor>& b2,
                                                    const std::optional<Tensor>& selection_bias, int64_t K,
                                                    const std::string& activation, const std::string& layout,
                                                    const std::string& routing, bool renormalize,
                                                    const std::string& rounding, int64_t tile_m, int64_t seed,
                                                    bool write_h, const std::optional<Tensor>& router_bias,
                                                    double routed_scaling_factor, int64_t n_group,
                                                    int64_t topk_group, at::ArrayRef<double> glu_clamp,
                                                    const std::optional<Tensor>& w1_shared,
                                                    const std::optional<Tensor>& b1_shared,
                                                    const std::optional<Tensor>& w2_shared,
                                                    const std::optional<Tensor>& b2_shared,
                                                    const std::optional<Tensor>& shared_scores,
                                                    const std::optional<Tensor>& shared_gate,
                                                    std::optional<at::TensorList> fp8_weights) {
  return translate_errors([&] {
    const SharedArgs shared{w1_shared, b1_shared, w2_shared, b2_shared, shared_scores.has_value(), shared_gate};
    const ValidLayerProblem valid = layer_problem(
        x, w1, w2, b1.has_value(), K, activation, layout, routing, renormalize, rounding, tile_m,
        {router_bias.has_value(), routed_scaling_factor, n_group, topk_group}, glu_clamp, shared, fp8_weights.has_value());
    const LayerProblem& p = *valid;
    check_layer_tensors(p, x, router_weight, w1, b1, w2, b2, shared);
    const at::Device device = x.device();
    const std::optional<Fp8ExpertWeights> fp8 = optional_fp8_weights(fp8_weights, p, device);
    if (selection_bias) check_tensor(*selection_bias, "selection_bias", at::kFloat, {p.E}, &device);
    if (router_bias) check_bf16(*router_bias, "router_bias", {p.E}, &device);
    if (shared_scores) check_tensor(*shared_scores, "shared_scores", at::kFloat, {p.T}, &device);
    const c10::cuda::CUDAGuard guard(x.device());
    const WorkspacePlan plan = plan_workspace(valid);
    const auto bytes = x.options().dtype(at::kByte);
    Tensor out = at::empty({p.T, p.d}, x.options());
    Tensor aux = at::empty({}, x.options().dtype(at::kFloat));
    // Inference (write_h false): H is not written, and the block stops before it.
    Tensor saved = at::empty({static_cast<int64_t>(write_h ? plan.saved_bytes : plan.inference_saved_bytes)}, bytes);
    Tensor ws = at::empty({static_cast<int64_t>(plan.forward_workspace_bytes)}, bytes);
    const Tensor w1_all = with_shared(w1, w1_shared), w2_all = with_shared(w2, w2_shared);
    const std::optional<Tensor> b1_all = bias_with_shared(b1, b1_shared), b2_all = bias_with_shared(b2, b2_shared);
    LayerForwardArgs a;
    a.x = x.data_ptr();
    a.router_weight = router_weight.data_ptr();
    a.w1 = w1_all.data_ptr();
    a.b1 = b1_all ? b1_all->data_ptr() : nullptr;
    a.w2 = w2_all.data_ptr();
    a.b2 = b2_all ? b2_all->data_ptr() : nullptr;
    a.shared_scores = shared_scores ? shared_scores->data_ptr<float>() : nullptr;
    a.shared_gate = shared_gate ? shared_gate->data_ptr() : nullptr;
    a.selection_bias = selection_bias ? selection_bias->data_ptr<float>() : nullptr;
    a.router_bias = router_bias ? router_bias->data_ptr() : nullptr;
    a.out = out.data_ptr();
    a.aux_loss = aux.data_ptr<float>();
    a.saved = saved.data_ptr();
    a.workspace = ws.data_ptr();
    a.seed = static_cast<uint64_t>(seed);
    a.write_h = write_h;
    a.fp8_weights = fp8 ? &*fp8 : nullptr;
    layer_forward(valid, a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(out, aux, saved);
  });
}

using Grads = std::tuple<Tensor, Tensor, Tensor, std::optional<Tensor>, Tensor, std::optional<Tensor>,
                         std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>>;

// Gradients of the layer from layer_forward's `saved` block (same problem arguments as the forward
// that wrote it), in the weights' dtype (bf16). d_aux: the aux loss's gradient as a one-element
// CUDA tensor, read on the device (no host synchronisation), or None for 0. With shared experts,
// dw1/db1/dw2/db2 hold the routed experts' gradients then the shared ones' ([E+S, ...]), and
// d_shared_scores [T] fp32 is returned when shared_scores were given (has_shared_scores), and
// d_shared_gate [1, d] when Qwen's gate shared_gate [1, d] was (dx then includes its term).
Grads op_layer_backward(const Tensor& x, const Tensor& router_weight, const Tensor& w1, const std::optional<Tensor>& b1,
                        const Tensor& w2, const std::optional<Tensor>& b2, const Tensor& saved, const Tensor& dout,
                        const std::optional<Tensor>& d_aux, int64_t K, const std::string& activation,
                        const std::string& layout, const std::string& routing, bool renormalize,
                        const std::string& rounding, int64_t tile_m, const std::optional<Tensor>& router_bias,
                        double routed_scaling_factor, int64_t n_group, int64_t topk_group,
                        at::ArrayRef<double> glu_clamp, const std::optional<Tensor>& w1_shared,
                        const std::optional<Tensor>& b1_shared, const std::optional<Tensor>& w2_shared,
                        const std::optional<Tensor>& b2_shared, bool has_shared_scores,
                        const std::optional<Tensor>& shared_gate, std::optional<at::TensorList> fp8_weights) {
  return translate_errors([&] {
    const SharedArgs shared{w1_shared, b1_shared, w2_shared, b2_shared, has_shared_scores, shared_gate};
    const ValidLayerProblem valid = layer_problem(
        x, w1, w2, b1.has_value(), K, activation, layout, routing, renormalize, rounding, tile_m,
        {router_bias.has_value(), routed_scaling_factor, n_group, topk_group}, glu_clamp, shared, fp8_weights.has_value());
    const LayerProblem& p = *valid;
    check_layer_tensors(p, x, router_weight, w1, b1, w2, b2, shared);
    const at::Device device = x.device();
    const std::optional<Fp8ExpertWeights> fp8 = optional_fp8_weights(fp8_weights, p, device);
    check_bf16(dout, "dout", {p.T, p.d}, &device);
    const WorkspacePlan plan = plan_workspace(valid);
    check_saved(saved, plan.saved_bytes, x.device(), "layer_forward");
    if (d_aux)
      MACHMOE_CHECK_VALUE(d_aux->numel() == 1 && d_aux->is_floating_point() && d_aux->device() == x.device(),
                        "d_aux must be a one-element floating-point tensor on x's device, got shape ",
                        d_aux->sizes(), " ", d_aux->scalar_type(), " on ", d_aux->device());
    const c10::cuda::CUDAGuard guard(x.device());
    // fp32 copy on the stream (no host read); the kernel takes its pointer.
    const std::optional<Tensor> d_aux32 =
        d_aux ? std::optional<Tensor>(d_aux->to(at::kFloat).contiguous()) : std::nullopt;
    const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n, E_all = weight_experts(p);
    Tensor dx = at::empty({p.T, p.d}, x.options());
    Tensor dwr = at::empty({p.E, p.d}, x.options());
    Tensor dw1 = at::empty({E_all, n1, p.d}, x.options());
    Tensor dw2 = at::empty({E_all, p.d, p.n}, x.options());
    std::optional<Tensor> db1, db2, dbr, d_shared, d_gate;
    if (p.has_router_bias) dbr = at::empty({p.E}, x.options());
    if (p.has_bias) {
      db1 = at::empty({E_all, n1}, x.options());
      db2 = at::empty({E_all, p.d}, x.options());
    }
    if (p.has_shared_scores) d_shared = at::empty({p.T}, x.options().dtype(at::kFloat));
    if (p.has_shared_gate) d_gate = at::empty({1, p.d}, x.options());
    const Tensor w1_all = with_shared(w1, w1_shared), w2_all = with_shared(w2, w2_shared);
    const std::optional<Tensor> b1_all = bias_with_shared(b1, b1_shared), b2_all = bias_with_shared(b2, b2_shared);
    Tensor ws = at::empty({static_cast<int64_t>(plan.backward_workspace_bytes)}, x.options().dtype(at::kByte));
    LayerBackwardArgs a;
    a.x = x.data_ptr();
    a.router_weight = router_weight.data_ptr();
    a.w1 = w1_all.data_ptr();
    a.b1 = b1_all ? b1_all->data_ptr() : nullptr;
    a.w2 = w2_all.data_ptr();
    a.b2 = b2_all ? b2_all->data_ptr() : nullptr;
    a.d_shared_scores = d_shared ? d_shared->data_ptr<float>() : nullptr;
    a.shared_gate = shared_gate ? shared_gate->data_ptr() : nullptr;
    a.d_shared_gate = d_gate ? d_gate->data_ptr() : nullptr;
    a.saved = saved.data_ptr();
    a.dout = dout.data_ptr();
    a.d_aux_device = d_aux32 ? d_aux32->data_ptr<float>() : nullptr;
    a.dx = dx.data_ptr();
    a.d_router_weight = dwr.data_ptr();
    a.d_router_bias = dbr ? dbr->data_ptr() : nullptr;
    a.dw1 = dw1.data_ptr();
    a.db1 = db1 ? db1->data_ptr() : nullptr;
    a.dw2 = dw2.data_ptr();
    a.db2 = db2 ? db2->data_ptr() : nullptr;
    a.workspace = ws.data_ptr();
    a.weight_grad_dtype = DType::BF16;
    a.fp8_weights = fp8 ? &*fp8 : nullptr;
    layer_backward(valid, a, at::cuda::getCurrentCUDAStream());
    return Grads(dx, dwr, dw1, db1, dw2, db2, dbr, d_shared, d_gate);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("layer_forward(Tensor x, Tensor router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2,"
        " Tensor? selection_bias, int K, str activation, str layout, str routing, bool renormalize,"
        " str rounding, int tile_m, int seed, bool write_h=True, Tensor? router_bias=None,"
        " float routed_scaling_factor=1.0, int n_group=1, int topk_group=1, float[] glu_clamp=[],"
        " Tensor? w1_shared=None, Tensor? b1_shared=None, Tensor? w2_shared=None, Tensor? b2_shared=None,"
        " Tensor? shared_scores=None, Tensor? shared_gate=None, Tensor[]? fp8_weights=None)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("layer_backward(Tensor x, Tensor router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2,"
        " Tensor saved, Tensor dout, Tensor? d_aux, int K, str activation, str layout, str routing,"
        " bool renormalize, str rounding, int tile_m, Tensor? router_bias=None, float routed_scaling_factor=1.0,"
        " int n_group=1, int topk_group=1, float[] glu_clamp=[], Tensor? w1_shared=None, Tensor? b1_shared=None,"
        " Tensor? w2_shared=None, Tensor? b2_shared=None, bool has_shared_scores=False, Tensor? shared_gate=None,"
        " Tensor[]? fp8_weights=None) -> (Tensor dx, Tensor d_router_weight, Tensor dw1, Tensor? db1, Tensor dw2, Tensor? db2,"
        " Tensor? d_router_bias, Tensor? d_shared_scores, Tensor? d_shared_gate)");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("layer_forward", &op_layer_forward);
  m.impl("layer_backward", &op_layer_backward);
}

}  // namespace machmoe::bindings
