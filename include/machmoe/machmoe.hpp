// machmoe public C++ API (no PyTorch): plan the workspace of an MoE layer and run its forward and
// backward on device pointers and a caller's stream, plus the kernel-family entry points.
// Semantics of every tensor: docs/LAYER.md. All entry points are asynchronous on `stream`, never
// synchronise the host, and throw machmoe::Error with a message naming the argument and the rule.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "machmoe/types.hpp"

namespace machmoe {

// The static description of one layer call.
struct LayerProblem {
  int64_t T = 0;  // tokens (0 allowed)
  int64_t d = 0;  // hidden size
  int64_t n = 0;  // expert intermediate size
  int64_t E = 0;  // experts
  int64_t K = 0;  // experts per token
  Activation activation = Activation::SwiGLU;
  GateUpLayout layout = GateUpLayout::Interleaved;
  bool has_bias = false;
  RoutingMethod routing = RoutingMethod::SoftmaxTopK;
  bool renormalize = true;
  TokenRounding rounding = TokenRounding::None;
  int64_t rounding_tile_m = 128;
  DType dtype = DType::BF16;  // x, weights, H and the output
  // The expert GEMMs' operands (types.hpp). FP8 takes the weights' FP8 copies in the call's
  // fp8_weights (quantize_expert_weights_fp8; the bf16 w1 and w2 are then not read and may be
  // null), keeps H in E4M3 in `saved`, and is defined for
  // SwiGLU and the clamped SwiGLU, the interleaved layout, bf16 and no shared experts, with d and
  // n multiples of 16 (biases and token rounding allowed); validate() refuses anything else.
  Precision precision = Precision::BF16;
  // ---- router options of recent MoE models (docs/LAYER.md "Routing"); defaults: off.
  double routed_scaling_factor = 1.0;  // > 0; scores × this after renormalisation
  int64_t n_group = 1;                 // group-limited selection (gate routings): E % n_group == 0
  int64_t topk_group = 1;              // groups kept, 1 <= topk_group <= n_group
  bool has_router_bias = false;        // logits = x·Wrᵀ + b_r (router_bias [E] given)
  GluClamp glu_clamp;  // ClampedSwiGLU's parameters; the defaults for any other activation
  // ---- shared experts (docs/LAYER.md "Shared experts"); default: none.
  // S experts that every token visits, of the routed experts' size n, stored after the E routed
  // ones: w1 [E+S, n1, d], w2 [E+S, d, n] (and b1, b2). They run in the routed experts' launches:
  // token t's pairs are its K routed ones, then (t, E+s) for s < S, weighted by 1, by
  // shared_scores[t] (has_shared_scores: a per-token weight computed by the caller) or by
  // sigmoid(x[t]·shared_gate) (has_shared_gate: Qwen's gate, a [d] weight, computed in the
  // layer's launches: its gradient and its part of dx come from layer_backward). At most one of
  // the two. Not with token rounding.
  int64_t num_shared = 0;
  bool has_shared_scores = false;
  bool has_shared_gate = false;
};

// Experts in the weights of a layer problem: the routed ones, then the shared ones.
inline int64_t weight_experts(const LayerProblem& p) { return p.E + p.num_shared; }

// The router options of a layer problem as the routing calls take them.
inline RouterOptions router_options(const LayerProblem& p) {
  return RouterOptions{p.routed_scaling_factor, p.n_group, p.topk_group};
}

struct ExpertsProblem;

// A problem that validate() accepted, kept as a read-only copy. Only validate() makes one, so a
// function that takes it need not check the problem again: a framework binding validates once
// and hands the result to plan_workspace and to the forward or backward call. The overloads
// that take the plain problem validate it themselves.
template <typename Problem>
class Validated {
 public:
  const Problem& problem() const { return problem_; }
  const Problem& operator*() const { return problem_; }
  const Problem* operator->() const { return &problem_; }

 private:
  explicit Validated(const Problem& p) : problem_(p) {}
  Problem problem_;
  friend Validated<LayerProblem> validate(const LayerProblem& p);
  friend Validated<ExpertsProblem> validate(const ExpertsProblem& p);
};
using ValidLayerProblem = Validated<LayerProblem>;
using ValidExpertsProblem = Validated<ExpertsProblem>;

// Throws Error(InvalidArgument) naming the first field that breaks a rule, or
// Error(Unsupported) for a valid problem beyond this build's limits.
ValidLayerProblem validate(const LayerProblem& p);

// Bytes the caller provides. `saved` lives from forward to backward (H bf16, fp32 scores, int32
// metadata, and logits where a routing variant needs them); `forward_workspace` and
// `backward_workspace` are scratch for one call each.
struct WorkspacePlan {
  size_t saved_bytes = 0;
  // What layer_forward needs in `saved` with write_h = false (inference): saved_bytes less H's
  // R·n1 bf16 (H is carved last). For an ExpertsProblem, equal to saved_bytes.
  size_t inference_saved_bytes = 0;
  size_t forward_workspace_bytes = 0;
  size_t backward_workspace_bytes = 0;
};
WorkspacePlan plan_workspace(const ValidLayerProblem& p);
WorkspacePlan plan_workspace(const LayerProblem& p);  // validates p

// The expert weights' FP8 copies that a call with precision FP8 reads (E = every expert of the
// weights, n1 = 2n): E4M3 codes with one fp32 scale per 128x128 block (quantize_weights_fp8 in
// machmoe/fp8.hpp), plain for the forward and transposed (the same codes and scales) for the
// backward's dA' = dout·W2 and dX~ = dH·W1.
struct Fp8ExpertWeights {
  const uint8_t* w1 = nullptr;         // [E, n1, d]
  const float* w1_scales = nullptr;    // [E, ceil(n1/128), ceil(d/128)]
  const uint8_t* w1_t = nullptr;       // [E, d, n1]
  const float* w1_t_scales = nullptr;  // [E, ceil(d/128), ceil(n1/128)]
  const uint8_t* w2 = nullptr;         // [E, d, n]
  const float* w2_scales = nullptr;    // [E, ceil(d/128), ceil(n/128)]
  const uint8_t* w2_t = nullptr;       // [E, n, d]
  const float* w2_t_scales = nullptr;  // [E, ceil(n/128), ceil(d/128)]
};
// Bytes of the four copies for E experts (SwiGLU: n1 = 2n), each part 256-byte aligned.
size_t fp8_expert_weights_bytes(int64_t E, int64_t d, int64_t n);
// Quantises w1 [E, 2n, d] and w2 [E, d, n] (bf16, gate/up interleaved) into `buffer`
// (fp8_expert_weights_bytes, 256-byte aligned) on `stream` and returns the pointers into it. Run
// once per change of the weights (an optimizer step): every call reads the copies as they are.
// Rules: E >= 1; d, n >= 16 and multiples of 16.
Fp8ExpertWeights quantize_expert_weights_fp8(int64_t E, int64_t d, int64_t n, const void* w1, const void* w2,
                                             void* buffer, cudaStream_t stream);

// Device pointers; layouts as docs/LAYER.md. Biases and selection_bias may be null when unused.
struct LayerForwardArgs {
  const void* x = nullptr;              // [T, d]
  const void* router_weight = nullptr;  // [E, d]
  const void* w1 = nullptr;             // [E+S, n1, d] (S = num_shared: the shared experts last)
  const void* b1 = nullptr;             // [E+S, n1]
  const void* w2 = nullptr;             // [E+S, d, n]
  const void* b2 = nullptr;             // [E+S, d]
  const float* selection_bias = nullptr;  // [E], gate routings (Sigmoid, SqrtSoftplus) only
  const void* router_bias = nullptr;    // [E] bf16, exactly when has_router_bias
  const float* shared_scores = nullptr;  // [T] fp32, exactly when has_shared_scores
  const void* shared_gate = nullptr;     // [d] bf16, exactly when has_shared_gate
  void* out = nullptr;                  // [T, d]
  float* aux_loss = nullptr;            // [1]
  void* saved = nullptr;                // plan.saved_bytes (inference_saved_bytes with write_h = false), 256-byte aligned
  void* workspace = nullptr;            // plan.forward_workspace_bytes
  uint64_t seed = 0;                    // stochastic token rounding
  // false: inference, H is not written (the up-projection writes only A), and `saved` then cannot
  // feed layer_backward; everything else is the same, the output bitwise so. BF16 only.
  bool write_h = true;
  const Fp8ExpertWeights* fp8_weights = nullptr;  // exactly when precision is FP8
};
void layer_forward(const ValidLayerProblem& p, const LayerForwardArgs& a, cudaStream_t stream);
void layer_forward(const LayerProblem& p, const LayerForwardArgs& a, cudaStream_t stream);  // validates p

// Gradients of the layer (docs/LAYER.md "Backward"), from what layer_forward left in `saved`.
// dx is bf16 [T, d]; the weight and bias gradients (d_router_weight [E, d], dw1 [E+S, n1, d],
// db1 [E+S, n1], dw2 [E+S, d, n], db2 [E+S, d]; S = num_shared) are written (not accumulated) in weight_grad_dtype
// (BF16 or FP32). Experts that received no rows get exact zeros. Deterministic: two calls on the
// same inputs give bitwise-identical results. No host synchronisation.
struct LayerBackwardArgs {
  const void* x = nullptr;
  const void* router_weight = nullptr;
  const void* w1 = nullptr;
  const void* b1 = nullptr;
  const void* w2 = nullptr;
  const void* b2 = nullptr;
  const void* saved = nullptr;  // what layer_forward wrote
  const void* dout = nullptr;   // [T, d]
  float d_aux = 0.f;            // gradient of the aux loss
  // The same on the device ([1] fp32), or null. When given it replaces d_aux and is read by a
  // kernel, so a framework can pass the aux loss's gradient without a host synchronisation.
  const float* d_aux_device = nullptr;
  void* dx = nullptr;           // [T, d]
  void* d_router_weight = nullptr;
  void* d_router_bias = nullptr;  // [E] in weight_grad_dtype, exactly when has_router_bias
  void* dw1 = nullptr;
  void* db1 = nullptr;
  void* dw2 = nullptr;
  void* db2 = nullptr;
  // [T] fp32, exactly when has_shared_scores: ∂loss/∂shared_scores[t], the sum over the token's S
  // shared pairs of ∂loss/∂(pair score).
  float* d_shared_scores = nullptr;
  // Exactly when has_shared_gate: the gate [d] bf16 (as given to layer_forward) and its gradient
  // [d] in weight_grad_dtype (written, not accumulated); dx then includes the gate's term.
  const void* shared_gate = nullptr;
  void* d_shared_gate = nullptr;
  void* workspace = nullptr;    // plan.backward_workspace_bytes, 256-byte aligned
  DType weight_grad_dtype = DType::BF16;
  const Fp8ExpertWeights* fp8_weights = nullptr;  // exactly when precision is FP8 (the forward's)
};
void layer_backward(const ValidLayerProblem& p, const LayerBackwardArgs& a, cudaStream_t stream);
void layer_backward(const LayerProblem& p, const LayerBackwardArgs& a, cudaStream_t stream);  // validates p

// ---------------------------------------------------------------- experts on a general routing list
// The expert part of the layer alone, on a routing list the caller gives (docs/LAYER.md, "general"):
// R pairs (score, token, expert), no router, no aux loss. layer_forward/layer_backward run the same
// expert code on the list their router made.
//
// The list's rules (not checked on the device, which would need a host synchronisation):
//   - ordered by token (pair_token non-decreasing), tokens in [0, T), experts in [0, E);
//   - no (token, expert) pair twice. The routing metadata gives a repeated pair one shared row:
//     the forward is still right (the row is added once per pair), the backward is not (the row's
//     H gradient carries one pair's score only). ExpertsForwardArgs.duplicate_flag reports a
//     repeat on the device; the Python front end refuses repeats on the host before calling.
// A pair outside [0, T) x [0, E) gets no row: it adds nothing and its score's gradient is 0.
struct ExpertsProblem {
  int64_t T = 0;  // tokens (0 allowed)
  int64_t d = 0;  // hidden size
  int64_t n = 0;  // expert intermediate size
  int64_t E = 0;  // experts
  int64_t R = 0;  // pairs in the list, those out of range included (0 allowed; 0 when T = 0)
  Activation activation = Activation::SwiGLU;
  GateUpLayout layout = GateUpLayout::Interleaved;
  bool has_bias = false;
  DType dtype = DType::BF16;  // x, weights, H and the output
  GluClamp glu_clamp;  // ClampedSwiGLU's parameters; the defaults for any other activation
  Precision precision = Precision::BF16;  // as LayerProblem's (FP8: the same rules, whole calls only)
};

// Throws Error(InvalidArgument) naming the first field that breaks a rule.
ValidExpertsProblem validate(const ExpertsProblem& p);
// Bytes the caller provides, exact for this problem (as the layer's plan): `saved` holds H [R, n1]
// bf16, the fp32 scores [R], expert_offsets [E+1], row_pair / pair_row [R] and the list's
// per-token offsets [T+1]; nothing of size R·d.
WorkspacePlan plan_workspace(const ValidExpertsProblem& p);
WorkspacePlan plan_workspace(const ExpertsProblem& p);  // validates p

// `part` splits the call in three, for a caller whose x rows arrive in two batches (expert
// parallelism: a GPU's own tokens are at hand, the other GPUs' arrive while it computes). Tokens
// [0, early_tokens) are the early ones, [early_tokens, T) the late ones.
//   EarlyRows: the routing metadata and the up-projection of the early tokens' rows (x's late
//              rows are not read);
//   LateRows:  both projections of the late tokens' rows, and out's late rows;
//   EarlyOut:  the down-projection of the early tokens' rows, and out's early rows.
// Run in that order with the same arguments (saved and workspace untouched in between), they
// write bitwise what one call (All) writes: every row is computed by the same kernels, only the
// tiles are cut at each expert's first late row.
enum class ExpertsForwardPart { All, EarlyRows, LateRows, EarlyOut };

struct ExpertsForwardArgs {
  const void* x = nullptr;             // [T, d]
  const void* w1 = nullptr;            // [E, n1, d]
  const void* b1 = nullptr;            // [E, n1] or null
  const void* w2 = nullptr;            // [E, d, n]
  const void* b2 = nullptr;            // [E, d] or null
  const float* scores = nullptr;       // [R] fp32 (copied into `saved`)
  const int32_t* pair_token = nullptr; // [R]
  const int32_t* pair_expert = nullptr;  // [R]
  void* out = nullptr;                 // [T, d]: out_t = Σ_{pairs (t, e, s)} s · MLP_e(x_t)
  void* saved = nullptr;               // plan.saved_bytes, 256-byte aligned
  void* workspace = nullptr;           // plan.forward_workspace_bytes, 256-byte aligned
  int32_t* duplicate_flag = nullptr;   // [1] or null: set to 1 when the list repeats a pair, else 0
  ExpertsForwardPart part = ExpertsForwardPart::All;
  int64_t early_tokens = 0;            // [0, T]: the early tokens of a split call (any part but All)
  // EarlyRows only, optional: the early tokens' rows [early_tokens, d] in a tensor of their own,
  // read instead of x's first rows (which may then still be in the making: a caller copies them
  // into x beside the kernels, for the parts and the backward that read x whole).
  const void* x_early = nullptr;
  // A bound on the GEMMs' persistent CTAs (0: one per SM), leaving SMs to work queued on other
  // streams (a transfer's barriers beside a split call's last part).
  int max_ctas = 0;
  const Fp8ExpertWeights* fp8_weights = nullptr;  // exactly when precision is FP8
};
void experts_forward(const ValidExpertsProblem& p, const ExpertsForwardArgs& a, cudaStream_t stream);
void experts_forward(const ExpertsProblem& p, const ExpertsForwardArgs& a, cudaStream_t stream);  // validates p

// Gradients of experts_forward from what it left in `saved` and the same list (pair_token and
// pair_expert; the scores are read from `saved`). dx bf16 [T, d]; d_scores fp32 [R] in the list's
// pair order; dw1 [E, n1, d], db1 [E, n1], dw2 [E, d, n], db2 [E, d] written (not accumulated) in
// weight_grad_dtype (BF16 or FP32). Experts without rows get exact zeros. Deterministic (bitwise),
// no host synchronisation, no float atomics.
//
// `part` splits the call in two, for a caller that wants to start on dx (e.g. send it to other
// GPUs) while the weight gradients are computed: DataGradients writes dx and d_scores and leaves
// in `workspace` what the weight gradients read; WeightGradients then writes dw1, db1, dw2, db2
// from that workspace (same problem, list, saved, x, dout; the workspace untouched in between).
// Each gradient is bitwise what a whole call writes. weights_max_ctas bounds the persistent CTAs of
// the weight-gradient GEMMs (0: one per SM), leaving SMs to work queued on other streams.
//
// DataGradients splits further, as the forward's parts do, for a caller whose dout rows arrive in
// two batches: DataEarlyRows runs the first GEMM (dout · W2) on the rows of the early tokens
// [0, early_tokens) (dout's late rows are not read), DataLateRows the rest of DataGradients. The
// two in order write bitwise what DataGradients writes.
enum class ExpertsBackwardPart { All, DataGradients, WeightGradients, DataEarlyRows, DataLateRows };
struct ExpertsBackwardArgs {
  const void* x = nullptr;
  const void* w1 = nullptr;
  const void* b1 = nullptr;
  const void* w2 = nullptr;
  const void* b2 = nullptr;
  const int32_t* pair_token = nullptr;   // [R] the forward's list
  const int32_t* pair_expert = nullptr;  // [R]
  const void* saved = nullptr;           // what experts_forward wrote
  const void* dout = nullptr;            // [T, d]
  void* dx = nullptr;
  void* dw1 = nullptr;
  void* db1 = nullptr;
  void* dw2 = nullptr;
  void* db2 = nullptr;
  float* d_scores = nullptr;             // [R]
  void* workspace = nullptr;             // plan.backward_workspace_bytes, 256-byte aligned
  DType weight_grad_dtype = DType::BF16;
  ExpertsBackwardPart part = ExpertsBackwardPart::All;
  int weights_max_ctas = 0;
  int64_t early_tokens = 0;  // [0, T]: the early tokens of DataEarlyRows / DataLateRows
  // DataEarlyRows only, optional: dout's early rows [early_tokens, d] in a tensor of their own, read
  // instead of dout's first rows (as ExpertsForwardArgs::x_early).
  const void* dout_early = nullptr;
  const Fp8ExpertWeights* fp8_weights = nullptr;  // exactly when precision is FP8 (the forward's)
};
void experts_backward(const ValidExpertsProblem& p, const ExpertsBackwardArgs& a, cudaStream_t stream);
void experts_backward(const ExpertsProblem& p, const ExpertsBackwardArgs& a, cudaStream_t stream);  // validates p

// ---------------------------------------------------------------- kernel families

// The top-K router: logits [T, E] fp32 -> scores [T, K] fp32, experts [T, K] int32 (docs/LAYER.md;
// ties to the lower expert index, NaN selected first). Any E >= 1 and 1 <= K <= E; E <= 4096 with
// K <= 32 keep the row in registers (fast path). selection_bias [E] only with Sigmoid, may be null.
void topk_router(const float* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                 bool renormalize, const float* selection_bias, float* scores, int32_t* experts,
                 cudaStream_t stream);
// Its backward: d_scores [T, K] -> d_logits [T, E] (every element written).
void topk_router_backward(const float* logits, const float* scores, const int32_t* experts,
                          const float* d_scores, int64_t T, int64_t E, int64_t K,
                          RoutingMethod method, bool renormalize, float* d_logits,
                          cudaStream_t stream);
// The same with the router options (routed scaling factor, group-limited selection; see
// RouterOptions). selection_bias with the gate routings (Sigmoid, SqrtSoftplus). Group-limited
// selection runs a kernel that rescans the row per selection round (any E; slower).
void topk_router(const float* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                 bool renormalize, const RouterOptions& options, const float* selection_bias, float* scores,
                 int32_t* experts, cudaStream_t stream);
void topk_router_backward(const float* logits, const float* scores, const int32_t* experts,
                          const float* d_scores, int64_t T, int64_t E, int64_t K,
                          RoutingMethod method, bool renormalize, const RouterOptions& options,
                          float* d_logits, cudaStream_t stream);

// The layer's router on its own, as layer_forward and layer_backward run it, for callers that route
// tokens before they travel (expert parallelism routes each rank's own tokens, then exchanges them).
// Forward: logits [T, E] fp32 = x [T, d] · Wrᵀ (+ router_bias [E]) (bf16 operands, fp32
// accumulation) -> top-K scores [T, K] fp32 and experts [T, K] int32 (as topk_router, with its
// options), expert_offsets [E+1] int32 of those T·K pairs (expert e has offsets[e+1] - offsets[e]),
// aux_loss [1] fp32 (the layer's load-balancing loss of them, docs/LAYER.md).
// Backward: d_scores [T, K] and the aux loss's gradient d_aux [1] (each on the device, or null for
// none) -> d_logits, rounded to bf16 for the GEMMs -> dx [T, d] bf16 = d_logits · Wr (written, not
// added), d_router_weight [E, d] = d_logitsᵀ · x and, exactly when has_router_bias, d_router_bias
// [E] = Σ_t d_logits, both in weight_grad_dtype. Deterministic, graph-capturable, no host
// synchronisation; any d >= 1 (the GEMMs are cuBLAS's).
struct RouterProblem {
  int64_t T = 0, d = 0, E = 0, K = 0;
  RoutingMethod routing = RoutingMethod::SoftmaxTopK;
  bool renormalize = true;
  RouterOptions options{};
  bool has_router_bias = false;
};
struct RouterForwardArgs {
  const void* x = nullptr;                // [T, d] bf16
  const void* router_weight = nullptr;    // [E, d] bf16
  const void* router_bias = nullptr;      // [E] bf16, exactly when has_router_bias
  const float* selection_bias = nullptr;  // [E] with the gate routings, or null
  float* logits = nullptr;                // [T, E]
  float* scores = nullptr;                // [T, K]
  int32_t* experts = nullptr;             // [T, K]
  int32_t* expert_offsets = nullptr;      // [E+1]
  float* aux_loss = nullptr;              // [1]
  void* workspace = nullptr;              // router_workspace_bytes(p), no initialisation needed
};
struct RouterBackwardArgs {
  const void* x = nullptr;               // the forward's inputs and outputs
  const void* router_weight = nullptr;
  const float* logits = nullptr;
  const float* scores = nullptr;
  const int32_t* experts = nullptr;
  const int32_t* expert_offsets = nullptr;
  const float* d_scores = nullptr;  // [T, K], or null
  const float* d_aux = nullptr;     // [1], or null
  void* dx = nullptr;               // [T, d] bf16
  void* d_router_weight = nullptr;  // [E, d]
  void* d_router_bias = nullptr;    // [E], exactly when has_router_bias
  DType weight_grad_dtype = DType::BF16;
  void* workspace = nullptr;  // router_workspace_bytes(p)
};
size_t router_workspace_bytes(const RouterProblem& p);
void router_forward(const RouterProblem& p, const RouterForwardArgs& a, cudaStream_t stream);
void router_backward(const RouterProblem& p, const RouterBackwardArgs& a, cudaStream_t stream);

// Routing metadata of R pairs, ordered by token: pair_expert [R], and pair_token [R] or null
// for a top-K list (token of pair p = p / K). Outputs (int32, device): see RoutingMetadataOutputs.
// A pair whose expert or token is out of range gets pair_row = -1 and no row (expert_offsets[E]
// then counts the valid pairs only); a repeated (token, expert) pair sets *duplicate_flag = 1 and
// its repeats share one row, whose row_pair is the lowest of their pair indices. Rows past
// expert_offsets[E] are not specified. Deterministic, graph-capturable, no host synchronisation.
// The workspace (routing_metadata_workspace_bytes) needs no initialisation; top-K lists whose
// tile fits in shared memory (E = 128 and K <= 180, or K = 8 and E <= 3500, ...) take a faster
// path with no memset.
struct RoutingMetadataOutputs {
  int32_t* expert_offsets = nullptr;  // [E+1]
  int32_t* row_token = nullptr;       // [R] gather index
  int32_t* row_pair = nullptr;        // [R]
  int32_t* pair_row = nullptr;        // [R] reverse index
  int32_t* token_offsets = nullptr;   // [T+1], may be null
  int32_t* duplicate_flag = nullptr;  // [1], may be null
};
size_t routing_metadata_workspace_bytes(int64_t T, int64_t E);
void routing_metadata(const int32_t* pair_expert, const int32_t* pair_token, int64_t R, int64_t K,
                      int64_t T, int64_t E, const RoutingMetadataOutputs& out, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

// Token rounding (training only; docs/LAYER.md): softmax_topk routing of logits [T, E] fp32,
// then each expert's row count moved to a multiple of tile_m (mode Nearest/Up/Down/Stochastic),
// emitted as a general routing list ordered by token, then expert. The list has R rows, R =
// token_offsets[T] on the device (no host sync), R <= token_rounding_capacity(...); rows past R
// hold invalid pairs (token T, expert -1, score 0), so the whole capacity can go to
// routing_metadata, which gives them no row. K <= 32.
struct TokenRoundingOutputs {
  float* topk_scores = nullptr;      // [T, K] the plain top-K routing (kept for the backward)
  int32_t* topk_experts = nullptr;   // [T, K]
  int32_t* token = nullptr;          // [capacity]
  int32_t* expert = nullptr;         // [capacity]
  float* score = nullptr;            // [capacity] top-K score, or P[t, e] for a padded pair
  uint8_t* padded = nullptr;         // [capacity] 1 = added by rounding
  int32_t* token_offsets = nullptr;  // [T+1]
  int32_t* count_topk = nullptr;     // [E+1] expert offsets of the top-K list (f_e = diff)
  int32_t* count_rounded = nullptr;  // [E] r_e
};
int64_t token_rounding_capacity(int64_t T, int64_t E, int64_t K, int64_t tile_m);
size_t token_rounding_workspace_bytes(int64_t T, int64_t E, int64_t K);
void token_rounding(const float* logits, int64_t T, int64_t E, int64_t K, TokenRounding mode,
                    int64_t tile_m, uint64_t seed, const TokenRoundingOutputs& out, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);
// d_score [capacity] of the list (rows past R ignored) -> d_logits [T, E] (every element written).
void token_rounding_backward(const float* logits, const float* topk_scores,
                             const int32_t* topk_experts, const int32_t* token_offsets,
                             const int32_t* expert, const uint8_t* padded, const float* d_score,
                             int64_t T, int64_t E, int64_t K, float* d_logits, cudaStream_t stream);

// Aggregation: out[t] = Σ_{p in [token_offsets[t], token_offsets[t+1])} (scores[p] or 1) ·
// rows[pair_row[p]]; rows [R, d], out [T, d], fp32 accumulation; scores null for the dX
// aggregation. Rows and out may each be bf16, fp16 or fp32.
void aggregate(const void* rows, DType rows_dtype, const int32_t* pair_row,
               const int32_t* token_offsets, const float* scores, int64_t T, int64_t d, void* out,
               DType out_dtype, cudaStream_t stream);

// Expert parallelism's exchange plan (docs/LAYER.md, "Expert parallelism"): who sends what, from
// one rank's top-K list experts [T, K] int32 and scores [T, K] fp32, with E experts sharded over W
// ranks (rank q owns experts [q·E/W, (q+1)·E/W); E a multiple of W; `rank` is this rank, written
// into each pair). Rows: one per distinct (token, owning rank), numbered rank-major with tokens
// ascending inside a rank. Pairs: the T·K pairs p = t·K + k, grouped by owning rank, (t, k) order
// inside. Every buffer int32 on the device; T·K <= 2^31 - 1. Deterministic, graph-capturable, no
// host synchronisation. An expert id out of [0, E) gets no row and no position (and sets
// *invalid); entries past the valid ones are then not specified.
struct ExchangePlanOutputs {
  int32_t* counts = nullptr;         // [W, 2] rows and pairs sent to rank q
  int32_t* row_offsets = nullptr;    // [W+1] rank q's rows are [row_offsets[q], row_offsets[q+1])
  int32_t* row_token = nullptr;      // [T·K] row -> token (past row_offsets[W]: not specified)
  int32_t* pair_row = nullptr;       // [T·K] pair -> its row
  int32_t* order = nullptr;          // [T·K] position (grouped by rank) -> pair
  int32_t* inverse = nullptr;        // [T·K] pair -> position
  int32_t* packed = nullptr;         // [T·K, 4], 16-byte aligned: at position i, for pair p =
                                     //   order[i] of rank q: (pair_row[p] - row_offsets[q],
                                     //   expert - q·E/W, rank, the score's fp32 bits)
  int32_t* token_offsets = nullptr;  // [T+1] token t's rows are distinct_rows[off[t] .. off[t+1])
  int32_t* distinct_rows = nullptr;  // [T·K] each token's rows, ascending (= rank order)
  int32_t* expert_counts = nullptr;  // [E] pairs per expert (the aux loss's counts); may be null
  int32_t* invalid = nullptr;        // [1] 1 if an expert id was out of [0, E), else 0; may be null
};
size_t exchange_plan_workspace_bytes(int64_t T, int64_t K, int64_t W);
void exchange_plan(const int32_t* experts, const float* scores, int64_t T, int64_t K, int64_t E,
                   int64_t W, int64_t rank, const ExchangePlanOutputs& out, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream);

// The sm_90a grouped GEMM engine: for every expert e with rows [off[e], off[e+1]),
//   C[r] = epilogue(A[row(r)] · W[e]ᵀ),  row(r) = gather[r] (gathered rows) or r (contiguous),
// A bf16 rows (lda elements apart), W [E, N, K] bf16 (nn.Linear layout, K contiguous), or with
// w_n_major W [E, K, N] (N contiguous: the backward's dA' = dout·W2 and dX~ = dH·W1).
// Epilogues: Store (C = acc + bias), GLU (C = H [R, N = 2n], C2 = act(gate)·up [R, n], gate/up
// per `layout`), Activation (C = H [R, N], C2 = act(H)) - for these two C may be null (inference:
// H is not written) -, ActivationBackward (the dH kernel: the
// GEMM gives dA' [R, N = n]; with H [R, n1] (h, ldh) and s_r = row_scores[row_pair[r]] it writes
// C = dH = dAct(s·dA', H) [R, n1] in H's layout, C2 = A' = s·act(H) [R, n], and
// ds_partial[r * column_tiles + j] = Σ over column tile j of dA'·act(H), fp32, no atomics).
// Needs K, N, lda, ldc, ldc2 multiples of 8 and 16-byte aligned pointers. R = off[E] is read on
// the device only: no host sync.
enum class GemmEpilogue : int32_t { Store = 0, GLU = 1, Activation = 2, ActivationBackward = 3 };
// Which kernel runs a grouped GEMM. Auto: chosen by the problem's shape (the fastest measured).
// Cooperative: both consumer warpgroups on one tile; runs every problem. PingPong: one tile per
// consumer warpgroup; runs the Store epilogue with contiguous A, and ActivationBackward with a
// gather (its own dH kernel). A forced kernel that cannot run the problem is refused
// (InvalidArgument). Every kernel computes the same result; forcing one is for tests and
// comparisons.
enum class GemmKernel : int32_t { Auto = 0, Cooperative = 1, PingPong = 2 };
struct GroupedGemmArgs {
  const void* a = nullptr;
  int64_t lda = 0;
  int64_t a_rows = 0;                       // rows of A (T with a gather, else >= off[E])
  const int32_t* gather = nullptr;          // [R] or null
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  // [E] device, or null. Given: expert e's rows are [expert_offsets[e], expert_row_ends[e]) (a part
  // of each expert's rows; expert_offsets may then be any [E] row starts); null: [off[e], off[e+1]).
  const int32_t* expert_row_ends = nullptr;
  int64_t E = 0, N = 0, K = 0;
  const void* w = nullptr;                  // [E, N, K]
  const void* bias = nullptr;               // [E, N] or null
  void* c = nullptr;
  int64_t ldc = 0;
  void* c2 = nullptr;
  int64_t ldc2 = 0;
  GemmEpilogue epilogue = GemmEpilogue::Store;
  Activation activation = Activation::SwiGLU;
  GateUpLayout layout = GateUpLayout::Interleaved;
  int32_t* tile_offsets = nullptr;          // workspace [E+1] int32 (device; written only for E > 512, > 384 by the dH ping-pong)
  int max_ctas = 0;                         // 0: one persistent CTA per SM
  bool w_n_major = false;                   // W is [E, K, N]
  // ActivationBackward only:
  const void* h = nullptr;                  // [R, n1] bf16
  int64_t ldh = 0;
  const float* row_scores = nullptr;        // [pairs] fp32, indexed through row_pair
  const int32_t* row_pair = nullptr;        // [R]
  float* ds_partial = nullptr;              // [R, grouped_gemm_column_tiles(N)]
  GemmKernel kernel = GemmKernel::Auto;
  GluClamp glu_clamp;                       // ClampedSwiGLU's parameters (GLU, ActivationBackward)
};
void grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream);
// The row stride of ActivationBackward's ds_partial for N output columns: one partial dS per
// 128 columns, ceil(N / 128), whichever kernel runs.
int64_t grouped_gemm_column_tiles(int64_t N);

// The weight gradients as varlen-K grouped GEMMs, the row (token) dimension gathered:
//   C[e] = Σ_{r in [off[e], off[e+1])} A[row(r)]ᵀ ⊗ B[r]        [M, N] per expert
// row(r) = a_gather[r] or r. A rows [*, M] bf16 (lda), B rows [R, N] bf16 (ldb, contiguous).
// C is [E, M, N], or [E, N, M] with transpose_c, in c_dtype (FP32 or BF16), written (not
// accumulated); an expert with no rows gets exact zeros. dW2 = A: dout gathered by token,
// B: A'; dW1 (transposed): A: x gathered by token, B: dH. Fixed summation order (deterministic).
// Which weight-gradient kernel runs. Auto: CTA pairs where there are two or more column tiles
// (N > 256, or 128 < N < 256) and max_ctas allows two CTAs, else one CTA per tile. SingleCta
// and CtaPairs force one (CtaPairs is refused where it cannot run). Both give bitwise the same C.
enum class WgradKernel : int32_t { Auto = 0, SingleCta = 1, CtaPairs = 2 };
struct GroupedWgradArgs {
  const void* a = nullptr;
  int64_t lda = 0;
  int64_t a_rows = 0;                       // rows of A (T with a gather)
  const int32_t* a_gather = nullptr;        // [R] or null
  const void* b = nullptr;
  int64_t ldb = 0;
  int64_t b_rows = 0;                       // rows of B (>= off[E])
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t E = 0, M = 0, N = 0;
  void* c = nullptr;
  DType c_dtype = DType::FP32;
  bool transpose_c = false;
  int max_ctas = 0;
  WgradKernel kernel = WgradKernel::Auto;
};
void grouped_gemm_wgrad(const GroupedWgradArgs& args, cudaStream_t stream);

// True when this build carries the sm_90a kernels of the layer, forward and backward.
bool layer_kernels_available();

// Facts about the current device, read off cudaGetDeviceProperties.
struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  size_t smem_per_block_optin = 0;
  size_t l2_bytes = 0;
  char name[256] = {};
};
DeviceInfo device_info();

// Launches a tiny sm_90a kernel and checks its result: proves the library's device code loads and
// runs on this GPU. Synchronises the stream (a diagnostic, not a hot-path call).
void device_self_test(cudaStream_t stream);

}  // namespace machmoe
