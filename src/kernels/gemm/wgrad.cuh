// The weight gradients as varlen-K grouped GEMMs on sm_90a.
//
//   for every expert e with rows [off[e], off[e+1]):
//     C[e] (M x N) = Σ_r A[row(r), :]ᵀ ⊗ B[r, :]      A rows [*, M] bf16, B rows [R, N] bf16
//   row(r) = gather[r] (dout or x gathered by token) or r. K = the expert's row count.
//   dW2 = doutᵀ·A' (A = dout gathered, B = A'), dW1ᵀ = xᵀ·dH (A = x gathered, B = dH, C stored
//   transposed into dW1 [E, n1, d]).
//
// Both operands are MN-major in shared memory (the reduction runs over their rows): each 64-row K
// block of A is two [64 K][64 M] blocks, of B BN/64 [64 K][64 N] blocks, 128-byte swizzled, and
// wgmma reads them with tnspA = tnspB = 1.
// Warpgroup 0 loads: all 128 threads copy the gathered A rows by 16-byte cp.async (zero-filled
// past the expert's last row), thread 0 loads B by TMA for full 64-row blocks; the expert's last,
// partial block of B is copied by cp.async too, zero-filled, so that no row of the next expert (or
// the uninitialised tail of the buffer) ever enters the sum. The gathered rows' source indices
// reach the copying threads through a two-slot ring in shared memory, 256 rows (four K blocks) a
// slot, loaded a slot ahead. Warpgroups 1-2 run wgmma on 64 rows of M each and release each stage
// as soon as its wgmmas retire. A full bf16 tile leaves by TMA: each warpgroup stages its 64 rows
// of C (or, with transpose_c, its 64 columns of Cᵀ) in its own 16 KB buffer, 128 columns at a
// time, and one of its threads issues each piece's store, the last of which runs under the next
// tile's main loop (the epilogue straight from the accumulators cost 15% at 7B-a: scattered 2-byte
// stores for the transposed dW1). Pieces rather than the whole 32 KB: the smaller buffers leave
// room for a fourth 48 KB stage at BN = 256 (on an H100: 30B-b dW1 +9%, dW2 +6%, 7B-a dW1 +5%;
// the second piece waits for the first's store to have read the buffer, which costs less).
// Partial tiles (at M's or N's end) and fp32 C are written straight from the accumulators. Tiles
// (e, m_blk, n_blk) are walked statically, expert-major; an expert with no rows gets its tiles
// written with zeros. Fixed K order: deterministic.
//
// Paired mode (kPair; the host's choice where N has two or more column tiles): clusters of two CTAs compute the two column tiles
// (n-blocks 2u, 2u + 1) of the same (expert, 128 rows of M), which need the same gathered A
// tile. Each CTA gathers only its half of it (rank r: M columns 64r .. 64r + 63, the half its
// consumer warpgroup r reads), so each SM issues half the cp.async of the unpaired kernel (the
// gather's cp.async bounds these kernels: gathering half the rows alone, with wrong results, ran
// 7B-a dW1 26% and 30B-b dW2/dW1 25% faster). Thread 0 of warpgroup r relays the half to the
// peer's stage by one 8 KB bulk copy (shared::cta -> shared::cluster, completing on the peer's
// `full_peer` barrier) once its full-barrier wait says the stage has landed. Measured on an H100:
// 30B-b dW2/dW1 +8%, 7B-a dW1 +4%. Slower alternatives: the relay from loader
// warp 0, polled while it waits for a free slot (7B-a dW1 -10%), and relaying every landed stage
// ahead of the consumer's own block (-6%). A stage is free again only when the consumers of
// both CTAs have released it (four arrivals, two of them remote), since the peer writes into
// it; the relay's source is then free too (the peer's consumers waited for its bytes). With an
// odd number of column tiles the last pair's rank 1 has no column tile: it still gathers and
// relays its half, runs the wgmmas on a stale B and stores nothing.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

constexpr int kWgradBM = 128, kWgradBK = 64, kWgradThreads = 384;
// The gathered rows' source indices are staged by the loaders this many rows at a time, in two
// slots (the kernel's idx_ring [2][kWgradIdxChunk]): four K blocks, two indices a loader thread.
constexpr int kWgradIdxChunk = 256;

struct GroupedWgradParams {
  const __nv_bfloat16* a;  // [*, M], lda
  int64_t lda;
  const int32_t* gather;   // [R] or null
  const __nv_bfloat16* b;  // [R, N], ldb
  int64_t ldb;
  const int32_t* expert_offsets;  // [E+1]
  int E, M, N;
  int m_tiles, n_tiles;
  void* c;                 // [E, M, N] or [E, N, M]
  bool c_fp32, transpose_c;
  bool tma_c;              // bf16 C: full tiles leave by TMA (tmap_c: C [E*M, N], or [E*N, M] transposed)
};

template <int BN>
struct WgradSmem {
  static constexpr int kABytes = kWgradBM * kWgradBK * 2;  // 16 KB: two [64 K][64 M] blocks
  static constexpr int kBBytes = BN * kWgradBK * 2;        // 32 KB for BN = 256
  static constexpr int kStageBytes = kABytes + kBBytes;
  // One staging buffer per consumer warpgroup: 64 rows x kEpiCols bf16 of C (either layout).
  // The staged C of a full tile goes out in pieces of kEpiCols columns (kEpiParts of them).
  static constexpr int kEpiCols = BN < 128 ? BN : 128;
  static constexpr int kEpiParts = BN / kEpiCols;
  static constexpr int kEpiBufBytes = 64 * kEpiCols * 2;
  static constexpr int kEpiBytes = 2 * kEpiBufBytes;
  static constexpr int kIdxBytes = 2 * kWgradIdxChunk * 4;  // the index ring
  static constexpr int kBudget = 227 * 1024;
  // Barriers (3 per stage). No alignment slack: the kernel declares its dynamic shared memory
  // 1024-byte aligned.
  static constexpr int kFixed = 1024;
  static constexpr int kStages = (kBudget - kFixed - kIdxBytes - kEpiBytes) / kStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kEpiBytes + kIdxBytes + kFixed;
  // The carve-up: [kStages] A stages (two [64 K][64 M] blocks each) | [kStages] B stages (BN/64
  // [64 K][64 N] blocks each) | [2] C staging buffers | [2] index-ring slots | barriers ([kStages]
  // full, [kStages] empty, [kStages] full_peer). The A stages and the C buffers are 1024-byte
  // aligned.
  static constexpr int kBOffset = kStages * kABytes;
  static constexpr int kEpiOffset = kStages * kStageBytes;
  static constexpr int kIdxOffset = kEpiOffset + kEpiBytes;
  static constexpr int kBarOffset = kIdxOffset + kIdxBytes;
  static_assert(kStages >= 2, "at least two pipeline stages");
  static_assert(3 * kStages * 8 <= kFixed, "fixed shared-memory area too small");
  static_assert(kWgradIdxChunk % kWgradBK == 0 && kWgradIdxChunk % 128 == 0,
                "a chunk is whole K blocks, whole loader passes");
};

// Copies rows [r0, r0 + rows) x columns [c0, c0 + W) of a bf16 matrix into MN-major blocks
// [64 K rows][64 columns] (8 KB apart), 128-byte swizzle; missing rows/columns are zero-filled.
// The 128 loader threads take 16-byte chunks, consecutive threads on consecutive chunks of a row.
template <int W>
struct WgradRows {
  static constexpr int kChunksPerRow = W / 8;
  static constexpr int kRowsPerPass = 128 / kChunksPerRow;
  static constexpr int kPasses = kWgradBK / kRowsPerPass;  // chunks per thread per K block
  static_assert(128 % kChunksPerRow == 0 && kWgradBK % kRowsPerPass == 0, "chunks must tile the threads");

  // Row of each of this thread's chunks in a contiguous operand (-1: past the expert's rows).
  static __device__ __forceinline__ void rows_in(int32_t (&row)[kPasses], int r0, int end, int tid) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = r0 + tid / kChunksPerRow + kRowsPerPass * i;
      row[i] = r < end ? r : -1;
    }
  }

  // Source row of each of this thread's chunks in the gathered operand, from the loaders' index
  // ring: `chunk` holds the source rows of rows [chunk_r0, chunk_r0 + kWgradIdxChunk) (-1 past
  // the expert's end), and this block's rows start at chunk[k0]. Shared-memory reads: a few cycles,
  // where a global load of the index costs this thread an L2 round trip before its copies.
  static __device__ __forceinline__ void rows_from(int32_t (&row)[kPasses], const int32_t* chunk, int k0, int tid) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) row[i] = chunk[k0 + tid / kChunksPerRow + kRowsPerPass * i];
  }

  // Addresses in 16-byte units held in 32 bits (the launcher bounds both operands below 2^32 of
  // them): a multiply-add and one wide multiply-add per copy (measured on the forward's gather: the
  // loader instructions, not the memory, bounded it).
  static __device__ __forceinline__ void copy(uint8_t* stage, const __nv_bfloat16* base, int64_t ld,
                                              const int32_t (&row)[kPasses], int c0, int cols, int tid) {
    const int c = tid % kChunksPerRow;
    const int col = c0 + c * 8;
    uint8_t* block = stage + (c / 8) * (kWgradBK * 128);
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int kr = tid / kChunksPerRow + kRowsPerPass * i;
      const bool ok = row[i] >= 0 && col < cols;
      const uint32_t unit = static_cast<uint32_t>(row[i]) * static_cast<uint32_t>(ld / 8) + col / 8;
      // (the offset selected, not the pointer: see GemmGatherRows::copy)
      sm90::cp_async_16(sm90::smem_addr(block + kr * 128 + (((c % 8) ^ (kr & 7)) << 4)),
                        reinterpret_cast<const uint4*>(base) + (ok ? unit : 0u), ok ? 16 : 0);
    }
  }
};

// Work unit t -> expert, first row of M, this CTA's first column, and the expert's rows
// [begin, end) (m inner: the CTAs running together share the expert's B rows and most of its A
// rows in L2). A unit is one tile, or with kPair the two column tiles of a cluster (n-blocks 2u
// and 2u + 1; rank r takes 2u + r, past N for the odd last one). Decoded by the loaders and the
// consumers alike.
struct WgradTile {
  int e, m0, n0, begin, end;
};
template <bool kPair>
__device__ __forceinline__ int wgrad_units_per_expert(const GroupedWgradParams& p) {
  return p.m_tiles * (kPair ? (p.n_tiles + 1) / 2 : p.n_tiles);
}
template <int BN, bool kPair>
__device__ __forceinline__ WgradTile wgrad_decode(const GroupedWgradParams& p, int t, int rank) {
  const int per_expert = wgrad_units_per_expert<kPair>(p);
  WgradTile w;
  w.e = t / per_expert;
  const int local = t - w.e * per_expert;
  w.m0 = (local % p.m_tiles) * kWgradBM;
  const int unit = local / p.m_tiles;
  w.n0 = (kPair ? 2 * unit + rank : unit) * BN;
  w.begin = __ldg(p.expert_offsets + w.e);
  w.end = __ldg(p.expert_offsets + w.e + 1);
  return w;
}

// The weight-gradient kernels' dynamic shared memory, carved up as WgradSmem's offsets say.
// 1024-byte aligned as declared (the 128-byte swizzle atoms): WgradSmem::kFixed has no slack for a
// round-up. (Its own name, as the dH ping-pong's: the alignment of a shared extern array reaches
// every kernel that declares it.)
extern __shared__ __align__(1024) uint8_t wgrad_smem[];

// The kernel's phases: barrier setup (init_barriers), the loader warpgroup (loader), and the
// consumer warpgroups' two epilogues (store_tile_direct, store_tile_tma); the consumers' main loop
// is in the kernel body.
//
// The split keeps the machine code of the single kernel body it came from. The compiler simplifies
// each phase before inlining it, so what a phase can see there matters: each phase takes its
// shared-memory addresses from wgrad_smem itself (constants), not as arguments or from a struct;
// the consumers' lane and warp come from the kernel body, and `peer` is computed at the kernel's
// start. The consumers' main loop as a function of its own compiled to another block order or
// other register assignments in every form tried, so it stays inline.
template <int BN, bool kPair>
struct GroupedWgrad {
  using Smem = WgradSmem<BN>;
  static constexpr int S = Smem::kStages;
  using Stages = StageRing<S>;
  static constexpr uint32_t kHalfBytes = Smem::kABytes / 2;  // one [64 K][64 M] block of A
  // This CTA's columns of A: all 128, or with kPair its half (M columns m0 + 64·rank ..).
  using RowsA = WgradRows<kPair ? 64 : kWgradBM>;
  using RowsB = WgradRows<BN>;

  // By thread 0, before the CTA's (with kPair the cluster's) first barrier.
  static __device__ __forceinline__ void init_barriers() {
    uint64_t* full = reinterpret_cast<uint64_t*>(wgrad_smem + Smem::kBarOffset);  // [S]
    uint64_t* empty = full + S;                                                      // [S]
    uint64_t* full_peer = empty + S;  // [S], kPair: the half of A the peer gathered has landed here
    for (int s = 0; s < S; ++s) {
      // 128 cp.async arrivals (this CTA's rows of A, the partial block's B) + thread 0's (expect_tx)
      sm90::mbar_init(&full[s], 128 + 1);
      // one per consumer warpgroup, of both CTAs with kPair (the peer writes into this stage)
      sm90::mbar_init(&empty[s], kPair ? 4 : 2);
      if (kPair) sm90::mbar_init(&full_peer[s], 1);  // thread 0's expect_tx; the bytes come from the peer
    }
  }

  // Warpgroup 0, the loaders: for every K block of every unit, the gathered A rows [64 K][128 M]
  // (with kPair this CTA's [64 K][64 M] half) by cp.async from all 128 threads, and B [64 K][BN]
  // by TMA from thread 0, or by cp.async for an expert's last, partial block, zero-filled so that
  // no row past the expert's end enters the sum.
  static __device__ __forceinline__ void loader(const GroupedWgradParams& p, const CUtensorMap* tmap_b, int tid,
                                                uint32_t rank, int first, int stride, int units) {
    uint8_t* smem_a = wgrad_smem;                   // [S][kABytes]
    uint8_t* smem_b = wgrad_smem + Smem::kBOffset;  // [S][kBBytes]
    int32_t* idx_ring = reinterpret_cast<int32_t*>(wgrad_smem + Smem::kIdxOffset);  // [2][kWgradIdxChunk]
    uint64_t* full = reinterpret_cast<uint64_t*>(wgrad_smem + Smem::kBarOffset);
    uint64_t* full_peer = full + 2 * S;
    const Stages stages{full, full + S};
    int it = 0;
    // The gathered rows' source indices go through shared memory (idx_ring), kWgradIdxChunk rows
    // at a time: each loader thread loads kIdxPer of the next chunk's indices (coalesced) when a
    // chunk starts and stores them when the next one starts, so that one index round trip is paid
    // per kBlocksPerChunk K blocks, under the copies of the blocks before it. (Nsight Compute at
    // 7B-a dW2, with the indices loaded per thread one block ahead instead: the loaders waited on
    // those loads in 9% of all warp samples and the consumers on the stages in 43%.)
    constexpr int kIdxPer = kWgradIdxChunk / 128;
    constexpr int kBlocksPerChunk = kWgradIdxChunk / kWgradBK;
    constexpr int kIdxBar = 3;  // named barrier of the 128 loader threads (1, 2: the consumers')
    int chunks = 0;             // chunks staged so far: slot = chunks & 1, alternating across tiles
    int32_t next_idx[kIdxPer];
    // The source rows of rows [r, r + kWgradIdxChunk) of B into next_idx, -1 past the expert's end.
    auto load_idx = [&](int r, int end) {
#pragma unroll
      for (int k = 0; k < kIdxPer; ++k) {
        const int rr = r + tid + 128 * k;  // below 2^31: the launcher bounds R (b_rows) with this slack
        next_idx[k] = rr < end ? (p.gather ? __ldg(p.gather + rr) : rr) : -1;
      }
    };
    // The slot written was last read two chunks ago, before every loader passed the previous
    // chunk's barrier; this barrier makes the chunk visible to all of them.
    auto stage_idx = [&]() {
      int32_t* slot = idx_ring + (chunks & 1) * kWgradIdxChunk;
#pragma unroll
      for (int k = 0; k < kIdxPer; ++k) slot[tid + 128 * k] = next_idx[k];
      sm90::named_barrier_sync(kIdxBar, 128);
      ++chunks;
    };
    for (int t = first; t < units; t += stride) {
      const auto [e, m0, n0, begin, end] = wgrad_decode<BN, kPair>(p, t, rank);
      const bool has_n = n0 < p.N;  // false only for kPair's rank 1 of an odd last pair
      int32_t a_rows[RowsA::kPasses];
      if (begin < end) {
        load_idx(begin, end);
        stage_idx();
        load_idx(begin + kWgradIdxChunk, end);
      }
      for (int r0 = begin, kb = 0; r0 < end; r0 += kWgradBK, ++it, ++kb) {
        if (kb > 0 && kb % kBlocksPerChunk == 0) {  // a new chunk: stage it, load the one after
          stage_idx();
          load_idx(r0 + kWgradIdxChunk, end);
        }
        const int32_t* chunk = idx_ring + ((chunks - 1) & 1) * kWgradIdxChunk;  // the chunk staged last
        RowsA::rows_from(a_rows, chunk, (kb % kBlocksPerChunk) * kWgradBK, tid);
        const typename Stages::Slot slot = Stages::slot(it);
        const int s = slot.stage;
        stages.acquire(slot);
        uint8_t* a_stage = smem_a + s * Smem::kABytes;
        uint8_t* b_stage = smem_b + s * Smem::kBBytes;
        if (kPair && tid == 0) sm90::mbar_arrive_expect_tx(&full_peer[s], kHalfBytes);
        if (end - r0 >= kWgradBK && has_n) {
          if (tid == 0) {
            stages.commit_tx(s, Smem::kBBytes);
#pragma unroll
            for (int h = 0; h < BN / 64; ++h)
              sm90::tma_load_2d(b_stage + h * 64 * 128, tmap_b, stages.full_barrier(s), n0 + 64 * h, r0);
          }
        } else {  // the expert's last, partial block: B by cp.async too, zero-filled (none without columns)
          if (has_n) {
            int32_t b_rows[RowsB::kPasses];
            RowsB::rows_in(b_rows, r0, end, tid);
            RowsB::copy(b_stage, p.b, p.ldb, b_rows, n0, p.N, tid);
          }
          if (tid == 0) stages.commit(s);
        }
        if constexpr (kPair)
          RowsA::copy(a_stage + rank * kHalfBytes, p.a, p.lda, a_rows, m0 + 64 * rank, p.M, tid);
        else
          RowsA::copy(a_stage, p.a, p.lda, a_rows, m0, p.M, tid);
        stages.commit_cp_async(s);
      }
    }
  }

  // Partial tiles (at M's or N's end) and fp32 C: this warpgroup's 64 x BN part of tile (e, m0,
  // n0) straight from the accumulators acc [BN/2], two columns a store. Accumulator fragment:
  // register 4·jj + 2·half + i is row (warp·16 + lane/4 + 8·half) of the warpgroup's 64, column
  // 8·jj + 2·(lane % 4) + i.
  static __device__ __forceinline__ void store_tile_direct(const GroupedWgradParams& p, int e, int m0, int n0, int cw,
                                                           int lane, int warp, const float (&acc)[BN / 2]) {
    const int64_t base = static_cast<int64_t>(e) * p.M * p.N;
#pragma unroll
    for (int jj = 0; jj < BN / 8; ++jj) {
      const int n = n0 + jj * 8 + 2 * (lane % 4);
      if (n >= p.N) continue;  // N is a multiple of 8: n + 1 < N too
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = m0 + cw * 64 + warp * 16 + lane / 4 + 8 * half;
        if (m >= p.M) continue;
        const float v0 = acc[jj * 4 + half * 2], v1 = acc[jj * 4 + half * 2 + 1];
        if (p.transpose_c) {
          const int64_t i0 = base + static_cast<int64_t>(n) * p.M + m, i1 = i0 + p.M;
          if (p.c_fp32) {
            static_cast<float*>(p.c)[i0] = v0;
            static_cast<float*>(p.c)[i1] = v1;
          } else {
            static_cast<__nv_bfloat16*>(p.c)[i0] = __float2bfloat16_rn(v0);
            static_cast<__nv_bfloat16*>(p.c)[i1] = __float2bfloat16_rn(v1);
          }
        } else {
          const int64_t i0 = base + static_cast<int64_t>(m) * p.N + n;
          if (p.c_fp32)
            *reinterpret_cast<float2*>(static_cast<float*>(p.c) + i0) = make_float2(v0, v1);
          else
            *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.c) + i0) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
  }

  // A full bf16 tile (e, m0, n0) by TMA: this warpgroup's 64 x BN part of C in kEpiParts pieces of
  // [64][kEpiCols] through its own buffer, 128-byte swizzled rows as the TMA store reads them,
  // each once the buffer's previous store has read it. (One 16 KB buffer per warpgroup instead of
  // 32 KB: a fourth stage at BN = 256.) The last piece's store runs under the next tile.
  static __device__ __forceinline__ void store_tile_tma(const GroupedWgradParams& p, const CUtensorMap* tmap_c, int e,
                                                        int m0, int n0, int cw, int tid, int lane, int warp,
                                                        const float (&acc)[BN / 2]) {
#pragma unroll
    for (int part = 0; part < Smem::kEpiParts; ++part) {
      uint8_t* buf = wgrad_smem + Smem::kEpiOffset + cw * Smem::kEpiBufBytes;  // [64][kEpiCols] bf16
      if (tid == 0) sm90::bulk_wait_read_all();
      sm90::named_barrier_sync(1 + cw, 128);
      constexpr int kJ = Smem::kEpiCols / 8;  // 8-column groups per piece
      if (p.transpose_c) {
        // [kEpiCols rows n][64 m] (one box {64 m, kEpiCols n} of C [E*N, M]): 2-byte stores,
        // conflict-free (the 4 n of a warp's store fall in 4 different swizzled 16-byte slots).
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int jj = part * kJ + j;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int m = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int n = j * 8 + 2 * (lane % 4) + i;
              *reinterpret_cast<__nv_bfloat16*>(buf + n * 128 + (((m >> 3) ^ (n & 7)) << 4) + (m & 7) * 2) =
                  __float2bfloat16_rn(acc[jj * 4 + half * 2 + i]);
            }
          }
        }
      } else {
        // kEpiCols/64 boxes [64 rows m][64 n] (boxes {64 n, 64 m} of C [E*M, N]).
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int jj = part * kJ + j;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + lane / 4 + 8 * half;
            *reinterpret_cast<__nv_bfloat162*>(buf + (j / 8) * (64 * 128) + r * 128 + (((j % 8) ^ (r & 7)) << 4) +
                                               (lane % 4) * 4) =
                __floats2bfloat162_rn(acc[jj * 4 + half * 2], acc[jj * 4 + half * 2 + 1]);
          }
        }
      }
      sm90::fence_proxy_async_shared();  // st.shared -> the TMA store's reads
      sm90::named_barrier_sync(1 + cw, 128);
      if (tid == 0) {
        const int c0 = n0 + part * Smem::kEpiCols;
        if (p.transpose_c) {
          sm90::tma_store_2d(tmap_c, buf, m0 + cw * 64, e * p.N + c0);
        } else {
#pragma unroll
          for (int h = 0; h < Smem::kEpiCols / 64; ++h)
            sm90::tma_store_2d(tmap_c, buf + h * (64 * 128), c0 + 64 * h, e * p.M + m0 + cw * 64);
        }
        sm90::bulk_commit_group();
      }
    }
  }
};

template <int BN, bool kPair>
__global__ void __launch_bounds__(kWgradThreads, 1)
    sm90_grouped_wgrad(const __grid_constant__ CUtensorMap tmap_b, const __grid_constant__ CUtensorMap tmap_c,
                       const GroupedWgradParams p) {
  using Wgrad = GroupedWgrad<BN, kPair>;
  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  const uint32_t rank = kPair ? sm90::cluster_ctarank() : 0, peer = rank ^ 1u;
  if (threadIdx.x == 0) {
    Wgrad::init_barriers();
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_b);
    if (p.tma_c) sm90::tma_prefetch_descriptor(&tmap_c);
  }
  if constexpr (kPair)
    sm90::cluster_sync();  // the peer's barriers exist before anyone signals them
  else
    __syncthreads();
  // Units are walked statically: this CTA (with kPair, cluster) takes first, first + stride, ...
  const int units = p.E * wgrad_units_per_expert<kPair>(p);
  const int first = kPair ? blockIdx.x / 2 : blockIdx.x, stride = kPair ? gridDim.x / 2 : gridDim.x;

  if (wg == 0) {
    sm90::setmaxnreg_dec<56>();
    Wgrad::loader(p, &tmap_b, tid, rank, first, stride, units);
  } else {
    // The consumers, warpgroup cw (0 or 1): rows [64 cw, 64 cw + 64) of M of every unit's tile.
    // The main loop runs wgmma m64n{BN}k16 over the expert's K blocks, A [64 K][64 M] and B
    // [64 K][BN] both MN-major (tnspA = tnspB = 1), into acc [BN/2] fp32 a thread, and releases
    // each stage as soon as its wgmmas retire; the tile then leaves by one of the two stores.
    sm90::setmaxnreg_inc<224>();
    using Smem = typename Wgrad::Smem;
    constexpr int S = Smem::kStages;
    constexpr uint32_t kHalfBytes = Wgrad::kHalfBytes;
    const int cw = wg - 1;
    uint8_t* smem_a = wgrad_smem;                   // [S][kABytes]
    uint8_t* smem_b = wgrad_smem + Smem::kBOffset;  // [S][kBBytes]
    uint64_t* full = reinterpret_cast<uint64_t*>(wgrad_smem + Smem::kBarOffset);
    uint64_t* full_peer = full + 2 * S;
    const typename Wgrad::Stages stages{full, full + S};
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    int it = 0;
    // A stage is free once this warpgroup's wgmmas reading it retired: tell both CTAs with kPair.
    auto release = [&](int s) {
      stages.release(s);
      if constexpr (kPair) sm90::mbar_arrive_cluster(&stages.empty[s], peer);
    };
    for (int t = first; t < units; t += stride) {
      const auto [e, m0, n0, begin, end] = wgrad_decode<BN, kPair>(p, t, rank);
      const bool has_n = n0 < p.N;
      float acc[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      for (int r0 = begin; r0 < end; r0 += kWgradBK, ++it) {
        const typename Wgrad::Stages::Slot slot = Wgrad::Stages::slot(it);
        const int s = slot.stage;
        stages.wait(slot);
        // kPair: warpgroup `rank` reads this CTA's own half of A, the other one the peer's
        if (kPair && cw != static_cast<int>(rank)) sm90::mbar_wait(&full_peer[s], slot.phase);
        sm90::fence_proxy_async_shared();  // cp.async (generic proxy) -> wgmma and the relay (async proxy)
        if (kPair && cw == static_cast<int>(rank) && tid == 0)  // relay this CTA's half to the peer
          sm90::bulk_copy_to_peer(smem_a + s * Smem::kABytes + rank * kHalfBytes, kHalfBytes, &full_peer[s], peer);
        const uint32_t a_addr = sm90::smem_addr(smem_a + s * Smem::kABytes + cw * 64 * 128);
        const uint32_t b_addr = sm90::smem_addr(smem_b + s * Smem::kBBytes);
        sm90::wgmma_fence();
        // (Unconditional even without columns: the result is then dropped. A runtime condition
        // around the wgmmas makes ptxas fence them (C7519) or serialise them (C7520): -5% and more.)
#pragma unroll
        for (int ks = 0; ks < kWgradBK / 16; ++ks) {
          sm90::wgmma_bf16<BN, 1, 1>(acc, sm90::smem_desc_mnmajor_sw128(a_addr + ks * 2048, 64 * 128),
                                     sm90::smem_desc_mnmajor_sw128(b_addr + ks * 2048, 64 * 128), 1);
        }
        sm90::wgmma_commit();
        // The stage is released as soon as its wgmmas retire, not one block later: the loaders
        // refill it while this warpgroup waits for the next one, and the other warpgroup's group
        // keeps the tensor cores busy meanwhile (with the index ring: 7B-a dW2 0.473 against
        // 0.485 M cycles, 30B-a +1%).
        sm90::wgmma_wait<0>();
        sm90::fence_accumulators(acc);
        if (tid == 0) release(s);
      }
      if (!has_n) continue;  // kPair's rank 1 of an odd last pair: no columns to store
      if (p.tma_c && m0 + kWgradBM <= p.M && n0 + BN <= p.N) {
        Wgrad::store_tile_tma(p, &tmap_c, e, m0, n0, cw, tid, lane, warp, acc);
        continue;
      }
      Wgrad::store_tile_direct(p, e, m0, n0, cw, lane, warp, acc);
    }
    if (tid == 0) sm90::bulk_wait_all();  // this warpgroup's TMA stores are complete
  }
  // kPair: neither CTA exits while the other may still arrive on its barriers or relay into it.
  if constexpr (kPair) sm90::cluster_sync();
}

}  // namespace machmoe::kernels
