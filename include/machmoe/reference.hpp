// The CPU reference of the whole layer, computing in double: the executable spec that every GPU
// kernel is tested against. Semantics: docs/LAYER.md. Row-major arrays throughout; shapes are in
// the comments. Nothing here is fast; everything here is meant to be obviously right.
#pragma once

#include <cstdint>
#include <vector>

#include "machmoe/types.hpp"

namespace machmoe::ref {

// ---------------------------------------------------------------- routing

// Top-K routing of logits [T, E]. Pair p = t*K + k is the k-th choice of token t
// (k = 0 is the largest selection key). selection_bias [E] (Sigmoid only) may be null.
struct TopK {
  int64_t T = 0, K = 0;
  std::vector<int32_t> expert;  // [T*K]
  std::vector<double> score;    // [T*K]
};
TopK topk_route(const double* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                bool renormalize, const double* selection_bias);
// The same with the router options: the routed scaling factor and group-limited selection
// (gate routings only; selection_bias with the gate routings).
TopK topk_route(const double* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                bool renormalize, const RouterOptions& options, const double* selection_bias);
// The kept groups of one token under group-limited selection: keep[g] for g < n_group, from the
// selection values key [E] (gate + selection bias).
std::vector<uint8_t> kept_groups(const double* key, int64_t E, const RouterOptions& options);
// The gate of the gate routings: σ(l) (Sigmoid) or sqrt(softplus(l)) (SqrtSoftplus), and its
// derivative; softplus(l) = l for l > 20, else log(1 + exp(l)) (as torch.nn.functional.softplus).
double gate(RoutingMethod method, double logit);
double gate_derivative(RoutingMethod method, double logit);

// d_logits [T, E] from d_score [T*K] through the routing's score function (selection is
// piecewise constant and not differentiated).
std::vector<double> topk_route_backward(const double* logits, int64_t T, int64_t E,
                                        RoutingMethod method, bool renormalize, const TopK& topk,
                                        const double* d_score);
std::vector<double> topk_route_backward(const double* logits, int64_t T, int64_t E,
                                        RoutingMethod method, bool renormalize, const RouterOptions& options,
                                        const TopK& topk, const double* d_score);

// A general routing list of R pairs (token, expert, score), ordered by token (non-decreasing).
// Top-K routing becomes one with pair p = t*K + k; token rounding produces one directly.
struct RoutingList {
  std::vector<int32_t> token;   // [R]
  std::vector<int32_t> expert;  // [R]
  std::vector<double> score;    // [R]
  int64_t size() const { return static_cast<int64_t>(token.size()); }
};
RoutingList to_list(const TopK& topk);

struct TokenRoundingOptions {
  TokenRounding mode = TokenRounding::Nearest;
  int64_t tile_m = 128;
  uint64_t seed = 0;  // Stochastic only
};

struct TokenRoundingResult {
  RoutingList list;                     // ordered by token, then expert
  std::vector<uint8_t> padded;          // [R] 1 = pair added by rounding (score = P[t,e])
  TopK topk;                            // the plain softmax_topk routing it started from
  std::vector<int64_t> count_topk;      // [E] f_e
  std::vector<int64_t> count_rounded;   // [E] r_e
};
TokenRoundingResult token_round(const double* logits, int64_t T, int64_t E, int64_t K,
                                const TokenRoundingOptions& opt);
// d_logits [T, E] from d_score [R] of the rounded list.
std::vector<double> token_round_backward(const double* logits, int64_t T, int64_t E,
                                         const TokenRoundingResult& tr, const double* d_score);

// The uniform draw in [0, 1) token rounding's Stochastic mode uses for expert e.
double stochastic_uniform(uint64_t seed, int64_t e);

// Aux load-balancing loss from logits [T, E] and the experts of the R routed pairs.
double aux_loss(const double* logits, int64_t T, int64_t E, const int32_t* expert, int64_t R);
// Adds d_aux · ∂aux/∂logits into d_logits [T, E].
void aux_loss_backward(const double* logits, int64_t T, int64_t E, const int32_t* expert,
                       int64_t R, double d_aux, double* d_logits);

// ---------------------------------------------------------------- routing metadata

// Rows are the R pairs grouped by expert (ascending), by token inside an expert, then by pair.
struct Metadata {
  std::vector<int64_t> expert_offsets;  // [E+1] rows of expert e: [off[e], off[e+1])
  std::vector<int32_t> row_pair;        // [R] row -> pair index
  std::vector<int32_t> row_token;       // [R] row -> token (the gather index)
  std::vector<int32_t> pair_row;        // [R] pair -> row (the reverse index)
  std::vector<int64_t> token_offsets;   // [T+1] pairs of token t: [off[t], off[t+1])
};
// Throws Error(InvalidArgument) for a token or expert out of range or a list not ordered by token.
Metadata build_metadata(const RoutingList& list, int64_t T, int64_t E);

// ---------------------------------------------------------------- experts

struct Shape {
  int64_t T = 0, d = 0, n = 0, E = 0;
  Activation act = Activation::SwiGLU;
  GateUpLayout layout = GateUpLayout::Interleaved;
  bool bias = false;
  GluClamp clamp;  // Activation::ClampedSwiGLU's parameters (the defaults for any other; last, so
                   // that positional initialisers of the fields above keep working)
  int64_t n1() const { return is_glu(act) ? 2 * n : n; }  // rows of W1 per expert
};

// Expert weights (nn.Linear convention): w1 [E, n1, d], b1 [E, n1], w2 [E, d, n], b2 [E, d].
// Biases are read only when Shape::bias.
struct Weights {
  const double* w1 = nullptr;
  const double* b1 = nullptr;
  const double* w2 = nullptr;
  const double* b2 = nullptr;
};

// act(H) for one row: h [n1] -> a [n]. `clamp`: ClampedSwiGLU's parameters.
void activation_forward(Activation act, GateUpLayout layout, int64_t n, const double* h, double* a,
                        const GluClamp& clamp = {});
// dH [n1] from dA [n] and H [n1]. A clamp passes the gradient where it does not bind, bounds
// included (as torch.clamp).
void activation_backward(Activation act, GateUpLayout layout, int64_t n, const double* h,
                         const double* da, double* dh, const GluClamp& clamp = {});

struct ExpertsForward {
  std::vector<double> H;    // [R, n1] in row (expert-grouped) order
  std::vector<double> A;    // [R, n]
  std::vector<double> Y;    // [R, d]
  std::vector<double> out;  // [T, d]
};
ExpertsForward experts_forward(const Shape& s, const double* x, const Weights& w,
                               const RoutingList& list, const Metadata& md);

struct ExpertsGrads {
  std::vector<double> dx;       // [T, d]   (expert path only)
  std::vector<double> dw1, db1; // [E, n1, d], [E, n1] (db1 empty without bias)
  std::vector<double> dw2, db2; // [E, d, n], [E, d]
  std::vector<double> d_score;  // [R] in pair order
};
// The memory-minimal backward: uses only x, H, scores and metadata (A is recomputed).
ExpertsGrads experts_backward(const Shape& s, const double* x, const Weights& w,
                              const RoutingList& list, const Metadata& md, const double* H,
                              const double* dout);

// ---------------------------------------------------------------- the whole layer

struct LayerConfig {
  Shape shape;
  int64_t K = 1;
  RoutingMethod routing = RoutingMethod::SoftmaxTopK;
  bool renormalize = true;  // TopKSoftmax and the gate routings only
  TokenRoundingOptions rounding{TokenRounding::None, 128, 0};
  RouterOptions router;     // routed scaling factor, group-limited selection
  // Shared experts (docs/LAYER.md "Shared experts"): experts E..E+S-1 of the weights ([E+S, ...];
  // shape.E counts the routed ones), visited by every token after its K routed pairs with the
  // weight shared_scores[t] (layer_forward's argument; null: 1). Not with token rounding.
  int64_t num_shared = 0;
};

struct LayerForward {
  std::vector<double> logits;  // [T, E]
  TopK topk;                   // plain top-K (always computed; the list below may be rounded)
  TokenRoundingResult rounded; // filled when rounding.mode != None
  RoutingList list;            // the pairs the experts ran on
  Metadata md;
  ExpertsForward experts;
  double aux = 0;
};
// x [T, d], wr [E, d]; selection_bias [E] or null.
LayerForward layer_forward(const LayerConfig& c, const double* x, const double* wr,
                           const Weights& w, const double* selection_bias);
// With a router bias br [E] (null: none): logits = x·wrᵀ + br; and with c.num_shared > 0 the
// shared experts' per-token weights shared_scores [T] (null: 1).
LayerForward layer_forward(const LayerConfig& c, const double* x, const double* wr, const double* br,
                           const Weights& w, const double* selection_bias, const double* shared_scores = nullptr);

struct LayerGrads {
  std::vector<double> dx, dwr, dw1, db1, dw2, db2;  // shapes as the inputs
  std::vector<double> dbr;                           // [E] = Σ_t d_logits (the router bias's gradient)
  std::vector<double> d_logits;                      // [T, E]
  std::vector<double> d_score;                       // [R] of fwd.list
  std::vector<double> d_shared_scores;               // [T] with shared experts: Σ_s d_score of (t, E+s)
};
LayerGrads layer_backward(const LayerConfig& c, const double* x, const double* wr, const Weights& w,
                          const LayerForward& fwd, const double* dout, double d_aux);

// General routing: the experts on a given list (no router, no aux loss). Gradients include
// d_score; dwr and d_logits are empty.
LayerForward general_forward(const Shape& s, const double* x, const Weights& w,
                             const RoutingList& list);
LayerGrads general_backward(const Shape& s, const double* x, const Weights& w,
                            const LayerForward& fwd, const double* dout);

}  // namespace machmoe::ref
