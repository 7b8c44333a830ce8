// The FP8 quantisers of machmoe/fp8.hpp on the GPU against the CPU reference
// (machmoe/reference_fp8.hpp), bitwise: codes, scales (NaN patterns included) and chunk offsets.
// Outputs are poisoned (0xff: a NaN code that no quantiser writes, and a NaN scale with another
// pattern than the quantisers' 0x7fc00000) and followed by guard bytes, so that an element left
// unwritten or a write past the end shows. Also the device's E4M3 conversion against the
// reference's on every float of [2^-12, 2^10) of both signs and the special values. The GPU tests
// skip without a GPU; the argument rules (Fp8Api.*) are checked before any CUDA call and run
// everywhere.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fp8_test_util.hpp"
#include "gpu_util.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/reference_fp8.hpp"

namespace {

using mtest::bits_of;
using mtest::from_bits;
using mtest::random_bf16;

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::have_gpu;

constexpr size_t kGuard = 256;  // poisoned bytes after every output

template <typename T>
void upload(const std::vector<T>& h, DeviceBuffer& dst) {
  if (!h.empty()) ASSERT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

// An output of `bytes` bytes followed by kGuard guard bytes, all poisoned with 0xff.
struct Out {
  size_t bytes;
  DeviceBuffer buf;
  explicit Out(size_t n) : bytes(n), buf(n + kGuard) {
    EXPECT_EQ(cudaMemset(buf.ptr, 0xff, n + kGuard), cudaSuccess);
  }
  std::vector<unsigned char> all() const { return mtest::bytes_of(buf.ptr, bytes + kGuard); }
};

// Bitwise equality of byte ranges; names the first difference.
::testing::AssertionResult same_bytes(const std::string& what, const unsigned char* got, const unsigned char* want,
                                      size_t n, size_t elem = 1) {
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure() << what << ": byte " << i << " (element " << i / elem << ") is 0x"
                                           << std::hex << int(got[i]) << ", want 0x" << int(want[i]);
    }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult guard_intact(const std::string& what, const std::vector<unsigned char>& all, size_t bytes) {
  for (size_t i = bytes; i < all.size(); ++i)
    if (all[i] != 0xff) return ::testing::AssertionFailure() << what << ": written past its end, at byte " << i;
  return ::testing::AssertionSuccess();
}

const unsigned char* raw(const std::vector<float>& v) { return reinterpret_cast<const unsigned char*>(v.data()); }

TEST(Fp8Api, BitwiseComparisonCatchesOneByte) {
  std::vector<unsigned char> a(100, 7), b = a;
  EXPECT_TRUE(same_bytes("equal", a.data(), b.data(), a.size()));
  b[63] = 8;
  EXPECT_FALSE(same_bytes("one byte off", a.data(), b.data(), a.size()));
  std::vector<unsigned char> g(110, 0xff);
  EXPECT_TRUE(guard_intact("guard", g, 100));
  g[105] = 0;
  EXPECT_FALSE(guard_intact("guard", g, 100));
}

// ---------------------------------------------------------------- argument rules (no GPU needed)
void expect_refused(const std::function<void()>& f, const std::string& arg, const std::string& what) {
  const std::string msg = mtest::expect_error(ErrorCode::InvalidArgument, f, what);
  EXPECT_TRUE(mtest::contains_word(msg, arg)) << what << ": message does not name " << arg << ": " << msg;
}

TEST(Fp8Api, RefusesBadArguments) {
  // Fake device addresses: every call below is refused before it touches one.
  auto* p16 = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  auto* f16 = reinterpret_cast<float*>(p16 + 4096);
  auto* i16 = reinterpret_cast<int32_t*>(p16 + 8192);
  QuantizeRowsArgs r;
  r.x = p16, r.T = 4, r.d = 32, r.ld = 32, r.R = 4, r.q = p16, r.scales = f16;
  auto rows = [&](auto change, const char* arg, const char* what) {
    QuantizeRowsArgs a = r;
    change(a);
    expect_refused([&] { quantize_rows_fp8(a, nullptr); }, arg, what);
  };
  rows([](QuantizeRowsArgs& a) { a.d = 24, a.ld = 24; }, "d", "d not a multiple of 16");
  rows([](QuantizeRowsArgs& a) { a.d = 0, a.ld = 0; }, "d", "d = 0");
  rows([](QuantizeRowsArgs& a) { a.ld = 16; }, "ld", "ld < d");
  rows([](QuantizeRowsArgs& a) { a.ld = 36; }, "ld", "ld not a multiple of 8");
  rows([](QuantizeRowsArgs& a) { a.R = 3; }, "R", "R != T without gather");
  rows([](QuantizeRowsArgs& a) { a.T = -1; }, "T", "T < 0");
  rows([](QuantizeRowsArgs& a) { a.T = int64_t{1} << 31, a.R = a.T; }, "T", "T >= 2^31");
  rows([&](QuantizeRowsArgs& a) { a.x = p16 + 8; }, "x", "x misaligned");
  rows([&](QuantizeRowsArgs& a) { a.q = p16 + 4; }, "q", "q misaligned");
  rows([&](QuantizeRowsArgs& a) { a.q = nullptr; }, "q", "q null");
  rows([&](QuantizeRowsArgs& a) { a.scales = reinterpret_cast<float*>(p16 + 2); }, "scales", "scales misaligned");
  rows([&](QuantizeRowsArgs& a) { a.scales = nullptr; }, "scales", "scales null");
  rows([&](QuantizeRowsArgs& a) { a.gather = reinterpret_cast<int32_t*>(p16 + 1), a.R = 2; }, "gather",
       "gather misaligned");

  QuantizeColumnsArgs c;
  c.x = p16, c.T = 4, c.d = 32, c.ld = 32, c.R = 4, c.expert_offsets = i16, c.E = 2, c.chunk_offsets = i16;
  c.qt = p16, c.scales = f16;
  auto cols = [&](auto change, const char* arg, const char* what) {
    QuantizeColumnsArgs a = c;
    change(a);
    expect_refused([&] { quantize_columns_fp8(a, nullptr); }, arg, what);
  };
  cols([](QuantizeColumnsArgs& a) { a.E = 0; }, "E", "E = 0");
  cols([](QuantizeColumnsArgs& a) { a.d = 40, a.ld = 40; }, "d", "d not a multiple of 16");
  cols([](QuantizeColumnsArgs& a) { a.R = 5; }, "R", "R != T without gather");
  cols([](QuantizeColumnsArgs& a) { a.expert_offsets = nullptr; }, "expert_offsets", "offsets null");
  cols([](QuantizeColumnsArgs& a) { a.chunk_offsets = nullptr; }, "chunk_offsets", "chunk offsets null");
  cols([&](QuantizeColumnsArgs& a) { a.qt = p16 + 8; }, "qt", "qt misaligned");
  cols([&](QuantizeColumnsArgs& a) { a.scales = nullptr; }, "scales", "scales null");
  cols([&](QuantizeColumnsArgs& a) { a.x = p16 + 2; }, "x", "x misaligned");

  QuantizeWeightsArgs w;
  w.w = p16, w.E = 2, w.N = 64, w.K = 64, w.q = p16, w.scales = f16, w.qt = p16, w.scales_t = f16;
  auto wts = [&](auto change, const char* arg, const char* what) {
    QuantizeWeightsArgs a = w;
    change(a);
    expect_refused([&] { quantize_weights_fp8(a, nullptr); }, arg, what);
  };
  wts([](QuantizeWeightsArgs& a) { a.K = 72; }, "K", "K not a multiple of 16");
  wts([](QuantizeWeightsArgs& a) { a.N = 72, a.transposed = true; }, "N", "N not a multiple of 16 with transposed");
  wts([](QuantizeWeightsArgs& a) { a.E = -1; }, "E", "E < 0");
  wts([&](QuantizeWeightsArgs& a) { a.w = p16 + 8; }, "w", "w misaligned");
  wts([&](QuantizeWeightsArgs& a) { a.transposed = true, a.qt = p16 + 4; }, "qt", "qt misaligned");
  wts([](QuantizeWeightsArgs& a) { a.transposed = true, a.scales_t = nullptr; }, "qt/scales_t", "scales_t null");
  wts([](QuantizeWeightsArgs& a) { a.E = int64_t{1} << 30, a.N = 256, a.K = 256; }, "E*N*K", "too many blocks");

  expect_refused([] { convert_float_to_e4m3(nullptr, nullptr, -1, nullptr); }, "n", "n < 0");
  expect_refused([] { convert_float_to_e4m3(nullptr, nullptr, 5, nullptr); }, "x/q", "null with n > 0");
}

// ---------------------------------------------------------------- the conversion itself
void check_convert(const std::vector<float>& x, const std::string& what) {
  DeviceBuffer dx(x.size() * 4), dq(x.size());
  upload(x, dx);
  convert_float_to_e4m3(static_cast<const float*>(dx.ptr), static_cast<uint8_t*>(dq.ptr),
                        static_cast<int64_t>(x.size()), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<unsigned char> got = mtest::bytes_of(dq.ptr, x.size());
  size_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const int want = ref::float_to_e4m3(x[i]);
    if (got[i] != want && ++bad <= 5)
      ADD_FAILURE() << what << ": x bits 0x" << std::hex << bits_of(x[i]) << ": device 0x" << int(got[i])
                    << ", reference 0x" << want;
  }
  EXPECT_EQ(bad, 0u) << what;
}

TEST(GpuFp8, ConversionMatchesReferenceOnEveryFloatInRange) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const uint32_t lo = bits_of(std::ldexp(1.f, -12)), hi = bits_of(std::ldexp(1.f, 10));
  constexpr uint32_t kBatch = 1u << 24;
  std::vector<float> x;
  for (uint32_t b0 = lo; b0 < hi; b0 += kBatch) {
    const uint32_t n = std::min(kBatch, hi - b0);
    x.resize(2 * static_cast<size_t>(n));
    for (uint32_t i = 0; i < n; ++i) x[2 * i] = from_bits(b0 + i), x[2 * i + 1] = from_bits((b0 + i) | 0x80000000u);
    check_convert(x, "floats from bits 0x" + std::to_string(b0));
    if (HasFailure()) return;
  }
}

TEST(GpuFp8, ConversionMatchesReferenceOnSpecialValues) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  std::vector<float> x = {0.f, -0.f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          448.f, 464.f, 465.f, -464.f, std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()};
  for (uint32_t payload : {1u, 0x400000u, 0x7fffffu, 0x123u}) {
    x.push_back(from_bits(0x7f800000u | payload));
    x.push_back(from_bits(0xff800000u | payload));
  }
  for (uint32_t b = 0; b < 0x7f800000u; b += 0x3f1u) x.push_back(from_bits(b)), x.push_back(from_bits(b | 0x80000000u));
  check_convert(x, "special values and a stride over every float");
}

// ---------------------------------------------------------------- rows
struct RowsCase {
  int64_t T, d, ld, R;  // R < 0: no gather (R = T)
};

void check_rows(const RowsCase& k) {
  const bool gathered = k.R >= 0;
  const int64_t R = gathered ? k.R : k.T;
  SCOPED_TRACE("T=" + std::to_string(k.T) + " d=" + std::to_string(k.d) + " ld=" + std::to_string(k.ld) +
               " R=" + std::to_string(R) + (gathered ? " gathered" : ""));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(k.T * 7919 + k.d * 31 + R));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(k.T * k.ld));
  // A zero tile, a NaN and an Inf in other tiles, a NaN in the padding between rows (never read).
  for (int64_t c = 0; c < std::min<int64_t>(k.d, 128); ++c) x[c] = 0;
  x[static_cast<size_t>((k.T - 1) * k.ld + k.d - 1)] = 0xffc0;
  if (k.T > 2) x[static_cast<size_t>(k.ld + k.d / 2)] = 0x7f80;
  if (k.ld > k.d) x[static_cast<size_t>(k.d)] = 0x7fc0;
  std::vector<int32_t> gather(static_cast<size_t>(std::max<int64_t>(R, 0)));
  for (size_t r = 0; r < gather.size(); ++r)
    gather[r] = r % 17 == 5 ? (r % 2 ? -1 : static_cast<int32_t>(k.T)) : static_cast<int32_t>(rng() % k.T);
  const ref::Fp8Rows want = ref::quantize_rows_fp8(x.data(), k.T, k.d, k.ld, gathered ? gather.data() : nullptr, R);

  DeviceBuffer dx(x.size() * 2), dg(gather.size() * 4);
  upload(x, dx);
  upload(gather, dg);
  Out q(static_cast<size_t>(R * k.d)), s(static_cast<size_t>(R * want.tiles) * 4);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  QuantizeRowsArgs a;
  a.x = dx.ptr, a.T = k.T, a.d = k.d, a.ld = k.ld, a.R = R;
  a.gather = gathered ? static_cast<const int32_t*>(dg.ptr) : nullptr;
  a.q = static_cast<uint8_t*>(q.buf.ptr), a.scales = static_cast<float*>(s.buf.ptr);
  quantize_rows_fp8(a, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  const auto gq = q.all(), gs = s.all();
  EXPECT_TRUE(same_bytes("q", gq.data(), want.q.data(), q.bytes, 1));
  EXPECT_TRUE(same_bytes("scales", gs.data(), raw(want.scales), s.bytes, 4));
  EXPECT_TRUE(guard_intact("q", gq, q.bytes));
  EXPECT_TRUE(guard_intact("scales", gs, s.bytes));
}

TEST(GpuFp8, RowsMatchReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_rows({1, 16, 16, -1});        // T = 1, one partial tile
  check_rows({37, 2880, 2888, -1});   // partial last tile and span, padded rows
  check_rows({64, 7168, 7168, -1});   // whole spans
  check_rows({20, 400, 400, 61});     // gathered, with out-of-range indices
  check_rows({300, 2048, 2056, 900}); // many warps per row set
  check_rows({5, 48, 48, 0});         // R = 0: nothing written
}

// ---------------------------------------------------------------- columns
void check_columns(int64_t T, int64_t d, const std::vector<int32_t>& offsets, bool gathered) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, R = gathered ? offsets.back() + 3 : T;
  SCOPED_TRACE("T=" + std::to_string(T) + " d=" + std::to_string(d) + " E=" + std::to_string(E) +
               " R=" + std::to_string(R) + (gathered ? " gathered" : ""));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(T * 131 + d * 7 + E));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(T * d));
  x[static_cast<size_t>((T / 2) * d + d - 1)] = 0xff80;  // -Inf: its column's chunk becomes NaN
  std::vector<int32_t> gather(static_cast<size_t>(R));
  for (size_t r = 0; r < gather.size(); ++r)
    gather[r] = r % 97 == 13 ? -7 : static_cast<int32_t>(rng() % T);
  const ref::Fp8Columns want =
      ref::quantize_columns_fp8(x.data(), T, d, d, gathered ? gather.data() : nullptr, R, offsets.data(), E);
  const Fp8ColumnsLayout l = fp8_columns_layout(R, E, d);
  ASSERT_EQ(l.max_chunks, want.max_chunks);
  ASSERT_EQ(l.r_pad, want.r_pad);

  DeviceBuffer dx(x.size() * 2), dg(gather.size() * 4), doff(offsets.size() * 4);
  upload(x, dx);
  upload(gather, dg);
  upload(offsets, doff);
  Out co(l.chunk_offsets_bytes), qt(l.qt_bytes), sc(l.scales_bytes);
  QuantizeColumnsArgs a;
  a.x = dx.ptr, a.T = T, a.d = d, a.ld = d, a.R = R;
  a.gather = gathered ? static_cast<const int32_t*>(dg.ptr) : nullptr;
  a.expert_offsets = static_cast<const int32_t*>(doff.ptr), a.E = E;
  a.chunk_offsets = static_cast<int32_t*>(co.buf.ptr);
  a.qt = static_cast<uint8_t*>(qt.buf.ptr), a.scales = static_cast<float*>(sc.buf.ptr);
  quantize_columns_fp8(a, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto gco = co.all(), gqt = qt.all(), gsc = sc.all();
  EXPECT_TRUE(same_bytes("chunk_offsets", gco.data(), reinterpret_cast<const unsigned char*>(want.chunk_offsets.data()),
                         co.bytes, 4));
  const int64_t used = want.chunk_offsets[E];
  // The chunks that exist (the first `used` blocks of qt [max_chunks, d, 128] and rows of scales
  // [max_chunks, d]), bitwise; the rest never written.
  const size_t used_qt = static_cast<size_t>(used * d * 128), used_sc = static_cast<size_t>(used * d) * 4;
  ASSERT_TRUE(same_bytes("qt", gqt.data(), want.qt.data(), used_qt));
  for (size_t b = used_qt; b < l.qt_bytes; ++b)
    ASSERT_EQ(gqt[b], 0xff) << "qt: unused chunk " << b / static_cast<size_t>(d * 128) << " written";
  ASSERT_TRUE(same_bytes("scales", gsc.data(), raw(want.scales), used_sc, 4));
  for (size_t b = used_sc; b < l.scales_bytes; ++b)
    ASSERT_EQ(gsc[b], 0xff) << "scales: unused chunk " << b / static_cast<size_t>(d * 4) << " written";
  EXPECT_TRUE(guard_intact("chunk_offsets", gco, co.bytes));
  EXPECT_TRUE(guard_intact("qt", gqt, qt.bytes));
  EXPECT_TRUE(guard_intact("scales", gsc, sc.bytes));
}

TEST(GpuFp8, ColumnsMatchReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_columns(300, 32, {0, 130, 130, 300}, false);                 // an expert with no rows, partial slab
  check_columns(1, 16, {0, 1}, false);                                // T = 1
  check_columns(700, 2880, {0, 1, 2, 3, 200, 600, 601}, true);        // one-row experts, d = 2880
  check_columns(512, 7168 / 4, {0, 128, 256, 384, 512}, false);      // whole chunks only
  check_columns(40, 48, {0, 0, 0, 0}, true);                          // every expert empty, d < 64
  std::vector<int32_t> many(65, 0);                                    // 64 experts, uneven
  for (size_t e = 1; e < many.size(); ++e) many[e] = many[e - 1] + static_cast<int32_t>((e * 37) % 300);
  check_columns(5000, 256, many, true);
}

// ---------------------------------------------------------------- weights
void check_weights(int64_t E, int64_t N, int64_t K, bool transposed) {
  SCOPED_TRACE("E=" + std::to_string(E) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
               (transposed ? " transposed" : ""));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(E * 1000003 + N * 1009 + K + transposed));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  std::vector<uint16_t> w = random_bf16(rng, static_cast<size_t>(E * N * K));
  // Expert 0's first block zeros; a NaN in the last block; an Inf in the first expert's last row.
  for (int64_t n = 0; n < std::min<int64_t>(N, 128); ++n)
    for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) w[static_cast<size_t>(n * K + k)] = 0;
  w.back() = 0x7fc0;
  w[static_cast<size_t>((N - 1) * K + K / 2)] = 0x7f80;
  const ref::Fp8Weights want = ref::quantize_weights_fp8(w.data(), E, N, K, transposed);
  DeviceBuffer dw(w.size() * 2);
  upload(w, dw);
  Out q(want.q.size()), s(want.scales.size() * 4), qt(transposed ? want.qt.size() : 0),
      st(transposed ? want.scales_t.size() * 4 : 0);
  QuantizeWeightsArgs a;
  a.w = dw.ptr, a.E = E, a.N = N, a.K = K;
  a.q = static_cast<uint8_t*>(q.buf.ptr), a.scales = static_cast<float*>(s.buf.ptr);
  a.transposed = transposed;
  a.qt = static_cast<uint8_t*>(qt.buf.ptr), a.scales_t = static_cast<float*>(st.buf.ptr);
  quantize_weights_fp8(a, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto gq = q.all(), gs = s.all(), gqt = qt.all(), gst = st.all();
  EXPECT_TRUE(same_bytes("q", gq.data(), want.q.data(), q.bytes));
  EXPECT_TRUE(same_bytes("scales", gs.data(), raw(want.scales), s.bytes, 4));
  EXPECT_TRUE(guard_intact("q", gq, q.bytes));
  EXPECT_TRUE(guard_intact("scales", gs, s.bytes));
  if (transposed) {
    EXPECT_TRUE(same_bytes("qt", gqt.data(), want.qt.data(), qt.bytes));
    EXPECT_TRUE(same_bytes("scales_t", gst.data(), raw(want.scales_t), st.bytes, 4));
  }
  EXPECT_TRUE(guard_intact("qt", gqt, qt.bytes));  // without transposed: untouched entirely
  EXPECT_TRUE(guard_intact("scales_t", gst, st.bytes));
}

TEST(GpuFp8, WeightsMatchReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  for (bool t : {false, true}) {
    check_weights(3, 208, 144, t);   // partial blocks along both dimensions
    check_weights(2, 256, 2880, t);  // K = 2880: a 64-wide last block
    check_weights(1, 16, 16, t);     // one small partial block
    check_weights(4, 384, 512, t);   // whole blocks
  }
}

}  // namespace
