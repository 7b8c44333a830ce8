// CPU reference, expert half: activations, the per-expert MLP forward on the expert-grouped rows,
// and its memory-minimal backward that uses only x, H, scores and the metadata.
#include <cmath>
#include <string>

#include "machmoe/reference.hpp"

namespace machmoe::ref {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // √(2/π)
constexpr double kGeluCubic = 0.044715;

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// f(h) and f'(h) of the scalar activations (GLU kinds use their gate function).
double act_value(Activation a, double h) {
  switch (a) {
    case Activation::SwiGLU:
    case Activation::SiLU: return h * sigmoid(h);
    case Activation::GeGLU:
    case Activation::GELU: return 0.5 * h * (1.0 + std::tanh(kSqrt2OverPi * (h + kGeluCubic * h * h * h)));
    case Activation::ReGLU:
    case Activation::ReLU: return h > 0 ? h : 0.0;
    case Activation::ReLU2: return h > 0 ? h * h : 0.0;
    case Activation::ClampedSwiGLU: break;  // glu_point
  }
  return NAN;
}

double act_derivative(Activation a, double h) {
  switch (a) {
    case Activation::SwiGLU:
    case Activation::SiLU: {
      const double s = sigmoid(h);
      return s * (1.0 + h * (1.0 - s));
    }
    case Activation::GeGLU:
    case Activation::GELU: {
      const double th = std::tanh(kSqrt2OverPi * (h + kGeluCubic * h * h * h));
      return 0.5 * (1.0 + th) +
             0.5 * h * (1.0 - th * th) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * h * h);
    }
    case Activation::ReGLU:
    case Activation::ReLU: return h > 0 ? 1.0 : 0.0;
    case Activation::ReLU2: return h > 0 ? 2.0 * h : 0.0;
    case Activation::ClampedSwiGLU: break;  // glu_point
  }
  return NAN;
}

// One GLU pair: A = f(g)·u and its partial derivatives ∂A/∂g, ∂A/∂u.
struct GluPoint {
  double a, da_dg, da_du;
};
GluPoint glu_point(Activation act, const GluClamp& c, double g, double u) {
  if (act != Activation::ClampedSwiGLU) return {act_value(act, g) * u, act_derivative(act, g) * u, act_value(act, g)};
  // docs/LAYER.md: the clamped SwiGLU. The parameters are floats; their exact values in double.
  const double L = c.limit, alpha = c.alpha;
  const double gc = !c.clamp_after && g > L ? L : g;
  const double sig = sigmoid(alpha * gc);
  const double silu = gc * sig;
  const double f = c.clamp_after && silu > L ? L : silu;
  const double uc = (u < -L ? -L : u > L ? L : u) + c.up_offset;
  // torch.clamp passes the gradient where min <= x <= max, bounds included.
  const bool gate_passes = c.clamp_after ? silu <= L : g <= L;
  const bool up_passes = -L <= u && u <= L;
  const double dsilu = sig * (1.0 + alpha * gc * (1.0 - sig));
  return {f * uc, gate_passes ? dsilu * uc : 0.0, up_passes ? f : 0.0};
}

// Column of gate j / up j inside a GLU row of 2n values.
int64_t gate_col(GateUpLayout l, int64_t /*n*/, int64_t j) { return l == GateUpLayout::Interleaved ? 2 * j : j; }
int64_t up_col(GateUpLayout l, int64_t n, int64_t j) { return l == GateUpLayout::Interleaved ? 2 * j + 1 : n + j; }

void check_shape(const Shape& s, const RoutingList& list, const Metadata& md) {
  if (s.T < 0 || s.d < 1 || s.n < 1 || s.E < 1)
    throw Error(ErrorCode::InvalidArgument, "experts: need T >= 0, d >= 1, n >= 1, E >= 1");
  if (static_cast<int64_t>(md.row_pair.size()) != list.size() ||
      static_cast<int64_t>(md.expert_offsets.size()) != s.E + 1)
    throw Error(ErrorCode::InvalidArgument, "experts: metadata does not match the routing list");
  check_glu_clamp("experts", s.act, s.clamp);
}

}  // namespace

void activation_forward(Activation act, GateUpLayout layout, int64_t n, const double* h, double* a,
                        const GluClamp& clamp) {
  for (int64_t j = 0; j < n; ++j)
    a[j] = is_glu(act) ? glu_point(act, clamp, h[gate_col(layout, n, j)], h[up_col(layout, n, j)]).a
                       : act_value(act, h[j]);
}

void activation_backward(Activation act, GateUpLayout layout, int64_t n, const double* h,
                         const double* da, double* dh, const GluClamp& clamp) {
  for (int64_t j = 0; j < n; ++j) {
    if (!is_glu(act)) {
      dh[j] = da[j] * act_derivative(act, h[j]);
      continue;
    }
    const GluPoint pt = glu_point(act, clamp, h[gate_col(layout, n, j)], h[up_col(layout, n, j)]);
    dh[gate_col(layout, n, j)] = da[j] * pt.da_dg;
    dh[up_col(layout, n, j)] = da[j] * pt.da_du;
  }
}

ExpertsForward experts_forward(const Shape& s, const double* x, const Weights& w,
                               const RoutingList& list, const Metadata& md) {
  check_shape(s, list, md);
  const int64_t R = list.size(), n1 = s.n1(), d = s.d, n = s.n;
  ExpertsForward f;
  f.H.assign(R * n1, 0.0);
  f.A.assign(R * n, 0.0);
  f.Y.assign(R * d, 0.0);
  f.out.assign(s.T * d, 0.0);
  for (int64_t e = 0; e < s.E; ++e) {
    const double* w1 = w.w1 + e * n1 * d;
    const double* w2 = w.w2 + e * d * n;
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r) {
      const int64_t p = md.row_pair[r], t = md.row_token[r];
      const double* xt = x + t * d;
      double* h = f.H.data() + r * n1;
      double* a = f.A.data() + r * n;
      double* y = f.Y.data() + r * d;
      for (int64_t c = 0; c < n1; ++c) {
        double acc = s.bias ? w.b1[e * n1 + c] : 0.0;
        for (int64_t k = 0; k < d; ++k) acc += xt[k] * w1[c * d + k];
        h[c] = acc;
      }
      activation_forward(s.act, s.layout, n, h, a, s.clamp);
      for (int64_t i = 0; i < d; ++i) {
        double acc = s.bias ? w.b2[e * d + i] : 0.0;
        for (int64_t j = 0; j < n; ++j) acc += a[j] * w2[i * n + j];
        y[i] = acc;
        f.out[t * d + i] += list.score[p] * acc;
      }
    }
  }
  return f;
}

ExpertsGrads experts_backward(const Shape& s, const double* x, const Weights& w,
                              const RoutingList& list, const Metadata& md, const double* H,
                              const double* dout) {
  check_shape(s, list, md);
  const int64_t R = list.size(), n1 = s.n1(), d = s.d, n = s.n, E = s.E;
  ExpertsGrads g;
  g.dx.assign(s.T * d, 0.0);
  g.dw1.assign(E * n1 * d, 0.0);
  g.dw2.assign(E * d * n, 0.0);
  if (s.bias) {
    g.db1.assign(E * n1, 0.0);
    g.db2.assign(E * d, 0.0);
  }
  g.d_score.assign(R, 0.0);
  std::vector<double> da(n), a(n), dh(n1);
  for (int64_t e = 0; e < E; ++e) {
    const double* w1 = w.w1 + e * n1 * d;
    const double* w2 = w.w2 + e * d * n;
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r) {
      const int64_t p = md.row_pair[r], t = md.row_token[r];
      const double sc = list.score[p];
      const double* xt = x + t * d;
      const double* go = dout + t * d;
      const double* h = H + r * n1;
      // dA' = dO_t · W2_e  [n], and A recomputed from H
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < d; ++i) acc += go[i] * w2[i * n + j];
        da[j] = acc;
      }
      activation_forward(s.act, s.layout, n, h, a.data(), s.clamp);
      double ds = 0;
      for (int64_t j = 0; j < n; ++j) ds += da[j] * a[j];
      if (s.bias)
        for (int64_t i = 0; i < d; ++i) ds += go[i] * w.b2[e * d + i];
      g.d_score[p] = ds;
      for (int64_t j = 0; j < n; ++j) da[j] *= sc;  // s · dA'
      activation_backward(s.act, s.layout, n, h, da.data(), dh.data(), s.clamp);
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < n; ++j) g.dw2[(e * d + i) * n + j] += sc * a[j] * go[i];
        if (s.bias) g.db2[e * d + i] += sc * go[i];
      }
      for (int64_t c = 0; c < n1; ++c) {
        for (int64_t k = 0; k < d; ++k) {
          g.dw1[(e * n1 + c) * d + k] += dh[c] * xt[k];
          g.dx[t * d + k] += dh[c] * w1[c * d + k];
        }
        if (s.bias) g.db1[e * n1 + c] += dh[c];
      }
    }
  }
  return g;
}

}  // namespace machmoe::ref
