// Formulas of docs/LAYER.md re-derived for the tests, independently of src/host: activations,
// naive per-token expert MLPs, routing scores, aux loss, splitmix64, random general routing lists.
// Used by the CPU reference's tests (test_reference*.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "machmoe/reference.hpp"
#include "test_util.hpp"

namespace mtest {

using namespace machmoe;
using Vec = std::vector<double>;

inline double sigm(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double gelu_tanh(double h) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * h * (1.0 + std::tanh(c * (h + 0.044715 * h * h * h)));
}
// The scalar function: act itself for plain activations, the gate function f for GLU ones.
inline double act_fn(Activation a, double h) {
  switch (a) {
    case Activation::SwiGLU:
    case Activation::SiLU:
      return h * sigm(h);
    case Activation::GeGLU:
    case Activation::GELU:
      return gelu_tanh(h);
    case Activation::ReGLU:
    case Activation::ReLU:
      return h > 0 ? h : 0.0;
    case Activation::ReLU2:
      return h > 0 ? h * h : 0.0;
    case Activation::ClampedSwiGLU:  // not a function of the gate alone: see the ClampedSwiGLU tests
      break;
  }
  return NAN;
}
inline int64_t gate_col(GateUpLayout l, int64_t n, int64_t j) {
  return l == GateUpLayout::Interleaved ? 2 * j : j;
}
inline int64_t up_col(GateUpLayout l, int64_t n, int64_t j) {
  return l == GateUpLayout::Interleaved ? 2 * j + 1 : n + j;
}
inline bool kinked(Activation a) {
  return a == Activation::ReLU || a == Activation::ReLU2 || a == Activation::ReGLU;
}
// Columns of H at which act has a kink (relu-type inputs).
inline std::vector<int64_t> kink_cols(Activation a, GateUpLayout l, int64_t n) {
  std::vector<int64_t> c;
  if (!kinked(a)) return c;
  for (int64_t j = 0; j < n; ++j) c.push_back(is_glu(a) ? gate_col(l, n, j) : j);
  return c;
}
inline Vec my_act(Activation a, GateUpLayout l, int64_t n, const double* h) {
  Vec out(n);
  for (int64_t j = 0; j < n; ++j)
    out[j] = is_glu(a) ? act_fn(a, h[gate_col(l, n, j)]) * h[up_col(l, n, j)] : act_fn(a, h[j]);
  return out;
}
// H of one (token, expert): x_t W1_e^T (+ b1_e).
inline Vec my_h(const ref::Shape& s, const double* x, const ref::Weights& w, int64_t t, int64_t e) {
  const int64_t n1 = s.n1();
  Vec h(n1);
  for (int64_t j = 0; j < n1; ++j) {
    double acc = s.bias ? w.b1[e * n1 + j] : 0.0;
    for (int64_t i = 0; i < s.d; ++i) acc += x[t * s.d + i] * w.w1[(e * n1 + j) * s.d + i];
    h[j] = acc;
  }
  return h;
}
// Y of one (token, expert).
inline Vec my_y(const ref::Shape& s, const double* x, const ref::Weights& w, int64_t t, int64_t e) {
  const Vec h = my_h(s, x, w, t, e);
  const Vec a = my_act(s.act, s.layout, s.n, h.data());
  Vec y(s.d);
  for (int64_t i = 0; i < s.d; ++i) {
    double acc = s.bias ? w.b2[e * s.d + i] : 0.0;
    for (int64_t j = 0; j < s.n; ++j) acc += a[j] * w.w2[(e * s.d + i) * s.n + j];
    y[i] = acc;
  }
  return y;
}
// The naive per-token layer output: out_t = sum over t's pairs of s * Y(t, e).
inline Vec naive_out(const ref::Shape& s, const double* x, const ref::Weights& w,
                     const ref::RoutingList& l) {
  Vec out(s.T * s.d, 0.0);
  for (int64_t p = 0; p < l.size(); ++p) {
    const Vec y = my_y(s, x, w, l.token[p], l.expert[p]);
    for (int64_t i = 0; i < s.d; ++i) out[l.token[p] * s.d + i] += l.score[p] * y[i];
  }
  return out;
}
inline Vec softmax_rows(const double* logits, int64_t T, int64_t E) {
  Vec P(T * E);
  for (int64_t t = 0; t < T; ++t) {
    double m = -INFINITY, z = 0;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, logits[t * E + e]);
    for (int64_t e = 0; e < E; ++e) z += (P[t * E + e] = std::exp(logits[t * E + e] - m));
    for (int64_t e = 0; e < E; ++e) P[t * E + e] /= z;
  }
  return P;
}
inline double sel_key(RoutingMethod m, const double* bias, double logit, int64_t e) {
  return m == RoutingMethod::Sigmoid ? sigm(logit) + (bias ? bias[e] : 0.0) : logit;
}
struct MyTopK {
  std::vector<int32_t> expert;
  Vec score;
};
inline MyTopK my_topk(const Vec& logits, int64_t T, int64_t E, int64_t K, RoutingMethod m,
                      bool renorm, const double* bias) {
  MyTopK r{std::vector<int32_t>(T * K), Vec(T * K)};
  const Vec P = softmax_rows(logits.data(), T, E);
  for (int64_t t = 0; t < T; ++t) {
    const double* l = &logits[t * E];
    std::vector<int32_t> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {  // NaN is the largest
      const double ka = sel_key(m, bias, l[a], a), kb = sel_key(m, bias, l[b], b);
      return ka > kb || (std::isnan(ka) && !std::isnan(kb));
    });
    double mx = -INFINITY, z = 0;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, l[idx[k]]);
    Vec s(K);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[k];
      s[k] = m == RoutingMethod::SoftmaxTopK   ? std::exp(l[e] - mx)
             : m == RoutingMethod::TopKSoftmax ? P[t * E + e]
                                               : sigm(l[e]);
      z += s[k];
    }
    const bool div = m == RoutingMethod::SoftmaxTopK || renorm;
    for (int64_t k = 0; k < K; ++k) {
      r.expert[t * K + k] = idx[k];
      r.score[t * K + k] = div ? s[k] / z : s[k];
    }
  }
  return r;
}
inline double my_aux(const Vec& logits, int64_t T, int64_t E, const std::vector<int32_t>& expert) {
  if (T == 0 || expert.empty()) return 0.0;
  const Vec P = softmax_rows(logits.data(), T, E);
  Vec col(E, 0.0), freq(E, 0.0);
  double tot = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) col[e] += P[t * E + e], tot += P[t * E + e];
  for (int32_t e : expert) freq[e] += 1;
  double a = 0;
  for (int64_t e = 0; e < E; ++e) a += col[e] / tot * freq[e] / double(expert.size());
  return double(E) * a;
}
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline double my_uniform(uint64_t seed, int64_t e) {
  return double(splitmix64(seed ^ (uint64_t(e) * 0x9E3779B97F4A7C15ull)) >> 11) /
         9007199254740992.0;
}

// A general list: each token gets 0..E pairs with experts in random order (repeats when `dups`).
inline ref::RoutingList random_list(Rng& rng, int64_t T, int64_t E, bool dups) {
  ref::RoutingList l;
  for (int64_t t = 0; t < T; ++t) {
    const size_t start = l.expert.size();
    const int64_t c = rng() % (E + 1);
    for (int64_t i = 0; i < c; ++i) {
      const int32_t e = int32_t(rng() % E);
      if (!dups && std::count(l.expert.begin() + start, l.expert.end(), e)) continue;
      l.token.push_back(int32_t(t));
      l.expert.push_back(e);
      l.score.push_back(mtest::uniform(rng, 1, -1, 1)[0]);
    }
  }
  return l;
}
}  // namespace mtest
