// The FP8 up-projection's epilogue (gemm/fp8_cooperative.cuh, BN = 256): from the consumer's
// fp32 accumulators straight to what the FP8 layer keeps and feeds on, with no bf16 H in between:
//
//   H  = acc (+ b1)                      [R, N]   N = n1 = 2n, gate/up interleaved (col 2j gate j)
//   Hq = E4M3(H / sH), sH per 1x128      [R, N] e4m3 + [R, ceil(N/128)] fp32  (kept for the backward)
//   A  = glu(H)                          from the fp32 H: one quantisation (A's) on the forward's
//                                        path; the backward recomputes A from Hq, as DeepSeek-V3's
//                                        recipe recomputes the SwiGLU from its cached FP8 input
//   Aq = E4M3(A / sA), sA per 1x128      [R, n] e4m3 + [R, ceil(n/128)] fp32  (the down-projection's A)
//
// The scale recipe is the quantisers' (kernels/quant/fp8_common.cuh): s = amax/448 (fp32 division,
// round to nearest), amax 0 gives 1, a NaN or Inf in a tile gives the NaN scale and 0x7f codes.
// Why BN = 256: a 256-column tile of H is two H scale groups (one per 128-column wave) and, after
// the GLU halves it, exactly one 128-column group of A, so every amax is a reduction inside the
// tile. In the m64nNk32 fragment a row's columns of one wave sit in the 4 lanes of a quad (lane
// l holds row 16w + l/4 (+8) and columns 8j + 2(l%4) + {0,1}, j < 16): each amax is the thread's
// own max and two quad shuffles, and each thread's column pair is one (gate, up) pair.
// Columns at or past N (a partial last tile reads the next expert's weight rows) are left out of
// every amax and never stored; rows past the expert or past R are computed but not stored.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/params.cuh"
#include "kernels/gemm/scheduler.cuh"
#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels {

// Where the epilogue writes (all row-major, rows R of the grouped problem).
struct Fp8GluOutputs {
  uint8_t* hq = nullptr;        // [R, N] e4m3
  float* h_scales = nullptr;    // [R, ceil(N / 128)]
  uint8_t* aq = nullptr;        // [R, N / 2] e4m3
  float* a_scales = nullptr;    // [R, ceil(N / 256)]
};

namespace fp8_glu {

// The scale of a tile whose amax is given as fp32 |bits| (unsigned order: finite < Inf < NaN).
__device__ __forceinline__ fp8::TileScale scale_of(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return {__uint_as_float(fp8::kNanScaleBits), true, __uint_as_float(fp8::kNanScaleBits)};
  if (amax_bits == 0) return {1.f, false, 1.f};
  // Floored at 2^-126 as the quantisers' scales (kernels/quant/fp8_common.cuh): 1/s is finite.
  const float s = fmaxf(__fdiv_rn(__uint_as_float(amax_bits), fp8::kE4M3Max), fp8::kMinScale);
  return {s, false, __frcp_rn(s)};
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// v · (1/s) as an E4M3 code (round to nearest even, saturating), as the quantisers compute it
// (kernels/quant/fp8_common.cuh: 1/s rounded once per tile, not a division per element); a bad
// tile's codes are NaN (0x7f).
__device__ __forceinline__ uint32_t code_of(float v, const fp8::TileScale& t) {
  if (t.bad) return 0x7fu;
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(fp8::quotient(v, t), __NV_SATFINITE, __NV_E4M3));
}

// A = f(gate)·up in fp32 for the activation ACT (a GLU kind), the clamped SwiGLU's parameters in g.
template <int ACT>
__device__ __forceinline__ float glu(const GroupedGemmParams& g, float gate, float up) {
  if constexpr (ACT == kActClampedSwiGLU) {
    const ClampedSwiGLUParts c = clamped_swiglu_parts(g, gate, up);
    return c.f * c.uc;
  } else {
    return gemm_act<ACT>(gate) * up;
  }
}

// The word of four picked by t (0-3, a register index known only at run time: selects, not an
// indexed array, which would go to local memory).
__device__ __forceinline__ uint32_t pick4(uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3, int t) {
  const uint32_t lo = (t & 1) ? v1 : v0, hi = (t & 1) ? v3 : v2;
  return (t & 2) ? hi : lo;
}

// Quad exchange for 16-byte stores. Each of a quad's four lanes holds words w[2t + k] (k < 2)
// meant for lane t of the quad; afterwards lane q holds in got[2s + k] the word w[2q + k] of lane
// s. Three xor-shuffle rounds: in round r a lane sends its partner q ^ r the words meant for it.
// Both ends index by a lane number (q ^ r, q ^ s) known only at run time, so both pick by selects
// (pick4): an array indexed so would go to local memory.
__device__ __forceinline__ void quad_exchange(const uint32_t (&w)[8], int q, uint32_t (&got)[8]) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t recv[4];  // recv[r]: from lane q ^ r (recv[0]: this lane's own)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t mine = pick4(w[k], w[2 + k], w[4 + k], w[6 + k], q ^ r);
      recv[r] = r == 0 ? mine : __shfl_xor_sync(kFullMask, mine, r);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) got[2 * s + k] = pick4(recv[0], recv[1], recv[2], recv[3], q ^ s);
  }
}

}  // namespace fp8_glu

// One consumer thread's two rows (row_local, row_local + 8) of a finished 128 x 256 tile.
// acc: the thread's fragment of its warpgroup's 64 x 256 (two 128-column waves, 64 each).
// rows_total: R (rows at or past it are not stored).
// Stores: in the fragment a quad holds a row's 128 H codes of a wave as 2-byte pieces strided by
// 8 bytes (and its 128 A codes as single bytes strided by 4), so the quad first trades codes
// (fp8_glu::quad_exchange) until each lane holds 32 contiguous bytes of the row, then stores them
// as two 16-byte stores: 8 H stores and 4 A stores a thread per tile instead of 64 2-byte and 64
// 1-byte ones, each of which filled a quarter or an eighth of a 32-byte sector. N and n are
// multiples of 16 (the FP8 rule), so a 16-byte piece lies wholly inside or wholly past them.
template <int ACT>
__device__ __forceinline__ void fp8_glu_epilogue(const GroupedGemmParams& g, const Fp8GluOutputs& o,
                                                 const GemmTile& tile, int row_local, int lane,
                                                 const float (&acc)[128], int64_t rows_total) {
  const int q = lane % 4;
  const int N = g.N, n = N / 2;
  const int h_tiles = (N + 127) / 128, a_tiles = (n + 127) / 128;
  const __nv_bfloat16* bias = g.bias ? g.bias + static_cast<int64_t>(tile.e) * N : nullptr;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row_local + 8 * h;
    const int64_t row = static_cast<int64_t>(tile.row0) + r;
    // The quad's four lanes share the row, so this is uniform over every shuffle group below.
    const bool store_row = r < tile.rows && row < rows_total;
    float a[32];  // this thread's A columns of the row: wave w, pair j at 16w + j
    uint32_t a_amax = 0;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      // Phase 1: H of the wave (+ bias) and its amax over the quad.
      float hv[32];
      uint32_t h_amax = 0;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = tile.n0 + 128 * w + 8 * j + 2 * q;  // the gate's column; col + 1 the up's
        const bool in = col < N;                            // N is even: both or neither
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          float v = acc[64 * w + 4 * j + 2 * h + k];
          if (bias != nullptr && in) v += __bfloat162float(bias[col + k]);
          hv[2 * j + k] = v;
          if (in) h_amax = max(h_amax, fp8_glu::abs_bits(v));
        }
      }
      const fp8::TileScale sh = fp8_glu::scale_of(fp8::group_max_bits<4>(h_amax));
      // Phase 2: Hq, and A from the fp32 pair (A from the dequantised pair would put a second
      // E4M3 rounding on the forward's path: measured, a 7B-a-shaped model's held-out loss 5-10%
      // above bf16 after 1000 steps, against within bf16's own run-to-run spread). The code pair
      // of group j (bytes 8j + 2q of the wave's 128) goes into word hw[2t + k] for lane t = j / 4,
      // k = (j % 4) / 2, half j % 2.
      uint32_t hw[8];
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const uint32_t c0 = fp8_glu::code_of(hv[2 * j], sh) | (fp8_glu::code_of(hv[2 * j + 1], sh) << 8);
        const uint32_t c1 = fp8_glu::code_of(hv[2 * j + 2], sh) | (fp8_glu::code_of(hv[2 * j + 3], sh) << 8);
        hw[j / 2] = c0 | (c1 << 16);
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = tile.n0 + 128 * w + 8 * j + 2 * q;
        const float av = fp8_glu::glu<ACT>(g, hv[2 * j], hv[2 * j + 1]);
        a[16 * w + j] = av;
        if (col < N) a_amax = max(a_amax, fp8_glu::abs_bits(av));
      }
      // Lane q's 32 bytes of the wave are groups 4q .. 4q + 3; got[2s + k] holds lane s's code
      // pairs of groups 4q + 2k, 4q + 2k + 1. A group's 8 bytes are the four lanes' pairs in order.
      uint32_t got[8];
      fp8_glu::quad_exchange(hw, q, got);
      const int c0 = tile.n0 + 128 * w + 32 * q;  // this lane's first column
      uint8_t* hrow = o.hq + row * N;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint4 v = make_uint4(__byte_perm(got[k], got[2 + k], 0x5410), __byte_perm(got[4 + k], got[6 + k], 0x5410),
                                   __byte_perm(got[k], got[2 + k], 0x7632), __byte_perm(got[4 + k], got[6 + k], 0x7632));
        if (store_row && c0 + 16 * k < N) *reinterpret_cast<uint4*>(hrow + c0 + 16 * k) = v;
      }
      if (store_row && q == 0 && tile.n0 + 128 * w < N) o.h_scales[row * h_tiles + tile.n0 / 128 + w] = sh.s;
    }
    // Phase 3: A's one scale group of the tile, Aq out. Lane q's A byte of pair j of wave w sits at
    // n0/2 + 64w + 4j + q, so lane t of the quad stores bytes 32t .. 32t + 31: wave t / 2, pairs
    // 8(t % 2) .. + 7, the words aw[2t + k] = pairs 8(t % 2) + 4k .. + 3 of wave t / 2 (a[8t + 4k ..]).
    const fp8::TileScale sa = fp8_glu::scale_of(fp8::group_max_bits<4>(a_amax));
    uint32_t aw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      aw[i] = fp8_glu::code_of(a[4 * i], sa) | (fp8_glu::code_of(a[4 * i + 1], sa) << 8) |
              (fp8_glu::code_of(a[4 * i + 2], sa) << 16) | (fp8_glu::code_of(a[4 * i + 3], sa) << 24);
    uint32_t got[8];
    fp8_glu::quad_exchange(aw, q, got);
    // got[2s + k] byte b is lane s's code of pair 8(q % 2) + 4k + b: byte 16k + 4b + s of the 32.
    const int a0 = tile.n0 / 2 + 32 * q;
    uint8_t* arow = o.aq + row * n;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint4 v = fp8::transpose4x4_bytes(got[k], got[2 + k], got[4 + k], got[6 + k]);
      if (store_row && a0 + 16 * k < n) *reinterpret_cast<uint4*>(arow + a0 + 16 * k) = v;
    }
    if (store_row && q == 0) o.a_scales[row * a_tiles + tile.n0 / 256] = sa.s;
  }
}

}  // namespace machmoe::kernels
