// PyTorch ops over the routing and data-movement kernel families (docs/OPS.md): CUDA tensors in,
// launches on the current stream, no host synchronisation.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "bindings/common.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::FP16;
    case at::kFloat: return DType::FP32;
    default: MACHMOE_CHECK_VALUE(false, name, " must be bfloat16, float16 or float32, got ", t);
  }
}

std::tuple<Tensor, Tensor> op_topk_router(const Tensor& logits, int64_t K, const std::string& routing,
                                          bool renormalize, const std::optional<Tensor>& selection_bias,
                                          double routed_scaling_factor, int64_t n_group, int64_t topk_group) {
  return translate_errors([&] {
    check_dims(logits, "logits", 2);
    check_tensor(logits, "logits", at::kFloat, logits.sizes());
    const int64_t T = logits.size(0), E = logits.size(1);
    const at::Device device = logits.device();
    const c10::cuda::CUDAGuard guard(device);
    if (selection_bias) check_tensor(*selection_bias, "selection_bias", at::kFloat, {E}, &device);
    MACHMOE_CHECK_VALUE(K >= 1 && K <= E, "K must be in [1, E=", E, "], got ", K);
    Tensor scores = at::empty({T, K}, logits.options());
    Tensor experts = at::empty({T, K}, logits.options().dtype(at::kInt));
    topk_router(logits.data_ptr<float>(), T, E, K, parse_routing(routing), renormalize,
                RouterOptions{routed_scaling_factor, n_group, topk_group},
                selection_bias ? selection_bias->data_ptr<float>() : nullptr, scores.data_ptr<float>(),
                experts.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream());
    return std::make_tuple(scores, experts);
  });
}

Tensor op_topk_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& experts,
                               const Tensor& d_scores, const std::string& routing, bool renormalize,
                               double routed_scaling_factor, int64_t n_group, int64_t topk_group) {
  return translate_errors([&] {
    check_dims(logits, "logits", 2);
    check_tensor(logits, "logits", at::kFloat, logits.sizes());
    const int64_t T = logits.size(0), E = logits.size(1);
    check_dims(scores, "scores", 2);
    const int64_t K = scores.size(1);
    const at::Device device = logits.device();
    check_tensor(scores, "scores", at::kFloat, {T, K}, &device);
    check_tensor(experts, "experts", at::kInt, {T, K}, &device);
    check_tensor(d_scores, "d_scores", at::kFloat, {T, K}, &device);
    const c10::cuda::CUDAGuard guard(device);
    Tensor d_logits = at::empty({T, E}, logits.options());
    topk_router_backward(logits.data_ptr<float>(), scores.data_ptr<float>(), experts.data_ptr<int32_t>(),
                         d_scores.data_ptr<float>(), T, E, K, parse_routing(routing), renormalize,
                         RouterOptions{routed_scaling_factor, n_group, topk_group}, d_logits.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    return d_logits;
  });
}

// pair_expert: [T, K] for a top-K list (pair_token absent), or [R] with pair_token [R].
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> op_routing_metadata(
    const Tensor& pair_expert, const std::optional<Tensor>& pair_token, int64_t T, int64_t E) {
  return translate_errors([&] {
    check_tensor(pair_expert, "pair_expert", at::kInt, pair_expert.sizes());
    const at::Device device = pair_expert.device();
    int64_t K = 0;
    if (pair_token) {
      check_dims(pair_expert, "pair_expert", 1);
      check_tensor(*pair_token, "pair_token", at::kInt, pair_expert.sizes(), &device);
    } else {
      check_dims(pair_expert, "pair_expert", 2);
      MACHMOE_CHECK_VALUE(pair_expert.size(0) == T, "pair_expert must be [T=", T, ", K] without pair_token, got ",
                        pair_expert.sizes());
      K = pair_expert.size(1);
    }
    const int64_t R = pair_expert.numel();
    const c10::cuda::CUDAGuard guard(device);
    const auto opts = pair_expert.options();
    Tensor expert_offsets = at::empty({E + 1}, opts), row_token = at::empty({R}, opts),
           row_pair = at::empty({R}, opts), pair_row = at::empty({R}, opts),
           token_offsets = at::empty({T + 1}, opts), duplicate = at::empty({1}, opts);
    const size_t ws_bytes = routing_metadata_workspace_bytes(T, E);
    Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, opts.dtype(at::kByte));
    RoutingMetadataOutputs out;
    out.expert_offsets = expert_offsets.data_ptr<int32_t>();
    out.row_token = row_token.data_ptr<int32_t>();
    out.row_pair = row_pair.data_ptr<int32_t>();
    out.pair_row = pair_row.data_ptr<int32_t>();
    out.token_offsets = token_offsets.data_ptr<int32_t>();
    out.duplicate_flag = duplicate.data_ptr<int32_t>();
    routing_metadata(pair_expert.data_ptr<int32_t>(), pair_token ? pair_token->data_ptr<int32_t>() : nullptr,
                     R, K, T, E, out, ws.data_ptr(), ws_bytes, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(expert_offsets, row_token, row_pair, pair_row, token_offsets, duplicate);
  });
}

// experts [T, K] int32, scores [T, K] fp32 -> the exchange plan (machmoe::exchange_plan), every
// output int32: counts [W, 2], row_offsets [W+1], row_token [T·K], pair_row [T·K], order [T·K],
// inverse [T·K], packed [T·K, 4], token_offsets [T+1], distinct_rows [T·K], expert_counts [E].
using PlanResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
PlanResult op_exchange_plan(const Tensor& experts, const Tensor& scores, int64_t E, int64_t W, int64_t rank) {
  return translate_errors([&] {
    check_dims(experts, "experts", 2);
    check_tensor(experts, "experts", at::kInt, experts.sizes());
    const int64_t T = experts.size(0), K = experts.size(1), R = T * K;
    const at::Device device = experts.device();
    check_tensor(scores, "scores", at::kFloat, {T, K}, &device);
    MACHMOE_CHECK_VALUE(W >= 1 && E >= W && E % W == 0, "E must be a multiple of W >= 1, got E=", E, ", W=", W);
    const c10::cuda::CUDAGuard guard(device);
    const auto opts = experts.options();
    Tensor counts = at::empty({W, 2}, opts), row_offsets = at::empty({W + 1}, opts),
           row_token = at::empty({R}, opts), pair_row = at::empty({R}, opts), order = at::empty({R}, opts),
           inverse = at::empty({R}, opts), packed = at::empty({R, 4}, opts), token_offsets = at::empty({T + 1}, opts),
           distinct_rows = at::empty({R}, opts), expert_counts = at::empty({E}, opts);
    const size_t ws_bytes = exchange_plan_workspace_bytes(T, K, W);
    Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, opts.dtype(at::kByte));
    ExchangePlanOutputs out;
    out.counts = counts.data_ptr<int32_t>();
    out.row_offsets = row_offsets.data_ptr<int32_t>();
    out.row_token = row_token.data_ptr<int32_t>();
    out.pair_row = pair_row.data_ptr<int32_t>();
    out.order = order.data_ptr<int32_t>();
    out.inverse = inverse.data_ptr<int32_t>();
    out.packed = packed.data_ptr<int32_t>();
    out.token_offsets = token_offsets.data_ptr<int32_t>();
    out.distinct_rows = distinct_rows.data_ptr<int32_t>();
    out.expert_counts = expert_counts.data_ptr<int32_t>();
    exchange_plan(experts.data_ptr<int32_t>(), scores.data_ptr<float>(), T, K, E, W, rank, out, ws.data_ptr(),
                  ws_bytes, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(counts, row_offsets, row_token, pair_row, order, inverse, packed, token_offsets,
                           distinct_rows, expert_counts);
  });
}

Tensor op_aggregate(const Tensor& rows, const Tensor& pair_row, const Tensor& token_offsets,
                    const std::optional<Tensor>& scores, std::optional<at::ScalarType> out_dtype) {
  return translate_errors([&] {
    check_dims(rows, "rows", 2);
    const DType rows_dtype = to_dtype(rows.scalar_type(), "rows");
    check_tensor(rows, "rows", rows.scalar_type(), rows.sizes());
    const at::Device device = rows.device();
    check_tensor(pair_row, "pair_row", at::kInt, pair_row.sizes(), &device);
    check_dims(token_offsets, "token_offsets", 1);
    check_tensor(token_offsets, "token_offsets", at::kInt, token_offsets.sizes(), &device);
    const int64_t T = token_offsets.size(0) - 1, d = rows.size(1);
    MACHMOE_CHECK_VALUE(T >= 0, "token_offsets must have T+1 >= 1 elements");
    if (scores) check_tensor(*scores, "scores", at::kFloat, pair_row.sizes(), &device);
    const c10::cuda::CUDAGuard guard(device);
    const at::ScalarType odt = out_dtype.value_or(rows.scalar_type());
    Tensor out = at::empty({T, d}, rows.options().dtype(odt));
    aggregate(rows.data_ptr(), rows_dtype, pair_row.data_ptr<int32_t>(),
              token_offsets.data_ptr<int32_t>(), scores ? scores->data_ptr<float>() : nullptr, T, d,
              out.data_ptr(), to_dtype(odt, "out_dtype"), at::cuda::getCurrentCUDAStream());
    return out;
  });
}

using RoundingResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// The rounded list is returned at its capacity; its length R is token_offsets[T] (on the device).
RoundingResult op_token_rounding(const Tensor& logits, int64_t K, const std::string& mode, int64_t tile_m,
                                 int64_t seed) {
  return translate_errors([&] {
    check_dims(logits, "logits", 2);
    check_tensor(logits, "logits", at::kFloat, logits.sizes());
    const int64_t T = logits.size(0), E = logits.size(1);
    MACHMOE_CHECK_VALUE(K >= 1 && K <= E, "K must be in [1, E=", E, "], got ", K);
    MACHMOE_CHECK_VALUE(tile_m >= 1, "tile_m must be >= 1, got ", tile_m);
    const c10::cuda::CUDAGuard guard(logits.device());
    const int64_t cap = token_rounding_capacity(T, E, K, tile_m);
    const auto f32 = logits.options(), i32 = logits.options().dtype(at::kInt);
    Tensor topk_scores = at::empty({T, K}, f32), topk_experts = at::empty({T, K}, i32),
           token = at::empty({cap}, i32), expert = at::empty({cap}, i32), score = at::empty({cap}, f32),
           padded = at::empty({cap}, logits.options().dtype(at::kBool)), token_offsets = at::empty({T + 1}, i32),
           count_topk = at::empty({E + 1}, i32), count_rounded = at::empty({E}, i32);
    const size_t ws_bytes = token_rounding_workspace_bytes(T, E, K);
    Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
    TokenRoundingOutputs out;
    out.topk_scores = topk_scores.data_ptr<float>();
    out.topk_experts = topk_experts.data_ptr<int32_t>();
    out.token = token.data_ptr<int32_t>();
    out.expert = expert.data_ptr<int32_t>();
    out.score = score.data_ptr<float>();
    out.padded = reinterpret_cast<uint8_t*>(padded.data_ptr<bool>());
    out.token_offsets = token_offsets.data_ptr<int32_t>();
    out.count_topk = count_topk.data_ptr<int32_t>();
    out.count_rounded = count_rounded.data_ptr<int32_t>();
    token_rounding(logits.data_ptr<float>(), T, E, K, parse_token_rounding(mode), tile_m,
                   static_cast<uint64_t>(seed), out, ws.data_ptr(), ws_bytes, at::cuda::getCurrentCUDAStream());
    return RoundingResult(token, expert, score, padded, token_offsets, topk_scores, topk_experts, count_topk,
                          count_rounded);
  });
}

Tensor op_token_rounding_backward(const Tensor& logits, const Tensor& topk_scores, const Tensor& topk_experts,
                                  const Tensor& token_offsets, const Tensor& expert, const Tensor& padded,
                                  const Tensor& d_score) {
  return translate_errors([&] {
    check_dims(logits, "logits", 2);
    check_tensor(logits, "logits", at::kFloat, logits.sizes());
    const int64_t T = logits.size(0), E = logits.size(1);
    check_dims(topk_scores, "topk_scores", 2);
    const int64_t K = topk_scores.size(1);
    const at::Device device = logits.device();
    check_tensor(topk_scores, "topk_scores", at::kFloat, {T, K}, &device);
    check_tensor(topk_experts, "topk_experts", at::kInt, {T, K}, &device);
    check_tensor(token_offsets, "token_offsets", at::kInt, {T + 1}, &device);
    check_tensor(expert, "expert", at::kInt, expert.sizes(), &device);
    check_tensor(padded, "padded", at::kBool, expert.sizes(), &device);
    check_tensor(d_score, "d_score", at::kFloat, expert.sizes(), &device);
    const c10::cuda::CUDAGuard guard(device);
    Tensor d_logits = at::empty({T, E}, logits.options());
    token_rounding_backward(logits.data_ptr<float>(), topk_scores.data_ptr<float>(), topk_experts.data_ptr<int32_t>(),
                            token_offsets.data_ptr<int32_t>(), expert.data_ptr<int32_t>(),
                            reinterpret_cast<const uint8_t*>(padded.data_ptr<bool>()), d_score.data_ptr<float>(),
                            T, E, K, d_logits.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    return d_logits;
  });
}

// The layer's router on its own (machmoe::router_forward): x [T, d] bf16, router_weight [E, d]
// bf16, router_bias [E] bf16 or absent -> (logits [T, E] fp32, scores [T, K] fp32, experts [T, K]
// int32, expert_offsets [E+1] int32, aux [] fp32).
RouterProblem router_problem(const Tensor& x, const Tensor& router_weight, int64_t K, const std::string& routing,
                             bool renormalize, double routed_scaling_factor, int64_t n_group, int64_t topk_group,
                             bool has_router_bias) {
  check_dims(x, "x", 2);
  check_dims(router_weight, "router_weight", 2);
  RouterProblem p;
  p.T = x.size(0), p.d = x.size(1), p.E = router_weight.size(0), p.K = K;
  p.routing = parse_routing(routing);
  p.renormalize = renormalize;
  p.options = RouterOptions{routed_scaling_factor, n_group, topk_group};
  p.has_router_bias = has_router_bias;
  const at::Device device = x.device();
  check_bf16(x, "x", x.sizes());
  check_bf16(router_weight, "router_weight", {p.E, p.d}, &device);
  return p;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> op_router_forward(
    const Tensor& x, const Tensor& router_weight, const std::optional<Tensor>& router_bias, int64_t K,
    const std::string& routing, bool renormalize, const std::optional<Tensor>& selection_bias,
    double routed_scaling_factor, int64_t n_group, int64_t topk_group) {
  return translate_errors([&] {
    const RouterProblem p = router_problem(x, router_weight, K, routing, renormalize, routed_scaling_factor, n_group,
                                           topk_group, router_bias.has_value());
    const at::Device device = x.device();
    const c10::cuda::CUDAGuard guard(device);
    if (router_bias) check_bf16(*router_bias, "router_bias", {p.E}, &device);
    if (selection_bias) check_tensor(*selection_bias, "selection_bias", at::kFloat, {p.E}, &device);
    const auto f32 = x.options().dtype(at::kFloat), i32 = x.options().dtype(at::kInt);
    Tensor logits = at::empty({p.T, p.E}, f32), scores = at::empty({p.T, K}, f32);
    Tensor experts = at::empty({p.T, K}, i32), offsets = at::empty({p.E + 1}, i32), aux = at::empty({}, f32);
    Tensor workspace = at::empty({static_cast<int64_t>(router_workspace_bytes(p))}, x.options().dtype(at::kByte));
    RouterForwardArgs a;
    a.x = x.data_ptr(), a.router_weight = router_weight.data_ptr();
    a.router_bias = router_bias ? router_bias->data_ptr() : nullptr;
    a.selection_bias = selection_bias ? selection_bias->data_ptr<float>() : nullptr;
    a.logits = logits.data_ptr<float>(), a.scores = scores.data_ptr<float>();
    a.experts = experts.data_ptr<int32_t>(), a.expert_offsets = offsets.data_ptr<int32_t>();
    a.aux_loss = aux.data_ptr<float>(), a.workspace = workspace.data_ptr();
    router_forward(p, a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(logits, scores, experts, offsets, aux);
  });
}

// Its backward: d_scores [T, K] fp32 and d_aux [] fp32 (each optional) -> (dx [T, d] bf16,
// d_router_weight [E, d] bf16, d_router_bias [E] bf16, or [0] without has_router_bias).
std::tuple<Tensor, Tensor, Tensor> op_router_backward(
    const Tensor& x, const Tensor& router_weight, const Tensor& logits, const Tensor& scores, const Tensor& experts,
    const Tensor& expert_offsets, const std::optional<Tensor>& d_scores, const std::optional<Tensor>& d_aux,
    bool has_router_bias, const std::string& routing, bool renormalize, double routed_scaling_factor,
    int64_t n_group, int64_t topk_group) {
  return translate_errors([&] {
    check_dims(scores, "scores", 2);
    const RouterProblem p = router_problem(x, router_weight, scores.size(1), routing, renormalize,
                                           routed_scaling_factor, n_group, topk_group, has_router_bias);
    const at::Device device = x.device();
    const c10::cuda::CUDAGuard guard(device);
    check_tensor(logits, "logits", at::kFloat, {p.T, p.E}, &device);
    check_tensor(scores, "scores", at::kFloat, {p.T, p.K}, &device);
    check_tensor(experts, "experts", at::kInt, {p.T, p.K}, &device);
    check_tensor(expert_offsets, "expert_offsets", at::kInt, {p.E + 1}, &device);
    if (d_scores) check_tensor(*d_scores, "d_scores", at::kFloat, {p.T, p.K}, &device);
    if (d_aux) check_tensor(*d_aux, "d_aux", at::kFloat, {}, &device);
    Tensor dx = at::empty_like(x), d_weight = at::empty_like(router_weight);
    Tensor d_bias = at::empty({has_router_bias ? p.E : 0}, router_weight.options());
    Tensor workspace = at::empty({static_cast<int64_t>(router_workspace_bytes(p))}, x.options().dtype(at::kByte));
    RouterBackwardArgs a;
    a.x = x.data_ptr(), a.router_weight = router_weight.data_ptr();
    a.logits = logits.data_ptr<float>(), a.scores = scores.data_ptr<float>();
    a.experts = experts.data_ptr<int32_t>(), a.expert_offsets = expert_offsets.data_ptr<int32_t>();
    a.d_scores = d_scores ? d_scores->data_ptr<float>() : nullptr;
    a.d_aux = d_aux ? d_aux->data_ptr<float>() : nullptr;
    a.dx = dx.data_ptr(), a.d_router_weight = d_weight.data_ptr();
    a.d_router_bias = has_router_bias ? d_bias.data_ptr() : nullptr;
    a.weight_grad_dtype = DType::BF16;
    a.workspace = workspace.data_ptr();
    router_backward(p, a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(dx, d_weight, d_bias);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("topk_router(Tensor logits, int K, str routing, bool renormalize, Tensor? selection_bias,"
        " float routed_scaling_factor=1.0, int n_group=1, int topk_group=1)"
        " -> (Tensor, Tensor)");
  m.def("topk_router_backward(Tensor logits, Tensor scores, Tensor experts, Tensor d_scores,"
        " str routing, bool renormalize, float routed_scaling_factor=1.0, int n_group=1, int topk_group=1)"
        " -> Tensor");
  m.def("router_forward(Tensor x, Tensor router_weight, Tensor? router_bias, int K, str routing, bool renormalize,"
        " Tensor? selection_bias, float routed_scaling_factor=1.0, int n_group=1, int topk_group=1)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("router_backward(Tensor x, Tensor router_weight, Tensor logits, Tensor scores, Tensor experts,"
        " Tensor expert_offsets, Tensor? d_scores, Tensor? d_aux, bool has_router_bias, str routing,"
        " bool renormalize, float routed_scaling_factor=1.0, int n_group=1, int topk_group=1)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("routing_metadata(Tensor pair_expert, Tensor? pair_token, int T, int E)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("exchange_plan(Tensor experts, Tensor scores, int E, int W, int rank)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("aggregate(Tensor rows, Tensor pair_row, Tensor token_offsets, Tensor? scores,"
        " ScalarType? out_dtype) -> Tensor");
  m.def("token_rounding(Tensor logits, int K, str mode, int tile_m, int seed)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("token_rounding_backward(Tensor logits, Tensor topk_scores, Tensor topk_experts,"
        " Tensor token_offsets, Tensor expert, Tensor padded, Tensor d_score) -> Tensor");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("topk_router", &op_topk_router);
  m.impl("topk_router_backward", &op_topk_router_backward);
  m.impl("router_forward", &op_router_forward);
  m.impl("router_backward", &op_router_backward);
  m.impl("routing_metadata", &op_routing_metadata);
  m.impl("exchange_plan", &op_exchange_plan);
  m.impl("aggregate", &op_aggregate);
  m.impl("token_rounding", &op_token_rounding);
  m.impl("token_rounding_backward", &op_token_rounding_backward);
}

}  // namespace machmoe::bindings
