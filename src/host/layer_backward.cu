// The layer backward on the GPU (docs/LAYER.md "Backward", docs/BACKWARD.md), end to end on the
// caller's stream, no host synchronisation, no float atomics (bitwise deterministic):
//   rebuild row_token / token_offsets -> dH kernel (dA' = dout·W2 gathered; epilogue: dH, A' = s·A,
//   dS partials) -> d scores (+ ⟨dout, b2⟩) -> router backward (top-K or token rounding) + aux
//   backward -> d_logits -> dW2, dW1 (varlen-K GEMMs) -> db2, db1 -> dX~ = dH·W1 -> dx (aggregate)
//   -> dWr = d_logitsᵀ·x and dx += d_logits·Wr (cuBLAS).
// Reads only x, the weights and what layer_forward left in `saved`; scratch in the backward
// workspace (host/layer_layout.hpp).
#include <algorithm>
#include <string>

#include "host/check.hpp"
#include "host/cublas_internal.hpp"
#include "host/layer_layout.hpp"
#include "kernels/aux_loss.cuh"
#include "kernels/layer_backward.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::at;
using detail::ceil_div;
using detail::check_cublas;
using detail::check_cuda;
using detail::check_launch;
using detail::LayerLayout;
using detail::require_arg;

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// Blocks covering `work` items at `per_block` each, at least one (grid.x may reach 2^31 - 1).
unsigned blocks_for(int64_t work, int64_t per_block) {
  return static_cast<unsigned>(std::max<int64_t>(ceil_div(work, per_block), 1));
}

cudaDataType_t cuda_type(DType t) { return t == DType::FP32 ? CUDA_R_32F : CUDA_R_16BF; }

void check_args(const LayerProblem& p, const LayerBackwardArgs& a) {
  constexpr const char* fn = "layer_backward";
  detail::require_gpu_layer(p, fn);
  require_arg(a.router_weight && a.w1 && a.w2 && a.saved && a.d_router_weight && a.dw1 && a.dw2 && a.workspace, fn,
              "router_weight/w1/w2/saved/d_router_weight/dw1/dw2/workspace", "must not be null");
  // x, dout and dx have T rows: empty (and so possibly null, as an empty framework tensor is) when T = 0.
  require_arg(p.T == 0 || (a.x && a.dout && a.dx), fn, "x/dout/dx", "must not be null when T > 0");
  const bool b = p.has_bias;
  require_arg((a.b1 != nullptr) == b && (a.b2 != nullptr) == b && (a.db1 != nullptr) == b && (a.db2 != nullptr) == b,
              fn, "b1/b2/db1/db2", "must all be given exactly when has_bias");
  require_arg(a.weight_grad_dtype == DType::BF16 || a.weight_grad_dtype == DType::FP32, fn, "weight_grad_dtype",
              std::string("must be bfloat16 or float32, got ") + to_string(a.weight_grad_dtype));
  require_arg((reinterpret_cast<uintptr_t>(a.saved) & 255) == 0 && (reinterpret_cast<uintptr_t>(a.workspace) & 255) == 0,
              fn, "saved/workspace", "must be 256-byte aligned");
  const void* rows[] = {a.x, a.router_weight, a.w1, a.w2, a.dout, a.dx, a.b2};
  for (const void* ptr : rows)
    require_arg(ptr == nullptr || detail::aligned16(ptr), fn, "x/router_weight/w1/w2/dout/dx/b2",
                "must be 16-byte aligned (16-byte row vectors)");
}

// T == 0: no token, so every gradient is zero (dx is empty).
void zero_gradients(const LayerProblem& p, const LayerBackwardArgs& a, int64_t n1, cudaStream_t stream) {
  const size_t es = static_cast<size_t>(dtype_size(a.weight_grad_dtype));
  const size_t E = static_cast<size_t>(p.E), d = static_cast<size_t>(p.d), n = static_cast<size_t>(p.n);
  const size_t N1 = static_cast<size_t>(n1);
  check_cuda(cudaMemsetAsync(a.d_router_weight, 0, E * d * es, stream), "layer_backward: zero d_router_weight");
  check_cuda(cudaMemsetAsync(a.dw1, 0, E * N1 * d * es, stream), "layer_backward: zero dw1");
  check_cuda(cudaMemsetAsync(a.dw2, 0, E * d * n * es, stream), "layer_backward: zero dw2");
  if (p.has_bias) {
    check_cuda(cudaMemsetAsync(a.db1, 0, E * N1 * es, stream), "layer_backward: zero db1");
    check_cuda(cudaMemsetAsync(a.db2, 0, E * d * es, stream), "layer_backward: zero db2");
  }
}

// db[e] [cols] = Σ_{rows r of e} scale_r · src[row(r)] (fixed order; kernels/layer_backward.cuh).
void bias_gradient(const LayerLayout& L, const LayerProblem& p, void* ws, const __nv_bfloat16* src,
                   const int32_t* gather, const float* pair_scores, const int32_t* row_pair,
                   const int32_t* expert_offsets, int64_t cols, void* out, DType out_dtype, cudaStream_t stream) {
  constexpr int kChunk = LayerLayout::kBiasChunkRows;
  kernels::BiasGradParams bp{};
  bp.src = src;
  bp.gather = gather;
  bp.pair_scores = pair_scores;
  bp.row_pair = row_pair;
  bp.expert_offsets = expert_offsets;
  bp.chunk_prefix = at<int32_t>(ws, L.bias_chunk_prefix);
  bp.partials = at<float>(ws, L.bias_partials);
  bp.out = out;
  bp.E = static_cast<int>(p.E);
  bp.cols = static_cast<int>(cols);
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(cols, kThreads));
  kernels::bwd_bias_partial<kThreads, kChunk>
      <<<dim3(static_cast<unsigned>(L.bias_chunks), col_blocks), kThreads, 0, stream>>>(bp);
  check_launch("layer_backward: bias gradient partial sums");
  const dim3 grid(static_cast<unsigned>(p.E), col_blocks);
  if (out_dtype == DType::FP32) kernels::bwd_bias_finalize<kThreads, float><<<grid, kThreads, 0, stream>>>(bp);
  else kernels::bwd_bias_finalize<kThreads, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(bp);
  check_launch("layer_backward: bias gradient");
}

}  // namespace

void layer_backward(const LayerProblem& p, const LayerBackwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "layer_backward";
  check_args(p, a);
  const LayerLayout L(p);
  const int64_t n1 = L.n1, R = L.R;
  if (p.T == 0) {
    zero_gradients(p, a, n1, stream);
    return;
  }
  const void* s = a.saved;
  void* w = a.workspace;
  const bool rounded = p.rounding != TokenRounding::None;
  const float* logits = at<float>(s, L.logits);
  const float* scores = at<float>(s, L.scores);    // [pairs] top-K scores or the rounded list's
  const int32_t* experts = at<int32_t>(s, L.experts);
  const int32_t* expert_offsets = at<int32_t>(s, L.expert_offsets);
  const int32_t* row_pair = at<int32_t>(s, L.row_pair);
  const int32_t* pair_row = at<int32_t>(s, L.pair_row);
  const int32_t* list_token = rounded ? at<int32_t>(s, L.list_token) : nullptr;
  int32_t* row_token = at<int32_t>(w, L.b_row_token);
  // Pairs of token t: [t·K, (t+1)·K) for top-K (rebuilt here), the rounded list's own offsets else.
  const int32_t* token_offsets = rounded ? at<int32_t>(s, L.list_token_offsets) : at<int32_t>(w, L.b_token_offsets);
  auto* dh = at<__nv_bfloat16>(w, L.dh);
  auto* a_prime = at<__nv_bfloat16>(w, L.a_prime);
  float* ds_partial = at<float>(w, L.ds_partial);
  float* d_scores = at<float>(w, L.d_scores);
  float* d_logits = at<float>(w, L.d_logits);
  auto* d_logits_bf16 = at<__nv_bfloat16>(w, L.d_logits_bf16);
  int32_t* tile_offsets = at<int32_t>(w, L.b_tile_offsets);

  // 1. The gather index row -> token [R] (and t·K offsets for top-K): not saved (SPEC minimum).
  kernels::bwd_rebuild_index<kThreads><<<blocks_for(std::max(R, p.T + 1), kThreads), kThreads, 0, stream>>>(
      row_pair, list_token, static_cast<int>(p.K), expert_offsets, static_cast<int>(p.E), R, p.T, row_token,
      rounded ? nullptr : at<int32_t>(w, L.b_token_offsets));
  check_launch("layer_backward: rebuild row_token");

  // 2. dH kernel: dA' [R, n] = dout[row_token] · W2_e (W2 [E, d, n] read as [E, K = d, N = n]);
  //    epilogue: dH [R, n1] = dAct(s·dA', H), A' [R, n] = s·act(H), ds_partial [R, tiles].
  GroupedGemmArgs g;
  g.a = a.dout;
  g.lda = p.d;
  g.a_rows = p.T;
  g.gather = row_token;
  g.expert_offsets = expert_offsets;
  g.E = p.E;
  g.N = p.n;
  g.K = p.d;
  g.w = a.w2;
  g.w_n_major = true;
  g.c = dh;
  g.ldc = n1;
  g.c2 = a_prime;
  g.ldc2 = p.n;
  g.epilogue = GemmEpilogue::ActivationBackward;
  g.activation = p.activation;
  g.layout = p.layout;
  g.h = at<__nv_bfloat16>(s, L.h);
  g.ldh = n1;
  g.row_scores = scores;
  g.row_pair = row_pair;
  g.ds_partial = ds_partial;
  g.tile_offsets = tile_offsets;
  grouped_gemm(g, stream);

  // 3. d scores [pairs] in pair order: Σ_j ds_partial[pair_row[p], j] (+ ⟨dout_t, b2_e⟩).
  kernels::PairScoreParams ps{};
  ps.ds_partial = ds_partial;
  ps.pair_row = pair_row;
  ps.dout = static_cast<const __nv_bfloat16*>(a.dout);
  ps.b2 = static_cast<const __nv_bfloat16*>(a.b2);
  ps.pair_expert = experts;
  ps.list_token = list_token;
  ps.d_score = d_scores;
  ps.pairs = R;
  ps.tiles = static_cast<int>(L.ds_tiles);
  ps.K = static_cast<int>(p.K);
  ps.d = static_cast<int>(p.d);
  if (p.has_bias)
    kernels::bwd_pair_scores_bias<kThreads><<<blocks_for(R, kWarpsPerBlock), kThreads, 0, stream>>>(ps);
  else
    kernels::bwd_pair_scores<kThreads><<<blocks_for(R, kThreads), kThreads, 0, stream>>>(ps);
  check_launch("layer_backward: d scores");

  // 4. Router backward: d scores -> d_logits [T, E] fp32 (every element written).
  if (!rounded) {
    topk_router_backward(logits, scores, experts, d_scores, p.T, p.E, p.K, p.routing, p.renormalize, d_logits,
                         stream);
  } else {
    token_rounding_backward(logits, at<float>(s, L.topk_scores), at<int32_t>(s, L.topk_experts), token_offsets,
                            experts, at<uint8_t>(s, L.list_padded), d_scores, p.T, p.E, p.K, d_logits, stream);
  }
  // 5. Aux loss: d_logits += d_aux · ∂aux/∂logits. A host d_aux of 0 (and no device scalar) adds
  //    nothing, so the kernels are skipped.
  if (a.d_aux_device != nullptr || a.d_aux != 0.f) {
    const int blocks = static_cast<int>(ceil_div(p.T, LayerLayout::kAuxTokensPerBlock));
    float* partials = at<float>(w, L.b_aux_partials);
    float* grad = at<float>(w, L.aux_grad);
    kernels::aux_colsum_partial<LayerLayout::kAuxTokensPerBlock><<<blocks, kThreads, 0, stream>>>(
        logits, p.T, static_cast<int>(p.E), partials);
    check_launch("layer_backward: aux partial sums");
    kernels::bwd_aux_coefficients<1024><<<1, 1024, 0, stream>>>(partials, blocks, static_cast<int>(p.E),
                                                                 expert_offsets, a.d_aux, a.d_aux_device, grad);
    check_launch("layer_backward: aux coefficients");
    kernels::bwd_aux_apply<kThreads><<<blocks_for(p.T, kWarpsPerBlock), kThreads, 0, stream>>>(
        logits, p.T, static_cast<int>(p.E), grad, d_logits);
    check_launch("layer_backward: aux backward");
  }
  // 6. bf16 copy of d_logits: the cuBLAS operand (fp32 accumulation there).
  kernels::bwd_to_bf16<kThreads><<<blocks_for(p.T * p.E, kThreads * 4), kThreads, 0, stream>>>(
      d_logits, p.T * p.E, d_logits_bf16);
  check_launch("layer_backward: d_logits to bf16");

  // 7. dW2 [E, d, n] = Σ_r dout[row_token[r]]ᵀ ⊗ A'_r (varlen K over the expert's rows).
  GroupedWgradArgs w2g;
  w2g.a = a.dout;
  w2g.lda = p.d;
  w2g.a_rows = p.T;
  w2g.a_gather = row_token;
  w2g.b = a_prime;
  w2g.ldb = p.n;
  w2g.b_rows = R;
  w2g.expert_offsets = expert_offsets;
  w2g.E = p.E;
  w2g.M = p.d;
  w2g.N = p.n;
  w2g.c = a.dw2;
  w2g.c_dtype = a.weight_grad_dtype;
  w2g.transpose_c = false;
  grouped_gemm_wgrad(w2g, stream);

  // 8. dW1 [E, n1, d] = (Σ_r x[row_token[r]]ᵀ ⊗ dH_r)ᵀ: [E, M = d, N = n1] stored transposed.
  GroupedWgradArgs w1g;
  w1g.a = a.x;
  w1g.lda = p.d;
  w1g.a_rows = p.T;
  w1g.a_gather = row_token;
  w1g.b = dh;
  w1g.ldb = n1;
  w1g.b_rows = R;
  w1g.expert_offsets = expert_offsets;
  w1g.E = p.E;
  w1g.M = p.d;
  w1g.N = n1;
  w1g.c = a.dw1;
  w1g.c_dtype = a.weight_grad_dtype;
  w1g.transpose_c = true;
  grouped_gemm_wgrad(w1g, stream);

  // 9. Bias gradients: db2[e] = Σ_r s_r · dout[row_token[r]], db1[e] = Σ_r dH_r.
  if (p.has_bias) {
    kernels::bwd_bias_chunk_prefix<1024, LayerLayout::kBiasChunkRows><<<1, 1024, 0, stream>>>(
        expert_offsets, static_cast<int>(p.E), at<int32_t>(w, L.bias_chunk_prefix));
    check_launch("layer_backward: bias chunk offsets");
    bias_gradient(L, p, w, static_cast<const __nv_bfloat16*>(a.dout), row_token, scores, row_pair, expert_offsets,
                  p.d, a.db2, a.weight_grad_dtype, stream);
    bias_gradient(L, p, w, dh, nullptr, nullptr, nullptr, expert_offsets, n1, a.db1, a.weight_grad_dtype, stream);
  }

  // 10. dX~ [R, d] = dH · W1_e (W1 [E, n1, d] read as [E, K = n1, N = d]), contiguous rows.
  GroupedGemmArgs gx;
  gx.a = dh;
  gx.lda = n1;
  gx.a_rows = R;
  gx.expert_offsets = expert_offsets;
  gx.E = p.E;
  gx.N = p.d;
  gx.K = n1;
  gx.w = a.w1;
  gx.w_n_major = true;
  gx.c = at<__nv_bfloat16>(w, L.dx_rows);
  gx.ldc = p.d;
  gx.epilogue = GemmEpilogue::Store;
  gx.tile_offsets = tile_offsets;  // stream order: the dH kernel is done with it
  grouped_gemm(gx, stream);

  // 11. dx [T, d] = Σ_{pairs of t} dX~[pair_row] (no scores).
  aggregate(gx.c, DType::BF16, pair_row, token_offsets, nullptr, p.T, p.d, a.dx, DType::BF16, stream);

  // 12. Router GEMMs (cuBLAS, bf16 operands, fp32 accumulation), column-major views of row-major
  //     arrays: dWrᵀ [d, E] = xᵀ [d, T] · d_logits [T, E]; dxᵀ [d, T] += Wrᵀ [d, E] · d_logitsᵀ [E, T].
  cublasHandle_t h = detail::cublas_on(stream, at<void>(w, L.b_cublas), LayerLayout::kCublasWorkspace, fn);
  const float one = 1.f, zero = 0.f;
  const int T = static_cast<int>(p.T), E = static_cast<int>(p.E), d = static_cast<int>(p.d);
  check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, d, E, T, &one, a.x, CUDA_R_16BF, d, d_logits_bf16,
                            CUDA_R_16BF, E, &zero, a.d_router_weight, cuda_type(a.weight_grad_dtype), d,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "layer_backward: d_router_weight GEMM (cublasGemmEx)");
  check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, T, E, &one, a.router_weight, CUDA_R_16BF, d,
                            d_logits_bf16, CUDA_R_16BF, E, &one, a.dx, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "layer_backward: dx router GEMM (cublasGemmEx)");
}

}  // namespace machmoe
