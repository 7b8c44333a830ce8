// The CPU reference of a layer with shared experts (LayerConfig::num_shared): experts E..E+S-1 of
// the weights, visited by every token after its K routed pairs with weight shared_scores[t]. It
// must equal the same layer without them (its first E experts) plus the experts on the list of
// shared pairs alone, forward and backward: the output and every gradient, d_shared_scores as the
// sum of the shared pairs' d scores, and the router's part (logits, aux loss, d_logits) untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "machmoe/reference.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using mtest::Rng;

std::vector<double> slice(const std::vector<double>& v, size_t begin, size_t end) {
  return std::vector<double>(v.begin() + static_cast<int64_t>(begin), v.begin() + static_cast<int64_t>(end));
}

TEST(ReferenceSharedExperts, EqualRoutedLayerPlusSharedList) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  for (const bool bias : {false, true}) {
    const int64_t T = 7, d = 12, n = 5, E = 6, K = 2, S = 2;
    ref::LayerConfig c;
    c.shape = ref::Shape{T, d, n, E, Activation::SwiGLU, GateUpLayout::Interleaved, bias};
    c.K = K;
    c.routing = RoutingMethod::Sigmoid;
    const int64_t n1 = c.shape.n1(), Ea = E + S;
    const auto x = mtest::uniform(rng, T * d, -1, 1), wr = mtest::uniform(rng, E * d, -1, 1);
    const auto w1 = mtest::uniform(rng, Ea * n1 * d, -0.5, 0.5), w2 = mtest::uniform(rng, Ea * d * n, -0.5, 0.5);
    const auto b1 = mtest::uniform(rng, Ea * n1, -0.2, 0.2), b2 = mtest::uniform(rng, Ea * d, -0.2, 0.2);
    const auto gate = mtest::uniform(rng, T, 0.1, 0.9), dout = mtest::uniform(rng, T * d, -1, 1);
    const ref::Weights w{w1.data(), bias ? b1.data() : nullptr, w2.data(), bias ? b2.data() : nullptr};
    const double d_aux = 0.3;

    ref::LayerConfig cs = c;
    cs.num_shared = S;
    const auto f = ref::layer_forward(cs, x.data(), wr.data(), nullptr, w, nullptr, gate.data());
    const auto g = ref::layer_backward(cs, x.data(), wr.data(), w, f, dout.data(), d_aux);

    // The routed layer alone (the first E experts of the same weights) ...
    const auto fr = ref::layer_forward(c, x.data(), wr.data(), nullptr, w, nullptr);
    const auto gr = ref::layer_backward(c, x.data(), wr.data(), w, fr, dout.data(), d_aux);
    // ... and the shared pairs alone, on experts E..E+S-1 of all E+S.
    ref::RoutingList shared;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) {
        shared.token.push_back(static_cast<int32_t>(t));
        shared.expert.push_back(static_cast<int32_t>(E + s));
        shared.score.push_back(gate[t]);
      }
    ref::Shape sa = c.shape;
    sa.E = Ea;
    const auto fs = ref::general_forward(sa, x.data(), w, shared);
    const auto gs = ref::general_backward(sa, x.data(), w, fs, dout.data());

    std::vector<double> out(T * d), dx(T * d);
    for (int64_t i = 0; i < T * d; ++i) {
      out[i] = fr.experts.out[i] + fs.experts.out[i];
      dx[i] = gr.dx[i] + gs.dx[i];
    }
    EXPECT_TRUE(mtest::all_close("out", f.experts.out, out, 1e-12, 1e-12));
    EXPECT_TRUE(mtest::all_close("logits", f.logits, fr.logits, 0, 0));
    EXPECT_EQ(f.aux, fr.aux) << "the aux loss counts the routed pairs only";
    EXPECT_TRUE(mtest::all_close("d_logits", g.d_logits, gr.d_logits, 1e-12, 1e-12));
    EXPECT_TRUE(mtest::all_close("dwr", g.dwr, gr.dwr, 1e-12, 1e-12));
    EXPECT_TRUE(mtest::all_close("dx", g.dx, dx, 1e-12, 1e-12));
    // Routed experts' weight gradients from the routed layer, the shared ones' from the shared list.
    const size_t w1e = n1 * d, w2e = d * n;
    EXPECT_TRUE(mtest::all_close("dw1 routed", slice(g.dw1, 0, E * w1e), slice(gr.dw1, 0, E * w1e), 1e-12, 1e-12));
    EXPECT_TRUE(mtest::all_close("dw1 shared", slice(g.dw1, E * w1e, Ea * w1e), slice(gs.dw1, E * w1e, Ea * w1e),
                                 1e-12, 1e-12));
    EXPECT_TRUE(mtest::all_close("dw2 routed", slice(g.dw2, 0, E * w2e), slice(gr.dw2, 0, E * w2e), 1e-12, 1e-12));
    EXPECT_TRUE(mtest::all_close("dw2 shared", slice(g.dw2, E * w2e, Ea * w2e), slice(gs.dw2, E * w2e, Ea * w2e),
                                 1e-12, 1e-12));
    if (bias) {
      EXPECT_TRUE(mtest::all_close("db1 shared", slice(g.db1, E * n1, Ea * n1), slice(gs.db1, E * n1, Ea * n1),
                                   1e-12, 1e-12));
      EXPECT_TRUE(mtest::all_close("db2 routed", slice(g.db2, 0, E * d), slice(gr.db2, 0, E * d), 1e-12, 1e-12));
    }
    std::vector<double> d_shared(T, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) d_shared[t] += gs.d_score[t * S + s];
    EXPECT_TRUE(mtest::all_close("d_shared_scores", g.d_shared_scores, d_shared, 1e-12, 1e-12));
    ASSERT_EQ(static_cast<int64_t>(g.d_score.size()), T * (K + S));
  }
}

TEST(ReferenceSharedExperts, RefusedWithTokenRounding) {
  ref::LayerConfig c;
  c.shape = ref::Shape{4, 8, 4, 4, Activation::SwiGLU, GateUpLayout::Interleaved, false};
  c.K = 2;
  c.num_shared = 1;
  c.rounding.mode = TokenRounding::Nearest;
  const std::vector<double> x(32, 0.1), wr(32, 0.1), w1(5 * 8 * 8, 0.1), w2(5 * 8 * 4, 0.1);
  const ref::Weights w{w1.data(), nullptr, w2.data(), nullptr};
  EXPECT_THROW(ref::layer_forward(c, x.data(), wr.data(), nullptr, w, nullptr, nullptr), Error);
}

}  // namespace
