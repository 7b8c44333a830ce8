// Routing metadata. From R routed pairs (expert id per pair, and the
// token per pair or p / K for top-K) it builds, with no host synchronisation and no sort:
//   expert_offsets [E+1]  rows of expert e are [off[e], off[e+1])
//   row_token [R]         gather index: row -> token
//   row_pair [R]          row -> pair
//   pair_row [R]          reverse index: pair -> row (-1 for an invalid pair)
//   token_offsets [T+1]   pairs of token t are [off[t], off[t+1]) (pairs are ordered by token)
// Rows are grouped by expert and keep token order inside an expert, exactly like the reference.
// A repeated (token, expert) pair is one bit, hence one row, shared by the repeats; that row's
// row_pair is the lowest of their pair indices (atomicMin: deterministic).
//
// Method: a bit matrix B [E, W] (W = ceil(T/32) words) marks which tokens chose each expert. A
// row's position inside its expert is then the number of set bits before its token: a per-expert
// prefix sum of popcounts, which is deterministic, stable by construction and needs no sort.
// Token rounding (token_rounding.cuh) reads B afterwards, so both paths leave all of it written.
//
// Top-K lists (pair_token null), tiled: a tile is 32*G consecutive tokens (G words of every B row)
// and its 32*G*K consecutive pairs. Three kernels, no memset and no global atomics:
//   1. metadata_topk_mark:  block per tile: bits in shared memory (atomicOr there), then it writes
//                           its G columns of B (every word of B is written), the tile's per-expert
//                           counts C [tiles, E], a duplicate flag per tile and token_offsets.
//   2. metadata_topk_scan:  block per 32 experts: C becomes its exclusive prefix over tiles (in
//                           place) and the per-expert totals; block 0 ORs the duplicate flags.
//   3. metadata_topk_place: block per tile: expert_offsets (every block scans the E totals; block
//                           0 stores them), the tile's bits from B, each pair's row (pair_row is
//                           written in pair order), then row_token/row_pair in row order through a
//                           shared-memory slot map, so those writes come in runs of consecutive rows.
// General lists (pair_token given), or a tile that does not fit in shared memory:
//   1. metadata_mark:  after a memset of B, one thread per pair sets its bit with a global atomicOr
//                      (the result is order-free) and clears row_pair for the atomicMin below.
//   2. metadata_scan:  one block per expert scans its W popcounts; the last block to finish turns
//                      the per-expert totals into expert_offsets.
//   3. metadata_place: one thread per pair computes its row and writes the three row indices.
#pragma once

#include <cuda_pipeline_primitives.h>

#include "kernels/common.cuh"

namespace machmoe::kernels {

struct MetadataParams {
  const int32_t* pair_expert;  // [R]
  const int32_t* pair_token;   // [R], or null for top-K lists (token of pair p = p / K)
  int64_t R, T;
  int E, K;
  int W;                        // words per expert row of the bit matrix, ceil(T / 32)
  uint32_t* bits;               // [E, W]; zeroed before metadata_mark (general path)
  int32_t* word_prefix;         // [E, W] set bits of expert e before word w (general path)
  int32_t* expert_total;        // [E]
  uint32_t* done_counter;       // [1], zero on entry; the last scan block resets it (general path)
  uint32_t* duplicate_flag;     // [1] workspace flag, set to 1 when a (token, expert) pair repeats
  int32_t* duplicate_out;       // [1] out.duplicate_flag, or null
  int32_t* expert_offsets;      // [E+1]
  int32_t* row_token;           // [R]
  int32_t* row_pair;            // [R]
  int32_t* pair_row;            // [R]
  int32_t* token_offsets;       // [T+1] or null
  // Tiled top-K path only.
  int num_tiles;                // ceil(W / G)
  int32_t* tile_counts;         // [num_tiles, E]: counts, then their exclusive prefix over tiles
  int32_t* tile_dup;            // [num_tiles] 1 if the tile holds a repeated (token, expert) pair
  bool experts_aligned16;       // pair_expert is 16-byte aligned (vector copies into the tile)
};

__device__ __forceinline__ int64_t metadata_token(const MetadataParams& p, int64_t i) {
  return p.pair_token ? p.pair_token[i] : i / p.K;
}

__device__ __forceinline__ bool metadata_valid(const MetadataParams& p, int64_t t, int e) {
  return e >= 0 && e < p.E && t >= 0 && t < p.T;
}

// ------------------------------------------------------------------ general path

__global__ void metadata_mark(MetadataParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.R;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Rows number at most R: every row_pair slot starts as 0xffffffff (-1) for the atomicMin.
    reinterpret_cast<uint32_t*>(p.row_pair)[i] = 0xffffffffu;
    const int e = p.pair_expert[i];
    const int64_t t = metadata_token(p, i);
    if (!metadata_valid(p, t, e)) continue;  // documented: an invalid pair gets no row
    const uint32_t bit = 1u << (t % 32);
    const uint32_t old = atomicOr(&p.bits[static_cast<int64_t>(e) * p.W + t / 32], bit);
    if (old & bit) *p.duplicate_flag = 1u;
  }
}

// Block e scans expert e's W words in chunks of blockDim.x.
__global__ void __launch_bounds__(512) metadata_scan(MetadataParams p) {
  __shared__ int smem[32];
  __shared__ bool is_last;
  const int e = blockIdx.x;
  const uint32_t* row = p.bits + static_cast<int64_t>(e) * p.W;
  int32_t* prefix = p.word_prefix + static_cast<int64_t>(e) * p.W;
  int carry = 0;
  for (int base = 0; base < p.W; base += blockDim.x) {
    const int w = base + threadIdx.x;
    const int c = w < p.W ? __popc(row[w]) : 0;
    int total;
    const int excl = block_exclusive_scan(c, smem, &total);
    if (w < p.W) prefix[w] = carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) {
    p.expert_total[e] = carry;
    __threadfence();  // publish the total before counting this block as done
    is_last = atomicAdd(p.done_counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  // The last block: expert_offsets = exclusive scan of the totals (read through L2, not L1).
  __threadfence();
  int carry_e = 0;
  for (int base = 0; base < p.E; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int c = i < p.E ? __ldcg(p.expert_total + i) : 0;
    int total;
    const int excl = block_exclusive_scan(c, smem, &total);
    if (i < p.E) p.expert_offsets[i] = carry_e + excl;
    carry_e += total;
  }
  if (threadIdx.x == 0) {
    p.expert_offsets[p.E] = carry_e;
    *p.done_counter = 0u;  // ready for the next call (and for graph replays)
  }
}

__global__ void metadata_place(MetadataParams p) {
  // Runs after metadata_mark: the workspace flag is final (this replaces a memcpy node).
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.duplicate_out)
    *p.duplicate_out = static_cast<int32_t>(*p.duplicate_flag);
  const int64_t n = p.R > p.T + 1 ? p.R : p.T + 1;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < p.R) {
      const int e = p.pair_expert[i];
      const int64_t t = metadata_token(p, i);
      if (metadata_valid(p, t, e)) {
        const int64_t w = static_cast<int64_t>(e) * p.W + t / 32;
        const uint32_t below = p.bits[w] & ((1u << (t % 32)) - 1u);
        const int row = p.expert_offsets[e] + p.word_prefix[w] + __popc(below);
        p.pair_row[i] = row;
        p.row_token[row] = static_cast<int32_t>(t);
        // Repeats share the row: the lowest pair index wins whatever the order of the writes.
        atomicMin(reinterpret_cast<uint32_t*>(p.row_pair) + row, static_cast<uint32_t>(i));
      } else {
        p.pair_row[i] = -1;
      }
    }
    if (p.token_offsets == nullptr) continue;
    if (!p.pair_token) {  // top-K: K pairs per token
      if (i <= p.T) p.token_offsets[i] = static_cast<int32_t>(i * p.K);
      continue;
    }
    // General list ordered by token: pair i opens tokens (token[i-1], token[i]]; the last pair
    // also closes the tokens after it. Clamped to [0, T] so a bad list cannot write out of range.
    if (i < p.R) {
      const int64_t t = p.pair_token[i];
      const int64_t t_prev = i > 0 ? p.pair_token[i - 1] : -1;
      for (int64_t tt = (t_prev + 1 > 0 ? t_prev + 1 : 0); tt <= t && tt <= p.T; ++tt)
        p.token_offsets[tt] = static_cast<int32_t>(i);
      if (i == p.R - 1)
        for (int64_t tt = (t + 1 > 0 ? t + 1 : 0); tt <= p.T; ++tt)
          p.token_offsets[tt] = static_cast<int32_t>(p.R);
    }
  }
}

// ------------------------------------------------------------------ tiled top-K path

constexpr int kTileThreads = 256;      // threads of metadata_topk_mark / metadata_topk_place
constexpr int kTileScanThreads = 1024; // metadata_topk_scan: 32 experts (lanes) x 32 tile segments

// Shared memory of a tile of G words (32*G tokens, n_max = 32*G*K pairs), in bytes. The launcher
// picks the largest G in {8, 4, 2, 1} whose place kernel fits (the mark kernel needs less).
//   mark:  experts [n_max] i32, words [E, G] u32
//   place: experts [n_max] i32, slot -> pair [n_max] u32, words [E, G] u32, row delta [E] i32,
//          slot base [E] i32, word prefix [E, G] u8
__host__ __device__ constexpr size_t topk_mark_smem(int64_t E, int G, int64_t K) {
  return 4 * (static_cast<size_t>(32 * G * K) + static_cast<size_t>(E * G));
}
__host__ __device__ constexpr size_t topk_place_smem(int64_t E, int G, int64_t K) {
  return 4 * (2 * static_cast<size_t>(32 * G * K) + static_cast<size_t>(E * G) + 2 * static_cast<size_t>(E)) +
         static_cast<size_t>(E * G);
}

struct TopkTile {
  int64_t t0;  // first token
  int64_t q0;  // first pair, t0 * K (a multiple of 4: 32*G*K is)
  int n;       // pairs in the tile: K * (tokens in the tile), the last tile may be short
};

template <int G>
__device__ __forceinline__ TopkTile topk_tile(const MetadataParams& p) {
  TopkTile tile;
  tile.t0 = static_cast<int64_t>(blockIdx.x) * (32 * G);
  const int64_t t1 = tile.t0 + 32 * G < p.T ? tile.t0 + 32 * G : p.T;
  tile.q0 = tile.t0 * p.K;
  tile.n = static_cast<int>((t1 - tile.t0) * p.K);
  return tile;
}

// Issues cp.async copies of the tile's n expert ids into s_exp (16-byte copies where aligned), so
// every load of the block is in flight at once; the caller commits and waits.
__device__ __forceinline__ void topk_stage_experts(const MetadataParams& p, const TopkTile& tile,
                                                   int32_t* s_exp) {
  const int32_t* src = p.pair_expert + tile.q0;
  for (int i = 4 * threadIdx.x; i < tile.n; i += 4 * blockDim.x) {
    if (p.experts_aligned16 && i + 4 <= tile.n) {
      __pipeline_memcpy_async(s_exp + i, src + i, 16);
    } else {
      for (int j = i; j < i + 4 && j < tile.n; ++j) __pipeline_memcpy_async(s_exp + j, src + j, 4);
    }
  }
}

template <int G>
__global__ void __launch_bounds__(kTileThreads) metadata_topk_mark(MetadataParams p) {
  extern __shared__ __align__(16) int32_t topk_mark_smem_raw[];
  const int E = p.E, K = p.K;
  int32_t* s_exp = topk_mark_smem_raw;                                     // [32*G*K]
  uint32_t* s_words = reinterpret_cast<uint32_t*>(s_exp + 32 * G * K);      // [E, G]
  const TopkTile tile = topk_tile<G>(p);
  topk_stage_experts(p, tile, s_exp);
  __pipeline_commit();
  for (int i = threadIdx.x; i < E * G; i += blockDim.x) s_words[i] = 0u;
  __pipeline_wait_prior(0);
  __syncthreads();
  int dup = 0;
  for (int i = threadIdx.x; i < tile.n; i += blockDim.x) {
    const int e = s_exp[i];
    if (e < 0 || e >= E) continue;  // an invalid expert gets no bit (and pair_row = -1)
    const int tl = i / K;           // token inside the tile, < 32*G
    const uint32_t bit = 1u << (tl & 31);
    if (atomicOr(&s_words[e * G + (tl >> 5)], bit) & bit) dup = 1;
  }
  dup = __syncthreads_or(dup);
  // B columns [w0, w0 + G) of every expert row: G consecutive words (G = 8: 32 bytes, one sector
  // when W is a multiple of 8, else two).
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * G;
  for (int i = threadIdx.x; i < E * G; i += blockDim.x) {
    const int e = i / G, g = i % G;
    if (w0 + g < p.W) p.bits[static_cast<int64_t>(e) * p.W + w0 + g] = s_words[i];
  }
  int32_t* counts = p.tile_counts + static_cast<int64_t>(blockIdx.x) * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int c = 0;
#pragma unroll
    for (int g = 0; g < G; ++g) c += __popc(s_words[e * G + g]);
    counts[e] = c;
  }
  if (threadIdx.x == 0) p.tile_dup[blockIdx.x] = dup;
  if (p.token_offsets) {  // K pairs per token
    const int tokens = tile.n / K;
    for (int j = threadIdx.x; j < tokens; j += blockDim.x)
      p.token_offsets[tile.t0 + j] = static_cast<int32_t>((tile.t0 + j) * K);
    if (tile.t0 + tokens == p.T && threadIdx.x == 0) p.token_offsets[p.T] = static_cast<int32_t>(p.T * K);
  }
}

// Block of 32 experts (lane) x 32 segments of tiles (warp): C [tiles, E] is read a row (128 bytes
// of the block's experts) at a time, summed per segment, and rewritten as the exclusive prefix.
__global__ void __launch_bounds__(kTileScanThreads) metadata_topk_scan(MetadataParams p) {
  __shared__ int partial[32][32];  // [segment][lane]
  const int lane = threadIdx.x % kWarpSize, seg = threadIdx.x / kWarpSize;
  const int E = p.E, e = blockIdx.x * kWarpSize + lane;
  const int rows = (p.num_tiles + 31) / 32;
  const int r0 = seg * rows, r1 = r0 + rows < p.num_tiles ? r0 + rows : p.num_tiles;
  int32_t* col = p.tile_counts + e;
  int sum = 0;
  if (e < E) {
#pragma unroll 4
    for (int r = r0; r < r1; ++r) sum += col[static_cast<int64_t>(r) * E];
  }
  partial[seg][lane] = sum;
  __syncthreads();
  int run = 0;
  for (int s = 0; s < seg; ++s) run += partial[s][lane];
  if (e < E) {
    for (int r = r0; r < r1; ++r) {  // the same lines again: L1 hits
      const int c = col[static_cast<int64_t>(r) * E];
      col[static_cast<int64_t>(r) * E] = run;
      run += c;
    }
    if (seg == 31) p.expert_total[e] = run;  // segment 31 ends at the last tile
  }
  if (blockIdx.x == 0) {  // the duplicate flag: OR over the tiles (no memset needed)
    int d = 0;
    for (int i = threadIdx.x; i < p.num_tiles; i += blockDim.x) d |= p.tile_dup[i];
    d = __syncthreads_or(d);
    if (threadIdx.x == 0 && p.duplicate_out) *p.duplicate_out = d ? 1 : 0;
  }
}

// Exclusive block-wide prefix sums of two ints per thread at once (one set of barriers).
__device__ __forceinline__ int2 block_exclusive_scan2(int2 v, int2* smem /*[32]*/, int2* total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int2 incl = v;
#pragma unroll
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const int ox = __shfl_up_sync(kFullMask, incl.x, o), oy = __shfl_up_sync(kFullMask, incl.y, o);
    if (lane >= o) incl.x += ox, incl.y += oy;
  }
  if (lane == kWarpSize - 1) smem[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x / kWarpSize;
    int2 w = lane < nw ? smem[lane] : make_int2(0, 0);
#pragma unroll
    for (int o = 1; o < kWarpSize; o <<= 1) {
      const int ox = __shfl_up_sync(kFullMask, w.x, o), oy = __shfl_up_sync(kFullMask, w.y, o);
      if (lane >= o) w.x += ox, w.y += oy;
    }
    if (lane < nw) smem[lane] = w;  // inclusive prefix of warp sums
  }
  __syncthreads();
  const int2 base = warp > 0 ? smem[warp - 1] : make_int2(0, 0);
  *total = smem[blockDim.x / kWarpSize - 1];
  __syncthreads();  // smem may be reused by the caller's next scan
  return make_int2(base.x + incl.x - v.x, base.y + incl.y - v.y);
}

// Row of the pair (token t0 + tl, expert e) = off[e] + C_excl[tile, e] + (bits of e in the tile
// before tl). In slot space (the tile's rows ordered by expert, then token) it is
// slot = lbase[e] + (bits before tl), and row = slot + delta[e], delta = off + C_excl - lbase.
template <int G>
__global__ void __launch_bounds__(kTileThreads) metadata_topk_place(MetadataParams p) {
  extern __shared__ __align__(16) int32_t topk_place_smem_raw[];
  __shared__ int2 s_scan[32];
  const int E = p.E, K = p.K, n_max = 32 * G * K;
  int32_t* s_exp = topk_place_smem_raw;                                       // [n_max]
  uint32_t* s_slot = reinterpret_cast<uint32_t*>(s_exp + n_max);               // [n_max]
  uint32_t* s_words = s_slot + n_max;                                          // [E, G]
  int32_t* s_delta = reinterpret_cast<int32_t*>(s_words + E * G);              // [E]
  int32_t* s_lbase = s_delta + E;                                              // [E]
  uint8_t* s_wpre = reinterpret_cast<uint8_t*>(s_lbase + E);                   // [E, G]
  const TopkTile tile = topk_tile<G>(p);
  // 1. Stage the tile's experts, its G columns of B, the E totals and the tile's C_excl row.
  topk_stage_experts(p, tile, s_exp);
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * G;
  for (int i = threadIdx.x; i < E * G; i += blockDim.x) {
    const int e = i / G, g = i % G;
    if (w0 + g < p.W) __pipeline_memcpy_async(s_words + i, p.bits + static_cast<int64_t>(e) * p.W + w0 + g, 4);
    else s_words[i] = 0u;  // past the last word of a short last tile
  }
  const int32_t* excl = p.tile_counts + static_cast<int64_t>(blockIdx.x) * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    __pipeline_memcpy_async(s_lbase + e, p.expert_total + e, 4);  // totals until step 2
    __pipeline_memcpy_async(s_delta + e, excl + e, 4);
  }
  __pipeline_commit();
  for (int i = threadIdx.x; i < tile.n; i += blockDim.x) s_slot[i] = 0xffffffffu;
  __pipeline_wait_prior(0);
  __syncthreads();
  // 2. Per expert: expert offset (scan of totals), tile count and word prefixes (scan -> lbase).
  int2 carry = make_int2(0, 0);
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    int2 v = make_int2(0, 0);
    if (e < E) {
      v.x = s_lbase[e];
#pragma unroll
      for (int g = 0; g < G; ++g) {  // prefix before word g < 7 * 32 = 224: fits a byte
        s_wpre[e * G + g] = static_cast<uint8_t>(v.y);
        v.y += __popc(s_words[e * G + g]);
      }
    }
    int2 total;
    const int2 ex = block_exclusive_scan2(v, s_scan, &total);
    if (e < E) {
      const int off = carry.x + ex.x, lbase = carry.y + ex.y;
      if (blockIdx.x == 0) p.expert_offsets[e] = off;
      s_lbase[e] = lbase;
      s_delta[e] += off - lbase;
    }
    carry.x += total.x;
    carry.y += total.y;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.expert_offsets[E] = carry.x;
  const int slots = carry.y;  // set bits in the tile = its rows
  __syncthreads();
  // 3. Each pair's row; pair_row in pair order (coalesced), slot -> lowest pair for step 4.
  int32_t* pair_row = p.pair_row + tile.q0;
  for (int i = threadIdx.x; i < tile.n; i += blockDim.x) {
    const int e = s_exp[i];
    int row = -1;
    if (e >= 0 && e < E) {
      const int tl = i / K, k = e * G + (tl >> 5);
      const int slot = s_lbase[e] + s_wpre[k] + __popc(s_words[k] & ((1u << (tl & 31)) - 1u));
      row = s_delta[e] + slot;
      atomicMin(s_slot + slot, static_cast<uint32_t>(i));  // repeats share the slot: lowest pair
    }
    pair_row[i] = row;
  }
  __syncthreads();
  // 4. The tile's rows in slot order: consecutive slots of an expert are consecutive rows, so
  // row_token/row_pair are written in runs (about 32*G*K/E rows per expert and tile).
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int i = static_cast<int>(s_slot[s]);  // every slot has a pair: a set bit came from one
    const int row = s_delta[s_exp[i]] + s;
    p.row_token[row] = static_cast<int32_t>(tile.t0 + i / K);
    p.row_pair[row] = static_cast<int32_t>(tile.q0 + i);
  }
}

}  // namespace machmoe::kernels
