// The sm_90a grouped GEMM engine's cooperative kernel: every epilogue, gathered or contiguous A.
//
//   for every expert e with rows [off[e], off[e+1]):
//     C[r, :] = epilogue( A[row(r), :] · B_eᵀ )      A [*, K] bf16, B_e = W[e] [N, K] bf16 (K-major)
//   row(r) = gather[r] (gathered activation rows, e.g. X by token) or r (contiguous rows).
//
// Persistent and warp-specialised: 3 warpgroups per CTA, one CTA per SM.
//   warpgroup 0 (56 registers), the loaders and the epilogue (GemmCooperative::producer,
//   ::epilogue_warps):
//     loader warps (warp 0; all four with a gather): thread 0 decodes the tile schedule
//       (gemm/scheduler.cuh) and hands it to the consumers through a ring, and issues the TMA
//       loads of the B tile (weights) and of contiguous A; with a gather the loader threads copy
//       the A rows by 16-byte cp.async, each keeping its 8 rows of the tile in registers as
//       32-bit offsets. A ring of shared-memory stages, one mbarrier per stage (TMA bytes +
//       cp.async arrivals).
//     epilogue (warps 1-3 without a gather; the loaders themselves, between loads, with one):
//       stores the staged C/H tile while the consumers already run the next tile: full tiles by
//       TMA from one thread, partial tiles (an expert's last) by the threads.
//   warpgroups 1-2, consumers (224 registers; ::consumer): each owns 64 rows of the 128-row tile,
//     runs wgmma m64n{BN}k16 with fp32 accumulators, keeps one wgmma group in flight, releases a
//     stage as soon as the wgmmas reading it retire, and stages the finished tile
//     (+ bias, bf16) out to shared memory (::stage_tile). The work an epilogue does per element
//     runs here too, on the warpgroup's own 64 staged rows, in slices under the next tile's
//     wgmmas: the activation output A of the GLU/activation epilogues (gemm/epilogue.cuh) and the
//     whole dH epilogue (gemm/epilogue_dact.cuh). On the loaders instead, A cost the gathered
//     up-projection 18% (the loaders' cp.async issue bounds it); here, 9%.
// Shared-memory operand tiles use the 128-byte swizzle (TMA writes it; the cp.async producer
// computes it) so that wgmma reads them without bank conflicts.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/epilogue_dact.cuh"
#include "kernels/gemm/params.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

// Register split of the 64K-register file: (56 + 2 x 224) x 128 threads = 64512.
template <int EPI>
constexpr int gemm_producer_regs() { return 56; }
template <int EPI>
constexpr int gemm_consumer_regs() { return 224; }

// The gathered A tile [128 rows x 64 K] of one stage, copied by kLoaders threads by 16-byte
// cp.async (the cooperative kernel's loader warpgroup, and the dH ping-pong kernel's). Thread
// `lane` copies chunk lane % 8 (8 bf16 of K) of rows lane / 8 + (kLoaders / 8)·i, i < kRows; it
// keeps those rows' A offsets in registers for the whole tile (re-reading them from shared memory
// each K block put a load in front of every cp.async: ncu showed the loader warps stalled on the
// L1TEX scoreboard, queued behind the cp.async traffic).
template <int kLoaders>
struct GemmGatherRows {
  static constexpr int kRows = 128 * 8 / kLoaders;
  uint32_t arow[kRows];  // in 16-byte units (the launcher bounds A below 2^32 of them); ~0: zero-fill

  __device__ __forceinline__ void load(const GroupedGemmParams& p, const GemmTile& tile, int lane) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = lane / 8 + (kLoaders / 8) * i;
      arow[i] = r < tile.rows ? static_cast<uint32_t>(__ldg(p.gather + tile.row0 + r)) * static_cast<uint32_t>(p.lda / 8)
                              : ~0u;
    }
  }
  __device__ __forceinline__ void copy(const GroupedGemmParams& p, uint8_t* a_stage, int lane, int k0) const {
    const int chunk = lane % 8;
    const bool k_ok = k0 + chunk * 8 < p.K;
    const uint32_t k_units = k0 / 8 + chunk;  // this thread's 16 bytes of the K block
    const uint4* a = reinterpret_cast<const uint4*>(p.a);
#pragma unroll 8
    for (int i = 0; i < kRows; ++i) {
      const int r = lane / 8 + (kLoaders / 8) * i;
      const bool ok = k_ok && arow[i] != ~0u;
      const uint32_t dst = sm90::smem_addr(a_stage + r * 128 + ((chunk ^ (r & 7)) << 4));
      // arow + k_units < a_rows * lda / 8 < 2^32: a 32-bit add and one wide multiply-add. A row
      // past the expert's end reads nothing (src-size 0 zero-fills) from A's first 16 bytes: the
      // offset is selected rather than the pointer, which kept the compiler reloading p.a from
      // the constant bank for every row.
      sm90::cp_async_16(dst, a + (ok ? arow[i] + k_units : 0u), ok ? 16 : 0);
    }
  }
};


// The cooperative kernel's phases. GATHER: A rows come through p.gather by 16-byte cp.async from
// the loader threads; otherwise A is contiguous and loaded by TMA like B (tmap_a over A [rows, K];
// a box may run into the next expert's rows, which are computed and not stored). B_NMAJOR: W is
// [E, K, N] (N contiguous), read through a 3-D map {N, K, E} in boxes of 64 N x 64 K and handed to
// wgmma as an N-major operand (the backward's dA' = dout·W2 and dX~ = dH·W1).
template <int BN, int EPI, bool GATHER, bool B_NMAJOR>
struct GemmCooperative {
  using Smem = GemmSmem<BN>;
  using Layout = GemmSmemLayout<BN>;
  static constexpr int S = Smem::kStages;
  using Stages = StageRing<S>;
  // BN columns of C per tile; the concatenated GLU tile spans BN/2 gate + BN/2 up columns.
  static constexpr int kTileCols = EPI == kEpiGluConcat ? BN / 2 : BN;
  static constexpr bool kDact = gemm_epi_is_dact(EPI);
  static constexpr int kGroupM = kDact ? kDactGroupM : kGemmGroupM;
  // Full tiles' C (plain store) or H (interleaved GLU, activation) leave by TMA (tmap_c); the
  // epilogue threads then have nothing to write (A is the consumers').
  static constexpr bool kTmaStore = epi_boxed<EPI>();
  // A gather needs the cp.async issue of all four warps (one per SM sub-partition) to keep up with
  // the tensor cores, so with a gather the same 128 threads also write the epilogue, in slices
  // between their loads. With TMA one loader warp suffices and three warps do the epilogue.
  static constexpr int kLoaders = GATHER ? 128 : 32;
  static constexpr int kEpilogueThreads = GATHER ? 128 : 96;
  // The activation output A of the GLU/activation epilogues, run by each consumer warpgroup on
  // its own 64 staged rows under the next tile's wgmmas: the loader threads, which bound a
  // gathered GEMM by their cp.async issue, then only store C/H (by TMA for full tiles).
  static constexpr bool kActOut = EPI == kEpiGluInter || EPI == kEpiGluConcat || EPI == kEpiAct;
  // (interleaved GLU: 8 A values per item, gemm_write_a_glu_pairs; else 4 or 8 per item)
  static constexpr bool kActPairs = EPI == kEpiGluInter;
  static constexpr int kActItemsPerBlock = kActPairs ? 1 : 2;

  static __device__ __forceinline__ void init_barriers(const Layout& sm) {
    // full: the loaders' cp.async arrivals (GATHER) + the TMA thread's expect_tx; empty: one
    // arrival per consumer warpgroup.
    sm.stages().init(GATHER ? kLoaders + 1 : 1, 2);
    for (int r = 0; r < kTileRing; ++r) {
      sm90::mbar_init(&sm.tile_full[r], 1);     // the producer's publishing thread
      sm90::mbar_init(&sm.tile_empty[r], 256);  // every consumer thread, once it has read the slot
    }
    sm90::mbar_init(sm.epi_full, 256);
    sm90::mbar_init(sm.epi_empty, kEpilogueThreads);
  }

  // One thread stores a full staged tile's boxes (a partial tile must not write the next
  // expert's rows: it takes the thread path). Returns whether it went by TMA.
  static __device__ __forceinline__ bool tma_store_tile(const GroupedGemmParams& p, const CUtensorMap* tmap_c,
                                                        const uint8_t* epi, const GemmTile& t, bool issuer) {
    if (!kTmaStore || t.rows != kGemmBM) return false;
    if (issuer && p.c) {  // null c (inference): H is not written
#pragma unroll
      for (int h = 0; h < BN / 64; ++h)
        if (t.n0 + 64 * h < p.N) sm90::tma_store_2d(tmap_c, epi + h * kEpiBoxBytes, t.n0 + 64 * h, t.row0);
      sm90::bulk_commit_group();
    }
    return true;
  }

  // Epilogue warps 1-3 (contiguous A): each staged tile, until the consumers' stop signal.
  static __device__ __forceinline__ void epilogue_warps(const GroupedGemmParams& p, const CUtensorMap* tmap_c,
                                                        const Layout& sm, int tid) {
    for (int n = 0;; ++n) {
      sm90::mbar_wait(sm.epi_full, n & 1);
      const GemmTile tile = *sm.epi_tile;
      if (tile.e < 0) break;
      const bool by_tma = tma_store_tile(p, tmap_c, sm.epi, tile, tid == kLoaders);
      if (by_tma) {  // nothing left for the threads (A is the consumers')
        if (tid == kLoaders) sm90::bulk_wait_read_all();  // the staged tile may be overwritten after this
        sm90::mbar_arrive(sm.epi_empty);
        continue;
      }
      // (the dH epilogue runs in the consumers: only the stop signal reaches here)
      if constexpr (!kDact)
        gemm_write_out<BN, EPI>(p, tile, sm.epi, tid - kLoaders, gemm_epi_items_of(tile, epi_chunks_per_row<BN, EPI>()),
                                kEpilogueThreads, 1 << 30, true, false);
      sm90::mbar_arrive(sm.epi_empty);
    }
    if (kTmaStore && tid == kLoaders) sm90::bulk_wait_all();
  }

  // The loader threads: decode and publish each tile, fill the stages; with a gather also the
  // epilogue's C/H stores (tiles that do not leave by TMA), in slices between the loads.
  static __device__ __forceinline__ void producer(const GroupedGemmParams& p, const CUtensorMap* tmap_a,
                                                  const CUtensorMap* tmap_b, const CUtensorMap* tmap_c,
                                                  const Layout& sm, int tid, int total_tiles, int k_blocks) {
    // `ep` tracks the staged tile in progress. The loaders never block on a stage while epilogue
    // work is pending (the consumers may be waiting for it to stage their next tile), and poll it
    // while they wait.
    struct {
      int n = 0, next = -1;
      bool tma = false;  // this tile's C/H went by TMA (issued by loader thread 0)
      GemmTile tile;
    } ep;
    // (The dH epilogue runs in the consumers: with it, only the stop signal reaches the loaders.)
    auto epi_begin = [&](const GemmTile& t) {  // a staged tile was taken: start its walk
      ep.tile = t;
      ep.next = tid;
      ep.tma = tma_store_tile(p, tmap_c, sm.epi, t, tid == 0);
      if (ep.tma) ep.next = 1 << 30;  // nothing left for the threads (A is the consumers')
    };
    auto epi_work = [&](int budget) {  // one slice of the tile in progress
      if constexpr (!kDact) {
        const int items = gemm_epi_items_of(ep.tile, epi_chunks_per_row<BN, EPI>());
        if (ep.next < items)
          ep.next = gemm_write_out<BN, EPI>(p, ep.tile, sm.epi, ep.next, items, kEpilogueThreads, budget, true, false);
        if (ep.next < items) return;
      }
      if (ep.tma && tid == 0) sm90::bulk_wait_read_all();
      sm90::mbar_arrive(sm.epi_empty);
      ep.next = -1;
      ++ep.n;
    };
    auto epi_step = [&](int budget) {
      if constexpr (GATHER) {
        if (ep.next < 0) {
          if (!sm90::mbar_test_wait(sm90::smem_addr(sm.epi_full), ep.n & 1)) return;
          const GemmTile t = *sm.epi_tile;
          if (t.e < 0) return;  // the stop signal: handled after the last load
          epi_begin(t);
          // A full tile's TMA store was just issued: finish (wait for it to have read the staged
          // tile, free it) at the next step, a K block later, instead of stalling this warp's
          // copies now; the consumers need the buffer again only at their next tile's staging.
          if (ep.tma) return;
        }
        epi_work(budget);
      }
    };
    const int lane = tid;  // 0 .. kLoaders-1
    const Stages stages = sm.stages();
    int it = 0;
    GemmGatherRows<kLoaders> rows;  // with a gather, this thread's rows of the tile
    for (int t = blockIdx.x, n = 0;; t += gridDim.x, ++n) {
      const bool done = t >= total_tiles;
      // (the table chosen again at each use from the parameters rather than held in a register:
      // several variants run at the 168-register cap, and a held pointer spilled there)
      const GemmTile tile =
          done ? GemmTile{-1, 0, 0, 0} : gemm_decode_tile<kGroupM>(p, gemm_tile_table(p, sm.tile_table), t, kTileCols);
      if (lane == 0) sm.tile_ring().publish(n, tile);  // (e = -1 tells the consumers to stop)
      if (done) break;
      if constexpr (GATHER) rows.load(p, tile, lane);  // this thread's A rows (~0 past the expert's end)
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        // (warp-uniform to the compiler: the stage's addresses and barriers in uniform registers,
        // and no per-lane loop around the cp.async arrival; on an H100 the gathered GEMMs ran
        // 0.5-2% faster)
        const typename Stages::Slot slot = Stages::slot(sm90::warp_uniform(it));
        const int s = slot.stage;
        if constexpr (GATHER) {
          while (!stages.try_acquire(slot)) epi_step(2);
        } else {
          stages.acquire(slot);
        }
        uint8_t* a_stage = sm.smem_a + s * Smem::kABytes;
        uint8_t* b_stage = sm.smem_b + s * Smem::kBBytes;
        const int k0 = kb * kGemmBK;
        if (lane == 0) {
          stages.commit_tx(s, GATHER ? Smem::kBBytes : Smem::kBBytes + Smem::kABytes);
          if constexpr (B_NMAJOR) {  // BN/64 blocks of [64 K rows][64 N], 8 KB apart
#pragma unroll
            for (int h = 0; h < BN / 64; ++h)
              sm90::tma_load_3d(b_stage + h * 64 * 128, tmap_b, stages.full_barrier(s), tile.n0 + 64 * h, k0, tile.e);
          } else {
            const int wrow = tile.e * p.N;  // first row of W[e] in the [E*N, K] view
#pragma unroll
            for (int h = 0; h < BN / 128; ++h) {
              // Interleaved/plain: rows n0 + 128h; concatenated GLU: gate rows j0.., up rows n + j0..
              const int r = EPI == kEpiGluConcat ? wrow + h * (p.N / 2) + tile.n0 : wrow + tile.n0 + 128 * h;
              sm90::tma_load_2d(b_stage + h * 128 * 128, tmap_b, stages.full_barrier(s), k0, r);
            }
          }
          if constexpr (!GATHER) sm90::tma_load_2d(a_stage, tmap_a, stages.full_barrier(s), k0, tile.row0);
        }
        if constexpr (GATHER) {
          rows.copy(p, a_stage, lane, k0);
          stages.commit_cp_async(s);
          epi_step(4);
        }
      }
    }
    if constexpr (GATHER) {  // drain: the remaining staged tiles, until the consumers say stop
      for (;;) {
        if (ep.next < 0) {
          sm90::mbar_wait(sm.epi_full, ep.n & 1);
          const GemmTile t = *sm.epi_tile;
          if (t.e < 0) break;
          epi_begin(t);
        }
        epi_work(1 << 30);
      }
      if (kTmaStore && tid == 0) sm90::bulk_wait_all();
    }
  }

  // The staged tile out to the epilogue threads: wait until they are done with the previous one,
  // stage this warpgroup's rows, signal. staged: tiles staged so far (the barrier's phase).
  static __device__ __forceinline__ void stage_tile(const GroupedGemmParams& p, const Layout& sm, const GemmTile& tile,
                                                    int cw, const float (&acc)[BN / 2], int& staged) {
    sm90::mbar_wait(sm.epi_empty, (staged & 1) ^ 1);
    gemm_stage_out<BN, EPI>(p, tile, cw, acc, sm.epi);
    if constexpr (kTmaStore) sm90::fence_proxy_async_shared();  // st.shared -> the TMA store's reads
    if (threadIdx.x == 128) *sm.epi_tile = tile;
    sm90::mbar_arrive(sm.epi_full);
    ++staged;
  }

  // Consumer warpgroup cw (0 or 1): its 64 rows of every tile of the ring, until the stop signal.
  static __device__ __forceinline__ void consumer(const GroupedGemmParams& p, const Layout& sm, int cw, int tid,
                                                  int k_blocks) {
    const Stages stages = sm.stages();
    int it = 0, staged = 0;
    // The dH epilogue, run by each consumer warpgroup on its own 64 rows of the staged tile while
    // the next tile's wgmmas run: one group of items per K block (loads issued a block ahead).
    DactPipe<BN, EPI, kDactGroupConsumer> pipe;
    struct {
      GemmTile tile;
      int next = 0, items = 0, end = 0;
      bool on = false;
    } dw;
    const int row_base = cw * 64;
    struct {
      GemmTile tile;
      int next = 0, end = 0, row_end = 0;
    } aw;
    auto act_step = [&](int budget) {
      if constexpr (kActPairs)
        aw.next = gemm_write_a_glu_inter<BN>(p, aw.tile, sm.epi, aw.next, aw.end, 128, budget, aw.row_end);
      else
        aw.next = gemm_write_out<BN, EPI>(p, aw.tile, sm.epi, aw.next, aw.end, 128, budget, false, true);
    };
    auto dact_step = [&]() {  // compute the loaded group, load the next one
      pipe.compute(p, dw.tile, sm.epi, sm.epi_scale, row_base, dw.items, dw.end, dw.next, 128);
      dw.next += kDactGroupConsumer * 128;
      dw.on = dw.next < dw.end;  // warp-uniform (end is a multiple of 32)
      if (dw.on) pipe.load(p, dw.tile, row_base, dw.items, dw.next, 128);
    };
    // Stage 0's operand descriptors (this warpgroup's 64 rows of A); the main loop advances them.
    const uint64_t desc_a0 = sm90::smem_desc_kmajor_sw128(sm90::smem_addr(sm.smem_a + cw * 64 * 128));
    const uint64_t desc_b0 = B_NMAJOR ? sm90::smem_desc_mnmajor_sw128(sm90::smem_addr(sm.smem_b), 64 * 128)
                                      : sm90::smem_desc_kmajor_sw128(sm90::smem_addr(sm.smem_b));
    for (int n = 0;; ++n) {
      const GemmTile tile = sm.tile_ring().take(n);
      if (tile.e < 0) break;
      float acc[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      DactRowScale rs;
      if constexpr (kDact) rs.load_pairs(p, tile, cw);
      int prev_stage = -1;
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const typename Stages::Slot slot = Stages::slot(it);
        const int s = slot.stage;
        stages.wait(slot);
        if constexpr (GATHER) sm90::fence_proxy_async_shared();  // cp.async (generic proxy) -> wgmma
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kGemmBK / 16; ++ks) {
          const uint64_t desc_a = sm90::smem_desc_advance(desc_a0, s * Smem::kABytes + ks * 32);
          const uint64_t desc_b = sm90::smem_desc_advance(desc_b0, s * Smem::kBBytes + ks * (B_NMAJOR ? 2048 : 32));
          sm90::wgmma_bf16<BN, 0, B_NMAJOR ? 1 : 0>(acc, desc_a, desc_b, 1);
        }
        sm90::wgmma_commit();
        // The dH epilogue's slice (the previous tile's) runs before the wait, while two wgmma
        // groups are queued (the previous block's and this one), so that the tensor cores have
        // work for its whole length: dH +1-5%. The GLU's A slice did not gain from the same move
        // (the up-projection lost 3%), so it stays after the wait.
        if constexpr (kDact) {
          if (dw.on) dact_step();
        }
        // Keep this stage's group in flight; the previous one is done after wait<1>.
        sm90::wgmma_wait<1>();
        sm90::fence_accumulators(acc);
        if (prev_stage >= 0 && tid == 0) stages.release(prev_stage);
        prev_stage = s;
        if constexpr (kDact) {
          if (kb == 0) rs.load_scores(p);
        }
        if constexpr (kActOut) {
          if (aw.next < aw.end) act_step(kActItemsPerBlock);  // the previous tile's A, under this block's wgmma
        }
      }
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(acc);
      if (prev_stage >= 0 && tid == 0) stages.release(prev_stage);
      if constexpr (kDact) {
        while (dw.on) dact_step();               // the rest of the previous tile's epilogue
        sm90::named_barrier_sync(2 + cw, 128);   // every thread of this warpgroup is done reading it
        gemm_stage_out<BN, EPI>(p, tile, cw, acc, sm.epi);
        rs.stage(sm.epi_scale, cw);
        sm90::named_barrier_sync(2 + cw, 128);   // this warpgroup's half is staged
        const int rows = max(0, min(64, tile.rows - row_base));
        dw.tile = tile;
        dw.items = rows * decltype(pipe)::kItemsPerRow;
        dw.end = decltype(pipe)::end_of(dw.items);  // whole warps: every lane runs the dS shuffle
        dw.next = tid;
        dw.on = dw.next < dw.end;
        if (dw.on) pipe.load(p, dw.tile, row_base, dw.items, dw.next, 128);
        continue;
      }
      if constexpr (kActOut) {
        while (aw.next < aw.end) act_step(1 << 30);  // the rest of the previous tile's A
        sm90::named_barrier_sync(2 + cw, 128);       // every thread of this warpgroup is done reading it
      }
      stage_tile(p, sm, tile, cw, acc, staged);
      if constexpr (kActOut) {
        sm90::named_barrier_sync(2 + cw, 128);  // this warpgroup's rows are staged
        const int rows = max(0, min(64, tile.rows - row_base));
        aw.tile = tile;
        if constexpr (kActPairs) {  // BN/16 items per row, in pairs of rows (row_base is even)
          aw.next = row_base * (BN / 16) + tid;
          aw.end = (row_base + ((rows + 1) & ~1)) * (BN / 16);
          aw.row_end = row_base + rows;
        } else {
          constexpr int kChunks = epi_chunks_per_row<BN, EPI>();
          aw.next = row_base * kChunks + tid;
          aw.end = (row_base + rows) * kChunks;
        }
      }
    }
    if constexpr (kDact) {
      while (dw.on) dact_step();  // the last tile's epilogue
    }
    if constexpr (kActOut) {
      while (aw.next < aw.end) act_step(1 << 30);  // the last tile's A
    }
    // Tell the epilogue threads to stop.
    sm90::mbar_wait(sm.epi_empty, (staged & 1) ^ 1);
    if (threadIdx.x == 128) sm.epi_tile->e = -1;
    sm90::mbar_arrive(sm.epi_full);
  }
};

template <int BN, int EPI, bool GATHER, bool B_NMAJOR>
__global__ void __launch_bounds__(kGemmThreads, 1)
    sm90_grouped_gemm(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                      const __grid_constant__ CUtensorMap tmap_c, const GroupedGemmParams p) {
  using Gemm = GemmCooperative<BN, EPI, GATHER, B_NMAJOR>;
  extern __shared__ uint8_t smem_raw[];
  const typename Gemm::Layout sm(smem_raw);
  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    Gemm::init_barriers(sm);
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_b);
    if (!GATHER) sm90::tma_prefetch_descriptor(&tmap_a);
    if (Gemm::kTmaStore) sm90::tma_prefetch_descriptor(&tmap_c);
  }
  const bool smem_tiles = p.E <= kGemmSmemTileE;
  if (smem_tiles && threadIdx.x >= 32 && threadIdx.x < 64) gemm_tile_offsets_warp(p, sm.tile_table);
  __syncthreads();
  const int total_tiles = gemm_tile_table(p, sm.tile_table)[p.E];
  const int k_blocks = (p.K + kGemmBK - 1) / kGemmBK;

  if (wg == 0) {
    sm90::setmaxnreg_dec<gemm_producer_regs<EPI>()>();
    if (tid >= Gemm::kLoaders) {
      Gemm::epilogue_warps(p, &tmap_c, sm, tid);
      return;
    }
    Gemm::producer(p, &tmap_a, &tmap_b, &tmap_c, sm, tid, total_tiles, k_blocks);
  } else {
    sm90::setmaxnreg_inc<gemm_consumer_regs<EPI>()>();
    Gemm::consumer(p, sm, wg - 1, tid, k_blocks);
  }
}

}  // namespace machmoe::kernels
