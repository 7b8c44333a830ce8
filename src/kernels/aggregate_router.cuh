// Kernel families 10 and 11 of SPEC §2 in one pass: the backward's dX aggregation together with the
// router's part of dx, so that dx is written once:
//   dx[t, :] = Σ_{p in [token_offsets[t], token_offsets[t+1])} dX̃[pair_row[p], :]  +  d_logits[t, :] · Wr
// dX̃ [R, d] bf16, d_logits [T, E] bf16, Wr [E, d] bf16 (the router weight), dx [T, d] bf16; the
// sums are fp32 and dx is rounded once. Before, the aggregation wrote dx and a cuBLAS GEMM with
// beta = 1 read and wrote it again (2·T·d·2 bytes more). Measured on the H100 (session 8, 7B-a /
// 30B-b): this kernel 308 / 1071 µs against 241 + 72 / 824 + 257 µs for the two; it moves DRAM
// bytes at ~2.2 TB/s where the plain aggregation reaches 2.8, for reasons not yet separated (4 vs 3
// blocks per SM made no difference; a cp.async ring for the rows was slower: docs/PERF.md).
// Block: 64 tokens x 128 columns, 256 threads (8 warps), 64 registers (4 blocks per SM):
//   1. G [64, 128] = d_logits[tokens, :] · Wr[:, columns] on the tensor cores (mma.sync m16n8k16,
//      fp32), E in chunks of 64 through shared memory; warp w owns rows 16·(w % 4), columns
//      64·(w / 4). G then goes to shared memory as fp32 (over the operand tiles).
//   2. thread (token row i / 16 + 16·pass, 16-byte column vector i % 16): the token's dX̃ rows,
//      up to 8 loads in flight, + G; one 16-byte store.
// Needs d % 8 == 0, 16-byte aligned dX̃ / Wr / dx and R·d/8 < 2^32 (the launcher checks; otherwise
// the layer falls back to the aggregation and a cuBLAS GEMM). d_logits rows are read by 16-byte
// vectors when E % 8 == 0 and element by element otherwise. Deterministic: fixed summation order.
#pragma once

#include <cuda_bf16.h>

#include "kernels/aggregate.cuh"
#include "kernels/common.cuh"
#include "kernels/sm90_ptx.cuh"

namespace machmoe::kernels {

struct AggregateRouterParams {
  const __nv_bfloat16* rows;      // [R, d] dX̃
  const int32_t* pair_row;        // [pairs] (-1: no row)
  const int32_t* token_offsets;   // [T+1]
  const __nv_bfloat16* d_logits;  // [T, E]
  const __nv_bfloat16* wr;        // [E, d]
  __nv_bfloat16* out;             // [T, d]
  int64_t T, d;
  int E;
};

constexpr int kAggRouterTokens = 64;  // tokens per block
constexpr int kAggRouterCols = 128;   // columns of d per block
constexpr int kAggRouterChunkE = 64;  // experts per shared-memory chunk
constexpr int kAggRouterThreads = 256;

// Padded row strides: 144 and 272 bytes put the 8 rows an ldmatrix reads in 8 different 16-byte
// bank groups; 136 floats (≡ 8 banks mod 32) keep the fp32 fragment stores conflict-free per
// half-warp.
constexpr int kAggRouterLdA = kAggRouterChunkE + 8;  // bf16
constexpr int kAggRouterLdB = kAggRouterCols + 8;    // bf16
constexpr int kAggRouterLdG = kAggRouterCols + 8;    // fp32
struct AggregateRouterSmem {
  union {
    struct {
      __nv_bfloat16 a[kAggRouterTokens][kAggRouterLdA];  // d_logits chunk [64 tokens][64 experts]
      __nv_bfloat16 b[kAggRouterChunkE][kAggRouterLdB];  // Wr chunk [64 experts][128 columns]
    } op;
    float g[kAggRouterTokens][kAggRouterLdG];  // G, once every chunk is multiplied
  };
};

__global__ void __launch_bounds__(kAggRouterThreads, 4) aggregate_rows_router(AggregateRouterParams p) {
  __shared__ __align__(16) AggregateRouterSmem sm;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // Column blocks are blockIdx.x, so that the blocks running at the same time read whole rows of
  // dX̃ between them (DRAM pages), not one 256-byte piece of many rows each.
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kAggRouterTokens;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kAggRouterCols;
  const bool e_vec = p.E % 8 == 0;

  // ---- 1. G = d_logits · Wr on the tensor cores
  const int m0 = 16 * (warp % 4), n0 = 64 * (warp / 4);
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  for (int e0 = 0; e0 < p.E; e0 += kAggRouterChunkE) {
    // d_logits chunk: 64 rows x 8 vectors of 8 experts (zeros past T and E).
#pragma unroll
    for (int i = 0; i < kAggRouterTokens * 8 / kAggRouterThreads; ++i) {
      const int v = tid + i * kAggRouterThreads, r = v / 8, c = (v % 8) * 8;
      const int64_t t = t0 + r;
      const int e = e0 + c;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (t < p.T) {
        const __nv_bfloat16* src = p.d_logits + t * p.E + e;
        if (e_vec) {
          if (e < p.E) val = __ldg(reinterpret_cast<const uint4*>(src));
        } else {
          __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(&val);
#pragma unroll
          for (int k = 0; k < 8; ++k)
            if (e + k < p.E) x[k] = src[k];
        }
      }
      *reinterpret_cast<uint4*>(&sm.op.a[r][c]) = val;
    }
    // Wr chunk: 64 expert rows x 16 vectors of 8 columns (zeros past E and d; d % 8 == 0).
#pragma unroll
    for (int i = 0; i < kAggRouterChunkE * 16 / kAggRouterThreads; ++i) {
      const int v = tid + i * kAggRouterThreads, r = v / 16, c = (v % 16) * 8;
      const int e = e0 + r;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (e < p.E && col0 + c < p.d) val = __ldg(reinterpret_cast<const uint4*>(p.wr + e * p.d + col0 + c));
      *reinterpret_cast<uint4*>(&sm.op.b[r][c]) = val;
    }
    __syncthreads();
#pragma unroll 1
    for (int ks = 0; ks < kAggRouterChunkE / 16; ++ks) {
      uint32_t a[4];
      // matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15): a0..a3 of the m16n8k16 A fragment
      sm90::ldmatrix_x4(sm90::smem_addr(&sm.op.a[m0 + lane % 16][ks * 16 + (lane / 16) * 8]), a);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        // B is [k][n] in shared memory: transposed loads give the "col" fragment; matrices
        // (k 0-7, n-tile j), (k 8-15, j), (k 0-7, j + 1), (k 8-15, j + 1).
        uint32_t b[4];
        sm90::ldmatrix_x4_trans(
            sm90::smem_addr(&sm.op.b[ks * 16 + lane % 8 + ((lane / 8) % 2) * 8][n0 + j * 8 + (lane / 16) * 8]), b);
        sm90::mma_bf16_16816(acc[j], a, b[0], b[1]);
        sm90::mma_bf16_16816(acc[j + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next chunk (or G) overwrites the operand tiles
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = m0 + lane / 4, c = n0 + 8 * j + 2 * (lane % 4);
    *reinterpret_cast<float2*>(&sm.g[r][c]) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(&sm.g[r + 8][c]) = make_float2(acc[j][2], acc[j][3]);
  }
  __syncthreads();

  // ---- 2. + the token's dX̃ rows, one store
  constexpr int kBatch = 8;
  const int vcol = (tid % 16) * 8;
  if (col0 + vcol >= p.d) return;  // no barrier below
  const uint4* rows16 = reinterpret_cast<const uint4*>(p.rows);
  const uint32_t d16 = static_cast<uint32_t>(p.d / 8), vunit = static_cast<uint32_t>((col0 + vcol) / 8);
  for (int r = tid / 16; r < kAggRouterTokens; r += kAggRouterThreads / 16) {
    const int64_t t = t0 + r;
    if (t >= p.T) break;
    float s[8];
    const float4 g0 = *reinterpret_cast<const float4*>(&sm.g[r][vcol]);
    const float4 g1 = *reinterpret_cast<const float4*>(&sm.g[r][vcol + 4]);
    s[0] = g0.x, s[1] = g0.y, s[2] = g0.z, s[3] = g0.w, s[4] = g1.x, s[5] = g1.y, s[6] = g1.z, s[7] = g1.w;
    const int begin = __ldg(p.token_offsets + t), end = __ldg(p.token_offsets + t + 1);
    for (int b = begin; b < end; b += kBatch) {
      Vec16<__nv_bfloat16> x[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {  // every load of the batch before any use
        const int row = b + i < end ? __ldg(p.pair_row + b + i) : -1;
        // 32-bit offsets in 16-byte units (the launcher bounds R·d/8 below 2^32): one register
        // per load in flight besides its data, so that 4 blocks fit an SM
        x[i].raw = row < 0 ? make_uint4(0, 0, 0, 0)
                           : __ldg(rows16 + (static_cast<uint32_t>(row) * d16 + vunit));
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] += __bfloat162float(x[i].elem[k]);
    }
    store_floats<__nv_bfloat16>(p.out + t * p.d + col0 + vcol, s);
  }
}

}  // namespace machmoe::kernels
