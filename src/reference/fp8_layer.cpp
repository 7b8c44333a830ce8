// CPU reference of the experts in FP8 (machmoe/reference_fp8_layer.hpp): the bf16 reference's
// experts with each GEMM operand quantised where the FP8 layer produces it.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "machmoe/reference_fp8.hpp"
#include "machmoe/reference_fp8_layer.hpp"

namespace machmoe::ref {
namespace {

constexpr int64_t kTile = 128;

// Quantises the tile whose elements are v[at(i)] for i in [0, count) in place, in double: the
// scale from their fp32 values' amax (NaN for a NaN or Inf in the tile), then code·scale.
void quantize_tile(double* v, int64_t count, const std::function<int64_t(int64_t)>& at) {
  float amax = 0.f;
  bool nonfinite = false;
  for (int64_t i = 0; i < count; ++i) {
    const float f = static_cast<float>(v[at(i)]);
    if (!std::isfinite(f)) nonfinite = true;
    else amax = std::max(amax, std::fabs(f));
  }
  const float scale = nonfinite ? NAN : fp8_scale(amax);
  for (int64_t i = 0; i < count; ++i) {
    double& x = v[at(i)];
    x = std::isnan(scale) ? NAN
                          : static_cast<double>(e4m3_to_float(fp8_quantize(static_cast<float>(x), scale))) *
                                static_cast<double>(scale);
  }
}

void check(bool ok, const char* fn, const std::string& rule) {
  if (!ok) throw Error(ErrorCode::InvalidArgument, std::string(fn) + ": " + rule);
}

void check_experts(const char* fn, const Shape& s, const RoutingList& list, const Metadata& md) {
  check(s.T >= 0 && s.d >= 1 && s.n >= 1 && s.E >= 1, fn, "T >= 0, d, n, E >= 1");
  check(static_cast<int64_t>(md.expert_offsets.size()) == s.E + 1, fn, "md.expert_offsets must have E + 1 entries");
  check(static_cast<int64_t>(md.row_token.size()) == list.size() &&
            static_cast<int64_t>(md.row_pair.size()) == list.size(),
        fn, "md must describe the list's R rows");
}

// x[t] for the rows of the list, in row order: [R, d].
std::vector<double> gathered_rows(const double* v, int64_t cols, const Metadata& md) {
  const int64_t R = static_cast<int64_t>(md.row_token.size());
  std::vector<double> g(static_cast<size_t>(R * cols));
  for (int64_t r = 0; r < R; ++r) std::copy_n(v + md.row_token[r] * cols, cols, g.begin() + r * cols);
  return g;
}

}  // namespace

std::vector<double> fp8_rows_dequantized(const double* v, int64_t rows, int64_t cols) {
  std::vector<double> q(v, v + rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile)
      quantize_tile(q.data(), std::min(kTile, cols - c0), [&](int64_t i) { return r * cols + c0 + i; });
  return q;
}

std::vector<double> fp8_blocks_dequantized(const double* w, int64_t E, int64_t N, int64_t K) {
  std::vector<double> q(w, w + E * N * K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n0 = 0; n0 < N; n0 += kTile)
      for (int64_t k0 = 0; k0 < K; k0 += kTile) {
        const int64_t bn = std::min(kTile, N - n0), bk = std::min(kTile, K - k0);
        quantize_tile(q.data(), bn * bk, [&](int64_t i) { return (e * N + n0 + i / bk) * K + k0 + i % bk; });
      }
  return q;
}

std::vector<double> fp8_columns_dequantized(const double* v, int64_t R, int64_t cols,
                                            const std::vector<int64_t>& expert_offsets) {
  std::vector<double> q(v, v + R * cols);
  for (size_t e = 0; e + 1 < expert_offsets.size(); ++e)
    for (int64_t r0 = expert_offsets[e]; r0 < expert_offsets[e + 1]; r0 += kTile) {
      const int64_t rows = std::min(kTile, expert_offsets[e + 1] - r0);
      for (int64_t c = 0; c < cols; ++c)
        quantize_tile(q.data(), rows, [&](int64_t i) { return (r0 + i) * cols + c; });
    }
  return q;
}

ExpertsForwardFp8 experts_forward_fp8(const Shape& s, const double* x, const Weights& w,
                                      const RoutingList& list, const Metadata& md) {
  check_experts("ref::experts_forward_fp8", s, list, md);
  const int64_t R = list.size(), n1 = s.n1(), d = s.d, n = s.n;
  const std::vector<double> xq = fp8_rows_dequantized(x, s.T, d);
  const std::vector<double> w1q = fp8_blocks_dequantized(w.w1, s.E, n1, d);
  const std::vector<double> w2q = fp8_blocks_dequantized(w.w2, s.E, d, n);
  ExpertsForwardFp8 f;
  f.H.assign(static_cast<size_t>(R * n1), 0.0);
  f.A.assign(static_cast<size_t>(R * n), 0.0);
  f.Y.assign(static_cast<size_t>(R * d), 0.0);
  f.out.assign(static_cast<size_t>(s.T * d), 0.0);
  for (int64_t e = 0; e < s.E; ++e)  // H = Xq[t]·W1qᵀ (+ b1)
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r)
      for (int64_t c = 0; c < n1; ++c) {
        double acc = s.bias ? w.b1[e * n1 + c] : 0.0;
        for (int64_t k = 0; k < d; ++k) acc += xq[md.row_token[r] * d + k] * w1q[(e * n1 + c) * d + k];
        f.H[r * n1 + c] = acc;
      }
  f.Hq = fp8_rows_dequantized(f.H.data(), R, n1);
  for (int64_t r = 0; r < R; ++r)
    activation_forward(s.act, s.layout, n, f.H.data() + r * n1, f.A.data() + r * n, s.clamp);
  const std::vector<double> aq = fp8_rows_dequantized(f.A.data(), R, n);
  for (int64_t e = 0; e < s.E; ++e)  // Y = Aq·W2qᵀ (+ b2), out = Σ score·Y
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r)
      for (int64_t i = 0; i < d; ++i) {
        double acc = s.bias ? w.b2[e * d + i] : 0.0;
        for (int64_t j = 0; j < n; ++j) acc += aq[r * n + j] * w2q[(e * d + i) * n + j];
        f.Y[r * d + i] = acc;
        f.out[md.row_token[r] * d + i] += list.score[md.row_pair[r]] * acc;
      }
  return f;
}

ExpertsGrads experts_backward_fp8(const Shape& s, const double* x, const Weights& w,
                                  const RoutingList& list, const Metadata& md, const double* Hq,
                                  const double* dout) {
  check_experts("ref::experts_backward_fp8", s, list, md);
  const int64_t R = list.size(), n1 = s.n1(), d = s.d, n = s.n, E = s.E;
  const std::vector<double> w1q = fp8_blocks_dequantized(w.w1, E, n1, d);
  const std::vector<double> w2q = fp8_blocks_dequantized(w.w2, E, d, n);
  const std::vector<double> doq = fp8_rows_dequantized(dout, s.T, d);
  ExpertsGrads g;
  g.dx.assign(static_cast<size_t>(s.T * d), 0.0);
  g.dw1.assign(static_cast<size_t>(E * n1 * d), 0.0);
  g.dw2.assign(static_cast<size_t>(E * d * n), 0.0);
  if (s.bias) {
    g.db1.assign(static_cast<size_t>(E * n1), 0.0);
    g.db2.assign(static_cast<size_t>(E * d), 0.0);
  }
  g.d_score.assign(static_cast<size_t>(R), 0.0);
  std::vector<double> a_scaled(static_cast<size_t>(R * n)), dh(static_cast<size_t>(R * n1));
  std::vector<double> da(n), a(n);
  for (int64_t e = 0; e < E; ++e)  // dA' = dOq[t]·W2q, d_score, dH
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r) {
      const int64_t p = md.row_pair[r], t = md.row_token[r];
      const double sc = list.score[p];
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < d; ++i) acc += doq[t * d + i] * w2q[(e * d + i) * n + j];
        da[j] = acc;
      }
      activation_forward(s.act, s.layout, n, Hq + r * n1, a.data(), s.clamp);
      double ds = 0;
      for (int64_t j = 0; j < n; ++j) ds += da[j] * a[j];
      if (s.bias)
        for (int64_t i = 0; i < d; ++i) ds += dout[t * d + i] * w.b2[e * d + i];
      g.d_score[p] = ds;
      for (int64_t j = 0; j < n; ++j) {
        da[j] *= sc;
        a_scaled[r * n + j] = sc * a[j];
      }
      activation_backward(s.act, s.layout, n, Hq + r * n1, da.data(), dh.data() + r * n1, s.clamp);
      if (s.bias) {
        for (int64_t c = 0; c < n1; ++c) g.db1[e * n1 + c] += dh[r * n1 + c];
        for (int64_t i = 0; i < d; ++i) g.db2[e * d + i] += sc * dout[t * d + i];
      }
    }
  const std::vector<double> dhq = fp8_rows_dequantized(dh.data(), R, n1);
  for (int64_t e = 0; e < E; ++e)  // dx = Σ dHq·W1q
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r)
      for (int64_t c = 0; c < n1; ++c)
        for (int64_t k = 0; k < d; ++k) g.dx[md.row_token[r] * d + k] += dhq[r * n1 + c] * w1q[(e * n1 + c) * d + k];
  // The weight gradients' operands, quantised along each expert's rows.
  const std::vector<double> dh_cols = fp8_columns_dequantized(dhq.data(), R, n1, md.expert_offsets);
  const std::vector<double> x_rows = gathered_rows(x, d, md);
  const std::vector<double> x_cols = fp8_columns_dequantized(x_rows.data(), R, d, md.expert_offsets);
  const std::vector<double> do_rows = gathered_rows(dout, d, md);
  const std::vector<double> do_cols = fp8_columns_dequantized(do_rows.data(), R, d, md.expert_offsets);
  const std::vector<double> a_cols = fp8_columns_dequantized(a_scaled.data(), R, n, md.expert_offsets);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r) {
      for (int64_t c = 0; c < n1; ++c)
        for (int64_t k = 0; k < d; ++k) g.dw1[(e * n1 + c) * d + k] += dh_cols[r * n1 + c] * x_cols[r * d + k];
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < n; ++j) g.dw2[(e * d + i) * n + j] += do_cols[r * d + i] * a_cols[r * n + j];
    }
  return g;
}

}  // namespace machmoe::ref
