// Tests of the FP8 experts' CPU reference (machmoe/reference_fp8_layer.hpp): its three
// quantise-dequantise helpers are bitwise the byte-level quantisers of machmoe/reference_fp8.hpp
// (which the GPU quantisers equal bitwise), so the layer spec and the kernels quantise alike; the
// FP8 experts stay within E4M3's error of the float64 experts and are measurably not them; a NaN
// stays inside its tile's token; bad metadata is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "machmoe/reference.hpp"
#include "machmoe/reference_fp8.hpp"
#include "machmoe/reference_fp8_layer.hpp"
#include "fp8_test_util.hpp"
#include "test_formulas.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using mtest::Rng;
using mtest::Vec;

// bf16 patterns and the doubles they hold.
Vec as_doubles(const std::vector<uint16_t>& h) {
  Vec v(h.size());
  for (size_t i = 0; i < h.size(); ++i) v[i] = ref::bf16_to_float(h[i]);
  return v;
}

double dequant(uint8_t code, float scale) {
  return static_cast<double>(ref::e4m3_to_float(code)) * static_cast<double>(scale);
}

// Bitwise equality of doubles, NaN equal to NaN.
void expect_same(const char* what, const Vec& got, const Vec& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::isnan(got[i]) && std::isnan(want[i])))
      ASSERT_EQ(got[i], want[i]) << what << " differs at " << i;
}

TEST(Fp8LayerReference, RowsAreTheRowQuantiser) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t T = 9, d = 2880;  // d: 22 full tiles and a partial one of 64
  const std::vector<uint16_t> x = mtest::random_bf16(rng, T * d);
  const ref::Fp8Rows q = ref::quantize_rows_fp8(x.data(), T, d, d, nullptr, T);
  Vec want(T * d);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t c = 0; c < d; ++c) want[r * d + c] = dequant(q.q[r * d + c], q.scales[r * q.tiles + c / 128]);
  const Vec xd = as_doubles(x);
  expect_same("rows", ref::fp8_rows_dequantized(xd.data(), T, d), want);
}

TEST(Fp8LayerReference, BlocksAreTheWeightQuantiser) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t E = 2, N = 272, K = 400;  // partial blocks along both
  const std::vector<uint16_t> w = mtest::random_bf16(rng, E * N * K);
  const ref::Fp8Weights q = ref::quantize_weights_fp8(w.data(), E, N, K, false);
  Vec want(E * N * K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        want[(e * N + n) * K + k] =
            dequant(q.q[(e * N + n) * K + k], q.scales[(e * q.nb_n + n / 128) * q.nb_k + k / 128]);
  const Vec wd = as_doubles(w);
  expect_same("blocks", ref::fp8_blocks_dequantized(wd.data(), E, N, K), want);
}

TEST(Fp8LayerReference, ColumnsAreTheColumnQuantiser) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  const int64_t R = 420, d = 48;
  const std::vector<int64_t> offsets = {0, 0, 1, 300, 300, 420};  // empty, one row, 299 rows, 120
  const std::vector<int32_t> offsets32(offsets.begin(), offsets.end());
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;
  const std::vector<uint16_t> x = mtest::random_bf16(rng, R * d);
  const ref::Fp8Columns q = ref::quantize_columns_fp8(x.data(), R, d, d, nullptr, R, offsets32.data(), E);
  Vec want(R * d);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const int64_t chunk = q.chunk_offsets[e] + (r - offsets[e]) / 128;
      const int64_t k = (r - offsets[e]) % 128;  // row r's place in its chunk: qt[chunk, i, k]
      for (int64_t i = 0; i < d; ++i)
        want[r * d + i] = dequant(q.qt[(chunk * d + i) * 128 + k], q.scales[chunk * d + i]);
    }
  const Vec xd = as_doubles(x);
  expect_same("columns", ref::fp8_columns_dequantized(xd.data(), R, d, offsets), want);
}

// A routed problem: every token to K = 2 of E experts, one expert left empty.
struct Problem {
  ref::Shape s;
  Vec x, w1, b1, w2, b2, dout;
  ref::RoutingList list;
  ref::Metadata md;
  ref::Weights W() const { return {w1.data(), s.bias ? b1.data() : nullptr, w2.data(), s.bias ? b2.data() : nullptr}; }
};

Problem make_problem(Rng& rng, bool bias) {
  Problem p;
  p.s.T = 37, p.s.d = 160, p.s.n = 144, p.s.E = 4, p.s.bias = bias;  // d, n: a full and a partial tile
  const int64_t n1 = p.s.n1(), d = p.s.d, n = p.s.n, E = p.s.E;
  p.x = mtest::uniform(rng, p.s.T * d, -1, 1);
  p.w1 = mtest::uniform(rng, E * n1 * d, -1.5 / std::sqrt(d), 1.5 / std::sqrt(d));
  p.b1 = mtest::uniform(rng, E * n1, -0.5, 0.5);
  p.w2 = mtest::uniform(rng, E * d * n, -1.0 / std::sqrt(n), 1.0 / std::sqrt(n));
  p.b2 = mtest::uniform(rng, E * d, -0.5, 0.5);
  p.dout = mtest::uniform(rng, p.s.T * d, -1, 1);
  for (int32_t t = 0; t < p.s.T; ++t) {
    const int32_t e0 = static_cast<int32_t>(rng() % (E - 1)), e1 = (e0 + 1 + static_cast<int32_t>(rng() % (E - 2))) % (E - 1);
    for (int32_t e : {e0, e1}) {  // experts 0 .. E-2: expert E-1 gets no rows
      p.list.token.push_back(t);
      p.list.expert.push_back(e);
      p.list.score.push_back(mtest::uniform(rng, 1, 0.2, 1.0)[0]);
    }
  }
  p.md = ref::build_metadata(p.list, p.s.T, E);
  return p;
}

double rel_err(const Vec& got, const Vec& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
  return std::sqrt(num / den);
}

// E4M3 rounds to nearest with 3 mantissa bits: an element's relative error is at most 2^-4, and
// for values spread over a binade its root mean square is about 2^-3 / sqrt(12) / 1.5 ~ 0.024.
// A tensor whose path crosses m quantised operands carries about sqrt(m) such errors: the bound
// is twice sqrt(m) · 0.024, the floor a tenth of it (a path that skipped its quantisations would
// fall below). `slack` widens the bound for tensors whose entries are sums of signed terms that
// cancel (d_score: one dot product per pair, up to 1.75x the model over 25 seeds).
void expect_fp8_error(const char* what, const Vec& got, const Vec& want, int m, double slack = 1) {
  const double expected = std::sqrt(static_cast<double>(m)) * 0.024, err = rel_err(got, want);
  EXPECT_LE(err, 2 * slack * expected) << what << ": normwise error " << err;
  EXPECT_GE(err, 0.1 * expected) << what << ": normwise error " << err << ", as if not quantised";
}

TEST(Fp8LayerReference, ExpertsStayWithinE4M3sErrorOfTheFloat64Experts) {
  for (bool bias : {false, true}) {
    const uint64_t seed = mtest::test_seed(bias);
    SCOPED_TRACE(mtest::seed_msg(seed));
    Rng rng(seed);
    const Problem p = make_problem(rng, bias);
    const ref::ExpertsForward want = ref::experts_forward(p.s, p.x.data(), p.W(), p.list, p.md);
    const ref::ExpertsForwardFp8 got = ref::experts_forward_fp8(p.s, p.x.data(), p.W(), p.list, p.md);
    expect_fp8_error("H", got.H, want.H, 2);        // X, W1
    expect_fp8_error("Hq", got.Hq, want.H, 3);      // X, W1, H
    expect_fp8_error("out", got.out, want.out, 4);  // X, W1, A, W2 (A from the unquantised H)
    const ref::ExpertsGrads gw =
        ref::experts_backward(p.s, p.x.data(), p.W(), p.list, p.md, want.H.data(), p.dout.data());
    const ref::ExpertsGrads gg =
        ref::experts_backward_fp8(p.s, p.x.data(), p.W(), p.list, p.md, got.Hq.data(), p.dout.data());
    expect_fp8_error("d_score", gg.d_score, gw.d_score, 5, 2);  // dout, W2; A from X, W1, H
    expect_fp8_error("dx", gg.dx, gw.dx, 6);                 // dout, W2, (H), dH, W1
    expect_fp8_error("dw1", gg.dw1, gw.dw1, 6);              // dout, W2, (H), dH, dH's columns, x's columns
    expect_fp8_error("dw2", gg.dw2, gw.dw2, 5);              // (X, W1, H), A's columns, dout's columns
    const int64_t empty = p.s.E - 1, n1 = p.s.n1();
    for (int64_t i = 0; i < n1 * p.s.d; ++i) ASSERT_EQ(gg.dw1[empty * n1 * p.s.d + i], 0.0);
    if (bias) {  // the bias gradients are sums of unquantised gradients: only dH's path differs
      expect_fp8_error("db1", gg.db1, gw.db1, 4);
      ASSERT_EQ(gg.db2.size(), gw.db2.size());
      for (size_t i = 0; i < gg.db2.size(); ++i) EXPECT_NEAR(gg.db2[i], gw.db2[i], 1e-12);
    }
  }
}

TEST(Fp8LayerReference, ANonFiniteInputSpoilsOnlyItsOwnTiles) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  Rng rng(seed);
  Problem p = make_problem(rng, false);
  const int64_t bad = 5, d = p.s.d;
  p.x[bad * d + 3] = std::numeric_limits<double>::infinity();
  const ref::ExpertsForwardFp8 f = ref::experts_forward_fp8(p.s, p.x.data(), p.W(), p.list, p.md);
  for (int64_t t = 0; t < p.s.T; ++t)
    for (int64_t i = 0; i < d; ++i)
      ASSERT_EQ(std::isnan(f.out[t * d + i]), t == bad) << "token " << t << " column " << i;
}

TEST(Fp8LayerReference, RefusesMetadataOfAnotherShape) {
  Rng rng(mtest::test_seed());
  Problem p = make_problem(rng, false);
  p.s.E += 1;
  EXPECT_THROW(ref::experts_forward_fp8(p.s, p.x.data(), p.W(), p.list, p.md), Error);
}

}  // namespace
