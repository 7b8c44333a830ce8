// The router bias b_r [E] (logits = x·Wrᵀ + b_r): the forward's broadcast of b_r into logits [T, E]
// before the router GEMM adds x·Wrᵀ to them (beta = 1), and the backward's d b_r = Σ_t d_logits
// [T, E] as fixed-order column sums (no float atomics: bitwise deterministic).
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"

namespace machmoe::kernels {

// logits [T, E] fp32 <- bias [E] bf16 on every row.
__global__ void __launch_bounds__(256) router_bias_broadcast(const __nv_bfloat16* bias, int64_t T, int E,
                                                             float* logits) {
  const int64_t total = T * E;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    logits[i] = __bfloat162float(bias[i % E]);
}

constexpr int kBiasGradRowsPerThread = 8;  // block: 32 columns × 8 row lanes
constexpr int kBiasGradMaxChunks = 128;    // partial sums per column (pass 1's grid.y)

// Pass 1: partials [chunks, E] fp32, chunk c = rows [c·rows_per_chunk, ...) of d_logits [T, E].
// Block (x, c): columns 32x .. 32x+31; thread (lane, r) sums rows r, r + 8, ... of the chunk, then
// the 8 row lanes are added in order.
__global__ void __launch_bounds__(256) router_bias_grad_partial(const float* d_logits, int64_t T, int E,
                                                                int64_t rows_per_chunk, float* partials) {
  __shared__ float part[kBiasGradRowsPerThread][kWarpSize];
  const int lane = threadIdx.x % kWarpSize, r = threadIdx.x / kWarpSize;
  const int col = blockIdx.x * kWarpSize + lane;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < T ? begin + rows_per_chunk : T;
  float s = 0.f;
  if (col < E)
    for (int64_t t = begin + r; t < end; t += kBiasGradRowsPerThread) s += d_logits[t * E + col];
  part[r][lane] = s;
  __syncthreads();
  if (r == 0 && col < E) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kBiasGradRowsPerThread; ++i) total += part[i][lane];
    partials[static_cast<int64_t>(blockIdx.y) * E + col] = total;
  }
}

// Pass 2: d_bias [E] (fp32 or bf16) = Σ over the chunks in order.
template <typename Out>
__global__ void __launch_bounds__(256) router_bias_grad_finish(const float* partials, int chunks, int E, Out* d_bias) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= E) return;
  float s = 0.f;
  for (int c = 0; c < chunks; ++c) s += partials[static_cast<int64_t>(c) * E + col];
  if constexpr (sizeof(Out) == 2) d_bias[col] = __float2bfloat16_rn(s);
  else d_bias[col] = s;
}

}  // namespace machmoe::kernels
