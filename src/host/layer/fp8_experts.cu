// The expert part of a call with precision FP8 (E4M3, DeepSeek-V3's recipe; machmoe/
// reference_fp8_layer.hpp states the same in double), on the caller's stream, no host
// synchronisation, and the weights' FP8 copies (quantize_expert_weights_fp8, also here).
//   Forward: x quantised once 1x128 along d -> up-projection on the gathered rows (+ b1), its GLU
//   epilogue writing H's E4M3 copy (saved) and A's -> down-projection Y [R, d] bf16 (+ b2) -> out =
//   Σ score·Y.
//   Backward: dout quantised once -> dA' = dout[row_token]·W2 -> the SwiGLU backward (A recomputed
//   from the saved H, d scores, dH and A' = score·A) fused with their quantisation: dH's E4M3 rows
//   and the column operands of dH and A' (dH and A' never reach memory; with biases, db1's
//   partial sums too) -> with biases, d scores' ⟨dout, b2⟩, db1 and db2 -> the router's part
//   (layer calls) -> dW2 from the columns of dout and A' -> dX~ = dH·W1 -> dx -> dW1 from the
//   columns of x and dH. The column operands are cut per expert into 128-row chunks
//   (machmoe/fp8.hpp).
// The workspace regions: host/layer/layer_layout.hpp (ExpertsForwardScratch, Fp8BackwardScratch).
#include <string>

#include "host/common/check.hpp"
#include "host/layer/experts_internal.hpp"
#include "host/layer/layer_layout.hpp"
#include "host/quant/quant_internal.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/fp8_wgrad.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::at;
using detail::check_cuda;

namespace {

// An E4M3 operand [rows, cols] with its 1x128 scales [rows, ceil(cols/128)], codes first
// (detail::fp8_rows_bytes).
struct Fp8Rows {
  uint8_t* codes;
  float* scales;
};
Fp8Rows fp8_rows(void* base, size_t offset, int64_t rows, int64_t cols) {
  uint8_t* codes = at<uint8_t>(base, offset);
  return {codes, reinterpret_cast<float*>(codes + static_cast<size_t>(rows) * static_cast<size_t>(cols))};
}

// The same for a column operand of the weight gradients [max_chunks, cols, 128] and its scales.
struct Fp8Columns {
  uint8_t* codes;
  float* scales;
};

void quantize_rows(const void* x, int64_t T, int64_t d, const int32_t* gather, int64_t R, Fp8Rows out,
                   cudaStream_t stream) {
  QuantizeRowsArgs q;
  q.x = x, q.T = T, q.d = d, q.ld = d, q.gather = gather, q.R = R, q.q = out.codes, q.scales = out.scales;
  quantize_rows_fp8(q, stream);
}

// x [T, cols] bf16 (row r = x[gather[r]], or x[r] with T = R) in 128-row chunks of each expert;
// chunk_offsets already written (by the fused SwiGLU backward, step 2 of the backward).
void quantize_columns(const void* x, int64_t T, int64_t cols, const int32_t* gather, const detail::ExpertsBackwardRun& r,
                      int32_t* chunk_offsets, Fp8Columns out, cudaStream_t stream) {
  QuantizeColumnsArgs q;
  q.x = x, q.T = T, q.d = cols, q.ld = cols, q.gather = gather, q.R = r.list.pairs;
  q.expert_offsets = r.expert_offsets, q.E = r.shape.E, q.chunk_offsets = chunk_offsets;
  q.qt = out.codes, q.scales = out.scales;
  detail::quantize_columns_fp8_given_offsets(q, stream);
}

// C [R, N] bf16 = the FP8 grouped GEMM of a's rows (gathered: a [T, K]) with w [E, N, K].
GroupedGemmFp8Args fp8_gemm(Fp8Rows a, int64_t R, const int32_t* gather, int64_t T, const uint8_t* w_codes,
                            const float* w_scales, const int32_t* expert_offsets, int64_t E, int64_t N, int64_t K,
                            int32_t* tile_offsets, int max_ctas) {
  GroupedGemmFp8Args g;
  g.a_q = a.codes, g.a_scales = a.scales, g.R = R, g.gather = gather, g.T = T;
  g.w_q = w_codes, g.w_scales = w_scales, g.expert_offsets = expert_offsets;
  g.E = E, g.N = N, g.K = K;
  g.tile_offsets = tile_offsets;
  g.max_ctas = max_ctas;
  return g;
}

// dW [E, M, N] (transpose_c: [E, N, M]) = Σ over each expert's chunks of A's columnsᵀ·B's columns.
void wgrad(Fp8Columns a, int64_t M, Fp8Columns b, int64_t N, const int32_t* chunk_offsets, int64_t E,
           int64_t max_chunks, void* c, DType c_dtype, bool transpose_c, int max_ctas, cudaStream_t stream) {
  GroupedWgradFp8Args g;
  g.a_qt = a.codes, g.a_scales = a.scales, g.M = M;
  g.b_qt = b.codes, g.b_scales = b.scales, g.N = N;
  g.chunk_offsets = chunk_offsets, g.E = E, g.max_chunks = max_chunks;
  g.c = c, g.c_dtype = c_dtype, g.transpose_c = transpose_c, g.max_ctas = max_ctas;
  grouped_wgrad_fp8(g, stream);
}

}  // namespace

namespace detail {

void experts_forward_gemms_fp8(const ExpertsForwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const Fp8ExpertWeights& w = *r.fp8;
  void* ws = r.workspace;
  const int64_t R = r.list.pairs;
  const int32_t* row_token = at<int32_t>(ws, r.scratch.row_token);
  int32_t* tile_offsets = at<int32_t>(ws, r.scratch.tile_offsets);
  // 1. x [T, d] in E4M3 once (not gathered: the up-projection gathers the quantised rows).
  const Fp8Rows x = fp8_rows(ws, r.scratch.x_fp8, s.T, s.d);
  quantize_rows(r.x, s.T, s.d, nullptr, s.T, x, stream);
  // 2. H [R, n1] = x[row_token]·W1ᵀ (+ b1); the epilogue writes H's E4M3 copy (saved; in inference,
  //    with r.h null, into Y's region, which step 3 overwrites) and A = SwiGLU(H) from the fp32 H,
  //    in E4M3 [R, n].
  const Fp8Rows h = r.h ? fp8_rows(r.h, 0, R, s.n1) : fp8_rows(ws, r.scratch.y, R, s.n1);
  const Fp8Rows a = fp8_rows(ws, r.scratch.a, R, s.n);
  GroupedGemmFp8Args up = fp8_gemm(x, R, row_token, s.T, w.w1, w.w1_scales, r.md.expert_offsets, s.E, s.n1, s.d,
                                   tile_offsets, r.max_ctas);
  up.epilogue = Fp8GemmEpilogue::Glu;
  up.activation = s.activation;
  up.glu_clamp = s.glu_clamp;
  up.bias = r.b1;  // null without biases
  up.hq = h.codes, up.h_scales = h.scales, up.act_q = a.codes, up.act_scales = a.scales;
  grouped_gemm_fp8(up, stream);
  // 3. Y [R, d] bf16 = A·W2ᵀ (+ b2, added in fp32 before the rounding).
  void* y = at<void>(ws, r.scratch.y);
  GroupedGemmFp8Args down = fp8_gemm(a, R, nullptr, R, w.w2, w.w2_scales, r.md.expert_offsets, s.E, s.d, s.n,
                                     tile_offsets, r.max_ctas);
  down.c = y, down.ldc = s.d;
  down.bias = r.b2;
  grouped_gemm_fp8(down, stream);
  // 4. out [T, d] = Σ_{pairs of t} score · Y[pair_row] (fp32, rounded once).
  aggregate(y, DType::BF16, r.md.pair_row, r.md.token_offsets, r.list.scores, s.T, s.d, r.out, DType::BF16, stream);
}

void experts_backward_fp8(const ExpertsBackwardRun& r, cudaStream_t stream) {
  const ExpertsShape& s = r.shape;
  const Fp8ExpertWeights& w = *r.fp8;
  const Fp8BackwardScratch& F = r.scratch.fp8;
  void* ws = r.workspace;
  void* region = at<void>(ws, F.region);
  const int64_t R = r.list.pairs;
  int32_t* row_token = at<int32_t>(ws, r.scratch.row_token);
  int32_t* tile_offsets = at<int32_t>(ws, r.scratch.tile_offsets);
  int32_t* chunk_offsets = at<int32_t>(ws, F.chunk_offsets);
  auto* dx_rows = at<__nv_bfloat16>(region, F.dx_rows);  // [R, d], in the region's dX~ phase
  auto columns = [&](size_t codes, size_t scales) {
    return Fp8Columns{at<uint8_t>(region, codes), at<float>(region, scales)};
  };

  rebuild_row_token(r, stream);
  // A pair without a row (its expert or token out of range, or dropped by token rounding) adds
  // nothing and its score's gradient is 0; step 2 writes the pairs that have rows.
  check_cuda(cudaMemsetAsync(r.d_scores, 0, static_cast<size_t>(R) * sizeof(float), stream),
             "experts backward (FP8): zero d_scores");
  // 1. dA' [R, n] bf16 = dout[row_token]·W2 (dout in E4M3 once; W2's transposed copy [E, n, d]).
  const Fp8Rows dout = fp8_rows(region, F.dout_q, s.T, s.d);
  quantize_rows(r.dout, s.T, s.d, nullptr, s.T, dout, stream);
  auto* da = at<__nv_bfloat16>(region, F.da);
  GroupedGemmFp8Args g = fp8_gemm(dout, R, row_token, s.T, w.w2_t, w.w2_t_scales, r.expert_offsets, s.E, s.n, s.d,
                                  tile_offsets, 0);
  g.c = da, g.ldc = s.n;
  grouped_gemm_fp8(g, stream);
  // 2. The SwiGLU backward from the saved H, fused with the quantisation of its outputs: d scores;
  //    dH's E4M3 rows (the dX~ GEMM's operand) and columns (dW1's), A''s columns (dW2's), each
  //    expert's rows in 128-row chunks (chunk_offsets written here, read by the steps below).
  const Fp8Rows h = fp8_rows(const_cast<void*>(r.h), 0, R, s.n1);
  const Fp8Rows dh_q = fp8_rows(region, F.dh_q, R, s.n1);
  const Fp8Columns ap_cols = columns(F.ap_cols, F.ap_cols_scales);
  const Fp8Columns dh_cols = columns(F.dh_cols, F.dh_cols_scales);
  detail::SwigluBackwardColumnsFp8Args sw;
  sw.da = da, sw.hq = h.codes, sw.h_scales = h.scales, sw.scores = r.list.scores, sw.row_pair = r.row_pair;
  sw.R = R, sw.n = s.n, sw.expert_offsets = r.expert_offsets, sw.E = s.E, sw.chunk_offsets = chunk_offsets;
  sw.d_scores = r.d_scores, sw.dh_q = dh_q.codes, sw.dh_scales = dh_q.scales;
  sw.dh_qt = dh_cols.codes, sw.dh_col_scales = dh_cols.scales;
  sw.ap_qt = ap_cols.codes, sw.ap_col_scales = ap_cols.scales;
  sw.clamp = s.activation == Activation::ClampedSwiGLU ? &s.glu_clamp : nullptr;
  // With biases, db1's partial sums per chunk [chunks, n1] from the kernel's bf16 dH (chunk_offsets
  // numbers each expert's chunks, as for the columns).
  const BiasChunks bias_chunks{chunk_offsets, s.has_bias ? at<float>(ws, F.bias_partials) : nullptr, F.max_chunks,
                               kBiasChunkRowsFp8};
  sw.dh_col_sums = bias_chunks.partials;
  detail::swiglu_backward_columns_fp8(sw, stream);
  if (s.has_bias) {
    // d scores += ⟨dout_t, b2_e⟩ (before the router reads them); db1 = Σ dH, db2 = Σ score·dout
    // per expert, in chunk order.
    add_output_bias_scores(r, stream);
    bias_gradient_finalize(bias_chunks, s.E, s.n1, r.db1, r.grad_dtype, stream);
    bias_gradient(bias_chunks, s.E, r.dout, row_token, r.list.scores, r.row_pair, r.expert_offsets, s.d, r.db2,
                  r.grad_dtype, stream);
  }
  if (r.after_scores) r.after_scores();  // a layer's router backward (d_logits from d scores)
  // 3. dW2 [E, d, n] = Σ doutᵀ·A' over each expert's rows, both cut into 128-row chunks.
  const Fp8Columns dout_cols = columns(F.dout_cols, F.dout_cols_scales);
  quantize_columns(r.dout, s.T, s.d, row_token, r, chunk_offsets, dout_cols, stream);
  wgrad(dout_cols, s.d, ap_cols, s.n, chunk_offsets, s.E, F.max_chunks, r.dw2, r.grad_dtype, false,
        r.weights_max_ctas, stream);
  // 4. dX~ [R, d] = dH·W1 (dH's E4M3 rows from step 2; W1's transposed copy [E, d, n1]), then dx.
  g = fp8_gemm(dh_q, R, nullptr, R, w.w1_t, w.w1_t_scales, r.expert_offsets, s.E, s.d, s.n1, tile_offsets, 0);
  g.c = dx_rows, g.ldc = s.d;
  grouped_gemm_fp8(g, stream);
  aggregate_input_gradient(r, dx_rows, stream);
  // 5. dW1 [E, n1, d] = (Σ xᵀ·dH)ᵀ over each expert's rows (x gathered by row_token).
  const Fp8Columns x_cols = columns(F.x_cols, F.x_cols_scales);
  quantize_columns(r.x, s.T, s.d, row_token, r, chunk_offsets, x_cols, stream);
  wgrad(x_cols, s.d, dh_cols, s.n1, chunk_offsets, s.E, F.max_chunks, r.dw1, r.grad_dtype, true, r.weights_max_ctas,
        stream);
}

}  // namespace detail

namespace {

// The four copies' places in the buffer, in carving order (each part 256-byte aligned).
struct Fp8WeightsLayout {
  size_t w1, w1_scales, w1_t, w1_t_scales, w2, w2_scales, w2_t, w2_t_scales, bytes;
  Fp8WeightsLayout(int64_t E, int64_t d, int64_t n) {
    const size_t e = static_cast<size_t>(E), n1 = 2 * static_cast<size_t>(n);
    const size_t blocks1 = e * static_cast<size_t>(fp8_tiles(2 * n) * fp8_tiles(d));
    const size_t blocks2 = e * static_cast<size_t>(fp8_tiles(n) * fp8_tiles(d));
    detail::Carve c;
    w1 = c.take(e * n1 * static_cast<size_t>(d)), w1_scales = c.take(4 * blocks1);
    w1_t = c.take(e * n1 * static_cast<size_t>(d)), w1_t_scales = c.take(4 * blocks1);
    w2 = c.take(e * static_cast<size_t>(d * n)), w2_scales = c.take(4 * blocks2);
    w2_t = c.take(e * static_cast<size_t>(d * n)), w2_t_scales = c.take(4 * blocks2);
    bytes = c.bytes;
  }
};

void check_weights_shape(int64_t E, int64_t d, int64_t n, const char* fn) {
  detail::require_arg(E >= 1, fn, "E", "must be >= 1, got " + std::to_string(E));
  detail::require_arg(d >= 16 && d % 16 == 0, fn, "d",
                      "must be a positive multiple of 16 (16-byte rows of E4M3 codes), got " + std::to_string(d));
  detail::require_arg(n >= 16 && n % 16 == 0, fn, "n",
                      "must be a positive multiple of 16 (16-byte rows of E4M3 codes), got " + std::to_string(n));
}

}  // namespace

size_t fp8_expert_weights_bytes(int64_t E, int64_t d, int64_t n) {
  check_weights_shape(E, d, n, "fp8_expert_weights_bytes");
  return Fp8WeightsLayout(E, d, n).bytes;
}

Fp8ExpertWeights quantize_expert_weights_fp8(int64_t E, int64_t d, int64_t n, const void* w1, const void* w2,
                                             void* buffer, cudaStream_t stream) {
  constexpr const char* fn = "quantize_expert_weights_fp8";
  check_weights_shape(E, d, n, fn);
  detail::require_arg(buffer != nullptr && (reinterpret_cast<uintptr_t>(buffer) & 255) == 0, fn, "buffer",
                      "must be given and 256-byte aligned");
  const Fp8WeightsLayout L(E, d, n);
  Fp8ExpertWeights out;
  QuantizeWeightsArgs q;
  q.transposed = true;
  q.w = w1, q.E = E, q.N = 2 * n, q.K = d;  // w1 [E, 2n, d]
  q.q = at<uint8_t>(buffer, L.w1), q.scales = at<float>(buffer, L.w1_scales);
  q.qt = at<uint8_t>(buffer, L.w1_t), q.scales_t = at<float>(buffer, L.w1_t_scales);
  quantize_weights_fp8(q, stream);
  out.w1 = q.q, out.w1_scales = q.scales, out.w1_t = q.qt, out.w1_t_scales = q.scales_t;
  q.w = w2, q.N = d, q.K = n;  // w2 [E, d, n]
  q.q = at<uint8_t>(buffer, L.w2), q.scales = at<float>(buffer, L.w2_scales);
  q.qt = at<uint8_t>(buffer, L.w2_t), q.scales_t = at<float>(buffer, L.w2_t_scales);
  quantize_weights_fp8(q, stream);
  out.w2 = q.q, out.w2_scales = q.scales, out.w2_t = q.qt, out.w2_t_scales = q.scales_t;
  return out;
}

}  // namespace machmoe
