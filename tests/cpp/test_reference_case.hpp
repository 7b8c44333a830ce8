// The random layer cases the CPU reference's tests share (test_reference*.cpp): the routing and
// activation variants, a layer call's data (Case) drawn clear of the kinks where finite
// differences fail, and the scalar loss the gradient checks differentiate (eval_case).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "machmoe/reference.hpp"
#include "test_formulas.hpp"
#include "test_util.hpp"

namespace mtest {

struct RouteV {
  RoutingMethod m;
  bool renorm, sbias;
  const char* name;
};
inline const char* const kModeNames[] = {"none", "nearest", "up", "down", "stochastic"};
inline const RouteV kRoutes[] = {{RoutingMethod::SoftmaxTopK, true, false, "softmax_topk"},
                          {RoutingMethod::TopKSoftmax, true, false, "topk_softmax_renorm"},
                          {RoutingMethod::TopKSoftmax, false, false, "topk_softmax"},
                          {RoutingMethod::Sigmoid, true, false, "sigmoid_renorm"},
                          {RoutingMethod::Sigmoid, false, false, "sigmoid"},
                          {RoutingMethod::Sigmoid, true, true, "sigmoid_renorm_bias"},
                          {RoutingMethod::Sigmoid, false, true, "sigmoid_bias"}};
struct ActV {
  Activation a;
  GateUpLayout l;
  const char* name;
};
inline const ActV kActs[] = {{Activation::SwiGLU, GateUpLayout::Interleaved, "swiglu_il"},
                      {Activation::SwiGLU, GateUpLayout::Concatenated, "swiglu_cat"},
                      {Activation::GeGLU, GateUpLayout::Interleaved, "geglu_il"},
                      {Activation::GeGLU, GateUpLayout::Concatenated, "geglu_cat"},
                      {Activation::ReGLU, GateUpLayout::Interleaved, "reglu_il"},
                      {Activation::ReGLU, GateUpLayout::Concatenated, "reglu_cat"},
                      {Activation::ReLU2, GateUpLayout::Interleaved, "relu2"},
                      {Activation::ReLU, GateUpLayout::Interleaved, "relu"},
                      {Activation::GELU, GateUpLayout::Interleaved, "gelu"},
                      {Activation::SiLU, GateUpLayout::Interleaved, "silu"}};

struct Case {
  ref::LayerConfig c;
  Vec x, wr, w1, b1, w2, b2, sb, dout;
  double d_aux = 0;
  ref::Weights W() const {
    return {w1.data(), c.shape.bias ? b1.data() : nullptr, w2.data(),
            c.shape.bias ? b2.data() : nullptr};
  }
  const double* sbias() const { return sb.empty() ? nullptr : sb.data(); }
  Vec logits() const {
    const auto& s = c.shape;
    Vec l(s.T * s.E, 0.0);
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t e = 0; e < s.E; ++e)
        for (int64_t i = 0; i < s.d; ++i) l[t * s.E + e] += x[t * s.d + i] * wr[e * s.d + i];
    return l;
  }
};

// Random data, redrawn until routing keys and relu inputs are clear of their kinks by 1e-4 (and at
// least a third of the relu inputs are positive, so that the layer is not dead).
inline Case make_case(Rng& rng, int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, const ActV& av,
               bool bias, const RouteV& rv,
               ref::TokenRoundingOptions ro = {TokenRounding::None, 128, 0}) {
  Case cs;
  auto& s = cs.c.shape;
  s.T = T, s.d = d, s.n = n, s.E = E, s.act = av.a, s.layout = av.l, s.bias = bias;
  cs.c.K = K, cs.c.routing = rv.m, cs.c.renormalize = rv.renorm, cs.c.rounding = ro;
  for (int attempt = 0; attempt < 200; ++attempt) {
    cs.x = mtest::uniform(rng, T * d, -1, 1);
    cs.wr = mtest::uniform(rng, E * d, -1.5, 1.5);
    cs.w1 = mtest::uniform(rng, E * s.n1() * d, -1.5 / std::sqrt(d), 1.5 / std::sqrt(d));
    cs.b1 = mtest::uniform(rng, E * s.n1(), -0.5, 0.5);
    cs.w2 = mtest::uniform(rng, E * d * n, -1.0 / std::sqrt(n), 1.0 / std::sqrt(n));
    cs.b2 = mtest::uniform(rng, E * d, -0.5, 0.5);
    cs.sb = rv.sbias ? mtest::uniform(rng, E, -0.3, 0.3) : Vec{};
    cs.dout = mtest::uniform(rng, T * d, -1, 1);
    cs.d_aux = mtest::uniform(rng, 1, 0.3, 1.2)[0];
    bool ok = true;
    int64_t live = 0, kinks = 0;  // relu-type inputs: enough of them positive for a live layer
    const Vec l = cs.logits();
    for (int64_t t = 0; t < T && ok; ++t) {
      Vec k(E);
      for (int64_t e = 0; e < E; ++e) k[e] = sel_key(rv.m, cs.sbias(), l[t * E + e], e);
      std::sort(k.begin(), k.end(), std::greater<double>());
      for (int64_t e = 0; e + 1 < E; ++e)  // all gaps: ranks, and token rounding's ranking keys
        ok = ok && k[e] - k[e + 1] > 1e-4;
      for (int64_t e = 0; e < E && ok; ++e) {
        const Vec h = my_h(s, cs.x.data(), cs.W(), t, e);
        for (int64_t j : kink_cols(s.act, s.layout, n))
          ok = ok && std::fabs(h[j]) > 1e-4, live += h[j] > 0, ++kinks;
      }
    }
    if (ok && 3 * live >= kinks) return cs;
  }
  ADD_FAILURE() << "could not draw data clear of kinks";
  return cs;
}

inline Eval eval_case(const Case& cs) {
  const auto f = ref::layer_forward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), cs.sbias());
  Eval ev;
  ev.L = mtest::dot(cs.dout, f.experts.out) + cs.d_aux * f.aux;
  for (size_t i = 0; i < cs.dout.size(); ++i) ev.Lmag += std::fabs(cs.dout[i] * f.experts.out[i]);
  ev.Lmag += std::fabs(cs.d_aux * f.aux);
  for (int64_t p = 0; p < f.list.size(); ++p) {
    ev.sig.push_back(f.list.token[p]);
    ev.sig.push_back(f.list.expert[p]);
    if (!f.rounded.padded.empty()) ev.sig.push_back(f.rounded.padded[p]);
  }
  const int64_t n1 = cs.c.shape.n1();
  const auto cols = kink_cols(cs.c.shape.act, cs.c.shape.layout, cs.c.shape.n);
  for (int64_t r = 0; r < f.list.size(); ++r)
    for (int64_t j : cols) ev.sig.push_back(f.experts.H[r * n1 + j] > 0);
  return ev;
}


}  // namespace mtest
