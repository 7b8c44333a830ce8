// machmoe FP8 quantisation (the first building block of FP8 training): bf16 tensors -> E4M3
// codes with fp32 scales, in DeepSeek-V3's recipe. Activations and gradients are quantised in
// 1x128 tiles along the GEMM's reduction dimension, weights in 128x128 blocks.
//
// E4M3 is OCP FP8 "E4M3FN": 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities,
// largest finite ±448, smallest subnormal 2^-9, NaN = codes 0x7f and 0xff.
//
// Every tile (or block) t of a tensor x gets one fp32 scale s and codes q:
//   amax = max |x| over t's real elements (a partial tile at the end of a dimension uses only
//          its real elements), in fp32 from the bf16 inputs (exact);
//   s    = max(amax / 448, 2^-126) (fp32 division, round to nearest; floored at the smallest
//          normal fp32 so that 1/s is finite: a tile whose amax is below 448·2^-126 ≈ 5e-36 uses
//          less of E4M3's range); amax = 0: s = 1 (all codes ±0);
//   q    = E4M3(x · (1/s)): 1/s rounded to fp32 once per tile (an IEEE division per element
//          would be the quantisers' largest cost), the product rounded to fp32, then round to
//          nearest even with saturation to ±448
//          (the device's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
//   x ≈ q·s (dequantised).
// Non-finite inputs propagate, never hidden: a tile holding a NaN or a ±Inf gets s = NaN (always
// the bits 0x7fc00000) and code 0x7f (NaN) for every real element, so it dequantises to NaN, and
// a GEMM that multiplies by its scale gives NaN. (Inf is treated as NaN rather than as an infinite
// scale: with s = Inf the finite elements would quantise to 0 and 0·Inf gives NaN anyway, and one
// rule is easier to check downstream.) A negative input that rounds to zero keeps its sign (0x80).
// A gathered row whose index lies outside [0, T) is quantised as NaN (NaN scales, 0x7f codes):
// a bad index shows instead of reading out of bounds.
//
// All calls are asynchronous on `stream`, never synchronise the host, and throw machmoe::Error
// (InvalidArgument) naming the argument and the rule it broke. The CPU reference of each is in
// machmoe/reference_fp8.hpp (bitwise the same results).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "machmoe/types.hpp"

namespace machmoe {

inline constexpr int64_t kFp8Tile = 128;                // elements per scale along a dimension
inline constexpr float kE4M3Max = 448.f;                // largest finite E4M3
inline constexpr uint32_t kFp8NanScaleBits = 0x7fc00000u;  // the scale of a non-finite tile
inline constexpr uint8_t kE4M3NanCode = 0x7f;           // the code of a non-finite tile's elements

// Scales along a dimension of n elements: ceil(n / 128).
inline constexpr int64_t fp8_tiles(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }

// ---------------------------------------------------------------- along rows (1x128 tiles)
// The operand of a GEMM whose reduction dimension is d (the forward up-projection X·W1ᵀ, the dH
// kernel's dout·W2): row r of the output is x[gather[r]] (gather null: x[r], and R must equal T
// or be 0).
//   q [R, d] e4m3, rows d bytes apart; scales [R, fp8_tiles(d)] fp32, scale [r, j] for columns
//   [128j, min(128j + 128, d)) of row r.
// Rules: d >= 16 and a multiple of 16 (16-byte q rows); ld >= d and a multiple of 8; x and q
// 16-byte aligned, scales and gather 4-byte aligned; 0 <= T, R < 2^31; gather values in [0, T)
// (outside: that row is NaN, see above).
struct QuantizeRowsArgs {
  const void* x = nullptr;          // [T, d] bf16, rows ld elements apart
  int64_t T = 0, d = 0, ld = 0;
  const int32_t* gather = nullptr;  // [R] device, or null (identity)
  int64_t R = 0;
  uint8_t* q = nullptr;             // [R, d] e4m3
  float* scales = nullptr;          // [R, fp8_tiles(d)]
};
void quantize_rows_fp8(const QuantizeRowsArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------- along each expert's rows
// The operands of the weight-gradient GEMMs, whose reduction dimension is an expert's rows
// (varlen K): x bf16 [T, d] with row r = x[gather[r]] (gather null: x[r], R must equal T or be
// 0) and expert_offsets [E+1] (device; expert e's rows are [off[e], off[e+1]), nondecreasing in
// [0, R]).
//
// Layout. Each expert's rows are cut into chunks of 128 from its first row (a chunk never
// straddles two experts; an expert's last chunk may be partial; an expert with no rows has no
// chunk). Chunks are numbered expert after expert:
//   chunk_offsets[e] = Σ_{e' < e} ceil(rows(e') / 128)     [E+1] int32, written on the device
// Chunk c = chunk_offsets[e] + j holds the expert's rows off[e] + 128j + [0, 128) and owns
//   qt[c]       e4m3 [max_chunks, d, 128]: column i of the gathered x becomes row i of qt[c],
//               its 128 codes contiguous along the rows, so that a K-major wgmma operand can TMA
//               a whole 128-deep K block; rows past the expert's end in its last chunk are zero
//               codes (no masking needed in the GEMM);
//   scales[c]   fp32 [max_chunks, d]: chunk c's scale for each column.
// Chunk-major, so that each chunk's codes and scales are written as contiguous blocks.
// The sizes come from (R, E, d) alone (fp8_columns_layout), without reading device data: at most
//   max_chunks = m + (R - m) / 128 (integer division), m = min(E, R),
// chunks exist for any offsets within R (each nonempty expert adds at most one partial chunk);
// r_pad = 128·max_chunks. Chunks c >= chunk_offsets[E] (their qt[c], scales[c]) are not written.
// A GEMM reads chunk_offsets to find expert e's K blocks: [chunk_offsets[e], chunk_offsets[e+1]).
// Rules: d >= 16 and a multiple of 16; ld >= d and a multiple of 8; 1 <= E < 2^31; 0 <= T, R <
// 2^31; x and qt 16-byte aligned, scales, gather, offsets and chunk_offsets 4-byte aligned.
// Offsets outside these rules are clamped into [0, R] on the device (no access leaves the
// buffers; the result is then meaningless).
struct Fp8ColumnsLayout {
  int64_t max_chunks = 0;          // the most chunks any offsets give
  int64_t r_pad = 0;               // the rows the chunks can hold: 128·max_chunks
  size_t qt_bytes = 0;             // d·r_pad (qt [max_chunks, d, 128])
  size_t scales_bytes = 0;         // 4·d·max_chunks
  size_t chunk_offsets_bytes = 0;  // 4·(E+1)
};
Fp8ColumnsLayout fp8_columns_layout(int64_t R, int64_t E, int64_t d);

struct QuantizeColumnsArgs {
  const void* x = nullptr;                  // [T, d] bf16, rows ld elements apart
  int64_t T = 0, d = 0, ld = 0;
  const int32_t* gather = nullptr;          // [R] device, or null (identity)
  int64_t R = 0;
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t E = 0;
  int32_t* chunk_offsets = nullptr;         // [E+1] out
  uint8_t* qt = nullptr;                    // [max_chunks, d, 128] e4m3 out
  float* scales = nullptr;                  // [max_chunks, d] out
};
void quantize_columns_fp8(const QuantizeColumnsArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------- weights (128x128 blocks)
// w bf16 [E, N, K] -> q e4m3 [E, N, K], scales fp32 [E, fp8_tiles(N), fp8_tiles(K)] (one per
// 128x128 block; edge blocks use their real elements). With `transposed`, also qt e4m3
// [E, K, N] = q transposed and scales_t [E, fp8_tiles(K), fp8_tiles(N)], scales_t[e, kb, nb] =
// scales[e, nb, kb]: the same codes and scales, so q and qt dequantise to the same values.
// Rules: 0 <= E, N, K; K a multiple of 16 (16-byte q rows), N too with `transposed`; every block
// count below 2^31; w, q, qt 16-byte aligned, scales 4-byte aligned.
struct QuantizeWeightsArgs {
  const void* w = nullptr;   // [E, N, K] bf16, contiguous
  int64_t E = 0, N = 0, K = 0;
  uint8_t* q = nullptr;      // [E, N, K]
  float* scales = nullptr;   // [E, fp8_tiles(N), fp8_tiles(K)]
  bool transposed = false;
  uint8_t* qt = nullptr;     // [E, K, N] (transposed only)
  float* scales_t = nullptr; // [E, fp8_tiles(K), fp8_tiles(N)] (transposed only)
};
void quantize_weights_fp8(const QuantizeWeightsArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------- grouped GEMM (FP8 operands)
// The forward expert GEMMs on row-quantised activations and block-quantised weights
// (DeepSeek-V3's recipe), A's rows optionally gathered (the up-projection on x quantised once):
//   C[r, n] = Σ_kb sa[a(r), kb] · sb[e, n / 128, kb] · Σ_{k in [128kb, 128kb + 128)} Aq[a(r), k] · Wq[e, n, k]
// for the rows r of expert e, [expert_offsets[e], expert_offsets[e+1]); KB = fp8_tiles(K);
// a(r) = gather[r] (gather [R] int32, device) or r (gather null: A contiguous, loaded by TMA).
//   a_q [T, K] e4m3, a_scales [T, KB] fp32 (what quantize_rows_fp8 writes with d = K, without a
//   gather), T = R without a gather; a gathered row whose index lies outside [0, T) reads nothing
//   and gives NaN outputs (as quantize_rows_fp8 makes such a row);
//   w_q [E, N, K] e4m3, w_scales [E, fp8_tiles(N), KB] fp32 (what quantize_weights_fp8 writes);
//   c [R, ldc] bf16: columns [0, N) of the experts' rows are written, nothing else.
// Accumulation in fp32: each 128-deep K block in the tensor cores, then promoted with its two
// scales (acc += sa·sb·block). expert_offsets [E+1] (device) must be nondecreasing within [0, R];
// an expert with no rows is skipped. tile_offsets: workspace [E+1] int32 (device), written only
// when E > 512 (may be null otherwise). max_ctas: 0 for one persistent CTA per SM, else at most
// that many. Needs an sm_90 GPU (wgmma).
// Rules (checked before any CUDA call, Error InvalidArgument naming the argument): 1 <= E <= 2^24;
// N >= 8 and a multiple of 8; K >= 16 and a multiple of 16 (16-byte rows of codes for the TMA and
// the gather's copies); 0 <= R < 2^31; E·N + 256 < 2^31; (ceil(R/128) + E)·ceil(N/256) < 2^31
// (the tiles); ldc >= N and a multiple of 8; a_q, w_q, c 16-byte aligned, the scales 4-byte
// aligned; no pointer null (with R = 0 the call does nothing). With a gather: 0 <= T < 2^31,
// T·K < 2^36 (a_q addressed in 16-byte units held in 32 bits), gather 4-byte aligned.
//
// The up-projection's epilogue (epilogue = Fp8GemmEpilogue::Glu) writes, instead of C, what the
// FP8 layer keeps and feeds on (machmoe/reference_fp8_layer.hpp states the same in double):
//   H  = C (+ bias[e])                      the GEMM above, fp32, W's rows gate/up interleaved
//                                           (row 2j gate j, row 2j + 1 up j)
//   hq [R, N] e4m3, h_scales [R, fp8_tiles(N)]          H quantised 1x128 along N
//   A  = glu(H)                             `activation` (a GLU kind, the clamped SwiGLU with
//                                           glu_clamp) on the fp32 H (not the dequantised hq)
//   act_q [R, N/2] e4m3, act_scales [R, fp8_tiles(N/2)]  A quantised 1x128 along N/2
// Scales as the quantisers': amax/448, 1 for an all-zero tile, NaN (codes 0x7f) for a tile with a
// NaN or Inf. Rules with Glu: N a multiple of 32 (16-byte rows of act_q); activation a GLU kind;
// hq, act_q 16-byte aligned, h_scales, act_scales 4-byte aligned, bias (bf16 [E, N] or null)
// 2-byte aligned; c and ldc unused. The plain store adds a bias (bf16 [E, N], 2-byte aligned) to C
// in fp32 before the rounding when A is contiguous; with a gather it refuses one.
enum class Fp8GemmEpilogue : int32_t { Store = 0, Glu = 1 };

struct GroupedGemmFp8Args {
  const uint8_t* a_q = nullptr;             // [T, K] e4m3 (T = R without a gather)
  const float* a_scales = nullptr;          // [T, fp8_tiles(K)]
  int64_t R = 0;                            // rows of C
  const int32_t* gather = nullptr;          // [R] device: row r reads a_q[gather[r]]; null: a_q[r]
  int64_t T = 0;                            // rows of a_q with a gather (unused without one)
  const uint8_t* w_q = nullptr;             // [E, N, K] e4m3
  const float* w_scales = nullptr;          // [E, fp8_tiles(N), fp8_tiles(K)]
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t E = 0, N = 0, K = 0;
  void* c = nullptr;                        // [R, ldc] bf16 (+ bias[e] without a gather)
  int64_t ldc = 0;
  int32_t* tile_offsets = nullptr;          // workspace [E+1] (E > 512 only)
  int max_ctas = 0;
  // The GLU epilogue (above): its outputs and parameters.
  Fp8GemmEpilogue epilogue = Fp8GemmEpilogue::Store;
  Activation activation = Activation::SwiGLU;
  GluClamp glu_clamp;
  const void* bias = nullptr;               // [E, N] bf16 or null
  uint8_t* hq = nullptr;                    // [R, N] e4m3
  float* h_scales = nullptr;                // [R, fp8_tiles(N)]
  uint8_t* act_q = nullptr;                 // [R, N/2] e4m3: A
  float* act_scales = nullptr;              // [R, fp8_tiles(N/2)]
};
void grouped_gemm_fp8(const GroupedGemmFp8Args& args, cudaStream_t stream);

// ---------------------------------------------------------------- the conversion itself
// q[i] = E4M3(x[i]) with the device's conversion (round to nearest even, satfinite; the rounding
// every quantiser above uses), for tests that hold a host conversion against the hardware.
// x fp32 [n], q e4m3 [n], both device pointers; n >= 0.
void convert_float_to_e4m3(const float* x, uint8_t* q, int64_t n, cudaStream_t stream);

}  // namespace machmoe
