// Tests of the CPU reference (include/machmoe/reference.hpp) against docs/LAYER.md: formulas
// re-derived independently (test_formulas.hpp), finite differences for every gradient, and the
// properties of token rounding and routing metadata. Tiny sizes; random data from per-test seeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "machmoe/reference.hpp"
#include "test_formulas.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using namespace mtest;  // Rng, Vec, the formulas of test_formulas.hpp

// ================================================================ layer cases
struct RouteV {
  RoutingMethod m;
  bool renorm, sbias;
  const char* name;
};
const char* const kModeNames[] = {"none", "nearest", "up", "down", "stochastic"};
const RouteV kRoutes[] = {{RoutingMethod::SoftmaxTopK, true, false, "softmax_topk"},
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
const ActV kActs[] = {{Activation::SwiGLU, GateUpLayout::Interleaved, "swiglu_il"},
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
Case make_case(Rng& rng, int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, const ActV& av,
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

Eval eval_case(const Case& cs) {
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

void check_layer_grads(Case& cs) {
  const auto fwd = ref::layer_forward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), cs.sbias());
  const auto g =
      ref::layer_backward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), fwd, cs.dout.data(), cs.d_aux);
  const std::function<Eval()> ev = [&] { return eval_case(cs); };
  check_fd("dx", g.dx, cs.x, ev);
  check_fd("dwr", g.dwr, cs.wr, ev);
  check_fd("dw1", g.dw1, cs.w1, ev);
  check_fd("dw2", g.dw2, cs.w2, ev);
  if (cs.c.shape.bias) {
    check_fd("db1", g.db1, cs.b1, ev);
    check_fd("db2", g.db2, cs.b2, ev);
  }
}

// Forward pieces against their definitions, and backward identities.
void check_layer_composition(const Case& cs) {
  const auto& s = cs.c.shape;
  const int64_t K = cs.c.K;
  const auto f = ref::layer_forward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), cs.sbias());
  const Vec l = cs.logits();
  EXPECT_TRUE(mtest::all_close("logits", f.logits, l));
  const MyTopK tk = my_topk(l, s.T, s.E, K, cs.c.routing, cs.c.renormalize, cs.sbias());
  EXPECT_EQ(f.topk.expert, tk.expert);
  EXPECT_TRUE(mtest::all_close("topk.score", f.topk.score, tk.score));
  if (cs.c.rounding.mode == TokenRounding::None) {
    ASSERT_EQ(f.list.size(), s.T * K);
    for (int64_t p = 0; p < s.T * K; ++p) {
      EXPECT_EQ(f.list.token[p], p / K);
      EXPECT_EQ(f.list.expert[p], tk.expert[p]);
    }
    EXPECT_TRUE(mtest::all_close("list.score", f.list.score, tk.score));
  } else {
    const auto tr = ref::token_round(l.data(), s.T, s.E, K, cs.c.rounding);
    EXPECT_EQ(f.list.token, tr.list.token);
    EXPECT_EQ(f.list.expert, tr.list.expert);
    EXPECT_TRUE(mtest::all_close("list.score", f.list.score, tr.list.score));
  }
  EXPECT_TRUE(mtest::all_close("out", f.experts.out, naive_out(s, cs.x.data(), cs.W(), f.list),
                               1e-11, 1e-12));
  EXPECT_NEAR(f.aux, my_aux(l, s.T, s.E, f.list.expert), 1e-12);

  const auto g =
      ref::layer_backward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), f, cs.dout.data(), cs.d_aux);
  ASSERT_EQ(g.d_logits.size(), size_t(s.T * s.E));
  Vec dwr(s.E * s.d, 0.0);  // dWr = dlogits^T x
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t e = 0; e < s.E; ++e)
      for (int64_t i = 0; i < s.d; ++i)
        dwr[e * s.d + i] += g.d_logits[t * s.E + e] * cs.x[t * s.d + i];
  EXPECT_TRUE(mtest::all_close("dwr = dlogits^T x", g.dwr, dwr, 1e-11, 1e-12));
  // dS_p = <dout_t, Y_p> (SPEC: "equals <dO_t, Y> without Y").
  ASSERT_EQ(g.d_score.size(), size_t(f.list.size()));
  for (int64_t p = 0; p < f.list.size(); ++p) {
    const Vec y = my_y(s, cs.x.data(), cs.W(), f.list.token[p], f.list.expert[p]);
    double ds = 0;
    for (int64_t i = 0; i < s.d; ++i) ds += cs.dout[f.list.token[p] * s.d + i] * y[i];
    EXPECT_NEAR(g.d_score[p], ds, 1e-11 * (1 + std::fabs(ds))) << "pair " << p;
  }
}

// ================================================================ the layer: gradients
class LayerGrad : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};
TEST_P(LayerGrad, MatchesFiniteDifferences) {
  const auto [ri, ai, bias] = GetParam();
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Case cs = make_case(rng, 6, 4, 3, 4, 2, kActs[ai], bias, kRoutes[ri]);
  check_layer_composition(cs);
  check_layer_grads(cs);
}
INSTANTIATE_TEST_SUITE_P(All, LayerGrad,
                         ::testing::Combine(::testing::Range(0, 7), ::testing::Range(0, 10),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<LayerGrad::ParamType>& i) {
                           return std::string(kRoutes[std::get<0>(i.param)].name) + "_" +
                                  kActs[std::get<1>(i.param)].name +
                                  (std::get<2>(i.param) ? "_bias" : "_nobias");
                         });

// The largest sizes, K = 3, every routing variant.
class LayerGradLarge : public ::testing::TestWithParam<int> {};
TEST_P(LayerGradLarge, MatchesFiniteDifferences) {
  const int ri = GetParam();
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Case cs = make_case(rng, 10, 8, 6, 6, 3, kActs[(ri * 3) % 10], true, kRoutes[ri]);
  check_layer_composition(cs);
  check_layer_grads(cs);
}
INSTANTIATE_TEST_SUITE_P(All, LayerGradLarge, ::testing::Range(0, 7),
                         [](const auto& i) { return std::string(kRoutes[i.param].name); });

// The layer with token rounding (gradients flow through selected and padded scores).
class LayerGradRounded : public ::testing::TestWithParam<std::tuple<int, int>> {};
TEST_P(LayerGradRounded, MatchesFiniteDifferences) {
  const auto [mode, tile] = GetParam();
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const ActV acts[] = {kActs[0], kActs[7], kActs[8], kActs[5]};
  Case cs = make_case(rng, 9, 4, 3, 4, 2, acts[mode - 1], true, kRoutes[0],
                      {TokenRounding(mode), tile, seed});
  check_layer_composition(cs);
  check_layer_grads(cs);
}
INSTANTIATE_TEST_SUITE_P(All, LayerGradRounded,
                         ::testing::Combine(::testing::Range(1, 5), ::testing::Values(2, 3)),
                         [](const auto& i) {
                           return std::string(kModeNames[std::get<0>(i.param)]) + "_M" +
                                  std::to_string(std::get<1>(i.param));
                         });

// Awkward shapes: T = 1, odd T, E = 1, K = 1, K = E.
const char* const kAwkwardNames[] = {"T1", "T13", "E1K1", "K1", "KeqE", "T1E1"};
class LayerAwkward : public ::testing::TestWithParam<std::tuple<int, int>> {};
TEST_P(LayerAwkward, Shapes) {
  const int64_t shapes[][5] = {{1, 4, 3, 4, 2}, {13, 3, 2, 3, 2}, {5, 4, 3, 1, 1},
                               {6, 4, 3, 3, 1}, {6, 4, 3, 3, 3},  {1, 2, 2, 1, 1}};
  const auto [si, ri] = GetParam();
  const auto* sh = shapes[si];
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Case cs =
      make_case(rng, sh[0], sh[1], sh[2], sh[3], sh[4], kActs[si % 10], si % 2 == 0, kRoutes[ri]);
  check_layer_composition(cs);
  check_layer_grads(cs);
}
INSTANTIATE_TEST_SUITE_P(All, LayerAwkward,
                         ::testing::Combine(::testing::Range(0, 6), ::testing::Values(0, 2, 5)),
                         [](const auto& i) {
                           return std::string(kAwkwardNames[std::get<0>(i.param)]) + "_" +
                                  kRoutes[std::get<1>(i.param)].name;
                         });

// ================================================================ the checks can fail
TEST(GradCheck, RejectsSmallCorruptions) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Case cs = make_case(rng, 6, 4, 3, 4, 2, kActs[0], true, kRoutes[0]);
  const auto fwd = ref::layer_forward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), cs.sbias());
  const auto g =
      ref::layer_backward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), fwd, cs.dout.data(), cs.d_aux);
  for (auto* pv : {&cs.x, &cs.w1}) {
    const Vec& got = pv == &cs.x ? g.dx : g.dw1;
    const FD fd = fd_grad(*pv, [&] { return eval_case(cs); });
    const auto tol = fd_tol(fd.Lmag);
    ASSERT_TRUE(mtest::grad_close("clean", got, fd.g, &fd.mask, tol));
    std::vector<size_t> order(got.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return std::fabs(got[a]) > std::fabs(got[b]); });
    const size_t nnz =
        size_t(std::count_if(got.begin(), got.end(), [](double v) { return v != 0.0; }));
    for (size_t i : {order[0], order[nnz / 2]}) {  // the largest and a median element
      Vec bad = got;
      bad[i] *= 1 + 1e-4;
      EXPECT_FALSE(mtest::grad_close("corrupted", bad, fd.g, nullptr, tol)) << "element " << i;
    }
    Vec nan = got;
    nan[order.back()] = NAN;
    EXPECT_FALSE(mtest::grad_close("nan", nan, fd.g, nullptr, tol));
  }
  // A small-magnitude tensor (1e-5) with one element off by 1e-4 relative fails an exact
  // comparison.
  Vec small = mtest::uniform(rng, 64, 1e-5, 2e-5), bad = small;
  bad[17] *= 1 + 1e-4;
  EXPECT_TRUE(mtest::grad_close("small", small, small));
  EXPECT_FALSE(mtest::grad_close("small", bad, small));
}

// ================================================================ routing
TEST(Routing, TiesGoToLowerExpertIndex) {
  const Vec row = {0.5, 2.0, 2.0, -1.0, 2.0};
  const std::vector<std::vector<int32_t>> want = {
      {1}, {1, 2}, {1, 2, 4}, {1, 2, 4, 0}, {1, 2, 4, 0, 3}};
  for (const auto& rv : kRoutes) {
    const Vec bias(5, 0.125);
    for (int64_t K = 1; K <= 5; ++K) {
      const auto tk =
          ref::topk_route(row.data(), 1, 5, K, rv.m, rv.renorm, rv.sbias ? bias.data() : nullptr);
      EXPECT_EQ(tk.expert, want[K - 1]) << rv.name << " K=" << K;
    }
  }
  // The selection bias moves the choice but never enters the score.
  const Vec l2 = {0.25, 0.75};  // without the bias expert 1 would win
  const Vec b2 = {0.5, -0.5};
  const auto tk = ref::topk_route(l2.data(), 1, 2, 1, RoutingMethod::Sigmoid, false, b2.data());
  EXPECT_EQ(tk.expert[0], 0);
  EXPECT_NEAR(tk.score[0], sigm(0.25), 1e-15) << "the selection bias must not enter the score";
  const auto tk2 = ref::topk_route(l2.data(), 1, 2, 1, RoutingMethod::Sigmoid, true, b2.data());
  EXPECT_NEAR(tk2.score[0], 1.0, 1e-15);
}

class RoutingV : public ::testing::TestWithParam<int> {};
TEST_P(RoutingV, ScoresAndOrderMatchFormula) {
  const RouteV rv = kRoutes[GetParam()];
  for (int trial = 0; trial < 20; ++trial) {
    const uint64_t seed = mtest::test_seed(trial);
    SCOPED_TRACE(mtest::seed_msg(seed));
    Rng rng(seed);
    const int64_t T = 1 + rng() % 10, E = 1 + rng() % 6, K = 1 + rng() % std::min<int64_t>(E, 3);
    const Vec l = mtest::uniform(rng, T * E, -3, 3), b = mtest::uniform(rng, E, -0.3, 0.3);
    const double* bp = rv.sbias ? b.data() : nullptr;
    const auto tk = ref::topk_route(l.data(), T, E, K, rv.m, rv.renorm, bp);
    const MyTopK my = my_topk(l, T, E, K, rv.m, rv.renorm, bp);
    EXPECT_EQ(tk.T, T);
    EXPECT_EQ(tk.K, K);
    EXPECT_EQ(tk.expert, my.expert);
    EXPECT_TRUE(mtest::all_close("score", tk.score, my.score));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k + 1 < K; ++k)
        EXPECT_GT(sel_key(rv.m, bp, l[t * E + tk.expert[t * K + k]], tk.expert[t * K + k]),
                  sel_key(rv.m, bp, l[t * E + tk.expert[t * K + k + 1]], tk.expert[t * K + k + 1]));
    if (rv.m == RoutingMethod::SoftmaxTopK) {  // renormalize is ignored
      const auto tk2 = ref::topk_route(l.data(), T, E, K, rv.m, false, nullptr);
      EXPECT_EQ(tk2.expert, tk.expert);
      EXPECT_TRUE(mtest::all_close("score(renorm off)", tk2.score, tk.score));
    }
    const auto lst = ref::to_list(tk);
    ASSERT_EQ(lst.size(), T * K);
    for (int64_t p = 0; p < T * K; ++p) {
      EXPECT_EQ(lst.token[p], p / K);
      EXPECT_EQ(lst.expert[p], tk.expert[p]);
      EXPECT_EQ(lst.score[p], tk.score[p]);
    }
  }
}
TEST_P(RoutingV, BackwardMatchesFiniteDifferences) {
  const RouteV rv = kRoutes[GetParam()];
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t T = 7, E = 5;
  for (int64_t K = 1; K <= E; K += 2) {
    Vec l = mtest::uniform(rng, T * E, -2, 2);
    const Vec w = mtest::uniform(rng, T * K, -1, 1), b = mtest::uniform(rng, E, -0.3, 0.3);
    const double* bp = rv.sbias ? b.data() : nullptr;
    const auto tk = ref::topk_route(l.data(), T, E, K, rv.m, rv.renorm, bp);
    const Vec got = ref::topk_route_backward(l.data(), T, E, rv.m, rv.renorm, tk, w.data());
    const FD fd = fd_grad(l, [&] {
      const auto t2 = ref::topk_route(l.data(), T, E, K, rv.m, rv.renorm, bp);
      Eval ev{mtest::dot(w, t2.score), 1.0, {t2.expert.begin(), t2.expert.end()}};
      return ev;
    });
    EXPECT_GE(fd.kept, l.size() * 3 / 4);
    EXPECT_TRUE(
        mtest::grad_close("d_logits K=" + std::to_string(K), got, fd.g, &fd.mask, fd_tol(1.0)));
  }
}
INSTANTIATE_TEST_SUITE_P(All, RoutingV, ::testing::Range(0, 7),
                         [](const auto& i) { return std::string(kRoutes[i.param].name); });

TEST(Routing, NaNLogitsAreSelectedAndPropagate) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Vec l = {0.5, nan,  1.5,  -0.5,  // one NaN
                 nan, 0.25, nan,  1.0,   // two NaNs: both selected, lower index first
                 0.5, 1.0,  -1.0, 2.0};  // clean token
  const Vec bias = {0.1, -0.1, 0.2, -0.2};
  for (const auto& rv : kRoutes) {
    SCOPED_TRACE(rv.name);
    const auto tk =
        ref::topk_route(l.data(), 3, 4, 2, rv.m, rv.renorm, rv.sbias ? bias.data() : nullptr);
    EXPECT_EQ(tk.expert[0], 1);
    EXPECT_TRUE(std::isnan(tk.score[0]));
    EXPECT_EQ(tk.expert[2], 0);
    EXPECT_EQ(tk.expert[3], 2);
    EXPECT_TRUE(std::isnan(tk.score[2]) && std::isnan(tk.score[3]));
    const MyTopK my = my_topk(l, 3, 4, 2, rv.m, rv.renorm, rv.sbias ? bias.data() : nullptr);
    EXPECT_EQ(tk.expert[4], my.expert[4]);
    EXPECT_EQ(tk.expert[5], my.expert[5]);
    EXPECT_NEAR(tk.score[4], my.score[4], 1e-12);
    EXPECT_NEAR(tk.score[5], my.score[5], 1e-12);
    const Vec w(6, 0.5);
    (void)ref::topk_route_backward(l.data(), 3, 4, rv.m, rv.renorm, tk, w.data());
    (void)ref::aux_loss(l.data(), 3, 4, tk.expert.data(), 6);
  }
  // Token rounding with NaN logits terminates with a well-formed list.
  for (int mode = 1; mode <= 4; ++mode) {
    const auto tr = ref::token_round(l.data(), 3, 4, 2, {TokenRounding(mode), 2, 7});
    for (int64_t p = 0; p + 1 < tr.list.size(); ++p)
      EXPECT_TRUE(std::make_pair(tr.list.token[p], tr.list.expert[p]) <
                  std::make_pair(tr.list.token[p + 1], tr.list.expert[p + 1]));
  }
  // The layer: a NaN in x makes that token's output NaN and leaves the others alone.
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Case cs = make_case(rng, 4, 3, 2, 3, 2, kActs[0], true, kRoutes[0]);
  cs.x[1 * 3 + 1] = nan;
  const auto f = ref::layer_forward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), nullptr);
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t i = 0; i < 3; ++i)
      EXPECT_EQ(std::isnan(f.experts.out[t * 3 + i]), t == 1) << "t=" << t << " i=" << i;
  (void)ref::layer_backward(cs.c, cs.x.data(), cs.wr.data(), cs.W(), f, cs.dout.data(), 1.0);
}

TEST(AuxLoss, ValueAndGradient) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  // Uniform router probabilities (equal logits in each row) and balanced frequencies: aux = 1.
  const int64_t T = 6, E = 3;
  Vec flat(T * E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) flat[t * E + e] = 0.3 + 0.5 * t;
  const std::vector<int32_t> balanced = {0, 1, 2, 0, 1, 2, 2, 1, 0, 1, 0, 2};
  EXPECT_NEAR(ref::aux_loss(flat.data(), T, E, balanced.data(), 12), 1.0, 1e-14);
  // Collapsed: every pair to expert 0, which has almost all probability: aux -> E.
  Vec peaked(T * E, -20.0);
  for (int64_t t = 0; t < T; ++t) peaked[t * E] = 20.0;
  const std::vector<int32_t> all0(T, 0);
  EXPECT_NEAR(ref::aux_loss(peaked.data(), T, E, all0.data(), T), double(E), 1e-12);
  EXPECT_EQ(ref::aux_loss(flat.data(), 0, E, nullptr, 0), 0.0);
  EXPECT_EQ(ref::aux_loss(flat.data(), T, E, nullptr, 0), 0.0);
  for (int trial = 0; trial < 5; ++trial) {
    const int64_t T2 = 1 + rng() % 9, E2 = 1 + rng() % 6, R = 1 + rng() % 12;
    Vec l = mtest::uniform(rng, T2 * E2, -2, 2);
    std::vector<int32_t> ex(R);
    for (auto& e : ex) e = int32_t(rng() % E2);
    EXPECT_NEAR(ref::aux_loss(l.data(), T2, E2, ex.data(), R), my_aux(l, T2, E2, ex), 1e-12);
    const double d_aux = mtest::uniform(rng, 1, 0.5, 2)[0];
    const Vec pre = mtest::uniform(rng, T2 * E2, -1, 1);
    Vec got = pre;  // aux_loss_backward adds into d_logits
    ref::aux_loss_backward(l.data(), T2, E2, ex.data(), R, d_aux, got.data());
    for (size_t i = 0; i < got.size(); ++i) got[i] -= pre[i];
    const FD fd = fd_grad(l, [&] {
      return Eval{d_aux * ref::aux_loss(l.data(), T2, E2, ex.data(), R), 1.0, {}};
    });
    EXPECT_TRUE(mtest::grad_close("d_logits(aux)", got, fd.g, &fd.mask, fd_tol(1.0)));
  }
}

// ================================================================ token rounding
struct Expected {
  std::vector<int32_t> token, expert;
  Vec score;
  std::vector<uint8_t> padded;
  std::vector<int64_t> f, r;
};
Expected expected_rounding(const Vec& l, int64_t T, int64_t E, int64_t K, TokenRounding mode,
                           int64_t M, uint64_t seed) {
  const MyTopK tk = my_topk(l, T, E, K, RoutingMethod::SoftmaxTopK, true, nullptr);
  const Vec P = softmax_rows(l.data(), T, E);
  Vec sel(T * E, -1.0);  // the top-K score of (t, e), or -1
  Expected x;
  x.f.assign(E, 0);
  x.r.assign(E, 0);
  for (int64_t p = 0; p < T * K; ++p)
    sel[(p / K) * E + tk.expert[p]] = tk.score[p], x.f[tk.expert[p]]++;
  std::vector<std::vector<uint8_t>> keep(T, std::vector<uint8_t>(E, 0));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t f = x.f[e];
    int64_t r = 0;
    switch (mode) {
      case TokenRounding::Nearest:
        r = int64_t(std::floor((f + M / 2.0) / M)) * M;
        break;
      case TokenRounding::Up:
        r = (f + M - 1) / M * M;
        break;
      case TokenRounding::Down:
        r = f / M * M;
        break;
      case TokenRounding::Stochastic:
        r = (my_uniform(seed, e) < double(f % M) / double(M) ? (f + M - 1) / M : f / M) * M;
        break;
      default:
        break;
    }
    x.r[e] = r = std::min<int64_t>(std::max<int64_t>(r, 0), T);
    std::vector<int64_t> ord(T);
    std::iota(ord.begin(), ord.end(), 0);
    std::stable_sort(ord.begin(), ord.end(), [&](int64_t a, int64_t b) {
      const bool sa = sel[a * E + e] >= 0, sb = sel[b * E + e] >= 0;
      if (sa != sb) return sa;
      return sa ? sel[a * E + e] > sel[b * E + e] : P[a * E + e] > P[b * E + e];
    });
    for (int64_t i = 0; i < r; ++i) keep[ord[i]][e] = 1;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      if (keep[t][e]) {
        const bool pad = sel[t * E + e] < 0;
        x.token.push_back(int32_t(t)), x.expert.push_back(int32_t(e));
        x.score.push_back(pad ? P[t * E + e] : sel[t * E + e]), x.padded.push_back(pad);
      }
  return x;
}

class TokenRound : public ::testing::TestWithParam<std::tuple<int, int>> {};
TEST_P(TokenRound, MatchesDefinition) {
  const auto [mode_i, M] = GetParam();
  const TokenRounding mode = TokenRounding(mode_i);
  for (int trial = 0; trial < 40; ++trial) {
    const uint64_t seed = mtest::test_seed(trial);
    SCOPED_TRACE(mtest::seed_msg(seed));
    Rng rng(seed);
    const int64_t T = 1 + rng() % 12, E = 1 + rng() % 6, K = 1 + rng() % std::min<int64_t>(E, 3);
    Vec l = mtest::uniform(rng, T * E, -2, 2);
    for (int64_t t = 1; t < T; ++t)  // duplicated rows: exact ties between tokens
      if (rng() % 3 == 0) std::copy(&l[(t - 1) * E], &l[t * E], &l[t * E]);
    const uint64_t rseed = rng();
    const auto tr = ref::token_round(l.data(), T, E, K, {mode, M, rseed});
    const Expected x = expected_rounding(l, T, E, K, mode, M, rseed);
    const auto tk = ref::topk_route(l.data(), T, E, K, RoutingMethod::SoftmaxTopK, true, nullptr);
    EXPECT_EQ(tr.topk.expert, tk.expert);
    EXPECT_TRUE(mtest::all_close("topk.score", tr.topk.score, tk.score));
    EXPECT_EQ(tr.count_topk, x.f);
    EXPECT_EQ(tr.count_rounded, x.r);
    for (int64_t e = 0; e < E && e < int64_t(tr.count_rounded.size()); ++e) {
      const int64_t r = tr.count_rounded[e], f = tr.count_topk[e];
      EXPECT_TRUE(r % M == 0 || r == T) << "r_e=" << r;
      EXPECT_LT(std::llabs(r - f), M);
      EXPECT_EQ(std::count(tr.list.expert.begin(), tr.list.expert.end(), int32_t(e)), r);
    }
    EXPECT_EQ(tr.list.token, x.token);
    EXPECT_EQ(tr.list.expert, x.expert);
    EXPECT_EQ(tr.padded, x.padded);
    EXPECT_TRUE(mtest::all_close("score", tr.list.score, x.score));
    for (int64_t p = 0; p + 1 < tr.list.size(); ++p)
      EXPECT_TRUE(std::make_pair(tr.list.token[p], tr.list.expert[p]) <
                  std::make_pair(tr.list.token[p + 1], tr.list.expert[p + 1]))
          << "order / duplicate at " << p;
    if (mode == TokenRounding::Stochastic) {  // deterministic for a seed
      const auto tr2 = ref::token_round(l.data(), T, E, K, {mode, M, rseed});
      EXPECT_EQ(tr2.list.token, tr.list.token);
      EXPECT_EQ(tr2.list.expert, tr.list.expert);
      EXPECT_EQ(tr2.count_rounded, tr.count_rounded);
    }
  }
}
TEST_P(TokenRound, BackwardMatchesFiniteDifferences) {
  const auto [mode_i, M] = GetParam();
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t T = 9, E = 4, K = 2;
  Vec l = mtest::uniform(rng, T * E, -2, 2);
  const ref::TokenRoundingOptions opt{TokenRounding(mode_i), M, seed};
  const auto tr = ref::token_round(l.data(), T, E, K, opt);
  const Vec w = mtest::uniform(rng, tr.list.size(), -1, 1);
  const Vec got = ref::token_round_backward(l.data(), T, E, tr, w.data());
  const FD fd = fd_grad(l, [&] {
    const auto t2 = ref::token_round(l.data(), T, E, K, opt);
    Eval ev{mtest::dot(w, t2.list.score), 1.0, {}};
    for (int64_t p = 0; p < t2.list.size(); ++p)
      ev.sig.insert(ev.sig.end(), {t2.list.token[p], t2.list.expert[p], t2.padded[p]});
    return ev;
  });
  EXPECT_GE(fd.kept, l.size() * 3 / 4);
  EXPECT_TRUE(mtest::grad_close("d_logits", got, fd.g, &fd.mask, fd_tol(1.0)));
}
INSTANTIATE_TEST_SUITE_P(All, TokenRound,
                         ::testing::Combine(::testing::Range(1, 5), ::testing::Values(2, 3, 4)),
                         [](const auto& i) {
                           return std::string(kModeNames[std::get<0>(i.param)]) + "_M" +
                                  std::to_string(std::get<1>(i.param));
                         });

TEST(TokenRoundingProps, StochasticUniformIsSplitmix64) {
  Rng rng(mtest::test_seed());
  double mean = 0;
  const uint64_t seeds[] = {0ull, 1ull, ~0ull, 0x9E3779B97F4A7C15ull, rng(), rng()};
  for (uint64_t s : seeds)
    for (int64_t e : {0, 1, 2, 7, 127, 4095, 100000}) {
      const double u = ref::stochastic_uniform(s, e);
      EXPECT_EQ(u, my_uniform(s, e)) << "seed " << s << " e " << e;
      EXPECT_TRUE(u >= 0.0 && u < 1.0);
    }
  for (int64_t e = 0; e < 1000; ++e) mean += ref::stochastic_uniform(12345, e) / 1000;
  EXPECT_NEAR(mean, 0.5, 0.05);
  // Spot value computed by hand from the LAYER.md formula: seed 0, e 0 -> splitmix64(0).
  EXPECT_EQ(splitmix64(0), 0xE220A8397B1DCDAFull);
}

TEST(TokenRoundingProps, ClampsToTAndKeepsSelectedFirst) {
  // K = 1: every selected score is exactly 1, so ties between tokens decide by index.
  const int64_t T = 5, E = 2;
  const Vec l = {2.0,  1.0,   // token 0 -> e0
                 2.0,  1.0,   // token 1 -> e0 (the row of token 0)
                 0.7,  0.2,   // token 2 -> e0
                 -1.0, 1.0,   // token 3 -> e1
                 -0.5, 0.5};  // token 4 -> e1
  // down, M = 2: e0 keeps 2 of its 3 tokens (ties: token 2 goes), e1 keeps both.
  const auto down = ref::token_round(l.data(), T, E, 1, {TokenRounding::Down, 2, 0});
  EXPECT_EQ(down.count_rounded, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(down.list.token, (std::vector<int32_t>{0, 1, 3, 4}));
  // up, M = 4: 3 -> 4 and 2 -> 4. e0 pads the best non-selected by P[t,0]: token 4
  // (P[4,0] = sigma(-1) > P[3,0] = sigma(-2)). e1 pads two by P[t,1]: token 2 (sigma(-0.5)), then
  // tokens 0 and 1 tie (identical rows): token 0.
  const auto up = ref::token_round(l.data(), T, E, 1, {TokenRounding::Up, 4, 0});
  EXPECT_EQ(up.count_rounded, (std::vector<int64_t>{4, 4}));
  std::vector<std::pair<int32_t, int32_t>> pairs;
  for (int64_t p = 0; p < up.list.size(); ++p)
    pairs.emplace_back(up.list.token[p], up.list.expert[p]);
  const std::vector<std::pair<int32_t, int32_t>> want = {{0, 0}, {0, 1}, {1, 0}, {2, 0},
                                                         {2, 1}, {3, 1}, {4, 0}, {4, 1}};
  EXPECT_EQ(pairs, want);
  EXPECT_EQ(up.padded, (std::vector<uint8_t>{0, 1, 0, 0, 1, 0, 1, 0}));
  // M = 128 > T: every expert takes all T tokens (r_e clamped to T).
  const auto big = ref::token_round(l.data(), T, E, 1, {TokenRounding::Up, 128, 0});
  EXPECT_EQ(big.count_rounded, (std::vector<int64_t>{T, T}));
  EXPECT_EQ(big.list.size(), T * E);
}

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

}  // namespace
