// Tests of the CPU reference (include/machmoe/reference.hpp) against docs/LAYER.md, the whole
// layer: each forward piece against formulas re-derived independently (test_formulas.hpp), every
// gradient against finite differences, over every routing and activation variant, token rounding
// and awkward shapes; and that the gradient check itself fails on small corruptions. Tiny sizes;
// random data from per-test seeds. Routing: test_reference_routing.cpp; experts on a general
// list: test_reference_experts.cpp; routing metadata: test_reference_metadata.cpp.
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
  // dS_p = <dout_t, Y_p>: the backward gets it without Y, which it never stores.
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

}  // namespace
