// The CPU reference of the experts in FP8 (E4M3, DeepSeek-V3's recipe): where the FP8 layer
// quantises, stated as code. Each GEMM operand is quantised once, at the point where the GPU
// layer produces it, and every GEMM then runs in double on the dequantised operands (code ·
// scale, exact in double), so the only differences from machmoe/reference.hpp's experts are the
// quantisations listed below. The GPU layer adds fp32 accumulation and rounding on top; its tests
// hold it against this with tolerances derived from E4M3's precision.
//
// Quantisation q(v): a tile's scale is s = amax/448 from the fp32 values of the tile (fp8_scale:
// amax 0 gives 1; a NaN or Inf gives NaN), each value becomes the E4M3 code of v/s (saturating),
// and the GEMMs read code·s. Tiles:
//   rows     1x128 along a row (activations and gradients, the GEMM's K along the row);
//   blocks   128x128 (weights; the transposed copies hold the same codes and scales);
//   columns  128 rows x 1 along each expert's rows, chunks counted from the expert's first row
//            (the weight-gradient GEMMs, whose K is the expert's rows).
//
// Forward (rows r grouped by expert as in Metadata; t = row_token[r], e its expert):
//   Xq = rows(x)                           once per forward, [T, d]
//   W1q = blocks(w1), W2q = blocks(w2)     once per optimizer step (a cached copy)
//   H[r]  = Xq[t] · W1q[e]ᵀ (+ b1[e])      [R, n1]
//   Hq    = rows(H)                        what the forward keeps for the backward (H in FP8)
//   A[r]  = act(H[r])                      from the unquantised H (the backward recomputes it from Hq)
//   Aq    = rows(A)
//   Y[r]  = Aq[r] · W2q[e]ᵀ (+ b2[e])      [R, d]
//   out[t] = Σ_r score · Y[r]
// Backward:
//   dOq = rows(dout)                       once per backward
//   dA'[r] = dOq[t] · W2q[e]               [R, n]
//   d_score = dA'·A (+ dout[t]·b2[e]);  dH = act'(Hq) · (score · dA')   [R, n1]
//   dHq = rows(dH);  dx[t] = Σ_r dHq[r] · W1q[e]
//   dW1[e] = Σ_r columns(dHq)[r]ᵀ ⊗ columns(x[t])[r]      (dHq requantised along the rows)
//   dW2[e] = Σ_r columns(dout[t])[r]ᵀ ⊗ columns(score·A)[r]
//   db1 = Σ dH, db2 = Σ score·dout (unquantised: bias gradients are sums, not GEMMs)
#pragma once

#include <cstdint>
#include <vector>

#include "machmoe/reference.hpp"

namespace machmoe::ref {

// q(v) dequantised, in double, for v [rows, cols] (row-major, ld = cols).
std::vector<double> fp8_rows_dequantized(const double* v, int64_t rows, int64_t cols);
// The same for E matrices [E, N, K] in 128x128 blocks.
std::vector<double> fp8_blocks_dequantized(const double* w, int64_t E, int64_t N, int64_t K);
// The same for v [R, cols] whose rows are grouped by expert (expert_offsets [E+1]), in 128-row
// chunks from each expert's first row, one scale per (chunk, column).
std::vector<double> fp8_columns_dequantized(const double* v, int64_t R, int64_t cols,
                                            const std::vector<int64_t>& expert_offsets);

struct ExpertsForwardFp8 {
  std::vector<double> H;    // [R, n1] before quantisation (row order)
  std::vector<double> Hq;   // [R, n1] dequantised: what the backward reads
  std::vector<double> A;    // [R, n] act(Hq)
  std::vector<double> Y;    // [R, d]
  std::vector<double> out;  // [T, d]
};
ExpertsForwardFp8 experts_forward_fp8(const Shape& s, const double* x, const Weights& w,
                                      const RoutingList& list, const Metadata& md);

// The backward from the forward's Hq (ExpertsForwardFp8::Hq) and dout [T, d].
ExpertsGrads experts_backward_fp8(const Shape& s, const double* x, const Weights& w,
                                  const RoutingList& list, const Metadata& md, const double* Hq,
                                  const double* dout);

}  // namespace machmoe::ref
