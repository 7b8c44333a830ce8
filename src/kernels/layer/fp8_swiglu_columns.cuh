// The FP8 experts' SwiGLU backward fused with the column quantisation of its two wgrad operands
// (host/quant/fp8_swiglu_columns.cu). Per 128-row chunk of an expert (the column layout of
// machmoe/fp8.hpp: chunk_offsets, rows past the expert's end zero), from dA' [R, n] bf16 and the
// saved E4M3 H [R, n1 = 2n] with its 1x128 scales, it writes
//   d_scores[row_pair[r]]              fp32, each row's Σ_j dA'·A
//   dh_q [R, n1], dh_scales [R, h_tiles]      dH's E4M3 rows (1x128 tiles along n1)
//   dh_qt [max_chunks, n1, 128], dh_col_scales [max_chunks, n1]   dH's columns by chunk (dW1's operand)
//   ap_qt [max_chunks, n, 128], ap_col_scales [max_chunks, n]     A''s columns by chunk (dW2's operand)
//   dh_col_sums [max_chunks, n1] fp32  (with expert biases, else null) each chunk's column sums of
//                                      the bf16 dH: db1's partials, added per expert in chunk order
// bitwise what the unfused path writes: fp8_swiglu_backward (with dh_q) for the first three, then
// the column quantiser (kernels/quant/columns.cuh) on its bf16 dH and A'. dH and A' never reach
// global memory: they exist only as the bf16 values staged in shared memory for the columns.
//
// Bitwise, and why. The per-group math is fp8_swiglu_math.cuh's, which the unfused kernel calls
// too. The d score: the unfused kernel gives a row to a warp whose lane l adds its groups
// c = 32·t + l (t = 0, 1, ...) in order into one fp32 partial, then sums the 32 partials by an
// xor-shuffle tree. Here a warp owns 16 rows of the chunk through all slabs, slab t being exactly
// the unfused kernel's iteration t (lane l: group 32·t + l), and each lane keeps its 16 partials
// across the slabs (in shared memory: in registers they made ptxas spill): the same chain per
// lane, the same tree at the end. dH's rows: the same 16-lane tiles as the unfused kernel. The
// columns: the bf16 values staged exactly as the column quantiser stages its input tile
// ([128 rows][128] bf16, zeros past the chunk's rows), then its tile step
// (kernels/quant/columns_tile.cuh).
//
// Work item: one chunk (a CTA, 256 threads, 2 CTAs per SM), its slabs of 32 groups (128 j: 128
// columns of dA' and A', 256 of dH and H) in order. Per slab:
//   A. compute: warp w takes chunk rows [16w, 16w + 16), in batches of kSwcRowBatch rows (their
//      loads issued together); writes dH's E4M3 rows and stages dH (two tiles: the slab's dH
//      columns [0, 128) and [128, 256)) and A' (one tile) in shared memory;
//   B. columns: for each of the three tiles, the column quantiser's reduce / scales / codes /
//      store (three barriers each: the codes overwrite their own input tile), a partial tile past
//      n1 or n skipped or cut to its columns.
// After the last slab, each warp's 16 d scores.
// Measured on an H200 (30B-b, R = 262144, n = 512, in the layer's backward): 0.70 ms against
// 0.89 ms for the three passes it replaces (the SwiGLU backward 0.51, dH's columns 0.25, A''s
// 0.13), and the workspace loses dH and A' in bf16 (the layer's peak 5.09 -> 4.86 GiB). Nothing
// prefetches the next slab while the columns are quantised (the registers are at their cap).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/layer/fp8_swiglu_math.cuh"
#include "kernels/quant/columns_tile.cuh"

namespace machmoe::kernels {

constexpr int kSwcThreads = fp8::kColsThreads;               // 8 warps (the column tile step's)
constexpr int kSwcWarps = kSwcThreads / kWarpSize;
constexpr int kSwcRowsPerWarp = fp8::kTile / kSwcWarps;      // 16 chunk rows per warp in phase A
constexpr int kSwcRowBatch = 8;                              // rows whose loads a warp issues together
constexpr int kSwcGroupsPerSlab = kWarpSize;                 // one group of 4 j per lane
constexpr int kSwcTiles = 3;                                 // dH columns [0, 128), [128, 256), A'
constexpr int kSwcCtasPerSm = 2;
// Shared memory (dynamic): 3 input tiles [128 rows][128 bf16] (each in turn its columns' codes
// [128 columns][128]) | the d-score partials [16 rows of a warp][256 threads] fp32 | the chunk's
// row scores [128] fp32: 112.5 KiB, two CTAs per SM of an H100/H200's 228 KiB (each CTA also
// takes 1 KiB of the runtime's).
constexpr size_t kSwcSmemBytes =
    16 * size_t{kSwcTiles} * fp8::kInUnits + 4 * size_t{kSwcRowsPerWarp} * kSwcThreads + 4 * size_t{fp8::kTile};
static_assert(16 * fp8::kOutUnits <= 16 * fp8::kInUnits, "a tile's codes fit in its input tile");
static_assert(kSwcRowsPerWarp % kSwcRowBatch == 0, "whole batches per warp");
static_assert(8 * kSwcGroupsPerSlab == 2 * fp8::kColsSlab, "a slab's dH columns are two column tiles");
static_assert(4 * kSwcGroupsPerSlab == fp8::kColsSlab, "a slab's A' columns are one column tile");

struct Fp8SwigluColumnsParams {
  const __nv_bfloat16* da;        // [R, n] dA'
  const uint8_t* hq;              // [R, n1] E4M3, gate j at column 2j, up j at 2j+1
  const float* h_scales;          // [R, h_tiles], h_tiles = ceil(n1 / 128)
  const float* scores;            // [pairs] fp32
  const int32_t* row_pair;        // [R] row -> pair
  int64_t R;
  int n, n1, h_tiles;             // n % 16 == 0, n1 = 2n
  const int32_t* offsets;         // [E+1] expert_offsets
  int64_t E;
  const int32_t* chunk_offsets;   // [E+1], from fp8_chunk_offsets_kernel (launched before)
  int64_t max_chunks;             // fp8_columns_layout(R, E, ·)
  float* d_scores;                // [pairs], written at row_pair[r]
  uint8_t* dh_q;                  // [R, n1]
  float* dh_scales;               // [R, h_tiles]
  uint8_t* dh_qt;                 // [max_chunks, n1, 128]
  float* dh_col_scales;           // [max_chunks, n1]
  uint8_t* ap_qt;                 // [max_chunks, n, 128]
  float* ap_col_scales;           // [max_chunks, n]
  float* dh_col_sums;             // [max_chunks, n1] or null (no expert biases)
  GluClampLimits clamp;           // kClamped: the clamped SwiGLU's parameters
};

// Phase A for one batch of rows (chunk rows first + k0 + b, b < kSwcRowBatch) of the lane's
// group g (in_row: g < n/4): loads, the group math, dH's E4M3 row codes and scale, the staging.
// Rows past the chunk's (i >= nrows, warp-uniform) are staged as zeros and write nothing.
// dot: this thread's d-score partials in shared memory, row first + k at dot[k·256].
template <bool kClamped>
__device__ __forceinline__ void compute_batch(const Fp8SwigluColumnsParams& p, int64_t row0, int nrows, int first,
                                              int k0, int g, bool in_row, int lane, const float* row_scores,
                                              float* dot, uint4* tiles) {
  uint2 da4[kSwcRowBatch], h8[kSwcRowBatch];
  float hs[kSwcRowBatch];
#pragma unroll
  for (int b = 0; b < kSwcRowBatch; ++b) {
    const int i = first + k0 + b;
    da4[b] = make_uint2(0, 0), h8[b] = make_uint2(0, 0), hs[b] = 0.f;
    if (i < nrows && in_row) {
      const int64_t r = row0 + i;
      da4[b] = __ldg(reinterpret_cast<const uint2*>(p.da + r * p.n + 4 * g));
      h8[b] = __ldg(reinterpret_cast<const uint2*>(p.hq + r * p.n1 + 8 * g));
      hs[b] = __ldg(p.h_scales + r * p.h_tiles + (8 * g) / fp8::kTile);
    }
  }
  uint2* const ap_tile = reinterpret_cast<uint2*>(tiles + 2 * fp8::kInUnits);  // [128 rows][32 groups]
#pragma unroll
  for (int b = 0; b < kSwcRowBatch; ++b) {
    const int k = k0 + b, i = first + k;
    uint4 dh8 = make_uint4(0, 0, 0, 0);  // the group's eight dH columns, bf16
    uint2 a4 = make_uint2(0, 0);         // its four A' columns, bf16
    if (i < nrows) {
      const int64_t r = row0 + i;
      if (in_row) {
        float partial = dot[k * kSwcThreads];
        const SwigluGroup gr = swiglu_backward_group<kClamped>(da4[b], h8[b], hs[b], row_scores[i], partial, p.clamp);
        dot[k * kSwcThreads] = partial;
        dh8 = gr.dh8, a4 = gr.a4;
      }
      // dH's row tile: 16 lanes' groups = 128 columns (lanes past the row hold zeros).
      const fp8::TileScale t = fp8::tile_scale(fp8::group_max_bits<16>(fp8::abs_max_bits8(dh8)));
      if (in_row) {
        *reinterpret_cast<uint2*>(p.dh_q + r * p.n1 + 8 * g) = fp8::quantize8(dh8, t);
        if (lane % 16 == 0) p.dh_scales[r * p.h_tiles + (8 * g) / fp8::kTile] = t.s;
      }
    }
    // Lanes 0-15: the slab's dH columns [0, 128) (tile 0), lanes 16-31: [128, 256) (tile 1);
    // 16 bytes each at unit lane % 16 of row i. A': 8 bytes at group lane of row i (tile 2).
    tiles[(lane / 16) * fp8::kInUnits + i * fp8::kUnitsPerRow + lane % 16] = dh8;
    ap_tile[i * kSwcGroupsPerSlab + lane] = a4;
  }
}

// Phase B for one staged tile: the column quantiser's tile step on columns [col0, col0 + ncols)
// of an operand qt [max_chunks, cols, 128] / scales [max_chunks, cols] (ncols a multiple of 16, > 0). The
// codes [128 columns][128] go into the tile itself (its first 16 KiB) once every thread has read
// its values and partial amaxes (one barrier more than the column quantiser, which has an out
// tile of its own: here those 16 KiB hold the d-score partials).
__device__ __forceinline__ void quantize_tile(uint4* tile, uint8_t* qt, float* scales, int64_t cols, int64_t c,
                                              int64_t col0, int ncols, int nrows, int rg, int wcol, int tid) {
  uint32_t w[fp8::kRowsPerWarp];
  const uint32_t m = fp8::reduce_amax2(reinterpret_cast<uint32_t*>(tile), rg, wcol, w);
  const fp8::TileScale s_lo = fp8::tile_scale(m & 0xffffu), s_hi = fp8::tile_scale(m >> 16);
  if (rg == 0 && 2 * wcol < ncols) {
    scales[fp8::column_scale_index(cols, c, col0 + 2 * wcol)] = s_lo.s;
    scales[fp8::column_scale_index(cols, c, col0 + 2 * wcol + 1)] = s_hi.s;
  }
  __syncthreads();  // the tile's values and partial amaxes are read: it takes the codes
  fp8::quantize_codes(w, s_lo, s_hi, rg, wcol, nrows, tile);
  __syncthreads();
  fp8::store_codes(qt, cols, tile, c, col0, ncols, tid);
}

// With expert biases, phase B first sums the chunk's rows of the slab's two staged dH tiles, one
// column a thread (kSwcThreads = 2 x 128 columns), before the column step overwrites them: four chains
// over rows i % 4, added in a fixed order (deterministic). Rows past the chunk's are staged zeros.
__device__ __forceinline__ void dh_column_sums(const uint4* tiles, float* sums, int64_t n1, int64_t c,
                                               int64_t dh_col0, int tid) {
  static_assert(kSwcThreads == 2 * fp8::kColsSlab, "one thread per column of the slab's two dH tiles");
  const int h = tid / fp8::kColsSlab, col = tid % fp8::kColsSlab;
  const int64_t gcol = dh_col0 + fp8::kColsSlab * h + col;
  if (gcol >= n1) return;
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(tiles + h * fp8::kInUnits) + col;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
  for (int i = 0; i < fp8::kTile; i += 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] += __bfloat162float(v[(i + k) * fp8::kColsSlab]);
  }
  sums[c * n1 + gcol] = (s[0] + s[1]) + (s[2] + s[3]);
}

// One CTA per chunk c = blockIdx.x (the grid covers max_chunks; chunks >= chunk_offsets[E] do
// nothing, as the column quantiser writes nothing for them). kClamped: the clamped SwiGLU.
template <bool kClamped>
__global__ void __launch_bounds__(kSwcThreads, kSwcCtasPerSm)
    fp8_swiglu_columns_kernel(const Fp8SwigluColumnsParams p) {
  extern __shared__ uint4 smem[];
  uint4* const tiles = smem;                                                       // [3][kInUnits]
  float* const partials = reinterpret_cast<float*>(tiles + kSwcTiles * fp8::kInUnits);  // [16][256]
  float* const row_scores = partials + kSwcRowsPerWarp * kSwcThreads;              // [128]
  const int64_t c = blockIdx.x;
  if (c >= fp8::min64(p.chunk_offsets[p.E], p.max_chunks)) return;  // (uniform over the CTA)
  int64_t row0;
  int nrows;
  fp8::chunk_rows(p.offsets, p.R, p.chunk_offsets, p.E, c, &row0, &nrows);
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int cg = warp % fp8::kColGroups, rg = warp / fp8::kColGroups;  // phase B's warp roles
  const int wcol = cg * kWarpSize + lane;
  const int first = warp * kSwcRowsPerWarp;  // phase A: this warp's chunk rows [first, first + 16)
  const int groups = p.n / 4;
  const int slabs = (groups + kSwcGroupsPerSlab - 1) / kSwcGroupsPerSlab;
  // Each lane's partial d score for each row of its warp (the unfused kernel's lane partials,
  // carried across the slabs), and the chunk's rows' scores.
  float* const dot = partials + tid;  // row first + k at dot[k·256]
#pragma unroll
  for (int k = 0; k < kSwcRowsPerWarp; ++k) dot[k * kSwcThreads] = 0.f;
  for (int i = tid; i < fp8::kTile; i += kSwcThreads)
    row_scores[i] = i < nrows ? p.scores[p.row_pair[row0 + i]] : 0.f;

  for (int t = 0; t < slabs; ++t) {
    // A. compute and stage, once every thread is past the previous slab's reads of the tiles
    // (and the scores are in).
    __syncthreads();
    const int g = kSwcGroupsPerSlab * t + lane;
    const bool in_row = g < groups;
#pragma unroll 1
    for (int k0 = 0; k0 < kSwcRowsPerWarp; k0 += kSwcRowBatch)
      compute_batch<kClamped>(p, row0, nrows, first, k0, g, in_row, lane, row_scores, dot, tiles);
    __syncthreads();
    // B. the columns: dH [256t, 256t + 256) as two tiles (the second past n1 in a last partial
    // slab: skipped), A' [128t, 128t + 128).
    const int64_t dh_col0 = int64_t{2} * fp8::kColsSlab * t, ap_col0 = int64_t{fp8::kColsSlab} * t;
    // (every thread done with both tiles before quantize_tile writes its partial amaxes and codes
    // into them: a barrier more, with biases only)
    if (p.dh_col_sums != nullptr) {
      dh_column_sums(tiles, p.dh_col_sums, p.n1, c, dh_col0, tid);
      __syncthreads();
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t col0 = dh_col0 + fp8::kColsSlab * h;
      const int ncols = static_cast<int>(fp8::min64(fp8::kColsSlab, p.n1 - col0));
      if (ncols > 0)
        quantize_tile(tiles + h * fp8::kInUnits, p.dh_qt, p.dh_col_scales, p.n1, c, col0, ncols, nrows, rg, wcol, tid);
    }
    quantize_tile(tiles + 2 * fp8::kInUnits, p.ap_qt, p.ap_col_scales, p.n, c, ap_col0,
                  static_cast<int>(fp8::min64(fp8::kColsSlab, p.n - ap_col0)), nrows, rg, wcol, tid);
  }

  // The d scores: the unfused kernel's xor-shuffle tree over the lanes' partials (each lane reads
  // only its own: no barrier needed).
#pragma unroll 1
  for (int k = 0; k < kSwcRowsPerWarp; ++k) {
    if (first + k >= nrows) break;  // (uniform over the warp)
    float dot_k = dot[k * kSwcThreads];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot_k += __shfl_xor_sync(0xffffffffu, dot_k, o);
    if (lane == 0) p.d_scores[p.row_pair[row0 + first + k]] = dot_k;
  }
}

}  // namespace machmoe::kernels
