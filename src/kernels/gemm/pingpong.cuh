// The plain-store grouped GEMM with contiguous A (the down-projection Y = A·W2ᵀ and the
// backward's dX~ = dH·W1) as a ping-pong kernel: one output tile per consumer warpgroup. The host
// chooses it by shape (host/gemm/config.cpp: N <= 2048 or K <= 512).
//
// Why: the cooperative kernel (gemm/cooperative.cuh) loses time at every tile boundary, where
// both consumer warpgroups drain their wgmmas and stage the 128 x 256 tile while the tensor cores
// idle (on an H100 at d = 768, ~0.19 M of the dX~ GEMM's 0.915 M cycles). Here each consumer
// warpgroup owns a whole 128 x 192 tile, and the next warpgroup starts its wgmmas before the
// previous one has drained, so each warpgroup's epilogue runs under the other's main loop. On an
// H200 it is 1-12% faster than the cooperative kernel where d <= 2048 or K <= 512, and 2-5%
// slower at d >= 4096 with K >= 1024 (hence the shape rule).
//
//   warpgroup 0: warp 1, one thread, decodes the static tile schedule (gemm/scheduler.cuh) into
//     a ring; warp 0, one thread, loads A [128 rows x 64 K] and B [BN x 64 K] per stage by TMA,
//     tile by tile from the ring. The other threads have nothing to do.
//   warpgroups 1 and 2: consumer c takes the CTA's tiles n = c, c + 2, ...; its K blocks are the
//     stages it = n·k_blocks ... (every tile has the same K). Turns: a consumer waits for its
//     turn (named barrier 4 + c, 256 threads), issues its tile's wgmmas (two m64nBNk16 chains,
//     rows 0-63 and 64-127: BN fp32 accumulators per thread), hands the turn to the other
//     (bar.arrive) as soon as the last K block's wgmmas are issued, then drains and stores.
//   epilogue, per consumer: staged in shared memory, out by TMA; the rows of an expert's last,
//     partial tile (one tile in ~12 at d = 768) are copied out of the staging buffer by the
//     threads.
// Stages are consumed in tile order by one warpgroup each, so a stage is released by one arrival.
// Deterministic: every C element is written once, by one thread or one TMA box.
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

constexpr int kPingPongBN = 192;  // two m64n192 chains per consumer: 192 fp32 accumulators per thread
constexpr int kPingPongLoaderRegs = 40, kPingPongConsumerRegs = 232;
static_assert(kPingPongLoaderRegs + 2 * kPingPongConsumerRegs <= 504, "168 registers per thread at launch");

// How a consumer's tile leaves: staged in shared memory in two 64-row halves, each warpgroup
// through its own 64 x BN buffer (gemm_stage_out, [64 rows][64 columns] boxes, 128-byte swizzle;
// 2 x 24 KB at BN = 192: four stages). A half with all its rows leaves by TMA, one cut by the
// expert's end is copied out row by row (gemm_write_out).
template <int BN>
struct GemmPingPongSmem {
  static constexpr int kABytes = kGemmBM * kGemmBK * 2;  // 16 KB
  static constexpr int kBBytes = BN * kGemmBK * 2;       // 24 KB at BN = 192
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kBoxBytes = 64 * 128;             // one staged box [64 rows][64 columns] (gemm_stage_out<.., 64>)
  static constexpr int kEpiBufBytes = (BN / 64) * kBoxBytes;  // a consumer's 64-row half tile
  static constexpr int kEpiBytes = 2 * kEpiBufBytes;
  static constexpr int kBudget = 227 * 1024;
  // 1 KB alignment slack + barriers (2 per stage, 2 per ring slot) + the ring + the tile table
  static constexpr int kFixed = 4096;
  static constexpr int kStages = (kBudget - kFixed - kEpiBytes) / kStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kEpiBytes + kFixed;
  static_assert(kStages >= 3 && kStages < kTileRing, "stages");
  static_assert((2 * kStages + 2 * kTileRing) * 8 + kTileRing * 16 + (kGemmSmemTileE + 1) * 4 <= kFixed - 1024,
                "fixed shared-memory area too small");
};

// Rows 0 .. rows - 1 of a staged 64-row half (or of one box: BN = 64, tile.n0 at the box) to C,
// 16 bytes per thread and step (gemm_write_out: eight threads write a box row's 128 bytes).
template <int BN>
__device__ __forceinline__ void pingpong_copy_rows(const GroupedGemmParams& p, GemmTile tile, int half, int rows,
                                                   const uint8_t* buf) {
  tile.row0 += 64 * half;
  gemm_write_out<BN, kEpiStore, 64>(p, tile, buf, threadIdx.x % 128, rows * (BN / 8), 128, 1 << 30, true, false);
}

// A consumer's main loop in the ping-pong kernels (this one and gemm/dact_pingpong.cuh):
// CTA tile n's K blocks, stages it = n·k_blocks + kb, into acc [2][BN/2] from zero: two m64nBN
// chains, rows 0-63 and 64-127 of the A stage. One wgmma group stays in flight; thread 0 of the
// warpgroup releases each stage (stages.release) once the group reading it has retired. Returns
// the last stage, not yet released: the caller hands the turn on before it drains. after_block(kb)
// runs after each block's wait<1>. kGather: A came by cp.async (the generic proxy), fenced for the
// wgmmas.
template <int BN, bool B_NMAJOR, bool kGather, int S, int kABytes, int kBBytes, class AfterBlock>
__device__ __forceinline__ int pingpong_mainloop(float (&acc)[2][BN / 2], const StageRing<S>& stages,
                                                 const uint8_t* smem_a, const uint8_t* smem_b, int n, int k_blocks,
                                                 AfterBlock after_block) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[h][i] = 0.f;
  int prev_stage = -1;
  // Stage 0's operand descriptors, advanced per stage and k step (sm90::smem_desc_advance).
  const uint64_t desc_a0 = sm90::smem_desc_kmajor_sw128(sm90::smem_addr(smem_a));
  const uint64_t desc_b0 = B_NMAJOR ? sm90::smem_desc_mnmajor_sw128(sm90::smem_addr(smem_b), 64 * 128)
                                    : sm90::smem_desc_kmajor_sw128(sm90::smem_addr(smem_b));
  const int it0 = sm90::warp_uniform(n) * k_blocks;  // (uniform registers for what follows)
  for (int kb = 0; kb < k_blocks; ++kb) {
    const typename StageRing<S>::Slot slot = StageRing<S>::slot(it0 + kb);
    const int s = slot.stage;
    stages.wait(slot);
    if constexpr (kGather) sm90::fence_proxy_async_shared();  // cp.async (generic proxy) -> wgmma
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kGemmBK / 16; ++ks) {
      const uint64_t desc_b = sm90::smem_desc_advance(desc_b0, s * kBBytes + ks * (B_NMAJOR ? 2048 : 32));
#pragma unroll
      for (int h = 0; h < 2; ++h)
        sm90::wgmma_bf16<BN, 0, B_NMAJOR ? 1 : 0>(
            acc[h], sm90::smem_desc_advance(desc_a0, s * kABytes + h * 64 * 128 + ks * 32), desc_b, 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();
    sm90::fence_accumulators(acc[0]);
    sm90::fence_accumulators(acc[1]);
    if (prev_stage >= 0 && threadIdx.x % 128 == 0) stages.release(prev_stage);
    prev_stage = s;
    after_block(kb);
  }
  return prev_stage;
}

// Both ping-pong kernels' shared memory: the stages, their own epilogue area, the barriers, the
// tile ring and the tile-offset table (no epilogue handoff: each consumer stores its own tiles).
template <class Smem>
using PingPongSmemLayout = GroupedGemmSmemLayout<Smem, false>;

// The consumers' turns in both ping-pong kernels. Consumer c (0 or 1) runs the CTA's tiles
// n = c, c + 2, ..., taken from the tile ring; it issues a tile's wgmmas only in its turn, and hands
// the turn to the other consumer as soon as the tile's last wgmmas are issued, so that the other's
// wgmmas queue behind them while this one drains and stores. Turn c is named barrier
// kBarrier + c over both consumer warpgroups (bar.arrive by the giver, bar.sync by the taker).
struct PingPongTurns {
  static constexpr int kBarrier = 4;  // named barriers 4 (consumer 0's turn) and 5 (consumer 1's); 2, 3: per warpgroup
  TileRing tiles;
  int c;
  // Consumer 1 hands consumer 0 its first turn.
  __device__ __forceinline__ PingPongTurns(const TileRing& tile_ring, int consumer) : tiles(tile_ring), c(consumer) {
    if (c == 1) sm90::named_barrier_arrive(kBarrier + 0, 256);
  }
  // Tile n (this consumer's next), then its turn; e < 0: a stop signal, the caller stops. Tile n's
  // turn is handed on by the consumer that issued tile n - 1 (tile 0's by the constructor). The
  // first stop signal (e = -1, n = the CTA's tile count) has such a turn pending too: it takes it,
  // so that no arrival is left on a named barrier when the CTA exits. Nobody hands a turn to the
  // second stop (e = -2).
  // The turn is also what keeps the stage barriers' parity waits unambiguous: a consumer waits on
  // its first stage only after the other has seen every earlier stage full, so it is never two
  // phases ahead of a stage. Never wait on a stage before taking the turn.
  __device__ __forceinline__ GemmTile next_tile(int n) const {
    const GemmTile tile = tiles.take(n);
    if (tile.e != -2) sm90::named_barrier_sync(kBarrier + c, 256);
    return tile;
  }
  // The other consumer's turn: call once this tile's last wgmmas are issued.
  __device__ __forceinline__ void hand_on() const { sm90::named_barrier_arrive(kBarrier + (c ^ 1), 256); }
};

// B_NMAJOR: W is [E, K, N] (dX~ = dH·W1), read by the 3-D map {N, K, E} in boxes {64 N, 64 K};
// otherwise W is [E*N, K] (Y = A·W2ᵀ), read in boxes {64 K, 64 rows}. tmap_a: A [R, K] in boxes
// {64 K, 128 rows}; tmap_c: C [rows, N] in boxes {64 columns, 64 rows}.
template <int BN, bool B_NMAJOR>
__global__ void __launch_bounds__(kGemmThreads, 1)
    sm90_grouped_gemm_pingpong(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                               const __grid_constant__ CUtensorMap tmap_c, const GroupedGemmParams p) {
  using Smem = GemmPingPongSmem<BN>;
  constexpr int S = Smem::kStages;
  extern __shared__ uint8_t smem_raw[];
  const PingPongSmemLayout<Smem> lay(smem_raw);
  uint8_t *smem_a = lay.smem_a, *smem_b = lay.smem_b, *epi = lay.epi;  // epi: [2][kEpiBufBytes], 1024-byte aligned
  const StageRing<S> stages = lay.stages();
  uint64_t *tile_full = lay.tile_full, *tile_empty = lay.tile_empty;
  const TileRing tile_ring = lay.tile_ring();
  int32_t* tile_table = lay.tile_table;

  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    stages.init(1, 1);  // full: the TMA thread's expect_tx; empty: the consumer that read the stage
    for (int r = 0; r < kTileRing; ++r) {
      sm90::mbar_init(&tile_full[r], 1);
      sm90::mbar_init(&tile_empty[r], 129);  // the consumer warpgroup that took the slot, and the loading thread
    }
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_a);
    sm90::tma_prefetch_descriptor(&tmap_b);
    sm90::tma_prefetch_descriptor(&tmap_c);
  }
  if (p.E <= kGemmSmemTileE && threadIdx.x >= 32 && threadIdx.x < 64) gemm_tile_offsets_warp(p, tile_table);
  __syncthreads();
  const int total_tiles = gemm_tile_table(p, tile_table)[p.E];
  const int k_blocks = (p.K + kGemmBK - 1) / kGemmBK;

  if (wg == 0) {
    sm90::setmaxnreg_dec<kPingPongLoaderRegs>();
    // Warp 1, one thread: the scheduler. It decodes the static tile schedule into the ring up to
    // kTileRing tiles ahead (a binary search and two global loads per tile, ~1-2k cycles under
    // load), so that neither the loads nor a consumer ever wait for a decode: with the decode
    // inline in the loading thread, the next tile's first loads went out late and its consumer
    // took its turn late, every tile. Two stop signals, one for each consumer (each reads every
    // other slot): e = -1, then -2.
    if (tid == 32) {
      int stops = 0;
      for (int t = blockIdx.x, n = 0;; t += gridDim.x, ++n) {
        const bool done = t >= total_tiles;
        const GemmTile tile = done ? GemmTile{-1 - stops, 0, 0, 0} : gemm_decode_tile(p, gemm_tile_table(p, tile_table), t, BN);
        tile_ring.publish(n, tile);
        if (done && ++stops == 2) break;
      }
    }
    // Warp 0, one thread: the loads, tile by tile from the ring (it reads every slot up to the
    // first stop signal; the second is the other consumer's alone).
    for (int n = 0; tid == 0; ++n) {
      const GemmTile tile = tile_ring.take(n);
      if (tile.e < 0) break;
      for (int kb = 0; kb < k_blocks; ++kb) {
        const typename StageRing<S>::Slot slot = StageRing<S>::slot(n * k_blocks + kb);
        const int s = slot.stage;
        stages.acquire(slot);
        uint8_t* a_stage = smem_a + s * Smem::kABytes;
        uint8_t* b_stage = smem_b + s * Smem::kBBytes;
        const int k0 = kb * kGemmBK;
        stages.commit_tx(s, Smem::kStageBytes);
#pragma unroll
        for (int h = 0; h < BN / 64; ++h) {
          uint8_t* dst = b_stage + h * 64 * 128;
          // [64 K rows][64 N] blocks (B_NMAJOR), or rows n0 + 64h of W[e] in the [E*N, K] view
          // ([64 rows][64 K]), 8 KB apart
          const int x = B_NMAJOR ? tile.n0 + 64 * h : k0, y = B_NMAJOR ? k0 : tile.e * p.N + tile.n0 + 64 * h;
          if constexpr (B_NMAJOR) sm90::tma_load_3d(dst, &tmap_b, stages.full_barrier(s), x, y, tile.e);
          else sm90::tma_load_2d(dst, &tmap_b, stages.full_barrier(s), x, y);
        }
        // (a box may run into the next expert's rows: computed, never stored)
        sm90::tma_load_2d(a_stage, &tmap_a, stages.full_barrier(s), k0, tile.row0);
      }
    }
    __syncwarp();  // warps 0 and 1 whole again before the end (lanes 1-31 had nothing to do)
  } else {
    // ------------------------------------------------------------ consumers
    sm90::setmaxnreg_inc<kPingPongConsumerRegs>();
    const int c = wg - 1;
    uint8_t* buf = epi + c * Smem::kEpiBufBytes;
    const PingPongTurns turns(tile_ring, c);
    bool stored = false;  // a TMA store from `buf` may still be reading it
    for (int n = c;; n += 2) {
      const GemmTile tile = turns.next_tile(n);
      if (tile.e < 0) break;
      float acc[2][BN / 2];
      const int prev_stage = pingpong_mainloop<BN, B_NMAJOR, false, S, Smem::kABytes, Smem::kBBytes>(
          acc, stages, smem_a, smem_b, n, k_blocks, [](int) {});
      turns.hand_on();  // the other consumer's wgmmas queue behind ours while ours drain
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(acc[0]);
      sm90::fence_accumulators(acc[1]);
      if (prev_stage >= 0 && tid == 0) stages.release(prev_stage);
      if (p.c) {  // (null c: nothing is stored)
        // A half cut by the expert's end is copied out of the buffer, not stored from the
        // accumulators: those 4-byte stores of the partial tiles (1 tile in 12 at d = 768) took
        // 0.09-0.11 ms of a 0.64 ms dX~ on an H100.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rows = min(64, tile.rows - 64 * h);
          if (rows <= 0) break;
          if (stored && tid == 0) sm90::bulk_wait_read_all();  // the previous store has read `buf`
          sm90::named_barrier_sync(2 + c, 128);  // (and every thread is done copying out of it)
          gemm_stage_out<BN, kEpiStore, 64>(p, tile, 0, acc[h], buf);  // boxes [64 rows][64 columns]
          sm90::fence_proxy_async_shared();  // st.shared -> the TMA store's reads
          sm90::named_barrier_sync(2 + c, 128);
          if (rows == 64) {
            if (tid == 0) {
#pragma unroll
              for (int b = 0; b < BN / 64; ++b)
                if (tile.n0 + 64 * b < p.N)
                  sm90::tma_store_2d(&tmap_c, buf + b * Smem::kBoxBytes, tile.n0 + 64 * b, tile.row0 + 64 * h);
              sm90::bulk_commit_group();
            }
            stored = true;
          } else {
            pingpong_copy_rows<BN>(p, tile, h, rows, buf);
          }
        }
      }
    }
    if (stored && tid == 0) sm90::bulk_wait_all();
  }
}

}  // namespace machmoe::kernels
