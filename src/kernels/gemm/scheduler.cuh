// The persistent grouped GEMMs' static tile schedule. Tiles: 128 rows of one expert x BN columns;
// an expert's last tile is predicated (no expert is padded to the tile), empty experts have no
// tiles. Tile t of the whole problem is found by a binary search over tile_offsets [E+1] (the
// prefix of per-expert tile counts; up to kGemmSmemTileE experts each kernel builds it in shared
// memory itself), so every CTA walks the same static schedule t = blockIdx.x, blockIdx.x +
// gridDim.x, ... with no atomics: deterministic.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/gemm/params.cuh"

namespace machmoe::kernels {

// Expert of tile t: the largest e with tile_offsets[e] <= t (empty experts share an offset).
// tile_offsets is the kernel's shared-memory table (E <= kGemmSmemTileE) or the global one.
__device__ __forceinline__ int gemm_tile_expert(const int32_t* tile_offsets, int E, int t) {
  int lo = 0, hi = E;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_offsets[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Tiles of expert e, rows [begins[e], ends[e]): ceil(rows_e / BM) row blocks x n_tiles column
// blocks (both tile-offset builders).
__device__ __forceinline__ int gemm_expert_tiles(const int32_t* begins, const int32_t* ends, int e, int n_tiles) {
  return (__ldg(ends + e) - __ldg(begins + e) + kGemmBM - 1) / kGemmBM * n_tiles;
}

// tile_offsets[e] = Σ_{e' < e} ceil(rows_e' / BM) · n_tiles for E <= kGemmSmemTileE, by one warp:
// lane l owns experts 16l .. 16l + 15.
__device__ __forceinline__ void gemm_tile_offsets_warp(const GroupedGemmParams& p, int32_t* out) {
  constexpr int kPer = kGemmSmemTileE / 32;
  const int lane = threadIdx.x % 32;
  int tiles[kPer], sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane * kPer + i;
    tiles[i] = e < p.E ? gemm_expert_tiles(p.expert_offsets, p.expert_ends, e, p.n_tiles) : 0;
    sum += tiles[i];
  }
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  int run = incl - sum;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane * kPer + i;
    if (e < p.E) out[e] = run;
    run += tiles[i];
  }
  if (lane == 31) out[p.E] = incl;
}

// Tiles of one expert are visited in groups of kGemmGroupM row blocks, column block outer inside a
// group, so that the CTAs running at the same time share both their A rows and their B columns
// in L2 (a plain row-major walk streams all of B once per wave of CTAs).
constexpr int kGemmGroupM = 8;
// The dH kernels (both forms) go in groups of 4 (on an H100, 2026-11, machmoe.bench configs: 7B-a
// dH +1.5%, 30B-b +1.9%, 120B-c +0.4%, the same at 30B-a and 120B-b); groups of 4 for every kernel
// cost the 30B-b up-projection 1.7%, so the others keep 8.
constexpr int kDactGroupM = 4;

// The tile-offset table the kernel reads: its own in shared memory, or the global one (E > kCap:
// kGemmSmemTileE, or a smaller table where shared memory is short; the host builds the global one
// for the same E).
template <int kCap = kGemmSmemTileE>
__device__ __forceinline__ const int32_t* gemm_tile_table(const GroupedGemmParams& p, const int32_t* smem_table) {
  static_assert(kCap <= kGemmSmemTileE, "gemm_tile_offsets_warp covers kGemmSmemTileE experts");
  return p.E <= kCap ? smem_table : p.tile_offsets;
}

// Tile t of the schedule; kGroupM: row blocks per group (kGemmGroupM above).
template <int kGroupM = kGemmGroupM>
__device__ __forceinline__ GemmTile gemm_decode_tile(const GroupedGemmParams& p, const int32_t* tile_offsets, int t,
                                                    int bn_cols) {
  GemmTile tile;
  tile.e = gemm_tile_expert(tile_offsets, p.E, t);
  const int local = t - tile_offsets[tile.e];
  const int begin = __ldg(p.expert_offsets + tile.e), end = __ldg(p.expert_ends + tile.e);
  const int m_tiles = (end - begin + kGemmBM - 1) / kGemmBM;
  const int group = local / (kGroupM * p.n_tiles);
  const int first_m = group * kGroupM;
  const int group_m = min(kGroupM, m_tiles - first_m);
  const int within = local - group * kGroupM * p.n_tiles;
  const int m_blk = first_m + within % group_m, n_blk = within / group_m;
  tile.row0 = begin + m_blk * kGemmBM;
  tile.rows = min(kGemmBM, end - tile.row0);
  tile.n0 = n_blk * bn_cols;
  return tile;
}

}  // namespace machmoe::kernels
