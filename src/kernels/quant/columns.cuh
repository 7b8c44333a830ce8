// FP8 quantisation along the rows of each expert (128x1 tiles, transposed output): the operands of
// the weight-gradient GEMMs, whose reduction dimension is an expert's rows (varlen K).
//   x bf16 [T, d] (ld), gather [R] int32 or null (row r = x[gather[r]], else x[r]),
//   expert_offsets [E+1] int32 (expert e's rows are [off[e], off[e+1]))
//   -> chunk_offsets [E+1] int32, qt e4m3 [d, r_pad], scales fp32 [d, max_chunks].
//
// Layout (fp8.hpp, fp8_columns_layout): each expert's rows are cut into 128-row chunks from its
// first row; chunk_offsets[e] = Σ_{e' < e} ceil(rows(e') / 128), computed here on the device (no
// host sync). Chunk c of expert e (c in [chunk_offsets[e], chunk_offsets[e+1])) holds rows
// off[e] + 128·(c - chunk_offsets[e]) + [0, 128) of the expert and lands in qt columns
// [128c, 128c + 128): column i of x becomes row i of qt, rows contiguous along R, so that a
// K-major wgmma operand can take whole 128-column K blocks by TMA. The rows past an expert's end
// in its last chunk are zero codes (so a GEMM needs no masking); scales[i, c] is chunk c's scale
// for column i. Chunks c >= chunk_offsets[E] (up to max_chunks) are not written.
// A row whose gather index is outside [0, T) is read as NaN (its chunk's scales become NaN).
// Included by host/quant/quantize_columns.cu only.
#pragma once

#include "kernels/ptx/sm90_ptx.cuh"
#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels::fp8 {

constexpr int kColsThreads = 256;
constexpr int kColsWarps = kColsThreads / kWarpSize;
constexpr int kColsSlab = 64;            // columns per work item: two per lane
constexpr int kRowsPerWarp = kTile / kColsWarps;  // 16 rows of the chunk per warp
constexpr int kScanThreads = 1024;

struct ColumnsParams {
  const __nv_bfloat16* x;        // [T, d], ld
  int64_t ld, T;
  const int32_t* gather;         // [R] or null
  int64_t R, d;                  // d % 16 == 0
  const int32_t* offsets;        // [E+1]
  int64_t E;
  const int32_t* chunk_offsets;  // [E+1], from fp8_chunk_offsets_kernel
  int64_t slabs;                 // ceil(d / 64)
  int64_t max_chunks, r_pad;     // r_pad = 128 * max_chunks
  uint8_t* qt;                   // [d, r_pad]
  float* scales;                 // [d, max_chunks]
};

// Expert e's row range, clamped into [0, R]: offsets are device data the host never checks, so
// invalid ones may give a meaningless result but never an access outside the buffers.
__device__ __forceinline__ void expert_rows(const int32_t* offsets, int64_t R, int64_t e, int64_t* begin,
                                            int64_t* end) {
  *begin = min64(max64(offsets[e], 0), R);
  *end = min64(max64(offsets[e + 1], 0), R);
  if (*end < *begin) *end = *begin;
}

// chunk_offsets [E+1] from expert_offsets: one block of 1024 threads scans E in steps of 1024.
__global__ void __launch_bounds__(kScanThreads) fp8_chunk_offsets_kernel(const int32_t* offsets, int64_t E,
                                                                          int64_t R, int32_t* chunk_offsets) {
  __shared__ int scan[kWarpSize];
  int carry = 0;
  for (int64_t base = 0; base < E; base += kScanThreads) {
    const int64_t e = base + threadIdx.x;
    int chunks = 0;
    if (e < E) {
      int64_t begin, end;
      expert_rows(offsets, R, e, &begin, &end);
      chunks = static_cast<int>((end - begin + kTile - 1) / kTile);
    }
    int total;
    const int excl = block_exclusive_scan(chunks, scan, &total);
    if (e < E) chunk_offsets[e] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) chunk_offsets[E] = carry;
}

// One work item: a chunk's 128 rows x a 64-column slab.
struct ColumnsItem {
  int64_t c = 0, col0 = 0, row0 = 0;  // chunk, first column, first row of the chunk
  int ncols = 0, nrows = 0;            // columns in the slab (a multiple of 16), rows of the chunk
};

__device__ __forceinline__ ColumnsItem locate_item(const ColumnsParams& p, int64_t item) {
  ColumnsItem it;
  it.c = item / p.slabs;
  it.col0 = (item - it.c * p.slabs) * kColsSlab;
  it.ncols = static_cast<int>(min64(kColsSlab, p.d - it.col0));
  // The expert of chunk c: the e with chunk_offsets[e] <= c < chunk_offsets[e+1] (empty experts
  // share their offset with the next one; the search finds the last e with offset <= c).
  int64_t lo = 0, hi = p.E;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.chunk_offsets[mid] <= it.c) lo = mid; else hi = mid;
  }
  int64_t begin, end;
  expert_rows(p.offsets, p.R, lo, &begin, &end);
  it.row0 = begin + (it.c - p.chunk_offsets[lo]) * kTile;
  // (row0 < begin only with inconsistent offsets: then the chunk is left empty.)
  it.nrows = it.row0 < begin ? 0 : static_cast<int>(max64(0, min64(kTile, end - it.row0)));
  return it;
}

// The item's 1024 16-byte units of x, [row][unit], four per thread (512 contiguous bytes per
// warp), copied into `tile` by cp.async (one commit group per thread): zeros past the expert's
// rows and past d, NaN for a bad gather index (both stored directly).
__device__ __forceinline__ void load_item(const ColumnsParams& p, const ColumnsItem& it, int tid, uint4* tile) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int v = tid + kColsThreads * i, row = v / 8, unit = v % 8;
    if (row < it.nrows && unit * 8 < it.ncols) {
      const int64_t r = it.row0 + row;
      const int64_t src = p.gather ? static_cast<int64_t>(p.gather[r]) : r;
      if (src >= 0 && src < p.T) {
        sm90::cp_async_16(sm90::smem_addr(tile + v), p.x + src * p.ld + it.col0 + unit * 8, 16);
      } else {
        const uint32_t nan2 = kBf16NanBits | (kBf16NanBits << 16);
        tile[v] = make_uint4(nan2, nan2, nan2, nan2);
      }
    } else {
      tile[v] = make_uint4(0, 0, 0, 0);
    }
  }
  sm90::cp_async_commit();
}

// Persistent: the grid's CTAs stride over (chunk, 64-column slab) items, for the chunks that
// exist (chunk_offsets[E], read on the device, at most max_chunks).
// Per item: the chunk's 128 gathered rows x 64 columns (each row segment 128 contiguous bytes)
// land in one of two shared-memory tiles by cp.async, the next item's copies being issued into
// the other before this item's are waited for, so that each CTA keeps its loads in flight while
// it quantises; warp w reduces rows [16w, 16w + 16) for columns 2·lane, 2·lane+1, the eight
// warps' partial amaxes meet in shared memory; each warp quantises its 16 rows of its two columns
// (16 bytes each) into a [64 columns][128 bytes] tile, which goes out as whole 128-byte qt row
// segments.
__global__ void __launch_bounds__(kColsThreads) fp8_quantize_columns_kernel(const ColumnsParams p) {
  __shared__ uint4 in_tiles[2][kTile * kColsSlab / 8];  // 2 x [128 rows][64 bf16], 32 KB
  __shared__ uint4 out_tile[kColsSlab * kTile / 16];    // [64 columns][128 codes], 8 KB; 16-byte
                                                        // units xor-swizzled by (column / 2) % 8
  __shared__ uint32_t part[kColsWarps][kWarpSize];      // partial amax bits, two columns per word
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int64_t used = min64(p.chunk_offsets[p.E], p.max_chunks);
  const int64_t items = used * p.slabs;
  ColumnsItem next_it;
  if (blockIdx.x < items) {
    next_it = locate_item(p, blockIdx.x);
    load_item(p, next_it, tid, in_tiles[0]);
  }
  int buf = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, buf ^= 1) {
    const ColumnsItem it = next_it;
    const int64_t c = it.c, col0 = it.col0;
    const int ncols = it.ncols, nrows = it.nrows;
    // The other tile was last read before the previous item's second barrier: free for the next
    // item's copies, issued before this item's are waited for.
    if (item + gridDim.x < items) {
      next_it = locate_item(p, item + gridDim.x);
      load_item(p, next_it, tid, in_tiles[buf ^ 1]);
      sm90::cp_async_wait<1>();
    } else {
      sm90::cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of this item have landed
    const uint4* in_tile = in_tiles[buf];

    // Warp w: rows [16w, 16w+16), lane: columns 2·lane (low halves) and 2·lane+1 (high halves).
    const uint32_t* in_words = reinterpret_cast<const uint32_t*>(in_tile);
    uint32_t w[kRowsPerWarp];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      w[k] = in_words[(warp * kRowsPerWarp + k) * (kColsSlab / 2) + lane];  // one row: 32 banks
      m = __vmaxu2(m, w[k] & kBf16AbsMask2);
    }
    part[warp][lane] = m;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kColsWarps; ++k) m = __vmaxu2(m, part[k][lane]);
    const TileScale s_lo = tile_scale(m & 0xffffu), s_hi = tile_scale(m >> 16);

    // Codes of the two columns for this warp's 16 rows, 4 rows per word, rows in order.
    uint32_t q_lo[4], q_hi[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t a0 = w[4 * k], a1 = w[4 * k + 1], a2 = w[4 * k + 2], a3 = w[4 * k + 3];
      // Regroup by column: low halves (column 2·lane) of four rows, then the high halves.
      q_lo[k] = quantize4(__byte_perm(a0, a1, 0x5410), __byte_perm(a2, a3, 0x5410), s_lo);
      q_hi[k] = quantize4(__byte_perm(a0, a1, 0x7632), __byte_perm(a2, a3, 0x7632), s_hi);
    }
    // A non-finite column: NaN codes for its real rows, zeros (padding) past the expert's end.
    if (s_lo.bad || s_hi.bad) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t mask = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b)
          if (warp * kRowsPerWarp + 4 * k + b < nrows) mask |= 0xffu << (8 * b);
        if (s_lo.bad) q_lo[k] = kE4M3Nan4 & mask;
        if (s_hi.bad) q_hi[k] = kE4M3Nan4 & mask;
      }
    }
    const int swz = lane % 8;  // (column / 2) % 8 for both columns 2·lane and 2·lane+1
    out_tile[(2 * lane) * 8 + (warp ^ swz)] = make_uint4(q_lo[0], q_lo[1], q_lo[2], q_lo[3]);
    out_tile[(2 * lane + 1) * 8 + (warp ^ swz)] = make_uint4(q_hi[0], q_hi[1], q_hi[2], q_hi[3]);
    if (warp == 0 && 2 * lane < ncols) {
      // [d, max_chunks]: one scalar per column (the scales are 1/32 of the codes' bytes).
      p.scales[(col0 + 2 * lane) * p.max_chunks + c] = s_lo.s;
      p.scales[(col0 + 2 * lane + 1) * p.max_chunks + c] = s_hi.s;
    }
    __syncthreads();

    // Store: 512 16-byte units, [column][unit]: eight lanes write one column's 128 bytes.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int u = tid + kColsThreads * i, col = u / 8, unit = u % 8;
      const uint4 val = out_tile[col * 8 + (unit ^ ((col / 2) % 8))];
      if (col < ncols) store16(p.qt + (col0 + col) * p.r_pad + c * kTile + unit * 16, val);
    }
    // No barrier here: the item after next writes this tile (last read before the second
    // barrier) only after the next item's first barrier, and so part and out_tile.
  }
}

}  // namespace machmoe::kernels::fp8
