// Aggregation: per-token gather-and-sum of the token's routed rows.
//   out[t] = Σ_{p in [token_offsets[t], token_offsets[t+1])} (score[p] or 1) · rows[pair_row[p]]
// rows [R, d] (Y in the forward, dX̃ in the backward), fp32 accumulation, out [T, d]. A token with
// no pairs gets zeros; a pair with pair_row = -1 (invalid routing) contributes nothing.
// Memory-bound: one block per token, each thread owns 16-byte column vectors and keeps up to
// kBatch row loads in flight before accumulating.
#pragma once

#include "kernels/common.cuh"

namespace machmoe::kernels {

struct AggregateParams {
  const void* rows;             // [R, d]
  const int32_t* pair_row;      // [R]
  const int32_t* token_offsets; // [T+1]
  const float* scores;          // [R] or null
  void* out;                    // [T, d]
  int64_t T, d;
};

template <typename TOut, int N>
__device__ __forceinline__ void store_floats(TOut* dst, const float (&v)[N]) {
  // N floats -> N elements of TOut, in 16-byte stores.
  constexpr int per = Vec16<TOut>::kElems;
#pragma unroll
  for (int c = 0; c < N; c += per) {
    Vec16<TOut> o;
#pragma unroll
    for (int i = 0; i < per; ++i) o.elem[i] = from_float<TOut>(v[c + i]);
    store_vec16(dst + c, o);
  }
}

// Vector path: d % (16 / sizeof(TIn)) == 0 and rows/out 16-byte aligned (checked by the launcher).
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(256) aggregate_rows_vec(AggregateParams p) {
  constexpr int kElems = Vec16<TIn>::kElems;
  constexpr int kBatch = 8;
  static_assert(kElems % Vec16<TOut>::kElems == 0, "output vector must divide the input vector");
  const int64_t t = blockIdx.x;
  const int begin = p.token_offsets[t], end = p.token_offsets[t + 1];
  const TIn* rows = static_cast<const TIn*>(p.rows);
  TOut* out = static_cast<TOut*>(p.out) + t * p.d;
  const int64_t nvec = p.d / kElems;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float acc[kElems] = {};
    for (int b = begin; b < end; b += kBatch) {
      Vec16<TIn> x[kBatch];
      float s[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {  // issue every load of the batch before using any
        const int pair = b + i;
        const int row = pair < end ? p.pair_row[pair] : -1;
        s[i] = row < 0 ? 0.f : (p.scores ? p.scores[pair] : 1.f);
        x[i].raw = row < 0 ? make_uint4(0, 0, 0, 0)
                           : load_vec16(rows + static_cast<int64_t>(row) * p.d + v * kElems).raw;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
#pragma unroll
        for (int j = 0; j < kElems; ++j) acc[j] += s[i] * to_float(x[i].elem[j]);
    }
    store_floats<TOut>(out + v * kElems, acc);
  }
}

// Scalar path for any d and alignment.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(256) aggregate_rows_scalar(AggregateParams p) {
  const int64_t t = blockIdx.x;
  const int begin = p.token_offsets[t], end = p.token_offsets[t + 1];
  const TIn* rows = static_cast<const TIn*>(p.rows);
  TOut* out = static_cast<TOut*>(p.out) + t * p.d;
  for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
    float acc = 0.f;
    for (int pair = begin; pair < end; ++pair) {
      const int row = p.pair_row[pair];
      if (row < 0) continue;
      acc += (p.scores ? p.scores[pair] : 1.f) * to_float(rows[static_cast<int64_t>(row) * p.d + c]);
    }
    out[c] = from_float<TOut>(acc);
  }
}

}  // namespace machmoe::kernels
