// PyTorch op over the layer forward (docs/OPS.md): one call for the whole layer, on the current
// stream. Returns the output, the aux loss and the `saved` block the backward will read.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "bindings/common.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

void check_bf16(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CUDA tensor, got ",
                    t.scalar_type(), " on ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  check_shape(t, name, shape);
}

std::tuple<Tensor, Tensor, Tensor> op_layer_forward(const Tensor& x, const Tensor& router_weight, const Tensor& w1,
                                                    const std::optional<Tensor>& b1, const Tensor& w2,
                                                    const std::optional<Tensor>& b2,
                                                    const std::optional<Tensor>& selection_bias, int64_t K,
                                                    const std::string& activation, const std::string& layout,
                                                    const std::string& routing, bool renormalize,
                                                    const std::string& rounding, int64_t tile_m, int64_t seed) {
  return translate_errors([&] {
    check_dims(x, "x", 2);
    check_dims(w1, "w1", 3);
    check_dims(w2, "w2", 3);
    LayerProblem p;
    p.T = x.size(0);
    p.d = x.size(1);
    p.E = w1.size(0);
    p.n = w2.size(2);
    p.K = K;
    p.activation = parse_activation(activation);
    p.layout = parse_layout(layout);
    p.routing = parse_routing(routing);
    p.renormalize = renormalize;
    p.rounding = parse_token_rounding(rounding);
    p.rounding_tile_m = tile_m;
    p.has_bias = b1.has_value();
    p.dtype = DType::BF16;
    validate(p);
    const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
    check_bf16(x, "x", {p.T, p.d});
    check_bf16(router_weight, "router_weight", {p.E, p.d});
    check_bf16(w1, "w1", {p.E, n1, p.d});
    check_bf16(w2, "w2", {p.E, p.d, p.n});
    TORCH_CHECK_VALUE(b1.has_value() == b2.has_value(), "b1 and b2 must be given together or not at all");
    if (b1) {
      check_bf16(*b1, "b1", {p.E, n1});
      check_bf16(*b2, "b2", {p.E, p.d});
    }
    if (selection_bias) {
      TORCH_CHECK_VALUE(selection_bias->is_cuda() && selection_bias->scalar_type() == at::kFloat &&
                            selection_bias->is_contiguous(),
                        "selection_bias must be a contiguous float32 CUDA tensor");
      check_shape(*selection_bias, "selection_bias", {p.E});
    }
    const c10::cuda::CUDAGuard guard(x.device());
    const WorkspacePlan plan = plan_workspace(p);
    const auto bytes = x.options().dtype(at::kByte);
    Tensor out = at::empty({p.T, p.d}, x.options());
    Tensor aux = at::empty({}, x.options().dtype(at::kFloat));
    Tensor saved = at::empty({static_cast<int64_t>(plan.saved_bytes)}, bytes);
    Tensor ws = at::empty({static_cast<int64_t>(plan.forward_workspace_bytes)}, bytes);
    LayerForwardArgs a;
    a.x = x.data_ptr();
    a.router_weight = router_weight.data_ptr();
    a.w1 = w1.data_ptr();
    a.b1 = b1 ? b1->data_ptr() : nullptr;
    a.w2 = w2.data_ptr();
    a.b2 = b2 ? b2->data_ptr() : nullptr;
    a.selection_bias = selection_bias ? selection_bias->data_ptr<float>() : nullptr;
    a.out = out.data_ptr();
    a.aux_loss = aux.data_ptr<float>();
    a.saved = saved.data_ptr();
    a.workspace = ws.data_ptr();
    a.seed = static_cast<uint64_t>(seed);
    layer_forward(p, a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(out, aux, saved);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("layer_forward(Tensor x, Tensor router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2,"
        " Tensor? selection_bias, int K, str activation, str layout, str routing, bool renormalize,"
        " str rounding, int tile_m, int seed)"
        " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) { m.impl("layer_forward", &op_layer_forward); }

}  // namespace machmoe::bindings
