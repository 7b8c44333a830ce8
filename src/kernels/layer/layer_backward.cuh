// The small kernels of the layer backward (host/layer/layer_backward.cu; the GEMMs are the grouped GEMM
// engine's). Every sum runs in a fixed order, no float atomics: the backward is bitwise
// deterministic. Shapes: T tokens, E experts, R rows (= pairs' capacity), d hidden, n1 columns of H.
//   bwd_pair_experts     expert [pairs] from pair_row and expert_offsets (not saved by the forward)
//   bwd_rebuild_index    row_token [R] and token_offsets [T+1] (not saved by the forward)
//   bwd_pair_scores      d_score [pairs] = Σ_j dS partials of the pair's row (+ ⟨dout_t, b2_e⟩)
//   bwd_bias_*           db1 / db2: per-expert column sums over the expert's rows, in row order
//   bwd_aux_*            d_aux · ∂aux/∂logits added into d_logits [T, E]
//   bwd_to_bf16          fp32 -> bf16 (d_logits as a cuBLAS operand)
// Templates only: a non-template __global__ in a header included by two TUs would clash at link.
#pragma once

#include "kernels/routing/aux_loss.cuh"
#include "kernels/common.cuh"

namespace machmoe::kernels {

// ---------------------------------------------------------------- pair experts

// expert[p] of every pair, rebuilt from the metadata (the forward does not save it: that keeps the
// held memory within 16 bytes per pair): the expert whose rows [off[e], off[e+1]) hold the pair's
// row pair_row[p]; -1 for a pair without a row (pair_row -1: an invalid entry of a rounded list).
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    bwd_pair_experts(const int32_t* pair_row, const int32_t* expert_offsets, int E, int64_t pairs, int32_t* expert) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < pairs; p += stride) {
    const int32_t row = pair_row[p];
    int32_t e = -1;
    if (row >= 0) {  // the largest e with off[e] <= row (empty experts share an offset)
      int lo = 0, hi = E;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(expert_offsets + mid) <= row) lo = mid;
        else hi = mid;
      }
      e = lo;
    }
    expert[p] = e;
  }
}

// ---------------------------------------------------------------- gather index

// row_token[r] = token of pair row_pair[r]: row_pair / K for a top-K list (list_token null), or
// list_token[row_pair] for a general (token-rounded) list. Rows at or past expert_offsets[E] have
// no pair (their row_pair is unspecified) and get token 0, a valid index nobody reads.
// token_offsets (top-K only, may be null) [T+1] = t·K.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    bwd_rebuild_index(const int32_t* row_pair, const int32_t* list_token, int K, const int32_t* expert_offsets,
                      int E, int64_t R, int64_t T, int32_t* row_token, int32_t* token_offsets) {
  const int64_t rows = expert_offsets[E];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < R || i <= T; i += stride) {
    if (i < R) {
      int32_t tok = 0;
      if (i < rows) {
        const int32_t pair = row_pair[i];
        tok = list_token ? list_token[pair] : pair / K;
      }
      row_token[i] = tok;
    }
    if (token_offsets && i <= T) token_offsets[i] = static_cast<int32_t>(i * K);
  }
}

// ---------------------------------------------------------------- d scores

struct PairScoreParams {
  const float* ds_partial;         // [R, tiles] the dH kernel's Σ over column tile j of dA'·A, or
                                   // null (bias only): d_score already holds Σ dA'·A (FP8)
  const int32_t* pair_row;         // [pairs] row of pair p, -1: no row
  const __nv_bfloat16* dout;       // [T, d] (bias only)
  const __nv_bfloat16* b2;         // [E, d] (bias only)
  const int32_t* pair_expert;      // [pairs] (bias only)
  const int32_t* list_token;       // [pairs] general list, or null: token = p / K (bias only)
  float* d_score;                  // [pairs]
  int64_t pairs;
  int tiles, K, d;
};

// Without biases: one thread per pair, the tiles added in j order.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) bwd_pair_scores(PairScoreParams p) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (pair >= p.pairs) return;
  const int32_t row = p.pair_row[pair];
  float acc = 0.f;
  if (row >= 0) {
    const float* part = p.ds_partial + static_cast<int64_t>(row) * p.tiles;
    for (int j = 0; j < p.tiles; ++j) acc += part[j];
  }
  p.d_score[pair] = acc;
}

// With biases: one warp per pair; lane 0 adds the tiles in j order, the warp adds ⟨dout_t, b2_e⟩
// (lane-strided 16-byte vectors, then a fixed-shape warp sum), lane 0 writes tiles + dot. Without
// ds_partial the dot is added to d_score (a pair without a row keeps its value).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) bwd_pair_scores_bias(PairScoreParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t pair = global_warp_index();
  if (pair >= p.pairs) return;
  const int32_t row = p.pair_row[pair];
  if (row < 0) {
    if (lane == 0 && p.ds_partial != nullptr) p.d_score[pair] = 0.f;
    return;
  }
  const int64_t t = p.list_token ? p.list_token[pair] : pair / p.K;
  const int e = p.pair_expert[pair];
  const __nv_bfloat16* g = p.dout + t * p.d;
  const __nv_bfloat16* b = p.b2 + static_cast<int64_t>(e) * p.d;
  float dot = 0.f;
  for (int v = lane * 8; v < p.d; v += kWarpSize * 8) {  // d % 8 == 0, rows 16-byte aligned
    const Vec16<__nv_bfloat16> gv = load_vec16(g + v), bv = load_vec16(b + v);
#pragma unroll
    for (int i = 0; i < 8; ++i) dot += __bfloat162float(gv.elem[i]) * __bfloat162float(bv.elem[i]);
  }
  dot = warp_sum(dot);
  if (lane == 0) {
    float acc = 0.f;
    if (p.ds_partial != nullptr) {
      const float* part = p.ds_partial + static_cast<int64_t>(row) * p.tiles;
      for (int j = 0; j < p.tiles; ++j) acc += part[j];
    } else {
      acc = p.d_score[pair];
    }
    p.d_score[pair] = acc + dot;
  }
}

// ---------------------------------------------------------------- bias gradients
// db[e, c] = Σ_{rows r of e, in order} scale_r · src[row(r), c]. An expert's rows are cut into
// chunks of kChunk rows; chunk_prefix[e] numbers its first chunk (chunks of e are contiguous).
// Pass 1 writes one fp32 partial per (chunk, column), pass 2 adds an expert's chunks in order.
// db2: src = dout gathered by row_token, scale = score of the row's pair; db1: src = dH, scale 1
// (precision FP8: the fused SwiGLU backward writes db1's partials, per 128-row column chunk).

// chunk_prefix [E+1] = exclusive prefix of ceil(rows_e / kChunk), by one block (chunked scan).
template <int kThreads, int kChunk>
__global__ void __launch_bounds__(kThreads) bwd_bias_chunk_prefix(const int32_t* expert_offsets, int E,
                                                                  int32_t* chunk_prefix) {
  __shared__ int smem[32];
  int carry = 0;
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + threadIdx.x;
    const int rows = e < E ? expert_offsets[e + 1] - expert_offsets[e] : 0;
    int total = 0;
    const int excl = block_exclusive_scan((rows + kChunk - 1) / kChunk, smem, &total);
    if (e < E) chunk_prefix[e] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) chunk_prefix[E] = carry;
}

struct BiasGradParams {
  const __nv_bfloat16* src;       // rows [*, cols] (ld = cols)
  const int32_t* gather;          // [R] row -> src row, or null (src row = r)
  const float* pair_scores;       // [pairs] scale of row r = pair_scores[row_pair[r]], or null (1)
  const int32_t* row_pair;        // [R] (with pair_scores)
  const int32_t* expert_offsets;  // [E+1]
  const int32_t* chunk_prefix;    // [E+1]
  float* partials;                // [chunks, cols]
  void* out;                      // [E, cols] in TOut
  int E, cols;
};

// Grid (chunk slots, column blocks); a slot past chunk_prefix[E] has no rows and returns.
template <int kThreads, int kChunk>
__global__ void __launch_bounds__(kThreads) bwd_bias_partial(BiasGradParams p) {
  const int chunk = blockIdx.x;
  if (chunk >= p.chunk_prefix[p.E]) return;
  // The expert of the chunk: the last e with chunk_prefix[e] <= chunk (empty experts share their
  // prefix with the next one, so the search lands on the expert that owns the chunk).
  int lo = 0, hi = p.E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.chunk_prefix[mid] <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const int e = lo;
  const int64_t begin = p.expert_offsets[e] + static_cast<int64_t>(chunk - p.chunk_prefix[e]) * kChunk;
  const int64_t end = min(begin + kChunk, static_cast<int64_t>(p.expert_offsets[e + 1]));
  const int c = blockIdx.y * kThreads + threadIdx.x;
  if (c >= p.cols) return;
  float acc = 0.f;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t src_row = p.gather ? p.gather[r] : r;
    const float s = p.pair_scores ? p.pair_scores[p.row_pair[r]] : 1.f;
    acc += s * __bfloat162float(p.src[src_row * p.cols + c]);
  }
  p.partials[static_cast<int64_t>(chunk) * p.cols + c] = acc;
}

// Grid (E, column blocks): db[e, c] = Σ over e's chunks in order; an expert with no rows gets 0.
template <int kThreads, typename TOut>
__global__ void __launch_bounds__(kThreads) bwd_bias_finalize(BiasGradParams p) {
  const int e = blockIdx.x;
  const int c = blockIdx.y * kThreads + threadIdx.x;
  if (c >= p.cols) return;
  float acc = 0.f;
  for (int k = p.chunk_prefix[e]; k < p.chunk_prefix[e + 1]; ++k) acc += p.partials[static_cast<int64_t>(k) * p.cols + c];
  static_cast<TOut*>(p.out)[static_cast<int64_t>(e) * p.cols + c] = from_float<TOut>(acc);
}

// ---------------------------------------------------------------- aux loss backward
// aux = E · Σ_e (C_e / S) · w_e, C_e = Σ_t P[t,e], S = Σ_e C_e, w_e = freq_e / rows (LAYER.md), so
//   ∂aux/∂C_j = E · (w_j / S − Σ_e C_e w_e / S²) =: g_j,   d_logits[t] += P_t ⊙ (d_aux·g − ⟨P_t, d_aux·g⟩)
// (the softmax Jacobian of row t). The column sums come from aux_colsum_partial (aux_loss.cuh).

// One block: grad[e] = d_aux · g_e for e < E, grad[E] = 1 when the loss has a gradient (rows > 0,
// S > 0), else 0 (LAYER.md: aux = 0 when R = 0). d_aux_device (if set) replaces d_aux.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    bwd_aux_coefficients(const float* partials, int blocks, int E, const int32_t* expert_offsets, float d_aux,
                         const float* d_aux_device, float* grad) {
  __shared__ float red[32];
  __shared__ float4 scratch[kThreads];
  float local_total = 0.f, local_weighted = 0.f;
  const float rows = static_cast<float>(expert_offsets[E]);
  aux_column_sums<kThreads>(partials, blocks, E, expert_offsets, grad, reinterpret_cast<float*>(scratch), local_total,
                            local_weighted);  // grad = C
  const float S = aux_block_sum<kThreads>(local_total, red);
  const float aw = aux_block_sum<kThreads>(local_weighted, red) / rows;  // Σ C_e w_e
  const bool live = rows > 0.f && S > 0.f;
  const float scale = d_aux_device ? *d_aux_device : d_aux;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const float w = static_cast<float>(expert_offsets[e + 1] - expert_offsets[e]) / rows;
    grad[e] = live ? scale * static_cast<float>(E) * (w / S - aw / (S * S)) : 0.f;
  }
  if (threadIdx.x == 0) grad[E] = live ? 1.f : 0.f;
}

// One warp per token: P_t from the logits, dot = ⟨P_t, grad⟩ (fixed-shape warp sum), then
// d_logits[t, e] += P_te · (grad_e − dot), and its bf16 copy (which the router backward already
// wrote for the case grad[E] == 0, no gradient).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) bwd_aux_apply(const float* logits, int64_t T, int E, const float* grad,
                                                          float* d_logits, __nv_bfloat16* d_logits_bf16) {
  if (grad[E] == 0.f) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = global_warp_index();
  if (t >= T) return;
  const float* row = logits + t * E;
  const SoftmaxStats st = warp_softmax_stats(row, E, lane);
  const float inv = 1.f / st.sum;
  float dot = 0.f;
  for (int e = lane; e < E; e += kWarpSize) dot += __expf(row[e] - st.max) * inv * grad[e];
  dot = warp_sum(dot);
  float* drow = d_logits + t * E;
  __nv_bfloat16* brow = d_logits_bf16 + t * E;
  for (int e = lane; e < E; e += kWarpSize) {
    const float v = drow[e] + __expf(row[e] - st.max) * inv * (grad[e] - dot);
    drow[e] = v;
    brow[e] = __float2bfloat16_rn(v);
  }
}

// ---------------------------------------------------------------- conversion

template <int kThreads>
__global__ void __launch_bounds__(kThreads) bwd_to_bf16(const float* in, int64_t count, __nv_bfloat16* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count; i += stride)
    out[i] = __float2bfloat16_rn(in[i]);
}

}  // namespace machmoe::kernels
