// Kernel families 3, 4 (and later 6, 9) of SPEC §2: the sm_90a grouped GEMM engine.
//
//   for every expert e with rows [off[e], off[e+1]):
//     C[r, :] = epilogue( A[row(r), :] · B_eᵀ )      A [*, K] bf16, B_e = W[e] [N, K] bf16 (K-major)
//   row(r) = gather[r] (gathered activation rows, e.g. X by token) or r (contiguous rows).
//
// Persistent and warp-specialised: 3 warpgroups per CTA, one CTA per SM.
//   warpgroup 0, producer (40 registers): TMA loads of the B tile (weights), and 16-byte cp.async
//     of the A rows through the gather index, into a ring of shared-memory stages; one mbarrier
//     per stage completes when both have landed (TMA bytes + 128 cp.async arrivals).
//   warpgroups 1-2, consumers (232 registers): each owns 64 rows of the 128-row tile, runs
//     wgmma m64n{BN}k16 with fp32 accumulators, keeps one wgmma group in flight, and releases a
//     stage as soon as the wgmmas reading it retire. Then the fused epilogue stores from registers.
// Tiles: 128 rows of one expert x BN columns; an expert's last tile is predicated (no expert is
// padded to the tile), empty experts have no tiles. Tile t of the whole problem is found by a
// binary search over tile_offsets [E+1] (prefix of per-expert tile counts), so every CTA walks
// the same static schedule t = blockIdx.x, blockIdx.x + gridDim.x, ...
// Shared-memory tiles use the 128-byte swizzle (TMA writes it; the cp.async producer computes it)
// so that wgmma reads them without bank conflicts.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/sm90_ptx.cuh"

namespace machmoe::kernels {

enum GemmEpilogue : int {
  kEpiStore = 0,      // C = acc (+ bias)
  kEpiGluInter = 1,   // GLU, gate/up interleaved columns: C = H, C2 = act(gate)·up
  kEpiGluConcat = 2,  // GLU, B tile = [128 gate rows; 128 up rows] of a concatenated W1
  kEpiAct = 3,        // non-GLU activation: C = H, C2 = act(H)
};

enum GemmActivation : int { kActSwiGLU = 0, kActGeGLU = 1, kActReGLU = 2, kActReLU2 = 3, kActReLU = 4,
                            kActGELU = 5, kActSiLU = 6 };

constexpr int kGemmBM = 128;
constexpr int kGemmBK = 64;  // one 128-byte swizzle row of bf16
constexpr int kGemmThreads = 384;
// Register split of the 64K-register file: (56 + 2 x 224) x 128 threads = 64512.
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;

struct GroupedGemmParams {
  const __nv_bfloat16* a;        // A rows, leading dimension lda (elements)
  int64_t lda;
  const int32_t* gather;         // [R] row -> A row, or null (row r of A)
  const int32_t* expert_offsets; // [E+1]
  const int32_t* tile_offsets;   // [E+1], from grouped_gemm_tile_offsets
  const __nv_bfloat16* bias;     // [E, N] or null; for kEpiGluConcat [E, 2n] in W1's layout
  __nv_bfloat16* c;              // [R, ldc]: C (store) or H (GLU / act)
  int64_t ldc;
  __nv_bfloat16* c2;             // [R, ldc2]: A = act(H), or null
  int64_t ldc2;
  int E, N, K;                   // N: output columns of C (2n for GLU)
  int n_tiles;                   // column tiles per expert
  int act;                       // GemmActivation
};

// The activation as a compile-time choice (the epilogue loop is instantiated once per activation
// and picked by one switch per tile). Fast intrinsics: the result is rounded to bf16 anyway.
template <int ACT>
__device__ __forceinline__ float gemm_act(float h) {
  if constexpr (ACT == kActSwiGLU || ACT == kActSiLU) {
    return __fdividef(h, 1.f + __expf(-h));
  } else if constexpr (ACT == kActGeGLU || ACT == kActGELU) {
    const float u = 0.7978845608028654f * (h + 0.044715f * h * h * h);
    return 0.5f * h * (1.f + tanhf(u));
  } else if constexpr (ACT == kActReGLU || ACT == kActReLU) {
    return fmaxf(h, 0.f);
  } else {  // ReLU²
    return h > 0.f ? h * h : 0.f;
  }
}

// Expert of tile t: the largest e with tile_offsets[e] <= t (empty experts share an offset).
__device__ __forceinline__ int gemm_tile_expert(const int32_t* tile_offsets, int E, int t) {
  int lo = 0, hi = E;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(tile_offsets + mid) <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

struct GemmTile {
  int e, row0, rows, n0;
};
constexpr int kTileRing = 4;  // tiles the producer may decode ahead of the consumers

// Tiles of one expert are visited in groups of kGemmGroupM row blocks, column block outer inside a
// group, so that the CTAs running at the same time share both their A rows and their B columns
// in L2 (a plain row-major walk streams all of B once per wave of CTAs).
constexpr int kGemmGroupM = 8;

__device__ __forceinline__ GemmTile gemm_decode_tile(const GroupedGemmParams& p, int t, int bn_cols) {
  GemmTile tile;
  tile.e = gemm_tile_expert(p.tile_offsets, p.E, t);
  const int local = t - __ldg(p.tile_offsets + tile.e);
  const int begin = __ldg(p.expert_offsets + tile.e), end = __ldg(p.expert_offsets + tile.e + 1);
  const int m_tiles = (end - begin + kGemmBM - 1) / kGemmBM;
  const int group = local / (kGemmGroupM * p.n_tiles);
  const int first_m = group * kGemmGroupM;
  const int group_m = min(kGemmGroupM, m_tiles - first_m);
  const int within = local - group * kGemmGroupM * p.n_tiles;
  const int m_blk = first_m + within % group_m, n_blk = within / group_m;
  tile.row0 = begin + m_blk * kGemmBM;
  tile.rows = min(kGemmBM, end - tile.row0);
  tile.n0 = n_blk * bn_cols;
  return tile;
}

// tile_offsets[e] = Σ_{e' < e} ceil(rows_e' / BM) · n_tiles, one block.
__global__ void __launch_bounds__(1024) grouped_gemm_tile_offsets(const int32_t* expert_offsets, int E,
                                                                   int n_tiles, int32_t* tile_offsets) {
  __shared__ int smem[32];
  int carry = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int rows = e < E ? expert_offsets[e + 1] - expert_offsets[e] : 0;
    const int tiles = (rows + kGemmBM - 1) / kGemmBM * n_tiles;
    int total;
    const int excl = block_exclusive_scan(tiles, smem, &total);
    if (e < E) tile_offsets[e] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) tile_offsets[E] = carry;
}

template <int BN>
struct GemmSmem {
  static constexpr int kABytes = kGemmBM * kGemmBK * 2;  // 16 KB
  static constexpr int kBBytes = BN * kGemmBK * 2;       // 32 KB for BN = 256
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = (200 * 1024) / kStageBytes;  // leaves room for barriers and alignment
  // + 1024 for the alignment of the stages, + 256 for the barriers and the tile ring.
  static constexpr int kBytes = kStages * kStageBytes + 1024 + 256;
};

// Column c of the consumer's accumulator fragment: register (c / 8) * 4 + (c % 2) for row r0,
// + 2 for row r0 + 8, where c % 8 / 2 == lane % 4.
template <int BN, int EPI, int ACT>
__device__ __forceinline__ void gemm_epilogue_act(const GroupedGemmParams& p, const GemmTile& tile, int cw,
                                                  float (&acc)[BN / 2]) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int r_local0 = cw * 64 + warp * 16 + lane / 4;
  const __nv_bfloat16* bias = p.bias ? p.bias + static_cast<int64_t>(tile.e) * p.N : nullptr;  // [E, N]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r_local = r_local0 + half * 8;
    const bool row_ok = r_local < tile.rows;
    const int64_t row = tile.row0 + r_local;
    if constexpr (EPI == kEpiGluConcat) {
      if (!row_ok) continue;
      // Tile columns [0, 128) are gate j0 + c, [128, 256) are up j0 + c - 128; n = N / 2.
      const int n = p.N / 2, j0 = tile.n0;
#pragma unroll
      for (int jj = 0; jj < BN / 16; ++jj) {
        const int j = j0 + jj * 8 + 2 * (lane % 4);
        if (j >= n) continue;
        float g0 = acc[jj * 4 + half * 2], g1 = acc[jj * 4 + half * 2 + 1];
        float u0 = acc[(jj + BN / 16) * 4 + half * 2], u1 = acc[(jj + BN / 16) * 4 + half * 2 + 1];
        if (bias) {
          g0 += __bfloat162float(bias[j]);
          g1 += __bfloat162float(bias[j + 1]);
          u0 += __bfloat162float(bias[n + j]);
          u1 += __bfloat162float(bias[n + j + 1]);
        }
        const __nv_bfloat162 g = __floats2bfloat162_rn(g0, g1), u = __floats2bfloat162_rn(u0, u1);
        *reinterpret_cast<__nv_bfloat162*>(p.c + row * p.ldc + j) = g;
        *reinterpret_cast<__nv_bfloat162*>(p.c + row * p.ldc + n + j) = u;
        // A from the bf16-rounded H, so that the backward's recomputation from H matches.
        const float2 gr = __bfloat1622float2(g), ur = __bfloat1622float2(u);
        *reinterpret_cast<__nv_bfloat162*>(p.c2 + row * p.ldc2 + j) =
            __floats2bfloat162_rn(gemm_act<ACT>(gr.x) * ur.x, gemm_act<ACT>(gr.y) * ur.y);
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) {
        const int col = tile.n0 + jj * 8 + 2 * (lane % 4);
        const bool ok = row_ok && col < p.N;
        float v0 = acc[jj * 4 + half * 2], v1 = acc[jj * 4 + half * 2 + 1];
        if (bias && ok) {
          v0 += __bfloat162float(bias[col]);
          v1 += __bfloat162float(bias[col + 1]);
        }
        const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
        if (ok) *reinterpret_cast<__nv_bfloat162*>(p.c + row * p.ldc + col) = h;
        if constexpr (EPI == kEpiGluInter) {
          // (gate, up) of A column col / 2. Lanes l (even) and l ^ 1 hold the consecutive A
          // columns col / 2 and col / 2 + 1: the even lane stores both as one 4-byte pair.
          const float2 hr = __bfloat1622float2(h);
          const float a = gemm_act<ACT>(hr.x) * hr.y;
          const float other = __shfl_xor_sync(kFullMask, a, 1);
          if ((lane & 1) == 0 && ok)
            *reinterpret_cast<__nv_bfloat162*>(p.c2 + row * p.ldc2 + col / 2) = __floats2bfloat162_rn(a, other);
        } else if constexpr (EPI == kEpiAct) {
          const float2 hr = __bfloat1622float2(h);
          if (ok)
            *reinterpret_cast<__nv_bfloat162*>(p.c2 + row * p.ldc2 + col) =
                __floats2bfloat162_rn(gemm_act<ACT>(hr.x), gemm_act<ACT>(hr.y));
        }
      }
    }
  }
}

template <int BN, int EPI>
__device__ __forceinline__ void gemm_epilogue(const GroupedGemmParams& p, const GemmTile& tile, int cw,
                                              float (&acc)[BN / 2]) {
  if constexpr (EPI == kEpiStore) {
    gemm_epilogue_act<BN, EPI, kActSwiGLU>(p, tile, cw, acc);  // no activation involved
  } else if constexpr (EPI == kEpiGluInter || EPI == kEpiGluConcat) {
    switch (p.act) {
      case kActGeGLU: gemm_epilogue_act<BN, EPI, kActGeGLU>(p, tile, cw, acc); break;
      case kActReGLU: gemm_epilogue_act<BN, EPI, kActReGLU>(p, tile, cw, acc); break;
      default: gemm_epilogue_act<BN, EPI, kActSwiGLU>(p, tile, cw, acc); break;
    }
  } else {
    switch (p.act) {
      case kActReLU2: gemm_epilogue_act<BN, EPI, kActReLU2>(p, tile, cw, acc); break;
      case kActReLU: gemm_epilogue_act<BN, EPI, kActReLU>(p, tile, cw, acc); break;
      case kActGELU: gemm_epilogue_act<BN, EPI, kActGELU>(p, tile, cw, acc); break;
      default: gemm_epilogue_act<BN, EPI, kActSiLU>(p, tile, cw, acc); break;
    }
  }
}

// GATHER: A rows come through p.gather by 16-byte cp.async from the producer threads; otherwise
// A is contiguous and loaded by TMA like B (tmap_a over A [rows, K]; a box may run into the next
// expert's rows, which are computed and not stored).
template <int BN, int EPI, bool GATHER>
__global__ void __launch_bounds__(kGemmThreads, 1)
    sm90_grouped_gemm(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                      const GroupedGemmParams p) {
  using Smem = GemmSmem<BN>;
  constexpr int S = Smem::kStages;
  // BN columns of C per tile; the concatenated GLU tile spans BN/2 gate + BN/2 up columns.
  constexpr int kTileCols = EPI == kEpiGluConcat ? BN / 2 : BN;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + S * Smem::kABytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * Smem::kStageBytes);
  uint64_t* empty = full + S;
  // The tile schedule, decoded by the producer (whose latency is hidden: it runs ahead) and
  // handed to the consumers through a small ring, so that they never stall on the binary search.
  uint64_t* tile_full = empty + S;
  uint64_t* tile_empty = tile_full + kTileRing;
  GemmTile* ring = reinterpret_cast<GemmTile*>(tile_empty + kTileRing);

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      // GATHER: 128 cp.async arrivals + the TMA thread's expect_tx; else the expect_tx alone.
      sm90::mbar_init(&full[s], GATHER ? 128 + 1 : 1);
      sm90::mbar_init(&empty[s], 2);       // one arrival per consumer warpgroup
    }
    for (int r = 0; r < kTileRing; ++r) {
      sm90::mbar_init(&tile_full[r], 1);     // the producer's publishing thread
      sm90::mbar_init(&tile_empty[r], 256);  // every consumer thread, once it has read the slot
    }
    sm90::mbar_fence_init();
    sm90::tma_prefetch_descriptor(&tmap_b);
    if (!GATHER) sm90::tma_prefetch_descriptor(&tmap_a);
  }
  __syncthreads();
  const int total_tiles = __ldg(p.tile_offsets + p.E);
  const int k_blocks = (p.K + kGemmBK - 1) / kGemmBK;

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    const int chunk = tid % 8;  // 16-byte chunk (8 bf16 of K) this thread copies in every row
    int it = 0;
    for (int t = blockIdx.x, n = 0;; t += gridDim.x, ++n) {
      const bool done = t >= total_tiles;
      const GemmTile tile = done ? GemmTile{-1, 0, 0, 0} : gemm_decode_tile(p, t, kTileCols);
      if (tid == 0) {  // publish (e = -1 tells the consumers to stop)
        const int slot = n % kTileRing;
        sm90::mbar_wait(&tile_empty[slot], ((n / kTileRing) & 1) ^ 1);
        ring[slot] = tile;
        sm90::mbar_arrive(&tile_full[slot]);
      }
      if (done) break;
      // GATHER: this thread's 8 rows (tid/8 + 16 i) of the tile, resolved once per tile.
      const __nv_bfloat16* src[GATHER ? 8 : 1];
      if constexpr (GATHER) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = tid / 8 + 16 * i;
          src[i] = r < tile.rows ? p.a + static_cast<int64_t>(__ldg(p.gather + tile.row0 + r)) * p.lda + chunk * 8
                                 : nullptr;
        }
      }
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % S;
        sm90::mbar_wait(&empty[s], ((it / S) & 1) ^ 1);
        uint8_t* a_stage = smem_a + s * Smem::kABytes;
        uint8_t* b_stage = smem_b + s * Smem::kBBytes;
        const int k0 = kb * kGemmBK;
        if (tid == 0) {
          sm90::mbar_arrive_expect_tx(&full[s], GATHER ? Smem::kBBytes : Smem::kBBytes + Smem::kABytes);
          const int wrow = tile.e * p.N;  // first row of W[e] in the [E*N, K] view
#pragma unroll
          for (int h = 0; h < BN / 128; ++h) {
            // Interleaved/plain: rows n0 + 128h; concatenated GLU: gate rows j0.., up rows n + j0..
            const int r = EPI == kEpiGluConcat ? wrow + h * (p.N / 2) + tile.n0 : wrow + tile.n0 + 128 * h;
            sm90::tma_load_2d(b_stage + h * 128 * 128, &tmap_b, &full[s], k0, r);
          }
          if constexpr (!GATHER) sm90::tma_load_2d(a_stage, &tmap_a, &full[s], k0, tile.row0);
        }
        if constexpr (GATHER) {
          const bool k_ok = k0 + chunk * 8 < p.K;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int r = tid / 8 + 16 * i;
            const bool ok = k_ok && src[i] != nullptr;
            const uint32_t dst = sm90::smem_addr(a_stage + r * 128 + ((chunk ^ (r & 7)) << 4));
            sm90::cp_async_16(dst, ok ? src[i] + k0 : p.a, ok ? 16 : 0);
          }
          sm90::cp_async_arrive_noinc(&full[s]);
        }
      }
    }
  } else {
    // ------------------------------------------------------------ consumers
    sm90::setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1;
    int it = 0;
    for (int n = 0;; ++n) {
      const int slot = n % kTileRing;
      sm90::mbar_wait(&tile_full[slot], (n / kTileRing) & 1);
      const GemmTile tile = ring[slot];
      sm90::mbar_arrive(&tile_empty[slot]);
      if (tile.e < 0) break;
      float acc[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      int prev_stage = -1;
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % S;
        sm90::mbar_wait(&full[s], (it / S) & 1);
        if constexpr (GATHER) sm90::fence_proxy_async_shared();  // cp.async (generic proxy) -> wgmma
        const uint32_t a_addr = sm90::smem_addr(smem_a + s * Smem::kABytes + cw * 64 * 128);
        const uint32_t b_addr = sm90::smem_addr(smem_b + s * Smem::kBBytes);
        sm90::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kGemmBK / 16; ++ks) {
          sm90::wgmma_bf16<BN, 0>(acc, sm90::smem_desc_kmajor_sw128(a_addr + ks * 32),
                                  sm90::smem_desc_kmajor_sw128(b_addr + ks * 32), 1);
        }
        sm90::wgmma_commit();
        // Keep this stage's group in flight; the previous one is done after wait<1>.
        sm90::wgmma_wait<1>();
        sm90::fence_accumulators(acc);
        if (prev_stage >= 0 && tid == 0) sm90::mbar_arrive(&empty[prev_stage]);
        prev_stage = s;
      }
      sm90::wgmma_wait<0>();
      sm90::fence_accumulators(acc);
      if (prev_stage >= 0 && tid == 0) sm90::mbar_arrive(&empty[prev_stage]);
      gemm_epilogue<BN, EPI>(p, tile, cw, acc);
    }
  }
}

}  // namespace machmoe::kernels
