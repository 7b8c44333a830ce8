// The expert part of the backward on the GPU (host/layer/experts_internal.hpp; docs/BACKWARD.md steps 1-3
// and 7-11), and experts_backward: the gradients of experts_forward on a general routing list.
// On the caller's stream, no host synchronisation, no float atomics (bitwise deterministic):
//   rebuild row_token -> dH kernel (dA' = dout·W2 gathered; epilogue: dH, A' = s·A, dS partials)
//   -> d scores (+ ⟨dout, b2⟩) -> dW2, dW1 (varlen-K GEMMs) -> db2, db1 -> dX~ = dH·W1 -> dx.
// layer_backward (layer_backward.cu) runs the same code, then its router part.
#include <algorithm>
#include <string>

#include "host/common/check.hpp"
#include "host/layer/call_rules.hpp"
#include "host/layer/early_rows.hpp"
#include "host/layer/experts_internal.hpp"
#include "host/layer/layer_layout.hpp"
#include "kernels/layer/aggregate_router.cuh"
#include "kernels/layer/layer_backward.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::at;
using detail::ceil_div;
using detail::check_cuda;
using detail::check_launch;
using detail::ExpertsBackwardScratch;

namespace {

constexpr int kThreads = detail::kBackwardThreads;
constexpr int kWarpsPerBlock = detail::kBackwardWarpsPerBlock;
using detail::blocks_for;

// The bf16 backward's chunks of the bias gradients: 256 rows, numbered by bwd_bias_chunk_prefix.
detail::BiasChunks bias_chunks(const ExpertsBackwardScratch& S, void* ws) {
  return {at<int32_t>(ws, S.bias_chunk_prefix), at<float>(ws, S.bias_partials), S.bias_chunks,
          ExpertsBackwardScratch::kBiasChunkRows};
}

// dx [T, d] = Σ_{pairs of t} dX~[pair_row] + d_logits[t]·Wr (+ the rank-1 term) in one pass
// (kernels/layer/aggregate_router.cuh).
// Persistent over token tiles: as many token groups as let the blocks of every column block be
// resident at once (each block loads its Wr slice once; a second wave would double the time of its
// blocks).
void aggregate_with_router(const detail::ExpertsBackwardRun& r, const __nv_bfloat16* dx_rows,
                           const int32_t* token_offsets, cudaStream_t stream) {
  const detail::ExpertsShape& s = r.shape;
  kernels::AggregateRouterParams ap{};
  ap.rows = dx_rows;
  ap.pair_row = r.pair_row;
  ap.token_offsets = token_offsets;
  ap.d_logits = static_cast<const __nv_bfloat16*>(r.router_d_logits);
  ap.wr = static_cast<const __nv_bfloat16*>(r.router_weight);
  ap.out = static_cast<__nv_bfloat16*>(r.dx);
  ap.rank1_coef = r.router_rank1_coef;
  ap.rank1_row = static_cast<const __nv_bfloat16*>(r.router_rank1_row);
  ap.T = s.T;
  ap.d = s.d;
  ap.E = static_cast<int>(r.router_E);
  const size_t smem = kernels::agg_router_smem_bytes(ap.E);
  auto* kernel =
      kernels::agg_router_prefetch(ap.E) ? kernels::aggregate_rows_router<true> : kernels::aggregate_rows_router<false>;
  detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<int>(kernels::agg_router_smem_max()),
                             "experts backward: cudaFuncSetAttribute (dx aggregation)");
  const int per_sm = detail::blocks_per_sm(reinterpret_cast<const void*>(kernel), kernels::kAggRouterThreads, smem,
                                           "experts backward: occupancy of the dx aggregation");
  const int64_t col_blocks = ceil_div(s.d, kernels::kAggRouterCols);
  const int64_t tiles = ceil_div(s.T, kernels::kAggRouterTokens);
  const int64_t groups = std::clamp<int64_t>(int64_t{std::max(per_sm, 1)} * device_info().sm_count / col_blocks, 1,
                                             std::min<int64_t>(tiles, 65535));
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(groups));
  kernel<<<grid, kernels::kAggRouterThreads, smem, stream>>>(ap);
  check_launch("experts backward: dx aggregation with the router's part");
}

}  // namespace

namespace detail {

void zero_expert_gradients(const ExpertsShape& s, void* dw1, void* db1, void* dw2, void* db2, DType grad_dtype,
                           const char* fn, cudaStream_t stream) {
  const size_t es = static_cast<size_t>(dtype_size(grad_dtype));
  const size_t E = static_cast<size_t>(s.E), d = static_cast<size_t>(s.d), n = static_cast<size_t>(s.n);
  const size_t n1 = static_cast<size_t>(s.n1);
  const std::string what = std::string(fn) + ": zero the weight gradients";
  check_cuda(cudaMemsetAsync(dw1, 0, E * n1 * d * es, stream), what.c_str());
  check_cuda(cudaMemsetAsync(dw2, 0, E * d * n * es, stream), what.c_str());
  if (s.has_bias) {
    check_cuda(cudaMemsetAsync(db1, 0, E * n1 * es, stream), what.c_str());
    check_cuda(cudaMemsetAsync(db2, 0, E * d * es, stream), what.c_str());
  }
}

bool router_dx_fusable(int64_t R, int64_t d, int64_t E) {
  return d % 8 == 0 && E >= 1 && E <= kernels::kAggRouterMaxE && ceil_div(d, kernels::kAggRouterCols) <= 65535 &&
         R * d / 8 < (int64_t{1} << 32) && device_info().smem_per_block_optin >= kernels::agg_router_smem_max();
}

namespace {

// The backward's scratch in the workspace (ExpertsBackwardScratch's offsets), as pointers: the
// phases below pass row_token, dH and A' from one to the next through these.
struct ScratchPointers {
  int32_t* row_token;          // [R]
  __nv_bfloat16* dh;           // [R, n1]
  __nv_bfloat16* a_prime;      // [R, n]
  float* ds_partial;           // [R, tiles]
  int32_t* tile_offsets;       // [E + 1]
};

ScratchPointers scratch_pointers(const ExpertsBackwardRun& r) {
  const ExpertsBackwardScratch& S = r.scratch;
  void* w = r.workspace;
  return {at<int32_t>(w, S.row_token), at<__nv_bfloat16>(w, S.dh), at<__nv_bfloat16>(w, S.a_prime),
          at<float>(w, S.ds_partial), at<int32_t>(w, S.tile_offsets)};
}

}  // namespace

// Step 1: the gather index row -> token [R] (and t·K offsets for a top-K list): not saved
// (derivable).
void rebuild_row_token(const ExpertsBackwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const PairList& l = r.list;
  const int64_t R = l.pairs;
  // Pairs of token t: [t·K, (t+1)·K) for a top-K list (rebuilt here), the list's own offsets else.
  int32_t* rebuilt_offsets = l.token ? nullptr : r.topk_token_offsets;
  kernels::bwd_rebuild_index<kThreads><<<blocks_for(std::max(R, s.T + 1), kThreads), kThreads, 0, stream>>>(
      r.row_pair, l.token, static_cast<int>(l.K), r.expert_offsets, static_cast<int>(s.E), R, s.T,
      at<int32_t>(r.workspace, r.scratch.row_token), rebuilt_offsets);
  check_launch("experts backward: rebuild row_token");
}

// Step 11: dx [T, d] = Σ_{pairs of t} dX~[pair_row] (no scores) (+ d_logits·Wr, the router's part).
void aggregate_input_gradient(const ExpertsBackwardRun& r, const void* dx_rows, cudaStream_t stream) {
  const int32_t* token_offsets = r.list.token ? r.token_offsets : r.topk_token_offsets;
  if (r.router_d_logits) {
    aggregate_with_router(r, static_cast<const __nv_bfloat16*>(dx_rows), token_offsets, stream);
    return;
  }
  aggregate(dx_rows, DType::BF16, r.pair_row, token_offsets, nullptr, r.shape.T, r.shape.d, r.dx, DType::BF16,
            stream);
}

namespace {

// Step 2, over the rows of `part` of each expert: the dH kernel: dA' [R, n] = dout[row_token] · W2_e
// (W2 [E, d, n] read as [E, K = d, N = n]); epilogue: dH [R, n1] = dAct(s·dA', H),
// A' [R, n] = s·act(H), ds_partial [R, tiles].
void dh_kernel(const ExpertsBackwardRun& r, RowPart part, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const auto [row_token, dh, a_prime, ds_partial, tile_offsets] = scratch_pointers(r);
  const ExpertRowRange rows = expert_rows(part, r.expert_offsets, at<int32_t>(r.workspace, r.scratch.row_split));
  GroupedGemmArgs g;
  const bool own_rows = part == RowPart::Early && r.dout_early && r.early_tokens > 0;  // the early rows apart
  g.a = own_rows ? r.dout_early : r.dout;
  g.lda = s.d;
  g.a_rows = own_rows ? r.early_tokens : s.T;
  g.gather = row_token;
  g.expert_offsets = rows.begins;
  g.expert_row_ends = rows.ends;
  g.E = s.E;
  g.N = s.n;
  g.K = s.d;
  g.w = r.w2;
  g.w_n_major = true;
  g.c = dh;
  g.ldc = s.n1;
  g.c2 = a_prime;
  g.ldc2 = s.n;
  g.epilogue = GemmEpilogue::ActivationBackward;
  g.activation = s.activation;
  g.glu_clamp = s.glu_clamp;
  g.layout = s.layout;
  g.h = r.h;
  g.ldh = s.n1;
  g.row_scores = r.list.scores;
  g.row_pair = r.row_pair;
  g.ds_partial = ds_partial;
  g.tile_offsets = tile_offsets;
  grouped_gemm(g, stream);
}

// Step 3: d scores [pairs] in pair order: Σ_j ds_partial[pair_row[p], j] (+ ⟨dout_t, b2_e⟩); then
// the caller's after_scores.
void pair_scores(const ExpertsBackwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const PairList& l = r.list;
  const int64_t R = l.pairs;
  kernels::PairScoreParams ps{};
  ps.ds_partial = scratch_pointers(r).ds_partial;
  ps.pair_row = r.pair_row;
  ps.dout = static_cast<const __nv_bfloat16*>(r.dout);
  ps.b2 = static_cast<const __nv_bfloat16*>(r.b2);
  ps.pair_expert = l.expert;
  ps.list_token = l.token;
  ps.d_score = r.d_scores;
  ps.pairs = R;
  ps.tiles = static_cast<int>(r.scratch.ds_tiles);
  ps.K = static_cast<int>(l.K);
  ps.d = static_cast<int>(s.d);
  if (s.has_bias)
    kernels::bwd_pair_scores_bias<kThreads><<<blocks_for(R, kWarpsPerBlock), kThreads, 0, stream>>>(ps);
  else
    kernels::bwd_pair_scores<kThreads><<<blocks_for(R, kThreads), kThreads, 0, stream>>>(ps);
  check_launch("experts backward: d scores");
  if (r.after_scores) r.after_scores();
}

// Steps 7-9: dW2, dW1 and the bias gradients from row_token, dH and A' in the workspace.
void weight_gradients(const ExpertsBackwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const int64_t n1 = s.n1, R = r.list.pairs;
  const ExpertsBackwardScratch& S = r.scratch;
  void* w = r.workspace;
  const ScratchPointers p = scratch_pointers(r);
  const int32_t* row_token = p.row_token;
  const __nv_bfloat16 *dh = p.dh, *a_prime = p.a_prime;

  // 7. dW2 [E, d, n] = Σ_r dout[row_token[r]]ᵀ ⊗ A'_r (varlen K over the expert's rows).
  GroupedWgradArgs w2g;
  w2g.a = r.dout;
  w2g.lda = s.d;
  w2g.a_rows = s.T;
  w2g.a_gather = row_token;
  w2g.b = a_prime;
  w2g.ldb = s.n;
  w2g.b_rows = R;
  w2g.expert_offsets = r.expert_offsets;
  w2g.E = s.E;
  w2g.M = s.d;
  w2g.N = s.n;
  w2g.c = r.dw2;
  w2g.c_dtype = r.grad_dtype;
  w2g.transpose_c = false;
  w2g.max_ctas = r.weights_max_ctas;
  int32_t* run_offsets = at<int32_t>(w, S.shared_run_offsets);
  float* pieces = at<float>(w, S.shared_pieces);
  shared_layer_wgrad(w2g, r.shared, s.T, run_offsets, pieces, stream);

  // 8. dW1 [E, n1, d] = (Σ_r x[row_token[r]]ᵀ ⊗ dH_r)ᵀ: [E, M = d, N = n1] stored transposed.
  GroupedWgradArgs w1g;
  w1g.a = r.x;
  w1g.lda = s.d;
  w1g.a_rows = s.T;
  w1g.a_gather = row_token;
  w1g.b = dh;
  w1g.ldb = n1;
  w1g.b_rows = R;
  w1g.expert_offsets = r.expert_offsets;
  w1g.E = s.E;
  w1g.M = s.d;
  w1g.N = n1;
  w1g.c = r.dw1;
  w1g.c_dtype = r.grad_dtype;
  w1g.transpose_c = true;
  w1g.max_ctas = r.weights_max_ctas;
  shared_layer_wgrad(w1g, r.shared, s.T, run_offsets, pieces, stream);

  // 9. Bias gradients: db2[e] = Σ_r s_r · dout[row_token[r]], db1[e] = Σ_r dH_r.
  if (s.has_bias) {
    kernels::bwd_bias_chunk_prefix<1024, ExpertsBackwardScratch::kBiasChunkRows><<<1, 1024, 0, stream>>>(
        r.expert_offsets, static_cast<int>(s.E), at<int32_t>(w, S.bias_chunk_prefix));
    check_launch("experts backward: bias chunk offsets");
    const detail::BiasChunks chunks = bias_chunks(S, w);
    detail::bias_gradient(chunks, s.E, r.dout, row_token, r.list.scores, r.row_pair, r.expert_offsets, s.d, r.db2,
                          r.grad_dtype, stream);
    detail::bias_gradient(chunks, s.E, dh, nullptr, nullptr, nullptr, r.expert_offsets, n1, r.db1, r.grad_dtype,
                          stream);
  }
}

// Steps 10-11: dX~ = dH·W1 and dx, the sum of a token's rows (+ the router's part).
void input_gradient(const ExpertsBackwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const int64_t n1 = s.n1, R = r.list.pairs;
  const ScratchPointers p = scratch_pointers(r);

  // 10. dX~ [R, d] = dH · W1_e (W1 [E, n1, d] read as [E, K = n1, N = d]), contiguous rows.
  GroupedGemmArgs gx;
  gx.a = p.dh;
  gx.lda = n1;
  gx.a_rows = R;
  gx.expert_offsets = r.expert_offsets;
  gx.E = s.E;
  gx.N = s.d;
  gx.K = n1;
  gx.w = r.w1;
  gx.w_n_major = true;
  gx.c = at<__nv_bfloat16>(r.workspace, r.scratch.dx_rows);
  gx.ldc = s.d;
  gx.epilogue = GemmEpilogue::Store;
  gx.tile_offsets = p.tile_offsets;  // stream order: the dH kernel is done with it
  grouped_gemm(gx, stream);
  aggregate_input_gradient(r, gx.c, stream);  // 11.
}

}  // namespace

void experts_backward_run(const ExpertsBackwardRun& r, cudaStream_t stream) {
  if (r.shape.precision == Precision::FP8) {  // whole calls only (the entry points refuse parts)
    experts_backward_fp8(r, stream);
    return;
  }
  switch (r.part) {
    case ExpertsBackwardPart::DataEarlyRows:
      rebuild_row_token(r, stream);
      launch_expert_row_split(r.expert_offsets, scratch_pointers(r).row_token, r.shape.E, r.early_tokens,
                              at<int32_t>(r.workspace, r.scratch.row_split), stream);
      dh_kernel(r, RowPart::Early, stream);
      return;
    case ExpertsBackwardPart::DataLateRows:
      dh_kernel(r, RowPart::Late, stream);
      pair_scores(r, stream);
      input_gradient(r, stream);
      return;
    default: break;
  }
  const bool data = r.part != ExpertsBackwardPart::WeightGradients;
  const bool weights = r.part != ExpertsBackwardPart::DataGradients;
  if (data) {
    rebuild_row_token(r, stream);
    dh_kernel(r, RowPart::All, stream);
    pair_scores(r, stream);
  }
  if (weights) weight_gradients(r, stream);
  if (data) input_gradient(r, stream);
}

}  // namespace detail

void experts_backward(const ValidExpertsProblem& valid, const ExpertsBackwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "experts_backward";
  const ExpertsProblem& p = *valid;
  detail::require_gpu_problem(valid, fn);
  const bool data_part = a.part == ExpertsBackwardPart::DataEarlyRows || a.part == ExpertsBackwardPart::DataLateRows;
  const bool data = a.part != ExpertsBackwardPart::WeightGradients;
  const bool weights = a.part == ExpertsBackwardPart::All || a.part == ExpertsBackwardPart::WeightGradients;
  detail::require_arg(a.part >= ExpertsBackwardPart::All && a.part <= ExpertsBackwardPart::DataLateRows, fn, "part",
                      "must be All, DataGradients, WeightGradients, DataEarlyRows or DataLateRows");
  if (a.dout_early) detail::require_row_aligned(fn, {{"dout_early", a.dout_early}});
  detail::require_arg(!data_part || (a.early_tokens >= 0 && a.early_tokens <= p.T), fn, "early_tokens",
                      "must be in [0, T = " + std::to_string(p.T) + "] with DataEarlyRows / DataLateRows; got " +
                          std::to_string(a.early_tokens));
  detail::require_arg(a.weights_max_ctas >= 0, fn, "weights_max_ctas",
                      "must be >= 0 (0: one CTA per SM); got " + std::to_string(a.weights_max_ctas));
  detail::require_given(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  if (p.precision == Precision::BF16)  // (with FP8 the copies in fp8_weights stand for them)
    detail::require_given(fn, {{"w1", a.w1}, {"w2", a.w2}}, "precision is BF16");
  if (weights) detail::require_given(fn, {{"dw1", a.dw1}, {"dw2", a.dw2}}, "the weight gradients are computed");
  // x, dout and dx have T rows, the list and d_scores R: empty (possibly null) when 0.
  if (p.T > 0) detail::require_given(fn, {{"x", a.x}, {"dout", a.dout}}, "T > 0");
  if (p.T > 0 && data) detail::require_given(fn, {{"dx", a.dx}}, "T > 0 and the data gradients are computed");
  if (p.R > 0) detail::require_given(fn, {{"pair_token", a.pair_token}, {"pair_expert", a.pair_expert}}, "R > 0");
  if (p.R > 0 && data)
    detail::require_given(fn, {{"d_scores", a.d_scores}}, "R > 0 and the data gradients are computed");
  detail::require_given_exactly_when(p.has_bias, "has_bias", fn, {{"b1", a.b1}, {"b2", a.b2}});
  if (weights) detail::require_given_exactly_when(p.has_bias, "has_bias", fn, {{"db1", a.db1}, {"db2", a.db2}});
  detail::require_weight_grad_dtype(a.weight_grad_dtype, fn);
  detail::require_block_aligned(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  detail::require_row_aligned(fn,
                              {{"x", a.x}, {"w1", a.w1}, {"w2", a.w2}, {"dout", a.dout}, {"dx", a.dx}, {"b2", a.b2}});
  detail::require_fp8_weights(p.precision, a.fp8_weights, a.part == ExpertsBackwardPart::All, fn);
  const detail::ExpertsShape shape = detail::experts_shape(p);
  if (p.T == 0 || p.R == 0) {  // no rows: every gradient is zero (d_scores is empty)
    if (weights) detail::zero_expert_gradients(shape, a.dw1, a.db1, a.dw2, a.db2, a.weight_grad_dtype, fn, stream);
    if (p.T > 0 && data && a.part != ExpertsBackwardPart::DataEarlyRows)  // a split call: in its last part
      check_cuda(cudaMemsetAsync(a.dx, 0, static_cast<size_t>(p.T * p.d) * 2, stream), "experts_backward: zero dx");
    return;
  }
  const detail::ExpertsLayout L(valid);
  const void* s = a.saved;
  detail::ExpertsBackwardRun r;
  r.shape = shape;
  r.list.expert = a.pair_expert;
  r.list.token = a.pair_token;
  r.list.scores = at<float>(s, L.scores);
  r.list.pairs = p.R;
  r.x = a.x, r.w1 = a.w1, r.w2 = a.w2, r.b2 = a.b2, r.dout = a.dout;
  r.h = at<void>(s, L.h);
  r.expert_offsets = at<int32_t>(s, L.expert_offsets);
  r.row_pair = at<int32_t>(s, L.row_pair);
  r.pair_row = at<int32_t>(s, L.pair_row);
  r.token_offsets = at<int32_t>(s, L.token_offsets);
  r.scratch = L.bwd;
  r.workspace = a.workspace;
  r.d_scores = a.d_scores;
  r.dx = a.dx, r.dw1 = a.dw1, r.db1 = a.db1, r.dw2 = a.dw2, r.db2 = a.db2;
  r.grad_dtype = a.weight_grad_dtype;
  r.part = a.part;
  r.weights_max_ctas = a.weights_max_ctas;
  r.early_tokens = a.early_tokens;
  r.dout_early = a.part == ExpertsBackwardPart::DataEarlyRows ? a.dout_early : nullptr;
  r.fp8 = a.fp8_weights;
  detail::experts_backward_run(r, stream);
}

}  // namespace machmoe
