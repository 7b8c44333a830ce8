// The CPU reference of the FP8 (E4M3) quantisers of machmoe/fp8.hpp: the executable spec the GPU
// kernels are tested against, bitwise. Its own float -> E4M3 conversion (round to nearest even,
// saturating to ±448) reproduces the device's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
// scales, their reciprocals and the products are computed in fp32 exactly as the kernels compute
// them (IEEE division, reciprocal and product, round to nearest), so nothing here is "close": it
// is equal. bf16 values are passed as their
// 16-bit patterns (no CUDA headers here). The recipe and the layouts: machmoe/fp8.hpp.
#pragma once

#include <cstdint>
#include <vector>

#include "machmoe/types.hpp"

namespace machmoe::ref {

inline constexpr float kE4M3MaxFinite = 448.f;
inline constexpr uint32_t kFp8NanScale = 0x7fc00000u;  // the bits of a non-finite tile's scale
inline constexpr uint8_t kE4M3Nan = 0x7f;

// ---------------------------------------------------------------- the format
// E4M3 ("E4M3FN"): code = s eeee mmm; e = 0: ±m·2^-9 (subnormal, m = 0: ±0); e = 1..15: ±(1 +
// m/8)·2^(e-7), except e = 15, m = 7 (0x7f, 0xff): NaN. Largest finite 0x7e = 448.
float e4m3_to_float(uint8_t code);
// float -> E4M3: round to nearest, ties to the even code; |x| >= 448 (Inf too) -> ±448; a
// magnitude that rounds to zero keeps its sign (0x80); NaN -> 0x7f, whatever its sign (as the
// CUDA header's conversion).
uint8_t float_to_e4m3(float x);

// bf16 bit pattern <-> float (the widening is exact; the narrowing rounds to nearest even, NaN
// kept as a quiet NaN).
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float x);

// The scale of a tile from its amax (fp32, from bf16 |x|): NaN or Inf -> NaN (bits 0x7fc00000),
// 0 -> 1, else max(amax / 448, 2^-126) in fp32.
float fp8_scale(float amax);
// One element's code given its tile's scale (a non-finite tile: 0x7f).
uint8_t fp8_quantize(float x, float scale);

// ---------------------------------------------------------------- the quantisers
// Rows (1x128 tiles along d): x [T, d] (ld) through gather [R] (null: identity, R = T or 0); a gather
// value outside [0, T) makes that row NaN. q [R, d], scales [R, ceil(d/128)].
struct Fp8Rows {
  int64_t R = 0, d = 0, tiles = 0;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};
Fp8Rows quantize_rows_fp8(const uint16_t* x, int64_t T, int64_t d, int64_t ld, const int32_t* gather, int64_t R);

// Columns per expert (128-row chunks per expert segment, transposed): see fp8.hpp for the layout.
// offsets [E+1] must be nondecreasing within [0, R] (else Error InvalidArgument). qt
// [max_chunks, d, 128], scales [max_chunks, d], chunk_offsets [E+1]; the chunks c >=
// chunk_offsets[E] are not part of the result (the GPU leaves them unwritten; here they are zero).
struct Fp8Columns {
  int64_t d = 0, max_chunks = 0, r_pad = 0;
  std::vector<int32_t> chunk_offsets;
  std::vector<uint8_t> qt;
  std::vector<float> scales;
};
// The layout's sizes from (R, E) alone: the most chunks any offsets can give.
int64_t fp8_max_chunks(int64_t R, int64_t E);
Fp8Columns quantize_columns_fp8(const uint16_t* x, int64_t T, int64_t d, int64_t ld, const int32_t* gather,
                                int64_t R, const int32_t* offsets, int64_t E);

// Weights (128x128 blocks): w [E, N, K] -> q [E, N, K], scales [E, nb_n, nb_k]; with transposed,
// qt [E, K, N] and scales_t [E, nb_k, nb_n] (the same codes and scales, transposed).
struct Fp8Weights {
  int64_t E = 0, N = 0, K = 0, nb_n = 0, nb_k = 0;
  std::vector<uint8_t> q, qt;
  std::vector<float> scales, scales_t;
};
Fp8Weights quantize_weights_fp8(const uint16_t* w, int64_t E, int64_t N, int64_t K, bool transposed);

// ---------------------------------------------------------------- the FP8 grouped GEMM
// grouped_gemm_fp8 (machmoe/fp8.hpp) in float64 on the dequantised operands (each product
// code·scale is exact in float64; the sums round in float64):
//   c[r, n]   = Σ_k (Aq[r, k]·sa[r, k/128]) · (Wq[e, n, k]·sb[e, n/128, k/128])
//   abs[r, n] = Σ_k |Aq[r, k]·sa[r, k/128]| · |Wq[e, n, k]·sb[e, n/128, k/128]|
// for the rows r of expert e, [offsets[e], offsets[e+1]); abs bounds what any summation order
// can lose (the GPU test's tolerance scales with it). Rows outside every expert are NaN in both
// (the GPU leaves them unwritten). a_q [R, K], a_scales [R, ceil(K/128)], w_q [E, N, K],
// w_scales [E, ceil(N/128), ceil(K/128)]; offsets [E+1] nondecreasing within [0, R] (else Error
// InvalidArgument), E, N, K >= 1, R >= 0.
struct Fp8GemmResult {
  int64_t R = 0, N = 0;
  std::vector<double> c, abs;  // [R, N] each
};
Fp8GemmResult grouped_gemm_fp8(const uint8_t* a_q, const float* a_scales, int64_t R, const uint8_t* w_q,
                               const float* w_scales, const int32_t* offsets, int64_t E, int64_t N, int64_t K);

}  // namespace machmoe::ref
