// Launcher of GPU token rounding (kernels/routing/token_rounding.cuh): top-K router -> routing metadata
// (its bit matrix) -> per-expert rounding -> the rounded general routing list. No host sync.
#include <algorithm>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/layer/saved_layout.hpp"
#include "host/routing/routing_internal.hpp"
#include "kernels/routing/token_rounding.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::align256;
using detail::ceil_div;
using detail::check_launch;
using detail::require_arg;

namespace {

constexpr int kMaxRoundingK = 32;  // the backward keeps one top-K rank per lane

// [metadata outputs: row_token, row_pair, pair_row (T*K each)] [metadata workspace]
// [row_max T] [row_sum T] [token_count T]
struct RoundingWorkspace {
  size_t row_token, row_pair, pair_row, metadata, row_max, row_sum, token_count, bytes;
  RoundingWorkspace(int64_t T, int64_t E, int64_t K) {
    const size_t R = static_cast<size_t>(T * K), t = static_cast<size_t>(T);
    row_token = 0;
    row_pair = row_token + align256(R * 4);
    pair_row = row_pair + align256(R * 4);
    metadata = pair_row + align256(R * 4);
    row_max = metadata + detail::MetadataWorkspace(T, E).bytes;
    row_sum = row_max + align256(t * 4);
    token_count = row_sum + align256(t * 4);
    bytes = token_count + align256(t * 4);
  }
};

int rounding_mode(TokenRounding m) {
  switch (m) {
    case TokenRounding::Nearest: return kernels::kRoundNearest;
    case TokenRounding::Up: return kernels::kRoundUp;
    case TokenRounding::Down: return kernels::kRoundDown;
    case TokenRounding::Stochastic: return kernels::kRoundStochastic;
    case TokenRounding::None: break;
  }
  throw Error(ErrorCode::InvalidArgument, "token_rounding: mode must be nr, up, down or stochastic");
}

void check_rounding_shape(const char* fn, int64_t T, int64_t E, int64_t K) {
  require_arg(T >= 0 && T < std::numeric_limits<int32_t>::max(), fn, "T", "must be in [0, 2^31 - 1)");
  require_arg(E >= 1 && E <= std::numeric_limits<int32_t>::max() / 2, fn, "E", "must be in [1, 2^30]");
  require_arg(K >= 1 && K <= E && K <= kMaxRoundingK, fn, "K",
              "must be in [1, min(E, 32)], got K=" + std::to_string(K) + ", E=" + std::to_string(E));
}

}  // namespace

int64_t token_rounding_capacity(int64_t T, int64_t E, int64_t K, int64_t tile_m) {
  require_arg(tile_m >= 1, "token_rounding_capacity", "tile_m", "must be >= 1");
  return detail::token_rounding_rows(E, K, tile_m).at(T);
}

size_t token_rounding_workspace_bytes(int64_t T, int64_t E, int64_t K) {
  check_rounding_shape("token_rounding_workspace_bytes", T, E, K);
  return RoundingWorkspace(T, E, K).bytes;
}

void token_rounding(const float* logits, int64_t T, int64_t E, int64_t K, TokenRounding mode,
                    int64_t tile_m, uint64_t seed, const TokenRoundingOutputs& out, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* fn = "token_rounding";
  check_rounding_shape(fn, T, E, K);
  require_arg(tile_m >= 1 && tile_m <= (1 << 20), fn, "tile_m", "must be in [1, 2^20]");
  const int64_t capacity = token_rounding_capacity(T, E, K, tile_m);
  require_arg(capacity <= std::numeric_limits<int32_t>::max(), fn, "T",
              "the rounded list must fit in int32 rows");
  require_arg(out.topk_scores && out.topk_experts && out.token && out.expert && out.score && out.padded &&
                  out.token_offsets && out.count_topk && out.count_rounded,
              fn, "out", "needs every output pointer");
  const RoundingWorkspace ws(T, E, K);
  require_arg(workspace && workspace_bytes >= ws.bytes, fn, "workspace",
              "needs token_rounding_workspace_bytes(T, E, K) = " + std::to_string(ws.bytes) + " bytes");
  const int kmode = rounding_mode(mode);
  char* base = static_cast<char*>(workspace);
  auto at = [&](size_t off) { return reinterpret_cast<int32_t*>(base + off); };

  topk_router(logits, T, E, K, RoutingMethod::SoftmaxTopK, true, nullptr, out.topk_scores,
              out.topk_experts, stream);
  RoutingMetadataOutputs md;
  md.expert_offsets = out.count_topk;
  md.row_token = at(ws.row_token);
  md.row_pair = at(ws.row_pair);
  md.pair_row = at(ws.pair_row);
  routing_metadata(out.topk_experts, nullptr, T * K, K, T, E, md, base + ws.metadata,
                   detail::MetadataWorkspace(T, E).bytes, stream);
  if (T == 0) {
    detail::check_cuda(cudaMemsetAsync(out.token_offsets, 0, sizeof(int32_t), stream), "token_rounding: memset");
    detail::check_cuda(cudaMemsetAsync(out.count_rounded, 0, E * sizeof(int32_t), stream), "token_rounding: memset");
    return;
  }
  kernels::RoundingParams p{};
  p.logits = logits;
  p.topk_scores = out.topk_scores;
  p.topk_experts = out.topk_experts;
  p.expert_offsets = out.count_topk;
  p.row_pair = md.row_pair;
  p.bits = reinterpret_cast<uint32_t*>(base + ws.metadata);  // offset 0 of the metadata workspace
  p.row_max = reinterpret_cast<float*>(base + ws.row_max);
  p.row_sum = reinterpret_cast<float*>(base + ws.row_sum);
  p.count_rounded = out.count_rounded;
  p.token_count = at(ws.token_count);
  p.token_offsets = out.token_offsets;
  p.out_token = out.token;
  p.out_expert = out.expert;
  p.out_score = out.score;
  p.out_padded = out.padded;
  p.T = T;
  p.E = static_cast<int>(E);
  p.K = static_cast<int>(K);
  p.W = static_cast<int>(ceil_div(T, 32));
  p.M = static_cast<int>(tile_m);
  p.mode = kmode;
  p.capacity = capacity;
  p.seed = seed;
  const auto warp_blocks = static_cast<unsigned>(ceil_div(T, 8));
  const auto token_blocks = static_cast<unsigned>(ceil_div(T, 256));
  kernels::rounding_row_stats<<<warp_blocks, 256, 0, stream>>>(p);
  check_launch("token_rounding: row_stats");
  kernels::rounding_select<<<static_cast<unsigned>(E), kernels::kSelectThreads, 0, stream>>>(p);
  check_launch("token_rounding: select");
  kernels::rounding_count<<<token_blocks, 256, 0, stream>>>(p);
  check_launch("token_rounding: count");
  kernels::rounding_scan<<<1, 1024, 0, stream>>>(p);
  check_launch("token_rounding: scan");
  kernels::rounding_emit<<<token_blocks, 256, 0, stream>>>(p);
  check_launch("token_rounding: emit");
  const auto tail_blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(capacity, 256), 1024));
  kernels::rounding_fill_tail<<<tail_blocks, 256, 0, stream>>>(p);
  check_launch("token_rounding: fill tail");
}

void token_rounding_backward(const float* logits, const float* topk_scores,
                             const int32_t* topk_experts, const int32_t* token_offsets,
                             const int32_t* expert, const uint8_t* padded, const float* d_score,
                             int64_t T, int64_t E, int64_t K, float* d_logits, cudaStream_t stream) {
  constexpr const char* fn = "token_rounding_backward";
  check_rounding_shape(fn, T, E, K);
  if (T == 0) return;
  require_arg(logits && topk_scores && topk_experts && token_offsets && expert && padded && d_score && d_logits,
              fn, "pointers", "must not be null");
  kernels::RoundingBackwardParams p{logits, topk_scores, topk_experts, token_offsets, expert, padded,
                                    d_score, d_logits, T, static_cast<int>(E), static_cast<int>(K)};
  kernels::rounding_backward<<<static_cast<unsigned>(ceil_div(T, 8)), 256, 0, stream>>>(p);
  check_launch(fn);
}

}  // namespace machmoe
