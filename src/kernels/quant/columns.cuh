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

constexpr int kScanThreads = 1024;

// The quantiser's performance choices. Every choice writes bitwise the same codes and scales (the
// amax is a max, order-free; each code is computed from its own element and its column's scale),
// so they differ only in speed. Work item: one 128-row chunk x a slab of kSlab columns.
//   Slab: 64 or 128 columns: each of the chunk's rows is read as one 128- or 256-byte segment
//     (the qt stores stay 128 bytes per column: one chunk).
//   Stages: shared-memory input tiles; the copies of Stages - 1 later items are in flight while an
//     item is quantised (2: double buffer).
//   Threads: per CTA; warps split into kSlab / 64 column groups x the rest as row groups.
//   MinBlocks: __launch_bounds__'s second argument (register cap), 1 = none.
//   Probe: find an item's expert by first trying the previous item's expert and the one after
//     (one load at most where a CTA's consecutive items fall in neighbouring experts), else the
//     binary search over chunk_offsets (false: the binary search for every item, 7 dependent
//     loads at E = 128).
//   EarlyGather: the gather indices of the item issued next iteration are loaded one iteration
//     ahead, so that the dependent chain gather index -> cp.async is not paid on every issue.
//   L2Prefetch: 0, or 128 / 256: cp.async's .L2::NB prefetch-size hint (L2 fetches the aligned
//     N-byte block of every access: with 64-column slabs, the neighbouring slab's segment).
//   ChunkGroup: item order. 1: chunk-major (item = chunk * slabs + slab): the CTAs running at once
//     cover whole rows of about (resident CTAs / slabs) chunks. G > 1: slab-major within groups of
//     G consecutive chunks: the CTAs running at once write longer runs (G * 128 bytes) of fewer qt
//     rows (fewer DRAM pages and TLB entries on the transposed writes) but read rows in pieces.
template <int Slab, int Stages, int Threads, int MinBlocks, bool Probe, bool EarlyGather, int L2Prefetch,
          int ChunkGroup>
struct ColsConfig {
  static constexpr int kSlab = Slab, kStages = Stages, kThreads = Threads, kMinBlocks = MinBlocks;
  static constexpr bool kProbe = Probe, kEarlyGather = EarlyGather;
  static constexpr int kL2Prefetch = L2Prefetch, kChunkGroup = ChunkGroup;

  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kColGroups = kSlab / 64;                 // 64 columns (32 words) per warp
  static constexpr int kRowGroups = kWarps / kColGroups;
  static constexpr int kRowsPerWarp = kTile / kRowGroups;      // rows each warp reduces
  static constexpr int kWordsPerRow = kSlab / 2;                // 32-bit words (bf16 pairs) per row
  static constexpr int kUnitsPerRow = kSlab / 8;                // 16-byte units of x per row
  static constexpr int kInUnits = kTile * kUnitsPerRow;         // one input tile [128][kSlab] bf16
  static constexpr int kLoadsPerThread = kInUnits / kThreads;   // one row each
  static constexpr int kOutUnits = kSlab * kTile / 16;          // [kSlab columns][128 codes]
  static constexpr int kStoresPerThread = kOutUnits / kThreads;
  static constexpr size_t kInBytes = 16 * size_t{kInUnits};

  static_assert(kSlab == 64 || kSlab == 128, "slabs of 64 or 128 columns");
  static_assert(kStages >= 2, "at least a double buffer");
  static_assert(kThreads % kWarpSize == 0 && kWarps % kColGroups == 0, "whole warps per column group");
  static_assert(kRowGroups >= 1 && kTile % kRowGroups == 0 && kRowsPerWarp % 16 == 0,
                "each warp quantises whole 16-code units");
  static_assert(kInUnits % kThreads == 0 && kThreads % kUnitsPerRow == 0, "whole rows per thread");
  static_assert(kOutUnits % kThreads == 0, "whole stores per thread");
  static_assert(L2Prefetch == 0 || L2Prefetch == 64 || L2Prefetch == 128 || L2Prefetch == 256, "PTX sizes");
  static_assert(kChunkGroup >= 1, "chunk groups of at least one chunk");
};

// The launcher's choice (the kernel as it was before the choices became parameters): 64-column
// slabs (128-byte row segments), a double buffer, 256 threads, a binary search per item,
// chunk-major order; MinBlocks 4 keeps it at the 64 registers (4 CTAs per SM) it had (ptxas
// otherwise takes 80: 3 CTAs). About 2.45 TB/s on an H200 at the 30B-b shape (x/dout gathered
// [R = 262144, d = 4096], dH d = 1024, A' d = 512). The other choices are measured by
// .ab/colq_bench.cu (outside the repository) before the default moves.
using ColsDefault = ColsConfig<64, 2, 256, 4, false, false, 0, 1>;

struct ColumnsParams {
  const __nv_bfloat16* x;        // [T, d], ld
  int64_t ld, T;
  const int32_t* gather;         // [R] or null
  int64_t R, d;                  // d % 16 == 0
  const int32_t* offsets;        // [E+1]
  int64_t E;
  const int32_t* chunk_offsets;  // [E+1], from fp8_chunk_offsets_kernel
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

// The expert of the last item a thread located (Probe): e, its chunks [cb, cn), its rows
// [begin, end). int32: E, R <= 2^31 - 1 (the launcher's rules), chunk_offsets are int32.
struct ExpertCache {
  int32_t e = -1, cb = 0, cn = 0, begin = 0, end = 0;
};

// Item -> (chunk, slab) in the order of Cfg::kChunkGroup (see ColsConfig).
template <class Cfg>
__device__ __forceinline__ void item_coords(int64_t item, int64_t used, int64_t slabs, int64_t* c, int64_t* s) {
  if constexpr (Cfg::kChunkGroup == 1) {
    *c = item / slabs;
    *s = item - *c * slabs;
  } else {
    const int64_t per_group = Cfg::kChunkGroup * slabs;
    const int64_t g = item / per_group, rem = item - g * per_group;
    const int64_t gc = min64(Cfg::kChunkGroup, used - g * Cfg::kChunkGroup);  // only the last is short
    *s = rem / gc;
    *c = g * Cfg::kChunkGroup + (rem - *s * gc);
  }
}

// The expert of chunk c: the e with chunk_offsets[e] <= c < chunk_offsets[e+1] (empty experts
// share their offset with the next one: the last e with offset <= c). Both searches find that e
// (chunk_offsets is non-decreasing); Probe narrows [lo, hi) from the cached expert first.
template <class Cfg>
__device__ __forceinline__ ColumnsItem locate_item(const ColumnsParams& p, int64_t item, int64_t used,
                                                   int64_t slabs, ExpertCache& ec) {
  ColumnsItem it;
  int64_t s;
  item_coords<Cfg>(item, used, slabs, &it.c, &s);
  it.col0 = s * Cfg::kSlab;
  it.ncols = static_cast<int>(min64(Cfg::kSlab, p.d - it.col0));
  const int64_t c = it.c;
  int64_t lo = 0, hi = p.E;  // invariant: chunk_offsets[lo] <= c, the answer in [lo, hi)
  bool cached = false;
  if constexpr (Cfg::kProbe) {
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
    if constexpr (Cfg::kProbe) ec.cn = p.chunk_offsets[lo + 1];
    ec.begin = static_cast<int32_t>(begin), ec.end = static_cast<int32_t>(end);
  }
  it.row0 = ec.begin + (c - ec.cb) * kTile;
  // (row0 < begin only with inconsistent offsets: then the chunk is left empty.)
  it.nrows = it.row0 < ec.begin ? 0 : static_cast<int>(max64(0, min64(kTile, int64_t{ec.end} - it.row0)));
  return it;
}

// An item located, with the x row of each of this thread's Cfg::kLoadsPerThread tile rows (rows
// tid / units + (threads / units)·i): gather[r] loaded (not yet used), or r itself.
template <class Cfg>
struct StagedItem {
  ColumnsItem it;
  bool exists = false;
  int32_t src[Cfg::kLoadsPerThread];
};

template <class Cfg>
__device__ __forceinline__ StagedItem<Cfg> prepare_item(const ColumnsParams& p, int64_t item, int64_t items,
                                                        int64_t used, int64_t slabs, ExpertCache& ec, int tid) {
  StagedItem<Cfg> st;
  st.exists = item < items;
  if (!st.exists) return st;
  st.it = locate_item<Cfg>(p, item, used, slabs, ec);
#pragma unroll
  for (int i = 0; i < Cfg::kLoadsPerThread; ++i) {
    const int row = tid / Cfg::kUnitsPerRow + (Cfg::kThreads / Cfg::kUnitsPerRow) * i;
    const int64_t r = st.it.row0 + row;
    st.src[i] = 0;
    if (row < st.it.nrows) st.src[i] = p.gather ? p.gather[r] : static_cast<int32_t>(r);  // r < R < 2^31
  }
  return st;
}

template <int kL2Prefetch>
__device__ __forceinline__ void cp_async_16_hint(uint32_t dst, const void* src) {
  if constexpr (kL2Prefetch == 0) {
    sm90::cp_async_16(dst, src, 16);
  } else if constexpr (kL2Prefetch == 64) {
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else if constexpr (kL2Prefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  }
}

// The item's 16-byte units of x, [row][unit], copied into `tile` by cp.async (one commit group
// per thread, empty when the item does not exist, so that the group count stays one per item):
// zeros past the expert's rows and past d, NaN for a bad gather index (both stored directly).
// Thread 0 records the item in `info` for the iteration that quantises it.
template <class Cfg>
__device__ __forceinline__ void issue_item(const ColumnsParams& p, const StagedItem<Cfg>& st, int tid, uint4* tile,
                                           ColumnsItem* info) {
  if (st.exists) {
    if (tid == 0) *info = st.it;
#pragma unroll
    for (int i = 0; i < Cfg::kLoadsPerThread; ++i) {
      const int v = tid + Cfg::kThreads * i, row = v / Cfg::kUnitsPerRow, unit = v % Cfg::kUnitsPerRow;
      if (row < st.it.nrows && unit * 8 < st.it.ncols) {
        const int64_t src = st.src[i];
        if (src >= 0 && src < p.T) {
          cp_async_16_hint<Cfg::kL2Prefetch>(sm90::smem_addr(tile + v), p.x + src * p.ld + st.it.col0 + unit * 8);
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

// Persistent: the grid's CTAs stride over (chunk, slab) items, for the chunks that exist
// (chunk_offsets[E], read on the device, at most max_chunks).
// Pipeline: Stages input tiles; iteration j issues the copies of item j + Stages - 1 into the tile
// that item j - 1 used, then waits for item j's (so Stages - 1 items' copies stay in flight while
// one is quantised). Per item: the chunk's 128 gathered rows x kSlab columns; warp (row group rg,
// column group cg) reduces rows [rg·RW, rg·RW + RW) (RW = kRowsPerWarp) for columns
// 64·cg + 2·lane, +1; the warps' partial amaxes meet in shared memory (each warp's in the first
// row it read of the input tile, which no other warp reads); each warp quantises its rows of its
// two columns into a [kSlab columns][128 codes] tile, which goes out as whole 128-byte qt row
// segments.
// Shared memory (dynamic, Cfg-sized): Stages x [128 rows][kSlab bf16] | [kSlab][128] codes, 16-byte
// units xor-swizzled by (column / 2) % 8 | Stages ColumnsItem.
template <class Cfg>
constexpr size_t columns_smem_bytes() {
  return Cfg::kStages * Cfg::kInBytes + 16 * size_t{Cfg::kOutUnits} + Cfg::kStages * sizeof(ColumnsItem);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) fp8_quantize_columns_kernel(const ColumnsParams p) {
  constexpr int S = Cfg::kStages, RW = Cfg::kRowsPerWarp;
  extern __shared__ uint4 smem[];
  uint4* const in_tiles = smem;                                  // [S][kInUnits]
  uint4* const out_tile = in_tiles + S * Cfg::kInUnits;          // [kOutUnits]
  ColumnsItem* const info = reinterpret_cast<ColumnsItem*>(out_tile + Cfg::kOutUnits);  // [S]
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int cg = warp % Cfg::kColGroups, rg = warp / Cfg::kColGroups;
  const int wcol = cg * kWarpSize + lane;  // word column: the slab's columns 2·wcol, 2·wcol + 1
  const int64_t used = min64(p.chunk_offsets[p.E], p.max_chunks);
  const int64_t slabs = (p.d + Cfg::kSlab - 1) / Cfg::kSlab;
  const int64_t items = used * slabs, G = gridDim.x;
  ExpertCache ec;

#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    issue_item<Cfg>(p, prepare_item<Cfg>(p, blockIdx.x + s * G, items, used, slabs, ec, tid), tid,
                    in_tiles + s * Cfg::kInUnits, info + s);
  StagedItem<Cfg> pending;
  if constexpr (Cfg::kEarlyGather)
    pending = prepare_item<Cfg>(p, blockIdx.x + (S - 1) * G, items, used, slabs, ec, tid);

  int stage = 0;  // the tile of item j
  for (int64_t item = blockIdx.x; item < items; item += G) {
    // Item j + S - 1 goes into the tile of item j - 1, last read before that item's second
    // barrier (this thread has passed its third).
    const int ahead = stage == 0 ? S - 1 : stage - 1;
    if constexpr (Cfg::kEarlyGather) {
      issue_item<Cfg>(p, pending, tid, in_tiles + ahead * Cfg::kInUnits, info + ahead);
      pending = prepare_item<Cfg>(p, item + S * G, items, used, slabs, ec, tid);
    } else {
      issue_item<Cfg>(p, prepare_item<Cfg>(p, item + (S - 1) * G, items, used, slabs, ec, tid), tid,
                      in_tiles + ahead * Cfg::kInUnits, info + ahead);
    }
    sm90::cp_async_wait<S - 1>();
    __syncthreads();  // every thread's copies of this item have landed, and its info
    const ColumnsItem it = info[stage];
    const int64_t c = it.c, col0 = it.col0;
    const int ncols = it.ncols, nrows = it.nrows;
    uint32_t* const in_words = reinterpret_cast<uint32_t*>(in_tiles + stage * Cfg::kInUnits);

    // Lane: columns 2·wcol (low halves) and 2·wcol + 1 (high halves) of rows [rg·RW, rg·RW + RW).
    uint32_t w[RW];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < RW; ++k) {
      w[k] = in_words[(rg * RW + k) * Cfg::kWordsPerRow + wcol];  // 32 consecutive words: 32 banks
      m = __vmaxu2(m, w[k] & kBf16AbsMask2);
    }
    in_words[rg * RW * Cfg::kWordsPerRow + wcol] = m;  // where this lane read w[0]
    __syncthreads();
#pragma unroll
    for (int k = 0; k < Cfg::kRowGroups; ++k) m = __vmaxu2(m, in_words[k * RW * Cfg::kWordsPerRow + wcol]);
    const TileScale s_lo = tile_scale(m & 0xffffu), s_hi = tile_scale(m >> 16);

    // Codes of the two columns for this warp's rows, 4 rows per word, rows in order.
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
    const int swz = lane % 8;  // (column / 2) % 8 for both columns 2·wcol and 2·wcol + 1
#pragma unroll
    for (int j = 0; j < RW / 16; ++j) {
      const int unit = (rg * RW / 16 + j) ^ swz;
      out_tile[(2 * wcol) * 8 + unit] = make_uint4(q_lo[4 * j], q_lo[4 * j + 1], q_lo[4 * j + 2], q_lo[4 * j + 3]);
      out_tile[(2 * wcol + 1) * 8 + unit] = make_uint4(q_hi[4 * j], q_hi[4 * j + 1], q_hi[4 * j + 2], q_hi[4 * j + 3]);
    }
    if (rg == 0 && 2 * wcol < ncols) {
      // [d, max_chunks]: one scalar per column (the scales are 1/32 of the codes' bytes).
      p.scales[(col0 + 2 * wcol) * p.max_chunks + c] = s_lo.s;
      p.scales[(col0 + 2 * wcol + 1) * p.max_chunks + c] = s_hi.s;
    }
    __syncthreads();

    // Store: [column][unit]: eight lanes write one column's 128 bytes.
#pragma unroll
    for (int i = 0; i < Cfg::kStoresPerThread; ++i) {
      const int u = tid + Cfg::kThreads * i, col = u / 8, unit = u % 8;
      const uint4 val = out_tile[col * 8 + (unit ^ ((col / 2) % 8))];
      if (col < ncols) store16(p.qt + (col0 + col) * p.r_pad + c * kTile + unit * 16, val);
    }
    // No barrier here: out_tile is next written after the next item's second barrier, which
    // every thread reaches after its stores' reads of it.
    stage = stage + 1 == S ? 0 : stage + 1;
  }
}

}  // namespace machmoe::kernels::fp8
