// The expert part of the forward on the GPU (host/layer/experts_internal.hpp), and experts_forward: the
// experts on a general routing list given by the caller (no router, no aux loss). On the caller's
// stream, no host synchronisation:
//   routing metadata of the list -> up-projection (gathered rows, GLU/activation epilogue: H saved,
//   A scratch) -> down-projection (Y scratch) -> aggregation with scores.
// layer_forward (layer.cu) runs the same code on the list its router made.
#include <cstdint>
#include <string>

#include "host/common/check.hpp"
#include "host/layer/call_rules.hpp"
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

void experts_forward_gemms(const ExpertsForwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const PairList& l = r.list;
  void* w = r.workspace;
  const RoutingMetadataOutputs md = metadata_of(r);

  // H [rows, n1] = x[row_token] · W1_eᵀ (+ b1_e); epilogue A [rows, n] = act(H).
  GroupedGemmArgs up;
  up.a = r.x;
  up.lda = s.d;
  up.a_rows = s.T;
  up.gather = md.row_token;
  up.expert_offsets = md.expert_offsets;
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
  grouped_gemm(up, stream);

  // Y [rows, d] = A · W2_eᵀ (+ b2_e), contiguous rows.
  GroupedGemmArgs down;
  down.a = up.c2;
  down.lda = s.n;
  down.a_rows = l.pairs;
  down.expert_offsets = md.expert_offsets;
  down.E = s.E;
  down.N = s.d;
  down.K = s.n;
  down.w = r.w2;
  down.bias = r.b2;
  down.c = at<void>(w, r.scratch.y);
  down.ldc = s.d;
  down.epilogue = GemmEpilogue::Store;
  down.tile_offsets = up.tile_offsets;  // stream order: the up-projection is done with it
  grouped_gemm(down, stream);

  // out [T, d] = Σ_{pairs of t, in pair order} score · Y[pair_row] (fp32 accumulation).
  aggregate(down.c, DType::BF16, md.pair_row, md.token_offsets, l.scores, s.T, s.d, r.out, DType::BF16, stream);
}

}  // namespace detail

void experts_forward(const ValidExpertsProblem& valid, const ExpertsForwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "experts_forward";
  const ExpertsProblem& p = *valid;
  detail::require_gpu_problem(valid, fn);
  detail::require_given(fn, {{"w1", a.w1}, {"w2", a.w2}, {"saved", a.saved}, {"workspace", a.workspace}});
  // x and out have T rows, the list R: empty (and so possibly null, as an empty framework tensor is) when 0.
  if (p.T > 0) detail::require_given(fn, {{"x", a.x}, {"out", a.out}}, "T > 0");
  if (p.R > 0)
    detail::require_given(fn, {{"scores", a.scores}, {"pair_token", a.pair_token}, {"pair_expert", a.pair_expert}},
                          "R > 0");
  detail::require_given_exactly_when(p.has_bias, "has_bias", fn, {{"b1", a.b1}, {"b2", a.b2}});
  detail::require_block_aligned(fn, {{"saved", a.saved}, {"workspace", a.workspace}});
  detail::require_row_aligned(fn, {{"x", a.x}, {"w1", a.w1}, {"w2", a.w2}, {"out", a.out}, {"b2", a.b2}});
  const detail::ExpertsLayout L(valid);
  if (p.T == 0 || p.R == 0) {  // no rows: out = 0, no repeat; the GEMMs need at least one row
    if (a.duplicate_flag)
      check_cuda(cudaMemsetAsync(a.duplicate_flag, 0, sizeof(int32_t), stream), "experts_forward: memset flag");
    if (p.T > 0)
      check_cuda(cudaMemsetAsync(a.out, 0, static_cast<size_t>(p.T * p.d) * 2, stream), "experts_forward: zero out");
    return;
  }
  void* s = a.saved;
  // The backward reads the scores from `saved` (the caller keeps only the list's indices).
  float* scores = at<float>(s, L.scores);
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
  detail::experts_forward_run(r, stream);
}

}  // namespace machmoe
