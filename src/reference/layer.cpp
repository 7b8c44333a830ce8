// CPU reference, the whole layer: router GEMM -> routing (top-K or token rounding) -> metadata ->
// experts -> output, and the backward through all of it including the router and the aux loss.
#include "machmoe/reference.hpp"

namespace machmoe::ref {

LayerForward layer_forward(const LayerConfig& c, const double* x, const double* wr,
                           const Weights& w, const double* selection_bias) {
  return layer_forward(c, x, wr, nullptr, w, selection_bias);
}

LayerForward layer_forward(const LayerConfig& c, const double* x, const double* wr, const double* br,
                           const Weights& w, const double* selection_bias) {
  const Shape& s = c.shape;
  if (c.rounding.mode != TokenRounding::None && c.routing != RoutingMethod::SoftmaxTopK)
    throw Error(ErrorCode::InvalidArgument,
                "layer_forward: token rounding is defined for routing=softmax_topk only");
  if (c.rounding.mode != TokenRounding::None && (c.router.routed_scaling_factor != 1.0 || c.router.n_group != 1))
    throw Error(ErrorCode::InvalidArgument,
                "layer_forward: token rounding takes no routed_scaling_factor and no group-limited selection");
  LayerForward f;
  f.logits.assign(s.T * s.E, 0.0);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t e = 0; e < s.E; ++e) {
      double acc = br ? br[e] : 0.0;
      for (int64_t k = 0; k < s.d; ++k) acc += x[t * s.d + k] * wr[e * s.d + k];
      f.logits[t * s.E + e] = acc;
    }
  f.topk = topk_route(f.logits.data(), s.T, s.E, c.K, c.routing, c.renormalize, c.router, selection_bias);
  if (c.rounding.mode != TokenRounding::None) {
    f.rounded = token_round(f.logits.data(), s.T, s.E, c.K, c.rounding);
    f.list = f.rounded.list;
  } else {
    f.list = to_list(f.topk);
  }
  f.md = build_metadata(f.list, s.T, s.E);
  f.experts = experts_forward(s, x, w, f.list, f.md);
  f.aux = aux_loss(f.logits.data(), s.T, s.E, f.list.expert.data(), f.list.size());
  return f;
}

LayerGrads layer_backward(const LayerConfig& c, const double* x, const double* wr, const Weights& w,
                          const LayerForward& fwd, const double* dout, double d_aux) {
  const Shape& s = c.shape;
  ExpertsGrads eg = experts_backward(s, x, w, fwd.list, fwd.md, fwd.experts.H.data(), dout);
  LayerGrads g;
  g.d_logits = c.rounding.mode != TokenRounding::None
                   ? token_round_backward(fwd.logits.data(), s.T, s.E, fwd.rounded, eg.d_score.data())
                   : topk_route_backward(fwd.logits.data(), s.T, s.E, c.routing, c.renormalize, c.router,
                                         fwd.topk, eg.d_score.data());
  aux_loss_backward(fwd.logits.data(), s.T, s.E, fwd.list.expert.data(), fwd.list.size(), d_aux,
                    g.d_logits.data());
  // The router GEMM: dWr = dlogitsᵀ·x [E, d]; its part of dx is dlogits·Wr [T, d].
  g.dwr.assign(s.E * s.d, 0.0);
  g.dbr.assign(s.E, 0.0);  // the router bias's gradient: Σ_t d_logits
  g.dx = std::move(eg.dx);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t e = 0; e < s.E; ++e) {
      const double dl = g.d_logits[t * s.E + e];
      g.dbr[e] += dl;
      for (int64_t k = 0; k < s.d; ++k) {
        g.dwr[e * s.d + k] += dl * x[t * s.d + k];
        g.dx[t * s.d + k] += dl * wr[e * s.d + k];
      }
    }
  g.dw1 = std::move(eg.dw1);
  g.db1 = std::move(eg.db1);
  g.dw2 = std::move(eg.dw2);
  g.db2 = std::move(eg.db2);
  g.d_score = std::move(eg.d_score);
  return g;
}

LayerForward general_forward(const Shape& s, const double* x, const Weights& w,
                             const RoutingList& list) {
  LayerForward f;
  f.list = list;
  f.md = build_metadata(f.list, s.T, s.E);
  f.experts = experts_forward(s, x, w, f.list, f.md);
  return f;
}

LayerGrads general_backward(const Shape& s, const double* x, const Weights& w,
                            const LayerForward& fwd, const double* dout) {
  ExpertsGrads eg = experts_backward(s, x, w, fwd.list, fwd.md, fwd.experts.H.data(), dout);
  LayerGrads g;
  g.dx = std::move(eg.dx);
  g.dw1 = std::move(eg.dw1);
  g.db1 = std::move(eg.db1);
  g.dw2 = std::move(eg.dw2);
  g.db2 = std::move(eg.db2);
  g.d_score = std::move(eg.d_score);
  return g;
}

}  // namespace machmoe::ref
