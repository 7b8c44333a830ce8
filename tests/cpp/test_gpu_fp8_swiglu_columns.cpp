// The fused FP8 SwiGLU backward with the column operands (detail::swiglu_backward_columns_fp8,
// host/quant/quant_internal.hpp) against the unfused path it replaces in the FP8 experts'
// backward, on the same inputs: swiglu_backward_fp8 (with dH's E4M3 rows), then
// quantize_columns_fp8 of its bf16 dH and of its bf16 A'. Every output bitwise: the d scores, dH's
// E4M3 rows and their scales, the chunk offsets, both column operands and their scales. The
// outputs of both paths are poisoned alike (0xff) first, so that a byte one path writes and the
// other leaves is a difference too.
// Shapes: experts with 0, 1, 127, 128, 129 rows (a chunk of one row, whole and partial chunks);
// n = 80 (one partial slab: dH's second column tile cut to 32 columns), n = 1440 (n1 = 2880: a
// partial last H tile and slab), gpt-oss's n = 2880, n = 16, no rows at all, and a 7B-a-like
// call (n = 256, 128 experts of about 1500 rows).
// Inputs: random E4M3 codes of H (no NaN codes) with tile scales 2^[-10, -3]·[1, 2), random bf16
// dA' in (-2, 2), scores in (0, 1), row_pair a permutation of the rows; in some cases one H tile
// has a NaN scale (NaN reaches dH's row tile, its column tiles in that chunk and the d score).
// The argument rules run without a GPU (Fp8Api.*); the rest skips without one.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_util.hpp"
#include "host/quant/quant_internal.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/fp8_swiglu.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::have_gpu;

// A device output of `bytes` bytes (poisoned with 0xff before each call).
struct Out {
  size_t bytes;
  DeviceBuffer buf;
  explicit Out(size_t b) : bytes(b), buf(b) {}
  template <typename T>
  T* as() const {
    return static_cast<T*>(buf.ptr);
  }
  void poison() { ASSERT_EQ(cudaMemset(buf.ptr, 0xff, bytes), cudaSuccess); }
  std::vector<unsigned char> host() const { return mtest::bytes_of(buf.ptr, bytes); }
};

template <typename T>
void upload(const std::vector<T>& h, DeviceBuffer& d) {
  ASSERT_EQ(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

::testing::AssertionResult same_bytes(const std::string& what, const Out& got, const Out& want) {
  const std::vector<unsigned char> g = got.host(), w = want.host();
  size_t diffs = 0, first = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i] != w[i] && diffs++ == 0) first = i;
  if (diffs == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << diffs << " of " << g.size()
                                       << " bytes differ from the unfused path, first at byte " << first << " (fused "
                                       << int{g[first]} << ", unfused " << int{w[first]} << ")";
}

struct SplitMix {
  uint64_t s;
  uint64_t next() { return mtest::mix64(s += 0x9e3779b97f4a7c15ull); }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};

// counts: rows of each expert (in order); nan_tile: one H tile of a middle row gets a NaN scale.
void check_fused(int64_t n, const std::vector<int64_t>& counts, bool nan_tile) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t R = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t n1 = 2 * n, h_tiles = fp8_tiles(n1);
  SCOPED_TRACE("n=" + std::to_string(n) + " E=" + std::to_string(E) + " R=" + std::to_string(R) +
               (nan_tile ? " with a NaN tile" : ""));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(n * 1000003 + R * 131 + E));
  SCOPED_TRACE(mtest::seed_msg(seed));
  SplitMix rng{seed};
  const size_t r = static_cast<size_t>(R);

  std::vector<int32_t> offsets(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + static_cast<int32_t>(counts[e]);
  std::vector<__nv_bfloat16> da(r * static_cast<size_t>(n));
  for (auto& v : da) v = __float2bfloat16_rn(static_cast<float>(4 * rng.unit() - 2));
  std::vector<uint8_t> hq(r * static_cast<size_t>(n1));
  for (auto& c : hq) {
    c = static_cast<uint8_t>(rng.next() >> 56);
    if ((c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
  }
  std::vector<float> hs(r * static_cast<size_t>(h_tiles));
  for (auto& s : hs) s = static_cast<float>(std::ldexp(1 + rng.unit(), -3 - static_cast<int>(rng.next() % 8)));
  if (nan_tile && R > 0)
    hs[static_cast<size_t>(R / 2 * h_tiles + h_tiles - 1)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> scores(r);
  for (auto& s : scores) s = static_cast<float>(0.01 + 0.98 * rng.unit());
  std::vector<int32_t> row_pair(r);
  std::iota(row_pair.begin(), row_pair.end(), 0);
  for (size_t i = r; i > 1; --i) std::swap(row_pair[i - 1], row_pair[rng.next() % i]);

  DeviceBuffer d_off(offsets.size() * 4), d_da(da.size() * 2), d_hq(hq.size()), d_hs(hs.size() * 4),
      d_scores(scores.size() * 4), d_rp(row_pair.size() * 4);
  upload(offsets, d_off), upload(da, d_da), upload(hq, d_hq), upload(hs, d_hs), upload(scores, d_scores);
  upload(row_pair, d_rp);

  const Fp8ColumnsLayout l1 = fp8_columns_layout(R, E, n1), l = fp8_columns_layout(R, E, n);
  ASSERT_EQ(l1.max_chunks, l.max_chunks);
  // Each path's outputs: d scores, dH's rows and scales, chunk offsets, dH's and A''s columns.
  struct Outs {
    Out ds, dh_q, dh_s, co, dh_qt, dh_cs, ap_qt, ap_cs;
  };
  auto outs = [&] {
    return Outs{Out(r * 4),           Out(r * static_cast<size_t>(n1)), Out(r * static_cast<size_t>(h_tiles) * 4),
                Out(offsets.size() * 4), Out(l1.qt_bytes),                  Out(l1.scales_bytes),
                Out(l.qt_bytes),         Out(l.scales_bytes)};
  };
  Outs want = outs(), got = outs();
  for (Outs* o : {&want, &got})
    for (Out* b : {&o->ds, &o->dh_q, &o->dh_s, &o->co, &o->dh_qt, &o->dh_cs, &o->ap_qt, &o->ap_cs}) b->poison();

  // The unfused path: bf16 dH and A', then their columns.
  DeviceBuffer dh(r * static_cast<size_t>(n1) * 2), ap(r * static_cast<size_t>(n) * 2);
  SwigluBackwardFp8Args u;
  u.da = d_da.ptr, u.hq = static_cast<const uint8_t*>(d_hq.ptr), u.h_scales = static_cast<const float*>(d_hs.ptr);
  u.scores = static_cast<const float*>(d_scores.ptr), u.row_pair = static_cast<const int32_t*>(d_rp.ptr);
  u.R = R, u.n = n, u.dh = dh.ptr, u.a_prime = ap.ptr, u.d_scores = want.ds.as<float>();
  u.dh_q = want.dh_q.as<uint8_t>(), u.dh_scales = want.dh_s.as<float>();
  swiglu_backward_fp8(u, nullptr);
  auto columns = [&](const void* x, int64_t d, const Out& qt, const Out& cs) {
    QuantizeColumnsArgs q;
    q.x = x, q.T = R, q.d = d, q.ld = d, q.R = R;
    q.expert_offsets = static_cast<const int32_t*>(d_off.ptr), q.E = E, q.chunk_offsets = want.co.as<int32_t>();
    q.qt = qt.as<uint8_t>(), q.scales = cs.as<float>();
    quantize_columns_fp8(q, nullptr);
  };
  columns(dh.ptr, n1, want.dh_qt, want.dh_cs);
  columns(ap.ptr, n, want.ap_qt, want.ap_cs);

  // The fused path.
  detail::SwigluBackwardColumnsFp8Args f;
  f.da = d_da.ptr, f.hq = u.hq, f.h_scales = u.h_scales, f.scores = u.scores, f.row_pair = u.row_pair;
  f.R = R, f.n = n, f.expert_offsets = static_cast<const int32_t*>(d_off.ptr), f.E = E;
  f.chunk_offsets = got.co.as<int32_t>(), f.d_scores = got.ds.as<float>();
  f.dh_q = got.dh_q.as<uint8_t>(), f.dh_scales = got.dh_s.as<float>();
  f.dh_qt = got.dh_qt.as<uint8_t>(), f.dh_col_scales = got.dh_cs.as<float>();
  f.ap_qt = got.ap_qt.as<uint8_t>(), f.ap_col_scales = got.ap_cs.as<float>();
  detail::swiglu_backward_columns_fp8(f, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_TRUE(same_bytes("d_scores", got.ds, want.ds));
  EXPECT_TRUE(same_bytes("dH rows (codes)", got.dh_q, want.dh_q));
  EXPECT_TRUE(same_bytes("dH rows (scales)", got.dh_s, want.dh_s));
  EXPECT_TRUE(same_bytes("chunk_offsets", got.co, want.co));
  EXPECT_TRUE(same_bytes("dH columns (codes)", got.dh_qt, want.dh_qt));
  EXPECT_TRUE(same_bytes("dH columns (scales)", got.dh_cs, want.dh_cs));
  EXPECT_TRUE(same_bytes("A' columns (codes)", got.ap_qt, want.ap_qt));
  EXPECT_TRUE(same_bytes("A' columns (scales)", got.ap_cs, want.ap_cs));
  if (nan_tile && R > 0) {  // the NaN reached the outputs (the comparison above is not vacuous)
    std::vector<float> ds(r);
    ASSERT_EQ(cudaMemcpy(ds.data(), got.ds.buf.ptr, r * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(std::isnan(ds[static_cast<size_t>(row_pair[static_cast<size_t>(R / 2)])]));
  }
}

TEST(GpuFp8, SwigluColumnsMatchUnfusedBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_fused(80, {0, 1, 127, 128, 129, 0, 300, 0}, true);  // one partial slab; empty first/last experts
  check_fused(1440, {129, 0, 1, 255, 128}, true);           // n1 = 2880: partial last H tile and slab
  check_fused(2880, {3, 130}, false);                       // gpt-oss's n
  check_fused(16, {5, 0, 200}, true);                        // the smallest n: four groups
  check_fused(512, {256, 1}, false);                         // whole slabs only
  check_fused(64, {0, 0, 0}, false);                         // no rows: the chunk offsets only
}

TEST(GpuFp8, SwigluColumnsMatchUnfusedBitwiseAt7BaShape) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  std::vector<int64_t> counts(128);
  SplitMix rng{mtest::test_seed(7)};
  for (auto& c : counts) c = 1400 + static_cast<int64_t>(rng.next() % 201);
  check_fused(256, counts, true);
}

// ---------------------------------------------------------------- argument rules (no GPU needed)
TEST(Fp8Api, SwigluColumnsRefusesBadArguments) {
  // Fake device addresses: every call below is refused before it touches one.
  auto* p = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  auto* f = reinterpret_cast<float*>(p + 4096);
  auto* i = reinterpret_cast<int32_t*>(p + 8192);
  detail::SwigluBackwardColumnsFp8Args ok;
  ok.da = p, ok.hq = p, ok.h_scales = f, ok.scores = f, ok.row_pair = i, ok.R = 4, ok.n = 32;
  ok.expert_offsets = i, ok.E = 2, ok.chunk_offsets = i, ok.d_scores = f, ok.dh_q = p, ok.dh_scales = f;
  ok.dh_qt = p, ok.dh_col_scales = f, ok.ap_qt = p, ok.ap_col_scales = f;
  auto refused = [&](const std::function<void(detail::SwigluBackwardColumnsFp8Args&)>& change, const char* arg,
                     const char* what) {
    detail::SwigluBackwardColumnsFp8Args a = ok;
    change(a);
    const std::string msg =
        mtest::expect_error(ErrorCode::InvalidArgument, [&] { detail::swiglu_backward_columns_fp8(a, nullptr); }, what);
    EXPECT_NE(msg.find(arg), std::string::npos) << what << ": message does not name " << arg << ": " << msg;
  };
  refused([](auto& a) { a.n = 8; }, "n must be a positive multiple of 16", "n = 8");
  refused([](auto& a) { a.n = 40; }, "n must be a positive multiple of 16", "n = 40");
  refused([](auto& a) { a.R = -1; }, "R must be in", "R < 0");
  refused([](auto& a) { a.E = 0; }, "E must be in", "E = 0");
  refused([](auto& a) { a.expert_offsets = nullptr; }, "expert_offsets", "expert_offsets null");
  refused([&](auto& a) { a.chunk_offsets = reinterpret_cast<int32_t*>(p + 2); }, "chunk_offsets",
          "chunk_offsets misaligned");
  refused([](auto& a) { a.da = nullptr; }, "must not be null when R > 0", "da null");
  refused([](auto& a) { a.ap_col_scales = nullptr; }, "must not be null when R > 0", "ap_col_scales null");
  refused([&](auto& a) { a.dh_qt = p + 8; }, "must be 16-byte aligned", "dh_qt misaligned");
  refused([&](auto& a) { a.dh_q = p + 4; }, "must be 8-byte aligned", "dh_q misaligned");
  refused([&](auto& a) { a.dh_col_scales = reinterpret_cast<float*>(p + 2); }, "must be 4-byte aligned",
          "dh_col_scales misaligned");
}

}  // namespace
