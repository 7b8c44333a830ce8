// The FP8 grouped GEMM (machmoe/fp8.hpp, grouped_gemm_fp8) on the GPU against the float64 GEMM on
// the dequantised operands (machmoe/reference_fp8.hpp). The operands are quantised on the CPU by
// the reference quantisers (bitwise what quantize_rows_fp8 / quantize_weights_fp8 write), so the
// only differences are the GPU's accumulation and its bf16 output rounding.
//
// Tolerance, derived. Per element, with abs = Σ_k |a_k·b_k| (float64, from the reference):
//   - the bf16 output rounding: <= 2^-9·|c| (round to nearest, 8 significant bits);
//   - the accumulation: each 128-deep block is summed by the tensor cores, whose FP8 accumulation
//     keeps ~14 bits of the largest term (DeepSeek-V3 §3.3). Model: each k32 step (the running
//     block sum + 32 products) loses at most 2^-13 of its terms' Σ|·|, i.e. four steps <= 2^-11 of
//     the block's Σ|a·b|; the fp32 promotion adds ~2^-24 per block. Summed: <= 2^-11·abs.
//   |got - c| <= 2·(2^-9·|c| + 2^-11·abs), a factor 2 of margin over that bound. Normwise the same
//   bound with the norms: ‖got - c‖ <= 2·(2^-9·‖c‖ + 2^-11·‖abs‖). The tests print the normwise
//   error and the worst |got - c| / abs they saw, to tighten the model once measured.
// A misapplied scale (another row's, K block's, column block's or expert's) changes a 128-block's
// contribution by a factor >= 2 in the structured cases, where every (row, K block) of A and
// every weight block has its own power-of-two magnitude: an O(1) error, far outside that bound;
// ScaleMistakesAreCaught feeds such scales and expects the comparison to fail.
// Outputs are poisoned (0xff: NaN in bf16): rows outside every expert and the columns [N, ldc)
// must stay poisoned, every other element must be written and finite.
// Gathered cases (GemmCase::T > 0): Aq [T, K] is quantised once without a gather and row r of the
// GEMM reads row gather[r] (random in [0, T), repeated, T != R); the reference runs on the rows
// gathered on the host. MisplacedGatherIsCaught checks that a kernel ignoring the gather (or
// reading a neighbour's index) would fail the comparison.
// The GPU tests skip without a GPU; the argument rules (GemmFp8Api.*) run everywhere.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "fp8_gemm_test_data.hpp"
#include "gpu_util.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/reference_fp8.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::GemmCase;
using mtest::GemmData;
using mtest::have_gpu;
using mtest::make_data;
using mtest::reference;
using mtest::upload;

constexpr uint16_t kPoison = 0xffff;  // bf16 NaN: a cudaMemset(0xff) output

// The comparison (host only, so that a test can feed it a corrupted result): c [R, ldc] bf16 bits.
::testing::AssertionResult matches(const ref::Fp8GemmResult& want, const std::vector<uint16_t>& c, int64_t ldc) {
  const int64_t R = want.R, N = want.N;
  double err2 = 0, ref2 = 0, abs2 = 0, worst = 0;
  int64_t bad = 0;
  std::string first;
  for (int64_t r = 0; r < R; ++r) {
    const bool covered = !std::isnan(want.c[r * N]);
    for (int64_t n = 0; n < ldc; ++n) {
      const uint16_t bits = c[r * ldc + n];
      if (!covered || n >= N) {  // never written
        if (bits != kPoison) {
          if (bad++ == 0) first = "row " + std::to_string(r) + " col " + std::to_string(n) + " written but outside the result";
        }
        continue;
      }
      const double got = ref::bf16_to_float(bits), ref_c = want.c[r * N + n], ref_abs = want.abs[r * N + n];
      const double err = std::fabs(got - ref_c), tol = 2 * (std::ldexp(std::fabs(ref_c), -9) + std::ldexp(ref_abs, -11));
      if (!std::isfinite(got) || !(err <= tol)) {
        if (bad++ == 0) {
          first = "row " + std::to_string(r) + " col " + std::to_string(n) + ": got " + std::to_string(got) + ", want " +
                  std::to_string(ref_c) + " (abs " + std::to_string(ref_abs) + ", tol " + std::to_string(tol) + ")";
        }
        continue;
      }
      if (ref_abs > 0) worst = std::max(worst, err / ref_abs);
      err2 += err * err, ref2 += ref_c * ref_c, abs2 += ref_abs * ref_abs;
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " elements wrong; first: " << first;
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0;
  const double tol = ref2 > 0 ? 2 * (std::ldexp(1.0, -9) + std::ldexp(std::sqrt(abs2 / ref2), -11)) : 0;
  if (!(rel <= tol) && ref2 > 0)
    return ::testing::AssertionFailure() << "normwise error " << rel << " above " << tol;
  return ::testing::AssertionSuccess() << "normwise error " << rel << " (tolerance " << tol
                                       << "), worst |err|/abs " << worst;
}

// One call on the GPU with the given scales (the data's own unless the caller corrupts them) and
// gather (the data's own unless the caller passes another; empty: contiguous); returns C [R, ldc]
// as bf16 bits, poisoned before the call.
std::vector<uint16_t> run_gpu(const GemmData& d, const std::vector<float>& sa, const std::vector<float>& sb,
                              int max_ctas, const std::vector<int32_t>* gather_override = nullptr) {
  const std::vector<int32_t>& gather = gather_override ? *gather_override : d.gather;
  DeviceBuffer aq(d.a.q.size()), das(sa.size() * 4), wq(d.w.q.size()), dsb(sb.size() * 4),
      off(d.offsets.size() * 4), tiles(d.offsets.size() * 4), c(static_cast<size_t>(d.R * d.ldc) * 2),
      dg(gather.size() * 4);
  upload(d.a.q, aq);
  upload(gather, dg);
  upload(sa, das);
  upload(d.w.q, wq);
  upload(sb, dsb);
  upload(d.offsets, off);
  EXPECT_EQ(cudaMemset(c.ptr, 0xff, static_cast<size_t>(d.R * d.ldc) * 2), cudaSuccess);
  EXPECT_EQ(cudaMemset(tiles.ptr, 0xff, d.offsets.size() * 4), cudaSuccess);
  GroupedGemmFp8Args a;
  a.a_q = static_cast<const uint8_t*>(aq.ptr), a.a_scales = static_cast<const float*>(das.ptr), a.R = d.R;
  if (!gather.empty()) a.gather = static_cast<const int32_t*>(dg.ptr), a.T = d.T;
  a.w_q = static_cast<const uint8_t*>(wq.ptr), a.w_scales = static_cast<const float*>(dsb.ptr);
  a.expert_offsets = static_cast<const int32_t*>(off.ptr);
  a.E = d.E, a.N = d.N, a.K = d.K;
  a.c = c.ptr, a.ldc = d.ldc;
  a.tile_offsets = static_cast<int32_t*>(tiles.ptr);
  a.max_ctas = max_ctas;
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  grouped_gemm_fp8(a, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  std::vector<uint16_t> out(static_cast<size_t>(d.R * d.ldc));
  if (!out.empty())
    EXPECT_EQ(cudaMemcpy(out.data(), c.ptr, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

std::string describe(const GemmCase& k) {
  std::string s = "rows {";
  for (size_t e = 0; e < k.rows.size() && e < 8; ++e) s += (e ? "," : "") + std::to_string(k.rows[e]);
  if (k.rows.size() > 8) s += ",... (E=" + std::to_string(k.rows.size()) + ")";
  return s + "} tail=" + std::to_string(k.tail) + " N=" + std::to_string(k.N) + " K=" + std::to_string(k.K) +
         " ldc=" + std::to_string(k.ldc) + " max_ctas=" + std::to_string(k.max_ctas) +
         (k.structured ? " structured" : "") + (k.T > 0 ? " gathered from T=" + std::to_string(k.T) : "");
}

void check_case(const GemmCase& k, uint64_t salt) {
  SCOPED_TRACE(describe(k));
  const uint64_t seed = mtest::test_seed(salt);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const GemmData d = make_data(k, rng);
  const ref::Fp8GemmResult want = reference(d, d.gather);
  const std::vector<uint16_t> got = run_gpu(d, d.a.scales, d.w.scales, k.max_ctas);
  const ::testing::AssertionResult ok = matches(want, got, d.ldc);
  EXPECT_TRUE(ok);
  if (ok) std::printf("  %s: %s\n", describe(k).c_str(), ok.message());
  // Deterministic: a second call gives the same bits.
  EXPECT_TRUE(run_gpu(d, d.a.scales, d.w.scales, k.max_ctas) == got) << "two calls differ";
}

// ---------------------------------------------------------------- GPU
TEST(GpuFp8Gemm, PartialTilesAndAnEmptyExpert) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // R not a multiple of 128, an expert with 0 rows, one of exactly 128, padding columns in ldc,
  // rows after the last expert.
  check_case({{200, 0, 128, 77}, 512, 512, 520, 5}, 1);
}

TEST(GpuFp8Gemm, GptOssWidths) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // N = K = 2880: a half column block (the last 256-wide tile has one 64-column wave and one past
  // N) and a half K block (64 of 128 valid).
  check_case({{130, 70}, 2880, 2880}, 2);
}

TEST(GpuFp8Gemm, KNotAMultipleOf128) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{1, 300, 0, 129}, 384, 400}, 3);  // K = 3·128 + 16
  check_case({{0, 3, 0, 17}, 72, 16}, 4);        // one K block of 16, N below one wave
  check_case({{64, 0}, 136, 144, 144}, 5);       // N = 128 + 8
}

TEST(GpuFp8Gemm, ManyExpertsGlobalTileTable) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  GemmCase k;
  mtest::Rng rng(mtest::test_seed(6));
  for (int e = 0; e < 600; ++e) k.rows.push_back(static_cast<int32_t>(rng() % 5));
  k.rows[599] = 130;
  k.N = 136, k.K = 144;
  check_case(k, 7);
}

TEST(GpuFp8Gemm, FewCtasWalkManyTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // 2 CTAs for 3·3 + 2·3 + 1·3 = 18 tiles: each CTA runs several, the stage and tile rings wrap.
  check_case({{300, 260, 129}, 520, 256, 0, 0, false, 2}, 8);
  check_case({{300, 260, 129}, 520, 256, 0, 0, false, 1}, 9);
}

TEST(GpuFp8Gemm, NoRowsWritesNothing) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{0, 0, 0}, 256, 128, 0, 40}, 10);  // R = 40 rows, none in an expert
  check_case({{0, 0}, 256, 128}, 11);             // R = 0: the call returns at once
}

TEST(GpuFp8Gemm, StructuredMagnitudes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{150, 0, 90}, 384, 640, 0, 0, true}, 12);
  check_case({{130, 70}, 2880, 2880, 0, 0, true}, 13);
}

// ---------------------------------------------------------------- GPU, gathered A
// (GemmCase fields: rows, N, K, ldc, tail, structured, max_ctas, T)
TEST(GpuFp8Gemm, GatheredPartialTilesRepeatsAndAnEmptyExpert) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // R = 410 rows from T = 150 (indices repeated), partial row tiles (zero-filled rows, scale 0),
  // an empty expert, one of exactly 128, padding columns in ldc, rows after the last expert.
  check_case({{200, 0, 128, 77}, 512, 512, 520, 5, false, 0, 150}, 21);
  // T > R: most of Aq is never read.
  check_case({{1, 300, 0, 129}, 384, 512, 0, 0, false, 0, 5000}, 22);
}

TEST(GpuFp8Gemm, GatheredGptOssWidths) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // K = 2880: a half last K block (4 of 8 chunks read, the rest zero-filled by the copy).
  check_case({{130, 70}, 2880, 2880, 0, 0, false, 0, 333}, 23);
  check_case({{130, 70}, 2880, 2880, 0, 0, true, 0, 333}, 24);
}

TEST(GpuFp8Gemm, GatheredKNotAMultipleOf128) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{1, 300, 0, 129}, 384, 400, 0, 0, false, 0, 250}, 25);  // K = 3·128 + 16: one chunk of the last block
  check_case({{150, 0, 90}, 384, 400, 0, 0, true, 0, 97}, 26);        // the same, structured magnitudes
  check_case({{0, 3, 0, 17}, 72, 16, 0, 0, false, 0, 7}, 27);         // one K block of 16 (one chunk)
}

TEST(GpuFp8Gemm, GatheredFewCtasAndManyExperts) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{300, 260, 129}, 520, 256, 0, 0, false, 1, 64}, 28);  // one CTA walks every tile
  GemmCase k;
  mtest::Rng rng(mtest::test_seed(29));
  for (int e = 0; e < 600; ++e) k.rows.push_back(static_cast<int32_t>(rng() % 5));
  k.rows[599] = 130;
  k.N = 136, k.K = 144, k.T = 100;
  check_case(k, 30);
}

// A kernel that ignored the gather, or read a neighbouring row's index, would fail: the result is
// compared with those readings and must differ (T > R, so that reading row r of Aq is defined).
TEST(GpuFp8Gemm, MisplacedGatherIsCaught) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const GemmCase k{{150, 0, 90}, 384, 400, 0, 0, true, 0, 300};
  const uint64_t seed = mtest::test_seed(31);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const GemmData d = make_data(k, rng);
  const std::vector<uint16_t> got = run_gpu(d, d.a.scales, d.w.scales, 0);
  EXPECT_TRUE(matches(reference(d, d.gather), got, d.ldc));
  EXPECT_FALSE(matches(reference(d, {}), got, d.ldc)) << "the result is that of A's rows read without the gather";
  std::vector<int32_t> shifted(d.gather.begin() + 1, d.gather.end());
  shifted.push_back(d.gather.front());
  EXPECT_FALSE(matches(reference(d, shifted), got, d.ldc)) << "the result is that of the next row's index";
  // And the contiguous call's result (what ignoring the gather gives) fails the gathered reference.
  const std::vector<int32_t> none;
  EXPECT_FALSE(matches(reference(d, d.gather), run_gpu(d, d.a.scales, d.w.scales, 0, &none), d.ldc))
      << "the contiguous result passed the gathered reference";
}

// A gather value outside [0, T) reads nothing and makes its row NaN (written, not left unwritten);
// the other rows are unaffected.
TEST(GpuFp8Gemm, GatherIndicesOutsideTGiveNanRows) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const GemmCase k{{130, 70}, 256, 384, 0, 0, false, 0, 90};
  const uint64_t seed = mtest::test_seed(32);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const GemmData d = make_data(k, rng);
  std::vector<int32_t> bad = d.gather;
  const int64_t bad_rows[] = {0, 129, 130, 199};  // both experts' first and last rows
  bad[0] = -1, bad[129] = static_cast<int32_t>(d.T), bad[130] = INT32_MIN, bad[199] = INT32_MAX;
  std::vector<uint16_t> got = run_gpu(d, d.a.scales, d.w.scales, 0, &bad);
  const ref::Fp8GemmResult want = reference(d, bad);  // (the bad rows read row 0 there)
  for (const int64_t r : bad_rows) {
    int64_t not_nan = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      uint16_t& bits = got[r * d.ldc + n];
      if (!std::isnan(ref::bf16_to_float(bits)) || bits == kPoison) ++not_nan;
      bits = ref::float_to_bf16(static_cast<float>(want.c[r * d.N + n]));  // the rest of the check skips it
    }
    EXPECT_EQ(not_nan, 0) << "row " << r << " (gather value " << bad[r] << "): elements not NaN or not written";
  }
  EXPECT_TRUE(matches(want, got, d.ldc));
}

// Each way of misapplying a scale gives a result the comparison refuses (and the right scales one
// it accepts): the check can fail, and would catch a kernel reading the wrong scale.
TEST(GpuFp8Gemm, ScaleMistakesAreCaught) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const GemmCase k{{150, 0, 90}, 384, 640, 0, 0, true};
  const uint64_t seed = mtest::test_seed(14);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const GemmData d = make_data(k, rng);
  const ref::Fp8GemmResult want = ref::grouped_gemm_fp8(d.a.q.data(), d.a.scales.data(), d.R, d.w.q.data(),
                                                         d.w.scales.data(), d.offsets.data(), d.E, d.N, d.K);
  EXPECT_TRUE(matches(want, run_gpu(d, d.a.scales, d.w.scales, 0), d.ldc));
  const int64_t KB = d.a.tiles, NB = d.w.nb_n;
  auto expect_caught = [&](const std::vector<float>& sa, const std::vector<float>& sb, const char* what) {
    EXPECT_FALSE(matches(want, run_gpu(d, sa, sb, 0), d.ldc)) << what << " was not caught";
  };
  std::vector<float> sa = d.a.scales;  // each row's scales of the next K block
  for (int64_t r = 0; r < d.R; ++r)
    for (int64_t kb = 0; kb < KB; ++kb) sa[r * KB + kb] = d.a.scales[r * KB + (kb + 1) % KB];
  expect_caught(sa, d.w.scales, "A's scales of the next K block");
  sa = d.a.scales;  // the next row's
  for (int64_t r = 0; r + 1 < d.R; ++r)
    for (int64_t kb = 0; kb < KB; ++kb) sa[r * KB + kb] = d.a.scales[(r + 1) * KB + kb];
  expect_caught(sa, d.w.scales, "A's scales of the next row");
  std::vector<float> sb = d.w.scales;  // the next expert's
  for (int64_t e = 0; e < d.E; ++e)
    for (int64_t i = 0; i < NB * KB; ++i) sb[e * NB * KB + i] = d.w.scales[((e + 1) % d.E) * NB * KB + i];
  expect_caught(d.a.scales, sb, "W's scales of the next expert");
  sb = d.w.scales;  // the next column block's
  for (int64_t e = 0; e < d.E; ++e)
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb)
        sb[(e * NB + nb) * KB + kb] = d.w.scales[(e * NB + (nb + 1) % NB) * KB + kb];
  expect_caught(d.a.scales, sb, "W's scales of the next column block");
}

// ---------------------------------------------------------------- CPU: the check and the reference
TEST(GemmFp8Check, CatchesWrongUnwrittenAndStrayElements) {
  const GemmCase k{{3, 0, 2}, 16, 32, 24, 1};
  mtest::Rng rng(mtest::test_seed(20));
  const GemmData d = make_data(k, rng);
  const ref::Fp8GemmResult want = ref::grouped_gemm_fp8(d.a.q.data(), d.a.scales.data(), d.R, d.w.q.data(),
                                                         d.w.scales.data(), d.offsets.data(), d.E, d.N, d.K);
  std::vector<uint16_t> c(static_cast<size_t>(d.R * d.ldc), kPoison);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t n = 0; n < d.N; ++n) c[r * d.ldc + n] = ref::float_to_bf16(static_cast<float>(want.c[r * d.N + n]));
  EXPECT_TRUE(matches(want, c, d.ldc));
  auto off = c;
  // 5% of Σ|a·b|: above the tolerance, at most (2^-8 + 2^-10)·Σ|a·b|
  off[2 * d.ldc + 3] = ref::float_to_bf16(static_cast<float>(want.c[2 * d.N + 3] + 0.05 * want.abs[2 * d.N + 3]));
  EXPECT_FALSE(matches(want, off, d.ldc)) << "an error of 5% of the element's scale";
  auto unwritten = c;
  unwritten[4 * d.ldc + 15] = kPoison;
  EXPECT_FALSE(matches(want, unwritten, d.ldc)) << "an unwritten element";
  auto stray = c;
  stray[5 * d.ldc] = 0;  // the row after the last expert
  EXPECT_FALSE(matches(want, stray, d.ldc)) << "a write outside the experts' rows";
  stray = c;
  stray[d.ldc + d.N] = 0;  // a padding column
  EXPECT_FALSE(matches(want, stray, d.ldc)) << "a write into the padding columns";
}

TEST(GemmFp8Reference, SmallCaseByHand) {
  // Aq codes 0x38 (1.0) with row scales 2 (K block 0) and 3 (K block 1); Wq codes 0x40 (2.0)
  // with scale 0.5 for expert 0 and 0x30 (0.5) with scale 4 for expert 1; K = 160 (128 + 32).
  const int64_t R = 3, N = 8, K = 160, E = 2;
  std::vector<uint8_t> aq(R * K, 0x38), wq(E * N * K, 0x40);
  std::fill(wq.begin() + N * K, wq.end(), 0x30);
  std::vector<float> sa = {2, 3, 2, 3, 2, 3}, sb = {0.5f, 0.5f, 4, 4};
  const std::vector<int32_t> off = {0, 1, 3};
  const auto got = ref::grouped_gemm_fp8(aq.data(), sa.data(), R, wq.data(), sb.data(), off.data(), E, N, K);
  // expert 0: 128·2·1 + 32·3·1 = 352; expert 1: (128·2 + 32·3)·2 = 704
  EXPECT_EQ(got.c[0], 352.0);
  EXPECT_EQ(got.c[1 * N + 5], 704.0);
  EXPECT_EQ(got.abs[2 * N + 7], 704.0);
  EXPECT_THROW(ref::grouped_gemm_fp8(aq.data(), sa.data(), R, wq.data(), sb.data(), std::vector<int32_t>{0, 2, 1}.data(),
                                     E, N, K),
               Error);
}

// ---------------------------------------------------------------- argument rules (no GPU needed)
TEST(GemmFp8Api, RefusesBadArguments) {
  // Fake device addresses: every call below is refused before it touches one.
  auto* p16 = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  auto* f16 = reinterpret_cast<float*>(p16 + 4096);
  auto* i16 = reinterpret_cast<int32_t*>(p16 + 8192);
  GroupedGemmFp8Args base;
  base.a_q = p16, base.a_scales = f16, base.R = 256, base.w_q = p16, base.w_scales = f16;
  base.expert_offsets = i16, base.E = 4, base.N = 256, base.K = 256, base.c = p16, base.ldc = 256;
  auto refused = [&](auto change, const char* arg, const char* what) {
    mtest::expect_refused(base, change, arg, what, [](const GroupedGemmFp8Args& a) { grouped_gemm_fp8(a, nullptr); });
  };
  using A = GroupedGemmFp8Args;
  refused([](A& a) { a.E = 0; }, "E", "E = 0");
  refused([](A& a) { a.E = (1 << 24) + 1; }, "E", "E > 2^24");
  refused([](A& a) { a.N = 12; }, "N", "N not a multiple of 8");
  refused([](A& a) { a.N = 0; }, "N", "N = 0");
  refused([](A& a) { a.K = 24; }, "K", "K not a multiple of 16");
  refused([](A& a) { a.K = 0; }, "K", "K = 0");
  refused([](A& a) { a.R = -1; }, "R", "R < 0");
  refused([](A& a) { a.R = int64_t{1} << 31; }, "R", "R >= 2^31");
  refused([](A& a) { a.E = 1 << 20, a.N = 4096, a.tile_offsets = reinterpret_cast<int32_t*>(uintptr_t{1} << 24); },
          "E*N", "E*N >= 2^31");
  refused([](A& a) { a.E = 1, a.R = (int64_t{1} << 31) - 1, a.N = 1 << 20, a.ldc = a.N; }, "R*N", "2^36 tiles");
  refused([](A& a) { a.ldc = 248; }, "ldc", "ldc < N");
  refused([](A& a) { a.ldc = 260; }, "ldc", "ldc not a multiple of 8");
  refused([](A& a) { a.a_q = nullptr; }, "a_q/a_scales/w_q/w_scales/expert_offsets", "a_q null");
  refused([](A& a) { a.c = nullptr; }, "c", "c null");
  refused([](A& a) { a.E = 513; }, "tile_offsets", "E > 512 without tile_offsets");
  refused([&](A& a) { a.a_q = p16 + 8; }, "a_q", "a_q misaligned");
  refused([&](A& a) { a.w_q = p16 + 4; }, "w_q", "w_q misaligned");
  refused([&](A& a) { a.c = p16 + 4; }, "c", "c misaligned");
  refused([&](A& a) { a.a_scales = reinterpret_cast<float*>(p16 + 2); }, "a_scales", "a_scales misaligned");
  refused([&](A& a) { a.w_scales = reinterpret_cast<float*>(p16 + 1); }, "w_scales", "w_scales misaligned");
  refused([](A& a) { a.max_ctas = -1; }, "max_ctas", "max_ctas < 0");
  auto* g16 = reinterpret_cast<int32_t*>(p16 + 12288);
  refused([&](A& a) { a.gather = g16, a.T = -1; }, "T", "T < 0 with a gather");
  refused([&](A& a) { a.gather = g16, a.T = int64_t{1} << 31; }, "T", "T >= 2^31 with a gather");
  refused([&](A& a) { a.gather = g16, a.T = (int64_t{1} << 31) - 1, a.K = 64; }, "T*K", "T·K >= 2^36 with a gather");
  refused([&](A& a) { a.gather = reinterpret_cast<int32_t*>(p16 + 2), a.T = 16; }, "gather", "gather misaligned");
  // R = 0 is valid and does nothing, without touching the device.
  GroupedGemmFp8Args empty = base;
  empty.R = 0;
  EXPECT_NO_THROW(grouped_gemm_fp8(empty, nullptr));
  empty.T = -1;  // T is not read without a gather
  EXPECT_NO_THROW(grouped_gemm_fp8(empty, nullptr));
  empty.gather = g16, empty.T = 0;  // a gather over no rows of a_q (every gathered row would be NaN)
  EXPECT_NO_THROW(grouped_gemm_fp8(empty, nullptr));
}

}  // namespace
