// The grouped GEMM engine's epilogue (gemm/cooperative.cuh), split in two so that it overlaps the
// next tile's main loop:
//   1. the consumer warpgroups stage their fp32 accumulators (+ bias) out to shared memory as the
//      bf16 H tile (a few hundred cycles), then go straight back to the tensor cores;
//   2. the three epilogue warps of the producer warpgroup read that tile, compute the activation
//      from the bf16-rounded H (what the backward will recompute), and write H and A (or Y) to
//      global memory in 16-byte stores, predicated on the expert's last row.
// Device functions only; included by gemm/cooperative.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cassert>

#include "kernels/common.cuh"
#include "kernels/gemm/params.cuh"
#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

// The activation as a compile-time choice (one instantiation per activation, picked by a switch
// per tile). Fast intrinsics: the result is rounded to bf16 anyway.
template <int ACT>
__device__ __forceinline__ float gemm_act(float h) {
  if constexpr (ACT == kActSwiGLU || ACT == kActSiLU) {
    return h * sigmoid_approx(h);
  } else if constexpr (ACT == kActGeGLU || ACT == kActGELU) {
    const float u = 0.7978845608028654f * (h + 0.044715f * h * h * h);
    return 0.5f * h * (1.f + tanhf(u));
  } else if constexpr (ACT == kActReGLU || ACT == kActReLU) {
    return fmaxf(h, 0.f);
  } else {
    static_assert(ACT == kActReLU2, "the clamped SwiGLU is computed by gemm_glu");
    return h > 0.f ? h * h : 0.f;
  }
}

// The clamped SwiGLU's parts for a gate g and an up u (GroupedGemmParams' clamp_* fields):
// gc = min(g, gate_limit), sig = σ(alpha·gc), f = min(gc·sig, act_limit), uc = clamp(u, ±up_limit)
// + up_offset; A = f·uc. The forward epilogues and the dH epilogue's recomputation share it, so
// the backward's A is bitwise the forward's.
struct ClampedSwiGLUParts {
  float gc, sig, f, uc;
};
__device__ __forceinline__ ClampedSwiGLUParts clamped_swiglu_parts(const GroupedGemmParams& p, float g, float u) {
  ClampedSwiGLUParts c;
  c.gc = fminf(g, p.clamp_gate_limit);
  c.sig = sigmoid_approx(p.clamp_alpha * c.gc);
  c.f = fminf(c.gc * c.sig, p.clamp_act_limit);
  c.uc = fminf(fmaxf(u, -p.clamp_up_limit), p.clamp_up_limit) + p.clamp_up_offset;
  return c;
}

// One GLU output A = f(gate)·up from H's bf16 gate and up; the clamped SwiGLU reads its
// parameters from p. (The bf16 values are converted inside, gate first, so that the other
// activations' SASS is what it was before this function existed.)
template <int ACT>
__device__ __forceinline__ float gemm_glu(const GroupedGemmParams& p, __nv_bfloat16 g, __nv_bfloat16 u) {
  if constexpr (ACT == kActClampedSwiGLU) {
    const ClampedSwiGLUParts c = clamped_swiglu_parts(p, __bfloat162float(g), __bfloat162float(u));
    return c.f * c.uc;
  } else {
    return gemm_act<ACT>(__bfloat162float(g)) * __bfloat162float(u);
  }
}

// The runtime activation code p.act as a compile-time one: calls f(GemmActTag<ACT>{}) for the
// GLU activations (kGlu) or the others, so that every epilogue instantiates its per-element work
// once per activation from one switch (ACT = decltype(tag)::value).
template <int ACT>
struct GemmActTag {
  static constexpr int value = ACT;
};
template <bool kGlu, class F>
__device__ __forceinline__ decltype(auto) gemm_act_dispatch(int act, F&& f) {
  if constexpr (kGlu) {
    switch (act) {
      case kActGeGLU: return f(GemmActTag<kActGeGLU>{});
      case kActReGLU: return f(GemmActTag<kActReGLU>{});
      case kActClampedSwiGLU: return f(GemmActTag<kActClampedSwiGLU>{});
      default: return f(GemmActTag<kActSwiGLU>{});
    }
  } else {
    switch (act) {
      case kActReLU2: return f(GemmActTag<kActReLU2>{});
      case kActReLU: return f(GemmActTag<kActReLU>{});
      case kActGELU: return f(GemmActTag<kActGELU>{});
      default: return f(GemmActTag<kActSiLU>{});
    }
  }
}

// Byte offset in the staged tile of row r, 16-byte chunk ch (8 columns) of the BN-wide row.
// Boxed tiles: boxes of kBoxRows rows (128; the ping-pong kernel stages 64-row halves). kBoxed: the
// boxed layout for a tile that never leaves by TMA (the ping-pong dH kernel's dA': 16 bytes a row
// less than the padded one, which is what its fifth stage needs).
template <int BN, int EPI, int kBoxRows = 128, bool kBoxed = epi_boxed<EPI>()>
__device__ __forceinline__ int epi_chunk_offset(int r, int ch) {
  const unsigned ur = r, uc = ch;  // both >= 0: shifts and masks, not signed division
  if constexpr (kBoxed) return (uc / 8) * (kBoxRows * 128) + ur * 128 + (((uc % 8) ^ (ur % 8)) << 4);
  else return ur * epi_row_bytes<BN>() + uc * 16;
}

// Weight row (and bias index) of tile column c: plain/interleaved n0 + c; concatenated GLU:
// gate j0 + c for c < BN/2, up n + j0 + c - BN/2.
template <int BN, int EPI>
__device__ __forceinline__ int gemm_weight_col(const GroupedGemmParams& p, const GemmTile& t, int c) {
  if constexpr (EPI == kEpiGluConcat) return c < BN / 2 ? t.n0 + c : p.N / 2 + t.n0 + c - BN / 2;
  return t.n0 + c;
}

// Consumer side: accumulator fragment (+ bias) -> bf16 tile in shared memory. Fragment layout of
// wgmma m64nBN: register 4·jj + 2·half + i holds row (warp·16 + lane/4 + 8·half) of the
// warpgroup's 64, column 8·jj + 2·(lane % 4) + i. That is the layout stmatrix takes: one
// stmatrix.x4 per two 8-column chunks stores the warp's 16 rows of both (matrices: rows 0-7 and
// 8-15 of chunk jj, then of chunk jj + 1), 16 instructions at BN = 256 instead of 64 4-byte
// st.shared, with fewer address computations. Measured on an H100: dX~ +1% (7B-a) and +2%
// (30B-b), the other kernels within noise; the shared-memory bytes, not the instructions, bound
// the staging.
// cw: which 64 rows of the staged tile (the warpgroup's half of a cooperative tile; 0 with
// kBoxRows = 64, where `epi` holds one 64-row half). kBoxed: as epi_chunk_offset.
template <int BN, int EPI, int kBoxRows = 128, bool kBoxed = epi_boxed<EPI>()>
__device__ __forceinline__ void gemm_stage_out(const GroupedGemmParams& p, const GemmTile& tile, int cw,
                                               const float (&acc)[BN / 2], uint8_t* epi) {
  static_assert(BN % 16 == 0, "pairs of 8-column chunks");
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  // The row and chunk this lane addresses for stmatrix: row lane % 8 of matrix lane / 8.
  const int srow = cw * 64 + warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
  const int schunk = lane / 16;
  const uint32_t base = sm90::smem_addr(epi);
  const __nv_bfloat16* bias = p.bias ? p.bias + static_cast<int64_t>(tile.e) * p.N : nullptr;
#pragma unroll
  for (int jj = 0; jj < BN / 8; jj += 2) {
    uint32_t v[4];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int c = (jj + q) * 8 + 2 * (lane % 4);
      float b0 = 0.f, b1 = 0.f;
      if (bias) {
        const int wc = gemm_weight_col<BN, EPI>(p, tile, c);
        if (wc < p.N) {
          b0 = __bfloat162float(bias[wc]);
          b1 = __bfloat162float(bias[wc + 1]);
        }
      }
      const float* a = acc + (jj + q) * 4;
      v[2 * q] = pack_bf16x2(a[0] + b0, a[1] + b1);      // rows 0-7 of the warp's 16
      v[2 * q + 1] = pack_bf16x2(a[2] + b0, a[3] + b1);  // rows 8-15
    }
    sm90::stmatrix_x4(base + epi_chunk_offset<BN, EPI, kBoxRows, kBoxed>(srow, jj + schunk), v[0], v[1], v[2], v[3]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_bf16(T* dst, const float (&v)[N]) {
  static_assert(N == 4 || N == 8, "4 or 8 values");
  __nv_bfloat162 o[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) o[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  if constexpr (N == 8) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(o);
  else *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(o);
}

template <int BN, int EPI>
constexpr int epi_chunks_per_row() { return EPI == kEpiGluConcat ? BN / 16 : BN / 8; }

__device__ __forceinline__ int gemm_epi_items_of(const GemmTile& tile, int chunks_per_row) {
  return tile.rows * chunks_per_row;
}

// The staged tile -> global H/C and/or A. Work items are (row, 8-column chunk), consecutive
// threads on consecutive chunks of a row, so the stores coalesce. A thread handles items
// next, next + stride, ... below `end` and stops after `budget` of them; it returns the item to
// resume from (>= end when it is done), so the work can be done in slices between other work.
// Two parts, run by different threads: write_h stores C/H (the epilogue threads, for tiles that
// did not leave by TMA), write_a computes and stores the activation output A (the consumer
// warpgroups, each over its own 64 rows, under the next tile's wgmmas; the interleaved GLU's A
// goes through gemm_write_a_glu_pairs instead).
// kBoxRows: the staged tile's box height (epi_chunk_offset; 64 for the ping-pong kernel's halves).
template <int BN, int EPI, int ACT, int kBoxRows = 128>
__device__ __forceinline__ int gemm_write_out_act(const GroupedGemmParams& p, const GemmTile& tile,
                                                  const uint8_t* epi, int next, int end, int stride, int budget,
                                                  bool write_h, bool write_a) {
  constexpr int kChunks = epi_chunks_per_row<BN, EPI>();
  write_h = write_h && p.c;  // null c: inference, H is not written
  for (; next < end && budget > 0; next += stride, --budget) {
    // (next >= 0: unsigned division by the constant kChunks, a shift and a mask where it is a power of two)
    const int r = static_cast<unsigned>(next) / kChunks, ch = static_cast<unsigned>(next) % kChunks;
    const int64_t row = tile.row0 + r;
    const uint8_t* src = epi + epi_chunk_offset<BN, EPI, kBoxRows>(r, ch);
    if constexpr (EPI == kEpiGluConcat) {
      const int n = p.N / 2, j = tile.n0 + ch * 8;
      if (j >= n) continue;
      const uint4 graw = *reinterpret_cast<const uint4*>(src);
      const uint4 uraw = *reinterpret_cast<const uint4*>(src + BN);  // up half: BN/2 columns later
      if (write_h) {
        *reinterpret_cast<uint4*>(p.c + row * p.ldc + j) = graw;
        *reinterpret_cast<uint4*>(p.c + row * p.ldc + n + j) = uraw;
      }
      if (write_a) {
        const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&graw);
        const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&uraw);
        float a[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = gemm_glu<ACT>(p, g[i], u[i]);
        store_bf16(p.c2 + row * p.ldc2 + j, a);
      }
    } else {
      const int col = tile.n0 + ch * 8;
      if (col >= p.N) continue;
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      if (write_h) *reinterpret_cast<uint4*>(p.c + row * p.ldc + col) = raw;
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
      // (the interleaved GLU's A: gemm_write_a_glu_pairs, 8 values per item)
      if constexpr (EPI == kEpiAct) {
        if (write_a) {
          float a[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) a[i] = gemm_act<ACT>(__bfloat162float(h[i]));
          store_bf16(p.c2 + row * p.ldc2 + col, a);
        }
      }
    }
  }
  return next;
}

// The interleaved GLU's activation output A from the staged H tile (boxed, 128 rows), 8 A values
// (two 8-column chunks of H) per item and one 16-byte store each: half the items, address
// computations and stores of gemm_write_out_act's 4-value items. Items q (from row_base · BN/16,
// row_base the warpgroup's first staged row, even) walk pairs of staged rows: lane bits 0-1 pick
// the chunk pair within a 64-column box, bit 2 the row of the pair, the next bits the box, the
// rest the row pair, so that each group of 8 lanes (one shared-memory wavefront of a 16-byte
// load) reads two rows of different swizzle parity: 8 distinct 16-byte slots, no bank conflict.
// Four lanes store 64 contiguous bytes of A (whole sectors). Rows at or past row_end are skipped
// (an odd count leaves half a pair).
template <int BN, int ACT>
__device__ __forceinline__ int gemm_write_a_glu_pairs(const GroupedGemmParams& p, const GemmTile& tile,
                                                      const uint8_t* epi, int next, int end, int stride, int budget,
                                                      int row_end) {
  constexpr unsigned kBoxes = BN / 64;
  for (; next < end && budget > 0; next += stride, --budget) {
    const unsigned q = next;  // >= 0: shifts and masks
    const unsigned box = (q / 8) % kBoxes;
    const int r = 2 * (q / (8 * kBoxes)) + (q / 4) % 2;
    const unsigned ch = 8 * box + 2 * (q % 4);  // the pair's first chunk (8 H columns)
    const int col = tile.n0 + 8 * ch;           // its first H column; N % 16 == 0: the pair is in or out
    if (r >= row_end || col >= p.N) continue;
    const uint4 raw0 = *reinterpret_cast<const uint4*>(epi + epi_chunk_offset<BN, kEpiGluInter>(r, ch));
    const uint4 raw1 = *reinterpret_cast<const uint4*>(epi + epi_chunk_offset<BN, kEpiGluInter>(r, ch + 1));
    const __nv_bfloat16* h0 = reinterpret_cast<const __nv_bfloat16*>(&raw0);
    const __nv_bfloat16* h1 = reinterpret_cast<const __nv_bfloat16*>(&raw1);
    float a[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = gemm_glu<ACT>(p, h0[2 * i], h0[2 * i + 1]);
      a[4 + i] = gemm_glu<ACT>(p, h1[2 * i], h1[2 * i + 1]);
    }
    store_bf16(p.c2 + static_cast<int64_t>(tile.row0 + r) * p.ldc2 + col / 2, a);
  }
  return next;
}

template <int BN>
__device__ __forceinline__ int gemm_write_a_glu_inter(const GroupedGemmParams& p, const GemmTile& tile, const uint8_t* epi,
                                                      int next, int end, int stride, int budget, int row_end) {
  return gemm_act_dispatch<true>(p.act, [&](auto act) {
    return gemm_write_a_glu_pairs<BN, decltype(act)::value>(p, tile, epi, next, end, stride, budget, row_end);
  });
}

template <int BN, int EPI, int kBoxRows = 128>
__device__ __forceinline__ int gemm_write_out(const GroupedGemmParams& p, const GemmTile& tile, const uint8_t* epi,
                                              int next, int end, int stride, int budget, bool write_h, bool write_a) {
  static_assert(kBoxRows == 128 || EPI == kEpiStore, "64-row boxes: the plain store only");
  if constexpr (EPI == kEpiStore || EPI == kEpiGluInter) {
    // No activation here: the plain store has none, and the interleaved GLU's A is written by
    // gemm_write_a_glu_inter (this path stores its H only, the same for every activation).
    assert(EPI == kEpiStore || !write_a);
    return gemm_write_out_act<BN, EPI, kActSwiGLU, kBoxRows>(p, tile, epi, next, end, stride, budget, write_h, false);
  } else {  // the concatenated GLU or an activation
    return gemm_act_dispatch<EPI == kEpiGluConcat>(p.act, [&](auto act) {
      return gemm_write_out_act<BN, EPI, decltype(act)::value>(p, tile, epi, next, end, stride, budget, write_h, write_a);
    });
  }
}

}  // namespace machmoe::kernels
