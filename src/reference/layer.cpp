// CPU reference, the whole layer: router GEMM -> routing (top-K or token rounding) -> metadata ->
// experts -> output, and the backward through all of it including the router and the aux loss.
#include "machmoe/reference.hpp"

namespace machmoe::ref {

LayerForward layer_forward(const LayerConfig& c, const double* x, const double* wr,
                           const Weights& w, const double* selection_bias) {
  return layer_forward(c, x, wr, nullptr, w, selection_bias);
}

namespace {

// The experts' shape of a layer: its weights hold the routed and the shared experts.
Shape experts_shape(const LayerConfig& c) {
  Shape s = c.shape;
  s.E += c.num_shared;
  return s;
}

// The top-K list with each token's S shared pairs (t, E+s, shared_scores[t] or 1) after its K
// routed ones: ordered by token, as every list.
RoutingList with_shared_pairs(const TopK& topk, int64_t E, int64_t S, const double* shared_scores) {
  RoutingList r;
  for (int64_t t = 0; t < topk.T; ++t) {
    for (int64_t k = 0; k < topk.K; ++k) {
      r.token.push_back(static_cast<int32_t>(t));
      r.expert.push_back(topk.expert[t * topk.K + k]);
      r.score.push_back(topk.score[t * topk.K + k]);
    }
    for (int64_t s = 0; s < S; ++s) {
      r.token.push_back(static_cast<int32_t>(t));
      r.expert.push_back(static_cast<int32_t>(E + s));
      r.score.push_back(shared_scores ? shared_scores[t] : 1.0);
    }
  }
  return r;
}

}  // namespace

LayerForward layer_forward(const LayerConfig& c, const double* x, const double* wr, const double* br,
                           const Weights& w, const double* selection_bias, const double* shared_scores) {
  const Shape& s = c.shape;
  if (c.num_shared < 0 || (c.num_shared > 0 && c.rounding.mode != TokenRounding::None))
    throw Error(ErrorCode::InvalidArgument,
                "layer_forward: num_shared must be >= 0, and shared experts are not available with token rounding");
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
    f.list = c.num_shared > 0 ? with_shared_pairs(f.topk, s.E, c.num_shared, shared_scores) : to_list(f.topk);
  }
  const Shape se = experts_shape(c);
  f.md = build_metadata(f.list, s.T, se.E);
  f.experts = experts_forward(se, x, w, f.list, f.md);
  // The aux loss counts the routed pairs only.
  f.aux = c.num_shared > 0 ? aux_loss(f.logits.data(), s.T, s.E, f.topk.expert.data(), s.T * c.K)
                           : aux_loss(f.logits.data(), s.T, s.E, f.list.expert.data(), f.list.size());
  return f;
}

LayerGrads layer_backward(const LayerConfig& c, const double* x, const double* wr, const Weights& w,
                          const LayerForward& fwd, const double* dout, double d_aux) {
  const Shape& s = c.shape;
  ExpertsGrads eg = experts_backward(experts_shape(c), x, w, fwd.list, fwd.md, fwd.experts.H.data(), dout);
  LayerGrads g;
  // With shared experts the list is [T, K+S]: the router's d scores are the first K of each
  // token's, the shared experts' weights get the sum of the other S.
  const int64_t S = c.num_shared, W = c.K + S;
  std::vector<double> d_routed;
  if (S > 0) {
    g.d_shared_scores.assign(s.T, 0.0);
    for (int64_t t = 0; t < s.T; ++t) {
      for (int64_t k = 0; k < c.K; ++k) d_routed.push_back(eg.d_score[t * W + k]);
      for (int64_t j = 0; j < S; ++j) g.d_shared_scores[t] += eg.d_score[t * W + c.K + j];
    }
  }
  const double* d_router = S > 0 ? d_routed.data() : eg.d_score.data();
  g.d_logits = c.rounding.mode != TokenRounding::None
                   ? token_round_backward(fwd.logits.data(), s.T, s.E, fwd.rounded, eg.d_score.data())
                   : topk_route_backward(fwd.logits.data(), s.T, s.E, c.routing, c.renormalize, c.router,
                                         fwd.topk, d_router);
  if (S > 0)
    aux_loss_backward(fwd.logits.data(), s.T, s.E, fwd.topk.expert.data(), s.T * c.K, d_aux, g.d_logits.data());
  else
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
