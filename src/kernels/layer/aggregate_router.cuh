// The backward's dX aggregation and the router's part of dx in one pass, so that dx is written once:
//   dx[t, :] = Σ_{p in [token_offsets[t], token_offsets[t+1])} dX̃[pair_row[p], :]  +  d_logits[t, :] · Wr
//              (+ rank1_coef[t] · rank1_row[:], when given: Qwen's shared-expert gate)
// dX̃ [R, d] bf16, d_logits [T, E] bf16, Wr [E, d] bf16 (the router weight), dx [T, d] bf16,
// rank1_coef [T] fp32, rank1_row [d] bf16; the sums are fp32 and dx is rounded once. The alternative, the aggregation writing dx and a cuBLAS
// GEMM with beta = 1 reading and writing it again, moves 2·T·d·2 bytes more; on an H100 it took
// 241 + 72 µs per call at 7B-a against this kernel's 269, and 823 + 257 at 30B-b against 934.
// Block: 128 columns of d, 512 threads (16 warps), persistent over token tiles of 64:
//   0. Wr[:, its columns] (E <= 256 rows) into shared memory once;
//   per tile: 1. the d_logits tile [64, E] in shared memory (for E <= 128 loaded by cp.async
//   during the previous tile's step 3); 2. G [64, 128] = d_logits · Wr on the tensor cores
//   (mma.sync m16n8k16, fp32; warp w owns rows 16·(w % 4), columns 32·(w / 4)), G to shared
//   memory as fp32; 3. thread (token row i / 16 + 32·pass,
//   16-byte column vector i % 16): the token's dX̃ rows, up to 8 loads in flight, + G; one store.
// Why persistent: re-reading Wr per 64-token tile (48 KB of operand loads per tile) makes the mma
// phase too long to hide behind the dX̃ loads (on an H100 at 7B-a: 306 µs per call); Wr once per
// block gives 291, and the next tile's d_logits by cp.async under this tile's sums with a grid of
// one wave 269.
// Needs d % 8 == 0, E <= 256, 16-byte aligned dX̃ / Wr / dx / rank1_row and R·d/8 < 2^32 (the launcher
// checks; otherwise the layer falls back to the aggregation and a cuBLAS GEMM). d_logits rows are read by 16-byte
// vectors when E % 8 == 0 and element by element otherwise. Deterministic: fixed summation order.
#pragma once

#include <cuda_bf16.h>

#include "kernels/layer/aggregate.cuh"
#include "kernels/common.cuh"
#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

struct AggregateRouterParams {
  const __nv_bfloat16* rows;      // [R, d] dX̃
  const int32_t* pair_row;        // [pairs] (-1: no row)
  const int32_t* token_offsets;   // [T+1]
  const __nv_bfloat16* d_logits;  // [T, E]
  const __nv_bfloat16* wr;        // [E, d]
  __nv_bfloat16* out;             // [T, d]
  const float* rank1_coef;        // [T] or null: no rank-1 term
  const __nv_bfloat16* rank1_row;  // [d], with rank1_coef
  int64_t T, d;
  int E;
};

constexpr int kAggRouterTokens = 64;   // tokens per tile
constexpr int kAggRouterCols = 128;    // columns of d per block
constexpr int kAggRouterMaxE = 256;    // Wr[:, block's columns] must fit shared memory
constexpr int kAggRouterThreads = 512; // 16 warps: 4 x 4 warp tiles of 16 rows x 32 columns

// Shared memory, dynamic (size by E): Wr slice [E16][kLdB] bf16 | G [64][kLdG] fp32 | d_logits
// tile(s) [64][E16 + 8] bf16. kPrefetch (E16 <= 128): two d_logits tiles, the next one loaded by
// cp.async while this tile's sums run; otherwise (E16 <= 256) one, over G's space, loaded in turn
// (so that two blocks still fit an SM).
// Padded row strides put the 8 rows an ldmatrix reads in different 16-byte bank groups (272 bytes
// ≡ 4 banks mod 32); 136 floats (≡ 8 banks) keep the fp32 fragment stores conflict-free per
// half-warp.
constexpr int kAggRouterLdB = kAggRouterCols + 8;  // bf16
constexpr int kAggRouterLdG = kAggRouterCols + 8;  // fp32
__host__ __device__ constexpr int agg_router_e16(int E) { return (E + 15) / 16 * 16; }
__host__ __device__ constexpr int agg_router_lda(int E) { return agg_router_e16(E) + 8; }
__host__ __device__ constexpr bool agg_router_prefetch(int E) { return agg_router_e16(E) <= 128; }
__host__ __device__ constexpr size_t agg_router_wr_bytes(int E) {
  return static_cast<size_t>(agg_router_e16(E)) * kAggRouterLdB * 2;
}
__host__ __device__ constexpr size_t agg_router_g_bytes() { return size_t{kAggRouterTokens} * kAggRouterLdG * 4; }
__host__ __device__ constexpr size_t agg_router_a_bytes(int E) {
  return static_cast<size_t>(kAggRouterTokens) * agg_router_lda(E) * 2;
}
__host__ __device__ constexpr size_t agg_router_smem_bytes(int E) {
  return agg_router_wr_bytes(E) + (agg_router_prefetch(E) ? agg_router_g_bytes() + 2 * agg_router_a_bytes(E)
                                                          : (agg_router_g_bytes() > agg_router_a_bytes(E)
                                                                 ? agg_router_g_bytes()
                                                                 : agg_router_a_bytes(E)));
}

// The most any E <= kAggRouterMaxE needs (the launcher opts the kernels in to this once).
__host__ __device__ constexpr size_t agg_router_smem_max() {
  return agg_router_smem_bytes(128) > agg_router_smem_bytes(kAggRouterMaxE) ? agg_router_smem_bytes(128)
                                                                            : agg_router_smem_bytes(kAggRouterMaxE);
}

// The d_logits rows t0 .. t0 + 63 (zeros past T and E) -> a_s [64][lda]: by cp.async where rows are
// 16-byte vectors (E % 8 == 0; the caller commits and waits), element by element otherwise.
__device__ __forceinline__ void agg_router_load_tile(const AggregateRouterParams& p, int64_t t0, int E16, int lda,
                                                     __nv_bfloat16* a_s, bool e_vec) {
  for (int v = threadIdx.x; v < kAggRouterTokens * (E16 / 8); v += kAggRouterThreads) {
    const int r = v / (E16 / 8), c = (v % (E16 / 8)) * 8;
    const int64_t t = t0 + r;
    const __nv_bfloat16* src = p.d_logits + t * p.E + c;
    if (e_vec) {
      const bool ok = t < p.T && c < p.E;
      sm90::cp_async_16(sm90::smem_addr(a_s + r * lda + c), ok ? static_cast<const void*>(src) : p.d_logits, ok ? 16 : 0);
    } else {
      uint4 val = make_uint4(0, 0, 0, 0);
      __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(&val);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (t < p.T && c + k < p.E) x[k] = src[k];
      *reinterpret_cast<uint4*>(a_s + r * lda + c) = val;
    }
  }
}

// grid (column blocks, token groups); a block walks token tiles blockIdx.y, + gridDim.y, ...
// Column blocks are blockIdx.x, so that the blocks running at the same time read whole rows of
// dX̃ between them (DRAM pages), not one 256-byte piece of many rows each.
template <bool kPrefetch>
__global__ void __launch_bounds__(kAggRouterThreads) aggregate_rows_router(AggregateRouterParams p) {
  extern __shared__ uint4 agg_router_smem[];
  const int E16 = agg_router_e16(p.E), lda = agg_router_lda(p.E);
  auto* base = reinterpret_cast<uint8_t*>(agg_router_smem);
  auto* wr_s = reinterpret_cast<__nv_bfloat16*>(base);  // [E16][kLdB]
  auto* g_s = reinterpret_cast<float*>(base + agg_router_wr_bytes(p.E));  // [64][kLdG]
  // [64][lda] d_logits tiles: tile b at a_s + b·a_step (one, over G, without prefetch)
  auto* a_s = reinterpret_cast<__nv_bfloat16*>(base + agg_router_wr_bytes(p.E) + (kPrefetch ? agg_router_g_bytes() : 0));
  const int a_step = kPrefetch ? kAggRouterTokens * lda : 0;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kAggRouterCols;
  const bool e_vec = p.E % 8 == 0;
  const int64_t tiles = (p.T + kAggRouterTokens - 1) / kAggRouterTokens;
  if (static_cast<int64_t>(blockIdx.y) >= tiles) return;  // (the launcher never makes such blocks)

  // ---- Wr[:, columns] once per block: E16 rows x 16 vectors (zeros past E and d; d % 8 == 0)
  for (int v = tid; v < E16 * 16; v += kAggRouterThreads) {
    const int r = v / 16, c = (v % 16) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < p.E && col0 + c < p.d) val = __ldg(reinterpret_cast<const uint4*>(p.wr + r * p.d + col0 + c));
    *reinterpret_cast<uint4*>(wr_s + r * kAggRouterLdB + c) = val;
  }
  if constexpr (kPrefetch) {
    agg_router_load_tile(p, static_cast<int64_t>(blockIdx.y) * kAggRouterTokens, E16, lda, a_s, e_vec);
    sm90::cp_async_commit();
  }

  const int m0 = 16 * (warp % 4), n0 = 32 * (warp / 4);
  const int vcol = (tid % 16) * 8;
  const bool col_ok = col0 + vcol < p.d;
  // The rank-1 row's 8 columns of this thread, once (the same for every token it sums).
  __nv_bfloat16 rank1[8];
  {
    Vec16<__nv_bfloat16> v;
    v.raw = p.rank1_coef != nullptr && col_ok ? __ldg(reinterpret_cast<const uint4*>(p.rank1_row + col0 + vcol))
                                              : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < 8; ++k) rank1[k] = v.elem[k];
  }
  const uint4* rows16 = reinterpret_cast<const uint4*>(p.rows);
  const uint32_t d16 = static_cast<uint32_t>(p.d / 8), vunit = static_cast<uint32_t>((col0 + vcol) / 8);
  int buf = 0;
  for (int64_t ty = blockIdx.y; ty < tiles; ty += gridDim.y, buf ^= 1) {
    const int64_t t0 = ty * kAggRouterTokens;
    // ---- 1. this tile's d_logits in shared memory (and the previous tile's sums done with G)
    if constexpr (kPrefetch) {
      sm90::cp_async_wait<0>();
    } else {
      agg_router_load_tile(p, t0, E16, lda, a_s, e_vec);
      sm90::cp_async_commit();
      sm90::cp_async_wait<0>();
    }
    __syncthreads();  // (also Wr, on the first tile)
    // ---- 2. G [64, 128] = d_logits tile · Wr slice (mma.sync m16n8k16, fp32)
    const __nv_bfloat16* a_tile = a_s + buf * a_step;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
#pragma unroll 1
    for (int ks = 0; ks < E16 / 16; ++ks) {
      uint32_t a[4];
      // matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15): a0..a3 of the m16n8k16 A fragment
      sm90::ldmatrix_x4(sm90::smem_addr(a_tile + (m0 + lane % 16) * lda + ks * 16 + (lane / 16) * 8), a);
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        // B is [k][n] in shared memory: transposed loads give the "col" fragment; matrices
        // (k 0-7, n-tile j), (k 8-15, j), (k 0-7, j + 1), (k 8-15, j + 1).
        uint32_t b[4];
        sm90::ldmatrix_x4_trans(sm90::smem_addr(wr_s + (ks * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kAggRouterLdB +
                                                n0 + j * 8 + (lane / 16) * 8),
                                b);
        sm90::mma_bf16_16816(acc[j], a, b[0], b[1]);
        sm90::mma_bf16_16816(acc[j + 1], a, b[2], b[3]);
      }
    }
    if constexpr (kPrefetch) {
      // The next tile's d_logits into the other buffer (its last reader, the previous tile's
      // mma, finished before the barrier above), in flight during this tile's sums.
      if (ty + gridDim.y < tiles) agg_router_load_tile(p, t0 + int64_t{gridDim.y} * kAggRouterTokens, E16, lda, a_s + (buf ^ 1) * a_step, e_vec);
      sm90::cp_async_commit();
    } else {
      __syncthreads();  // G overwrites the d_logits tile
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = m0 + lane / 4, c = n0 + 8 * j + 2 * (lane % 4);
      *reinterpret_cast<float2*>(g_s + r * kAggRouterLdG + c) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(g_s + (r + 8) * kAggRouterLdG + c) = make_float2(acc[j][2], acc[j][3]);
    }
    __syncthreads();

    // ---- 3. + the token's dX̃ rows (+ the rank-1 term), one store: thread (token row
    //         tid / 16 + 32·pass, vector tid % 16)
    constexpr int kBatch = 8;
#pragma unroll 1
    for (int r = tid / 16; r < kAggRouterTokens; r += kAggRouterThreads / 16) {
      const int64_t t = t0 + r;
      if (!col_ok || t >= p.T) break;
      const int begin = __ldg(p.token_offsets + t), end = __ldg(p.token_offsets + t + 1);
      float s[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) s[k] = g_s[r * kAggRouterLdG + vcol + k];
      if (p.rank1_coef != nullptr) {
        const float c = __ldg(p.rank1_coef + t);
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] += c * __bfloat162float(rank1[k]);
      }
      for (int b = begin; b < end; b += kBatch) {
        Vec16<__nv_bfloat16> x[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {  // every load of the batch before any use
          const int row = b + i < end ? __ldg(p.pair_row + b + i) : -1;
          // 32-bit offsets in 16-byte units (the launcher bounds R·d/8 below 2^32)
          x[i].raw = row < 0 ? make_uint4(0, 0, 0, 0) : __ldg(rows16 + (static_cast<uint32_t>(row) * d16 + vunit));
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
#pragma unroll
          for (int k = 0; k < 8; ++k) s[k] += __bfloat162float(x[i].elem[k]);
      }
      store_floats<__nv_bfloat16>(p.out + t * p.d + col0 + vcol, s);
    }
    if constexpr (!kPrefetch) __syncthreads();  // the next tile's d_logits overwrite G
  }
  if constexpr (kPrefetch) sm90::cp_async_wait<0>();
}

}  // namespace machmoe::kernels
