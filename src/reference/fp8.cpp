// CPU reference of the FP8 (E4M3) quantisers (machmoe/reference_fp8.hpp): the conversion by
// integer arithmetic on the float's bits, the scales and quotients in fp32 exactly as the kernels
// compute them (so the results are bitwise those of the GPU), the loops as plain as possible.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "machmoe/reference_fp8.hpp"

namespace machmoe::ref {
namespace {

constexpr int64_t kTile = 128;

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

void require(bool ok, const char* fn, const char* arg, const std::string& rule) {
  if (!ok) throw Error(ErrorCode::InvalidArgument, std::string(fn) + ": " + arg + " " + rule);
}

// Rounds the integer m·2^-shift to nearest, ties to even (shift >= 1).
uint32_t round_shift_even(uint64_t m, int shift) {
  if (shift >= 63) return 0;
  const uint64_t q = m >> shift, rem = m & ((uint64_t{1} << shift) - 1), half = uint64_t{1} << (shift - 1);
  return static_cast<uint32_t>(q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0));
}

// The amax of a tile and whether it holds a NaN or Inf, from bf16 patterns.
struct Amax {
  float amax = 0.f;
  bool nonfinite = false;
  void add(float v) {
    if (!std::isfinite(v)) nonfinite = true;
    else amax = std::max(amax, std::fabs(v));
  }
  float scale() const { return nonfinite ? from_bits(kFp8NanScale) : fp8_scale(amax); }
};

const float kNan = std::numeric_limits<float>::quiet_NaN();

void check_source(const char* fn, int64_t T, int64_t d, int64_t ld, const int32_t* gather, int64_t R) {
  require(T >= 0, fn, "T", "must be >= 0");
  require(R >= 0, fn, "R", "must be >= 0");
  require(d >= 1, fn, "d", "must be >= 1");
  require(ld >= d, fn, "ld", "must be >= d");
  require(gather != nullptr || R == T || R == 0, fn, "R", "must equal T (or be 0) without a gather index");
}

// Element (r, col) of the gathered rows as float; a row whose index is outside [0, T): NaN.
float gathered(const uint16_t* x, int64_t T, int64_t ld, const int32_t* gather, int64_t r, int64_t col) {
  const int64_t src = gather ? gather[r] : r;
  if (src < 0 || src >= T) return kNan;
  return bf16_to_float(x[src * ld + col]);
}

}  // namespace

float e4m3_to_float(uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  if (e == 15 && m == 7) return kNan;
  // e = 0: m·2^-9; else (1 + m/8)·2^(e-7) = (8 + m)·2^(e-10).
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  return (code & 0x80) ? -v : v;
}

uint8_t float_to_e4m3(float x) {
  const uint32_t b = bits_of(x);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return kE4M3Nan;                      // NaN, either sign
  if (a >= bits_of(kE4M3MaxFinite)) return sign | 0x7e;      // [448, Inf]: RNE gives 448 up to 464,
                                                             // satfinite beyond
  const int exp = static_cast<int>(a >> 23);                 // biased fp32 exponent
  const uint32_t mant = a & 0x7fffffu;
  if (exp >= 127 - 6) {
    // Normal E4M3 (|x| >= 2^-6): exponent exp - 120 in [1, 15], keep 3 of 23 mantissa bits. A
    // carry out of the mantissa moves to the next exponent, as it should; |x| < 448 stays <= 0x7e.
    const uint32_t code = (static_cast<uint32_t>(exp - 120) << 3) | (mant >> 20);
    const uint32_t rem = mant & 0xfffffu, half = 0x80000u;
    return sign | static_cast<uint8_t>(code + ((rem > half || (rem == half && (code & 1))) ? 1 : 0));
  }
  // Subnormal E4M3: the code is |x| / 2^-9 rounded to an integer in [0, 8] (8 = 0x08 = 2^-6, the
  // smallest normal). |x| = M·2^(max(exp, 1) - 150) with M the significand as an integer.
  const uint64_t M = exp == 0 ? mant : (mant | 0x800000u);
  const int shift = 141 - std::max(exp, 1);  // >= 21
  return sign | static_cast<uint8_t>(round_shift_even(M, shift));
}

float bf16_to_float(uint16_t bits) { return from_bits(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float x) {
  const uint32_t b = bits_of(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

float fp8_scale(float amax) {
  if (!std::isfinite(amax)) return from_bits(kFp8NanScale);
  if (amax == 0.f) return 1.f;
  // fp32 division, round to nearest (as the kernels' __fdiv_rn), floored at 2^-126 (FLT_MIN) so
  // that 1/scale is finite.
  return std::max(amax / kE4M3MaxFinite, std::numeric_limits<float>::min());
}

uint8_t fp8_quantize(float x, float scale) {
  if (std::isnan(scale)) return kE4M3Nan;
  // x · (1/scale): the reciprocal and the product each rounded to nearest in fp32, as the kernels'
  // __frcp_rn and __fmul_rn (volatile: one rounding per step, never fused or reassociated).
  const volatile float inv = 1.0f / scale;
  const volatile float v = x * inv;
  return float_to_e4m3(v);
}

Fp8Rows quantize_rows_fp8(const uint16_t* x, int64_t T, int64_t d, int64_t ld, const int32_t* gather, int64_t R) {
  check_source("ref::quantize_rows_fp8", T, d, ld, gather, R);
  Fp8Rows out;
  out.R = R, out.d = d, out.tiles = (d + kTile - 1) / kTile;
  out.q.assign(static_cast<size_t>(R * d), 0);
  out.scales.assign(static_cast<size_t>(R * out.tiles), 0.f);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < out.tiles; ++j) {
      const int64_t c0 = j * kTile, c1 = std::min(d, c0 + kTile);
      Amax am;
      for (int64_t c = c0; c < c1; ++c) am.add(gathered(x, T, ld, gather, r, c));
      const float s = am.scale();
      out.scales[r * out.tiles + j] = s;
      for (int64_t c = c0; c < c1; ++c) out.q[r * d + c] = fp8_quantize(gathered(x, T, ld, gather, r, c), s);
    }
  }
  return out;
}

int64_t fp8_max_chunks(int64_t R, int64_t E) {
  // k nonempty experts give at most k + (R - k) / 128 chunks (each of them one partial chunk at
  // most), which grows with k <= min(E, R).
  const int64_t k = std::min(E, R);
  return k + (R - k) / kTile;
}

Fp8Columns quantize_columns_fp8(const uint16_t* x, int64_t T, int64_t d, int64_t ld, const int32_t* gather,
                                int64_t R, const int32_t* offsets, int64_t E) {
  constexpr const char* fn = "ref::quantize_columns_fp8";
  check_source(fn, T, d, ld, gather, R);
  require(E >= 1, fn, "E", "must be >= 1");
  for (int64_t e = 0; e < E; ++e)
    require(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= R, fn, "expert_offsets",
            "must be nondecreasing within [0, R]");
  Fp8Columns out;
  out.d = d;
  out.max_chunks = fp8_max_chunks(R, E);
  out.r_pad = kTile * out.max_chunks;
  out.chunk_offsets.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e)
    out.chunk_offsets[e + 1] =
        out.chunk_offsets[e] + static_cast<int32_t>((offsets[e + 1] - offsets[e] + kTile - 1) / kTile);
  out.qt.assign(static_cast<size_t>(d * out.r_pad), 0);
  out.scales.assign(static_cast<size_t>(d * out.max_chunks), 0.f);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t c = out.chunk_offsets[e]; c < out.chunk_offsets[e + 1]; ++c) {
      const int64_t r0 = offsets[e] + (c - out.chunk_offsets[e]) * kTile;
      const int64_t r1 = std::min<int64_t>(offsets[e + 1], r0 + kTile);
      for (int64_t i = 0; i < d; ++i) {
        Amax am;
        for (int64_t r = r0; r < r1; ++r) am.add(gathered(x, T, ld, gather, r, i));
        const float s = am.scale();
        out.scales[c * d + i] = s;
        // Rows r1 .. r0 + 128 of the chunk stay zero codes (padding).
        for (int64_t r = r0; r < r1; ++r)
          out.qt[(c * d + i) * kTile + (r - r0)] = fp8_quantize(gathered(x, T, ld, gather, r, i), s);
      }
    }
  }
  return out;
}

Fp8Weights quantize_weights_fp8(const uint16_t* w, int64_t E, int64_t N, int64_t K, bool transposed) {
  constexpr const char* fn = "ref::quantize_weights_fp8";
  require(E >= 0 && N >= 0 && K >= 0, fn, "E/N/K", "must be >= 0");
  Fp8Weights out;
  out.E = E, out.N = N, out.K = K;
  out.nb_n = (N + kTile - 1) / kTile, out.nb_k = (K + kTile - 1) / kTile;
  out.q.assign(static_cast<size_t>(E * N * K), 0);
  out.scales.assign(static_cast<size_t>(E * out.nb_n * out.nb_k), 0.f);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t nb = 0; nb < out.nb_n; ++nb) {
      for (int64_t kb = 0; kb < out.nb_k; ++kb) {
        const int64_t n0 = nb * kTile, n1 = std::min(N, n0 + kTile), k0 = kb * kTile, k1 = std::min(K, k0 + kTile);
        Amax am;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k) am.add(bf16_to_float(w[(e * N + n) * K + k]));
        const float s = am.scale();
        out.scales[(e * out.nb_n + nb) * out.nb_k + kb] = s;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k)
            out.q[(e * N + n) * K + k] = fp8_quantize(bf16_to_float(w[(e * N + n) * K + k]), s);
      }
    }
  }
  if (transposed) {
    out.qt.assign(out.q.size(), 0);
    out.scales_t.assign(out.scales.size(), 0.f);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) out.qt[(e * K + k) * N + n] = out.q[(e * N + n) * K + k];
      for (int64_t nb = 0; nb < out.nb_n; ++nb)
        for (int64_t kb = 0; kb < out.nb_k; ++kb)
          out.scales_t[(e * out.nb_k + kb) * out.nb_n + nb] = out.scales[(e * out.nb_n + nb) * out.nb_k + kb];
    }
  }
  return out;
}

Fp8GemmResult grouped_gemm_fp8(const uint8_t* a_q, const float* a_scales, int64_t R, const uint8_t* w_q,
                               const float* w_scales, const int32_t* offsets, int64_t E, int64_t N, int64_t K) {
  constexpr const char* fn = "ref::grouped_gemm_fp8";
  require(E >= 1 && N >= 1 && K >= 1, fn, "E/N/K", "must be >= 1");
  require(R >= 0, fn, "R", "must be >= 0");
  for (int64_t e = 0; e < E; ++e)
    require(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= R, fn, "offsets",
            "must be nondecreasing within [0, R]");
  const int64_t kb_n = (K + kTile - 1) / kTile, nb_n = (N + kTile - 1) / kTile;
  Fp8GemmResult out;
  out.R = R, out.N = N;
  out.c.assign(static_cast<size_t>(R * N), static_cast<double>(kNan));
  out.abs = out.c;
  std::vector<double> w(static_cast<size_t>(N * K)), a(static_cast<size_t>(K));
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    for (int64_t n = 0; n < N; ++n)  // W[e] dequantised, [N, K]
      for (int64_t k = 0; k < K; ++k)
        w[n * K + k] = static_cast<double>(e4m3_to_float(w_q[(e * N + n) * K + k])) *
                       static_cast<double>(w_scales[(e * nb_n + n / kTile) * kb_n + k / kTile]);
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      for (int64_t k = 0; k < K; ++k)
        a[k] = static_cast<double>(e4m3_to_float(a_q[r * K + k])) * static_cast<double>(a_scales[r * kb_n + k / kTile]);
      for (int64_t n = 0; n < N; ++n) {
        const double* wr = w.data() + n * K;
        double sum = 0, abs_sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          sum += a[k] * wr[k];
          abs_sum += std::fabs(a[k] * wr[k]);
        }
        out.c[r * N + n] = sum;
        out.abs[r * N + n] = abs_sum;
      }
    }
  }
  return out;
}

}  // namespace machmoe::ref
