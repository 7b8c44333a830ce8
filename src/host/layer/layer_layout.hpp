// Where every buffer of a layer call (LayerLayout) and of an experts call on a general routing list
// (ExpertsLayout) lives inside the caller's `saved` and `workspace` blocks, at a given T: one
// definition for plan_workspace (sizes) and the calls (pointers), so the two can never disagree.
// The saved blocks' parts and their sizes come from host/layer/saved_layout.hpp, which the fake
// kernels of the PyTorch ops read as well. The expert part's scratch (ExpertsForwardScratch /
// ExpertsBackwardScratch) is carved the same way in both. Every offset is 256-byte aligned (TMA
// needs 128, 16-byte vectors need 16). The layouts take a validated problem: their arithmetic
// relies on validate()'s bounds (sizes >= 0, row counts within int32).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "host/layer/saved_layout.hpp"
#include "host/layer/shared_pairs.hpp"
#include "host/routing/routing_internal.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// A running allocator over one block: offset of each sub-buffer, then the total.
struct Carve {
  size_t bytes = 0;
  size_t take(size_t n) {
    const size_t at = bytes;
    bytes += (n + kSavedPartAlignment - 1) / kSavedPartAlignment * kSavedPartAlignment;
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

// Experts in the weights of an experts call (a layer's: machmoe.hpp, routed + shared).
inline int64_t weight_experts(const ExpertsProblem& p) { return p.E; }

// The shapes the expert part of a layer call needs (from a LayerProblem or an ExpertsProblem); E
// counts every expert in the weights (a layer's shared experts too).
struct ExpertsShape {
  int64_t T = 0, d = 0, n = 0, n1 = 0, E = 0;  // n1 = columns of H (2n for GLU activations)
  Activation activation = Activation::SwiGLU;
  GluClamp glu_clamp;
  GateUpLayout layout = GateUpLayout::Interleaved;
  bool has_bias = false;
  size_t elem = 2;  // bytes per element of x, the weights, H, A, Y (bf16 on the GPU)
  Precision precision = Precision::BF16;
};
template <typename Problem>  // LayerProblem or ExpertsProblem
ExpertsShape experts_shape(const Problem& p) {
  ExpertsShape s;
  s.T = p.T, s.d = p.d, s.n = p.n, s.n1 = is_glu(p.activation) ? 2 * p.n : p.n, s.E = weight_experts(p);
  s.activation = p.activation, s.glu_clamp = p.glu_clamp, s.layout = p.layout, s.has_bias = p.has_bias;
  s.elem = static_cast<size_t>(dtype_size(p.dtype));
  s.precision = p.precision;
  return s;
}

// Bytes of an E4M3 operand [rows, cols] with its 1x128 scales [rows, ceil(cols/128)], codes
// first (cols % 16 == 0 keeps the scales 16-byte aligned).
inline size_t fp8_rows_bytes(int64_t rows, int64_t cols) {
  return static_cast<size_t>(rows) * static_cast<size_t>(cols + 4 * ceil_div(cols, int64_t{128}));
}

// The FP8 backward's scratch (host/layer/fp8_experts.cu) besides the gather index. One region
// that its steps share; a buffer lives from the step that writes it to the last that reads it:
//   dH's columns (dW1's operand) 2-5, from the fused SwiGLU backward to dW1;
//   A''s columns (dW2's operand) 2-3, beside dH's;
//   dout's E4M3 rows and dA' [R, n] bf16 (dA' = dout·W2) 1-2, past A''s columns;
//   dout's columns 3, past A''s; dX~ [R, d] bf16 4 and x's columns 5, past dH's columns;
//   dH's E4M3 rows 2-4 (the dX~ GEMM's operand), past all of these.
// dH and A' themselves never reach memory (the fused kernel writes their E4M3 forms only). The
// column operands' chunk offsets [E+1] have a block of their own.
struct Fp8BackwardScratch {
  size_t region = 0, region_bytes = 0, chunk_offsets = 0;
  // Offsets inside `region` (the steps above).
  size_t dh_cols = 0, dh_cols_scales = 0, ap_cols = 0, ap_cols_scales = 0;
  size_t dout_q = 0, da = 0;
  size_t dout_cols = 0, dout_cols_scales = 0;
  size_t dx_rows = 0, x_cols = 0, x_cols_scales = 0;
  size_t dh_q = 0;
  // With expert biases, outside the region: [max_chunks, max(d, n1)] fp32, the per-chunk sums of
  // db1 (written by step 2) and then of db2 (each chunk of an expert's rows, chunk_offsets).
  size_t bias_partials = 0;
  int64_t max_chunks = 0;  // the column operands' chunk bound (fp8_columns_layout), all three widths
  void carve(Carve& b, const ExpertsShape& s, int64_t R) {
    const Fp8ColumnsLayout cd = fp8_columns_layout(R, s.E, s.d), cn = fp8_columns_layout(R, s.E, s.n),
                           cn1 = fp8_columns_layout(R, s.E, s.n1);
    max_chunks = cd.max_chunks;
    Carve h;  // dH's columns, steps 2-5
    dh_cols = h.take(cn1.qt_bytes), dh_cols_scales = h.take(cn1.scales_bytes);
    Carve a = h;  // A''s columns, steps 2-3
    ap_cols = a.take(cn.qt_bytes), ap_cols_scales = a.take(cn.scales_bytes);
    Carve dgrad = a;  // dout's E4M3 rows, dA' [R, n] bf16: steps 1-2
    dout_q = dgrad.take(fp8_rows_bytes(s.T, s.d));
    da = dgrad.take(static_cast<size_t>(R) * static_cast<size_t>(s.n) * 2);
    Carve w2grad = a;  // doutᵀ by expert chunks: step 3
    dout_cols = w2grad.take(cd.qt_bytes), dout_cols_scales = w2grad.take(cd.scales_bytes);
    Carve xgrad = h;  // dX~ [R, d] bf16: step 4
    dx_rows = xgrad.take(static_cast<size_t>(R) * static_cast<size_t>(s.d) * 2);
    Carve w1grad = h;  // xᵀ by expert chunks: step 5
    x_cols = w1grad.take(cd.qt_bytes), x_cols_scales = w1grad.take(cd.scales_bytes);
    Carve all;
    all.bytes = std::max({dgrad.bytes, w2grad.bytes, xgrad.bytes, w1grad.bytes});
    dh_q = all.take(fp8_rows_bytes(R, s.n1));  // dH's E4M3 rows [R, n1] and scales: steps 2-4
    region_bytes = all.bytes;
    region = b.take(region_bytes);
    chunk_offsets = b.take(cd.chunk_offsets_bytes);
    if (s.has_bias)
      bias_partials = b.take(static_cast<size_t>(max_chunks) * static_cast<size_t>(std::max(s.d, s.n1)) * 4);
  }
};

// The expert part's forward scratch for R rows (bf16 data): the gather index row -> token [R],
// A [R, n], Y [R, d], the routing metadata's workspace, the GEMMs' tile offsets [E+1] and, for a
// call split into early and late tokens, each expert's first late row [E] (host/layer/early_rows.hpp).
// With precision FP8, A is E4M3 with its scales and x's E4M3 rows [T, d] (and scales) come first,
// and Y's region also holds H's E4M3 copy when H is not saved.
struct ExpertsForwardScratch {
  size_t row_token = 0, a = 0, y = 0, metadata = 0, tile_offsets = 0, row_split = 0;
  size_t x_fp8 = 0;  // FP8 only
  void carve(Carve& f, const ExpertsShape& s, int64_t R) {
    const size_t r = static_cast<size_t>(R), es = s.elem;
    const bool fp8 = s.precision == Precision::FP8;
    row_token = f.take(r * 4);
    if (fp8) x_fp8 = f.take(fp8_rows_bytes(s.T, s.d));
    a = f.take(fp8 ? fp8_rows_bytes(R, s.n) : r * static_cast<size_t>(s.n) * es);
    // FP8 inference (H not saved): the up-projection's E4M3 H [R, n1] and scales land here, where
    // Y is written next (the down-projection reads A, not H). Larger than Y only when
    // n1 + 4·ceil(n1/128) > 2d (n close to d).
    y = f.take(std::max(r * static_cast<size_t>(s.d) * es, fp8 ? fp8_rows_bytes(R, s.n1) : size_t{0}));
    metadata = f.take(routing_metadata_workspace_bytes(s.T, s.E));
    tile_offsets = f.take((static_cast<size_t>(s.E) + 1) * 4);
    row_split = f.take(static_cast<size_t>(s.E) * 4);
  }
};

// The expert part's backward scratch for R rows (host/layer/experts_backward.cu): the rebuilt gather
// index, the dH kernel's outputs (dH, A' = s·A, dS partials), dX~, the GEMMs' tile offsets, each
// expert's first late row [E] (a call split into early and late tokens), and with biases the
// per-chunk partial sums of db1/db2.
struct ExpertsBackwardScratch {
  // Rows per partial sum of the bias gradients: experts' rows are cut into chunks of this many,
  // each chunk summed by one block, the chunks of an expert then added in order.
  static constexpr int kBiasChunkRows = 256;
  size_t row_token = 0, dh = 0, a_prime = 0, dx_rows = 0, ds_partial = 0, tile_offsets = 0, row_split = 0;
  size_t bias_chunk_prefix = 0, bias_partials = 0;  // has_bias only
  size_t shared_run_offsets = 0, shared_pieces = 0;  // a layer's shared experts, where cut (shared_pairs.hpp)
  Fp8BackwardScratch fp8;                            // precision FP8 only
  int64_t ds_tiles = 0;     // column tiles of the dH kernel: the row stride of ds_partial
  int64_t bias_chunks = 0;  // rows of bias_partials (upper bound of Σ_e ceil(rows_e / kBiasChunkRows))
  // shared: how many of the s.E experts are a layer's shared experts (the last ones, T rows each).
  void carve(Carve& b, const ExpertsShape& s, int64_t R, int64_t shared = 0) {
    const size_t r = static_cast<size_t>(R), es = s.elem;
    row_token = b.take(r * 4);                                   // [R] row -> token
    if (s.precision == Precision::FP8) {  // no bf16 dH or A'; dX~ in the FP8 region; no d-score partials
      tile_offsets = b.take((static_cast<size_t>(s.E) + 1) * 4);
      fp8.carve(b, s, R);
      return;
    }
    dh = b.take(r * static_cast<size_t>(s.n1) * es);             // [R, n1] dH
    a_prime = b.take(r * static_cast<size_t>(s.n) * es);         // [R, n] A' = s·act(H)
    dx_rows = b.take(r * static_cast<size_t>(s.d) * es);         // [R, d] dX~ = dH·W1
    ds_tiles = grouped_gemm_column_tiles(s.n);
    ds_partial = b.take(r * static_cast<size_t>(ds_tiles) * 4);  // [R, ds_tiles] fp32
    tile_offsets = b.take((static_cast<size_t>(s.E) + 1) * 4);
    row_split = b.take(static_cast<size_t>(s.E) * 4);            // [E] first late row per expert
    if (s.has_bias) {
      bias_chunks = ceil_div(R, kBiasChunkRows) + s.E;
      const size_t cols = static_cast<size_t>(std::max<int64_t>(s.d, s.n1));
      bias_chunk_prefix = b.take((static_cast<size_t>(s.E) + 1) * 4);     // [E+1] first chunk of each expert
      bias_partials = b.take(static_cast<size_t>(bias_chunks) * cols * 4);  // [chunks, max(d, n1)]
    }
    const SharedWgradScratch cut(s.T, shared, s.d, s.n, s.n1);
    if (cut.offsets_bytes > 0) {
      shared_run_offsets = b.take(cut.offsets_bytes);  // [S·m + 1] int32
      shared_pieces = b.take(cut.pieces_bytes);        // [S·m, d, max(n, n1)] fp32
    }
  }
};

// The blocks of experts_forward / experts_backward (a general routing list of R pairs).
struct ExpertsLayout {
  int64_t R = 0;
  // saved (host/layer/saved_layout.hpp, ExpertsSavedPart): offsets of its parts
  size_t h, scores, expert_offsets, row_pair, pair_row, token_offsets;
  size_t saved_bytes;
  ExpertsForwardScratch fwd;
  size_t forward_bytes;
  ExpertsBackwardScratch bwd;  // d_scores is the caller's output
  size_t backward_bytes;

  explicit ExpertsLayout(const ValidExpertsProblem& valid) {
    const ExpertsProblem& p = *valid;
    const ExpertsShape sh = experts_shape(p);
    R = p.R;
    const auto parts = experts_saved_terms(valid);
    size_t off[kExpertsSavedParts];
    Carve s;
    for (int i = 0; i < kExpertsSavedParts; ++i) off[i] = s.take(parts[i].bytes(R, p.T));
    saved_bytes = s.bytes;
    h = off[kExpertsH], scores = off[kExpertsScores], expert_offsets = off[kExpertsExpertOffsets];
    row_pair = off[kExpertsRowPair], pair_row = off[kExpertsPairRow], token_offsets = off[kExpertsTokenOffsets];
    Carve f;
    fwd.carve(f, sh, R);
    forward_bytes = f.bytes;
    Carve b;
    bwd.carve(b, sh, R);
    backward_bytes = b.bytes;
  }
};

struct LayerLayout {
  int64_t R = 0;   // rows the experts may run on (T·K for top-K)
  int64_t n1 = 0;  // columns of H
  // saved (host/layer/saved_layout.hpp, LayerSavedPart): offsets of its parts; the rounded list's
  // are used with token rounding only
  size_t scores, expert_offsets, row_pair, pair_row, logits;
  size_t list_token, list_padded, topk_scores, topk_experts, list_token_offsets, count_topk, count_rounded;
  size_t router_scores;  // shared experts only: the router's [T, K] (the list is [T, K+S])
  size_t h;
  size_t saved_bytes;
  size_t inference_saved_bytes;  // everything before H (carved last): enough when H is not written
  // forward workspace: the expert part's scratch (gather index, A, Y, metadata, tile offsets),
  // the aggregation's pair offsets, the aux loss's partial sums, cuBLAS, token rounding
  ExpertsForwardScratch fwd;
  size_t experts, token_offsets, aux_partials, aux_colsum, cublas, rounding = 0;
  size_t router_experts = 0;  // shared experts only: the router's [T, K] int32
  size_t gate_logits = 0;     // shared experts only: x·shared_gate [T] fp32 (used with has_shared_gate)
  size_t forward_bytes;
  // backward workspace: the expert part's scratch (host/layer/experts_backward.cu), the top-K list's
  // token offsets t·K, the d scores, the router's gradients and scratch (layer_backward.cu)
  ExpertsBackwardScratch bwd;
  size_t b_experts, b_token_offsets, d_scores, d_logits, d_logits_bf16, b_cublas, b_aux_partials, aux_grad;
  size_t b_router_experts = 0, b_router_d_scores = 0;  // shared experts only: the router's [T, K]
  size_t d_gate_logits = 0, d_gate_logits_bf16 = 0;     // shared experts only: [T] (has_shared_gate)
  size_t backward_bytes;

  static constexpr int kAuxTokensPerBlock = 64;
  static constexpr size_t kCublasWorkspace = size_t{4} << 20;

  explicit LayerLayout(const ValidLayerProblem& valid) {
    const LayerProblem& p = *valid;
    const ExpertsShape sh = experts_shape(p);
    const LayerSavedTerms terms = layer_saved_terms(valid);
    R = terms.rows.at(p.T);
    n1 = sh.n1;
    const size_t r = static_cast<size_t>(R), T = static_cast<size_t>(p.T), E = static_cast<size_t>(p.E);
    size_t off[kLayerSavedParts];
    Carve s;
    for (int i = 0; i < kLayerSavedParts; ++i) {
      if (i == kLayerH) inference_saved_bytes = s.bytes;
      off[i] = s.take(terms.parts[i].bytes(R, p.T));
    }
    saved_bytes = s.bytes;
    scores = off[kLayerScores], expert_offsets = off[kLayerExpertOffsets];
    row_pair = off[kLayerRowPair], pair_row = off[kLayerPairRow], logits = off[kLayerLogits];
    list_token = off[kLayerListToken], list_padded = off[kLayerListPadded];
    topk_scores = off[kLayerTopkScores], topk_experts = off[kLayerTopkExperts];
    list_token_offsets = off[kLayerListTokenOffsets];
    count_topk = off[kLayerCountTopk], count_rounded = off[kLayerCountRounded];
    router_scores = off[kLayerRouterScores];
    h = off[kLayerH];

    Carve f;
    fwd.carve(f, sh, R);
    experts = f.take(r * 4);              // [pairs] int32: the router's (or rounded list's) experts
    token_offsets = f.take((T + 1) * 4);  // [T+1] the aggregation's pair offsets
    const size_t aux_blocks = static_cast<size_t>(ceil_div(std::max<int64_t>(p.T, 1), kAuxTokensPerBlock));
    aux_partials = f.take(aux_blocks * E * 4);
    aux_colsum = f.take(E * 4);
    cublas = f.take(kCublasWorkspace);
    if (p.rounding != TokenRounding::None) rounding = f.take(token_rounding_workspace_bytes(p.T, p.E, p.K));
    const size_t topk = T * static_cast<size_t>(p.K);
    if (p.num_shared > 0) {
      router_experts = f.take(topk * 4);
      gate_logits = f.take(T * 4);  // carved with any shared experts: the sizes need not know of the gate
    }
    forward_bytes = f.bytes;

    Carve b;
    bwd.carve(b, sh, R, p.num_shared);
    b_experts = b.take(r * 4);              // [pairs] int32, rebuilt from pair_row
    b_token_offsets = b.take((T + 1) * 4);  // [T+1] t·K (top-K; rounding has its own)
    d_scores = b.take(r * 4);               // [R] fp32, pair order
    d_logits = b.take(T * E * 4);           // [T, E] fp32
    d_logits_bf16 = b.take(T * E * 2);      // [T, E] bf16, cuBLAS operand
    b_cublas = b.take(kCublasWorkspace);
    b_aux_partials = b.take(aux_blocks * E * 4);  // [aux blocks, E] fp32 column sums of P
    aux_grad = b.take((E + 1) * 4);               // [E] ∂loss/∂colsum, then a skip flag
    if (p.num_shared > 0) {
      b_router_experts = b.take(topk * 4);   // [T, K] int32
      b_router_d_scores = b.take(topk * 4);  // [T, K] fp32
      d_gate_logits = b.take(T * 4);         // [T] fp32 ∂loss/∂(x·shared_gate)
      d_gate_logits_bf16 = b.take(T * 2);    // [T] bf16, the cuBLAS operand of d_shared_gate
    }
    backward_bytes = b.bytes;
  }
};

}  // namespace machmoe::detail
