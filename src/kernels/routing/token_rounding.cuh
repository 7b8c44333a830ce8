// Token rounding on the GPU (docs/LAYER.md "Token rounding"): moves each expert's row
// count f_e to a multiple r_e of the tile M by dropping its lowest-score selected tokens or padding
// it with its best non-selected tokens, then emits the general routing list ordered by token,
// then expert. Starts from the softmax_topk routing and its metadata bit matrix
// (routing_metadata.cuh): bit (e, t) set <=> token t selected expert e.
//
//   1. rounding_row_stats:  per token, max and sum of exp over the logits row (P = softmax).
//   2. rounding_select:     one block per expert: r_e from f_e, then a radix select of the
//                           |r_e - f_e| (< M) tokens to add or drop; edits the bit matrix.
//   3. rounding_count:      per token, the number of experts it keeps (popcount down a column).
//   4. rounding_scan:       token_offsets = exclusive scan of the counts (one block).
//   5. rounding_emit:       per token, its pairs in expert order with their scores.
//   6. rounding_fill_tail:  rows [R, capacity) become invalid pairs (token T, expert -1), so the
//                           list can go to routing_metadata at its capacity without a host sync.
// Backward: rounding_backward maps d_score of the list to d_logits [T, E].
#pragma once

#include "kernels/common.cuh"

namespace machmoe::kernels {

enum RoundingMode : int { kRoundNearest = 1, kRoundUp = 2, kRoundDown = 3, kRoundStochastic = 4 };

struct RoundingParams {
  const float* logits;          // [T, E]
  const float* topk_scores;     // [T, K] softmax over the selected logits
  const int32_t* topk_experts;  // [T, K]
  const int32_t* expert_offsets;// [E+1] of the top-K list (f_e = off[e+1] - off[e])
  const int32_t* row_pair;      // [T*K] rows of the top-K list grouped by expert
  uint32_t* bits;               // [E, W] selection bits, edited into the rounded membership
  float* row_max;               // [T]
  float* row_sum;               // [T]
  int32_t* count_rounded;       // [E] r_e
  int32_t* token_count;         // [T] pairs per token after rounding
  int32_t* token_offsets;       // [T+1]
  int32_t* out_token;           // [capacity]
  int32_t* out_expert;          // [capacity]
  float* out_score;             // [capacity]
  uint8_t* out_padded;          // [capacity]
  int64_t T;
  int E, K, W, M, mode;
  int64_t capacity;             // rows the outputs can hold (>= T*K + E*(M-1), <= T*E)
  uint64_t seed;
};

__device__ __forceinline__ float rounding_prob(const RoundingParams& p, int64_t t, int e) {
  return __expf(p.logits[t * p.E + e] - p.row_max[t]) / p.row_sum[t];
}

__global__ void __launch_bounds__(256) rounding_row_stats(RoundingParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = global_warp_index();
  if (t >= p.T) return;
  const SoftmaxStats st = warp_softmax_stats(p.logits + t * p.E, p.E, lane);
  if (lane == 0) {
    p.row_max[t] = st.max;
    p.row_sum[t] = st.sum;
  }
}

// The same draw as the reference (docs/LAYER.md): splitmix64, top 53 bits.
__device__ __forceinline__ double rounding_uniform(uint64_t seed, int e) {
  uint64_t z = seed ^ (static_cast<uint64_t>(e) * 0x9E3779B97F4A7C15ull);
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

__device__ __forceinline__ int64_t rounding_target(const RoundingParams& p, int e, int64_t f) {
  const int64_t M = p.M, lo = f / M * M, hi = lo + (f % M ? M : 0);
  int64_t r = f;
  if (p.mode == kRoundNearest) r = (f + M / 2) / M * M;
  else if (p.mode == kRoundUp) r = hi;
  else if (p.mode == kRoundDown) r = lo;
  else if (p.mode == kRoundStochastic) r = rounding_uniform(p.seed, e) < static_cast<double>(f % M) / M ? hi : lo;
  return r < 0 ? 0 : (r > p.T ? p.T : r);
}

constexpr int kSelectThreads = 512;

// Block-wide count of `pred` over the block's threads (all threads must call it).
__device__ __forceinline__ int block_count(bool pred, int* smem /*[32]*/) {
  int c = __popc(__ballot_sync(kFullMask, pred));
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) smem[warp] = c;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) total += smem[w];
  __syncthreads();
  return total;
}

// One block per expert. Candidates: pad = the non-selected tokens, keyed by P[t, e] (best first,
// ties to the lower token); drop = the selected tokens, keyed by the inverse of their rank (the
// worst rank first: lowest top-K score, ties to the higher token). Either way the block selects
// the m largest 32-bit keys by an 8-bit radix select, then takes ties at the threshold in the
// order the rank wants, and flips those tokens' bits.
__global__ void __launch_bounds__(kSelectThreads) rounding_select(RoundingParams p) {
  __shared__ int hist[256];
  __shared__ int smem[32];
  __shared__ int s_carry;
  const int e = blockIdx.x;
  const int64_t f = p.expert_offsets[e + 1] - p.expert_offsets[e];
  const int64_t r = rounding_target(p, e, f);
  if (threadIdx.x == 0) p.count_rounded[e] = static_cast<int32_t>(r);
  if (r == f) return;
  const bool pad = r > f;
  int64_t need = pad ? r - f : f - r;
  uint32_t* bits = p.bits + static_cast<int64_t>(e) * p.W;
  const int64_t n = pad ? p.T : f;  // candidates: every token (selected ones skipped) or the rows
  // Candidate i -> (token, key). Drop candidates come from the expert's rows (token order).
  auto candidate = [&](int64_t i, int64_t* token, uint32_t* key) -> bool {
    if (pad) {
      *token = i;
      if (bits[i / 32] & (1u << (i % 32))) return false;
      *key = ordered_key(rounding_prob(p, i, e));
      return true;
    }
    const int pair = p.row_pair[p.expert_offsets[e] + i];
    *token = pair / p.K;
    *key = ~ordered_key(p.topk_scores[pair]);  // lowest score = largest key
    return true;
  };
  // Radix select: find the threshold key (prefix) such that count(key > thr) < need <= count(key >= thr).
  uint32_t prefix = 0, prefix_mask = 0;
  int64_t above = 0;  // candidates strictly above the current prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t tok;
      uint32_t key;
      if (candidate(i, &tok, &key) && (key & prefix_mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t acc = above;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (acc + hist[digit] >= need) break;
        acc += hist[digit];
      }
      s_carry = digit;
      smem[0] = static_cast<int>(acc - above);
    }
    __syncthreads();
    above += smem[0];
    prefix |= static_cast<uint32_t>(s_carry) << shift;
    prefix_mask |= 255u << shift;
    __syncthreads();
  }
  // Keys > prefix are all taken; among keys == prefix take `need - above` in rank order: lowest
  // token first when padding, highest token first when dropping (worst rank first).
  const int64_t ties_wanted = need - above;
  if (threadIdx.x == 0) s_carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = pad ? base + threadIdx.x : n - 1 - (base + threadIdx.x);
    int64_t tok = -1;
    uint32_t key = 0;
    const bool valid = (pad ? i < n : i >= 0) && candidate(i, &tok, &key);
    const bool is_tie = valid && key == prefix;
    // Rank of this tie among this chunk's ties, in scan order.
    const unsigned tie_mask = __ballot_sync(kFullMask, is_tie);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    if (lane == 0) smem[warp] = __popc(tie_mask);
    __syncthreads();
    int before = s_carry;
    for (int w = 0; w < warp; ++w) before += smem[w];
    before += __popc(tie_mask & ((1u << lane) - 1u));
    const bool take = valid && (key > prefix || (is_tie && before < ties_wanted));
    if (take) {
      if (pad) atomicOr(&bits[tok / 32], 1u << (tok % 32));
      else atomicAnd(&bits[tok / 32], ~(1u << (tok % 32)));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chunk = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) chunk += smem[w];
      s_carry += chunk;
    }
    __syncthreads();
  }
}

// Per token: how many experts keep it (a column popcount of the edited bit matrix).
__global__ void rounding_count(RoundingParams p) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= p.T) return;
  const uint32_t bit = 1u << (t % 32);
  int c = 0;
  for (int e = 0; e < p.E; ++e) c += (p.bits[static_cast<int64_t>(e) * p.W + t / 32] & bit) ? 1 : 0;
  p.token_count[t] = c;
}

// token_offsets = exclusive scan of token_count, one block (T up to a few million is fine).
__global__ void __launch_bounds__(1024) rounding_scan(RoundingParams p) {
  __shared__ int smem[32];
  int carry = 0;
  for (int64_t base = 0; base < p.T; base += blockDim.x) {
    const int64_t t = base + threadIdx.x;
    const int c = t < p.T ? p.token_count[t] : 0;
    int total;
    const int excl = block_exclusive_scan(c, smem, &total);
    if (t < p.T) p.token_offsets[t] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) p.token_offsets[p.T] = carry;
}

// Per token: its pairs in expert order. Selected pairs keep their top-K score; padded pairs get
// P[t, e]. Pairs past `capacity` are not written (the launcher sizes capacity so none are).
__global__ void rounding_emit(RoundingParams p) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= p.T) return;
  const uint32_t bit = 1u << (t % 32);
  int64_t out = p.token_offsets[t];
  for (int e = 0; e < p.E; ++e) {
    if (!(p.bits[static_cast<int64_t>(e) * p.W + t / 32] & bit)) continue;
    int k = 0;
    while (k < p.K && p.topk_experts[t * p.K + k] != e) ++k;
    if (out < p.capacity) {
      p.out_token[out] = static_cast<int32_t>(t);
      p.out_expert[out] = e;
      p.out_score[out] = k < p.K ? p.topk_scores[t * p.K + k] : rounding_prob(p, t, e);
      p.out_padded[out] = k < p.K ? 0 : 1;
    }
    ++out;
  }
}

// The rows past the list's length R = token_offsets[T]: token T and expert -1 keep the list
// ordered by token and make routing_metadata give them no row (pair_row = -1).
__global__ void rounding_fill_tail(RoundingParams p) {
  const int64_t R = p.token_offsets[p.T];
  for (int64_t i = R + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.capacity;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p.out_token[i] = static_cast<int32_t>(p.T);
    p.out_expert[i] = -1;
    p.out_score[i] = 0.f;
    p.out_padded[i] = 0;
  }
}

struct RoundingBackwardParams {
  const float* logits;          // [T, E]
  const float* topk_scores;     // [T, K]
  const int32_t* topk_experts;  // [T, K]
  const int32_t* token_offsets; // [T+1] of the rounded list
  const int32_t* list_expert;   // [R]
  const uint8_t* list_padded;   // [R]
  const float* d_score;         // [R]
  float* d_logits;              // [T, E], every element written
  int64_t T;
  int E, K;
};

// One warp per token. Selected pairs: softmax-over-top-K Jacobian with g_k = d_score of the kept
// pair of rank k (0 for a dropped one). Padded pairs: the full-softmax Jacobian of P[t, e].
__global__ void __launch_bounds__(256) rounding_backward(RoundingBackwardParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = global_warp_index();
  if (t >= p.T) return;
  const float* row = p.logits + t * p.E;
  float* drow = p.d_logits + t * p.E;
  const int begin = p.token_offsets[t], end = p.token_offsets[t + 1];
  // Full softmax of the row (for padded pairs).
  const SoftmaxStats st = warp_softmax_stats(row, p.E, lane);
  const float m = st.max, z = st.sum;
  // pad_dot = Σ_padded g·P_e; lane k collects g_k of rank k.
  float pad_dot = 0.f, g_rank = 0.f;
  for (int q = begin; q < end; ++q) {
    const int e = p.list_expert[q];
    const float g = p.d_score[q];
    if (p.list_padded[q]) {
      pad_dot += g * __expf(row[e] - m) / z;
    } else if (lane < p.K && p.topk_experts[t * p.K + lane] == e) {
      g_rank += g;
    }
  }
  const float s = lane < p.K ? p.topk_scores[t * p.K + lane] : 0.f;
  const float topk_dot = warp_sum(s * g_rank);
  for (int e = lane; e < p.E; e += kWarpSize) drow[e] = -(__expf(row[e] - m) / z) * pad_dot;
  __syncwarp();
  for (int q = begin + lane; q < end; q += kWarpSize)
    if (p.list_padded[q]) {
      const int e = p.list_expert[q];
      drow[e] += p.d_score[q] * __expf(row[e] - m) / z;
    }
  __syncwarp();
  if (lane < p.K) drow[p.topk_experts[t * p.K + lane]] += s * (g_rank - topk_dot);
}

}  // namespace machmoe::kernels
