// The CPU reference of the FP8 quantisers (machmoe/reference_fp8.hpp): the E4M3 conversion held
// against a table derived here from the format's definition (every code decoded, every float of
// [2^-12, 2^10) of both signs converted, ties, saturation, subnormals, NaN), then the tiling
// rules of the three quantisers (scales, partial tiles, amax 0, NaN and Inf, gather, the
// per-expert chunk layout, the transposed weight copy) and the layout's host-side sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "machmoe/fp8.hpp"
#include "machmoe/reference_fp8.hpp"
#include "fp8_test_util.hpp"
#include "test_util.hpp"

namespace {

using mtest::bits_of;
using mtest::from_bits;
using mtest::random_bf16;

using namespace machmoe;

// The 127 nonnegative finite E4M3 values by code (0x00 .. 0x7e), from the definition: code =
// eeee mmm, e = 0: m/8 · 2^-6, else (1 + m/8) · 2^(e-7).
std::vector<double> e4m3_table() {
  std::vector<double> v;
  for (int e = 0; e < 16; ++e)
    for (int m = 0; m < 8; ++m)
      if (!(e == 15 && m == 7))
        v.push_back(e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7));
  return v;
}

TEST(Fp8Reference, DecodesEveryCode) {
  const std::vector<double> table = e4m3_table();
  ASSERT_EQ(table.size(), 127u);
  for (int c = 0; c < 256; ++c) {
    const float v = ref::e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(std::fabs(v)), table[c & 0x7f]) << "code " << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << "code " << c;
  }
  EXPECT_EQ(ref::e4m3_to_float(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(ref::e4m3_to_float(0x07), 7 * std::ldexp(1.f, -9));
  EXPECT_EQ(ref::e4m3_to_float(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(ref::e4m3_to_float(0x38), 1.f);
  EXPECT_EQ(ref::e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(ref::e4m3_to_float(0xfe), -448.f);
  for (size_t i = 1; i < table.size(); ++i) EXPECT_LT(table[i - 1], table[i]) << "codes increase with value";
}

TEST(Fp8Reference, RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(ref::float_to_e4m3(ref::e4m3_to_float(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

// Every float of [2^-12, 2^10), both signs, against the nearest table value (ties to the even
// code), walking the floats in order with the bracketing pair of codes.
TEST(Fp8Reference, ConvertsEveryFloatInRangeLikeTheTable) {
  const std::vector<double> table = e4m3_table();
  const uint32_t lo = bits_of(std::ldexp(1.f, -12)), hi = bits_of(std::ldexp(1.f, 10));
  size_t i = 0, bad = 0;  // table[i] <= x < table[i+1] (or i = 126: x >= 448)
  for (uint32_t b = lo; b < hi; ++b) {
    const double x = from_bits(b);
    while (i + 1 < table.size() && table[i + 1] <= x) ++i;
    int want;
    if (i + 1 == table.size()) {
      want = 0x7e;  // [448, 1024): nearest is 448 up to 464 (a tie going to even 0x7e), then saturation
    } else {
      const double mid = (table[i] + table[i + 1]) / 2;  // exact in double
      const size_t even = i % 2 == 0 ? i : i + 1;  // the code's last bit is the mantissa's
      want = static_cast<int>(x < mid ? i : x > mid ? i + 1 : even);
    }
    const int got = ref::float_to_e4m3(from_bits(b)), got_neg = ref::float_to_e4m3(from_bits(b | 0x80000000u));
    if ((got != want || got_neg != (want | 0x80)) && ++bad <= 5)
      ADD_FAILURE() << "x=" << x << " (bits 0x" << std::hex << b << "): got 0x" << got << " / -x 0x" << got_neg
                    << ", want 0x" << want;
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Fp8Reference, ConversionEdges) {
  auto cv = [](float x) { return static_cast<int>(ref::float_to_e4m3(x)); };
  const float inf = std::numeric_limits<float>::infinity();
  // Ties go to the even code.
  EXPECT_EQ(cv(1.0625f), 0x38);                          // between 1 (0x38) and 1.125 (0x39)
  EXPECT_EQ(cv(1.1875f), 0x3a);                          // between 1.125 and 1.25 (0x3a)
  EXPECT_EQ(cv(std::ldexp(1.f, -10)), 0x00);             // half the smallest subnormal -> 0
  EXPECT_EQ(cv(std::nextafter(std::ldexp(1.f, -10), 1.f)), 0x01);
  EXPECT_EQ(cv(3 * std::ldexp(1.f, -10)), 0x02);         // between 0x01 and 0x02
  EXPECT_EQ(cv(15 * std::ldexp(1.f, -10)), 0x08);        // between 7·2^-9 and 2^-6
  EXPECT_EQ(cv(-std::ldexp(1.f, -10)), 0x80);            // a negative zero keeps its sign
  EXPECT_EQ(cv(-0.f), 0x80);
  EXPECT_EQ(cv(0.f), 0x00);
  // Saturation: [448, Inf] -> 448 (464 is a tie between 448 and the NaN slot; satfinite anyway).
  EXPECT_EQ(cv(448.f), 0x7e);
  EXPECT_EQ(cv(464.f), 0x7e);
  EXPECT_EQ(cv(465.f), 0x7e);
  EXPECT_EQ(cv(1e30f), 0x7e);
  EXPECT_EQ(cv(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(cv(inf), 0x7e);
  EXPECT_EQ(cv(-inf), 0xfe);
  EXPECT_EQ(cv(-500.f), 0xfe);
  EXPECT_EQ(cv(432.f), 0x7e);  // between 416 (0x7d) and 448 (0x7e): even 0x7e
  EXPECT_EQ(cv(431.f), 0x7d);
  // Tiny floats (fp32 subnormals included) are zeros of their sign; NaN of any sign and payload -> 0x7f.
  for (uint32_t b = 0; b < bits_of(std::ldexp(1.f, -12)); b += 0x1234567u / 64) {
    ASSERT_EQ(cv(from_bits(b)), 0x00);
    ASSERT_EQ(cv(from_bits(b | 0x80000000u)), 0x80);
  }
  for (uint32_t b = bits_of(1024.f); b < 0x7f800000u; b += 0x12345u) {
    ASSERT_EQ(cv(from_bits(b)), 0x7e);
    ASSERT_EQ(cv(from_bits(b | 0x80000000u)), 0xfe);
  }
  for (uint32_t payload : {1u, 0x400000u, 0x7fffffu, 0x123u}) {
    EXPECT_EQ(cv(from_bits(0x7f800000u | payload)), 0x7f);
    EXPECT_EQ(cv(from_bits(0xff800000u | payload)), 0x7f);
  }
}

TEST(Fp8Reference, Bf16Helpers) {
  EXPECT_EQ(ref::float_to_bf16(1.f), 0x3f80);
  EXPECT_EQ(ref::float_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // tie to even
  EXPECT_EQ(ref::float_to_bf16(from_bits(0x3f818000u)), 0x3f82);
  EXPECT_EQ(ref::bf16_to_float(0xc2f7), -123.5f);
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(std::nanf("")))));
}

TEST(Fp8Reference, Scale) {
  EXPECT_EQ(ref::fp8_scale(0.f), 1.f);
  EXPECT_EQ(ref::fp8_scale(448.f), 1.f);
  EXPECT_EQ(ref::fp8_scale(7.f), 7.f / 448.f);
  EXPECT_EQ(bits_of(ref::fp8_scale(std::numeric_limits<float>::infinity())), ref::kFp8NanScale);
  EXPECT_EQ(bits_of(ref::fp8_scale(std::nanf(""))), ref::kFp8NanScale);
  // The smallest bf16 amax still gives a nonzero (subnormal) scale: no division by zero.
  EXPECT_GT(ref::fp8_scale(ref::bf16_to_float(0x0001)), 0.f);
  EXPECT_EQ(ref::fp8_quantize(1.f, std::nanf("")), ref::kE4M3Nan);
}

// Checks one tile: scale = amax/448 over the given values (NaN/Inf: the NaN pattern and 0x7f
// codes), and every code within half an E4M3 step of x / s.
void check_tile(const std::vector<float>& x, float s, const std::vector<uint8_t>& q, const std::string& what) {
  bool nonfinite = false;
  float amax = 0;
  for (float v : x) {
    if (!std::isfinite(v)) nonfinite = true;
    else amax = std::max(amax, std::fabs(v));
  }
  if (nonfinite) {
    EXPECT_EQ(bits_of(s), ref::kFp8NanScale) << what;
    for (uint8_t c : q) ASSERT_EQ(c, 0x7f) << what;
    return;
  }
  EXPECT_EQ(s, amax == 0 ? 1.f : std::max(amax / 448.f, std::numeric_limits<float>::min())) << what;
  // A tile below the scale's floor (amax < 448·2^-126) does not reach ±448.
  bool reached_max = amax == 0 || amax / 448.f < std::numeric_limits<float>::min();
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = static_cast<double>(x[i]) / s, got = ref::e4m3_to_float(q[i]);
    const double step = std::fabs(v) >= std::ldexp(1.0, -6) ? std::ldexp(std::fabs(v), -4) : std::ldexp(1.0, -10);
    ASSERT_LE(std::fabs(got - v), step * (1 + 1e-6)) << what << " element " << i;
    ASSERT_FALSE(std::signbit(got) != std::signbit(x[i])) << what << " element " << i;
    reached_max |= (q[i] & 0x7f) == 0x7e;
  }
  EXPECT_TRUE(reached_max) << what << ": the amax element must take ±448";
}

TEST(Fp8Reference, RowsTiles) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  struct Shape { int64_t T, d, ld; };
  for (const Shape sh : {Shape{1, 16, 16}, Shape{3, 2880, 2888}, Shape{5, 128, 128}, Shape{4, 400, 400}}) {
    std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(sh.T * sh.ld));
    const int64_t d = sh.d;
    // Row 0, tile 0: all zeros (one negative zero); the last row's last tile: a NaN; the row
    // before (if any): an Inf.
    for (int64_t c = 0; c < std::min<int64_t>(d, 128); ++c) x[c] = c == 5 ? 0x8000 : 0;
    x[(sh.T - 1) * sh.ld + d - 1] = 0x7fc1;
    if (sh.T > 1) x[(sh.T - 2) * sh.ld + d - 3] = 0xff80;  // -Inf
    const ref::Fp8Rows r = ref::quantize_rows_fp8(x.data(), sh.T, d, sh.ld, nullptr, sh.T);
    ASSERT_EQ(r.tiles, (d + 127) / 128);
    for (int64_t t = 0; t < sh.T; ++t) {
      for (int64_t j = 0; j < r.tiles; ++j) {
        const int64_t c0 = 128 * j, c1 = std::min(d, c0 + 128);  // a partial last tile: its real elements
        std::vector<float> xv;
        std::vector<uint8_t> qv;
        for (int64_t c = c0; c < c1; ++c)
          xv.push_back(ref::bf16_to_float(x[t * sh.ld + c])), qv.push_back(r.q[t * d + c]);
        check_tile(xv, r.scales[t * r.tiles + j], qv, "T=" + std::to_string(sh.T) + " d=" + std::to_string(d) +
                                                          " row " + std::to_string(t) + " tile " + std::to_string(j));
      }
    }
    if (sh.T > 1 || d > 128) {  // (with T = 1 and one tile, the NaN below shares the zero tile)
      EXPECT_EQ(r.scales[0], 1.f);
      EXPECT_EQ(r.q[5], 0x80);  // -0 stays -0
    }
    EXPECT_EQ(bits_of(r.scales[(sh.T - 1) * r.tiles + r.tiles - 1]), ref::kFp8NanScale);
  }
}

TEST(Fp8Reference, RowsGather) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const int64_t T = 7, d = 272;
  const std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(T * d));
  const ref::Fp8Rows all = ref::quantize_rows_fp8(x.data(), T, d, d, nullptr, T);
  const std::vector<int32_t> gather = {6, 0, 0, 3, -1, 7, 2};  // repeats, and two out of range
  const ref::Fp8Rows g = ref::quantize_rows_fp8(x.data(), T, d, d, gather.data(), 7);
  for (int64_t r = 0; r < 7; ++r) {
    const int32_t src = gather[r];
    for (int64_t j = 0; j < all.tiles; ++j) {
      if (src < 0 || src >= T) {
        EXPECT_EQ(bits_of(g.scales[r * g.tiles + j]), ref::kFp8NanScale) << "row " << r;
      } else {
        EXPECT_EQ(bits_of(g.scales[r * g.tiles + j]), bits_of(all.scales[src * all.tiles + j])) << "row " << r;
      }
    }
    for (int64_t c = 0; c < d; ++c)
      ASSERT_EQ(g.q[r * d + c], (src < 0 || src >= T) ? 0x7f : all.q[src * d + c]) << "row " << r << " col " << c;
  }
}

// The per-expert chunks against quantize_rows_fp8 of each chunk's rows transposed (one tile per
// row): the two reference quantisers must agree, and the layout must hold (chunk offsets, zero
// padding, no chunk for an empty expert).
void check_columns(mtest::Rng& rng, int64_t T, int64_t d, const std::vector<int32_t>& offsets, bool use_gather) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, R = offsets.back();
  SCOPED_TRACE("T=" + std::to_string(T) + " d=" + std::to_string(d) + " E=" + std::to_string(E) +
               " R=" + std::to_string(R));
  std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(T * d));
  if (T * d > 10) x[static_cast<size_t>(T * d / 2)] = 0x7f80;  // +Inf somewhere
  std::vector<int32_t> gather(static_cast<size_t>(R));
  for (auto& g : gather) g = static_cast<int32_t>(rng() % static_cast<uint64_t>(T));
  const int32_t* gp = use_gather ? gather.data() : nullptr;
  const ref::Fp8Columns col = ref::quantize_columns_fp8(x.data(), T, d, d, gp, R, offsets.data(), E);
  ASSERT_EQ(col.max_chunks, ref::fp8_max_chunks(R, E));
  ASSERT_EQ(col.r_pad, 128 * col.max_chunks);
  ASSERT_EQ(col.chunk_offsets[0], 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    ASSERT_EQ(col.chunk_offsets[e + 1] - col.chunk_offsets[e], (rows + 127) / 128) << "expert " << e;
    for (int64_t c = col.chunk_offsets[e]; c < col.chunk_offsets[e + 1]; ++c) {
      const int64_t r0 = offsets[e] + 128 * (c - col.chunk_offsets[e]), n = std::min<int64_t>(128, offsets[e + 1] - r0);
      std::vector<uint16_t> xt(static_cast<size_t>(d * n));  // [d, n]: the chunk transposed
      for (int64_t i = 0; i < d; ++i)
        for (int64_t r = 0; r < n; ++r) xt[i * n + r] = x[(gp ? gp[r0 + r] : r0 + r) * d + i];
      const ref::Fp8Rows rows_q = ref::quantize_rows_fp8(xt.data(), d, n, n, nullptr, d);
      for (int64_t i = 0; i < d; ++i) {
        ASSERT_EQ(bits_of(col.scales[c * d + i]), bits_of(rows_q.scales[i]))
            << "column " << i << " chunk " << c;
        for (int64_t r = 0; r < 128; ++r)
          ASSERT_EQ(col.qt[(c * d + i) * 128 + r], r < n ? rows_q.q[i * n + r] : 0)
              << "column " << i << " chunk " << c << " row " << r << (r < n ? "" : " (padding)");
      }
    }
  }
  EXPECT_LE(col.chunk_offsets[E], col.max_chunks);
}

TEST(Fp8Reference, ColumnsChunksPerExpert) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  check_columns(rng, 300, 32, {0, 130, 130, 300}, false);           // expert 1 has no rows
  check_columns(rng, 50, 2880 / 10, {0, 1, 2, 3, 200, 600}, true);  // one-row experts, gathered
  check_columns(rng, 1, 16, {0, 1}, false);                         // T = 1
  check_columns(rng, 20, 48, {0, 0, 0}, true);                      // R = 0
  check_columns(rng, 64, 16, {0, 128, 256, 384}, true);              // whole chunks only
}

TEST(Fp8Reference, ColumnsNaNStaysInItsColumnAndChunk) {
  const int64_t T = 200, d = 32;
  std::vector<uint16_t> x(static_cast<size_t>(T * d), ref::float_to_bf16(1.f));
  x[150 * d + 7] = 0xffc0;  // NaN at row 150 (expert 1, chunk 1), column 7
  const std::vector<int32_t> off = {0, 100, 200};
  const ref::Fp8Columns col = ref::quantize_columns_fp8(x.data(), T, d, d, nullptr, T, off.data(), 2);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t c = 0; c < 2; ++c) {
      const bool nan = i == 7 && c == 1;
      EXPECT_EQ(bits_of(col.scales[c * d + i]), nan ? ref::kFp8NanScale : bits_of(1.f / 448.f));
      for (int64_t r = 0; r < 128; ++r)
        ASSERT_EQ(col.qt[(c * d + i) * 128 + r], r >= 100 ? 0 : nan ? 0x7f : 0x7e) << i << " " << c << " " << r;
    }
}

TEST(Fp8Reference, ColumnsRefusesBadOffsets) {
  const std::vector<uint16_t> x(64, 0);
  const std::vector<int32_t> decreasing = {0, 3, 2, 4}, beyond = {0, 5};
  const std::string m1 = mtest::expect_error(
      ErrorCode::InvalidArgument,
      [&] { ref::quantize_columns_fp8(x.data(), 4, 16, 16, nullptr, 4, decreasing.data(), 3); }, "decreasing offsets");
  const std::string m2 = mtest::expect_error(
      ErrorCode::InvalidArgument,
      [&] { ref::quantize_columns_fp8(x.data(), 4, 16, 16, nullptr, 4, beyond.data(), 1); }, "offsets beyond R");
  EXPECT_TRUE(mtest::contains_word(m1, "expert_offsets")) << m1;
  EXPECT_TRUE(mtest::contains_word(m2, "expert_offsets")) << m2;
}

// fp8_columns_layout (the library's host function, no device) against the reference bound, and
// the bound against every split of R rows over E experts (small R) and its extremal split.
TEST(Fp8Reference, ColumnsLayoutBound) {
  for (int64_t E = 1; E <= 4; ++E) {
    for (int64_t R = 0; R <= 400; R += (R < 140 ? 1 : 37)) {
      const int64_t bound = ref::fp8_max_chunks(R, E);
      const Fp8ColumnsLayout l = fp8_columns_layout(R, E, 48);
      ASSERT_EQ(l.max_chunks, bound);
      ASSERT_EQ(l.r_pad, 128 * bound);
      ASSERT_EQ(l.qt_bytes, static_cast<size_t>(48 * 128 * bound));
      ASSERT_EQ(l.scales_bytes, static_cast<size_t>(4 * 48 * bound));
      ASSERT_EQ(l.chunk_offsets_bytes, static_cast<size_t>(4 * (E + 1)));
      EXPECT_LE(bound, R / 128 + E);
      // Every split (rows of experts 0..E-2 in steps, the rest to the last one).
      int64_t most = 0;
      std::vector<int64_t> rows(E, 0);
      std::function<void(int64_t, int64_t)> walk = [&](int64_t e, int64_t left) {
        if (e == E - 1) {
          rows[e] = left;
          int64_t chunks = 0;
          for (int64_t r : rows) chunks += (r + 127) / 128;
          most = std::max(most, chunks);
          return;
        }
        for (int64_t r = 0; r <= left; r += (left > 140 ? 13 : 1)) rows[e] = r, walk(e + 1, left - r);
        if (left >= 1) rows[e] = 1, walk(e + 1, left - 1);
      };
      if (E <= 3) walk(0, R);
      // The extremal split: min(E, R) - 1 experts of one row, the rest in one.
      const int64_t m = std::min(E, R);
      int64_t extremal = R == 0 ? 0 : (m - 1) + (R - (m - 1) + 127) / 128;
      EXPECT_EQ(extremal, bound) << "R=" << R << " E=" << E;
      if (E <= 3) EXPECT_EQ(most, bound) << "R=" << R << " E=" << E;
    }
  }
  // Sizes only from (R, E, d): a DeepSeek-V3-like shape.
  const Fp8ColumnsLayout big = fp8_columns_layout(262144, 256, 7168);
  EXPECT_EQ(big.max_chunks, 256 + (262144 - 256) / 128);
  mtest::expect_error(ErrorCode::InvalidArgument, [] { fp8_columns_layout(10, 0, 16); }, "E = 0");
  mtest::expect_error(ErrorCode::InvalidArgument, [] { fp8_columns_layout(10, 2, 24); }, "d = 24");
  mtest::expect_error(ErrorCode::InvalidArgument, [] { fp8_columns_layout(-1, 2, 16); }, "R < 0");
}

TEST(Fp8Reference, WeightsBlocksAndTransposedCopy) {
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const int64_t E = 3, N = 208, K = 144;  // partial blocks along both dimensions
  std::vector<uint16_t> w = random_bf16(rng, static_cast<size_t>(E * N * K));
  w[(1 * N + 130) * K + 140] = 0x7fc0;                          // NaN: expert 1, block (1, 1)
  for (int64_t n = 0; n < 128; ++n)
    for (int64_t k = 0; k < 128; ++k) w[(2 * N + n) * K + k] = 0;  // expert 2, block (0, 0): zeros
  const ref::Fp8Weights r = ref::quantize_weights_fp8(w.data(), E, N, K, true);
  ASSERT_EQ(r.nb_n, 2);
  ASSERT_EQ(r.nb_k, 2);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t nb = 0; nb < 2; ++nb)
      for (int64_t kb = 0; kb < 2; ++kb) {
        std::vector<float> xv;
        std::vector<uint8_t> qv;
        for (int64_t n = 128 * nb; n < std::min<int64_t>(N, 128 * nb + 128); ++n)
          for (int64_t k = 128 * kb; k < std::min<int64_t>(K, 128 * kb + 128); ++k)
            xv.push_back(ref::bf16_to_float(w[(e * N + n) * K + k])), qv.push_back(r.q[(e * N + n) * K + k]);
        const float s = r.scales[(e * 2 + nb) * 2 + kb];
        check_tile(xv, s, qv, "block " + std::to_string(e) + "," + std::to_string(nb) + "," + std::to_string(kb));
        EXPECT_EQ(bits_of(r.scales_t[(e * 2 + kb) * 2 + nb]), bits_of(s)) << "scales_t is scales transposed";
      }
  EXPECT_EQ(bits_of(r.scales[(1 * 2 + 1) * 2 + 1]), ref::kFp8NanScale);
  EXPECT_EQ(r.scales[(2 * 2 + 0) * 2 + 0], 1.f);
  // q and qt dequantise to the same values, element by element.
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const float a = ref::e4m3_to_float(r.q[(e * N + n) * K + k]) * r.scales[(e * 2 + n / 128) * 2 + k / 128];
        const float b = ref::e4m3_to_float(r.qt[(e * K + k) * N + n]) * r.scales_t[(e * 2 + k / 128) * 2 + n / 128];
        ASSERT_TRUE(bits_of(a) == bits_of(b)) << e << " " << n << " " << k;
      }
  const ref::Fp8Weights plain = ref::quantize_weights_fp8(w.data(), E, N, K, false);
  EXPECT_EQ(plain.q, r.q);
  EXPECT_TRUE(plain.qt.empty());
}

}  // namespace
