// Kernel families 4 and 9 of SPEC §2 (down-projection Y = A·W2ᵀ, dX~ = dH·W1) as a ping-pong
// grouped GEMM: the plain store of gemm/cooperative.cuh, contiguous A, one output tile per
// consumer warpgroup. The default where host/gemm/grouped_gemm.cu's shape rule (kPingPongWhere: N <=
// 2048 or K <= 512) says it wins, in mode 1; MACHMOE_GEMM_PINGPONG=0/1/2/5/6 overrides.
//
// Measured: session 26 found every mode slower in the sustained kernel table (7B-a dX~ 0.66 ms
// against 0.59): its main loop alone is faster (probe 1: 0.514 ms against 0.548), but the
// partial tiles stored from the accumulators cost 0.09-0.11 ms (probe 64). With them staged and
// copied out of the buffer (session 27, H100): 7B-a dX~ 0.527-0.546 ms against 0.578-0.586, and on
// an H200 1-12% faster at every SPEC config with d <= 2048 or K <= 512, 2-5% slower at d >= 4096
// with K >= 1024 (docs/PERF.md, session 27).
//
// Why (session 25, Nsight Compute on the same H100): SonicMoE's dX~ at 7B-a takes 16% fewer
// cycles than ours with the same tensor-core work (its tensor pipe is busy 0.631 M cycles, ours
// 0.601 M; SonicMoE computes ~5% more rows, padding experts to 256). Our cooperative kernel
// loses the rest at every tile boundary: both consumer warpgroups drain their wgmmas and stage
// the 128 x 256 tile while the tensor cores idle, ~0.19 M of its 0.915 M cycles. SonicMoE runs
// this GEMM as 128 x 192 tiles in ping-pong: each consumer warpgroup owns a whole tile, and the
// next warpgroup starts its wgmmas before the previous one has drained, so each warpgroup's
// epilogue runs under the other's main loop.
//
//   warpgroup 0: warp 1, one thread, decodes the static tile schedule (as the cooperative
//     kernel) into a ring; warp 0, one thread, loads A [128 rows x 64 K] and B [BN x 64 K] per
//     stage by TMA, tile by tile from the ring. The other threads have nothing to do.
//   warpgroups 1 and 2: consumer c takes the CTA's tiles n = c, c + 2, ...; its K blocks are the
//     stages it = n·k_blocks ... (every tile has the same K). Turns: a consumer waits for its
//     turn (named barrier 4 + c, 256 threads), issues its tile's wgmmas (two m64nBNk16 chains,
//     rows 0-63 and 64-127: BN fp32 accumulators per thread), hands the turn to the other
//     (bar.arrive) as soon as the last K block's wgmmas are issued, then drains and stores.
//   epilogue, per consumer: staged in shared memory, out by TMA (kPPEpiHalves / kPPEpiRing below);
//     the rows of an expert's last, partial tile (one tile in ~12 at 7B-a) are copied out of the
//     staging buffer by the threads.
// Stages are consumed in tile order by one warpgroup each, so a stage is released by one
// arrival (two with kCluster, below). Deterministic: every C element is written once, by one thread or one TMA box.
//
// kCluster (MACHMOE_GEMM_PINGPONG=2; SonicMoE's cluster 2x1): clusters of two CTAs take units of
// 256 rows of one expert x BN columns, rank r the rows 128r .. 128r + 127 (rank 1 of an expert's
// odd last unit has none: it loads and computes, stores nothing). Both need the same weight tile:
// each loads some of its 64-column boxes (rank 0 boxes 0 and 2, rank 1 box 1) and multicasts
// them to both CTAs. A stage is then free only when the consumers of both CTAs have released it
// (two arrivals, one remote), since the peer writes into it. Neither CTA exits while the other
// may still write into it or arrive on its barriers.
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/cooperative.cuh"

namespace machmoe::kernels {

constexpr int kPingPongBN = 192;  // two m64n192 chains per consumer: 192 fp32 accumulators per thread
constexpr int kPingPongLoaderRegs = 40, kPingPongConsumerRegs = 232;
static_assert(kPingPongLoaderRegs + 2 * kPingPongConsumerRegs <= 504, "168 registers per thread at launch");

// How a consumer's tile leaves (modes 1/2 and 5/6 of MACHMOE_GEMM_PINGPONG). Both stage it in
// shared memory (gemm_stage_out, [64 rows][64 columns] boxes, 128-byte swizzle); a 64-row half
// with all its rows leaves by TMA, one cut by the expert's end is copied out row by row
// (gemm_write_out):
//   kPPEpiHalves: in two 64-row halves, each warpgroup through its own 64 x BN buffer
//     (2 x 24 KB at BN = 192: four stages);
//   kPPEpiRing: box by box through one two-box ring (16 KB) that the warpgroups take in turn
//     (SonicMoE's arrangement: five stages). The epilogues alternate like the main loops (named
//     barriers 6 and 7), and a warpgroup hands the ring on only once its last box has been read.
// (Modes 3/4, every tile stored straight from the accumulators by st.global with no buffer and a
// fifth stage, measured 0.96 ms against mode 1's 0.66 on 7B-a dX~ in session 26; removed.)
constexpr int kPPEpiHalves = 0, kPPEpiRing = 1;

template <int BN, int kEpi = kPPEpiHalves>
struct GemmPingPongSmem {
  static constexpr int kABytes = kGemmBM * kGemmBK * 2;  // 16 KB
  static constexpr int kBBytes = BN * kGemmBK * 2;       // 24 KB at BN = 192
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kBoxBytes = 64 * 128;             // one staged box [64 rows][64 columns] (gemm_stage_out<.., 64>)
  static constexpr int kEpiBufBytes = (BN / 64) * kBoxBytes;  // a consumer's 64-row half tile
  static constexpr int kEpiBytes = kEpi == kPPEpiHalves ? 2 * kEpiBufBytes : 2 * kBoxBytes;
  static constexpr int kBudget = 227 * 1024;
  // 1 KB alignment slack + barriers (2 per stage, 2 per ring slot) + the ring + the tile table
  static constexpr int kFixed = 4096;
  static constexpr int kStages = (kBudget - kFixed - kEpiBytes) / kStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kEpiBytes + kFixed;
  static_assert(kStages >= 3 && kStages < kTileRing, "stages");
  static_assert((2 * kStages + 2 * kTileRing) * 8 + kTileRing * 16 + (kGemmSmemTileE + 1) * 4 <= kFixed - 1024,
                "fixed shared-memory area too small");
};

#if MACHMOE_GEMM_PROBES
// Probe 1024 (probe builds only): where one thread of each consumer (and the producer) spends its
// cycles, summed over CTAs and launches; host/gemm/grouped_gemm.cu prints them per tile at exit.
__device__ unsigned long long g_pingpong_cycles[8];
#endif
struct PingPongCycles {
  enum { kRingWait, kTurnWait, kFullWait, kMainLoop, kDrain, kEpilogue, kTiles, kEmptyWait };
  uint32_t v[8] = {};
  bool on;
  __device__ uint32_t now() const { return on ? static_cast<uint32_t>(clock()) : 0u; }
  __device__ void add(int i, uint32_t since) {
    if (on) v[i] += static_cast<uint32_t>(clock()) - since;
  }
  __device__ void flush() const {
#if MACHMOE_GEMM_PROBES
    if (on)
      for (int i = 0; i < 8; ++i)
        if (v[i]) atomicAdd(&g_pingpong_cycles[i], static_cast<unsigned long long>(v[i]));
#endif
  }
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
// warpgroup releases each stage (release(s)) once the group reading it has retired. Returns the
// last stage, not yet released: the caller hands the turn on before it drains. wait_full(s,
// parity) waits for a stage (the store kernel times the wait); after_block(kb) runs after each
// block's wait<1>. kGather: A came by cp.async (the generic proxy), fenced for the wgmmas.
template <int BN, bool B_NMAJOR, bool kGather, int S, int kABytes, int kBBytes, class WaitFull, class Release,
          class AfterBlock>
__device__ __forceinline__ int pingpong_mainloop(const GroupedGemmParams& p, float (&acc)[2][BN / 2],
                                                 const uint8_t* smem_a, const uint8_t* smem_b, int n, int k_blocks,
                                                 WaitFull wait_full, Release release, AfterBlock after_block) {
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
    const int it = it0 + kb, s = it % S;
    wait_full(s, (it / S) & 1);
    if constexpr (kGather) sm90::fence_proxy_async_shared();  // cp.async (generic proxy) -> wgmma
    sm90::wgmma_fence();
    if (!gemm_probe(p, 2)) {  // (timing probe: no wgmma)
#pragma unroll
      for (int ks = 0; ks < kGemmBK / 16; ++ks) {
        const uint64_t desc_b = sm90::smem_desc_advance(desc_b0, s * kBBytes + ks * (B_NMAJOR ? 2048 : 32));
#pragma unroll
        for (int h = 0; h < 2; ++h)
          sm90::wgmma_bf16<BN, 0, B_NMAJOR ? 1 : 0>(
              acc[h], sm90::smem_desc_advance(desc_a0, s * kABytes + h * 64 * 128 + ks * 32), desc_b, 1);
      }
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();
    sm90::fence_accumulators(acc[0]);
    sm90::fence_accumulators(acc[1]);
    if (prev_stage >= 0 && threadIdx.x % 128 == 0) release(prev_stage);
    prev_stage = s;
    after_block(kb);
  }
  return prev_stage;
}

// Where a ping-pong kernel's shared memory holds what (both ping-pong kernels): S operand stages
// (A tiles, then B tiles), the epilogue area, then the barriers (full / empty per stage,
// tile_full / tile_empty per ring slot), the tile ring and the tile-offset table [E+1], all from a
// 1024-byte aligned base (the 128-byte swizzle atoms).
template <class Smem>
struct PingPongSmemLayout {
  uint8_t *smem_a, *smem_b, *epi;
  uint64_t *full, *empty, *tile_full, *tile_empty;
  GemmTile* ring;
  int32_t* tile_table;  // [E+1] when E is within the kernel's shared-memory table (gemm_tile_table)
  __device__ __forceinline__ explicit PingPongSmemLayout(uint8_t* smem_raw) {
    constexpr int S = Smem::kStages;
    uint8_t* smem = smem_raw + ((1024u - (sm90::smem_addr(smem_raw) & 1023u)) & 1023u);
    smem_a = smem;
    smem_b = smem + S * Smem::kABytes;
    epi = smem + S * Smem::kStageBytes;
    full = reinterpret_cast<uint64_t*>(epi + Smem::kEpiBytes);
    empty = full + S;
    tile_full = empty + S;
    tile_empty = tile_full + kTileRing;
    ring = reinterpret_cast<GemmTile*>(tile_empty + kTileRing);
    tile_table = reinterpret_cast<int32_t*>(ring + kTileRing);
  }
};

// B_NMAJOR: W is [E, K, N] (dX~ = dH·W1), read by the 3-D map {N, K, E} in boxes {64 N, 64 K};
// otherwise W is [E*N, K] (Y = A·W2ᵀ), read in boxes {64 K, 64 rows}. tmap_a: A [R, K] in boxes
// {64 K, 128 rows}; tmap_c: C [rows, N] in boxes {64 columns, 64 rows}.
template <int BN, bool B_NMAJOR, bool kCluster, int kEpi>
__global__ void __launch_bounds__(kGemmThreads, 1)
    sm90_grouped_gemm_pingpong(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                               const __grid_constant__ CUtensorMap tmap_c, const GroupedGemmParams p) {
  using Smem = GemmPingPongSmem<BN, kEpi>;
  constexpr int S = Smem::kStages;
  constexpr int kUnitRows = kCluster ? 2 * kGemmBM : kGemmBM;  // rows of one schedule unit
  extern __shared__ uint8_t smem_raw[];
  const PingPongSmemLayout<Smem> lay(smem_raw);
  uint8_t *smem_a = lay.smem_a, *smem_b = lay.smem_b, *epi = lay.epi;  // epi: [2][kEpiBufBytes], 1024-byte aligned
  uint64_t *full = lay.full, *empty = lay.empty, *tile_full = lay.tile_full, *tile_empty = lay.tile_empty;
  GemmTile* ring = lay.ring;
  int32_t* tile_table = lay.tile_table;

  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  const uint32_t rank = kCluster ? sm90::cluster_ctarank() : 0, peer = rank ^ 1u;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      sm90::mbar_init(&full[s], 1);                // the TMA thread's expect_tx (+ the peer's bytes)
      sm90::mbar_init(&empty[s], kCluster ? 2 : 1);  // the consumer that read it (and the peer's)
    }
    for (int r = 0; r < kTileRing; ++r) {
      sm90::mbar_init(&tile_full[r], 1);
      sm90::mbar_init(&tile_empty[r], 129);  // the consumer warpgroup that took the slot, and the loading thread
    }
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_a);
    sm90::tma_prefetch_descriptor(&tmap_b);
    sm90::tma_prefetch_descriptor(&tmap_c);
  }
  if (p.E <= kGemmSmemTileE && threadIdx.x >= 32 && threadIdx.x < 64) gemm_tile_offsets_warp<kUnitRows>(p, tile_table);
  if constexpr (kCluster)
    sm90::cluster_sync();  // the peer's barriers exist before anything signals them
  else
    __syncthreads();
  const int first = kCluster ? blockIdx.x / 2 : blockIdx.x, stride = kCluster ? gridDim.x / 2 : gridDim.x;
  const int total_tiles = gemm_tile_table(p, tile_table)[p.E];
  const int k_blocks = (p.K + kGemmBK - 1) / kGemmBK;

  if (wg == 0) {
    sm90::setmaxnreg_dec<kPingPongLoaderRegs>();
    PingPongCycles cyc{};
    cyc.on = gemm_probe(p, 1024) && tid == 0;
    // Warp 1, one thread: the scheduler. It decodes the static tile schedule into the ring up to
    // kTileRing tiles ahead (a binary search and two global loads per tile, ~1-2k cycles under
    // load), so that neither the loads nor a consumer ever wait for a decode. Session 26 measured
    // the decode inline in the loading thread: the next tile's first loads went out late and the
    // consumer of the next tile took its turn late, every tile. Two stop signals, one for each
    // consumer (each reads every other slot): e = -1, then -2.
    if (tid == 32) {
      int stops = 0;
      for (int t = first, n = 0;; t += stride, ++n) {
        const bool done = t >= total_tiles;
        GemmTile tile = done ? GemmTile{-1 - stops, 0, 0, 0}
                             : gemm_decode_tile<kUnitRows>(p, gemm_tile_table(p, tile_table), t, BN);
        if (kCluster && !done) {  // this CTA's 128 of the unit's rows (none: rows = 0)
          tile.row0 += kGemmBM * static_cast<int>(rank);
          tile.rows = max(0, min(kGemmBM, tile.rows - kGemmBM * static_cast<int>(rank)));
        }
        const int slot = n % kTileRing;
        sm90::mbar_wait(&tile_empty[slot], ((n / kTileRing) & 1) ^ 1);
        ring[slot] = tile;
        sm90::mbar_arrive(&tile_full[slot]);
        if (done && ++stops == 2) break;
      }
    }
    // Warp 0, one thread: the loads, tile by tile from the ring (it reads every slot up to the
    // first stop signal; the second is the other consumer's alone).
    for (int n = 0; tid == 0; ++n) {
      const int slot = n % kTileRing;
      sm90::mbar_wait(&tile_full[slot], (n / kTileRing) & 1);
      const GemmTile tile = ring[slot];
      sm90::mbar_arrive(&tile_empty[slot]);
      if (tile.e < 0) break;
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int it = n * k_blocks + kb, s = it % S;
        const uint32_t t_empty = cyc.now();
        sm90::mbar_wait(&empty[s], ((it / S) & 1) ^ 1);
        cyc.add(PingPongCycles::kEmptyWait, t_empty);
        uint8_t* a_stage = smem_a + s * Smem::kABytes;
        uint8_t* b_stage = smem_b + s * Smem::kBBytes;
        const int k0 = kb * kGemmBK;
        if (gemm_probe(p, 4)) {  // timing probe: no loads, the stage is "full" at once (stale data)
          sm90::mbar_arrive(&full[s]);
          continue;
        }
        sm90::mbar_arrive_expect_tx(&full[s], Smem::kStageBytes);
#pragma unroll
        for (int h = 0; h < BN / 64; ++h) {
          uint8_t* dst = b_stage + h * 64 * 128;
          // [64 K rows][64 N] blocks (B_NMAJOR), or rows n0 + 64h of W[e] in the [E*N, K] view
          // ([64 rows][64 K]), 8 KB apart
          const int x = B_NMAJOR ? tile.n0 + 64 * h : k0, y = B_NMAJOR ? k0 : tile.e * p.N + tile.n0 + 64 * h;
          if constexpr (kCluster) {
            if (h % 2 != static_cast<int>(rank)) continue;  // the peer multicasts this box
            if constexpr (B_NMAJOR) sm90::tma_load_3d_multicast(dst, &tmap_b, &full[s], x, y, tile.e, 0x3);
            else sm90::tma_load_2d_multicast(dst, &tmap_b, &full[s], x, y, 0x3);
          } else {
            if constexpr (B_NMAJOR) sm90::tma_load_3d(dst, &tmap_b, &full[s], x, y, tile.e);
            else sm90::tma_load_2d(dst, &tmap_b, &full[s], x, y);
          }
        }
        // (a box may run into the next expert's rows: computed, never stored)
        sm90::tma_load_2d(a_stage, &tmap_a, &full[s], k0, tile.row0);
      }
    }
    cyc.flush();
    __syncwarp();  // warps 0 and 1 whole again before the end (lanes 1-31 had nothing to do)
  } else {
    // ------------------------------------------------------------ consumers
    sm90::setmaxnreg_inc<kPingPongConsumerRegs>();
    auto release = [&](int s) {  // by one thread: this CTA's barrier (and the peer's)
      sm90::mbar_arrive(&empty[s]);
      if constexpr (kCluster) sm90::mbar_arrive_cluster(&empty[s], peer);
    };
    const int c = wg - 1;
    uint8_t* buf = epi + c * Smem::kEpiBufBytes;
    constexpr int kTurn = 4;  // named barriers 4 (consumer 0's turn) and 5 (consumer 1's); 2, 3: per warpgroup
    constexpr int kEpiTurn = 6;  // kPPEpiRing: 6 and 7, the epilogues' turns (the ring's owner)
    if (c == 1) sm90::named_barrier_arrive(kTurn + 0, 256);  // consumer 0 goes first
    if (kEpi == kPPEpiRing && c == 1) sm90::named_barrier_arrive(kEpiTurn + 0, 256);
    bool stored = false;  // a TMA store from `buf` may still be reading it
    PingPongCycles cyc{};
    cyc.on = gemm_probe(p, 1024) && tid == 0;
    for (int n = c;; n += 2) {
      const int slot = n % kTileRing;
      const uint32_t t_ring = cyc.now();
      sm90::mbar_wait(&tile_full[slot], (n / kTileRing) & 1);
      cyc.add(PingPongCycles::kRingWait, t_ring);
      const GemmTile tile = ring[slot];
      sm90::mbar_arrive(&tile_empty[slot]);
      // Tile n's turn is handed over by the warpgroup that issued tile n - 1 (tile 0's by consumer
      // 1 above). The first stop signal (e = -1, n = the CTA's tile count) has such a turn pending
      // too: take it, so that no arrival is left on a named barrier when the CTA exits. Nobody
      // hands a turn to the second stop.
      // The turn is also what keeps the stage barriers' parity waits unambiguous: a consumer waits
      // on its first stage only after the other has seen every earlier stage full, so it is never
      // two phases ahead of a stage. Never wait on a stage before taking the turn.
      const uint32_t t_turn = cyc.now();
      if (tile.e != -2) sm90::named_barrier_sync(kTurn + c, 256);
      cyc.add(PingPongCycles::kTurnWait, t_turn);
      const uint32_t t_main = cyc.now();
      // (the ring's turn likewise: tile n's epilogue turn comes from tile n - 1's)
      if (kEpi == kPPEpiRing && tile.e == -1) sm90::named_barrier_sync(kEpiTurn + c, 256);
      if (tile.e < 0) break;
      float acc[2][BN / 2];
      const int prev_stage = pingpong_mainloop<BN, B_NMAJOR, false, S, Smem::kABytes, Smem::kBBytes>(
          p, acc, smem_a, smem_b, n, k_blocks,
          [&](int s, uint32_t parity) {
            const uint32_t t_full = cyc.now();
            sm90::mbar_wait(&full[s], parity);
            cyc.add(PingPongCycles::kFullWait, t_full);
          },
          release, [](int) {});
      // The other consumer's turn: its wgmmas queue behind ours while ours drain.
      sm90::named_barrier_arrive(kTurn + (c ^ 1), 256);
      cyc.add(PingPongCycles::kMainLoop, t_main);
      const uint32_t t_drain = cyc.now();
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(acc[0]);
      sm90::fence_accumulators(acc[1]);
      cyc.add(PingPongCycles::kDrain, t_drain);
      const uint32_t t_epi = cyc.now();
      if (prev_stage >= 0 && tid == 0) release(prev_stage);

      if constexpr (kEpi == kPPEpiRing) sm90::named_barrier_sync(kEpiTurn + c, 256);  // the ring is ours
      // (timing probes, -DMACHMOE_GEMM_PROBES=ON builds only: 1 drops the accumulators, 8 stages
      // full tiles without storing them, 16 leaves out the proxy fence, 32 the staging's stmatrix,
      // 64 the partial tiles' stores)
      const bool out = p.c && !gemm_probe(p, 1) && !(tile.rows < kGemmBM && gemm_probe(p, 64));
      const bool tma_out = !gemm_probe(p, 8);
      if (kEpi == kPPEpiRing && out) {
        // Six boxes (BN = 192) through the two-box ring: box i is staged while box i - 1 is read.
        // A box cut by the expert's end is copied out row by row (as in the halves' epilogue);
        // its (empty) bulk group keeps the ring's group count.
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int b = 0; b < BN / 64; ++b) {
            const int rows = min(64, tile.rows - 64 * h);
            if (rows <= 0) continue;  // (the second half of a tile of <= 64 rows: no more boxes)
            const int i = h * (BN / 64) + b;
            uint8_t* box = epi + (i % 2) * Smem::kBoxBytes;
            if (i >= 2) {
              if (tid == 0) sm90::bulk_wait_read<1>();  // box i - 2 has left this slot
              sm90::named_barrier_sync(2 + c, 128);
            }
            GemmTile box_tile = tile;  // the box's 64 columns: acc registers 32·b .. 32·b + 31
            box_tile.n0 += 64 * b;
            if (!gemm_probe(p, 32))
              gemm_stage_out<64, kEpiStore, 64>(p, box_tile, 0, reinterpret_cast<const float(&)[32]>(acc[h][32 * b]), box);
            if (!gemm_probe(p, 16)) sm90::fence_proxy_async_shared();  // st.shared -> the TMA store's reads
            sm90::named_barrier_sync(2 + c, 128);
            if (tid == 0) {
              if (rows == 64 && tile.n0 + 64 * b < p.N && tma_out)
                sm90::tma_store_2d(&tmap_c, box, tile.n0 + 64 * b, tile.row0 + 64 * h);
              sm90::bulk_commit_group();
            }
            if (rows < 64) pingpong_copy_rows<64>(p, box_tile, h, rows, box);
          }
        if (tid == 0) sm90::bulk_wait_read_all();  // the ring is read: the other warpgroup's now
        stored = true;
      } else if (kEpi == kPPEpiHalves && out) {
        // (A half cut by the expert's end is copied out of the buffer, not stored from the
        // accumulators: session 26 measured those 4-byte stores of the partial tiles, 1 tile in
        // 12, at 0.09-0.11 ms of 7B-a's 0.64 ms dX~; probe 64.)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rows = min(64, tile.rows - 64 * h);
          if (rows <= 0) break;
          if (stored && tid == 0) sm90::bulk_wait_read_all();  // the previous store has read `buf`
          sm90::named_barrier_sync(2 + c, 128);  // (and every thread is done copying out of it)
          if (!gemm_probe(p, 32)) gemm_stage_out<BN, kEpiStore, 64>(p, tile, 0, acc[h], buf);  // boxes [64 rows][64 columns]
          if (!gemm_probe(p, 16)) sm90::fence_proxy_async_shared();  // st.shared -> the TMA store's reads
          sm90::named_barrier_sync(2 + c, 128);
          if (rows == 64) {
            if (tid == 0) {
#pragma unroll
              for (int b = 0; b < BN / 64; ++b)
                if (tile.n0 + 64 * b < p.N && tma_out)
                  sm90::tma_store_2d(&tmap_c, buf + b * Smem::kBoxBytes, tile.n0 + 64 * b, tile.row0 + 64 * h);
              sm90::bulk_commit_group();
            }
            stored = true;
          } else {
            pingpong_copy_rows<BN>(p, tile, h, rows, buf);
          }
        }
      }
      if constexpr (kEpi == kPPEpiRing) sm90::named_barrier_arrive(kEpiTurn + (c ^ 1), 256);
      cyc.add(PingPongCycles::kEpilogue, t_epi);
      if (cyc.on) ++cyc.v[PingPongCycles::kTiles];
    }
    cyc.flush();
    if (stored && tid == 0) sm90::bulk_wait_all();
  }
  // kCluster: neither CTA exits while the other may still multicast into it or arrive on its
  // barriers (every thread of both CTAs arrives here).
  if constexpr (kCluster) sm90::cluster_sync();
}

}  // namespace machmoe::kernels
