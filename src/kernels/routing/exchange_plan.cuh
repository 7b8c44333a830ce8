// Expert parallelism's exchange plan (docs/LAYER.md, "Expert parallelism"; the launcher is
// src/host/routing/exchange_plan.cu). From one rank's top-K list experts [T, K] it writes who sends what,
// with no host synchronisation. The two orderings the exchange needs come from the routing-
// metadata kernel run with the owning rank q = e / E_local in place of the expert:
//   rows:  the [T, K] list of ranks -> one row per distinct (token, rank), rank-major, tokens
//          ascending (row_offsets [W+1], row_token, pair_row);
//   pairs: the same ranks as a list of T·K one-pair tokens -> the pairs grouped by rank, (t, k)
//          order inside (order = row_token, inverse = pair_row of that call).
// The three kernels here do what is left, each pass one thread per token (K pairs):
//   exchange_plan_prepare:       dest [T·K] (the owning rank; W for an expert out of range), the
//                                distinct ranks per token, and the per-expert pair counts;
//   exchange_plan_token_offsets: one block: the exclusive prefix of the distinct counts, i.e.
//                                where each token's rows start in the row-sum list;
//   exchange_plan_finish:        the packed pairs [T·K, 4] at their grouped positions, each
//                                token's rows in rank order, and the per-rank counts [W, 2].
// Ranks per token are a 64-bit mask when W <= 64 (O(K) per token); otherwise each pair scans its
// token's pairs (O(K^2) per token in prepare, up to O(K^3) in finish: K and W are both small in
// practice). Deterministic: the only atomics are integer adds (order-free).
#pragma once

#include "kernels/common.cuh"

namespace machmoe::kernels {

constexpr int kPlanThreads = 256;      // tokens per block (prepare, finish)
constexpr int kPlanScanThreads = 1024;  // the single block of exchange_plan_token_offsets
constexpr int kPlanHistMax = 12 * 1024;  // experts counted in shared memory (48 KB) first

struct ExchangePlanParams {
  const int32_t* experts;       // [T, K] global expert ids
  const float* scores;          // [T, K]
  int64_t T;
  int K, E, E_local, W, rank;
  int32_t* dest;                // [T·K] owning rank, W if the expert is out of [0, E)
  int32_t* distinct;            // [T] distinct valid ranks per token
  int32_t* expert_counts;       // [E] zeroed before prepare; or null
  bool hist_in_smem;            // count experts in shared memory [E] first (E <= kPlanHistMax)
  const int32_t* row_offsets;   // [W+1] rows per rank, prefix (routing metadata over [T, K])
  const int32_t* pair_row;      // [T·K] pair -> row (-1: invalid)
  const int32_t* pair_offsets;  // [W+1] pairs per rank, prefix (routing metadata over T·K x 1)
  const int32_t* inverse;       // [T·K] pair -> its position grouped by rank (-1: invalid)
  int32_t* token_offsets;       // [T+1]
  int4* packed;                 // [T·K] (row in its rank's chunk, local expert, rank, score bits)
  int32_t* distinct_rows;       // [T·K] each token's rows in rank order, token after token
  int32_t* counts;              // [W, 2] rows and pairs sent to each rank
  int32_t* invalid;             // [1] 1 if some expert was out of [0, E) (it has no pair position:
                                //     pair_offsets[W] < T·K), else 0; or null
};

// The general path for W > 64, on one token's ranks q[0..K) (W marks an invalid pair).
// Whether pair j is the first of the token's pairs with a valid rank q[j] (O(K)).
__device__ __forceinline__ bool plan_first_of_rank(const int32_t* q, int W, int j) {
  for (int i = 0; i < j; ++i)
    if (q[i] == q[j]) return false;
  return q[j] < W;
}
// ... and how many of the token's distinct ranks lie below q[j] (O(K^2)).
__device__ __forceinline__ int plan_ranks_below(const int32_t* q, int K, int W, int j) {
  int n = 0;
  for (int i = 0; i < K; ++i) n += q[i] < q[j] && plan_first_of_rank(q, W, i);
  return n;
}

__global__ void __launch_bounds__(kPlanThreads) exchange_plan_prepare(ExchangePlanParams p) {
  extern __shared__ int32_t hist[];  // [E] when p.hist_in_smem, else no shared memory
  const bool smem_hist = p.expert_counts != nullptr && p.hist_in_smem;
  if (smem_hist)
    for (int e = threadIdx.x; e < p.E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < p.T) {
    const int32_t* ex = p.experts + t * p.K;
    int32_t* dq = p.dest + t * p.K;
    uint64_t mask = 0;
    for (int k = 0; k < p.K; ++k) {
      const int e = ex[k];
      const bool ok = e >= 0 && e < p.E;
      const int q = ok ? e / p.E_local : p.W;
      dq[k] = q;
      if (ok && p.W <= 64) mask |= 1ull << q;
      if (ok && p.expert_counts) {
        if (smem_hist) atomicAdd(&hist[e], 1);
        else atomicAdd(&p.expert_counts[e], 1);
      }
    }
    int n = __popcll(mask);
    if (p.W > 64) {
      n = 0;
      for (int k = 0; k < p.K; ++k) n += plan_first_of_rank(dq, p.W, k);
    }
    p.distinct[t] = n;
  }
  if (smem_hist) {
    __syncthreads();
    for (int e = threadIdx.x; e < p.E; e += blockDim.x)
      if (hist[e]) atomicAdd(&p.expert_counts[e], hist[e]);
  }
}

// One block: token_offsets[0] = 0, token_offsets[t+1] = distinct[0] + ... + distinct[t]. Each
// thread sums a contiguous chunk, the block scans the chunk sums, each thread writes its chunk.
__global__ void __launch_bounds__(kPlanScanThreads) exchange_plan_token_offsets(ExchangePlanParams p) {
  __shared__ int scratch[32];
  const int64_t chunk = (p.T + blockDim.x - 1) / blockDim.x;
  const int64_t begin = threadIdx.x * chunk, end = begin + chunk < p.T ? begin + chunk : p.T;
  int sum = 0;
  for (int64_t t = begin; t < end; ++t) sum += p.distinct[t];
  int total;
  int run = block_exclusive_scan(sum, scratch, &total);
  if (threadIdx.x == 0) p.token_offsets[0] = 0;
  for (int64_t t = begin; t < end; ++t) {
    run += p.distinct[t];
    p.token_offsets[t + 1] = run;
  }
}

__global__ void __launch_bounds__(kPlanThreads) exchange_plan_finish(ExchangePlanParams p) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (blockIdx.x == 0) {
    for (int q = threadIdx.x; q < p.W; q += blockDim.x) {
      p.counts[2 * q] = p.row_offsets[q + 1] - p.row_offsets[q];
      p.counts[2 * q + 1] = p.pair_offsets[q + 1] - p.pair_offsets[q];
    }
    if (threadIdx.x == 0 && p.invalid) *p.invalid = p.pair_offsets[p.W] != p.T * p.K;
  }
  if (t >= p.T) return;
  const int32_t* dq = p.dest + t * p.K;
  uint64_t mask = 0;
  if (p.W <= 64)
    for (int k = 0; k < p.K; ++k) mask |= dq[k] < p.W ? 1ull << dq[k] : 0ull;
  uint64_t seen = 0;
  int32_t* rows_out = p.distinct_rows + p.token_offsets[t];
  for (int k = 0; k < p.K; ++k) {
    const int64_t i = t * p.K + k;
    const int q = dq[k];
    if (q >= p.W) continue;  // an expert out of range: no row, no position
    const int row = p.pair_row[i];
    p.packed[p.inverse[i]] = make_int4(row - p.row_offsets[q], p.experts[i] - q * p.E_local, p.rank,
                                       __float_as_int(p.scores[i]));
    if (p.W <= 64) {
      const uint64_t bit = 1ull << q;
      if (!(seen & bit)) rows_out[__popcll(mask & (bit - 1))] = row;
      seen |= bit;
    } else if (plan_first_of_rank(dq, p.W, k)) {
      rows_out[plan_ranks_below(dq, p.K, p.W, k)] = row;
    }
  }
}

}  // namespace machmoe::kernels
