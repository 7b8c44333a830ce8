// Tests of the CPU reference's routing (include/machmoe/reference.hpp) against docs/LAYER.md:
// top-K routing's choices, ties, NaNs and scores against formulas re-derived independently
// (test_formulas.hpp), its backward and the aux loss's against finite differences, and token
// rounding against its definition and properties. Tiny sizes; random data from per-test seeds.
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

}  // namespace
