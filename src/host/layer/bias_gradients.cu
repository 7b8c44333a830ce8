// The expert biases' parts of the backward, shared by both precisions (kernels/layer/
// layer_backward.cuh): db1 / db2 as per-expert sums over chunks of the expert's rows (one fp32
// partial per chunk and column, the chunks then added in order: deterministic, no atomics), and
// the d scores' ⟨dout_t, b2_e⟩ term where another kernel wrote the rest (precision FP8).
#include "host/common/check.hpp"
#include "host/layer/experts_internal.hpp"
#include "kernels/layer/layer_backward.cuh"
#include "machmoe/fp8.hpp"

namespace machmoe::detail {
namespace {

constexpr int kThreads = kBackwardThreads;

kernels::BiasGradParams bias_params(const BiasChunks& c, int64_t E, int64_t cols, void* out) {
  kernels::BiasGradParams bp{};
  bp.chunk_prefix = c.prefix;
  bp.partials = c.partials;
  bp.out = out;
  bp.E = static_cast<int>(E);
  bp.cols = static_cast<int>(cols);
  return bp;
}

unsigned column_blocks(int64_t cols) { return static_cast<unsigned>(ceil_div(cols, kThreads)); }

template <int kChunk>
void launch_partials(const BiasChunks& c, const kernels::BiasGradParams& bp, cudaStream_t stream) {
  kernels::bwd_bias_partial<kThreads, kChunk>
      <<<dim3(static_cast<unsigned>(c.slots), column_blocks(bp.cols)), kThreads, 0, stream>>>(bp);
}

}  // namespace

void bias_gradient_finalize(const BiasChunks& c, int64_t E, int64_t cols, void* out, DType out_dtype,
                            cudaStream_t stream) {
  const kernels::BiasGradParams bp = bias_params(c, E, cols, out);
  const dim3 grid(static_cast<unsigned>(E), column_blocks(cols));
  if (out_dtype == DType::FP32) kernels::bwd_bias_finalize<kThreads, float><<<grid, kThreads, 0, stream>>>(bp);
  else kernels::bwd_bias_finalize<kThreads, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(bp);
  check_launch("experts backward: bias gradient");
}

void bias_gradient(const BiasChunks& c, int64_t E, const void* src, const int32_t* gather, const float* pair_scores,
                   const int32_t* row_pair, const int32_t* expert_offsets, int64_t cols, void* out, DType out_dtype,
                   cudaStream_t stream) {
  kernels::BiasGradParams bp = bias_params(c, E, cols, out);
  bp.src = static_cast<const __nv_bfloat16*>(src);
  bp.gather = gather;
  bp.pair_scores = pair_scores;
  bp.row_pair = row_pair;
  bp.expert_offsets = expert_offsets;
  if (c.slots > 0) {
    if (c.chunk_rows == kBiasChunkRowsFp8) launch_partials<kBiasChunkRowsFp8>(c, bp, stream);
    else launch_partials<kBiasChunkRowsBf16>(c, bp, stream);
    check_launch("experts backward: bias gradient partial sums");
  }
  bias_gradient_finalize(c, E, cols, out, out_dtype, stream);
}

void add_output_bias_scores(const ExpertsBackwardRun& r, cudaStream_t stream) {
  const int64_t pairs = r.list.pairs;
  if (pairs == 0) return;
  kernels::PairScoreParams ps{};
  ps.ds_partial = nullptr;  // d_scores holds Σ dA'·A already
  ps.pair_row = r.pair_row;
  ps.dout = static_cast<const __nv_bfloat16*>(r.dout);
  ps.b2 = static_cast<const __nv_bfloat16*>(r.b2);
  ps.pair_expert = r.list.expert;
  ps.list_token = r.list.token;
  ps.d_score = r.d_scores;
  ps.pairs = pairs;
  ps.K = static_cast<int>(r.list.K);
  ps.d = static_cast<int>(r.shape.d);
  kernels::bwd_pair_scores_bias<kThreads><<<blocks_for(pairs, kBackwardWarpsPerBlock), kThreads, 0, stream>>>(ps);
  check_launch("experts backward: d scores' output-bias term");
}

}  // namespace machmoe::detail
