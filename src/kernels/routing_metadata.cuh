// Kernel family 2 (SPEC §2): routing metadata. From R routed pairs (expert id per pair, and the
// token per pair or p / K for top-K) it builds, with no host synchronisation and no sort:
//   expert_offsets [E+1]  rows of expert e are [off[e], off[e+1])
//   row_token [R]         gather index: row -> token
//   row_pair [R]          row -> pair
//   pair_row [R]          reverse index: pair -> row (-1 for an invalid pair)
//   token_offsets [T+1]   pairs of token t are [off[t], off[t+1]) (pairs are ordered by token)
// Rows are grouped by expert and keep token order inside an expert, exactly like the reference.
//
// Method: a bit matrix B [E, W] (W = ceil(T/32) words) marks which tokens chose each expert. A
// row's position inside its expert is then the number of set bits before its token: a per-expert
// prefix sum of popcounts, which is deterministic, stable by construction and needs no sort.
//   1. metadata_mark:  one thread per pair sets its bit (atomicOr: the result is order-free).
//   2. metadata_scan:  one block per expert scans its W popcounts; the last block to finish turns
//                      the per-expert totals into expert_offsets.
//   3. metadata_place: one thread per pair computes its row and writes the three row indices.
#pragma once

#include "kernels/common.cuh"

namespace machmoe::kernels {

struct MetadataParams {
  const int32_t* pair_expert;  // [R]
  const int32_t* pair_token;   // [R], or null for top-K lists (token of pair p = p / K)
  int64_t R, T;
  int E, K;
  int W;                        // words per expert row of the bit matrix, ceil(T / 32)
  uint32_t* bits;               // [E, W], zeroed before metadata_mark
  int32_t* word_prefix;         // [E, W] set bits of expert e before word w
  int32_t* expert_total;        // [E]
  uint32_t* done_counter;       // [1], zero on entry; the last scan block resets it
  uint32_t* duplicate_flag;     // [1], set to 1 when a (token, expert) pair repeats
  int32_t* expert_offsets;      // [E+1]
  int32_t* row_token;           // [R]
  int32_t* row_pair;            // [R]
  int32_t* pair_row;            // [R]
  int32_t* token_offsets;       // [T+1] or null
};

__device__ __forceinline__ int64_t metadata_token(const MetadataParams& p, int64_t i) {
  return p.pair_token ? p.pair_token[i] : i / p.K;
}

__device__ __forceinline__ bool metadata_valid(const MetadataParams& p, int64_t t, int e) {
  return e >= 0 && e < p.E && t >= 0 && t < p.T;
}

__global__ void metadata_mark(MetadataParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.R;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = p.pair_expert[i];
    const int64_t t = metadata_token(p, i);
    if (!metadata_valid(p, t, e)) continue;  // documented: an invalid pair gets no row
    const uint32_t bit = 1u << (t % 32);
    const uint32_t old = atomicOr(&p.bits[static_cast<int64_t>(e) * p.W + t / 32], bit);
    if (old & bit) *p.duplicate_flag = 1u;
  }
}

// Block e scans expert e's W words in chunks of blockDim.x.
__global__ void __launch_bounds__(512) metadata_scan(MetadataParams p) {
  __shared__ int smem[32];
  __shared__ bool is_last;
  const int e = blockIdx.x;
  const uint32_t* row = p.bits + static_cast<int64_t>(e) * p.W;
  int32_t* prefix = p.word_prefix + static_cast<int64_t>(e) * p.W;
  int carry = 0;
  for (int base = 0; base < p.W; base += blockDim.x) {
    const int w = base + threadIdx.x;
    const int c = w < p.W ? __popc(row[w]) : 0;
    int total;
    const int excl = block_exclusive_scan(c, smem, &total);
    if (w < p.W) prefix[w] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) {
    p.expert_total[e] = carry;
    __threadfence();  // publish the total before counting this block as done
    is_last = atomicAdd(p.done_counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  // The last block: expert_offsets = exclusive scan of the totals (read through L2, not L1).
  __threadfence();
  int carry_e = 0;
  for (int base = 0; base < p.E; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int c = i < p.E ? __ldcg(p.expert_total + i) : 0;
    int total;
    const int excl = block_exclusive_scan(c, smem, &total);
    if (i < p.E) p.expert_offsets[i] = carry_e + excl;
    carry_e += total;
  }
  if (threadIdx.x == 0) {
    p.expert_offsets[p.E] = carry_e;
    *p.done_counter = 0u;  // ready for the next call (and for graph replays)
  }
}

__global__ void metadata_place(MetadataParams p) {
  const int64_t n = p.R > p.T + 1 ? p.R : p.T + 1;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < p.R) {
      const int e = p.pair_expert[i];
      const int64_t t = metadata_token(p, i);
      if (metadata_valid(p, t, e)) {
        const int64_t w = static_cast<int64_t>(e) * p.W + t / 32;
        const uint32_t below = p.bits[w] & ((1u << (t % 32)) - 1u);
        const int row = p.expert_offsets[e] + p.word_prefix[w] + __popc(below);
        p.pair_row[i] = row;
        p.row_token[row] = static_cast<int32_t>(t);
        p.row_pair[row] = static_cast<int32_t>(i);
      } else {
        p.pair_row[i] = -1;
      }
    }
    if (p.token_offsets == nullptr) continue;
    if (!p.pair_token) {  // top-K: K pairs per token
      if (i <= p.T) p.token_offsets[i] = static_cast<int32_t>(i * p.K);
      continue;
    }
    // General list ordered by token: pair i opens tokens (token[i-1], token[i]]; the last pair
    // also closes the tokens after it. Clamped to [0, T] so a bad list cannot write out of range.
    if (i < p.R) {
      const int64_t t = p.pair_token[i];
      const int64_t t_prev = i > 0 ? p.pair_token[i - 1] : -1;
      for (int64_t tt = (t_prev + 1 > 0 ? t_prev + 1 : 0); tt <= t && tt <= p.T; ++tt)
        p.token_offsets[tt] = static_cast<int32_t>(i);
      if (i == p.R - 1)
        for (int64_t tt = (t + 1 > 0 ? t + 1 : 0); tt <= p.T; ++tt)
          p.token_offsets[tt] = static_cast<int32_t>(p.R);
    }
  }
}

}  // namespace machmoe::kernels
