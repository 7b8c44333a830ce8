// The tile step of the FP8 quantisation along each expert's rows (columns.cuh has the layout):
// one 128-row chunk x 128 columns of bf16 staged in shared memory [128 rows][128] (row-major, 256
// bytes a row) -> each column's amax over the chunk, its scale, its 128 codes transposed into
// [128 columns][128 codes] and stored as one contiguous block of qt. Shared by the column
// quantiser (columns.cuh) and the fused SwiGLU backward (kernels/layer/fp8_swiglu_columns.cuh),
// whose outputs must be bitwise the same. Device helpers only, no kernels. Also the clamped row
// range of an expert, which both use to place a chunk.
#pragma once

#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels::fp8 {

// The tiling (columns.cuh says why 128-column slabs): 256-byte row segments per tile.
constexpr int kColsSlab = 128;                         // columns per tile
constexpr int kColsThreads = 256;                      // 8 warps: 2 column groups x 4 row groups
constexpr int kColGroups = kColsSlab / 64;             // 64 columns (32 words) per warp
constexpr int kRowGroups = kColsThreads / kWarpSize / kColGroups;
constexpr int kRowsPerWarp = kTile / kRowGroups;       // 32 rows each warp reduces
constexpr int kWordsPerRow = kColsSlab / 2;            // 32-bit words (bf16 pairs) per tile row
constexpr int kUnitsPerRow = kColsSlab / 8;            // 16-byte units of x per tile row
constexpr int kInUnits = kTile * kUnitsPerRow;         // one input tile [128 rows][128] bf16, 32 KiB
constexpr int kOutUnits = kColsSlab * kTile / 16;      // [128 columns][128 codes] e4m3, 16 KiB
constexpr int kStoresPerThread = kOutUnits / kColsThreads;
static_assert(kRowsPerWarp % 16 == 0, "each warp quantises whole 16-code units");
static_assert(kOutUnits % kColsThreads == 0, "whole stores per thread");

// Expert e's row range, clamped into [0, R]: offsets are device data the host never checks, so
// invalid ones may give a meaningless result but never an access outside the buffers.
__device__ __forceinline__ void expert_rows(const int32_t* offsets, int64_t R, int64_t e, int64_t* begin,
                                            int64_t* end) {
  *begin = min64(max64(offsets[e], 0), R);
  *end = min64(max64(offsets[e + 1], 0), R);
  if (*end < *begin) *end = *begin;
}

// Chunk c's rows, for c < chunk_offsets[E] (chunk_offsets non-decreasing, chunk_offsets[0] = 0):
// its expert is the last e with chunk_offsets[e] <= c (empty experts share their offset with the
// next one), found by bisection; its rows are [row0, row0 + nrows), row0 = begin(e) + 128·(c −
// chunk_offsets[e]), nrows <= 128 (0 only with inconsistent offsets). The column quantiser's
// locate_item gives the same with a cache over consecutive items.
__device__ __forceinline__ void chunk_rows(const int32_t* offsets, int64_t R, const int32_t* chunk_offsets, int64_t E,
                                           int64_t c, int64_t* row0, int* nrows) {
  int64_t lo = 0, hi = E;  // invariant: chunk_offsets[lo] <= c, the answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (chunk_offsets[mid] <= c) lo = mid; else hi = mid;
  }
  int64_t begin, end;
  expert_rows(offsets, R, lo, &begin, &end);
  *row0 = begin + (c - chunk_offsets[lo]) * kTile;
  *nrows = *row0 < begin ? 0 : static_cast<int>(max64(0, min64(kTile, end - *row0)));
}

// Reduce: warp (row group rg, column group cg) reads rows [32·rg, 32·rg + 32) of the input tile
// [128 rows][64 words]; lane's word column wcol = 32·cg + lane holds the slab's columns 2·wcol
// (low halves) and 2·wcol + 1 (high halves). Returns the chunk's amax of both columns (two bf16
// |bits|), w keeps the lane's 32 words for the quantisation. The 4 row groups' partials meet in
// the tile itself: each warp's in the first row it read, which no other warp reads. Contains the
// item's second barrier.
__device__ __forceinline__ uint32_t reduce_amax2(uint32_t* in_words, int rg, int wcol, uint32_t (&w)[kRowsPerWarp]) {
  constexpr int RW = kRowsPerWarp;
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < RW; ++k) {
    w[k] = in_words[(rg * RW + k) * kWordsPerRow + wcol];  // 32 consecutive words: 32 banks
    m = __vmaxu2(m, w[k] & kBf16AbsMask2);
  }
  in_words[rg * RW * kWordsPerRow + wcol] = m;  // where this lane read w[0]
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kRowGroups; ++k) m = __vmaxu2(m, in_words[k * RW * kWordsPerRow + wcol]);
  return m;
}

// Quantise: the codes of the lane's two columns for its warp's 32 rows (4 rows per word, rows in
// order) into out_tile [128 columns][8 units of 16 codes], units xor-swizzled by (column / 2) % 8
// so that both the writes here and the column-wise reads of the store are conflict-free.
__device__ __forceinline__ void quantize_codes(const uint32_t (&w)[kRowsPerWarp], const TileScale& s_lo,
                                               const TileScale& s_hi, int rg, int wcol, int nrows, uint4* out_tile) {
  constexpr int RW = kRowsPerWarp;
  uint32_t q_lo[RW / 4], q_hi[RW / 4];
#pragma unroll
  for (int k = 0; k < RW / 4; ++k) {
    const uint32_t a0 = w[4 * k], a1 = w[4 * k + 1], a2 = w[4 * k + 2], a3 = w[4 * k + 3];
    // Regroup by column: low halves (column 2·wcol) of four rows, then the high halves.
    q_lo[k] = quantize4(__byte_perm(a0, a1, 0x5410), __byte_perm(a2, a3, 0x5410), s_lo);
    q_hi[k] = quantize4(__byte_perm(a0, a1, 0x7632), __byte_perm(a2, a3, 0x7632), s_hi);
  }
  // A non-finite column: NaN codes for its real rows, zeros (padding) past the expert's end.
  if (s_lo.bad || s_hi.bad) {
#pragma unroll
    for (int k = 0; k < RW / 4; ++k) {
      uint32_t mask = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (rg * RW + 4 * k + b < nrows) mask |= 0xffu << (8 * b);
      if (s_lo.bad) q_lo[k] = kE4M3Nan4 & mask;
      if (s_hi.bad) q_hi[k] = kE4M3Nan4 & mask;
    }
  }
  const int swz = wcol % 8;  // (column / 2) % 8 for both columns 2·wcol and 2·wcol + 1
#pragma unroll
  for (int j = 0; j < RW / 16; ++j) {
    const int unit = (rg * RW / 16 + j) ^ swz;
    out_tile[(2 * wcol) * 8 + unit] = make_uint4(q_lo[4 * j], q_lo[4 * j + 1], q_lo[4 * j + 2], q_lo[4 * j + 3]);
    out_tile[(2 * wcol + 1) * 8 + unit] = make_uint4(q_hi[4 * j], q_hi[4 * j + 1], q_hi[4 * j + 2], q_hi[4 * j + 3]);
  }
}

// Store: out_tile's codes into chunk c's block of qt [max_chunks, d, 128], column col0 + col at
// qt[c, col0 + col, 0 .. 128): eight consecutive threads write one column's 128 bytes, and the
// item's 128 columns are one contiguous 16 KiB run.
__device__ __forceinline__ void store_codes(uint8_t* qt, int64_t d, const uint4* out_tile, int64_t c, int64_t col0,
                                            int ncols, int tid) {
#pragma unroll
  for (int i = 0; i < kStoresPerThread; ++i) {
    const int u = tid + kColsThreads * i, col = u / 8, unit = u % 8;
    const uint4 val = out_tile[col * 8 + (unit ^ ((col / 2) % 8))];
    if (col < ncols) store16(qt + (c * d + col0 + col) * kTile + unit * 16, val);
  }
}

// Where chunk c's scale of column col lives in scales [max_chunks, d]: chunk-major, so that an
// item's scales (and a weight-gradient tile's) are one contiguous run.
__device__ __forceinline__ int64_t column_scale_index(int64_t d, int64_t c, int64_t col) { return c * d + col; }

}  // namespace machmoe::kernels::fp8
