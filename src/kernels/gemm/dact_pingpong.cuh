// The dH kernel (dA' = dout[gathered] · W2, then the dH epilogue of gemm/epilogue_dact.cuh) as a
// ping-pong grouped GEMM: one 128 x 128 tile per consumer warpgroup. The host chooses it where
// d = K <= 2048 (host/gemm/config.hpp, kDactPingPongWhere).
//
// On an H100 (2026-11; configurations of machmoe.bench): 5-6.5% faster than the cooperative
// kernel at d = 768 and 1536 (7B-a 0.529-0.541 ms against 0.568-0.580), 7-9% slower at d = 4096.
// Without its wgmmas it still takes 93% of its time at 7B-a: its loads and the epilogue's traffic
// bound it.
//
// Why: the cooperative kernel already runs the dH epilogue in slices under the next tile's
// wgmmas, but at every tile boundary both warpgroups drain and stage at once while the tensor
// cores idle. Here each consumer warpgroup owns a whole tile, so its drain, staging and whole
// epilogue (H loads, dH and A' stores, the dS partials) run while the other warpgroup's wgmmas
// run. The dO rows are gathered per 128 columns instead of per 256 (twice the cp.async requests
// per FLOP, which bound the gathered GEMMs).
//
//   warpgroup 0, the loaders (as the cooperative kernel's with a gather): every thread decodes the
//     static tile schedule t = blockIdx.x, blockIdx.x + gridDim.x, ...; thread 0 publishes each
//     tile into a ring (then two stop signals, one per consumer) and issues the TMA loads of W2's
//     two {64 N, 64 K} boxes per stage; all 128 threads copy the tile's dO rows [128 x 64 K] by
//     16-byte cp.async, 8 rows each, row offsets held in registers for the whole tile.
//   warpgroups 1 and 2: consumer c takes the CTA's tiles n = c, c + 2, ... from the ring. Turns as
//     in gemm/pingpong.cuh (PingPongTurns): wait for the turn, issue the tile's
//     wgmmas (two m64n128k16 chains: 128 fp32 accumulators per thread), hand the turn on after the
//     last K block's wgmmas are issued, then drain, stage the bf16 dA' tile [128 x 128] and the
//     rows' scores in the warpgroup's own buffer, and run the dH epilogue over its 128 rows
//     (DactPipe, two groups of loads in flight).
// A stage is released by the one consumer that read it; every output element, and each row's dS
// partial of the tile's 128 columns, is written once by one thread: deterministic.
//
// Five stages, with both staging buffers kept, by staging dA' in the boxed (swizzled) layout
// instead of padded rows (32 KB a buffer, not 34) and keeping at most 384 experts' tile offsets
// in shared memory: against four stages, 7B-a 0.500-0.504 ms instead of 0.514-0.517 (5% fewer
// cycles). Measured slower, on an H100: freeing the staging buffers for more stages, with the
// epilogue straight from the accumulators (7-21%) or staging in 64-row halves (2-6%): with 128
// accumulators under the 168-register cap, either leaves the epilogue too few loads in flight to
// stay under the other consumer's main loop; the kernel in CTA pairs multicasting W2's boxes
// (4-12% at d <= 1536); the epilogue from the accumulators with H, dH and A' moved by TMA through
// sub-tile buffers (20-27% at d <= 1536: 1.3x the DRAM reads for the same L2 requests).
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/cooperative.cuh"  // GemmGatherRows
#include "kernels/gemm/epilogue_dact.cuh"
#include "kernels/gemm/pingpong.cuh"  // pingpong_mainloop, PingPongSmemLayout, PingPongTurns
#include "kernels/gemm/scheduler.cuh"

namespace machmoe::kernels {

constexpr int kDactPPBN = 128;  // two m64n128 chains per consumer
constexpr int kDactPPGroup = 2;  // epilogue items (16 columns each) per thread per load group
// Experts whose tile offsets this kernel keeps in shared memory (the host builds the global table
// above that): fewer than the engine's kGemmSmemTileE, so that five stages fit.
constexpr int kDactPPSmemTileE = 384;

struct GemmDactPingPongSmem {
  static constexpr int BN = kDactPPBN;
  static constexpr int kABytes = kGemmBM * kGemmBK * 2;  // 16 KB of gathered dO rows
  static constexpr int kBBytes = BN * kGemmBK * 2;       // 16 KB: two {64 N, 64 K} boxes of W2
  static constexpr int kStageBytes = kABytes + kBBytes;
  // A consumer's staged dA' tile [128 rows][BN], boxed (epi_chunk_offset<.., kBoxed>: two
  // [128][64] boxes, 128-byte swizzle; conflict-free both ways) rather than padded: 32 KB, not 34.
  static constexpr int kEpiBufBytes = 128 * BN * 2;
  static constexpr int kScaleBytes = 128 * 4;                     // its rows' scores
  static constexpr int kEpiBytes = 2 * (kEpiBufBytes + kScaleBytes);
  static constexpr int kBudget = 227 * 1024;
  // Barriers, the ring and the tile table, with no alignment slack: the kernel declares its dynamic
  // shared memory 1024-byte aligned, so the layout's round-up is zero. Five stages take the budget
  // to the byte: 5 x 32 KB + 2 x (32 KB + 512) + 2 KB = 227 KB.
  static constexpr int kFixed = 2048;
  static constexpr int kStages = (kBudget - kFixed - kEpiBytes) / kStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kEpiBytes + kFixed;
  static_assert(kStages >= 3 && kStages < kTileRing, "stages");
  static_assert(kStages == 5, "the boxed staging exists for the fifth stage");
  static_assert((2 * kStages + 2 * kTileRing) * 8 + kTileRing * 16 + (kDactPPSmemTileE + 1) * 4 <= kFixed,
                "fixed shared-memory area too small");
};

// EPI: kEpiDGluInter, kEpiDGluConcat or kEpiDAct. A = dout [T, K] gathered through p.gather
// (always: the dH GEMM's rows are routed tokens); W2 [E, K, N] N-major through tmap_b {N, K, E}.
template <int EPI>
__global__ void __launch_bounds__(kGemmThreads, 1)
    sm90_grouped_gemm_dact_pingpong(const __grid_constant__ CUtensorMap tmap_b, const GroupedGemmParams p) {
  static_assert(gemm_epi_is_dact(EPI), "the dH epilogues only");
  using Smem = GemmDactPingPongSmem;
  constexpr int BN = kDactPPBN;
  constexpr int S = Smem::kStages;
  // 1024-byte aligned as declared (the 128-byte swizzle's atom), so that the layout's round-up
  // folds away: Smem::kFixed has no slack for it. (Its own name: declared as smem_raw, the
  // alignment reached every kernel of the unit and made ptxas spill 8 bytes in four cooperative
  // GEMMs.)
  extern __shared__ __align__(1024) uint8_t dact_pingpong_smem[];
  const PingPongSmemLayout<Smem> lay(dact_pingpong_smem);
  uint8_t *smem_a = lay.smem_a, *smem_b = lay.smem_b;
  uint8_t* epi = lay.epi;  // [2][kEpiBufBytes], then [2][128] scores
  float* scales = reinterpret_cast<float*>(epi + 2 * Smem::kEpiBufBytes);
  const StageRing<S> stages = lay.stages();
  uint64_t *tile_full = lay.tile_full, *tile_empty = lay.tile_empty;
  const TileRing tile_ring = lay.tile_ring();
  int32_t* tile_table = lay.tile_table;

  constexpr int kLoaders = 128;
  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    // full: the loaders' cp.async arrivals + thread 0's expect_tx; empty: the consumer that read it
    stages.init(kLoaders + 1, 1);
    for (int r = 0; r < kTileRing; ++r) {
      sm90::mbar_init(&tile_full[r], 1);      // loader thread 0
      sm90::mbar_init(&tile_empty[r], 128);   // the consumer warpgroup that took the slot
    }
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_b);
  }
  if (p.E <= kDactPPSmemTileE && threadIdx.x >= 32 && threadIdx.x < 64) gemm_tile_offsets_warp(p, tile_table);
  __syncthreads();
  const int32_t* tiles = gemm_tile_table<kDactPPSmemTileE>(p, tile_table);
  const int total_tiles = tiles[p.E];
  const int k_blocks = (p.K + kGemmBK - 1) / kGemmBK;

  if (wg == 0) {
    // ------------------------------------------------------------ loaders
    sm90::setmaxnreg_dec<gemm_producer_regs<EPI>()>();
    GemmGatherRows<kLoaders> rows;  // this thread's dout rows of the tile
    for (int t = blockIdx.x, n = 0, it = 0;; t += gridDim.x, ++n) {
      const bool done = t >= total_tiles;
      const GemmTile tile = done ? GemmTile{-1, 0, 0, 0} : gemm_decode_tile<kDactGroupM>(p, tiles, t, BN);
      if (tid == 0) {
        tile_ring.publish(n, tile);
        if (done) tile_ring.publish(n + 1, GemmTile{-2, 0, 0, 0});  // the other consumer's stop signal
      }
      if (done) break;
      rows.load(p, tile, tid);  // (~0 past the expert's end)
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        // (uniform registers: sm90::warp_uniform)
        const typename StageRing<S>::Slot slot = StageRing<S>::slot(sm90::warp_uniform(it));
        const int s = slot.stage;
        stages.acquire(slot);
        uint8_t* a_stage = smem_a + s * Smem::kABytes;
        uint8_t* b_stage = smem_b + s * Smem::kBBytes;
        const int k0 = kb * kGemmBK;
        if (tid == 0) {
          stages.commit_tx(s, Smem::kBBytes);
#pragma unroll
          for (int h = 0; h < BN / 64; ++h)  // [64 K rows][64 N] blocks, 8 KB apart
            sm90::tma_load_3d(b_stage + h * 64 * 128, &tmap_b, stages.full_barrier(s), tile.n0 + 64 * h, k0, tile.e);
        }
        rows.copy(p, a_stage, tid, k0);
        stages.commit_cp_async(s);
      }
    }
  } else {
    // ------------------------------------------------------------ consumers
    sm90::setmaxnreg_inc<gemm_consumer_regs<EPI>()>();
    const int c = wg - 1;
    uint8_t* buf = epi + c * Smem::kEpiBufBytes;
    float* scale = scales + c * 128;
    const PingPongTurns turns(tile_ring, c);
    for (int n = c;; n += 2) {
      const GemmTile tile = turns.next_tile(n);  // (a stage is waited on only after the turn)
      if (tile.e < 0) break;
      DactRowScale rs[2];
      rs[0].load_pairs(p, tile, 0);
      rs[1].load_pairs(p, tile, 1);
      float acc[2][BN / 2];
      const int prev_stage = pingpong_mainloop<BN, true, true, S, Smem::kABytes, Smem::kBBytes>(
          acc, stages, smem_a, smem_b, n, k_blocks, [&](int kb) {
            if (kb == 0) {
              rs[0].load_scores(p);
              rs[1].load_scores(p);
            }
          });
      turns.hand_on();
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(acc[0]);
      sm90::fence_accumulators(acc[1]);
      if (prev_stage >= 0 && tid == 0) stages.release(prev_stage);

      // The epilogue, under the other consumer's wgmmas. Every thread of this warpgroup is done
      // reading the buffer (its previous tile's epilogue) before it is overwritten.
      sm90::named_barrier_sync(2 + c, 128);
      gemm_stage_out<BN, EPI, 128, true>(p, tile, 0, acc[0], buf);  // rows 0-63
      gemm_stage_out<BN, EPI, 128, true>(p, tile, 1, acc[1], buf);  // rows 64-127
      rs[0].stage(scale, 0);
      rs[1].stage(scale, 1);
      sm90::named_barrier_sync(2 + c, 128);
      // Items (row, two 8-column chunks) of the tile's rows; `end` in whole warps (every lane of a
      // row's warp runs the dS shuffle). Two load groups in flight: the next group's H loads
      // are issued before this group is computed.
      using Pipe = DactPipe<BN, EPI, kDactPPGroup, true>;
      const int items = tile.rows * Pipe::kItemsPerRow, end = Pipe::end_of(items);
      constexpr int kStep = kDactPPGroup * 128;
      Pipe pa, pb;
      int next = tid;
      if (next < end) pa.load(p, tile, 0, items, next, 128);
      while (next < end) {
        if (next + kStep < end) pb.load(p, tile, 0, items, next + kStep, 128);
        pa.compute(p, tile, buf, scale, 0, items, end, next, 128);
        next += kStep;
        if (next >= end) break;
        if (next + kStep < end) pa.load(p, tile, 0, items, next + kStep, 128);
        pb.compute(p, tile, buf, scale, 0, items, end, next, 128);
        next += kStep;
      }
    }
  }
}

}  // namespace machmoe::kernels
