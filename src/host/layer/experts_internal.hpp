// The expert part of a layer call, shared by the router-driven layer (layer.cu, layer_backward.cu)
// and the experts on a general routing list (experts.cpp, experts_backward.cu): the routing list
// -> metadata -> up-projection (H) -> down-projection -> aggregation, and its backward. The callers
// own the blocks; these runs take pointers into them (host/layer/layer_layout.hpp). Nothing here checks
// arguments: the public entry points have done that.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <functional>

#include "host/common/check.hpp"
#include "host/layer/layer_layout.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// Launch shape of the backward's small kernels (kernels/layer/layer_backward.cuh), shared by the layer's
// and the general list's backward: 256 threads, and a grid of blocks covering `work` items at
// `per_block` each, at least one (grid.x may reach 2^31 - 1).
constexpr int kBackwardThreads = 256;
constexpr int kBackwardWarpsPerBlock = kBackwardThreads / 32;
inline unsigned blocks_for(int64_t work, int64_t per_block) {
  return static_cast<unsigned>(std::max<int64_t>(ceil_div(work, per_block), 1));
}

// A routing list of `pairs` pairs in token order: pair p sends token token[p] to expert expert[p]
// with weight scores[p]. A top-K list has no token array (token = p / K, pairs = T·K). `pairs` is
// also the capacity of the rows (a rounded list's tail holds invalid pairs that get no row).
struct PairList {
  const int32_t* expert = nullptr;  // [pairs]
  const int32_t* token = nullptr;   // [pairs], or null for a top-K list
  const float* scores = nullptr;    // [pairs] fp32
  int64_t pairs = 0;
  int64_t K = 0;  // top-K lists only
};

struct ExpertsForwardRun {
  ExpertsShape shape;
  PairList list;
  const void *x = nullptr, *w1 = nullptr, *b1 = nullptr, *w2 = nullptr, *b2 = nullptr;
  void* out = nullptr;  // [T, d]
  void* h = nullptr;    // [pairs, n1] (saved for the backward)
  // Where the metadata goes (the saved block's or scratch); md.row_token is set by the run (scratch).
  RoutingMetadataOutputs md;
  ExpertsForwardScratch scratch;  // offsets into `workspace`
  void* workspace = nullptr;
  int max_ctas = 0;  // bound on the GEMMs' CTAs (0: none)
  int64_t early_tokens = 0;       // a split call's early tokens [0, early_tokens)
  const void* x_early = nullptr;  // EarlyRows: their rows of x [early_tokens, d] apart, or null
  const Fp8ExpertWeights* fp8 = nullptr;  // shape.precision FP8: the weights' FP8 copies
};

// Forward, T > 0 and pairs > 0: routing_metadata of the list, H [rows, n1] = x[row_token]·W1ᵀ (+b1)
// with the GLU/activation epilogue (A scratch), Y = A·W2ᵀ (+b2), out = Σ scores·Y per token.
// = experts_forward_metadata, then experts_forward_gemms; the layer runs its aux loss between the
// two, while the router's partial sums are still in L2.
void experts_forward_run(const ExpertsForwardRun& r, cudaStream_t stream);
void experts_forward_metadata(const ExpertsForwardRun& r, cudaStream_t stream);
void experts_forward_gemms(const ExpertsForwardRun& r, cudaStream_t stream);
// One part of a call split into early and late tokens (machmoe::ExpertsForwardPart, the tokens
// [0, r.early_tokens) early); All is experts_forward_run.
void experts_forward_part(const ExpertsForwardRun& r, ExpertsForwardPart part, cudaStream_t stream);

struct ExpertsBackwardRun {
  ExpertsShape shape;
  PairList list;
  const void *x = nullptr, *w1 = nullptr, *w2 = nullptr, *b2 = nullptr, *dout = nullptr;
  // What the forward saved.
  const void* h = nullptr;
  const int32_t *expert_offsets = nullptr, *row_pair = nullptr, *pair_row = nullptr;
  // The per-token pair offsets [T+1] of a list with tokens. A top-K list's (t·K) are rebuilt into
  // topk_token_offsets [T+1] (scratch) instead.
  const int32_t* token_offsets = nullptr;
  int32_t* topk_token_offsets = nullptr;
  ExpertsBackwardScratch scratch;  // offsets into `workspace`
  void* workspace = nullptr;
  // Outputs: d_scores [pairs] fp32 (pair order); dx [T, d] bf16; weight and bias gradients in
  // grad_dtype (db1/db2 only with biases).
  float* d_scores = nullptr;
  void *dx = nullptr, *dw1 = nullptr, *db1 = nullptr, *dw2 = nullptr, *db2 = nullptr;
  DType grad_dtype = DType::BF16;
  ExpertsBackwardPart part = ExpertsBackwardPart::All;  // what to compute (machmoe.hpp)
  // A layer's shared experts: the last `shared` of shape.E, T rows each; their weight gradients
  // are cut into runs (host/layer/shared_pairs.hpp) in the scratch the layout carved for them.
  int64_t shared = 0;
  int weights_max_ctas = 0;                             // bound on the wgrad GEMMs' CTAs (0: none)
  int64_t early_tokens = 0;                             // DataEarlyRows / DataLateRows: tokens [0, early_tokens)
  const void* dout_early = nullptr;                     // DataEarlyRows: dout's early rows, or null
  // The layer backward's router part, optional. after_scores runs on the stream once d_scores is
  // written (the router backward: d_logits from d_scores); with router_d_logits set, the dx
  // aggregation also adds the router's part d_logits [T, E] · router_weight [E, d] (bf16, fp32
  // sums; kernels/layer/aggregate_router.cuh), so that dx is written once.
  std::function<void()> after_scores;
  const void* router_d_logits = nullptr;
  const void* router_weight = nullptr;
  int64_t router_E = 0;
  // With router_d_logits, optional: a rank-1 term coef [T] fp32 ⊗ row [d] bf16 added to dx as
  // well (Qwen's shared-expert gate: ∂loss/∂(x·g) ⊗ g).
  const float* router_rank1_coef = nullptr;
  const void* router_rank1_row = nullptr;
  const Fp8ExpertWeights* fp8 = nullptr;  // shape.precision FP8: the weights' FP8 copies
};

// Whether the dx aggregation can add the router's part itself (experts_backward.cu): d % 8 == 0
// (16-byte row vectors), E <= 256 (Wr's slice in shared memory), and dX~ [R, d] addressable by
// 32-bit offsets in 16-byte units.
bool router_dx_fusable(int64_t R, int64_t d, int64_t E);

// Backward, T > 0 and pairs > 0 (docs/BACKWARD.md steps 1-3 and 7-11): rebuild row_token, the
// dH kernel (dH, A', dS partials), d_scores, dW2, dW1, db2/db1, dX~ = dH·W1, dx = Σ dX~ per token.
// r.part DataGradients runs all but dW2, dW1, db2/db1; WeightGradients only those (from the
// workspace a DataGradients run filled).
void experts_backward_run(const ExpertsBackwardRun& r, cudaStream_t stream);

// Pieces of the backward that both precisions run (experts_backward.cu): step 1, the gather index
// row -> token into scratch.row_token (and a top-K list's t·K offsets); step 11, dx [T, d] = the
// sum of each token's rows of dX~ [pairs, d] bf16 (+ the router's part with router_d_logits).
void rebuild_row_token(const ExpertsBackwardRun& r, cudaStream_t stream);
void aggregate_input_gradient(const ExpertsBackwardRun& r, const void* dx_rows, cudaStream_t stream);

// precision FP8 (fp8_experts.cu; machmoe/reference_fp8_layer.hpp states the same in double):
// experts_forward_gemms and experts_backward_run (whole calls) on the weights' FP8 copies r.fp8.
// H is saved as E4M3 codes [pairs, n1] followed by their scales (saved_h_row_bytes).
void experts_forward_gemms_fp8(const ExpertsForwardRun& r, cudaStream_t stream);
void experts_backward_fp8(const ExpertsBackwardRun& r, cudaStream_t stream);

// The expert biases' gradients (bias_gradients.cu): db [E, cols] = Σ over each expert's rows r of
// scale_r · src[row(r)] (bf16 src [*, cols]; row(r) = gather[r] or r; scale_r =
// pair_scores[row_pair[r]] or 1), as fp32 partials per chunk of an expert's rows, added per expert
// in chunk order into `out` (grad dtype). The chunks: `prefix` [E+1] numbers each expert's first
// chunk of `chunk_rows` rows (the bf16 backward's 256, or FP8's 128-row column chunks), `partials`
// [slots, cols] fp32 with `slots` at least the chunks there can be.
inline constexpr int kBiasChunkRowsBf16 = ExpertsBackwardScratch::kBiasChunkRows;
inline constexpr int kBiasChunkRowsFp8 = static_cast<int>(kFp8Tile);
struct BiasChunks {
  const int32_t* prefix = nullptr;  // [E+1] device
  float* partials = nullptr;        // [slots, cols] fp32
  int64_t slots = 0;
  int chunk_rows = kBiasChunkRowsBf16;  // kBiasChunkRowsBf16 or kBiasChunkRowsFp8
};
void bias_gradient(const BiasChunks& chunks, int64_t E, const void* src, const int32_t* gather,
                   const float* pair_scores, const int32_t* row_pair, const int32_t* expert_offsets, int64_t cols,
                   void* out, DType out_dtype, cudaStream_t stream);
// Its second pass alone, on partials another kernel wrote (FP8: the SwiGLU backward's dH sums).
void bias_gradient_finalize(const BiasChunks& chunks, int64_t E, int64_t cols, void* out, DType out_dtype,
                            cudaStream_t stream);
// d_scores[p] += ⟨dout[t], b2[e]⟩ for every pair p with a row (t its token, e its expert): the
// output bias's term where the rest of the d scores is written already (FP8).
void add_output_bias_scores(const ExpertsBackwardRun& r, cudaStream_t stream);

// Zeros for the expert weight and bias gradients (no rows: T = 0 or an empty list).
void zero_expert_gradients(const ExpertsShape& s, void* dw1, void* db1, void* dw2, void* db2, DType grad_dtype,
                           const char* fn, cudaStream_t stream);

}  // namespace machmoe::detail
