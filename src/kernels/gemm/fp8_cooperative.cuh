// The sm_90a FP8 (E4M3) grouped GEMM, DeepSeek-V3's recipe, contiguous or gathered A, a plain
// bf16 store or the up-projection's GLU epilogue with fused quantisation (EPI, fp8_glu_epilogue.cuh):
//
//   for every expert e with rows [off[e], off[e+1]):
//     C[r, n] = Σ_kb sa[a(r), kb] · sb[e, n / 128, kb] · Σ_{k in block kb} Aq[a(r), k] · Wq[e, n, k]
//   a(r) = gather[r] (GATHER: the up-projection's rows of x by token, x quantised once) or r;
//   Aq e4m3 [T, K] with row scales sa fp32 [T, KB] (1x128 tiles along K, quantize_rows_fp8; T = R
//   without a gather),
//   Wq e4m3 [E, N, K] with block scales sb fp32 [E, NB, KB] (128x128 blocks, quantize_weights_fp8),
//   KB = ceil(K / 128), NB = ceil(N / 128); C bf16 [R, ldc].
//
// Promotion. Each 128-deep K block (one scale group of both operands) is accumulated by four
// wgmma m64n128k32 into a temporary fp32 fragment `tmp`, then added into the main accumulator
// with its two scales in fp32 (acc += sa·sb·tmp): the tensor core's FP8 accumulation (~14 bits,
// DeepSeek-V3 §3.3) never spans more than one block.
//
// Persistent and warp-specialised like gemm/cooperative.cuh (same tile schedule, stage ring and
// tile ring), 3 warpgroups per CTA, one CTA per SM:
//   warpgroup 0 (40 registers; 56 with a gather): warp 0 loads. Lane 0 publishes each tile
//     (gemm/scheduler.cuh) and issues the TMA loads of a stage: A [128 rows x 128 K] and
//     B [BN rows x 128 K], both K-major with the 128-byte swizzle (one swizzle row = 128 e4m3 =
//     exactly one scale group). All 32 lanes copy the stage's scales by 4-byte cp.async: sa of
//     the tile's 128 rows (4 rows a lane) and sb of its BN/128 weight blocks, completing on the
//     stage's full barrier (1 TMA arrival + 32 cp.async arrivals). Warps 1-3 write the plain
//     store's staged tiles out (below); with the GLU epilogue they have nothing to do and leave.
//     GATHER: all four warps load (the cp.async issue rate bounds a gathered GEMM: one warp per
//     SM sub-partition, as the bf16 engine's gathered loaders, gemm/cooperative.cuh). Thread 0
//     still publishes and issues B's TMA; the 128 threads copy A's rows by 16-byte cp.async into
//     the layout the TMA writes, and sa of one row each (Fp8GatherRows); 1 + 128 arrivals.
//   warpgroups 1-2, consumers (232 registers; 224 with a gather): each owns 64 rows of the
//     128-row tile and runs its 64 x BN as BN/128 "waves" of 128 columns per K block, one weight
//     block each (so one scalar
//     sb per wave and no column select): tmp[64] (64 x 128 fp32) + acc[BN/2] (64 x BN fp32).
//     Each wave: fence, 4 wgmma, commit, wait<0>, promote. The other warpgroup's wgmmas keep the
//     tensor cores busy while one promotes. The stage is released (one arrival per warp, 8 in
//     all) after the last wave's wgmmas have retired; the scales were read before the first wave.
//     At the tile's end:
//     - contiguous A, plain store (the down-projection, dX~: C [R, N] bf16, 2 bytes an output
//       against 1/8 byte an output of A per 128-deep K block, so the store is DRAM-bound): the
//       consumers stage the bf16 tile in shared memory (stmatrix, gemm/epilogue.cuh's boxed
//       layout, a few hundred cycles) and go back to the tensor cores; warps 1-3 of warpgroup 0
//       send a full tile out by TMA stores (128 x 64 boxes, clipped at N and R) or write a
//       partial one (an expert's last rows) in 16-byte stores, so the DRAM writes overlap the
//       next tile's main loop. The staging (64 KB) costs a pipeline stage (3 instead of 4).
//     - with a gather (dA' = dout·W2ᵀ: N = n, a small output) or the GLU epilogue: each consumer
//       stores its rows straight from registers, 8 columns (16 bytes) a lane after a transpose
//       inside each quad, bounded by the expert's rows and by N.
//     Registers (ptxas of CUDA 13.0, sm_90a, 2026-11, BN = 256; the consumers get 224): the
//     staged store's kernel uses up to R204, the gathered store's R210, the gathered GLU's R218;
//     no spill, no stack frame.
// Partial tiles: an expert's last row block reads the next rows of Aq (another expert's, computed
// and not stored; past R the TMA reads zeros and the scale copy writes 0); with a gather its rows
// past the expert's end get zero codes and scale 0 instead (cp.async with src-size 0: nothing is
// read, so no NaN from garbage). A partial last K block (K % 128 != 0) is zero-filled by the TMA
// in both operands (with a gather, A's chunks past K by the copy: K is a multiple of 16, so a
// 16-byte chunk lies wholly inside or outside). Column blocks past N read the next expert's
// weight rows (not stored) and a zero sb where the block index passes NB.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/gemm/params.cuh"
#include "kernels/gemm/fp8_glu_epilogue.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/ptx/sm90_ptx_fp8.cuh"

namespace machmoe::kernels {

constexpr int kFp8BK = 128;  // K per stage: one scale group, one 128-byte swizzle row of e4m3

struct Fp8GemmParams {
  // The schedule's fields (expert_offsets, tile_offsets, E, N, K, n_tiles), the gather ([R] or
  // null) and the output (c bf16 [R, ldc]); a, lda, bias, c2 and the epilogue fields are unused.
  GroupedGemmParams g;
  const uint8_t* aq;  // [a_rows, K] e4m3: read by the gather's cp.async (contiguous A: by the TMA)
  const float* sa;    // [a_rows, k_blocks]
  const float* sb;    // [E, n_blocks, k_blocks]
  int a_rows;         // rows of Aq and sa: T with a gather, else R
  int c_rows;         // R: rows of C
  int k_blocks;       // ceil(K / 128)
  int n_blocks;       // ceil(N / 128)
  Fp8GluOutputs glu;  // kFp8EpiGlu's outputs (c unused then)
};

// What a finished tile becomes: C in bf16 (store), or the up-projection's Hq, Aq and their scales
// (gemm/fp8_glu_epilogue.cuh; BN = 256, W's rows gate/up interleaved, the activation p.g.act).
enum Fp8Epilogue : int { kFp8EpiStore = 0, kFp8EpiGlu = 1 };

// Register split of the 64K-register file: (40 + 2 x 232) x 128 threads = 64512. The loader warp
// holds only its tile and loop counters. With a gather or the staged store, (56 + 2 x 224) x 128
// as the bf16 engine: the gathered loaders hold their 8 rows' offsets and scale row
// (Fp8GatherRows), the epilogue warps the staged tile's item loop; the consumers fit in 224
// (ptxas, in the comment at the top).
template <bool kWideProducer>
constexpr int fp8_producer_regs() { return kWideProducer ? 56 : 40; }
template <bool kWideProducer>
constexpr int fp8_consumer_regs() { return kWideProducer ? 224 : 232; }

// A gathered row's sa when its gather value lies outside [0, T): the NaN scale (fp8.hpp), copied
// by cp.async (which reads only global memory) so that the row's outputs are NaN, as
// quantize_rows_fp8 makes such a row; its codes are zero-filled (nothing is read for it).
__device__ uint32_t fp8_gather_nan_scale = 0x7fc00000u;

// The gathered A tile [128 rows x 128 K] e4m3 of one stage and its row scales, copied by the
// loader warpgroup's 128 threads by cp.async (the layout of GemmGatherRows in gemm/cooperative.cuh,
// in e4m3 units, with the scale row and the index check the FP8 operand adds). One K block of a
// row is 128 bytes, one 128-byte swizzle row: 16-byte chunk c of tile row r goes to
// r·128 + 16·(c ^ (r % 8)) of the 1024-byte aligned stage, byte for byte where the TMA puts it for
// the contiguous path (CU_TENSOR_MAP_SWIZZLE_128B), so the same wgmma descriptors read both.
// Thread t copies chunk t % 8 (16 codes of the K block) of rows t / 8 + 16i, i < 8 (a warp: four
// whole 128-byte rows per instruction), and sa[gather[row0 + t], kb] of row t. Offsets are
// loaded once per tile into registers (32-bit, in 16-byte units: the launcher bounds T·K/16).
struct Fp8GatherRows {
  static constexpr int kRows = 8;                    // 128 rows x 8 chunks / 128 threads
  static constexpr uint32_t kNoRow = ~0u;            // past the expert's end: zero codes, scale 0
  static constexpr uint32_t kBadRow = kNoRow - 1;    // (srow) gather value outside [0, T): scale NaN
  uint32_t arow[kRows];  // gather[r]·K/16 of rows t / 8 + 16i, or kNoRow (also for a bad index)
  uint32_t srow;         // gather[row0 + t]·KB, or kNoRow / kBadRow

  __device__ __forceinline__ void load(const Fp8GemmParams& p, const GemmTile& tile, int t) {
    const uint32_t units = static_cast<uint32_t>(p.g.K) / 16, T = static_cast<uint32_t>(p.a_rows);
    // The tile's rows, also bounded by R: offsets past R break the documented rule, and gather [R]
    // is not read past its end then (as C is not written there).
    const int rows = min(tile.rows, p.c_rows - tile.row0);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = t / 8 + 16 * i;
      // (a negative index is a large unsigned one: outside [0, T) too)
      const uint32_t g = r < rows ? static_cast<uint32_t>(__ldg(p.g.gather + tile.row0 + r)) : kNoRow;
      arow[i] = g < T ? g * units : kNoRow;
    }
    const bool real = t < rows;
    const uint32_t g = real ? static_cast<uint32_t>(__ldg(p.g.gather + tile.row0 + t)) : kNoRow;
    srow = g < T ? g * static_cast<uint32_t>(p.k_blocks) : (real ? kBadRow : kNoRow);
  }

  // Block kb's A chunks into a_stage and row t's scale into sc[t].
  __device__ __forceinline__ void copy(const Fp8GemmParams& p, uint8_t* a_stage, float* sc, int t, int kb) const {
    const int chunk = t % 8;
    const uint32_t k_units = static_cast<uint32_t>(kb) * (kFp8BK / 16) + chunk;  // this thread's 16 bytes
    const bool k_ok = k_units < static_cast<uint32_t>(p.g.K) / 16;            // chunks past K: zeros
    const uint4* a = reinterpret_cast<const uint4*>(p.aq);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = t / 8 + 16 * i;
      const bool ok = k_ok && arow[i] != kNoRow;
      const uint32_t dst = sm90::smem_addr(a_stage + r * kFp8BK + ((chunk ^ (r & 7)) << 4));
      // arow + k_units < T·K/16 < 2^32. The offset is selected, not the pointer (the pointer form
      // reloads the base from the constant bank per row, gemm/cooperative.cuh); a row not read
      // zero-fills from Aq's first 16 bytes with src-size 0.
      sm90::cp_async_16(dst, a + (ok ? arow[i] + k_units : 0u), ok ? 16 : 0);
    }
    const float* src = srow < kBadRow ? p.sa + (srow + kb) : reinterpret_cast<const float*>(&fp8_gather_nan_scale);
    sm90::cp_async_4(sm90::smem_addr(sc + t), src, srow == kNoRow ? 0 : 4);
  }
};

// Shared memory: S stages of [A 16 KB | B BN·128 B], then the layout's "epilogue" area: the staged
// output tile (kStaged: BN/64 boxes [128 rows][64 columns] bf16, 128-byte swizzle, 1024-byte
// aligned as it follows whole stages) and S scale slots; then the barriers, the tile ring (with
// the epilogue handoff when kStaged) and the tile-offset table (GroupedGemmSmemLayout).
template <int BN, bool kStaged>
struct Fp8GemmSmem {
  static constexpr int kWaves = BN / 128;
  static constexpr int kABytes = kGemmBM * kFp8BK;  // 16 KB
  static constexpr int kBBytes = BN * kFp8BK;       // 32 KB for BN = 256
  static constexpr int kStageBytes = kABytes + kBBytes;
  // sa [128] of the tile's rows, then sb [kWaves] of its column blocks, padded to 16 bytes.
  static constexpr int kScaleFloats = 128 + 4;
  static constexpr int kScaleBytes = kScaleFloats * 4;
  static constexpr int kBudget = 227 * 1024;
  static constexpr int kFixed = 4096;  // 1 KB alignment slack + barriers, ring, tile table
  static constexpr int kOutBytes = kStaged ? kGemmBM * BN * 2 : 0;  // 64 KB at BN = 256
  static constexpr int kFit = (kBudget - kFixed - kOutBytes) / (kStageBytes + kScaleBytes);
  static constexpr int kStages = kFit < kTileRing - 1 ? kFit : kTileRing - 1;
  static constexpr int kEpiBytes = kOutBytes + kStages * kScaleBytes;
  static constexpr int kBytes = kStages * kStageBytes + kEpiBytes + kFixed;
  static_assert(BN % 128 == 0 && kWaves >= 1 && kWaves <= 4, "BN: whole 128-column waves, at most 4");
  static_assert(kStages >= 2, "at least two pipeline stages");
  static_assert(kEpiBytes % 16 == 0, "the barriers after the scale slots stay 8-byte aligned");
  static_assert(kOutBytes % kEpiBoxBytes == 0, "whole 128 x 64 boxes (gemm/epilogue.cuh)");
  // barriers (2 per stage, 2 per ring slot, 2 for the handoff), the ring and the handoff's tile,
  // the handoff's row scores (unused here, part of the layout), the tile-offset table
  static_assert((2 * kStages + 2 * kTileRing + 2) * 8 + (kTileRing + 1) * 16 + 128 * 4 + (kGemmSmemTileE + 1) * 4 <=
                    kFixed - 1024,
                "fixed shared-memory area too small");
};

template <int BN, bool GATHER, int EPI>
struct Fp8GemmCooperative {
  static_assert(EPI == kFp8EpiStore || BN == 256, "the GLU epilogue's A scale group is one 256-column tile");
  // The plain store of a contiguous A goes through shared memory to warps 1-3 (the loader is one
  // warp there); a gathered A keeps all four warps loading.
  static constexpr bool kStaged = EPI == kFp8EpiStore && !GATHER;
  static constexpr bool kWideProducer = GATHER || kStaged;
  using Smem = Fp8GemmSmem<BN, kStaged>;
  using Layout = GroupedGemmSmemLayout<Smem, kStaged>;
  static constexpr int S = Smem::kStages;
  static constexpr int kWaves = Smem::kWaves;
  using Stages = StageRing<S>;
  // The loader threads: warp 0 with TMA loads of A, the whole warpgroup with a gather.
  static constexpr int kLoaders = GATHER ? 128 : 32;
  static constexpr int kEpilogueThreads = 96;  // warps 1-3 (kStaged)

  static __device__ __forceinline__ void init_barriers(const Layout& sm) {
    // full: the TMA thread's expect_tx arrival + the loaders' cp.async arrivals (32, or 128 with
    // a gather); empty: one arrival per consumer warp.
    sm.stages().init(1 + kLoaders, 8);
    for (int r = 0; r < kTileRing; ++r) {
      sm90::mbar_init(&sm.tile_full[r], 1);     // the publishing lane
      sm90::mbar_init(&sm.tile_empty[r], 256);  // every consumer thread, once it has read the slot
    }
    if constexpr (kStaged) {
      sm90::mbar_init(sm.epi_full, 256);  // every consumer thread has staged its part
      sm90::mbar_init(sm.epi_empty, kEpilogueThreads);
    }
  }

  static __device__ __forceinline__ float* scale_slot(const Layout& sm, int stage) {
    return reinterpret_cast<float*>(sm.epi + Smem::kOutBytes) + stage * Smem::kScaleFloats;
  }

  // Warps 1-3 (kStaged): each staged tile out to C until the consumers' stop signal. A full tile
  // (128 rows of one expert) leaves by BN/64 TMA box stores from one thread, which waits only until
  // they have read shared memory; an expert's last, partial tile must not touch the next expert's
  // rows, so the 96 threads write its rows in 16-byte stores (gemm_write_out).
  static __device__ __forceinline__ void epilogue_warps(const Fp8GemmParams& p, const CUtensorMap* tmap_c,
                                                        const Layout& sm, int tid) {
    const bool issuer = tid == kLoaders;
    for (int n = 0;; ++n) {
      sm90::mbar_wait(sm.epi_full, n & 1);
      const GemmTile tile = *sm.epi_tile;
      if (tile.e < 0) break;
      if (tile.rows == kGemmBM) {
        if (issuer) {
#pragma unroll
          for (int h = 0; h < BN / 64; ++h)
            if (tile.n0 + 64 * h < p.g.N) sm90::tma_store_2d(tmap_c, sm.epi + h * kEpiBoxBytes, tile.n0 + 64 * h, tile.row0);
          sm90::bulk_commit_group();
          sm90::bulk_wait_read_all();  // the staged tile may be overwritten after the arrival below
        }
      } else {
        gemm_write_out<BN, kEpiStore>(p.g, tile, sm.epi, tid - kLoaders, gemm_epi_items_of(tile, BN / 8),
                                      kEpilogueThreads, 1 << 30, true, false);
      }
      sm90::mbar_arrive(sm.epi_empty);
    }
    if (issuer) sm90::bulk_wait_all();  // the last stores complete before the CTA's shared memory goes
  }

  // kStaged: this warpgroup's 64 rows of the finished tile into the staging area, once the
  // epilogue warps are done with the previous tile. The tile handed over has its rows bounded by
  // R as well (offsets past R break the documented rule; C's writes stay inside [R, ldc]).
  // staged: tiles staged so far (the barriers' phase).
  static __device__ __forceinline__ void stage_tile(const Fp8GemmParams& p, const Layout& sm, const GemmTile& tile,
                                                    int cw, const float (&acc)[kWaves * 64], int& staged) {
    sm90::mbar_wait(sm.epi_empty, (staged & 1) ^ 1);
    gemm_stage_out<BN, kEpiStore>(p.g, tile, cw, acc, sm.epi);
    sm90::fence_proxy_async_shared();  // st.shared -> the TMA store's reads
    if (threadIdx.x == 128) {
      GemmTile out = tile;
      out.rows = max(0, min(tile.rows, p.c_rows - tile.row0));
      *sm.epi_tile = out;
    }
    sm90::mbar_arrive(sm.epi_full);
    ++staged;
  }

  // The loaders (warp 0; the warpgroup with a gather; `lane` is the thread's index among them):
  // decode and publish each tile, fill the stages (TMA operands, cp.async scales; with a gather A
  // by cp.async too).
  static __device__ __forceinline__ void producer(const Fp8GemmParams& p, const CUtensorMap* tmap_a,
                                                  const CUtensorMap* tmap_b, const Layout& sm, int lane,
                                                  int total_tiles) {
    const Stages stages = sm.stages();
    const int KB = p.k_blocks;
    int it = 0;
    Fp8GatherRows rows;  // with a gather, this thread's rows of the tile
    for (int t = blockIdx.x, n = 0;; t += gridDim.x, ++n) {
      const bool done = t >= total_tiles;
      const GemmTile tile =
          done ? GemmTile{-1, 0, 0, 0} : gemm_decode_tile<kGemmGroupM>(p.g, gemm_tile_table(p.g, sm.tile_table), t, BN);
      if (lane == 0) sm.tile_ring().publish(n, tile);  // (e = -1 tells the consumers to stop)
      if (done) break;
      if constexpr (GATHER) rows.load(p, tile, lane);
      const int nb0 = tile.n0 / 128;
      for (int kb = 0; kb < KB; ++kb, ++it) {
        const typename Stages::Slot slot = Stages::slot(sm90::warp_uniform(it));
        const int s = slot.stage;
        stages.acquire(slot);
        if (lane == 0) {
          stages.commit_tx(s, GATHER ? Smem::kBBytes : Smem::kStageBytes);
          uint8_t* b_stage = sm.smem_b + s * Smem::kBBytes;
#pragma unroll
          for (int h = 0; h < kWaves; ++h)  // W[e] rows n0 + 128h in the [E·N, K] view
            sm90::tma_load_2d(b_stage + h * 128 * kFp8BK, tmap_b, stages.full_barrier(s), kb * kFp8BK,
                              tile.e * p.g.N + tile.n0 + 128 * h);
          if constexpr (!GATHER)
            sm90::tma_load_2d(sm.smem_a + s * Smem::kABytes, tmap_a, stages.full_barrier(s), kb * kFp8BK, tile.row0);
        }
        float* sc = scale_slot(sm, s);
        if constexpr (GATHER) {
          rows.copy(p, sm.smem_a + s * Smem::kABytes, sc, lane, kb);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // sa of rows row0 + lane + 32i; rows past R read nothing (0)
            const int r = lane + 32 * i;
            const int64_t row = static_cast<int64_t>(tile.row0) + r;  // (row0 + 127 may pass 2^31 - 1)
            const bool ok = row < p.a_rows;
            const int64_t at = ok ? row * KB + kb : 0;
            sm90::cp_async_4(sm90::smem_addr(sc + r), p.sa + at, ok ? 4 : 0);
          }
        }
        if (lane < kWaves) {  // sb of the wave's weight block; past NB (a tile wider than N) 0
          const bool ok = nb0 + lane < p.n_blocks;
          const int64_t at = ok ? (static_cast<int64_t>(tile.e) * p.n_blocks + nb0 + lane) * KB + kb : 0;
          sm90::cp_async_4(sm90::smem_addr(sc + 128 + lane), p.sb + at, ok ? 4 : 0);
        }
        stages.commit_cp_async(s);
      }
    }
    sm90::cp_async_wait_all();
  }

  // The consumer's finished rows to C in bf16. Fragment of m64nNk32 (per thread t of the
  // warpgroup, warp w = t / 32, lane l): register i holds row 16w + l/4 + 8·((i >> 1) & 1),
  // column 8·(i >> 2) + 2·(l % 4) + (i & 1). A quad's four lanes hold one row's 8-column groups
  // j as a bf16 pair each; they trade pairs (a 4x4 transpose by shuffles) so that for every four
  // groups each lane writes one group whole: 16-byte stores of full 32-byte sectors, a quarter of
  // the store instructions of writing the pairs (N and ldc are multiples of 8, c 16-byte aligned).
  static __device__ __forceinline__ void store(const Fp8GemmParams& p, const GemmTile& tile, int row_local,
                                               int lane, const float (&acc)[kWaves * 64]) {
    const int q = lane % 4;
    __nv_bfloat16* c = p.g.c;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_local + 8 * h;
      // (offsets past R break the documented rule; the second test keeps C's writes inside [R, ldc])
      const bool row_ok = r < tile.rows && tile.row0 + r < p.c_rows;  // the same for a quad's lanes
      __nv_bfloat16* crow = c + static_cast<int64_t>(tile.row0 + r) * p.g.ldc;
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
#pragma unroll
        for (int j0 = 0; j0 < 16; j0 += 4) {
          uint32_t pair[4];  // this lane's pairs of groups j0 .. j0 + 3
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int i = w * 64 + 4 * (j0 + k) + 2 * h;
            const __nv_bfloat162 b = __floats2bfloat162_rn(acc[i], acc[i + 1]);
            pair[k] = *reinterpret_cast<const uint32_t*>(&b);
          }
          // Step s: lane q takes lane (q + s) % 4's pair of group j0 + q, which that lane sends.
          uint32_t group[4];  // group j0 + q: the pairs of lanes 0..3, in column order
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const int send_k = (q - s) & 3, from = (q + s) & 3;
            const uint32_t send = send_k == 0 ? pair[0] : send_k == 1 ? pair[1] : send_k == 2 ? pair[2] : pair[3];
            const uint32_t got = __shfl_sync(0xffffffffu, send, (lane & ~3) | from);
#pragma unroll
            for (int k = 0; k < 4; ++k)
              if (k == from) group[k] = got;
          }
          const int col = tile.n0 + 128 * w + 8 * (j0 + q);
          if (row_ok && col < p.g.N)
            *reinterpret_cast<uint4*>(crow + col) = make_uint4(group[0], group[1], group[2], group[3]);
        }
      }
    }
  }

  // Consumer warpgroup cw (0 or 1): its 64 rows of every tile, until the stop signal.
  static __device__ __forceinline__ void consumer(const Fp8GemmParams& p, const Layout& sm, int cw, int tid) {
    const Stages stages = sm.stages();
    const int warp = tid / 32, lane = tid % 32;
    const int row_local = cw * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile (+8: second)
    const uint64_t desc_a0 = sm90::smem_desc_kmajor_sw128(sm90::smem_addr(sm.smem_a + cw * 64 * kFp8BK));
    const uint64_t desc_b0 = sm90::smem_desc_kmajor_sw128(sm90::smem_addr(sm.smem_b));
    float tmp[64];  // one wave's 64 x 128 block product (overwritten by each wave's first wgmma)
#pragma unroll
    for (int i = 0; i < 64; ++i) tmp[i] = 0.f;
    int it = 0, staged = 0;
    for (int n = 0;; ++n) {
      const GemmTile tile = sm.tile_ring().take(n);
      if (tile.e < 0) break;
      float acc[kWaves * 64];
#pragma unroll
      for (int i = 0; i < kWaves * 64; ++i) acc[i] = 0.f;
      for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
        const typename Stages::Slot slot = Stages::slot(it);
        const int s = slot.stage;
        stages.wait(slot);
        if constexpr (GATHER) sm90::fence_proxy_async_shared();  // A by cp.async (generic proxy) -> wgmma
        // The scales first (their slot is released with the operands), combined per wave:
        // f0 for row row_local, f1 for row_local + 8.
        const float* sc = scale_slot(sm, s);
        const float sa0 = sc[row_local], sa1 = sc[row_local + 8];
        float f0[kWaves], f1[kWaves];
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          const float sb = sc[128 + w];
          f0[w] = sa0 * sb;
          f1[w] = sa1 * sb;
        }
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          sm90::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < kFp8BK / 32; ++ks) {  // +32 bytes = +32 K along the swizzled row
            const uint64_t desc_a = sm90::smem_desc_advance(desc_a0, s * Smem::kABytes + ks * 32);
            const uint64_t desc_b = sm90::smem_desc_advance(desc_b0, s * Smem::kBBytes + w * 128 * kFp8BK + ks * 32);
            sm90::wgmma_e4m3<128>(tmp, desc_a, desc_b, ks > 0 ? 1 : 0);
          }
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          sm90::fence_accumulators(tmp);
          if (w == kWaves - 1) {  // every wgmma of the stage has retired, the scales were read
            __syncwarp();
            if (lane == 0) stages.release(s);
          }
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[w * 64 + i] = fmaf((i & 2) ? f1[w] : f0[w], tmp[i], acc[w * 64 + i]);
        }
      }
      if constexpr (EPI == kFp8EpiGlu) {
        gemm_act_dispatch<true>(p.g.act, [&](auto act) {
          fp8_glu_epilogue<decltype(act)::value>(p.g, p.glu, tile, row_local, lane, acc, p.c_rows);
        });
      } else if constexpr (kStaged) {
        stage_tile(p, sm, tile, cw, acc, staged);
      } else {
        store(p, tile, row_local, lane, acc);
      }
    }
    if constexpr (kStaged) {  // tell the epilogue warps to stop
      sm90::mbar_wait(sm.epi_empty, (staged & 1) ^ 1);
      if (threadIdx.x == 128) sm.epi_tile->e = -1;
      sm90::mbar_arrive(sm.epi_full);
    }
  }
};

// GATHER: A's rows through p.g.gather by cp.async (tmap_a unused: any valid map will do).
// tmap_c: C [R, N] bf16 in 64-column x 128-row boxes, 128-byte swizzle (the staged plain store;
// unused otherwise).
template <int BN, bool GATHER, int EPI>
__global__ void __launch_bounds__(kGemmThreads, 1)
    sm90_grouped_gemm_fp8(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                          const __grid_constant__ CUtensorMap tmap_c, const Fp8GemmParams p) {
  using Gemm = Fp8GemmCooperative<BN, GATHER, EPI>;
  extern __shared__ uint8_t fp8_gemm_smem_raw[];
  const typename Gemm::Layout sm(fp8_gemm_smem_raw);
  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    Gemm::init_barriers(sm);
    sm90::mbar_fence_init();
    if (!GATHER) sm90::tma_prefetch_descriptor(&tmap_a);
    sm90::tma_prefetch_descriptor(&tmap_b);
    if (Gemm::kStaged) sm90::tma_prefetch_descriptor(&tmap_c);
  }
  if (p.g.E <= kGemmSmemTileE && threadIdx.x >= 32 && threadIdx.x < 64) gemm_tile_offsets_warp(p.g, sm.tile_table);
  __syncthreads();
  const int total_tiles = gemm_tile_table(p.g, sm.tile_table)[p.g.E];
  if (wg == 0) {
    sm90::setmaxnreg_dec<fp8_producer_regs<Gemm::kWideProducer>()>();
    if (tid < Gemm::kLoaders) Gemm::producer(p, &tmap_a, &tmap_b, sm, tid, total_tiles);
    else if constexpr (Gemm::kStaged) Gemm::epilogue_warps(p, &tmap_c, sm, tid);
  } else {
    sm90::setmaxnreg_inc<fp8_consumer_regs<Gemm::kWideProducer>()>();
    Gemm::consumer(p, sm, wg - 1, tid);
  }
}

}  // namespace machmoe::kernels
