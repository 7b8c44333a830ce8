// The FP8 GEMM tests' problems (test_gpu_fp8_gemm.cpp, test_gpu_fp8_glu.cpp): experts' row
// counts, random or structured bf16 operands quantised by the CPU reference quantisers (bitwise
// what the GPU quantisers write), an optional gather, and the float64 GEMM on the dequantised
// operands (machmoe/reference_fp8.hpp).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gpu_util.hpp"
#include "machmoe/reference_fp8.hpp"
#include "test_util.hpp"

namespace mtest {

using namespace machmoe;

// A problem: experts' row counts, then `tail` rows after the last expert that no expert covers.
struct GemmCase {
  std::vector<int32_t> rows;  // [E]
  int64_t N = 0, K = 0, ldc = 0;  // ldc 0: N
  int64_t tail = 0;
  bool structured = false;  // power-of-two magnitudes per (row, K block) of A and per weight block
  int max_ctas = 0;
  int64_t T = 0;  // > 0: gathered, Aq [T, K] and gather [R] random in [0, T); 0: contiguous
};

struct GemmData {
  int64_t E = 0, R = 0, N = 0, K = 0, ldc = 0, T = 0;
  std::vector<int32_t> offsets;  // [E+1]
  std::vector<int32_t> gather;   // [R] (gathered cases), else empty
  ref::Fp8Rows a;                // q [T, K], scales [T, KB] (T = R when contiguous)
  ref::Fp8Weights w;             // q [E, N, K], scales [E, NB, KB]
};

// A's rows as the GEMM reads them: a.q and a.scales through `gather` (empty: a itself); an index
// outside [0, T) reads row 0 (the callers that use one check those rows apart).
inline ref::Fp8Rows gathered_rows(const ref::Fp8Rows& a, const std::vector<int32_t>& gather) {
  if (gather.empty()) return a;
  ref::Fp8Rows g;
  g.R = static_cast<int64_t>(gather.size()), g.d = a.d, g.tiles = a.tiles;
  for (const int32_t t : gather) {
    const int64_t row = t >= 0 && t < a.R ? t : 0;
    g.q.insert(g.q.end(), a.q.begin() + row * a.d, a.q.begin() + (row + 1) * a.d);
    g.scales.insert(g.scales.end(), a.scales.begin() + row * a.tiles, a.scales.begin() + (row + 1) * a.tiles);
  }
  return g;
}

inline ref::Fp8GemmResult reference(const GemmData& d, const std::vector<int32_t>& gather) {
  const ref::Fp8Rows a = gathered_rows(d.a, gather);
  return ref::grouped_gemm_fp8(a.q.data(), a.scales.data(), d.R, d.w.q.data(), d.w.scales.data(), d.offsets.data(),
                               d.E, d.N, d.K);
}

// Magnitude 2^(m mod 9 - 4) for a block index m: nine distinct scales, neighbours a factor 2 apart.
inline double magnitude(int64_t m) { return std::ldexp(1.0, static_cast<int>(m % 9) - 4); }

inline GemmData make_data(const GemmCase& k, mtest::Rng& rng) {
  GemmData d;
  d.E = static_cast<int64_t>(k.rows.size());
  d.N = k.N, d.K = k.K, d.ldc = k.ldc ? k.ldc : k.N;
  d.offsets.assign(static_cast<size_t>(d.E + 1), 0);
  for (int64_t e = 0; e < d.E; ++e) d.offsets[e + 1] = d.offsets[e] + k.rows[e];
  d.R = d.offsets[d.E] + k.tail;
  d.T = k.T > 0 ? k.T : d.R;
  if (k.T > 0)
    for (int64_t r = 0; r < d.R; ++r) d.gather.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(k.T)));
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<uint16_t> x(static_cast<size_t>(d.T * d.K)), w(static_cast<size_t>(d.E * d.N * d.K));
  for (int64_t r = 0; r < d.T; ++r)
    for (int64_t c = 0; c < d.K; ++c)
      x[r * d.K + c] = ref::float_to_bf16(static_cast<float>(u(rng) * (k.structured ? magnitude(5 * r + c / 128) : 1.0)));
  for (int64_t e = 0; e < d.E; ++e)
    for (int64_t n = 0; n < d.N; ++n)
      for (int64_t c = 0; c < d.K; ++c) {
        const double m = k.structured ? magnitude(7 * e + 3 * (n / 128) + c / 128 + 1) : 0.05;
        w[(e * d.N + n) * d.K + c] = ref::float_to_bf16(static_cast<float>(u(rng) * m));
      }
  d.a = ref::quantize_rows_fp8(x.data(), d.T, d.K, d.K, nullptr, d.T);
  d.w = ref::quantize_weights_fp8(w.data(), d.E, d.N, d.K, false);
  return d;
}

template <typename T>
inline void upload(const std::vector<T>& h, DeviceBuffer& dst) {
  if (!h.empty()) ASSERT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

}  // namespace mtest
