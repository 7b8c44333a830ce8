// The sm_90a FP8 (E4M3) weight-gradient grouped GEMM, DeepSeek-V3's recipe for wgrad: both
// operands quantised in 1x128 tiles ALONG THE REDUCTION DIMENSION, which is each expert's rows
// (varlen K), by quantize_columns_fp8 (machmoe/fp8.hpp, "along each expert's rows"):
//
//   for every expert e, its K blocks are its chunks c in [chunk_offsets[e], chunk_offsets[e+1]):
//     C[e][m, n] = Σ_c sa[c, m] · sb[c, n] · Σ_{k < 128} Aqt[c, m, k] · Bqt[c, n, k]
//   Aqt e4m3 [max_chunks, M, 128], sa fp32 [max_chunks, M]; Bqt e4m3 [max_chunks, N, 128],
//   sb fp32 [max_chunks, N] (both from the same expert_offsets, so they share chunk_offsets);
//   C fp32 or bf16 [E, M, N], or with transpose_c C[e]ᵀ into [E, N, M].
// dW1ᵀ = xᵀ·dH: A = x's columns (M = d), B = dH's (N = n1); dW2 = doutᵀ·A': A = dout's (M = d),
// B = A''s (N = n). An expert without chunks gets C[e] = 0.
//
// Both operands are K-major (each row of Aqt[c] / Bqt[c] is contiguous along the expert's rows),
// as the FP8 wgmma requires, so a stage is a plain TMA box: one chunk = 128 e4m3 = one 128-byte
// swizzle row. The quantiser zero-pads every chunk past its expert's last row, so no masking
// along K. A chunk's scales are contiguous too ([max_chunks, cols]): one TMA box each.
//
// Promotion. A chunk's product is accumulated by four wgmma m64n128k32 per 128-column wave into a
// temporary fp32 fragment `tmp`, then added into the main accumulator with both scales in fp32:
//   acc[m, n] += (sa[m, c]·sb[n, c]) · tmp[m, n]
// Unlike the forward (gemm/fp8_cooperative.cuh: one weight-block scale per wave), sb varies per
// COLUMN here, so each thread reads the sb of the columns its fragment holds from the stage's
// shared scales (two adjacent columns per 8-column group: one 8-byte load per group).
//
// Persistent and warp-specialised, 3 warpgroups per CTA, one CTA per SM. Tiles (e, m_blk, n_blk),
// 128 x BN, are walked statically and expert-major (as gemm/wgrad.cuh): CTA b takes tiles b,
// b + gridDim.x, ...; loader and consumers decode the same tile from its index and read the same
// chunk range, so no tile ring is needed.
//   warpgroup 0 (40 registers): one thread loads. Per chunk it issues the TMA loads of a stage,
//     A [128 M x 128 K] and B [BN N x 128 K] (BN/128 boxes of 128 rows), 128-byte swizzle, and
//     the chunk's scales, sa of the tile's 128 m and sb of its BN n (zeros past M or N), all
//     completing on the stage's full barrier (one expect_tx arrival).
//   warpgroups 1-2, consumers (232 registers): each owns 64 rows of M and runs its 64 x BN as BN/128
//     waves per chunk: fence, 4 wgmma, commit, wait<0>, promote. tmp[64] + acc[BN/2] (64 + 128 at
//     BN = 256). The stage is released (one arrival per warp, 8 in all) after the last wave's
//     promotion, which still reads the stage's sb. C's format (fp32 / bf16, transposed or not) is
//     a template argument: one kernel each. At the tile's end each consumer stores its 64 rows:
//   - bf16 C, staged: the accumulators, rounded to bf16, go by stmatrix into the consumer's half
//     of a 128 x BN staging tile laid out as C is (transposed: [BN n][64 m], by stmatrix.trans;
//     plain: BN/64 boxes [64 m][64 n]; 128-byte swizzled rows), and one thread sends the half to
//     C by TMA stores through a 3-D map of C as [E][rows][cols], whose bounds clip the box at M and
//     N. The consumers go straight on to the next tile's main loop while the store drains; the
//     half is rewritten only at the next tile's end, after that thread's wait for the store's
//     reads and a named barrier of the warpgroup. This replaced a store straight from the
//     fragments (2-byte stores, 8 lanes per 16 contiguous bytes, with transpose; 4-byte pairs
//     without) during which the tensor cores idled. The staging tile (64 KB at BN = 256) costs a
//     pipeline stage: 3 instead of 4 (a stage is ~1600 cycles of tensor work, so two loads stay
//     in flight under one stage's wgmmas).
//   - fp32 C: straight from the fragments (fp32 pairs, or single elements transposed), bounded by
//     M and N; a staged fp32 tile would need 128 KB. Not the layer's format (it stores bf16).
// Registers (ptxas of CUDA 13.0, sm_90a, BN = 256, from the SASS): the consumers use up to R212 of
// their 232 with the staged bf16 store (both layouts), R215 (plain) and R213 (transposed) with
// fp32 C; the loader up to R26 of its 40; no spill, no stack frame. SASS: 16.0 KB (transposed)
// and 17.0 KB (plain) with the staged store, whose 16 stmatrix and 64 conversions a thread take
// ~110 instructions between its two named barriers; 16-33 KB with the fp32 store.
// Edges: tile rows past M and columns past N read zeros (TMA out of bounds, zero scales) and are
// not stored (the fp32 store's bounds; the TMA store's map, per expert, for bf16). Fixed K order
// (the expert's chunks in order) and the same fp32 sums and rounding in every format: deterministic.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/gemm/pipeline.cuh"
#include "kernels/ptx/sm90_ptx_fp8.cuh"

namespace machmoe::kernels {

constexpr int kFp8WgradBM = 128;       // M rows per tile: two consumer warpgroups of 64
constexpr int kFp8WgradBK = 128;       // K per stage: one chunk, one 128-byte swizzle row of e4m3
constexpr int kFp8WgradThreads = 384;  // loader warpgroup + two consumer warpgroups
// Register split of the 64K-register file, as the forward's: (40 + 2 x 232) x 128 = 64512.
constexpr int kFp8WgradProducerRegs = 40;
constexpr int kFp8WgradConsumerRegs = 232;
// The staged store's boxes are 64 bf16 wide: one 128-byte swizzle row.
constexpr int kFp8WgradEpiCols = 64;
// Named barriers 1 and 2: consumer warpgroup cw's staging half (0 is __syncthreads).
constexpr int kFp8WgradEpiBarrier = 1;

struct Fp8WgradParams {
  const int32_t* chunk_offsets;   // [E+1]: expert e's chunks [chunk_offsets[e], chunk_offsets[e+1])
  int E, M, N;
  int max_chunks;
  int m_tiles, n_tiles;           // ceil(M / 128), ceil(N / BN)
  void* c;                        // [E, M, N], or [E, N, M] transposed (the kernel's template arguments)
};

// Shared memory: S stages of A [128][128] e4m3, then S of B [BN][128], then (kStaged: bf16 C) the
// staging tile, two halves of 64 x BN bf16, one per consumer warpgroup, then S scale slots
// (sa [128] | sb [BN] fp32), then the barriers (full [S], empty [S]). Declared 1024-byte aligned
// (fp8_wgrad_smem), so the stages and the staging boxes start on a swizzle atom without slack.
// At BN = 256: staged, 3 x (16 + 32 + 1.5) KB + 64 KB + 1 KB = 218624 bytes; fp32 C, 4 stages
// and no staging tile, 203776 bytes.
template <int BN, bool kStaged>
struct Fp8WgradSmem {
  static constexpr int kWaves = BN / 128;
  static constexpr int kABytes = kFp8WgradBM * kFp8WgradBK;  // 16 KB
  static constexpr int kBBytes = BN * kFp8WgradBK;           // 32 KB at BN = 256
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kScaleFloats = kFp8WgradBM + BN;      // sa of the tile's m, sb of its n
  static constexpr int kScaleBytes = kScaleFloats * 4;
  static constexpr int kEpiHalfBytes = kStaged ? 64 * BN * 2 : 0;  // 32 KB at BN = 256
  static constexpr int kEpiBytes = 2 * kEpiHalfBytes;
  static constexpr int kBudget = 227 * 1024;
  static constexpr int kFixed = 1024;  // the barriers
  static constexpr int kStages = (kBudget - kFixed - kEpiBytes) / (kStageBytes + kScaleBytes);
  static constexpr int kBOffset = kStages * kABytes;
  static constexpr int kEpiOffset = kStages * kStageBytes;
  static constexpr int kScaleOffset = kEpiOffset + kEpiBytes;
  static constexpr int kBarOffset = kScaleOffset + kStages * kScaleBytes;
  static constexpr int kBytes = kBarOffset + kFixed;
  static_assert(BN % 128 == 0 && kWaves >= 1 && kWaves <= 2, "BN: one or two 128-column waves");
  static_assert(kStages >= 2, "at least two pipeline stages");
  static_assert(kBytes <= kBudget, "shared memory over the per-block budget");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stages on 1024-byte swizzle atoms");
  static_assert(kEpiOffset % 1024 == 0 && (64 * kFp8WgradEpiCols * 2) % 1024 == 0,
                "staging boxes on 1024-byte swizzle atoms");
  static_assert(BN <= 256, "a transposed half is one TMA box of BN rows (at most 256)");
  static_assert(kScaleBytes % 16 == 0, "scale slots keep the barriers 8-byte aligned");
  static_assert(2 * kStages * 8 <= kFixed, "fixed shared-memory area too small");
};
static_assert(Fp8WgradSmem<256, true>::kStages == 3 && Fp8WgradSmem<256, true>::kBytes == 218624,
              "staged bf16 C at BN = 256: 3 stages (the header comment's figures)");
static_assert(Fp8WgradSmem<256, false>::kStages == 4 && Fp8WgradSmem<256, false>::kBytes == 203776,
              "fp32 C at BN = 256: 4 stages (the header comment's figures)");

// Its own name: the alignment of a shared extern array reaches every kernel that declares it.
extern __shared__ __align__(1024) uint8_t fp8_wgrad_smem[];

struct Fp8WgradTile {
  int e, m0, n0;
  int c_begin, c_end;  // the expert's chunks, clamped into [0, max_chunks]
};

// Tile t of the expert-major walk: e = t / (m_tiles·n_tiles); within the expert m varies
// fastest. The chunk range is clamped, so that offsets breaking the quantiser's contract cannot
// send a load outside the operands (the result is then meaningless, nothing more).
template <int BN>
__device__ __forceinline__ Fp8WgradTile fp8_wgrad_tile(const Fp8WgradParams& p, int t) {
  Fp8WgradTile w;
  const int per_expert = p.m_tiles * p.n_tiles;
  w.e = t / per_expert;
  const int local = t - w.e * per_expert;
  w.m0 = (local % p.m_tiles) * kFp8WgradBM;
  w.n0 = (local / p.m_tiles) * BN;
  const int b = __ldg(p.chunk_offsets + w.e), e = __ldg(p.chunk_offsets + w.e + 1);
  w.c_begin = min(max(b, 0), p.max_chunks);
  w.c_end = min(max(e, w.c_begin), p.max_chunks);
  return w;
}

// T (float or __nv_bfloat16) and kTranspose: C's format. bf16 C is staged (kStaged), fp32 C is
// stored from the fragments.
template <int BN, typename T, bool kTranspose>
struct Fp8Wgrad {
  static constexpr bool kStaged = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kStaged || std::is_same_v<T, float>, "C is fp32 or bf16");
  using Smem = Fp8WgradSmem<BN, kStaged>;
  static constexpr int S = Smem::kStages;
  static constexpr int kWaves = Smem::kWaves;
  using Stages = StageRing<S>;

  static __device__ __forceinline__ Stages stages() {
    uint64_t* full = reinterpret_cast<uint64_t*>(fp8_wgrad_smem + Smem::kBarOffset);
    return {full, full + S};
  }
  static __device__ __forceinline__ float* scale_slot(int stage) {
    return reinterpret_cast<float*>(fp8_wgrad_smem + Smem::kScaleOffset) + stage * Smem::kScaleFloats;
  }

  // By thread 0 before the CTA's first barrier. full: the loader's expect_tx arrival; empty: one
  // arrival per consumer warp.
  static __device__ __forceinline__ void init_barriers() { stages().init(1, 8); }

  // The loader thread: per chunk of every tile, the stage's operands and scales by TMA.
  struct Maps {
    const CUtensorMap *a, *b, *sa, *sb;
  };
  static __device__ __forceinline__ void loader(const Fp8WgradParams& p, const Maps& maps, int units) {
    const Stages ring = stages();
    int it = 0;
    for (int t = blockIdx.x; t < units; t += gridDim.x) {
      const Fp8WgradTile tile = fp8_wgrad_tile<BN>(p, t);
      for (int c = tile.c_begin; c < tile.c_end; ++c, ++it) {
        const typename Stages::Slot slot = Stages::slot(it);
        const int s = slot.stage;
        uint64_t* full = ring.full_barrier(s);
        ring.acquire(slot);
        ring.commit_tx(s, Smem::kStageBytes + Smem::kScaleBytes);
        sm90::tma_load_3d(fp8_wgrad_smem + s * Smem::kABytes, maps.a, full, 0, tile.m0, c);
        uint8_t* b_stage = fp8_wgrad_smem + Smem::kBOffset + s * Smem::kBBytes;
#pragma unroll
        for (int h = 0; h < kWaves; ++h)  // Bqt[c] rows n0 + 128h .. (past N: zeros)
          sm90::tma_load_3d(b_stage + h * 128 * kFp8WgradBK, maps.b, full, 0, tile.n0 + 128 * h, c);
        float* sc = scale_slot(s);
        sm90::tma_load_2d(sc, maps.sa, full, tile.m0, c);                 // sa[c, m0 .. m0 + 127]
        sm90::tma_load_2d(sc + kFp8WgradBM, maps.sb, full, tile.n0, c);  // sb[c, n0 .. n0 + BN - 1]
      }
    }
  }

  // acc of wave w += (sa·sb)·tmp. Fragment of m64nNk32 (thread t of the warpgroup, warp w = t / 32,
  // lane l): register 4j + 2h + i holds row 16w + l/4 + 8h, column 8j + 2·(l % 4) + i of the wave;
  // sbw points at the wave's sb of column 2·(l % 4).
  static __device__ __forceinline__ void promote(float (&acc)[kWaves * 64], const float (&tmp)[64], int w, float sa0,
                                                 float sa1, const float* sbw) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 sb = *reinterpret_cast<const float2*>(sbw + 8 * j);
      float* a = acc + w * 64 + 4 * j;
      a[0] = fmaf(sa0 * sb.x, tmp[4 * j + 0], a[0]);
      a[1] = fmaf(sa0 * sb.y, tmp[4 * j + 1], a[1]);
      a[2] = fmaf(sa1 * sb.x, tmp[4 * j + 2], a[2]);
      a[3] = fmaf(sa1 * sb.y, tmp[4 * j + 3], a[3]);
    }
  }

  // fp32 C: this consumer's 64 x BN part of tile (e, m0, n0), straight from the fragments, bounded
  // by M and N (N is even: a pair's second column is inside too). Transposed, C[e]ᵀ [N, M]: the 8
  // rows of a lane quad are 8 adjacent m, one 4-byte element each.
  static __device__ __forceinline__ void store_direct(const Fp8WgradParams& p, const Fp8WgradTile& tile,
                                                      int row_local, int lane, const float (&acc)[kWaves * 64]) {
    float* c = static_cast<float*>(p.c) + static_cast<int64_t>(tile.e) * p.M * p.N;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = tile.m0 + row_local + 8 * h;
      if (m >= p.M) continue;
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int n = tile.n0 + 128 * w + 8 * j + 2 * (lane % 4);
          if (n >= p.N) continue;
          const float v0 = acc[w * 64 + 4 * j + 2 * h], v1 = acc[w * 64 + 4 * j + 2 * h + 1];
          if constexpr (kTranspose) {
            float* at = c + static_cast<int64_t>(n) * p.M + m;
            at[0] = v0;
            at[p.M] = v1;
          } else {
            *reinterpret_cast<float2*>(c + static_cast<int64_t>(m) * p.N + n) = make_float2(v0, v1);
          }
        }
      }
    }
  }

  // bf16 C: the accumulators, rounded to nearest even, into this consumer's staging half at `buf`
  // in C's layout. One stmatrix.x4 per two 8-column groups g, g + 1 of a wave stores the warp's 16
  // rows of both: matrix q = rows 8·(q % 2) .. +7 of group g + q / 2, whose register in every lane
  // is the fragment's bf16 pair (row l / 4, columns 2·(l % 4), +1); lane l gives the address of
  // row l % 8 of matrix l / 8. 16 stmatrix a thread at BN = 256.
  //   transposed: buf = [BN n][64 m], one box {64 m, BN n} of C[e]ᵀ; .trans stores each 8 x 8
  //     matrix turned, one 16-byte memory row per column n holding its 8 rows m;
  //   plain: buf = BN/64 boxes [64 m][64 n], boxes {64 n, 64 m} of C[e].
  // 128-byte rows with the 128-byte swizzle (16-byte chunk k of row r at slot k ^ (r % 8)), as the
  // TMA store reads them; the 8 rows of one matrix land in 8 different slots: no bank conflict.
  // Waves wholly past N (from live_waves on) are not staged: their columns are never stored.
  static __device__ __forceinline__ void stage_bf16(uint32_t buf, int warp, int lane, int live_waves,
                                                    const float (&acc)[kWaves * 64]) {
    const int q = lane / 8, r = lane % 8;  // this lane addresses row r of matrix q
    const int h = q % 2;                   // matrix q holds fragment rows 8h .. 8h + 7 of the warp's 16
#pragma unroll
    for (int w = 0; w < kWaves; ++w) {
      if (w >= live_waves) break;  // uniform over the warpgroup
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const float* a = acc + w * 64 + 4 * j;
        const uint32_t v0 = pack_bf16x2(a[0], a[1]), v1 = pack_bf16x2(a[2], a[3]);
        const uint32_t v2 = pack_bf16x2(a[4], a[5]), v3 = pack_bf16x2(a[6], a[7]);
        const int g = 16 * w + j + q / 2;  // this lane's 8-column group of the tile: columns 8g .. 8g + 7
        if constexpr (kTranspose) {        // memory row n = 8g + r, chunk of m = 16·warp + 8h
          sm90::stmatrix_x4_trans(buf + (8 * g + r) * 128 + (((2 * warp + h) ^ r) << 4), v0, v1, v2, v3);
        } else {                           // box g / 8, row m = 16·warp + 8h + r, chunk g % 8
          sm90::stmatrix_x4(buf + (g / 8) * (64 * 128) + (16 * warp + 8 * h + r) * 128 + (((g % 8) ^ r) << 4), v0,
                            v1, v2, v3);
        }
      }
    }
  }

  // bf16 C: this consumer's 64 x BN part of tile (e, m0, n0) to C by TMA, through its staging
  // half. Thread 0 of the warpgroup issues the stores; the half may be rewritten once that thread
  // has waited for their reads (the previous tile's, one main loop ago: normally done already).
  // Every box is clipped by the map at the expert's M and N; boxes wholly past N are skipped.
  static __device__ __forceinline__ void store_staged(const Fp8WgradParams& p, const CUtensorMap* tmap_c,
                                                      const Fp8WgradTile& tile, int cw, int tid,
                                                      const float (&acc)[kWaves * 64]) {
    const int m0 = tile.m0 + 64 * cw;
    if (m0 >= p.M) return;  // none of this consumer's rows exist (uniform over the warpgroup)
    uint8_t* buf = fp8_wgrad_smem + Smem::kEpiOffset + cw * Smem::kEpiHalfBytes;
    if (tid == 0) sm90::bulk_wait_read_all();                 // the previous store has read buf
    sm90::named_barrier_sync(kFp8WgradEpiBarrier + cw, 128);  // ... as every thread now knows
    stage_bf16(sm90::smem_addr(buf), tid / 32, tid % 32, (p.N - tile.n0 + 127) / 128, acc);
    sm90::fence_proxy_async_shared();                         // the stmatrix writes -> the TMA's reads
    sm90::named_barrier_sync(kFp8WgradEpiBarrier + cw, 128);  // the whole half is staged
    if (tid == 0) {
      if constexpr (kTranspose) {
        sm90::tma_store_3d(tmap_c, buf, m0, tile.n0, tile.e);  // C[e]ᵀ rows n0 .., columns m0 .. m0 + 63
      } else {
#pragma unroll
        for (int b = 0; b < BN / kFp8WgradEpiCols; ++b)
          if (tile.n0 + kFp8WgradEpiCols * b < p.N)
            sm90::tma_store_3d(tmap_c, buf + b * (64 * 128), tile.n0 + kFp8WgradEpiCols * b, m0, tile.e);
      }
      sm90::bulk_commit_group();
    }
  }

  // Consumer warpgroup cw (0 or 1): rows [64cw, 64cw + 64) of every tile's M.
  static __device__ __forceinline__ void consumer(const Fp8WgradParams& p, const CUtensorMap* tmap_c, int cw,
                                                  int tid, int units) {
    const Stages ring = stages();
    const int warp = tid / 32, lane = tid % 32;
    const int row_local = cw * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile (+8: second)
    const uint64_t desc_a0 = sm90::smem_desc_kmajor_sw128(sm90::smem_addr(fp8_wgrad_smem + cw * 64 * kFp8WgradBK));
    const uint64_t desc_b0 = sm90::smem_desc_kmajor_sw128(sm90::smem_addr(fp8_wgrad_smem + Smem::kBOffset));
    float tmp[64];  // one wave's 64 x 128 chunk product (overwritten by each wave's first wgmma)
#pragma unroll
    for (int i = 0; i < 64; ++i) tmp[i] = 0.f;
    int it = 0;
    for (int t = blockIdx.x; t < units; t += gridDim.x) {
      const Fp8WgradTile tile = fp8_wgrad_tile<BN>(p, t);
      float acc[kWaves * 64];  // an expert without chunks stores these zeros
#pragma unroll
      for (int i = 0; i < kWaves * 64; ++i) acc[i] = 0.f;
      const int c_end = sm90::warp_uniform(tile.c_end);
      for (int c = sm90::warp_uniform(tile.c_begin); c < c_end; ++c, ++it) {
        const typename Stages::Slot slot = Stages::slot(it);
        const int s = slot.stage;
        ring.wait(slot);
        const float* sc = scale_slot(s);
        const float sa0 = sc[row_local], sa1 = sc[row_local + 8];
        const float* sb = sc + kFp8WgradBM + 2 * (lane % 4);
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          sm90::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < kFp8WgradBK / 32; ++ks) {  // +32 bytes = +32 K along the swizzled row
            const uint64_t desc_a = sm90::smem_desc_advance(desc_a0, s * Smem::kABytes + ks * 32);
            const uint64_t desc_b =
                sm90::smem_desc_advance(desc_b0, s * Smem::kBBytes + w * 128 * kFp8WgradBK + ks * 32);
            sm90::wgmma_e4m3<128>(tmp, desc_a, desc_b, ks > 0 ? 1 : 0);
          }
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          sm90::fence_accumulators(tmp);
          promote(acc, tmp, w, sa0, sa1, sb + 128 * w);
        }
        // Every read of the stage has retired: the wgmmas (waited) and the scales (consumed above).
        __syncwarp();
        if (lane == 0) ring.release(s);
      }
      if constexpr (kStaged)
        store_staged(p, tmap_c, tile, cw, tid, acc);
      else
        store_direct(p, tile, row_local, lane, acc);
    }
    if (kStaged && tid == 0) sm90::bulk_wait_all();  // the last stores are done before the CTA's smem goes
  }
};

// T (float or __nv_bfloat16) and kTranspose pick C's format: one kernel each, so that each holds
// only its own store (the four stores in one kernel made it 68 KB of SASS, against 24 KB for the
// forward FP8 GEMM). tmap_a / tmap_b: the operands [max_chunks, M | N, 128] e4m3; tmap_sa / tmap_sb: their
// scales [max_chunks, M | N]; tmap_c: C as [E][rows][cols] bf16 for the staged store (unused with fp32 C).
template <int BN, typename T, bool kTranspose>
__global__ void __launch_bounds__(kFp8WgradThreads, 1)
    sm90_grouped_wgrad_fp8(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                           const __grid_constant__ CUtensorMap tmap_sa, const __grid_constant__ CUtensorMap tmap_sb,
                           const __grid_constant__ CUtensorMap tmap_c, const Fp8WgradParams p) {
  using Wgrad = Fp8Wgrad<BN, T, kTranspose>;
  const int wg = sm90::warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    Wgrad::init_barriers();
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_a);
    sm90::tma_prefetch_descriptor(&tmap_b);
    sm90::tma_prefetch_descriptor(&tmap_sa);
    sm90::tma_prefetch_descriptor(&tmap_sb);
    if constexpr (Wgrad::kStaged) sm90::tma_prefetch_descriptor(&tmap_c);
  }
  __syncthreads();
  const int units = p.E * p.m_tiles * p.n_tiles;  // below 2^31 - 2^16 (the launcher's rule)
  if (wg == 0) {
    sm90::setmaxnreg_dec<kFp8WgradProducerRegs>();
    if (tid == 0) Wgrad::loader(p, {&tmap_a, &tmap_b, &tmap_sa, &tmap_sb}, units);
  } else {
    sm90::setmaxnreg_inc<kFp8WgradConsumerRegs>();
    Wgrad::consumer(p, &tmap_c, wg - 1, tid, units);
  }
}

}  // namespace machmoe::kernels
