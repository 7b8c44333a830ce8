// The C++ API without Python: machmoe::exchange_plan (expert parallelism's plan) on the GPU against
// the plan written out from its definition on the host (docs/LAYER.md, "Expert parallelism"):
// rows = the distinct (owning rank, token) pairs in rank-major order, pairs grouped by rank stably,
// the packed pairs, each token's rows, the counts. Also: the empty list, an expert out of range,
// no expert counts, and the arguments it refuses. Every output is poisoned first. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gpu_util.hpp"
#include "machmoe/machmoe.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::have_gpu;

using Vec = std::vector<int32_t>;

struct Plan {
  Vec counts, row_offsets, row_token, pair_row, order, inverse, packed, token_offsets, distinct_rows, expert_counts;
  int32_t invalid = 0;
};

// The definition, on the host.
Plan define(const Vec& experts, const std::vector<float>& scores, int64_t T, int64_t K, int64_t E, int64_t W,
            int rank) {
  const int64_t R = T * K, El = E / W;
  Plan p;
  std::vector<int> dest(R);
  std::set<std::pair<int, int>> keys;  // (rank, token)
  p.expert_counts.assign(E, 0);
  for (int64_t i = 0; i < R; ++i) {
    const int e = experts[i];
    const bool ok = e >= 0 && e < E;
    dest[i] = ok ? static_cast<int>(e / El) : static_cast<int>(W);
    if (ok) {
      keys.insert({dest[i], static_cast<int>(i / K)});
      ++p.expert_counts[e];
    } else {
      p.invalid = 1;
    }
  }
  std::map<std::pair<int, int>, int> row_of;
  p.row_offsets.assign(W + 1, 0);
  for (const auto& k : keys) {
    row_of[k] = static_cast<int>(p.row_token.size());
    p.row_token.push_back(k.second);
    ++p.row_offsets[k.first + 1];
  }
  for (int64_t q = 0; q < W; ++q) p.row_offsets[q + 1] += p.row_offsets[q];
  p.pair_row.assign(R, -1);
  for (int64_t i = 0; i < R; ++i)
    if (dest[i] < W) p.pair_row[i] = row_of[{dest[i], static_cast<int>(i / K)}];
  for (int q = 0; q < W; ++q)
    for (int64_t i = 0; i < R; ++i)
      if (dest[i] == q) p.order.push_back(static_cast<int32_t>(i));
  p.inverse.assign(R, -1);
  p.counts.assign(2 * W, 0);
  for (size_t pos = 0; pos < p.order.size(); ++pos) {
    const int i = p.order[pos], q = dest[i];
    p.inverse[i] = static_cast<int32_t>(pos);
    int32_t bits;
    std::memcpy(&bits, &scores[i], 4);
    p.packed.insert(p.packed.end(), {p.pair_row[i] - p.row_offsets[q], experts[i] - q * static_cast<int32_t>(El), rank, bits});
    ++p.counts[2 * q + 1];
  }
  for (int q = 0; q < W; ++q) p.counts[2 * q] = p.row_offsets[q + 1] - p.row_offsets[q];
  p.token_offsets.push_back(0);
  for (int64_t t = 0; t < T; ++t) {
    std::set<int> rows;
    for (int64_t k = 0; k < K; ++k)
      if (p.pair_row[t * K + k] >= 0) rows.insert(p.pair_row[t * K + k]);
    p.distinct_rows.insert(p.distinct_rows.end(), rows.begin(), rows.end());
    p.token_offsets.push_back(static_cast<int32_t>(p.distinct_rows.size()));
  }
  return p;
}

// The first `keep` of `n` int32 on the device.
Vec down(const DeviceBuffer& b, size_t n, size_t keep) {
  Vec h(n);
  if (n) EXPECT_EQ(cudaMemcpy(h.data(), b.ptr, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  h.resize(std::min(keep, n));
  return h;
}
Vec down(const DeviceBuffer& b, size_t n) { return down(b, n, n); }

// Runs the GPU plan on `experts` and compares every output with the definition (where it is
// specified: rows and positions up to the valid ones).
void check_plan(const Vec& experts, int64_t T, int64_t K, int64_t E, int64_t W, int rank, bool with_counts,
                const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t R = T * K;
  std::vector<float> scores(R);
  for (int64_t i = 0; i < R; ++i) scores[i] = 0.001f * static_cast<float>((i * 7919) % 1000) - 0.3f;
  const Plan want = define(experts, scores, T, K, E, W, rank);
  DeviceBuffer d_experts(R * 4), d_scores(R * 4), counts(2 * W * 4), row_offsets((W + 1) * 4), row_token(R * 4),
      pair_row(R * 4), order(R * 4), inverse(R * 4), packed(R * 16), token_offsets((T + 1) * 4),
      distinct_rows(R * 4), expert_counts(E * 4), invalid(4);
  if (R) {
    ASSERT_EQ(cudaMemcpy(d_experts.ptr, experts.data(), R * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_scores.ptr, scores.data(), R * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  // Poison every output (0xff: -1, also a row's "no row"): what the plan specifies must be written.
  const std::pair<DeviceBuffer*, size_t> poisoned[] = {
      {&counts, 2 * W * 4}, {&row_offsets, (W + 1) * 4}, {&row_token, R * 4},  {&pair_row, R * 4},
      {&order, R * 4},      {&inverse, R * 4},           {&packed, R * 16},    {&token_offsets, (T + 1) * 4},
      {&distinct_rows, R * 4}, {&expert_counts, E * 4},  {&invalid, 4}};
  for (const auto& [b, bytes] : poisoned) ASSERT_EQ(cudaMemset(b->ptr, 0xff, bytes), cudaSuccess);
  const size_t ws_bytes = exchange_plan_workspace_bytes(T, K, W);
  DeviceBuffer ws(ws_bytes);
  ASSERT_EQ(cudaMemset(ws.ptr, 0xff, ws_bytes), cudaSuccess);
  ExchangePlanOutputs out;
  out.counts = static_cast<int32_t*>(counts.ptr);
  out.row_offsets = static_cast<int32_t*>(row_offsets.ptr);
  out.row_token = static_cast<int32_t*>(row_token.ptr);
  out.pair_row = static_cast<int32_t*>(pair_row.ptr);
  out.order = static_cast<int32_t*>(order.ptr);
  out.inverse = static_cast<int32_t*>(inverse.ptr);
  out.packed = static_cast<int32_t*>(packed.ptr);
  out.token_offsets = static_cast<int32_t*>(token_offsets.ptr);
  out.distinct_rows = static_cast<int32_t*>(distinct_rows.ptr);
  out.expert_counts = with_counts ? static_cast<int32_t*>(expert_counts.ptr) : nullptr;
  out.invalid = static_cast<int32_t*>(invalid.ptr);
  exchange_plan(static_cast<const int32_t*>(d_experts.ptr), static_cast<const float*>(d_scores.ptr), T, K, E, W,
                rank, out, ws.ptr, ws_bytes, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t S = want.row_token.size(), P = want.order.size();
  EXPECT_EQ(down(counts, 2 * W), want.counts);
  EXPECT_EQ(down(row_offsets, W + 1), want.row_offsets);
  EXPECT_EQ(down(row_token, R, S), want.row_token);
  EXPECT_EQ(down(pair_row, R), want.pair_row);
  EXPECT_EQ(down(order, R, P), want.order);
  EXPECT_EQ(down(inverse, R), want.inverse);
  EXPECT_EQ(down(packed, 4 * R, 4 * P), want.packed);
  EXPECT_EQ(down(token_offsets, T + 1), want.token_offsets);
  EXPECT_EQ(down(distinct_rows, R, S), want.distinct_rows);
  if (with_counts) EXPECT_EQ(down(expert_counts, E), want.expert_counts);
  EXPECT_EQ(down(invalid, 1)[0], want.invalid);
}

// A top-K list: K distinct experts per token, drawn at random.
Vec random_topk(uint64_t seed, int64_t T, int64_t K, int64_t E) {
  mtest::Rng rng(seed);
  Vec ex;
  std::vector<int32_t> all(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) all[e] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k) {
      std::swap(all[k], all[k + rng() % (E - k)]);
      ex.push_back(all[k]);
    }
  }
  return ex;
}

TEST(GpuExchangePlan, MatchesItsDefinition) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const uint64_t seed = mtest::test_seed();
  SCOPED_TRACE(mtest::seed_msg(seed));
  struct Shape { int64_t T, K, E, W; };
  for (const Shape s : {Shape{1000, 8, 64, 4}, Shape{1, 2, 8, 2}, Shape{333, 8, 128, 1}, Shape{77, 3, 9, 3},
                        Shape{40, 16, 128, 128}, Shape{129, 6, 192, 96}, Shape{3000, 8, 16384, 64},
                        Shape{513, 4, 16, 8}}) {
    const std::string what = "T=" + std::to_string(s.T) + " K=" + std::to_string(s.K) + " E=" + std::to_string(s.E) +
                             " W=" + std::to_string(s.W);
    check_plan(random_topk(seed ^ static_cast<uint64_t>(s.T * 131 + s.W), s.T, s.K, s.E), s.T, s.K, s.E, s.W,
               static_cast<int>(s.W - 1), true, what);
  }
}

TEST(GpuExchangePlan, EmptyListOutOfRangeExpertsAndNoCounts) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_plan({}, 0, 8, 16, 4, 1, true, "T = 0");
  // E = 8 over W = 2: expert 9 and -1 have no rank; the rest plan as usual, and *invalid = 1.
  check_plan({0, 5, 3, 9, 7, 1, -1, 2}, 4, 2, 8, 2, 0, true, "out of range");
  check_plan(random_topk(7, 50, 4, 32), 50, 4, 32, 4, 2, false, "expert_counts null");
}

// Runs without a GPU: every refusal comes before any launch.
TEST(GpuExchangePlan, RefusesBadArguments) {
  int32_t dummy[8] = {};
  alignas(16) int32_t packed[8] = {};
  const float scores[8] = {};
  ExchangePlanOutputs out;
  out.counts = out.row_offsets = out.token_offsets = dummy;
  out.row_token = out.pair_row = out.order = out.inverse = out.distinct_rows = dummy;
  out.packed = packed;
  auto refuses = [&](int64_t T, int64_t K, int64_t E, int64_t W, int64_t rank, const char* arg) {
    try {
      exchange_plan(dummy, scores, T, K, E, W, rank, out, nullptr, 0, nullptr);
      ADD_FAILURE() << "accepted a bad " << arg;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
    }
  };
  refuses(10, 2, 9, 2, 0, "E must be a multiple of W");
  refuses(10, 2, 8, 2, 2, "rank must be in [0, W=2)");
  refuses(10, 0, 8, 2, 0, "K must be in [1, 65536]");
  refuses(-1, 2, 8, 2, 0, "T must be >= 0");
  refuses(10, 2, 8, 0, 0, "W must be in [1, 2^20]");
  refuses(10, 2, 8, 2, 0, "workspace needs exchange_plan_workspace_bytes");
  out.packed = packed + 1;  // 4-byte aligned only
  refuses(10, 2, 8, 2, 0, "out.packed must be 16-byte aligned");
}

}  // namespace
