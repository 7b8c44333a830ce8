// Helpers the FP8 tests share (test_reference_fp8.cpp, test_gpu_fp8.cpp): float bit patterns and
// random bf16 inputs that reach every exponent range of the E4M3 codes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "machmoe/reference_fp8.hpp"
#include "test_util.hpp"

namespace mtest {

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Random bf16 patterns: per-128 tile magnitudes 2^[-30, 30], a few exact zeros (both signs) and
// bf16 subnormals, so that every exponent range of the codes is used.
inline std::vector<uint16_t> random_bf16(Rng& rng, size_t count) {
  std::vector<uint16_t> h(count);
  std::uniform_real_distribution<double> u(-1, 1);
  std::uniform_int_distribution<int> ex(-30, 30), pick(0, 999);
  int e = 0;
  for (size_t i = 0; i < count; ++i) {
    if (i % 128 == 0) e = ex(rng);
    const int p = pick(rng);
    float v = static_cast<float>(std::ldexp(u(rng), e));
    if (p == 0) v = 0.f;
    if (p == 1) v = -0.f;
    if (p == 2) v = from_bits(0x00010000u * static_cast<uint32_t>(1 + pick(rng) % 100));  // bf16 subnormal
    h[i] = machmoe::ref::float_to_bf16(v);
  }
  return h;
}

}  // namespace mtest
