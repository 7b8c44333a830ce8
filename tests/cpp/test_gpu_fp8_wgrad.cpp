// The FP8 weight-gradient grouped GEMM (machmoe/fp8_wgrad.hpp, grouped_wgrad_fp8) on the GPU
// against a float64 GEMM on the dequantised operands. The operands come from the CPU reference of
// quantize_columns_fp8 (bitwise what the GPU quantiser writes; one test chains the GPU quantiser
// itself), so the only differences are the GPU's accumulation and its output rounding.
//
// Tolerance, derived as for the forward FP8 GEMM (test_gpu_fp8_gemm.cpp). Per element, with
// abs = Σ_k |a_k·b_k| (float64, dequantised):
//   - the output rounding: <= 2^-9·|c| for bf16, 2^-24·|c| for fp32;
//   - the accumulation: each 128-deep chunk is summed by the tensor cores in four k32 steps. FP8
//     accumulation keeps ~13-14 bits (DeepSeek-V3 §3.3), and it truncates each product aligned to
//     the step's largest term, so a step of 32 products loses up to 32·2^-13 = 2^-8 of its largest
//     term, not of their sum; the chunk is then promoted in fp32 (~2^-24): <= 2^-8·abs per element
//     in the worst case. Measured on an H200 with the structured data (products spanning 2^18):
//     up to 1.3e-3·abs (2^-9.6), above a bound of 2^-13 of each step's sum (2·2^-11·abs in all).
//   |got - c| <= 2·u·|c| + 2^-8·abs per element (the worst case, no further margin); normwise
//   2·(u + 2^-11·|abs|/|c|), where the per-element errors average out.
// An expert without chunks must give exact zeros (c = abs = 0: tolerance 0).
// A misapplied scale (a chunk's scale taken from the next chunk) changes a chunk's contribution
// by a factor >= 2 in the structured cases, where every (chunk, column) of both operands has its
// own power-of-two magnitude: far outside the bound. WgradFp8Check.ScaleFromNextChunkIsCaught shows
// it on the reference alone (no GPU); GpuFp8Wgrad.ScaleMistakesAreCaught feeds such scales to the
// kernel. Outputs are poisoned first (0xff: NaN in fp32 and bf16): every element must be written,
// and the poisoned guards on both sides of C must stay as they were.
// The GPU tests skip without a GPU; the check, the reference and the argument rules run everywhere.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fp8_test_util.hpp"
#include "gpu_util.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/fp8_wgrad.hpp"
#include "machmoe/reference_fp8.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::have_gpu;

enum class Values { Plain, Structured, WideRange };

// A problem: the experts' row counts (R = their sum), the operands' widths, the data, the output.
struct WgradCase {
  std::vector<int32_t> rows;  // [E]
  int64_t M = 0, N = 0;
  Values values = Values::Plain;
  DType c_dtype = DType::FP32;
  bool transpose_c = false;
  int max_ctas = 0;
};

struct WgradData {
  int64_t E = 0, R = 0, M = 0, N = 0;
  std::vector<int32_t> offsets;  // [E+1] expert_offsets
  ref::Fp8Columns a, b;          // A = the columns of x [R, M], B = those of dH [R, N]
};

// Magnitude 2^(m mod 9 - 4): nine distinct scales, neighbours a factor 2 apart.
double magnitude(int64_t m) { return std::ldexp(1.0, static_cast<int>(m % 9) - 4); }

// Rows [R, width] bf16. Structured: row r of global chunk c, column i has magnitude
// magnitude(step·c + i % 5 + shift), so that each chunk's scale differs from the next's by 2^step
// (mod the wrap) in every column; WideRange: random_bf16 (2^[-30, 30] per 128 elements).
std::vector<uint16_t> make_rows(const WgradCase& k, const std::vector<int32_t>& chunk_of_row, int64_t width,
                                int64_t step, int64_t shift, mtest::Rng& rng) {
  const size_t R = chunk_of_row.size();
  if (k.values == Values::WideRange) return mtest::random_bf16(rng, R * static_cast<size_t>(width));
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<uint16_t> x(R * static_cast<size_t>(width));
  for (size_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < width; ++i) {
      const double m = k.values == Values::Structured ? magnitude(step * chunk_of_row[r] + i % 5 + shift) : 1.0;
      x[r * width + i] = ref::float_to_bf16(static_cast<float>(u(rng) * m));
    }
  return x;
}

WgradData make_data(const WgradCase& k, mtest::Rng& rng) {
  WgradData d;
  d.E = static_cast<int64_t>(k.rows.size());
  d.M = k.M, d.N = k.N;
  d.offsets.assign(static_cast<size_t>(d.E + 1), 0);
  for (int64_t e = 0; e < d.E; ++e) d.offsets[e + 1] = d.offsets[e] + k.rows[e];
  d.R = d.offsets[d.E];
  std::vector<int32_t> chunk_of_row(static_cast<size_t>(d.R));
  for (int64_t e = 0, c0 = 0; e < d.E; c0 += (k.rows[e] + 127) / 128, ++e)
    for (int32_t r = d.offsets[e]; r < d.offsets[e + 1]; ++r)
      chunk_of_row[r] = static_cast<int32_t>(c0 + (r - d.offsets[e]) / 128);
  const std::vector<uint16_t> x = make_rows(k, chunk_of_row, d.M, 2, 0, rng);
  const std::vector<uint16_t> dh = make_rows(k, chunk_of_row, d.N, 5, 1, rng);
  d.a = ref::quantize_columns_fp8(x.data(), d.R, d.M, d.M, nullptr, d.R, d.offsets.data(), d.E);
  d.b = ref::quantize_columns_fp8(dh.data(), d.R, d.N, d.N, nullptr, d.R, d.offsets.data(), d.E);
  return d;
}

// The float64 result on the dequantised operands, with the given scales: c and abs [E, M, N].
struct WgradRef {
  int64_t E = 0, M = 0, N = 0;
  std::vector<double> c, abs;
};

// q·s of one operand (qt [max_chunks, width, 128], scales [max_chunks, width]) as [width, r_pad],
// each column's rows contiguous, for the chunks that exist (the rest is never read).
std::vector<double> dequantise(const ref::Fp8Columns& q, const std::vector<float>& scales, int64_t used) {
  std::vector<double> v(static_cast<size_t>(q.d * q.r_pad), 0.0);
  for (int64_t i = 0; i < q.d; ++i)
    for (int64_t k = 0; k < 128 * used; ++k) {
      const int64_t c = k / 128;
      v[i * q.r_pad + k] = static_cast<double>(ref::e4m3_to_float(q.qt[(c * q.d + i) * 128 + k % 128])) *
                           static_cast<double>(scales[c * q.d + i]);
    }
  return v;
}

WgradRef reference(const WgradData& d, const std::vector<float>& sa, const std::vector<float>& sb) {
  WgradRef out;
  out.E = d.E, out.M = d.M, out.N = d.N;
  out.c.assign(static_cast<size_t>(d.E * d.M * d.N), 0.0);
  out.abs = out.c;
  const std::vector<int32_t>& co = d.a.chunk_offsets;
  const int64_t r_pad = d.a.r_pad;
  const std::vector<double> A = dequantise(d.a, sa, co[d.E]), B = dequantise(d.b, sb, co[d.E]);
  for (int64_t e = 0; e < d.E; ++e) {
    const int64_t k0 = 128 * int64_t{co[e]}, k1 = 128 * int64_t{co[e + 1]};
    // Four columns n at a time (N is a multiple of 16): eight independent sums, about ten times
    // faster than one dot product at a time (seconds at d = 2880).
    for (int64_t m = 0; m < d.M; ++m)
      for (int64_t n = 0; n < d.N; n += 4) {
        const double* a = A.data() + m * r_pad;
        const double* b = B.data() + n * r_pad;
        double s[4] = {0, 0, 0, 0}, t[4] = {0, 0, 0, 0};
        for (int64_t k = k0; k < k1; ++k)
          for (int j = 0; j < 4; ++j) {
            const double p = a[k] * b[j * r_pad + k];
            s[j] += p;
            t[j] += std::fabs(p);
          }
        for (int j = 0; j < 4; ++j) {
          out.c[(e * d.M + m) * d.N + n + j] = s[j];
          out.abs[(e * d.M + m) * d.N + n + j] = t[j];
        }
      }
  }
  return out;
}

// The comparison (host only, so that a test can feed it a corrupted result): got [E, M, N] in
// C's logical order (the caller undoes transpose_c), as doubles; NaN = never written.
::testing::AssertionResult matches(const WgradRef& want, const std::vector<double>& got, DType dtype) {
  const double u = dtype == DType::BF16 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -24);
  double err2 = 0, ref2 = 0, abs2 = 0, worst = 0;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < want.c.size(); ++i) {
    const double c = want.c[i], a = want.abs[i], err = std::fabs(got[i] - c);
    const double tol = 2 * u * std::fabs(c) + std::ldexp(a, -8);
    if (!std::isfinite(got[i]) || !(err <= tol)) {
      if (bad++ == 0) {
        const int64_t e = static_cast<int64_t>(i) / (want.M * want.N), mn = static_cast<int64_t>(i) % (want.M * want.N);
        first = "expert " + std::to_string(e) + " m " + std::to_string(mn / want.N) + " n " +
                std::to_string(mn % want.N) + ": got " + std::to_string(got[i]) + ", want " + std::to_string(c) +
                " (abs " + std::to_string(a) + ", tol " + std::to_string(tol) + ")";
      }
      continue;
    }
    if (a > 0) worst = std::max(worst, err / a);
    err2 += err * err, ref2 += c * c, abs2 += a * a;
  }
  if (bad) return ::testing::AssertionFailure() << bad << " elements wrong; first: " << first;
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0;
  const double tol = ref2 > 0 ? 2 * (u + std::ldexp(std::sqrt(abs2 / ref2), -11)) : 0;
  if (!(rel <= tol) && ref2 > 0) return ::testing::AssertionFailure() << "normwise error " << rel << " above " << tol;
  return ::testing::AssertionSuccess() << "normwise error " << rel << " (tolerance " << tol << "), worst |err|/abs "
                                       << worst;
}

// C's bytes as doubles in [E, M, N] order.
std::vector<double> decode(const std::vector<unsigned char>& bytes, const WgradData& d, DType dtype, bool transpose_c) {
  const int64_t count = d.E * d.M * d.N;
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t e = 0; e < d.E; ++e)
    for (int64_t m = 0; m < d.M; ++m)
      for (int64_t n = 0; n < d.N; ++n) {
        const int64_t at = transpose_c ? (e * d.N + n) * d.M + m : (e * d.M + m) * d.N + n;
        double x;
        if (dtype == DType::FP32) {
          float f;
          std::memcpy(&f, bytes.data() + 4 * at, 4);
          x = f;
        } else {
          uint16_t h;
          std::memcpy(&h, bytes.data() + 2 * at, 2);
          x = ref::bf16_to_float(h);
        }
        v[(e * d.M + m) * d.N + n] = x;
      }
  return v;
}

template <typename T>
void upload(const std::vector<T>& h, DeviceBuffer& dst) {
  if (!h.empty()) ASSERT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

// Bytes of poison on each side of C in run_gpu's buffer: more than a whole tile of any format
// (128 x 256 fp32 = 128 KB), so that a store past C's ends (an unclipped TMA box, a row past M
// of the last expert) lands inside it.
constexpr size_t kGuardBytes = size_t{1} << 18;

// One call on the GPU with the given scales (the data's own unless the caller corrupts them);
// returns C's bytes, poisoned before the call. C sits between two guards, poisoned too, which the
// call must leave as they were.
std::vector<unsigned char> run_gpu(const WgradData& d, const std::vector<float>& sa, const std::vector<float>& sb,
                                   const WgradCase& k) {
  const size_t c_bytes = static_cast<size_t>(d.E * d.M * d.N * dtype_size(k.c_dtype));
  DeviceBuffer aq(d.a.qt.size()), das(sa.size() * 4), bq(d.b.qt.size()), dsb(sb.size() * 4),
      co(d.a.chunk_offsets.size() * 4), guarded(c_bytes + 2 * kGuardBytes);
  upload(d.a.qt, aq);
  upload(sa, das);
  upload(d.b.qt, bq);
  upload(sb, dsb);
  upload(d.a.chunk_offsets, co);
  EXPECT_EQ(cudaMemset(guarded.ptr, 0xff, c_bytes + 2 * kGuardBytes), cudaSuccess);
  void* c = static_cast<unsigned char*>(guarded.ptr) + kGuardBytes;
  GroupedWgradFp8Args a;
  a.a_qt = static_cast<const uint8_t*>(aq.ptr), a.a_scales = static_cast<const float*>(das.ptr), a.M = d.M;
  a.b_qt = static_cast<const uint8_t*>(bq.ptr), a.b_scales = static_cast<const float*>(dsb.ptr), a.N = d.N;
  a.chunk_offsets = static_cast<const int32_t*>(co.ptr), a.E = d.E, a.max_chunks = d.a.max_chunks;
  a.c = c, a.c_dtype = k.c_dtype, a.transpose_c = k.transpose_c, a.max_ctas = k.max_ctas;
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  grouped_wgrad_fp8(a, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  std::vector<unsigned char> all = mtest::bytes_of(guarded.ptr, c_bytes + 2 * kGuardBytes);
  const auto poisoned = [](unsigned char b) { return b == 0xff; };
  EXPECT_TRUE(std::all_of(all.begin(), all.begin() + kGuardBytes, poisoned)) << "a write before C";
  EXPECT_TRUE(std::all_of(all.end() - kGuardBytes, all.end(), poisoned)) << "a write past C's end";
  return std::vector<unsigned char>(all.begin() + kGuardBytes, all.end() - kGuardBytes);
}

std::string describe(const WgradCase& k) {
  std::string s = "rows {";
  for (size_t e = 0; e < k.rows.size() && e < 8; ++e) s += (e ? "," : "") + std::to_string(k.rows[e]);
  if (k.rows.size() > 8) s += ",... (E=" + std::to_string(k.rows.size()) + ")";
  const char* values[] = {"plain", "structured", "wide-range"};
  return s + "} M=" + std::to_string(k.M) + " N=" + std::to_string(k.N) + " " + values[static_cast<int>(k.values)] +
         (k.c_dtype == DType::BF16 ? " bf16" : " fp32") + (k.transpose_c ? " transposed" : "") +
         " max_ctas=" + std::to_string(k.max_ctas);
}

void check_case(const WgradCase& k, uint64_t salt) {
  SCOPED_TRACE(describe(k));
  const uint64_t seed = mtest::test_seed(salt);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const WgradData d = make_data(k, rng);
  const WgradRef want = reference(d, d.a.scales, d.b.scales);
  const std::vector<unsigned char> got = run_gpu(d, d.a.scales, d.b.scales, k);
  const ::testing::AssertionResult ok = matches(want, decode(got, d, k.c_dtype, k.transpose_c), k.c_dtype);
  EXPECT_TRUE(ok);
  if (ok) std::printf("  %s: %s\n", describe(k).c_str(), ok.message());
  // Deterministic: a second call gives the same bits.
  EXPECT_TRUE(run_gpu(d, d.a.scales, d.b.scales, k) == got) << "two calls differ";
}

// Each chunk's scales replaced by the next chunk's (the last one's by chunk 0's): the mistake of a
// kernel that reads row c + 1 of the scale tensor.
std::vector<float> next_chunk_scales(const ref::Fp8Columns& q) {
  std::vector<float> s = q.scales;
  const int64_t used = q.chunk_offsets.back();
  for (int64_t i = 0; i < q.d; ++i)
    for (int64_t c = 0; c < used; ++c) s[c * q.d + i] = q.scales[((c + 1) % used) * q.d + i];
  return s;
}

// ---------------------------------------------------------------- GPU
TEST(GpuFp8Wgrad, EdgeExpertsEveryOutputFormat) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // An empty expert first and in the middle, one of 1 row, one of 300 (a partial third chunk), one
  // of exactly 128, one of 129 (a chunk of one row); M = 272: a partial second row tile; N = 400:
  // a partial second column tile whose second wave holds 16 columns.
  for (const DType dt : {DType::FP32, DType::BF16})
    for (const bool tr : {false, true})
      check_case({{0, 1, 300, 128, 0, 129}, 272, 400, Values::Structured, dt, tr}, 1 + 2 * (dt == DType::BF16) + tr);
}

// The edges of the staged bf16 store (TMA boxes clipped by the map of C as [E][rows][cols]), in
// both layouts, with C between guards (run_gpu): M = 208, a last row tile whose second consumer
// holds 16 of its 64 rows (transposed: a box 16 columns wide); N = 336, a last column tile of 80
// columns (one live wave: transposed, a box of 80 of its 256 rows; plain, a full box and one of
// 16 columns, two boxes skipped); then M = 64 (the second consumer has no rows at all) with
// N = 16 (a plain box clipped to 16 columns, a transposed one to 16 rows). Experts without chunks
// first, in the middle and last: their zeros leave by the same stores. max_ctas = 3: each CTA
// walks several tiles, so a staging half is rewritten after its previous store.
TEST(GpuFp8Wgrad, StagedStoreEdges) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  for (const bool tr : {false, true}) {
    check_case({{0, 260, 0, 129, 1, 0}, 208, 336, Values::Structured, DType::BF16, tr, 3}, 22 + tr);
    check_case({{0, 130, 0, 5, 0}, 64, 16, Values::Structured, DType::BF16, tr}, 24 + tr);
  }
}

TEST(GpuFp8Wgrad, OneRow) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{0, 1, 0}, 16, 16}, 5);                                // T = 1 in the middle expert
  check_case({{1}, 48, 32, Values::Plain, DType::BF16, true}, 6);    // E = 1, T = 1
}

TEST(GpuFp8Wgrad, SevenBaDw1Shape) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // 7B-a-like dW1: M = d = 1536, N = n1 = 512; stored transposed in bf16 as dW1 [E, n1, d] is.
  const std::vector<int32_t> rows = {70, 0, 129, 1, 256, 40, 100, 3};
  check_case({rows, 1536, 512, Values::Plain, DType::BF16, true}, 7);
  check_case({rows, 1536, 512, Values::Structured, DType::FP32, false}, 8);
}

TEST(GpuFp8Wgrad, GptOssWidths) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // d = 2880 (22.5 row tiles) and N = 2·2880 (22.5 column tiles), one chunk.
  check_case({{100, 0}, 2880, 5760, Values::Plain, DType::BF16}, 9);
}

TEST(GpuFp8Wgrad, ManyExpertsFewCtas) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  WgradCase k;
  mtest::Rng rng(mtest::test_seed(10));
  for (int e = 0; e < 130; ++e) k.rows.push_back(static_cast<int32_t>(rng() % 6));
  k.rows[77] = 300;
  k.M = 144, k.N = 80, k.values = Values::Structured;
  for (const int ctas : {0, 2, 1}) {  // 2 and 1 CTAs walk hundreds of tiles: the stage ring wraps
    k.max_ctas = ctas;
    check_case(k, 11 + ctas);
  }
}

TEST(GpuFp8Wgrad, WideRangeValues) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{200, 57}, 256, 512, Values::WideRange}, 14);
  check_case({{200, 57}, 256, 512, Values::WideRange, DType::BF16}, 15);
}

TEST(GpuFp8Wgrad, NoRowsZeroesC) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{0, 0, 0}, 32, 48}, 16);                              // max_chunks = 0: C = 0
  check_case({{0, 0, 0}, 32, 48, Values::Plain, DType::BF16, true}, 17);
}

// Misapplied scales give a result the comparison refuses (and the right scales one it accepts).
TEST(GpuFp8Wgrad, ScaleMistakesAreCaught) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const WgradCase k{{150, 0, 90, 1}, 144, 272, Values::Structured};
  const uint64_t seed = mtest::test_seed(18);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const WgradData d = make_data(k, rng);
  const WgradRef want = reference(d, d.a.scales, d.b.scales);
  auto gpu = [&](const std::vector<float>& sa, const std::vector<float>& sb) {
    return decode(run_gpu(d, sa, sb, k), d, k.c_dtype, k.transpose_c);
  };
  EXPECT_TRUE(matches(want, gpu(d.a.scales, d.b.scales), k.c_dtype));
  EXPECT_FALSE(matches(want, gpu(next_chunk_scales(d.a), d.b.scales), k.c_dtype)) << "A's next-chunk scales";
  EXPECT_FALSE(matches(want, gpu(d.a.scales, next_chunk_scales(d.b)), k.c_dtype)) << "B's next-chunk scales";
}

// The whole FP8 wgrad path on the device: quantize_columns_fp8 of a gathered x and of dH (the
// GPU quantiser, unused chunks of its outputs poisoned with NaN codes and scales, which the GEMM
// must never read), then the GEMM, against the reference built from the CPU quantiser.
TEST(GpuFp8Wgrad, AfterTheGpuQuantiser) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const int64_t T = 500, M = 400, N = 272;
  const std::vector<int32_t> offsets = {0, 200, 200, 201, 460};
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, R = offsets.back();
  const uint64_t seed = mtest::test_seed(19);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  std::vector<int32_t> gather(static_cast<size_t>(R));
  for (auto& g : gather) g = static_cast<int32_t>(rng() % T);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<uint16_t> x(static_cast<size_t>(T * M)), dh(static_cast<size_t>(R * N));
  for (auto& v : x) v = ref::float_to_bf16(static_cast<float>(u(rng)));
  for (auto& v : dh) v = ref::float_to_bf16(static_cast<float>(u(rng) * 1e-3));
  WgradData d;
  d.E = E, d.R = R, d.M = M, d.N = N, d.offsets = offsets;
  d.a = ref::quantize_columns_fp8(x.data(), T, M, M, gather.data(), R, offsets.data(), E);
  d.b = ref::quantize_columns_fp8(dh.data(), R, N, N, nullptr, R, offsets.data(), E);
  const WgradRef want = reference(d, d.a.scales, d.b.scales);

  const Fp8ColumnsLayout la = fp8_columns_layout(R, E, M), lb = fp8_columns_layout(R, E, N);
  ASSERT_EQ(la.max_chunks, d.a.max_chunks);
  DeviceBuffer dx(x.size() * 2), ddh(dh.size() * 2), dg(gather.size() * 4), doff(offsets.size() * 4),
      co_a(la.chunk_offsets_bytes), co_b(lb.chunk_offsets_bytes), qa(la.qt_bytes), sa(la.scales_bytes),
      qb(lb.qt_bytes), sb(lb.scales_bytes), c(static_cast<size_t>(E * M * N) * 2);
  upload(x, dx);
  upload(dh, ddh);
  upload(gather, dg);
  upload(offsets, doff);
  ASSERT_EQ(cudaMemset(qa.ptr, 0xff, la.qt_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(qb.ptr, 0xff, lb.qt_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(sa.ptr, 0xff, la.scales_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(sb.ptr, 0xff, lb.scales_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(c.ptr, 0xff, static_cast<size_t>(E * M * N) * 2), cudaSuccess);
  QuantizeColumnsArgs q;
  q.x = dx.ptr, q.T = T, q.d = M, q.ld = M, q.gather = static_cast<const int32_t*>(dg.ptr), q.R = R;
  q.expert_offsets = static_cast<const int32_t*>(doff.ptr), q.E = E;
  q.chunk_offsets = static_cast<int32_t*>(co_a.ptr), q.qt = static_cast<uint8_t*>(qa.ptr);
  q.scales = static_cast<float*>(sa.ptr);
  quantize_columns_fp8(q, nullptr);
  q.x = ddh.ptr, q.T = R, q.d = N, q.ld = N, q.gather = nullptr;
  q.chunk_offsets = static_cast<int32_t*>(co_b.ptr), q.qt = static_cast<uint8_t*>(qb.ptr);
  q.scales = static_cast<float*>(sb.ptr);
  quantize_columns_fp8(q, nullptr);
  GroupedWgradFp8Args a;
  a.a_qt = static_cast<const uint8_t*>(qa.ptr), a.a_scales = static_cast<const float*>(sa.ptr), a.M = M;
  a.b_qt = static_cast<const uint8_t*>(qb.ptr), a.b_scales = static_cast<const float*>(sb.ptr), a.N = N;
  a.chunk_offsets = static_cast<const int32_t*>(co_a.ptr), a.E = E, a.max_chunks = la.max_chunks;
  a.c = c.ptr, a.c_dtype = DType::BF16, a.transpose_c = true;
  grouped_wgrad_fp8(a, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<unsigned char> got = mtest::bytes_of(c.ptr, static_cast<size_t>(E * M * N) * 2);
  const ::testing::AssertionResult ok = matches(want, decode(got, d, DType::BF16, true), DType::BF16);
  EXPECT_TRUE(ok);
  if (ok) std::printf("  after the GPU quantiser: %s\n", ok.message());
}

// ---------------------------------------------------------------- CPU: the check and the reference
TEST(WgradFp8Check, CatchesWrongAndUnwrittenElements) {
  const WgradCase k{{3, 0, 130}, 32, 48, Values::Plain};
  mtest::Rng rng(mtest::test_seed(20));
  const WgradData d = make_data(k, rng);
  const WgradRef want = reference(d, d.a.scales, d.b.scales);
  std::vector<double> c = want.c;
  for (auto& v : c) v = ref::bf16_to_float(ref::float_to_bf16(static_cast<float>(v)));
  EXPECT_TRUE(matches(want, c, DType::BF16));
  auto off = c;
  const size_t i = static_cast<size_t>((2 * d.M + 5) * d.N + 7);  // expert 2
  off[i] += 0.05 * want.abs[i];  // 5% of Σ|a·b|: above the tolerance, at most (2^-8 + 2^-10)·Σ|a·b|
  EXPECT_FALSE(matches(want, off, DType::BF16)) << "an error of 5% of the element's scale";
  auto unwritten = c;
  unwritten[static_cast<size_t>(d.M * d.N + 3)] = NAN;  // expert 1, which has no rows
  EXPECT_FALSE(matches(want, unwritten, DType::BF16)) << "an unwritten element";
  auto nonzero = c;
  nonzero[static_cast<size_t>(d.M * d.N + 4)] = 1e-30;  // an empty expert must be exactly 0
  EXPECT_FALSE(matches(want, nonzero, DType::BF16)) << "a nonzero element of an empty expert";
}

// The check refuses the result of a kernel that takes each chunk's scale from the next chunk (no
// GPU needed: the float64 result with those scales stands for the kernel's), in each operand.
TEST(WgradFp8Check, ScaleFromNextChunkIsCaught) {
  for (const auto& rows : {std::vector<int32_t>{150, 0, 90, 1}, std::vector<int32_t>{0, 1, 300, 128, 0, 129}}) {
    const WgradCase k{rows, 144, 80, Values::Structured};
    mtest::Rng rng(mtest::test_seed(21));
    const WgradData d = make_data(k, rng);
    const WgradRef want = reference(d, d.a.scales, d.b.scales);
    EXPECT_TRUE(matches(want, want.c, DType::FP32));
    EXPECT_FALSE(matches(want, reference(d, next_chunk_scales(d.a), d.b.scales).c, DType::FP32)) << "A's scales";
    EXPECT_FALSE(matches(want, reference(d, d.a.scales, next_chunk_scales(d.b)).c, DType::FP32)) << "B's scales";
  }
}

TEST(WgradFp8Reference, SmallCaseByHand) {
  // Expert 0: 130 rows (chunks 0 and 1), expert 1: none, expert 2: 1 row (chunk 2). A = x's
  // columns, all 1.0 in x (scale 1/448, codes 448); B = dH's columns, all 2.0 (scale 2/448).
  const int64_t M = 16, N = 16, R = 131, E = 3;
  const std::vector<int32_t> offsets = {0, 130, 130, 131};
  std::vector<uint16_t> x(static_cast<size_t>(R * M), ref::float_to_bf16(1.f)),
      dh(static_cast<size_t>(R * N), ref::float_to_bf16(2.f));
  WgradData d;
  d.E = E, d.R = R, d.M = M, d.N = N, d.offsets = offsets;
  d.a = ref::quantize_columns_fp8(x.data(), R, M, M, nullptr, R, offsets.data(), E);
  d.b = ref::quantize_columns_fp8(dh.data(), R, N, N, nullptr, R, offsets.data(), E);
  ASSERT_EQ(d.a.chunk_offsets, (std::vector<int32_t>{0, 2, 2, 3}));
  const WgradRef r = reference(d, d.a.scales, d.b.scales);
  // Σ over each expert's rows of 1·2; each dequantised value is 448·fl(v/448), within 2^-23 of v.
  EXPECT_NEAR(r.c[0], 260.0, 260e-6);
  EXPECT_EQ(r.c[static_cast<size_t>(M * N + 5)], 0.0);
  EXPECT_NEAR(r.c[static_cast<size_t>(2 * M * N + 17)], 2.0, 2e-6);
  EXPECT_NEAR(r.abs[static_cast<size_t>(M * N - 1)], 260.0, 260e-6);
}

// ---------------------------------------------------------------- argument rules (no GPU needed)
TEST(WgradFp8Api, RefusesBadArguments) {
  // Fake device addresses: every call below is refused before it touches one.
  auto* p16 = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  auto* f16 = reinterpret_cast<float*>(p16 + 4096);
  auto* i16 = reinterpret_cast<int32_t*>(p16 + 8192);
  GroupedWgradFp8Args base;
  base.a_qt = p16, base.a_scales = f16, base.M = 256, base.b_qt = p16, base.b_scales = f16, base.N = 256;
  base.chunk_offsets = i16, base.E = 4, base.max_chunks = 8, base.c = p16;
  auto refused = [&](auto change, const char* arg, const char* what) {
    mtest::expect_refused(base, change, arg, what, [](const GroupedWgradFp8Args& a) { grouped_wgrad_fp8(a, nullptr); });
  };
  using A = GroupedWgradFp8Args;
  refused([](A& a) { a.E = 0; }, "E", "E = 0");
  refused([](A& a) { a.E = (1 << 24) + 1; }, "E", "E > 2^24");
  refused([](A& a) { a.M = 24; }, "M", "M not a multiple of 16");
  refused([](A& a) { a.M = 0; }, "M", "M = 0");
  refused([](A& a) { a.M = (1 << 24) + 16; }, "M", "M > 2^24");
  refused([](A& a) { a.N = 8; }, "N", "N not a multiple of 16");
  refused([](A& a) { a.N = -16; }, "N", "N < 0");
  refused([](A& a) { a.max_chunks = -1; }, "max_chunks", "max_chunks < 0");
  refused([](A& a) { a.max_chunks = int64_t{1} << 24; }, "max_chunks", "128·max_chunks = 2^31");
  refused([](A& a) { a.E = 1 << 20, a.M = 1 << 14, a.N = 1 << 14; }, "E*M*N", "2^33 tiles");
  refused([](A& a) { a.c_dtype = DType::FP16; }, "c_dtype", "fp16 C");
  refused([](A& a) { a.c = nullptr; }, "c/chunk_offsets", "c null");
  refused([](A& a) { a.chunk_offsets = nullptr; }, "c/chunk_offsets", "chunk_offsets null");
  refused([](A& a) { a.b_scales = nullptr; }, "a_qt/a_scales/b_qt/b_scales", "b_scales null");
  refused([&](A& a) { a.a_qt = p16 + 8; }, "a_qt", "a_qt misaligned");
  refused([&](A& a) { a.b_qt = p16 + 4; }, "b_qt", "b_qt misaligned");
  refused([&](A& a) { a.c = p16 + 8; }, "c", "c misaligned");
  refused([&](A& a) { a.a_scales = reinterpret_cast<float*>(p16 + 4); }, "a_scales",
          "a_scales 4- but not 16-byte aligned (TMA)");
  refused([&](A& a) { a.b_scales = reinterpret_cast<float*>(p16 + 1); }, "b_scales", "b_scales misaligned");
  refused([&](A& a) { a.chunk_offsets = reinterpret_cast<int32_t*>(p16 + 2); }, "chunk_offsets",
          "chunk_offsets misaligned");
  refused([](A& a) { a.max_ctas = -1; }, "max_ctas", "max_ctas < 0");
}

}  // namespace
