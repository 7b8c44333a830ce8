// Where every buffer of a layer call lives inside the caller's `saved` and `workspace` blocks.
// One definition for plan_workspace (sizes) and layer_forward/backward (pointers), so the two can
// never disagree. All offsets are 256-byte aligned (TMA needs 128, 16-byte vectors need 16).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "host/routing_internal.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// A running allocator over one block: offset of each sub-buffer, then the total.
struct Carve {
  size_t bytes = 0;
  size_t take(size_t n) {
    const size_t at = bytes;
    bytes += align256(n);
    return at;
  }
};

struct LayerLayout {
  int64_t R = 0;   // rows the experts may run on (T·K for top-K)
  int64_t n1 = 0;  // columns of H
  // saved (forward -> backward): SPEC §1's X-free minimum, 16 bytes per routed pair (scores,
  // experts, row -> pair, pair -> row). The gather index row -> token and the per-token pair
  // offsets are derivable (pair / K and t·K for top-K; the rounded list saves its own tokens
  // and offsets), so they live in the forward's workspace only.
  size_t h, scores, experts, expert_offsets, row_pair, pair_row, logits;
  // token rounding only: the rounded list's tokens and padded flags, the top-K it started from,
  // its per-token offsets and the per-expert counts before/after
  size_t list_token = 0, list_padded = 0, topk_scores = 0, topk_experts = 0, list_token_offsets = 0,
         count_topk = 0, count_rounded = 0;
  size_t saved_bytes;
  // forward workspace
  size_t row_token, token_offsets, a, y, metadata, tile_offsets, aux_partials, aux_colsum, cublas, rounding = 0;
  size_t forward_bytes;
  // backward workspace (issue #5; sized now so the plan is complete)
  size_t backward_bytes;

  static constexpr int kAuxTokensPerBlock = 64;
  static constexpr size_t kCublasWorkspace = size_t{4} << 20;

  explicit LayerLayout(const LayerProblem& p) {
    R = p.T * p.K;
    if (p.rounding != TokenRounding::None) R = std::min(R + p.E * (p.rounding_tile_m - 1), p.T * p.E);
    n1 = is_glu(p.activation) ? 2 * p.n : p.n;
    const size_t es = static_cast<size_t>(dtype_size(p.dtype));
    const size_t r = static_cast<size_t>(R), T = static_cast<size_t>(p.T), E = static_cast<size_t>(p.E);
    Carve s;
    h = s.take(r * static_cast<size_t>(n1) * es);  // [R, n1]
    scores = s.take(r * 4);                         // [T*K] fp32 (or [R] for a rounded list)
    experts = s.take(r * 4);                        // [T*K] int32
    expert_offsets = s.take((E + 1) * 4);
    row_pair = s.take(r * 4);
    pair_row = s.take(r * 4);
    logits = s.take(T * E * 4);  // [T, E] fp32: the aux loss and some routings need the softmax
    const bool rounded = p.rounding != TokenRounding::None;
    if (rounded) {
      const size_t tk = T * static_cast<size_t>(p.K);
      list_token = s.take(r * 4);
      list_padded = s.take(r);
      topk_scores = s.take(tk * 4);
      topk_experts = s.take(tk * 4);
      list_token_offsets = s.take((T + 1) * 4);
      count_topk = s.take((E + 1) * 4);
      count_rounded = s.take(E * 4);
    }
    saved_bytes = s.bytes;

    Carve f;
    row_token = f.take(r * 4);                      // [R] the up-projection's gather index
    token_offsets = f.take((T + 1) * 4);            // [T+1] the aggregation's pair offsets
    a = f.take(r * static_cast<size_t>(p.n) * es);  // [R, n]
    y = f.take(r * static_cast<size_t>(p.d) * es);  // [R, d]
    metadata = f.take(routing_metadata_workspace_bytes(p.T, p.E));
    tile_offsets = f.take((E + 1) * 4);
    const size_t aux_blocks = static_cast<size_t>(ceil_div(std::max<int64_t>(p.T, 1), kAuxTokensPerBlock));
    aux_partials = f.take(aux_blocks * E * 4);
    aux_colsum = f.take(E * 4);
    cublas = f.take(kCublasWorkspace);
    if (rounded) rounding = f.take(token_rounding_workspace_bytes(p.T, p.E, p.K));
    forward_bytes = f.bytes;

    // dH [R, n1], A' [R, n], dX~ [R, d], dS [R], d logits [T, E]
    backward_bytes = align256(r * static_cast<size_t>(n1) * es) + align256(r * static_cast<size_t>(p.n) * es) +
                     align256(r * static_cast<size_t>(p.d) * es) + align256(r * 4) + align256(T * E * 4);
  }
};

}  // namespace machmoe::detail
