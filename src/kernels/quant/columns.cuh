// FP8 quantisation along the rows of each expert (128x1 tiles, transposed output): the operands of
// the weight-gradient GEMMs, whose reduction dimension is an expert's rows (varlen K).
//   x bf16 [T, d] (ld), gather [R] int32 or null (row r = x[gather[r]], else x[r]),
//   expert_offsets [E+1] int32 (expert e's rows are [off[e], off[e+1]))
//   -> chunk_offsets [E+1] int32, qt e4m3 [max_chunks, d, 128], scales fp32 [max_chunks, d].
//
// Layout (fp8.hpp, fp8_columns_layout): each expert's rows are cut into 128-row chunks from its
// first row; chunk_offsets[e] = Σ_{e' < e} ceil(rows(e') / 128), computed here on the device (no
// host sync). Chunk c of expert e (c in [chunk_offsets[e], chunk_offsets[e+1])) holds rows
// off[e] + 128·(c - chunk_offsets[e]) + [0, 128) of the expert and lands in qt[c]: column i of
// x becomes row i of qt[c] [d, 128], the chunk's rows contiguous, so that a K-major wgmma operand
// takes a whole 128-row K block of 128 columns by TMA. The rows past an expert's end in its last
// chunk are zero codes (so a GEMM needs no masking); scales[c, i] is chunk c's scale for column
// i. Chunks c >= chunk_offsets[E] (up to max_chunks) are not written. Chunk-major because the
// writes then are whole contiguous blocks (an item's 16 KiB of codes, its 512 bytes of scales):
// with codes [d, 128·max_chunks] and scales [d, max_chunks] the same kernel took 0.976 ms instead
// of 0.79 at 30B-b (H200), its scattered 4-byte scale stores costing partial-sector writes.
// A row whose gather index is outside [0, T) is read as NaN (its chunk's scales become NaN).
//
// Work item: one 128-row chunk x a slab of 128 columns (a 256-byte segment of each row), double
// buffered, 256 threads, 2 CTAs per SM. Measured on an H200 (outputs bitwise equal), 30B-b gathered
// x/dout [R = 262144, d = 4096]: 3421 GB/s (0.962 ms), against 2736 GB/s (1.202 ms) for the former
// 64-column slabs (128-byte segments, a binary search per item, gather indices loaded at issue);
// dH (d = 1024) 0.288 -> 0.251 ms, A' (d = 512) 0.149 -> 0.132 ms, 7B-a x/dout (d = 1536)
// 0.323 -> 0.267 ms. 3 stages gained nothing; 4 stages, 512 threads, 5 CTAs per SM (64-column
// slabs), cp.async's L2::256B prefetch hint and slab-major item orders did not help or lost.
// The tile step (reduce, scales, codes, store) is columns_tile.cuh's. Included by
// host/quant/quantize_columns.cu only.
#pragma once

#include "kernels/ptx/sm90_ptx.cuh"
#include "kernels/quant/columns_tile.cuh"

namespace machmoe::kernels::fp8 {

constexpr int kScanThreads = 1024;

// The quantiser's own tiling beside columns_tile.cuh's: how an item's input tile is loaded.
constexpr int kColsCtasPerSm = 2;                        // what shared memory allows (80 KiB each)
constexpr int kLoadsPerThread = kInUnits / kColsThreads;
constexpr int kRowStride = kColsThreads / kUnitsPerRow;  // tile rows between a thread's loads
static_assert(kInUnits % kColsThreads == 0 && kColsThreads % kUnitsPerRow == 0, "whole rows per thread");

struct ColumnsParams {
  const __nv_bfloat16* x;        // [T, d], ld
  int64_t ld, T;
  const int32_t* gather;         // [R] or null
  int64_t R, d;                  // d % 16 == 0
  const int32_t* offsets;        // [E+1]
  int64_t E;
  const int32_t* chunk_offsets;  // [E+1], from fp8_chunk_offsets_kernel
  int64_t max_chunks;            // fp8_columns_layout(R, E, d)
  uint8_t* qt;                   // [max_chunks, d, 128]
  float* scales;                 // [max_chunks, d]
};

// chunk_offsets [E+1] from expert_offsets: one block of 1024 threads scans E in steps of 1024.
// (Non-decreasing by construction, whatever the offsets: the expert searches below rely on it.)
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

// One work item: a chunk's 128 rows x a slab of columns.
struct ColumnsItem {
  int64_t c = 0, col0 = 0, row0 = 0;  // chunk, first column, first row of the chunk
  int ncols = 0, nrows = 0;            // columns in the slab (a multiple of 16), rows of the chunk
};

// The expert of the last item a thread located: e, its chunks [cb, cn), its rows [begin, end).
// int32: E, R <= 2^31 - 1 (the launcher's rules), chunk_offsets are int32.
struct ExpertCache {
  int32_t e = -1, cb = 0, cn = 0, begin = 0, end = 0;
};

// Item -> (chunk c = item / slabs, slab), chunk-major: the CTAs running at once read whole
// 256-byte row segments of neighbouring chunks. Chunk c's expert is the e with
// chunk_offsets[e] <= c < chunk_offsets[e+1] (empty experts share their offset with the next
// one: the last e with offset <= c; chunk_offsets is non-decreasing). A CTA's consecutive items
// mostly fall in the same or the next expert, so the search first probes the cached expert and
// the one after it (one load at most), and only then bisects the rest (7 dependent loads at
// E = 128).
__device__ __forceinline__ ColumnsItem locate_item(const ColumnsParams& p, int64_t item, int64_t slabs,
                                                   ExpertCache& ec) {
  ColumnsItem it;
  it.c = item / slabs;
  it.col0 = (item - it.c * slabs) * kColsSlab;
  it.ncols = static_cast<int>(min64(kColsSlab, p.d - it.col0));
  const int64_t c = it.c;
  int64_t lo = 0, hi = p.E;  // invariant: chunk_offsets[lo] <= c, the answer in [lo, hi)
  bool cached = false;
  if (ec.e >= 0) {
    if (c >= ec.cb && c < ec.cn) {
      cached = true;
    } else if (c >= ec.cn) {
      lo = int64_t{ec.e} + 1;  // chunk_offsets[e + 1] = cn <= c
      if (lo + 1 < hi) {
        if (p.chunk_offsets[lo + 1] <= c) lo = lo + 1; else hi = lo + 1;
      }
    } else {
      hi = ec.e;  // c < chunk_offsets[e]; chunk_offsets[0] = 0 <= c
    }
  }
  if (!cached) {
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.chunk_offsets[mid] <= c) lo = mid; else hi = mid;
    }
    int64_t begin, end;
    expert_rows(p.offsets, p.R, lo, &begin, &end);
    ec.e = static_cast<int32_t>(lo);
    ec.cb = p.chunk_offsets[lo];
    ec.cn = p.chunk_offsets[lo + 1];
    ec.begin = static_cast<int32_t>(begin), ec.end = static_cast<int32_t>(end);
  }
  it.row0 = ec.begin + (c - ec.cb) * kTile;
  // (row0 < begin only with inconsistent offsets: then the chunk is left empty.)
  it.nrows = it.row0 < ec.begin ? 0 : static_cast<int>(max64(0, min64(kTile, int64_t{ec.end} - it.row0)));
  return it;
}

// An item located, with the x row of each of this thread's kLoadsPerThread tile rows
// (tid / kUnitsPerRow + kRowStride·i): gather[r] loaded (not yet used), or r itself. Prepared one
// iteration before its copies are issued, so that the dependent chain expert search -> gather
// index -> cp.async address is not paid at the issue.
struct StagedItem {
  ColumnsItem it;
  bool exists = false;
  int32_t src[kLoadsPerThread];
};

__device__ __forceinline__ StagedItem prepare_item(const ColumnsParams& p, int64_t item, int64_t items,
                                                   int64_t slabs, ExpertCache& ec, int tid) {
  StagedItem st;
  st.exists = item < items;
  if (!st.exists) return st;
  st.it = locate_item(p, item, slabs, ec);
#pragma unroll
  for (int i = 0; i < kLoadsPerThread; ++i) {
    const int row = tid / kUnitsPerRow + kRowStride * i;
    const int64_t r = st.it.row0 + row;
    st.src[i] = 0;
    if (row < st.it.nrows) st.src[i] = p.gather ? p.gather[r] : static_cast<int32_t>(r);  // r < R < 2^31
  }
  return st;
}

// The item's 16-byte units of x, [row][unit], copied into `tile` by cp.async (one commit group
// per thread, empty when the item does not exist, so that the group count stays one per item):
// zeros past the expert's rows and past d, NaN for a bad gather index (both stored directly).
// Thread 0 records the item in `info` for the iteration that quantises it.
__device__ __forceinline__ void issue_item(const ColumnsParams& p, const StagedItem& st, int tid, uint4* tile,
                                           ColumnsItem* info) {
  if (st.exists) {
    if (tid == 0) *info = st.it;
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const int v = tid + kColsThreads * i, row = v / kUnitsPerRow, unit = v % kUnitsPerRow;
      if (row < st.it.nrows && unit * 8 < st.it.ncols) {
        const int64_t src = st.src[i];
        if (src >= 0 && src < p.T) {
          sm90::cp_async_16(sm90::smem_addr(tile + v), p.x + src * p.ld + st.it.col0 + unit * 8, 16);
        } else {
          const uint32_t nan2 = kBf16NanBits | (kBf16NanBits << 16);
          tile[v] = make_uint4(nan2, nan2, nan2, nan2);
        }
      } else {
        tile[v] = make_uint4(0, 0, 0, 0);
      }
    }
  }
  sm90::cp_async_commit();
}

// Shared memory (dynamic, 80 KiB + 64 bytes: two CTAs per SM of an H100/H200's 228 KiB, not
// three): 2 input tiles [128 rows][128 bf16] | out_tile [128 columns][128 codes] | 2 ColumnsItem
// (the item each input tile holds).
constexpr size_t kColsSmemBytes = 2 * 16 * size_t{kInUnits} + 16 * size_t{kOutUnits} + 2 * sizeof(ColumnsItem);

// Persistent: the grid's CTAs stride over (chunk, slab) items, for the chunks that exist
// (chunk_offsets[E], read on the device, at most max_chunks). Double buffer: iteration j issues
// the copies of item j + 1 into the other input tile and prepares item j + 2 (its expert and
// gather indices), then waits for item j's copies and quantises it: reduce, scales, quantise,
// store. __launch_bounds__' second argument keeps ptxas at 128 registers (without it: 168, one
// CTA per SM).
__global__ void __launch_bounds__(kColsThreads, kColsCtasPerSm) fp8_quantize_columns_kernel(const ColumnsParams p) {
  extern __shared__ uint4 smem[];
  uint4* const in_tiles = smem;                                                    // [2][kInUnits]
  uint4* const out_tile = in_tiles + 2 * kInUnits;                                 // [kOutUnits]
  ColumnsItem* const info = reinterpret_cast<ColumnsItem*>(out_tile + kOutUnits);  // [2]
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int cg = warp % kColGroups, rg = warp / kColGroups;
  const int wcol = cg * kWarpSize + lane;  // word column: the slab's columns 2·wcol, 2·wcol + 1
  const int64_t used = min64(p.chunk_offsets[p.E], p.max_chunks);
  const int64_t slabs = (p.d + kColsSlab - 1) / kColsSlab;
  const int64_t items = used * slabs, G = gridDim.x;

  // Prologue: the first item's copies in flight into tile 0, the second item prepared.
  ExpertCache ec;
  issue_item(p, prepare_item(p, blockIdx.x, items, slabs, ec, tid), tid, in_tiles, info);
  StagedItem pending = prepare_item(p, blockIdx.x + G, items, slabs, ec, tid);

  int stage = 0;  // the tile of item j
  for (int64_t item = blockIdx.x; item < items; item += G) {
    // Issue: item j + 1 goes into the tile of item j - 1, last read (its partial amaxes) before
    // that item's third barrier, which every thread has passed.
    issue_item(p, pending, tid, in_tiles + (stage ^ 1) * kInUnits, info + (stage ^ 1));
    pending = prepare_item(p, item + 2 * G, items, slabs, ec, tid);
    sm90::cp_async_wait<1>();
    __syncthreads();  // every thread's copies of item j have landed, and its info
    const ColumnsItem it = info[stage];

    uint32_t w[kRowsPerWarp];
    const uint32_t m = reduce_amax2(reinterpret_cast<uint32_t*>(in_tiles + stage * kInUnits), rg, wcol, w);
    const TileScale s_lo = tile_scale(m & 0xffffu), s_hi = tile_scale(m >> 16);
    if (rg == 0 && 2 * wcol < it.ncols) {
      // Scales [max_chunks, d]: one scalar per column (the scales are 1/32 of the codes' bytes).
      p.scales[column_scale_index(p.d, it.c, it.col0 + 2 * wcol)] = s_lo.s;
      p.scales[column_scale_index(p.d, it.c, it.col0 + 2 * wcol + 1)] = s_hi.s;
    }
    quantize_codes(w, s_lo, s_hi, rg, wcol, it.nrows, out_tile);
    __syncthreads();
    store_codes(p.qt, p.d, out_tile, it.c, it.col0, it.ncols, tid);
    // No barrier here: out_tile is next written after the next item's second barrier, which
    // every thread reaches after its stores' reads of it.
    stage ^= 1;
  }
}

}  // namespace machmoe::kernels::fp8
