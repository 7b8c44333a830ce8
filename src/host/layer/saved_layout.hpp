// The `saved` blocks' byte layout, defined once: what a layer call (or an experts call on a general
// routing list) keeps from its forward for its backward, part by part, in carving order. Every
// part's size is linear in the block's rows R and tokens T, so that one description serves
//   - LayerLayout / ExpertsLayout (host/layer/layer_layout.hpp), which carve the block at a given
//     T into the pointers the calls use and the sizes plan_workspace reports, and
//   - the fake kernels of the PyTorch ops (python/machmoe/_fake.py), which size the block on
//     symbolic T and R under torch.compile: they read this description through the
//     layer_saved_layout / experts_saved_layout ops (saved_layout_ints) instead of restating it.
// Header only, no CUDA: the PyTorch op library includes it too.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// Every part starts at a multiple of this many bytes (TMA needs 128, 16-byte vectors need 16).
inline constexpr int64_t kSavedPartAlignment = 256;

// Bytes of one part: per_row·R + per_token·T + fixed, before rounding up to the alignment.
struct PartSize {
  int64_t per_row = 0, per_token = 0, fixed = 0;
  size_t bytes(int64_t R, int64_t T) const { return static_cast<size_t>(per_row * R + per_token * T + fixed); }
};

// Bytes per row of the saved H [R, n1]: n1 elements of the data dtype, or with precision FP8 its
// E4M3 codes [R, n1] followed by their fp32 scales [R, ceil(n1/128)] (1x128 tiles along a row).
// Codes first: R·n1 is a multiple of 16 (FP8 needs n1 % 32 == 0), so the scales start aligned.
inline int64_t saved_h_row_bytes(int64_t n1, DType dtype, Precision precision) {
  return precision == Precision::FP8 ? n1 + 4 * ((n1 + 127) / 128) : n1 * dtype_size(dtype);
}

// Rows a layer call's experts may run on, from its tokens T:
//   min(per_token·T + extra, cap_per_token·T), or per_token·T + extra with cap_per_token = 0.
// Top-K: T·K. Token rounding: token_rounding_rows below.
struct LayerRows {
  int64_t per_token = 0, extra = 0, cap_per_token = 0;
  int64_t at(int64_t T) const {
    const int64_t rows = per_token * T + extra;
    return cap_per_token > 0 ? std::min(rows, cap_per_token * T) : rows;
  }
};

// The rounded list's capacity min(T·K + E·(tile_m - 1), T·E): each expert moves by less than one
// tile, and a token appears at most once per expert. The one definition: token_rounding_capacity
// evaluates it at T, the saved layout (and through it the fake kernels) keeps it symbolic in T.
inline LayerRows token_rounding_rows(int64_t E, int64_t K, int64_t tile_m) {
  return LayerRows{K, E * (tile_m - 1), E};
}

// The parts of a layer call's saved block, in carving order. What is saved is the minimum the
// backward cannot rebuild cheaply: H, 12 bytes per routed pair (score, row -> pair, pair -> row),
// the expert offsets and the fp32 logits. Everything else is derivable and lives in the forward's
// workspace only: the gather index row -> token, the per-token pair offsets (t·K for top-K) and
// each pair's expert (the backward rebuilds it from pair_row and the expert offsets). x is not
// saved either (the caller keeps it), so no part has a size in d. H comes last, so that inference
// (layer_forward with write_h = false) needs only what precedes it.
enum LayerSavedPart : int {
  kLayerScores,            // [R] fp32: the list's scores (top-K or rounded)
  kLayerExpertOffsets,     // [E+1] int32
  kLayerRowPair,           // [R] int32 row -> pair
  kLayerPairRow,           // [R] int32 pair -> row
  kLayerLogits,            // [T, E] fp32: the aux loss and the routings' backward need the softmax
  kLayerListToken,         // token rounding only (else empty): the rounded list's tokens [R] int32,
  kLayerListPadded,        //   its padded flags [R] uint8,
  kLayerTopkScores,        //   the top-K it started from: scores [T, K] fp32,
  kLayerTopkExperts,       //   experts [T, K] int32,
  kLayerListTokenOffsets,  //   its per-token offsets [T+1] int32,
  kLayerCountTopk,         //   the expert offsets of the top-K list [E+1] int32,
  kLayerCountRounded,      //   and the per-expert counts after rounding [E] int32
  kLayerRouterScores,      // shared experts only (else empty): the router's top-K scores [T, K]
                           //   fp32 (the list's [T, K+S] holds them too, strided; the router's
                           //   backward reads them dense)
  kLayerH,                 // [R, n1] in the data dtype (FP8: codes and scales, saved_h_row_bytes)
  kLayerSavedParts
};

struct LayerSavedTerms {
  LayerRows rows;
  std::array<PartSize, kLayerSavedParts> parts;
};

inline LayerSavedTerms layer_saved_terms(const ValidLayerProblem& valid) {
  const LayerProblem& p = *valid;
  const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  const bool rounded = p.rounding != TokenRounding::None;
  LayerSavedTerms t;
  // A top-K list holds K + num_shared pairs per token (the shared experts' after the routed ones).
  t.rows = rounded ? token_rounding_rows(p.E, p.K, p.rounding_tile_m) : LayerRows{p.K + p.num_shared, 0, 0};
  auto& s = t.parts;  // {per_row, per_token, fixed}
  s[kLayerScores] = {4, 0, 0};
  s[kLayerExpertOffsets] = {0, 0, (weight_experts(p) + 1) * 4};
  s[kLayerRowPair] = {4, 0, 0};
  s[kLayerPairRow] = {4, 0, 0};
  s[kLayerLogits] = {0, p.E * 4, 0};
  if (rounded) {
    s[kLayerListToken] = {4, 0, 0};
    s[kLayerListPadded] = {1, 0, 0};
    s[kLayerTopkScores] = {0, p.K * 4, 0};
    s[kLayerTopkExperts] = {0, p.K * 4, 0};
    s[kLayerListTokenOffsets] = {0, 4, 4};
    s[kLayerCountTopk] = {0, 0, (p.E + 1) * 4};
    s[kLayerCountRounded] = {0, 0, p.E * 4};
  }
  if (p.num_shared > 0) s[kLayerRouterScores] = {0, p.K * 4, 0};
  s[kLayerH] = {saved_h_row_bytes(n1, p.dtype, p.precision), 0, 0};
  return t;
}

// The parts of an experts call's saved block (R = the list's length, given by the caller), in
// carving order: H, a copy of the scores (the backward reads them from here), the metadata the
// backward needs, and the list's per-token pair offsets (the dX~ aggregation reads them).
enum ExpertsSavedPart : int {
  kExpertsH,              // [R, n1] in the data dtype (FP8: codes and scales, saved_h_row_bytes)
  kExpertsScores,         // [R] fp32
  kExpertsExpertOffsets,  // [E+1] int32
  kExpertsRowPair,        // [R] int32
  kExpertsPairRow,        // [R] int32
  kExpertsTokenOffsets,   // [T+1] int32
  kExpertsSavedParts
};

inline std::array<PartSize, kExpertsSavedParts> experts_saved_terms(const ValidExpertsProblem& valid) {
  const ExpertsProblem& p = *valid;
  const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  std::array<PartSize, kExpertsSavedParts> s;
  s[kExpertsH] = {saved_h_row_bytes(n1, p.dtype, p.precision), 0, 0};
  s[kExpertsScores] = {4, 0, 0};
  s[kExpertsExpertOffsets] = {0, 0, (p.E + 1) * 4};
  s[kExpertsRowPair] = {4, 0, 0};
  s[kExpertsPairRow] = {4, 0, 0};
  s[kExpertsTokenOffsets] = {0, 4, 4};
  return s;
}

// The layouts as one flat list of integers (what the layer_saved_layout and experts_saved_layout
// ops return; python/machmoe/_fake.py decodes it):
//   [alignment, rows.per_token, rows.extra, rows.cap_per_token,
//    then per part in carving order: per_row, per_token, fixed]
// For an experts call the rows are the list's length: the three row fields are 0. Without
// write_h the layer's list stops before H, the last part.
inline std::vector<int64_t> saved_layout_ints(const LayerRows& rows, const PartSize* parts, int count) {
  std::vector<int64_t> v{kSavedPartAlignment, rows.per_token, rows.extra, rows.cap_per_token};
  for (int i = 0; i < count; ++i) v.insert(v.end(), {parts[i].per_row, parts[i].per_token, parts[i].fixed});
  return v;
}
inline std::vector<int64_t> layer_saved_layout_ints(const ValidLayerProblem& p, bool write_h) {
  const LayerSavedTerms t = layer_saved_terms(p);
  static_assert(kLayerH == kLayerSavedParts - 1, "H is the last part of the layer's saved block");
  return saved_layout_ints(t.rows, t.parts.data(), write_h ? kLayerSavedParts : kLayerH);
}
inline std::vector<int64_t> experts_saved_layout_ints(const ValidExpertsProblem& p) {
  const auto parts = experts_saved_terms(p);
  return saved_layout_ints(LayerRows{}, parts.data(), kExpertsSavedParts);
}

}  // namespace machmoe::detail
