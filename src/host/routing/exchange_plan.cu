// Launcher of expert parallelism's exchange plan (kernels/routing/exchange_plan.cuh): two routing-
// metadata passes over the owning ranks and three small kernels, all on the caller's stream. One
// call instead of the ~25 PyTorch ops it would take in python/machmoe/distributed.py before the
// count sync, where the exchange would be bound by the host's time per op.
#include <algorithm>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/routing/routing_internal.hpp"
#include "kernels/routing/exchange_plan.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::align256;
using detail::ceil_div;
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;

namespace {

// [dest R | scratch R | distinct T | pair_offsets W+1 | routing_metadata's, the larger of its
// two calls (the calls run one after the other on the stream, so they share it)]
struct PlanWorkspace {
  size_t dest, scratch, distinct, pair_offsets, metadata, metadata_bytes, bytes;
  PlanWorkspace(int64_t T, int64_t K, int64_t W) {
    const auto R = static_cast<size_t>(T * K);
    dest = 0;
    scratch = dest + align256(R * 4);
    distinct = scratch + align256(R * 4);
    pair_offsets = distinct + align256(static_cast<size_t>(T) * 4);
    metadata = pair_offsets + align256(static_cast<size_t>(W + 1) * 4);
    metadata_bytes = std::max(routing_metadata_workspace_bytes(T, W), routing_metadata_workspace_bytes(T * K, W));
    bytes = metadata + metadata_bytes;
  }
};

void check_plan_shape(const char* fn, int64_t T, int64_t K, int64_t W) {
  require_arg(T >= 0, fn, "T", "must be >= 0, got " + std::to_string(T));
  require_arg(K >= 1 && K <= (1 << 16), fn, "K", "must be in [1, 65536], got " + std::to_string(K));
  require_arg(T <= std::numeric_limits<int32_t>::max() / K, fn, "T",
              "T*K must fit in int32, got T=" + std::to_string(T) + ", K=" + std::to_string(K));
  require_arg(W >= 1 && W <= (1 << 20), fn, "W", "must be in [1, 2^20], got " + std::to_string(W));
}

}  // namespace

size_t exchange_plan_workspace_bytes(int64_t T, int64_t K, int64_t W) {
  check_plan_shape("exchange_plan_workspace_bytes", T, K, W);
  return PlanWorkspace(T, K, W).bytes;
}

void exchange_plan(const int32_t* experts, const float* scores, int64_t T, int64_t K, int64_t E,
                   int64_t W, int64_t rank, const ExchangePlanOutputs& out, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* fn = "exchange_plan";
  check_plan_shape(fn, T, K, W);
  require_arg(E >= W && E % W == 0 && E <= std::numeric_limits<int32_t>::max() / 2, fn, "E",
              "must be a multiple of W=" + std::to_string(W) + " in [W, 2^30], got " + std::to_string(E));
  require_arg(rank >= 0 && rank < W, fn, "rank", "must be in [0, W=" + std::to_string(W) + "), got " + std::to_string(rank));
  const int64_t R = T * K;
  require_arg(out.counts && out.row_offsets && out.token_offsets, fn, "out",
              "needs counts, row_offsets and token_offsets");
  require_arg(R == 0 || (out.row_token && out.pair_row && out.order && out.inverse && out.packed &&
                         out.distinct_rows),
              fn, "out", "needs row_token, pair_row, order, inverse, packed and distinct_rows");
  require_arg(detail::aligned16(out.packed), fn, "out.packed", "must be 16-byte aligned");
  require_arg(R == 0 || (experts && scores), fn, "experts/scores", "must not be null");
  const PlanWorkspace ws(T, K, W);
  require_arg(workspace && workspace_bytes >= ws.bytes, fn, "workspace",
              "needs exchange_plan_workspace_bytes(T, K, W) = " + std::to_string(ws.bytes) + " bytes");
  char* base = static_cast<char*>(workspace);
  auto at = [&](size_t offset) { return reinterpret_cast<int32_t*>(base + offset); };

  kernels::ExchangePlanParams p{};
  p.experts = experts;
  p.scores = scores;
  p.T = T;
  p.K = static_cast<int>(K);
  p.E = static_cast<int>(E);
  p.E_local = static_cast<int>(E / W);
  p.W = static_cast<int>(W);
  p.rank = static_cast<int>(rank);
  p.dest = at(ws.dest);
  p.distinct = at(ws.distinct);
  p.expert_counts = out.expert_counts;
  p.hist_in_smem = E <= kernels::kPlanHistMax;
  p.row_offsets = out.row_offsets;
  p.pair_row = out.pair_row;
  p.pair_offsets = at(ws.pair_offsets);
  p.inverse = out.inverse;
  p.token_offsets = out.token_offsets;
  p.packed = reinterpret_cast<int4*>(out.packed);
  p.distinct_rows = out.distinct_rows;
  p.counts = out.counts;
  p.invalid = out.invalid;

  if (out.expert_counts)
    check_cuda(cudaMemsetAsync(out.expert_counts, 0, static_cast<size_t>(E) * 4, stream), "exchange_plan: memset");
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(ceil_div(T, kernels::kPlanThreads), 1));
  const size_t hist_smem = out.expert_counts && p.hist_in_smem ? static_cast<size_t>(E) * 4 : 0;
  if (T > 0) {
    kernels::exchange_plan_prepare<<<blocks, kernels::kPlanThreads, hist_smem, stream>>>(p);
    check_launch("exchange_plan: prepare");
  }
  // Rows: the [T, K] list of owning ranks; a token's pairs for one rank merge into one row.
  RoutingMetadataOutputs rows;
  rows.expert_offsets = out.row_offsets;
  rows.row_token = out.row_token;
  rows.row_pair = at(ws.scratch);
  rows.pair_row = out.pair_row;
  routing_metadata(p.dest, nullptr, R, K, T, W, rows, base + ws.metadata, ws.metadata_bytes, stream);
  // Pairs: every pair its own token (a top-K list with K = 1), grouped by rank stably; the row
  // of pair p is its position.
  RoutingMetadataOutputs pairs;
  pairs.expert_offsets = at(ws.pair_offsets);
  pairs.row_token = out.order;
  pairs.row_pair = at(ws.scratch);
  pairs.pair_row = out.inverse;
  routing_metadata(p.dest, nullptr, R, 1, R, W, pairs, base + ws.metadata, ws.metadata_bytes, stream);
  kernels::exchange_plan_token_offsets<<<1, kernels::kPlanScanThreads, 0, stream>>>(p);
  check_launch("exchange_plan: token_offsets");
  kernels::exchange_plan_finish<<<blocks, kernels::kPlanThreads, 0, stream>>>(p);
  check_launch("exchange_plan: finish");
}

}  // namespace machmoe
