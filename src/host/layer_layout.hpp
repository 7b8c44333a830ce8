// Where every buffer of a layer call lives inside the caller's `saved` and `workspace` blocks.
// One definition for plan_workspace (sizes) and layer_forward/backward (pointers), so the two can
// never disagree. All offsets are 256-byte aligned (TMA needs 128, 16-byte vectors need 16).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

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

// Typed pointer to the sub-buffer at byte offset `off` of a block.
template <typename T>
T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}
template <typename T>
const T* at(const void* base, size_t off) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + off);
}

// The problem rules of the GPU layer (forward and backward), beyond validate(): bf16 data,
// 16-byte rows, at most 32 experts per token with token rounding.
inline void require_gpu_layer(const LayerProblem& p, const char* fn) {
  validate(p);
  require_arg(p.rounding == TokenRounding::None || p.K <= 32, fn, "K", "must be <= 32 with token rounding");
  if (p.dtype != DType::BF16)
    throw Error(ErrorCode::Unsupported,
                std::string(fn) + ": the GPU layer runs in bfloat16, got dtype=" + to_string(p.dtype));
  if (p.d % 8 != 0 || p.n % 8 != 0)
    throw Error(ErrorCode::Unsupported, std::string(fn) + ": d and n must be multiples of 8 (16-byte rows), got d=" +
                                            std::to_string(p.d) + ", n=" + std::to_string(p.n));
}

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
  // backward workspace: the rebuilt gather index and token offsets, the dH kernel's outputs
  // (dH, A' = s·A, dS partials), dX~, the router's gradients and scratch (layer_backward.cu)
  size_t b_row_token, b_token_offsets, dh, a_prime, dx_rows, ds_partial, d_scores, d_logits, d_logits_bf16,
      b_tile_offsets, b_cublas, b_aux_partials, aux_grad;
  size_t bias_chunk_prefix = 0, bias_partials = 0;  // has_bias only
  int64_t ds_tiles = 0;     // column tiles of the dH kernel: the row stride of ds_partial
  int64_t bias_chunks = 0;  // rows of bias_partials (upper bound of Σ_e ceil(rows_e / kBiasChunkRows))
  size_t backward_bytes;

  static constexpr int kAuxTokensPerBlock = 64;
  static constexpr size_t kCublasWorkspace = size_t{4} << 20;
  // Rows per partial sum of the bias gradients: experts' rows are cut into chunks of this many,
  // each chunk summed by one block, the chunks of an expert then added in order.
  static constexpr int kBiasChunkRows = 256;

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

    Carve b;
    b_row_token = b.take(r * 4);                          // [R] row -> token, rebuilt from row_pair
    b_token_offsets = b.take((T + 1) * 4);                // [T+1] t·K (top-K; rounding has its own)
    dh = b.take(r * static_cast<size_t>(n1) * es);        // [R, n1] dH
    a_prime = b.take(r * static_cast<size_t>(p.n) * es);  // [R, n] A' = s·act(H)
    dx_rows = b.take(r * static_cast<size_t>(p.d) * es);  // [R, d] dX~ = dH·W1
    ds_tiles = grouped_gemm_column_tiles(p.n);
    ds_partial = b.take(r * static_cast<size_t>(ds_tiles) * 4);  // [R, ds_tiles] fp32
    d_scores = b.take(r * 4);                             // [R] fp32, pair order
    d_logits = b.take(T * E * 4);                         // [T, E] fp32
    d_logits_bf16 = b.take(T * E * 2);                    // [T, E] bf16, cuBLAS operand
    b_tile_offsets = b.take((E + 1) * 4);
    b_cublas = b.take(kCublasWorkspace);
    b_aux_partials = b.take(aux_blocks * E * 4);          // [aux blocks, E] fp32 column sums of P
    aux_grad = b.take((E + 1) * 4);                       // [E] ∂loss/∂colsum, then a skip flag
    if (p.has_bias) {
      bias_chunks = ceil_div(R, kBiasChunkRows) + p.E;
      const size_t cols = static_cast<size_t>(std::max<int64_t>(p.d, n1));
      bias_chunk_prefix = b.take((E + 1) * 4);            // [E+1] first chunk of each expert
      bias_partials = b.take(static_cast<size_t>(bias_chunks) * cols * 4);  // [chunks, max(d, n1)]
    }
    backward_bytes = b.bytes;
  }
};

}  // namespace machmoe::detail
