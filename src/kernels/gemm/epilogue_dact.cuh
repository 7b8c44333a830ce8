// The dH epilogue of the grouped GEMM engine (docs/BACKWARD.md): the engine
// computes dA'_r = dout_{tok(r)} · W2_e (fp32, staged to shared memory as bf16 like every tile),
// and the consumer warpgroups themselves finish the backward of the activation per routed row r
// with score s_r, each on its own 64 staged rows while the next tile's wgmmas run:
//   A_r  = act(H_r)                  recomputed from the saved bf16 H (bitwise the forward's A)
//   dS_r = Σ_j dA'_rj · A_rj          written per 128 columns (ds_partial [R, ceil(n/128)], fp32):
//                                    no atomics, the tiles are added in order afterwards
//   dA   = s_r · dA'_r
//   dH_r = dA ⊙ act'(H_r)            GLU: d gate = dA·f'(g)·u, d up = dA·f(g), in H's layout
//   A'_r = s_r · A_r                 the dW2 GEMM's operand (bf16 [R, n])
// Work items are (row, 16 columns of dA'); a row's items are lanes of one warp (BN/16 = 16 or 8
// of them), so the row's dS partial is a shuffle reduction (DactPipe). Device functions only;
// included by gemm/cooperative.cuh.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"
#include "kernels/gemm/epilogue.cuh"

namespace machmoe::kernels {

// act(h) exactly as the forward epilogue computes it, and act'(h).
template <int ACT>
__device__ __forceinline__ float gemm_act_grad(float h, float& f) {
  if constexpr (ACT == kActSwiGLU || ACT == kActSiLU) {
    const float sig = sigmoid_approx(h);
    f = h * sig;  // gemm_act<ACT>(h), bit for bit, with one sigmoid for both
    return sig * (1.f + h * (1.f - sig));
  } else {
    f = gemm_act<ACT>(h);
    if constexpr (ACT == kActGeGLU || ACT == kActGELU) {
      constexpr float c = 0.7978845608028654f;
      const float th = tanhf(c * (h + 0.044715f * h * h * h));
      return 0.5f * (1.f + th) + 0.5f * h * (1.f - th * th) * c * (1.f + 3.f * 0.044715f * h * h);
    } else if constexpr (ACT == kActReGLU || ACT == kActReLU) {
      return h > 0.f ? 1.f : 0.f;
    } else {  // ReLU²
      return h > 0.f ? 2.f * h : 0.f;
    }
  }
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One element of the dH epilogue: from H's gate g (the activation's input) and up (1 without a
// GLU), the bf16-rounded dA' `da` and the row's score s: adds da·A to the row's dS, and gives
// A' = s·A and the gradients of gate (or of the activation's input) and of up.
// The clamped SwiGLU (p's clamp_* fields, epilogue.cuh) passes a gradient where its clamps do
// not bind, as torch.clamp does (bounds included): d gate = dA·[g <= gate_limit]·[gc·sig <=
// act_limit]·sig·(1 + alpha·gc·(1 - sig))·uc, d up = dA·[|u| <= up_limit]·f.
template <int ACT, bool kGlu>
__device__ __forceinline__ void dact_element(const GroupedGemmParams& p, float g, float up, float da, float s,
                                             float& ds, float& a_scaled, float& d_gate, float& d_up) {
  if constexpr (ACT == kActClampedSwiGLU) {
    static_assert(kGlu, "a GLU activation");
    const ClampedSwiGLUParts c = clamped_swiglu_parts(p, g, up);
    const float a = round_bf16(c.f * c.uc);
    ds += da * a;
    const float dd = s * da;
    a_scaled = s * a;
    const bool gate_passes = g <= p.clamp_gate_limit && c.gc * c.sig <= p.clamp_act_limit;
    const bool up_passes = fabsf(up) <= p.clamp_up_limit;
    const float df = c.sig * (1.f + p.clamp_alpha * c.gc * (1.f - c.sig));
    d_gate = gate_passes ? dd * df * c.uc : 0.f;
    d_up = up_passes ? dd * c.f : 0.f;
  } else {
    float f;
    const float df = gemm_act_grad<ACT>(g, f);
    const float a = round_bf16(kGlu ? f * up : f);
    ds += da * a;
    const float dd = s * da;
    a_scaled = s * a;
    d_gate = kGlu ? dd * df * up : dd * df;
    d_up = dd * f;
  }
}

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* src, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(b[i]);
}

// The consumer warpgroups run the dH epilogue themselves, each on its own 64 rows of the staged
// tile, in groups of this many items per thread, one group per K block of the next tile.
constexpr int kDactGroupConsumer = 1;

// The dH epilogue as a two-phase pipe, so that the loads of H overlap other work: load() issues
// the global loads of a group of G items (a thread's items next, next + stride, ...) into
// registers and returns at once; compute() (called later: the consumer warpgroups call it while
// their next K block's wgmmas run) finishes the group. An item is two 8-column chunks of dA', q
// and q + BN/16, of one row of the staged tile, so that the index arithmetic, the score and the
// row's dS reduction are paid once per 16 values, while each warp access stays as before: a row's
// BN/16 items are consecutive lanes, so lanes read and write consecutive chunks (whole 32-byte
// sectors for A', 8 distinct 16-byte slots per 8-lane wavefront of a shared load), first the
// row's left half, then its right half. Items are rows row_base + it / (BN/16); `items` =
// rows · kItemsPerRow, end_of(items) rounds it up to whole warps. The scores come from shared
// memory (`scale` [128], staged with the tile), so no load chain row -> pair -> score.
// Measured on an H100 against 8-column items in the same calls: dH +1-2% at 7B-a and 30B-b, +4-5%
// at 120B-c. (A 16-column form with lanes 32 bytes apart lost 2-5%.)
// kBoxed: the tile is staged in the boxed layout (epi_chunk_offset), as the ping-pong dH kernel
// stages it; else padded rows (epi_row_bytes), as the cooperative kernel does.
template <int BN, int EPI, int G, bool kBoxed = false>
struct DactPipe {
  static constexpr int kItemsPerRow = BN / 16;  // items of a row; its second chunks start BN/2 columns on
  static_assert(kItemsPerRow == 8 || kItemsPerRow == 16, "a row's items must tile a warp");
  uint4 h[G][4];

  __host__ __device__ static constexpr int end_of(int items) { return (items + 31) & ~31; }

  __device__ __forceinline__ void load(const GroupedGemmParams& p, const GemmTile& tile, int row_base, int items,
                                       int next, int stride) {
#pragma unroll
    for (int u = 0; u < G; ++u) {
      const int it = next + u * stride;
      const int r = row_base + it / kItemsPerRow, j = tile.n0 + (it % kItemsPerRow) * 8;
      const int j2 = j + BN / 2;  // the second chunk's first column
      if (it < items && j < p.N) {
        const bool two = j2 < p.N;
        const __nv_bfloat16* hrow = p.h + static_cast<int64_t>(tile.row0 + r) * p.ldh;
        if constexpr (EPI == kEpiDGluInter) {  // (gate, up) pairs at columns 2j .. 2j + 15, 2j2 ..
          h[u][0] = __ldg(reinterpret_cast<const uint4*>(hrow + 2 * j));
          h[u][1] = __ldg(reinterpret_cast<const uint4*>(hrow + 2 * j + 8));
          if (two) {
            h[u][2] = __ldg(reinterpret_cast<const uint4*>(hrow + 2 * j2));
            h[u][3] = __ldg(reinterpret_cast<const uint4*>(hrow + 2 * j2 + 8));
          }
        } else if constexpr (EPI == kEpiDGluConcat) {  // gate at j, up at n + j
          h[u][0] = __ldg(reinterpret_cast<const uint4*>(hrow + j));
          h[u][2] = __ldg(reinterpret_cast<const uint4*>(hrow + p.N + j));
          if (two) {
            h[u][1] = __ldg(reinterpret_cast<const uint4*>(hrow + j2));
            h[u][3] = __ldg(reinterpret_cast<const uint4*>(hrow + p.N + j2));
          }
        } else {
          h[u][0] = __ldg(reinterpret_cast<const uint4*>(hrow + j));
          if (two) h[u][1] = __ldg(reinterpret_cast<const uint4*>(hrow + j2));
        }
      }
    }
  }

  // One 8-column chunk c (0 or 1) of item u: dH, A' and the chunk's share of the row's dS.
  template <int ACT>
  __device__ __forceinline__ float chunk(const GroupedGemmParams& p, const uint8_t* epi, int u, int c, int r_tile,
                                         int ch, int j, int64_t row, float s) {
    constexpr bool kGlu = EPI != kEpiDAct;
    float da[8];
    load_bf16x8(reinterpret_cast<const __nv_bfloat16*>(epi + epi_chunk_offset<BN, EPI, 128, kBoxed>(r_tile, ch + c * kItemsPerRow)), da);
    // H of the chunk: GLU interleaved h[2c], h[2c + 1] ((gate, up) pairs); concatenated gate
    // h[c], up h[2 + c]; no GLU h[c].
    const __nv_bfloat16* h0 = reinterpret_cast<const __nv_bfloat16*>(&h[u][EPI == kEpiDGluInter ? 2 * c : c]);
    const __nv_bfloat16* h1 = reinterpret_cast<const __nv_bfloat16*>(&h[u][EPI == kEpiDGluInter ? 2 * c + 1 : 2 + c]);
    float ds = 0.f, a_scaled[8], d0[8], d1[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float g, up = 1.f;
      if constexpr (EPI == kEpiDGluInter) {
        const __nv_bfloat16* hp = i < 4 ? h0 : h1;
        g = __bfloat162float(hp[2 * (i % 4)]);
        up = __bfloat162float(hp[2 * (i % 4) + 1]);
      } else if constexpr (EPI == kEpiDGluConcat) {
        g = __bfloat162float(h0[i]);
        up = __bfloat162float(h1[i]);
      } else {
        g = __bfloat162float(h0[i]);
      }
      // (d1 is written without a GLU too, and not stored)
      if constexpr (EPI == kEpiDGluInter) {  // back to (gate, up) pairs
        float* dst = i < 4 ? d0 : d1;
        dact_element<ACT, kGlu>(p, g, up, da[i], s, ds, a_scaled[i], dst[2 * (i % 4)], dst[2 * (i % 4) + 1]);
      } else {
        dact_element<ACT, kGlu>(p, g, up, da[i], s, ds, a_scaled[i], d0[i], d1[i]);
      }
    }
    const int jc = j + c * (BN / 2);
    __nv_bfloat16* dh = p.c + row * p.ldc;
    if constexpr (EPI == kEpiDGluInter) {
      store_bf16(dh + 2 * jc, d0);
      store_bf16(dh + 2 * jc + 8, d1);
    } else if constexpr (EPI == kEpiDGluConcat) {
      store_bf16(dh + jc, d0);
      store_bf16(dh + p.N + jc, d1);
    } else {
      store_bf16(dh + jc, d0);
    }
    store_bf16(p.c2 + row * p.ldc2 + jc, a_scaled);
    return ds;
  }

  template <int ACT>
  __device__ __forceinline__ void compute_act(const GroupedGemmParams& p, const GemmTile& tile, const uint8_t* epi,
                                              const float* scale, int row_base, int items, int end, int next,
                                              int stride) {
#pragma unroll
    for (int u = 0; u < G; ++u) {
      const int it = next + u * stride;
      if (it >= end) break;  // warp-uniform: end is a multiple of 32
      const int r = row_base + it / kItemsPerRow, ch = it % kItemsPerRow;
      const int j = tile.n0 + ch * 8;
      float ds = 0.f;
      if (it < items && j < p.N) {
        const int64_t row = tile.row0 + r;
        const float s = scale[r];
        ds = chunk<ACT>(p, epi, u, 0, r, ch, j, row, s);
        if (j + BN / 2 < p.N) ds += chunk<ACT>(p, epi, u, 1, r, ch, j, row, s);
      }
      // The row's items are kItemsPerRow consecutive lanes (it ≡ lane mod 32, stride a multiple of 32).
#pragma unroll
      for (int off = kItemsPerRow / 2; off > 0; off >>= 1) ds += __shfl_xor_sync(0xffffffffu, ds, off);
      // One dS partial per 128 columns (kDsCols), whatever the tile width: a 256-wide tile writes
      // its sum and a zero, so that the layout does not depend on which kernel ran.
      if (ch == 0 && it < items) {
        float* dst = p.ds_partial + static_cast<int64_t>(tile.row0 + r) * p.ds_cols + tile.n0 / kDsCols;
        dst[0] = ds;
        if constexpr (BN > kDsCols) {
          if (tile.n0 / kDsCols + 1 < p.ds_cols) dst[1] = 0.f;
        }
      }
    }
  }

  __device__ __forceinline__ void compute(const GroupedGemmParams& p, const GemmTile& tile, const uint8_t* epi,
                                          const float* scale, int row_base, int items, int end, int next,
                                          int stride) {
    gemm_act_dispatch<EPI != kEpiDAct>(p.act, [&](auto act) {
      compute_act<decltype(act)::value>(p, tile, epi, scale, row_base, items, end, next, stride);
    });
  }
};

// Consumer side: the scores of the warpgroup's rows, staged with the tile. Loaded in two steps
// during the main loop (row -> pair at the tile's start, pair -> score after its first K block)
// so that neither load stalls the tensor cores.
struct DactRowScale {
  int32_t pair[2];
  float s[2];
  __device__ __forceinline__ void load_pairs(const GroupedGemmParams& p, const GemmTile& tile, int cw) {
    const int r0 = cw * 64 + ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4;
#pragma unroll
    for (int i = 0; i < 2; ++i) pair[i] = r0 + 8 * i < tile.rows ? __ldg(p.row_pair + tile.row0 + r0 + 8 * i) : -1;
  }
  __device__ __forceinline__ void load_scores(const GroupedGemmParams& p) {
#pragma unroll
    for (int i = 0; i < 2; ++i) s[i] = pair[i] >= 0 ? __ldg(p.row_scores + pair[i]) : 0.f;
  }
  __device__ __forceinline__ void stage(float* scale, int cw) const {
    const int r0 = cw * 64 + ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4;
    if (threadIdx.x % 4 == 0) {
      scale[r0] = s[0];
      scale[r0 + 8] = s[1];
    }
  }
};

}  // namespace machmoe::kernels
