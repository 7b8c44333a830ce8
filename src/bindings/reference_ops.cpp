// PyTorch ops over the CPU reference (machmoe/reference.hpp): float64 in, float64 out, on the CPU.
// They exist so the Python tests can check the C++ reference against an independent float64
// PyTorch implementation, and the GPU tests can check kernels against it. Schemas: docs/OPS.md.
#include <torch/library.h>

#include <optional>
#include <vector>

#include "bindings/common.hpp"
#include "machmoe/reference.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

// A contiguous float64 CPU copy of a floating tensor.
Tensor as_f64(const Tensor& t, const char* name) {
  MACHMOE_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor for the reference ops, got ",
                    t.device());
  MACHMOE_CHECK_VALUE(at::isFloatingType(t.scalar_type()), name, " must be floating point, got ",
                    t.scalar_type());
  return t.to(at::kDouble).contiguous();
}

std::vector<int32_t> as_i32(const Tensor& t, const char* name) {
  MACHMOE_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  MACHMOE_CHECK_VALUE(!at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool, name,
                    " must be an integer tensor, got ", t.scalar_type());
  check_dims(t, name, 1);
  Tensor c = t.to(at::kInt).contiguous();
  return {c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel()};
}

template <typename T>
Tensor vec_to_tensor(const std::vector<T>& v, at::IntArrayRef shape) {
  const auto dtype = std::is_same_v<T, double> ? at::kDouble
                     : std::is_same_v<T, int64_t> ? at::kLong
                     : std::is_same_v<T, uint8_t> ? at::kBool
                                                  : at::kInt;
  Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  if (static_cast<int64_t>(v.size()) != out.numel()) C10_THROW_ERROR(Error, "internal: size mismatch");
  if (!v.empty()) std::memcpy(out.data_ptr(), v.data(), v.size() * sizeof(T));
  return out;
}

const double* opt_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<double>() : nullptr;
}

// Shape + converted weights of one call, with every argument checked against the others.
struct ExpertInputs {
  ref::Shape s;
  Tensor x, w1, w2;
  std::optional<Tensor> b1, b2;
  ref::Weights weights() const {
    return {w1.data_ptr<double>(), b1 ? b1->data_ptr<double>() : nullptr, w2.data_ptr<double>(),
            b2 ? b2->data_ptr<double>() : nullptr};
  }
};

ExpertInputs expert_inputs(const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                           const Tensor& w2, const std::optional<Tensor>& b2,
                           const std::string& activation, const std::string& layout,
                           at::ArrayRef<double> glu_clamp) {
  ExpertInputs in;
  in.s.act = parse_activation(activation);
  in.s.clamp = glu_clamp_from(glu_clamp);
  check_glu_clamp("reference", in.s.act, in.s.clamp);
  in.s.layout = parse_layout(layout);
  check_dims(x, "x", 2);
  check_dims(w1, "w1", 3);
  check_dims(w2, "w2", 3);
  in.s.T = x.size(0);
  in.s.d = x.size(1);
  in.s.E = w1.size(0);
  in.s.n = w2.size(2);
  MACHMOE_CHECK_VALUE(in.s.d >= 1 && in.s.n >= 1 && in.s.E >= 1, "x, w1, w2 must have d, n, E >= 1");
  check_shape(w1, "w1", {in.s.E, in.s.n1(), in.s.d});
  check_shape(w2, "w2", {in.s.E, in.s.d, in.s.n});
  MACHMOE_CHECK_VALUE(b1.has_value() == b2.has_value(), "b1 and b2 must be given together or not at all");
  in.s.bias = b1.has_value();
  in.x = as_f64(x, "x");
  in.w1 = as_f64(w1, "w1");
  in.w2 = as_f64(w2, "w2");
  if (in.s.bias) {
    check_shape(*b1, "b1", {in.s.E, in.s.n1()});
    check_shape(*b2, "b2", {in.s.E, in.s.d});
    in.b1 = as_f64(*b1, "b1");
    in.b2 = as_f64(*b2, "b2");
  }
  return in;
}

std::tuple<Tensor, Tensor> reference_topk(const Tensor& logits, int64_t K, const std::string& routing,
                                          bool renormalize, const std::optional<Tensor>& selection_bias,
                                          double routed_scaling_factor, int64_t n_group, int64_t topk_group) {
  return translate_errors([&] {
    check_dims(logits, "logits", 2);
    const int64_t T = logits.size(0), E = logits.size(1);
    MACHMOE_CHECK_VALUE(K >= 1 && K <= E, "K must be in [1, E=", E, "], got ", K);
    const Tensor l = as_f64(logits, "logits");
    std::optional<Tensor> bias;
    if (selection_bias) {
      check_shape(*selection_bias, "selection_bias", {E});
      bias = as_f64(*selection_bias, "selection_bias");
    }
    const auto r = ref::topk_route(l.data_ptr<double>(), T, E, K, parse_routing(routing), renormalize,
                                   RouterOptions{routed_scaling_factor, n_group, topk_group}, opt_ptr(bias));
    return std::make_tuple(vec_to_tensor(r.score, {T, K}), vec_to_tensor(r.expert, {T, K}));
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> reference_token_rounding(const Tensor& logits, int64_t K,
                                                                    const std::string& mode,
                                                                    int64_t tile_m, int64_t seed) {
  return translate_errors([&] {
    check_dims(logits, "logits", 2);
    const int64_t T = logits.size(0), E = logits.size(1);
    MACHMOE_CHECK_VALUE(K >= 1 && K <= E, "K must be in [1, E=", E, "], got ", K);
    const Tensor l = as_f64(logits, "logits");
    const auto r = ref::token_round(l.data_ptr<double>(), T, E, K,
                                    {parse_token_rounding(mode), tile_m, static_cast<uint64_t>(seed)});
    const int64_t R = r.list.size();
    return std::make_tuple(vec_to_tensor(r.list.token, {R}), vec_to_tensor(r.list.expert, {R}),
                           vec_to_tensor(r.list.score, {R}), vec_to_tensor(r.padded, {R}));
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> reference_metadata(const Tensor& token,
                                                                      const Tensor& expert,
                                                                      int64_t T, int64_t E) {
  return translate_errors([&] {
    ref::RoutingList list;
    list.token = as_i32(token, "token");
    list.expert = as_i32(expert, "expert");
    MACHMOE_CHECK_VALUE(list.token.size() == list.expert.size(), "token and expert must have the same length");
    list.score.assign(list.token.size(), 1.0);
    const int64_t R = list.size();
    const auto md = ref::build_metadata(list, T, E);
    return std::make_tuple(vec_to_tensor(md.expert_offsets, {E + 1}), vec_to_tensor(md.row_token, {R}),
                           vec_to_tensor(md.row_pair, {R}), vec_to_tensor(md.pair_row, {R}),
                           vec_to_tensor(md.token_offsets, {T + 1}));
  });
}

Tensor bias_grad(const std::vector<double>& g, int64_t rows, int64_t cols) {
  return g.empty() ? at::empty({0}, at::kDouble) : vec_to_tensor(g, {rows, cols});
}

using LayerResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, Tensor, Tensor, Tensor>;

LayerResult reference_layer(const Tensor& x, const Tensor& router_weight, const Tensor& w1,
                            const std::optional<Tensor>& b1, const Tensor& w2,
                            const std::optional<Tensor>& b2, const std::optional<Tensor>& selection_bias,
                            const Tensor& dout, double d_aux, int64_t K, const std::string& activation,
                            const std::string& layout, const std::string& routing, bool renormalize,
                            const std::string& rounding, int64_t tile_m, int64_t seed,
                            const std::optional<Tensor>& router_bias, double routed_scaling_factor, int64_t n_group,
                            int64_t topk_group, at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    const ExpertInputs in = expert_inputs(x, w1, b1, w2, b2, activation, layout, glu_clamp);
    const auto& s = in.s;
    check_shape(router_weight, "router_weight", {s.E, s.d});
    check_shape(dout, "dout", {s.T, s.d});
    MACHMOE_CHECK_VALUE(K >= 1 && K <= s.E, "K must be in [1, E=", s.E, "], got ", K);
    ref::LayerConfig c;
    c.shape = s;
    c.K = K;
    c.routing = parse_routing(routing);
    c.renormalize = renormalize;
    c.rounding = {parse_token_rounding(rounding), tile_m, static_cast<uint64_t>(seed)};
    c.router = RouterOptions{routed_scaling_factor, n_group, topk_group};
    std::optional<Tensor> bias, rbias;
    if (router_bias) {
      check_shape(*router_bias, "router_bias", {s.E});
      rbias = as_f64(*router_bias, "router_bias");
    }
    if (selection_bias) {
      MACHMOE_CHECK_VALUE(is_gate_routing(c.routing),
                          "selection_bias is only used with routing=sigmoid or sqrt_softplus");
      check_shape(*selection_bias, "selection_bias", {s.E});
      bias = as_f64(*selection_bias, "selection_bias");
    }
    const Tensor wr = as_f64(router_weight, "router_weight"), go = as_f64(dout, "dout");
    const double* xp = in.x.data_ptr<double>();
    const auto f = ref::layer_forward(c, xp, wr.data_ptr<double>(), opt_ptr(rbias), in.weights(), opt_ptr(bias));
    const auto g = ref::layer_backward(c, xp, wr.data_ptr<double>(), in.weights(), f,
                                       go.data_ptr<double>(), d_aux);
    const int64_t R = f.list.size();
    return LayerResult(vec_to_tensor(f.experts.out, {s.T, s.d}), at::scalar_tensor(f.aux, at::kDouble),
                       vec_to_tensor(f.list.token, {R}), vec_to_tensor(f.list.expert, {R}),
                       vec_to_tensor(f.list.score, {R}), vec_to_tensor(g.dx, {s.T, s.d}),
                       vec_to_tensor(g.dwr, {s.E, s.d}), vec_to_tensor(g.dw1, {s.E, s.n1(), s.d}),
                       bias_grad(g.db1, s.E, s.n1()), vec_to_tensor(g.dw2, {s.E, s.d, s.n}),
                       bias_grad(g.db2, s.E, s.d), vec_to_tensor(g.d_logits, {s.T, s.E}),
                       vec_to_tensor(g.dbr, {s.E}));
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> reference_general(
    const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
    const std::optional<Tensor>& b2, const Tensor& token, const Tensor& expert, const Tensor& score,
    const Tensor& dout, const std::string& activation, const std::string& layout, at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    const ExpertInputs in = expert_inputs(x, w1, b1, w2, b2, activation, layout, glu_clamp);
    const auto& s = in.s;
    check_shape(dout, "dout", {s.T, s.d});
    ref::RoutingList list;
    list.token = as_i32(token, "token");
    list.expert = as_i32(expert, "expert");
    check_dims(score, "score", 1);
    const Tensor sc = as_f64(score, "score");
    list.score.assign(sc.data_ptr<double>(), sc.data_ptr<double>() + sc.numel());
    MACHMOE_CHECK_VALUE(list.token.size() == list.expert.size() && list.token.size() == list.score.size(),
                      "token, expert and score must have the same length");
    const Tensor go = as_f64(dout, "dout");
    const double* xp = in.x.data_ptr<double>();
    const auto f = ref::general_forward(s, xp, in.weights(), list);
    const auto g = ref::general_backward(s, xp, in.weights(), f, go.data_ptr<double>());
    const int64_t R = list.size();
    return std::make_tuple(vec_to_tensor(f.experts.out, {s.T, s.d}), vec_to_tensor(g.dx, {s.T, s.d}),
                           vec_to_tensor(g.dw1, {s.E, s.n1(), s.d}), bias_grad(g.db1, s.E, s.n1()),
                           vec_to_tensor(g.dw2, {s.E, s.d, s.n}), bias_grad(g.db2, s.E, s.d),
                           vec_to_tensor(g.d_score, {R}));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("reference_topk(Tensor logits, int K, str routing, bool renormalize, Tensor? selection_bias,"
        " float routed_scaling_factor=1.0, int n_group=1, int topk_group=1)"
        " -> (Tensor, Tensor)", &reference_topk);
  m.def("reference_token_rounding(Tensor logits, int K, str mode, int tile_m, int seed)"
        " -> (Tensor, Tensor, Tensor, Tensor)", &reference_token_rounding);
  m.def("reference_metadata(Tensor token, Tensor expert, int T, int E)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)", &reference_metadata);
  m.def("reference_layer(Tensor x, Tensor router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2,"
        " Tensor? selection_bias, Tensor dout, float d_aux, int K, str activation, str layout,"
        " str routing, bool renormalize, str rounding, int tile_m, int seed, Tensor? router_bias=None,"
        " float routed_scaling_factor=1.0, int n_group=1, int topk_group=1, float[] glu_clamp=[])"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,"
        " Tensor)",
        &reference_layer);
  m.def("reference_general(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor token,"
        " Tensor expert, Tensor score, Tensor dout, str activation, str layout, float[] glu_clamp=[])"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", &reference_general);
}

}  // namespace machmoe::bindings
