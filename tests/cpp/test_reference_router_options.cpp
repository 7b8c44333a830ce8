// Tests of the CPU reference's router options (docs/LAYER.md "Routing"): the sqrt-softplus gate,
// the routed scaling factor, group-limited selection (its corner cases and ties) and the router
// bias, against values worked out by hand or re-derived here, and their backward against finite
// differences. Tiny sizes; random data from per-test seeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "machmoe/machmoe.hpp"
#include "machmoe/reference.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using mtest::Eval;
using mtest::Rng;
using Vec = std::vector<double>;

double sqrt_softplus(double l) { return std::sqrt(l > 20 ? l : std::log1p(std::exp(l))); }
double sigm(double l) { return 1 / (1 + std::exp(-l)); }

RouterOptions options(double scale, int64_t n_group = 1, int64_t topk_group = 1) {
  return RouterOptions{scale, n_group, topk_group};
}

TEST(RouterOptions, SqrtSoftplusGateAndItsDerivative) {
  for (double l : {-30.0, -3.0, -0.5, 0.0, 0.7, 5.0, 19.5, 20.0, 20.5, 40.0}) {
    EXPECT_NEAR(ref::gate(RoutingMethod::SqrtSoftplus, l), sqrt_softplus(l), 1e-15 * std::max(1.0, std::fabs(l)))
        << "l=" << l;
    const double h = 1e-6 * std::max(1.0, std::fabs(l));
    if (std::fabs(l - 20) > 2 * h) {  // the threshold is a kink (as in torch)
      const double fd = (sqrt_softplus(l + h) - sqrt_softplus(l - h)) / (2 * h);
      EXPECT_NEAR(ref::gate_derivative(RoutingMethod::SqrtSoftplus, l), fd, 1e-8 * std::max(1.0, std::fabs(fd)))
          << "l=" << l;
    }
  }
  EXPECT_EQ(ref::gate(RoutingMethod::SqrtSoftplus, 30.0), std::sqrt(30.0)) << "above 20 softplus is the identity";
  EXPECT_NEAR(ref::gate(RoutingMethod::Sigmoid, 0.3), sigm(0.3), 1e-16);
}

TEST(RouterOptions, SqrtSoftplusScoresSelectionBiasAndScaling) {
  const Vec l = {0.5, -1.0, 2.0, 0.25};
  const Vec bias = {0.0, 3.0, 0.0, 0.0};  // moves expert 1 first; never enters its score
  for (bool renorm : {false, true})
    for (double scale : {1.0, 2.5}) {
      const auto tk = ref::topk_route(l.data(), 1, 4, 2, RoutingMethod::SqrtSoftplus, renorm, options(scale),
                                      bias.data());
      ASSERT_EQ(tk.expert, (std::vector<int32_t>{1, 2}));
      const double g1 = sqrt_softplus(-1.0), g2 = sqrt_softplus(2.0), sum = renorm ? g1 + g2 : 1.0;
      EXPECT_NEAR(tk.score[0], scale * g1 / sum, 1e-15);
      EXPECT_NEAR(tk.score[1], scale * g2 / sum, 1e-15);
    }
}

TEST(RouterOptions, ScalingMultipliesEveryMethodsScoresAfterRenormalisation) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t T = 5, E = 7, K = 3;
  const Vec l = mtest::uniform(rng, T * E, -3, 3);
  for (RoutingMethod m : {RoutingMethod::SoftmaxTopK, RoutingMethod::TopKSoftmax, RoutingMethod::Sigmoid,
                          RoutingMethod::SqrtSoftplus})
    for (bool renorm : {false, true}) {
      const auto a = ref::topk_route(l.data(), T, E, K, m, renorm, nullptr);
      const auto b = ref::topk_route(l.data(), T, E, K, m, renorm, options(2.827), nullptr);
      EXPECT_EQ(a.expert, b.expert);
      for (int64_t i = 0; i < T * K; ++i) EXPECT_NEAR(b.score[i], 2.827 * a.score[i], 1e-14) << to_string(m);
    }
}

// E = 8 in 4 groups of 2. Group scores: the sum of the two selection values of each group.
TEST(GroupSelection, KeepsTheGroupsWithTheLargestTopTwoSums) {
  // sigmoid gates of these logits; group 0 holds the largest single value, group 2 the largest sum
  const Vec l = {4.0, -4.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.5};
  Vec key(8);
  for (int e = 0; e < 8; ++e) key[e] = sigm(l[e]);
  const auto keep = ref::kept_groups(key.data(), 8, options(1.0, 4, 2));
  EXPECT_EQ(keep, (std::vector<uint8_t>{0, 1, 1, 0})) << "group sums: 1.0, 1.46, 1.76, 1.12";
  const auto tk = ref::topk_route(l.data(), 1, 8, 3, RoutingMethod::Sigmoid, true, options(1.0, 4, 2), nullptr);
  EXPECT_EQ(tk.expert, (std::vector<int32_t>{4, 5, 2})) << "expert 0 (the largest) is in a dropped group";
  // Without groups expert 0 would come first.
  const auto plain = ref::topk_route(l.data(), 1, 8, 3, RoutingMethod::Sigmoid, true, nullptr);
  EXPECT_EQ(plain.expert[0], 0);
}

TEST(GroupSelection, TiesGoToTheLowerGroupAndTheLowerExpert) {
  const Vec l(8, 0.3);  // every value equal: groups 0 and 1 kept, experts 0, 1, 2 chosen
  const auto tk = ref::topk_route(l.data(), 1, 8, 3, RoutingMethod::Sigmoid, false, options(1.0, 4, 2), nullptr);
  EXPECT_EQ(tk.expert, (std::vector<int32_t>{0, 1, 2}));
  // Equal group sums from different values: 0.9 + 0.1 in group 1, 0.5 + 0.5 in group 0 (exact in
  // binary: the selection bias carries the values; logit -inf gives a sigmoid gate of 0).
  const double ninf = -INFINITY;
  const Vec l2 = {ninf, ninf, ninf, ninf, ninf, ninf};
  const Vec bias = {0.5, 0.5, 0.75, 0.25, 0.0, 0.0};
  const auto tk2 = ref::topk_route(l2.data(), 1, 6, 2, RoutingMethod::Sigmoid, false, options(1.0, 3, 1), bias.data());
  EXPECT_EQ(tk2.expert, (std::vector<int32_t>{0, 1})) << "equal group sums: the lower group wins";
}

// transformers (deepseek_v3, glm4_moe) fills the experts of dropped groups with -inf before the
// top-K, so they are never chosen, even when every kept value is negative (a fill with 0.0 would
// pick them then).
TEST(GroupSelection, DroppedGroupsStayOutWhenKeptValuesAreNegative) {
  const Vec l = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};  // gates 0.5
  const Vec bias = {-1.0, -1.2, -1.0, -1.1, -3.0, -3.0, -3.0, -3.0};  // all selection values < 0
  const auto tk = ref::topk_route(l.data(), 1, 8, 4, RoutingMethod::Sigmoid, true, options(1.0, 4, 2), bias.data());
  EXPECT_EQ(tk.expert, (std::vector<int32_t>{0, 2, 3, 1}));
  for (int32_t e : tk.expert) EXPECT_LT(e, 4) << "an expert of a dropped group was chosen";
  // K = topk_group * E / n_group: exactly the kept groups' experts.
  const auto all = ref::topk_route(l.data(), 1, 8, 4, RoutingMethod::SqrtSoftplus, true, options(1.0, 4, 2),
                                   bias.data());
  std::vector<int32_t> sorted = all.expert;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(GroupSelection, MatchesABruteForceRestatement) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t G = 2 + rng() % 4, S = 2 + rng() % 4, E = G * S, TG = 1 + rng() % G;
    const int64_t K = 1 + rng() % (TG * S);
    const RoutingMethod m = rng() % 2 ? RoutingMethod::Sigmoid : RoutingMethod::SqrtSoftplus;
    const Vec l = mtest::uniform(rng, E, -3, 3), b = mtest::uniform(rng, E, -1, 1);
    const auto tk = ref::topk_route(l.data(), 1, E, K, m, true, options(1.5, G, TG), b.data());
    // Brute force: group sums from a full sort of each group, groups by a full sort, then experts.
    Vec key(E);
    for (int64_t e = 0; e < E; ++e) key[e] = ref::gate(m, l[e]) + b[e];
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < G; ++g) {
      Vec v(key.begin() + g * S, key.begin() + (g + 1) * S);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({-(v[0] + v[1]), g});
    }
    std::sort(groups.begin(), groups.end());
    std::vector<std::pair<double, int64_t>> cand;
    for (int64_t i = 0; i < TG; ++i)
      for (int64_t e = groups[i].second * S; e < (groups[i].second + 1) * S; ++e) cand.push_back({-key[e], e});
    std::sort(cand.begin(), cand.end());
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += ref::gate(m, l[cand[k].second]);
    for (int64_t k = 0; k < K; ++k) {
      ASSERT_EQ(tk.expert[k], cand[k].second) << "trial " << trial;
      EXPECT_NEAR(tk.score[k], 1.5 * ref::gate(m, l[cand[k].second]) / sum, 1e-14);
    }
  }
}

TEST(GroupSelection, RejectsBadOptions) {
  const Vec l(8, 0.0);
  auto route = [&](RoutingMethod m, int64_t K, RouterOptions o) {
    return [=, &l] { ref::topk_route(l.data(), 1, 8, K, m, true, o, nullptr); };
  };
  const auto S = RoutingMethod::Sigmoid;
  for (const auto& [f, what] : std::vector<std::pair<std::function<void()>, std::string>>{
           {route(S, 2, options(1.0, 3, 1)), "n_group does not divide E"},
           {route(S, 2, options(1.0, 4, 5)), "topk_group > n_group"},
           {route(S, 2, options(1.0, 4, 0)), "topk_group < 1"},
           {route(S, 5, options(1.0, 4, 2)), "K > topk_group * E / n_group"},
           {route(S, 2, options(1.0, 8, 2)), "one expert per group"},
           {route(RoutingMethod::SoftmaxTopK, 2, options(1.0, 4, 2)), "groups with softmax routing"},
           {route(S, 2, options(0.0)), "routed_scaling_factor 0"},
           {route(S, 2, options(-1.0)), "routed_scaling_factor < 0"}})
    EXPECT_FALSE(mtest::expect_error(ErrorCode::InvalidArgument, f, what).empty()) << what;
}

// The backward of every method with scaling and groups against central differences of Σ w·score.
TEST(RouterOptions, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t T = 6, E = 8;
  for (RoutingMethod m : {RoutingMethod::SoftmaxTopK, RoutingMethod::TopKSoftmax, RoutingMethod::Sigmoid,
                          RoutingMethod::SqrtSoftplus})
    for (bool renorm : {false, true})
      for (int64_t n_group : {1, 4}) {
        if (n_group > 1 && !is_gate_routing(m)) continue;
        const RouterOptions o = options(2.5, n_group, n_group > 1 ? 2 : 1);
        const int64_t K = 3;
        Vec l = mtest::uniform(rng, T * E, -2, 2);
        const Vec w = mtest::uniform(rng, T * K, -1, 1), b = mtest::uniform(rng, E, -0.3, 0.3);
        const double* bp = is_gate_routing(m) ? b.data() : nullptr;
        const auto tk = ref::topk_route(l.data(), T, E, K, m, renorm, o, bp);
        const Vec got = ref::topk_route_backward(l.data(), T, E, m, renorm, o, tk, w.data());
        mtest::check_fd(std::string(to_string(m)) + (renorm ? " renorm" : "") + " n_group=" + std::to_string(n_group),
                        got, l, [&] {
                          const auto t2 = ref::topk_route(l.data(), T, E, K, m, renorm, o, bp);
                          return Eval{mtest::dot(w, t2.score), 3.0, {t2.expert.begin(), t2.expert.end()}};
                        });
      }
}

// logits = x·Wrᵀ + b_r; d b_r = Σ_t d_logits, checked against central differences of the layer's
// loss Σ out·dout + d_aux·aux.
TEST(RouterBias, LayerForwardAndGradient) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  ref::LayerConfig c;
  c.shape.T = 5, c.shape.d = 4, c.shape.n = 3, c.shape.E = 6;
  c.K = 2;
  const auto& s = c.shape;
  const Vec x = mtest::uniform(rng, s.T * s.d, -1, 1), wr = mtest::uniform(rng, s.E * s.d, -1, 1);
  Vec br = mtest::uniform(rng, s.E, -1, 1);
  const Vec w1 = mtest::uniform(rng, s.E * s.n1() * s.d, -0.5, 0.5), w2 = mtest::uniform(rng, s.E * s.d * s.n, -0.5, 0.5);
  const Vec dout = mtest::uniform(rng, s.T * s.d, -1, 1);
  const ref::Weights w{w1.data(), nullptr, w2.data(), nullptr};
  for (RoutingMethod m : {RoutingMethod::SoftmaxTopK, RoutingMethod::SqrtSoftplus}) {
    c.routing = m;
    c.router = options(m == RoutingMethod::SqrtSoftplus ? 2.5 : 1.0, m == RoutingMethod::SqrtSoftplus ? 3 : 1,
                       m == RoutingMethod::SqrtSoftplus ? 2 : 1);
    const auto f = ref::layer_forward(c, x.data(), wr.data(), br.data(), w, nullptr);
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t e = 0; e < s.E; ++e) {
        double acc = br[e];
        for (int64_t k = 0; k < s.d; ++k) acc += x[t * s.d + k] * wr[e * s.d + k];
        EXPECT_NEAR(f.logits[t * s.E + e], acc, 1e-15);
      }
    const double d_aux = 0.3;
    const auto g = ref::layer_backward(c, x.data(), wr.data(), w, f, dout.data(), d_aux);
    ASSERT_EQ(g.dbr.size(), size_t(s.E));
    for (int64_t e = 0; e < s.E; ++e) {
      double sum = 0;
      for (int64_t t = 0; t < s.T; ++t) sum += g.d_logits[t * s.E + e];
      EXPECT_NEAR(g.dbr[e], sum, 1e-14);
    }
    mtest::check_fd(std::string("d router bias ") + to_string(m), g.dbr, br, [&] {
      const auto f2 = ref::layer_forward(c, x.data(), wr.data(), br.data(), w, nullptr);
      return Eval{mtest::dot(f2.experts.out, dout) + d_aux * f2.aux, 4.0,
                  {f2.list.expert.begin(), f2.list.expert.end()}};
    });
  }
}

// LayerProblem's router fields: each rule refused with a message naming the field.
TEST(RouterOptions, LayerProblemValidation) {
  auto base = [] {
    LayerProblem p;
    p.T = 64, p.d = 64, p.n = 32, p.E = 16, p.K = 4;
    p.routing = RoutingMethod::SqrtSoftplus;
    return p;
  };
  auto invalid = [](const LayerProblem& p, const std::string& field, const std::string& what) {
    const std::string msg = mtest::expect_error(ErrorCode::InvalidArgument, [&] { validate(p); }, what);
    EXPECT_NE(msg.find(field), std::string::npos) << what << ": \"" << msg << "\"";
  };
  LayerProblem p = base();
  p.n_group = 4, p.topk_group = 2, p.routed_scaling_factor = 2.5, p.has_router_bias = true;
  EXPECT_NO_THROW(validate(p));
  p = base(), p.routed_scaling_factor = 0;
  invalid(p, "routed_scaling_factor", "scale 0");
  p = base(), p.routed_scaling_factor = 1e300;
  invalid(p, "routed_scaling_factor", "scale overflows fp32");
  p = base(), p.n_group = 3;
  invalid(p, "n_group", "E % n_group != 0");
  p = base(), p.n_group = 4, p.topk_group = 5;
  invalid(p, "topk_group", "topk_group > n_group");
  p = base(), p.n_group = 4, p.topk_group = 0;
  invalid(p, "topk_group", "topk_group 0");
  p = base(), p.n_group = 16, p.topk_group = 4;
  invalid(p, "n_group", "one expert per group");
  p = base(), p.n_group = 4, p.topk_group = 1, p.K = 5;
  invalid(p, "K", "K > topk_group * E / n_group");
  p = base(), p.routing = RoutingMethod::TopKSoftmax, p.n_group = 4, p.topk_group = 2;
  invalid(p, "n_group", "groups with a softmax routing");
  p = base(), p.routing = RoutingMethod::SoftmaxTopK, p.rounding = TokenRounding::Nearest, p.routed_scaling_factor = 2;
  invalid(p, "rounding", "token rounding with a scaling factor");
}

}  // namespace
