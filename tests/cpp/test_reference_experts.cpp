// Tests of the CPU reference's experts (include/machmoe/reference.hpp) against docs/LAYER.md:
// the experts on a general routing list against the naive per-token MLPs and finite differences,
// and each activation's forward and backward. Tiny sizes; random data from per-test seeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "machmoe/reference.hpp"
#include "test_formulas.hpp"
#include "test_reference_case.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using namespace mtest;  // Rng, Vec, the formulas of test_formulas.hpp, the cases of test_reference_case.hpp

// ================================================================ experts and general routing
class Experts : public ::testing::TestWithParam<std::tuple<int, bool>> {};
TEST_P(Experts, ForwardMatchesNaiveAndGradients) {
  const auto [ai, bias] = GetParam();
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Case cs = make_case(rng, 7, 4, 3, 5, 1, kActs[ai], bias, kRoutes[0]);
  const auto& s = cs.c.shape;
  ref::RoutingList l;
  do l = random_list(rng, s.T, s.E, true);
  while (l.size() == 0);
  l.score = mtest::uniform(rng, l.size(), -1.5, 1.5);
  const auto f = ref::general_forward(s, cs.x.data(), cs.W(), l);
  EXPECT_TRUE(
      mtest::all_close("out", f.experts.out, naive_out(s, cs.x.data(), cs.W(), l), 1e-11, 1e-12));
  EXPECT_EQ(f.aux, 0.0);
  const auto md = ref::build_metadata(l, s.T, s.E);
  const int64_t n1 = s.n1();
  ASSERT_EQ(f.experts.H.size(), size_t(l.size() * n1));
  for (int64_t r = 0; r < l.size(); ++r) {  // H, A, Y in row order
    const int32_t p = md.row_pair[r];
    const Vec h = my_h(s, cs.x.data(), cs.W(), l.token[p], l.expert[p]);
    const Vec a = my_act(s.act, s.layout, s.n, h.data());
    const Vec y = my_y(s, cs.x.data(), cs.W(), l.token[p], l.expert[p]);
    EXPECT_TRUE(mtest::all_close("H", Vec(&f.experts.H[r * n1], &f.experts.H[(r + 1) * n1]), h));
    EXPECT_TRUE(mtest::all_close("A", Vec(&f.experts.A[r * s.n], &f.experts.A[(r + 1) * s.n]), a,
                                 1e-12, 1e-13));
    EXPECT_TRUE(mtest::all_close("Y", Vec(&f.experts.Y[r * s.d], &f.experts.Y[(r + 1) * s.d]), y,
                                 1e-12, 1e-12));
  }
  const auto g = ref::general_backward(s, cs.x.data(), cs.W(), f, cs.dout.data());
  EXPECT_TRUE(g.dwr.empty());
  EXPECT_TRUE(g.d_logits.empty());
  const auto eg =
      ref::experts_backward(s, cs.x.data(), cs.W(), l, md, f.experts.H.data(), cs.dout.data());
  EXPECT_TRUE(mtest::all_close("experts_backward dw1", eg.dw1, g.dw1));
  EXPECT_TRUE(mtest::all_close("experts_backward d_score", eg.d_score, g.d_score));
  // Tokens without pairs: zero output and zero dx; experts without rows: exactly zero gradients.
  for (int64_t t = 0; t < s.T; ++t)
    if (md.token_offsets[t] == md.token_offsets[t + 1])
      for (int64_t i = 0; i < s.d; ++i) {
        EXPECT_EQ(f.experts.out[t * s.d + i], 0.0);
        EXPECT_EQ(g.dx[t * s.d + i], 0.0);
      }
  for (int64_t e = 0; e < s.E; ++e)
    if (md.expert_offsets[e] == md.expert_offsets[e + 1]) {
      for (int64_t i = 0; i < n1 * s.d; ++i) EXPECT_EQ(g.dw1[e * n1 * s.d + i], 0.0);
      for (int64_t i = 0; i < s.d * s.n; ++i) EXPECT_EQ(g.dw2[e * s.d * s.n + i], 0.0);
      if (bias) {
        for (int64_t i = 0; i < n1; ++i) EXPECT_EQ(g.db1[e * n1 + i], 0.0);
        for (int64_t i = 0; i < s.d; ++i) EXPECT_EQ(g.db2[e * s.d + i], 0.0);
      }
    }
  if (!bias) EXPECT_TRUE(g.db1.empty() && g.db2.empty());
  // Finite differences of L = <dout, out> w.r.t. everything, the scores included.
  const std::function<Eval()> ev = [&] {
    const auto f2 = ref::general_forward(s, cs.x.data(), cs.W(), l);
    Eval e{mtest::dot(cs.dout, f2.experts.out), 0, {}};
    for (size_t i = 0; i < cs.dout.size(); ++i) e.Lmag += std::fabs(cs.dout[i] * f2.experts.out[i]);
    for (int64_t j : kink_cols(s.act, s.layout, s.n))
      for (int64_t r = 0; r < l.size(); ++r) e.sig.push_back(f2.experts.H[r * n1 + j] > 0);
    return e;
  };
  check_fd("d_score", g.d_score, l.score, ev);
  check_fd("dx", g.dx, cs.x, ev);
  check_fd("dw1", g.dw1, cs.w1, ev);
  check_fd("dw2", g.dw2, cs.w2, ev);
  if (bias) {
    check_fd("db1", g.db1, cs.b1, ev);
    check_fd("db2", g.db2, cs.b2, ev);
  }
}
INSTANTIATE_TEST_SUITE_P(All, Experts,
                         ::testing::Combine(::testing::Range(0, 10), ::testing::Bool()),
                         [](const auto& i) {
                           return std::string(kActs[std::get<0>(i.param)].name) +
                                  (std::get<1>(i.param) ? "_bias" : "_nobias");
                         });

TEST(ActivationFn, ForwardBackwardAndReluAtZero) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t n = 5;
  for (const auto& av : kActs) {
    SCOPED_TRACE(av.name);
    const int64_t n1 = is_glu(av.a) ? 2 * n : n;
    Vec h;
    do h = mtest::uniform(rng, n1, -2.5, 2.5);
    while (std::any_of(h.begin(), h.end(), [](double v) { return std::fabs(v) < 1e-3; }));
    const Vec da = mtest::uniform(rng, n, -1, 1);
    Vec a(n), dh(n1);
    ref::activation_forward(av.a, av.l, n, h.data(), a.data());
    EXPECT_TRUE(mtest::all_close("act", a, my_act(av.a, av.l, n, h.data()), 1e-13, 1e-14));
    ref::activation_backward(av.a, av.l, n, h.data(), da.data(), dh.data());
    const FD fd = fd_grad(h, [&] {
      Vec a2(n);
      ref::activation_forward(av.a, av.l, n, h.data(), a2.data());
      Eval e{mtest::dot(da, a2), 1.0, {}};
      for (double v : h) e.sig.push_back(v > 0);
      return e;
    });
    EXPECT_TRUE(mtest::grad_close("dh", dh, fd.g, &fd.mask, fd_tol(1.0)));
    if (kinked(av.a)) {  // relu'(0) = 0: exactly zero gate / input gradient at 0
      Vec hz = h;
      for (int64_t j : kink_cols(av.a, av.l, n)) hz[j] = 0.0;
      ref::activation_backward(av.a, av.l, n, hz.data(), da.data(), dh.data());
      for (int64_t j : kink_cols(av.a, av.l, n)) EXPECT_EQ(dh[j], 0.0) << "column " << j;
    }
  }
}

// ================================================================ the clamped SwiGLU
// The three variants (gpt-oss, DeepSeek-V4, the post-activation clamp) written out here from the
// models' definitions, independently of the reference: gate g, up u, L = limit.
double clamped_glu_formula(const GluClamp& c, double g, double u) {
  const double L = c.limit;
  const double uc = std::min(std::max(u, -L), L) + c.up_offset;
  if (c.clamp_after) return std::min(g * sigm(c.alpha * g), L) * uc;
  const double gc = std::min(g, L);
  return gc * sigm(c.alpha * gc) * uc;
}

struct ClampVariant {
  GluClamp c;
  const char* name;
};
const ClampVariant kClampVariants[] = {{GluClamp{}, "gpt_oss"},
                                       {GluClamp{1.f, 10.f, 0.f, false}, "deepseek_v4"},
                                       {GluClamp{1.f, 3.f, 0.f, true}, "post_activation"}};

// Values against the formula, derivatives against central differences, at points on both sides
// of every clamp (at least 0.05 from a boundary, so that the difference step never crosses it),
// in both layouts.
TEST(ClampedSwiGLU, ValuesAndDerivativesOnBothSidesOfEachClamp) {
  for (const auto& v : kClampVariants) {
    for (GateUpLayout l : {GateUpLayout::Interleaved, GateUpLayout::Concatenated}) {
      SCOPED_TRACE(std::string(v.name) + (l == GateUpLayout::Interleaved ? " interleaved" : " concatenated"));
      const double L = v.c.limit;
      // Gates: far below, below and above the gate clamp (or, clamp_after, where silu(g) is below
      // and above L: silu(g) = L near g = L + small); ups: inside and outside [-L, L] on both sides.
      const Vec gates = {-2.0 * L, -1.3, 0.7, L - 0.4, L - 0.05 * L, L + 0.3, 1.5 * L + 0.2, 3.0 * L};
      const Vec ups = {-2.0 * L, -L - 0.2, -L + 0.2, -0.4, 0.9, L - 0.2, L + 0.2, 2.5 * L};
      const int64_t n = static_cast<int64_t>(gates.size() * ups.size());
      Vec h(2 * n);
      for (size_t i = 0; i < gates.size(); ++i)
        for (size_t k = 0; k < ups.size(); ++k) {
          const int64_t j = static_cast<int64_t>(i * ups.size() + k);
          h[gate_col(l, n, j)] = gates[i];
          h[up_col(l, n, j)] = ups[k];
        }
      Vec a(n), dh(2 * n), da(n, 0.0);
      ref::activation_forward(Activation::ClampedSwiGLU, l, n, h.data(), a.data(), v.c);
      for (int64_t j = 0; j < n; ++j)
        EXPECT_NEAR(a[j], clamped_glu_formula(v.c, h[gate_col(l, n, j)], h[up_col(l, n, j)]),
                    1e-13 * (1 + std::fabs(a[j])))
            << "column " << j;
      // d A_j / d H by central differences, one column at a time (dA = e_j).
      constexpr double eps = 1e-6;
      for (int64_t j = 0; j < n; ++j) {
        std::fill(da.begin(), da.end(), 0.0);
        da[j] = 1.0;
        ref::activation_backward(Activation::ClampedSwiGLU, l, n, h.data(), da.data(), dh.data(), v.c);
        for (int64_t col : {gate_col(l, n, j), up_col(l, n, j)}) {
          Vec hp = h, hm = h, ap(n), am(n);
          hp[col] += eps;
          hm[col] -= eps;
          ref::activation_forward(Activation::ClampedSwiGLU, l, n, hp.data(), ap.data(), v.c);
          ref::activation_forward(Activation::ClampedSwiGLU, l, n, hm.data(), am.data(), v.c);
          const double fd = (ap[j] - am[j]) / (2 * eps);
          EXPECT_NEAR(dh[col], fd, 1e-6 * (1 + std::fabs(fd))) << "column " << j << ", H column " << col;
        }
      }
      // A clamp passes the gradient at its bound (torch.clamp: min <= x <= max): g = L (pre-clamp)
      // and u = ±L give the derivative of the unclamped function there.
      if (!v.c.clamp_after) {
        const double g = L, sig = sigm(v.c.alpha * g);
        const double dsilu = sig * (1 + v.c.alpha * g * (1 - sig));
        for (double u : {-L, L}) {
          Vec hb(2), ab(1), dhb(2), one = {1.0};
          hb[gate_col(l, 1, 0)] = g;
          hb[up_col(l, 1, 0)] = u;
          ref::activation_backward(Activation::ClampedSwiGLU, l, 1, hb.data(), one.data(), dhb.data(), v.c);
          EXPECT_NEAR(dhb[gate_col(l, 1, 0)], dsilu * (u + v.c.up_offset), 1e-13) << "u = " << u;
          EXPECT_NEAR(dhb[up_col(l, 1, 0)], g * sig, 1e-13) << "u = " << u;
        }
      }
    }
  }
}

TEST(ClampedSwiGLU, ParametersAreChecked) {
  EXPECT_NO_THROW(check_glu_clamp("t", Activation::ClampedSwiGLU, GluClamp{1.f, 10.f, 0.f, true}));
  EXPECT_NO_THROW(check_glu_clamp("t", Activation::SwiGLU, GluClamp{}));
  EXPECT_THROW(check_glu_clamp("t", Activation::SwiGLU, GluClamp{1.f, 7.f, 1.f, false}), Error);
  EXPECT_THROW(check_glu_clamp("t", Activation::ClampedSwiGLU, GluClamp{0.f, 7.f, 1.f, false}), Error);
  EXPECT_THROW(check_glu_clamp("t", Activation::ClampedSwiGLU, GluClamp{1.f, -1.f, 1.f, false}), Error);
  EXPECT_THROW(check_glu_clamp("t", Activation::ClampedSwiGLU, GluClamp{1.f, NAN, 1.f, false}), Error);
  EXPECT_THROW(check_glu_clamp("t", Activation::ClampedSwiGLU, GluClamp{1.f, 7.f, INFINITY, false}), Error);
}

}  // namespace
