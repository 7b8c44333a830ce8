// The expert part of the forward on the GPU (host/layer/experts_internal.hpp), and experts_forward: the
// experts on a general routing list given by the caller (no router, no aux loss). On the caller's
// stream, no host synchronisation:
//   routing metadata of the list -> up-projection (gathered rows, GLU/activation epilogue: H saved,
//   A scratch) -> down-projection (Y scratch) -> aggregation with scores,
// or that in three parts split at the early tokens (ExpertsForwardPart), each GEMM then over one
// row range per expert (host/layer/early_rows.hpp).
// layer_forward (layer.cu) runs the same code on the list its router made.
#include <cstdint>
#include <string>

#include "host/common/check.hpp"
#include "host/layer/call_rules.hpp"
#include "host/layer/early_rows.hpp"
#include "host/layer/experts_internal.hpp"
#include "host/layer/layer_layout.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::at;
using detail::check_cuda;

namespace detail {

namespace {
RoutingMetadataOutputs metadata_of(const ExpertsForwardRun& r) {
  RoutingMetadataOutputs md = r.md;
  md.row_token = at<int32_t>(r.workspace, r.scratch.row_token);
  return md;
}
}  // namespace

void experts_forward_run(const ExpertsForwardRun& r, cudaStream_t stream) {
  experts_forward_metadata(r, stream);
  experts_forward_gemms(r, stream);
}

void experts_forward_metadata(const ExpertsForwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const PairList& l = r.list;
  routing_metadata(l.expert, l.token, l.pairs, l.K, s.T, s.E, metadata_of(r), at<void>(r.workspace, r.scratch.metadata),
                   routing_metadata_workspace_bytes(s.T, s.E), stream);
}

namespace {

// H [rows, n1] = x[row_token] · W1_eᵀ (+ b1_e); epilogue A [rows, n] = act(H); over the rows of
// `part` of each expert.
void up_projection(const ExpertsForwardRun& r, RowPart part, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  void* w = r.workspace;
  const RoutingMetadataOutputs md = metadata_of(r);
  const ExpertRowRange rows = expert_rows(part, md.expert_offsets, at<int32_t>(w, r.scratch.row_split));
  GroupedGemmArgs up;
  const bool own_rows = part == RowPart::Early && r.x_early && r.early_tokens > 0;  // the early rows apart
  up.a = own_rows ? r.x_early : r.x;
  up.lda = s.d;
  up.a_rows = own_rows ? r.early_tokens : s.T;
  up.gather = md.row_token;
  up.expert_offsets = rows.begins;
  up.expert_row_ends = rows.ends;
  up.E = s.E;
  up.N = s.n1;
  up.K = s.d;
  up.w = r.w1;
  up.bias = r.b1;
  up.c = r.h;
  up.ldc = s.n1;
  up.c2 = at<void>(w, r.scratch.a);
  up.ldc2 = s.n;
  up.epilogue = is_glu(s.activation) ? GemmEpilogue::GLU : GemmEpilogue::Activation;
  up.activation = s.activation;
  up.glu_clamp = s.glu_clamp;
  up.layout = s.layout;
  up.tile_offsets = at<int32_t>(w, r.scratch.tile_offsets);
  up.max_ctas = r.max_ctas;
  grouped_gemm(up, stream);
}

// Y [rows, d] = A · W2_eᵀ (+ b2_e), contiguous rows, over the rows of `part` of each expert.
void down_projection(const ExpertsForwardRun& r, RowPart part, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  void* w = r.workspace;
  const RoutingMetadataOutputs md = metadata_of(r);
  const ExpertRowRange rows = expert_rows(part, md.expert_offsets, at<int32_t>(w, r.scratch.row_split));
  GroupedGemmArgs down;
  down.a = at<void>(w, r.scratch.a);
  down.lda = s.n;
  down.a_rows = r.list.pairs;
  down.expert_offsets = rows.begins;
  down.expert_row_ends = rows.ends;
  down.E = s.E;
  down.N = s.d;
  down.K = s.n;
  down.w = r.w2;
  down.bias = r.b2;
  down.c = at<void>(w, r.scratch.y);
  down.ldc = s.d;
  down.epilogue = GemmEpilogue::Store;
  down.tile_offsets = at<int32_t>(w, r.scratch.tile_offsets);  // stream order: the up-projection is done with it
  down.max_ctas = r.max_ctas;
  grouped_gemm(down, stream);
}

// out [t0, t1) rows = Σ_{pairs of t, in pair order} score · Y[pair_row] (fp32 accumulation).
void aggregate_tokens(const ExpertsForwardRun& r, int64_t t0, int64_t t1, cudaStream_t stream) {
  if (t1 <= t0) return;
  const ExpertsShape& s = r.shape;
  const RoutingMetadataOutputs md = metadata_of(r);
  aggregate(at<void>(r.workspace, r.scratch.y), DType::BF16, md.pair_row, md.token_offsets + t0, r.list.scores,
            t1 - t0, s.d, static_cast<char*>(r.out) + t0 * s.d * 2, DType::BF16, stream);
}

}  // namespace

void experts_forward_gemms(const ExpertsForwardRun& r, cudaStream_t stream) {
  if (r.shape.precision == Precision::FP8) {  // whole calls only (the entry points refuse parts)
    experts_forward_gemms_fp8(r, stream);
    return;
  }
  up_projection(r, RowPart::All, stream);
  down_projection(r, RowPart::All, stream);
  aggregate_tokens(r, 0, r.shape.T, stream);
}

void experts_forward_part(const ExpertsForwardRun& r, ExpertsForwardPart part, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const int64_t early_tokens = r.early_tokens;
  switch (part) {
    case ExpertsForwardPart::All: experts_forward_run(r, stream); return;
    case ExpertsForwardPart::EarlyRows: {
      experts_forward_metadata(r, stream);
      const RoutingMetadataOutputs md = metadata_of(r);
      launch_expert_row_split(md.expert_offsets, md.row_token, s.E, early_tokens,
                              at<int32_t>(r.workspace, r.scratch.row_split), stream);
      up_projection(r, RowPart::Early, stream);
      return;
    }
    case ExpertsForwardPart::LateRows:
      up_projection(r, RowPart::Late, stream);
      down_projection(r, RowPart::Late, stream);
      aggregate_tokens(r, early_tokens, s.T, stream);
      return;
    case ExpertsForwardPart::EarlyOut:
      down_projection(r, RowPart::Early, stream);
      aggregate_tokens(r, 0, early_tokens, stream);
      return;
  }
}

}  // namespace detail

void experts_forward(const ValidExpertsProblem& valid, const ExpertsForwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "experts_forward";
  const ExpertsProblem& p = *valid;
  detail::require_gpu_problem(valid, fn);
  detail::require_given(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  if (p.precision == Precision::BF16)  // (with FP8 the copies in fp8_weights stand for them)
    detail::require_given(fn, {{"w1", a.w1}, {"w2", a.w2}}, "precision is BF16");
  // x and out have T rows, the list R: empty (and so possibly null, as an empty framework tensor is) when 0.
  if (p.T > 0) detail::require_given(fn, {{"x", a.x}, {"out", a.out}}, "T > 0");
  if (p.R > 0)
    detail::require_given(fn, {{"scores", a.scores}, {"pair_token", a.pair_token}, {"pair_expert", a.pair_expert}},
                          "R > 0");
  detail::require_given_exactly_when(p.has_bias, "has_bias", fn, {{"b1", a.b1}, {"b2", a.b2}});
  detail::require_block_aligned(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  detail::require_row_aligned(fn, {{"x", a.x}, {"w1", a.w1}, {"w2", a.w2}, {"out", a.out}, {"b2", a.b2}});
  if (a.x_early) detail::require_row_aligned(fn, {{"x_early", a.x_early}});
  detail::require_arg(a.max_ctas >= 0, fn, "max_ctas", "must be >= 0 (0: one CTA per SM); got " + std::to_string(a.max_ctas));
  detail::require_arg(a.part >= ExpertsForwardPart::All && a.part <= ExpertsForwardPart::EarlyOut, fn, "part",
                      "must be All, EarlyRows, LateRows or EarlyOut");
  detail::require_arg(a.part == ExpertsForwardPart::All || (a.early_tokens >= 0 && a.early_tokens <= p.T), fn,
                      "early_tokens", "must be in [0, T = " + std::to_string(p.T) + "] for a part of a split call; got " +
                          std::to_string(a.early_tokens));
  detail::require_fp8_weights(p.precision, a.fp8_weights, a.part == ExpertsForwardPart::All, fn);
  const detail::ExpertsLayout L(valid);
  if (p.T == 0 || p.R == 0) {  // no rows: out = 0, no repeat; the GEMMs need at least one row
    // (a split call writes all of it in its first part, nothing in the others)
    if (a.part != ExpertsForwardPart::All && a.part != ExpertsForwardPart::EarlyRows) return;
    if (a.duplicate_flag)
      check_cuda(cudaMemsetAsync(a.duplicate_flag, 0, sizeof(int32_t), stream), "experts_forward: memset flag");
    if (p.T > 0)
      check_cuda(cudaMemsetAsync(a.out, 0, static_cast<size_t>(p.T * p.d) * 2, stream), "experts_forward: zero out");
    return;
  }
  void* s = a.saved;
  // The backward reads the scores from `saved` (the caller keeps only the list's indices).
  float* scores = at<float>(s, L.scores);
  if (a.part == ExpertsForwardPart::All || a.part == ExpertsForwardPart::EarlyRows)
    check_cuda(cudaMemcpyAsync(scores, a.scores, static_cast<size_t>(p.R) * sizeof(float), cudaMemcpyDeviceToDevice,
                               stream),
               "experts_forward: copy scores");
  detail::ExpertsForwardRun r;
  r.shape = detail::experts_shape(p);
  r.list.expert = a.pair_expert;
  r.list.token = a.pair_token;
  r.list.scores = scores;
  r.list.pairs = p.R;
  r.x = a.x, r.w1 = a.w1, r.b1 = a.b1, r.w2 = a.w2, r.b2 = a.b2;
  r.out = a.out;
  r.h = at<void>(s, L.h);
  r.md.expert_offsets = at<int32_t>(s, L.expert_offsets);
  r.md.row_pair = at<int32_t>(s, L.row_pair);
  r.md.pair_row = at<int32_t>(s, L.pair_row);
  r.md.token_offsets = at<int32_t>(s, L.token_offsets);
  r.md.duplicate_flag = a.duplicate_flag;
  r.scratch = L.fwd;
  r.workspace = a.workspace;
  r.max_ctas = a.max_ctas;
  r.x_early = a.part == ExpertsForwardPart::EarlyRows ? a.x_early : nullptr;
  r.early_tokens = a.early_tokens;
  r.fp8 = a.fp8_weights;
  detail::experts_forward_part(r, a.part, stream);
}

}  // namespace machmoe
