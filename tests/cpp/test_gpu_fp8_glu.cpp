// The FP8 up-projection's GLU epilogue (grouped_gemm_fp8 with Fp8GemmEpilogue::Glu, machmoe/fp8.hpp)
// on the GPU: Hq, its scales, Aq and its scales against the float64 GEMM on the dequantised
// operands (fp8_gemm_test_data.hpp) plus the bias, and A against the activation of that float64 H
// (the kernel computes A from its fp32 H, not from the quantised one).
//
// Tolerances, derived (H = the float64 result + bias, abs = Σ_k |a_k·b_k|, g = 2^-10·abs the GEMM
// accumulation bound of test_gpu_fp8_gemm.cpp with its factor 2):
//   - H's scale: the GPU's amax is of its fp32 H, within g of the reference's, so
//     |448·sH − amax_ref| <= max g over the tile (+ 2^-22 relative for the division);
//   - an H code: E4M3 rounds to nearest, so |code·sH − H_gpu| <= 2^-4·|H_gpu| (normal codes) or
//     2^-10·sH (subnormal codes); with |H_gpu − H| <= g: |code·sH − H| <= 2^-4·(|H| + g) + 2^-10·sH + g;
//   - A: the GPU evaluates the activation in fp32 with approximate exp/reciprocal (relative errors
//     of a few 2^-22) on its fp32 H, within g of H: with eA bounding what a change of g in gate and
//     up moves the activation (its change over the corners of that box, twice over), A's scale is
//     within max eA + 2^-16·amax of the float64 one, and an A code within
//     2^-4·(|A| + eA) + 2^-10·sA + 2^-15·amax + eA of A.
// A structured case (every weight block its own power-of-two magnitude) makes a scale written to
// the wrong group, or from the wrong wave, fail by a factor of 2 or more.
// Outputs are poisoned with 0xff (E4M3 -NaN, fp32 NaN, never written by the epilogue): rows
// outside every expert must stay poisoned, every element of the experts' rows must be written.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp8_gemm_test_data.hpp"
#include "gpu_util.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/reference.hpp"
#include "machmoe/reference_fp8.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::GemmCase;
using mtest::GemmData;
using mtest::have_gpu;

struct GluOut {
  std::vector<uint8_t> hq, aq;          // [R, N], [R, N/2]
  std::vector<float> h_scales, a_scales;  // [R, ceil(N/128)], [R, ceil(N/256)]
  bool operator==(const GluOut& o) const {
    auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](float a, float b) {
               return std::memcmp(&a, &b, 4) == 0;
             });
    };
    return hq == o.hq && aq == o.aq && same_bits(h_scales, o.h_scales) && same_bits(a_scales, o.a_scales);
  }
};

struct GluSetup {
  Activation act = Activation::SwiGLU;
  GluClamp clamp;
  bool bias = false;
};

GluOut run_glu(const GemmData& d, const std::vector<float>& sa, const std::vector<uint16_t>& bias, const GluSetup& g) {
  const int64_t n = d.N / 2, ht = (d.N + 127) / 128, at = (n + 127) / 128;
  GluOut o;  // host copies, sized as the outputs
  o.hq.assign(static_cast<size_t>(d.R * d.N), 0), o.aq.assign(static_cast<size_t>(d.R * n), 0);
  o.h_scales.assign(static_cast<size_t>(d.R * ht), 0.f), o.a_scales.assign(static_cast<size_t>(d.R * at), 0.f);
  const size_t hs_bytes = o.h_scales.size() * 4, as_bytes = o.a_scales.size() * 4;
  DeviceBuffer aq_in(d.a.q.size()), das(sa.size() * 4), wq(d.w.q.size()), dsb(d.w.scales.size() * 4),
      off(d.offsets.size() * 4), tiles(d.offsets.size() * 4), dg(d.gather.size() * 4), db(bias.size() * 2),
      hq(o.hq.size()), hs(hs_bytes), aq(o.aq.size()), as(as_bytes);
  mtest::upload(d.a.q, aq_in);
  mtest::upload(sa, das);
  mtest::upload(d.w.q, wq);
  mtest::upload(d.w.scales, dsb);
  mtest::upload(d.offsets, off);
  mtest::upload(d.gather, dg);
  mtest::upload(bias, db);
  EXPECT_EQ(cudaMemset(hq.ptr, 0xff, o.hq.size()), cudaSuccess);
  EXPECT_EQ(cudaMemset(aq.ptr, 0xff, o.aq.size()), cudaSuccess);
  EXPECT_EQ(cudaMemset(hs.ptr, 0xff, hs_bytes), cudaSuccess);
  EXPECT_EQ(cudaMemset(as.ptr, 0xff, as_bytes), cudaSuccess);
  GroupedGemmFp8Args a;
  a.a_q = static_cast<const uint8_t*>(aq_in.ptr), a.a_scales = static_cast<const float*>(das.ptr), a.R = d.R;
  if (!d.gather.empty()) a.gather = static_cast<const int32_t*>(dg.ptr), a.T = d.T;
  a.w_q = static_cast<const uint8_t*>(wq.ptr), a.w_scales = static_cast<const float*>(dsb.ptr);
  a.expert_offsets = static_cast<const int32_t*>(off.ptr);
  a.E = d.E, a.N = d.N, a.K = d.K;
  a.tile_offsets = static_cast<int32_t*>(tiles.ptr);
  a.epilogue = Fp8GemmEpilogue::Glu;
  a.activation = g.act, a.glu_clamp = g.clamp;
  a.bias = g.bias ? db.ptr : nullptr;
  a.hq = static_cast<uint8_t*>(hq.ptr), a.h_scales = static_cast<float*>(hs.ptr);
  a.act_q = static_cast<uint8_t*>(aq.ptr), a.act_scales = static_cast<float*>(as.ptr);
  grouped_gemm_fp8(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (d.R > 0) {
    EXPECT_EQ(cudaMemcpy(o.hq.data(), hq.ptr, o.hq.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(o.aq.data(), aq.ptr, o.aq.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(o.h_scales.data(), hs.ptr, hs_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(o.a_scales.data(), as.ptr, as_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return o;
}

double decode(uint8_t code, float scale) { return static_cast<double>(ref::e4m3_to_float(code)) * scale; }

bool poisoned(float s) {
  uint32_t b;
  std::memcpy(&b, &s, 4);
  return b == 0xffffffffu;
}

// Checks one case's outputs (failures through gtest, the first eight in full).
void check_glu(const GemmData& d, const GluOut& o, const std::vector<uint16_t>& bias, const GluSetup& g) {
  const int64_t N = d.N, n = N / 2, ht = (N + 127) / 128, at = (n + 127) / 128;
  const ref::Fp8GemmResult want = mtest::reference(d, d.gather);
  int failures = 0;
  auto fail = [&](const std::string& what) { ADD_FAILURE_AT(__FILE__, __LINE__) << what; return ++failures < 8; };
  for (int64_t r = 0; r < d.R && failures < 8; ++r) {
    const bool covered = !std::isnan(want.c[r * N]);
    if (!covered) {  // outside every expert: nothing written
      for (int64_t c = 0; c < N; ++c) if (o.hq[r * N + c] != 0xff && !fail("row " + std::to_string(r) + " hq written")) return;
      for (int64_t c = 0; c < n; ++c) if (o.aq[r * n + c] != 0xff && !fail("row " + std::to_string(r) + " aq written")) return;
      continue;
    }
    int64_t e = 0;
    while (d.offsets[e + 1] <= r) ++e;
    // H: per 128-column group, the scale and the codes.
    std::vector<double> h(N), hd(N);
    for (int64_t c = 0; c < N; ++c) h[c] = want.c[r * N + c] + (g.bias ? ref::bf16_to_float(bias[e * N + c]) : 0.0);
    for (int64_t t = 0; t < ht; ++t) {
      const int64_t c0 = 128 * t, c1 = std::min(N, c0 + 128);
      double amax = 0, gmax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(h[c])), gmax = std::max(gmax, std::ldexp(want.abs[r * N + c], -10));
      const float s = o.h_scales[r * ht + t];
      if (poisoned(s) || !(std::fabs(448.0 * s - amax) <= gmax + std::ldexp(amax, -22)))
        if (!fail("row " + std::to_string(r) + " H group " + std::to_string(t) + ": scale " + std::to_string(s) +
                  ", 448·s vs amax " + std::to_string(amax))) return;
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t code = o.hq[r * N + c];
        hd[c] = decode(code, s);
        const double gerr = std::ldexp(want.abs[r * N + c], -10);
        const double tol = std::ldexp(std::fabs(h[c]) + gerr, -4) + std::ldexp(static_cast<double>(s), -10) + gerr;
        if (code == 0xff || !(std::fabs(hd[c] - h[c]) <= tol))
          if (!fail("row " + std::to_string(r) + " H col " + std::to_string(c) + ": code " + std::to_string(code) +
                    " -> " + std::to_string(hd[c]) + ", want " + std::to_string(h[c]))) return;
      }
    }
    // A from the float64 H (the kernel's comes from its fp32 H, which differs from it by at most
    // the accumulation bound gerr per element): ea[j] bounds what that moves A, the largest change
    // of act over the corners of the (gate, up) box of half-width gerr, twice over.
    std::vector<double> a(n), ea(n);
    for (int64_t j = 0; j < n; ++j) {
      ref::activation_forward(g.act, GateUpLayout::Interleaved, 1, h.data() + 2 * j, a.data() + j, g.clamp);
      const double eg = std::ldexp(want.abs[r * N + 2 * j], -10), eu = std::ldexp(want.abs[r * N + 2 * j + 1], -10);
      for (double sg : {-1.0, 1.0})
        for (double su : {-1.0, 1.0}) {
          const double corner[2] = {h[2 * j] + sg * eg, h[2 * j + 1] + su * eu};
          double ac = 0;
          ref::activation_forward(g.act, GateUpLayout::Interleaved, 1, corner, &ac, g.clamp);
          ea[j] = std::max(ea[j], 2 * std::fabs(ac - a[j]));
        }
    }
    for (int64_t t = 0; t < at; ++t) {
      const int64_t j0 = 128 * t, j1 = std::min(n, j0 + 128);
      double amax = 0, emax = 0;
      for (int64_t j = j0; j < j1; ++j) amax = std::max(amax, std::fabs(a[j])), emax = std::max(emax, ea[j]);
      const float s = o.a_scales[r * at + t];
      if (poisoned(s) || !(std::fabs(448.0 * s - amax) <= emax + std::ldexp(amax, -16)))
        if (!fail("row " + std::to_string(r) + " A group " + std::to_string(t) + ": scale " + std::to_string(s) +
                  ", 448·s vs amax " + std::to_string(amax))) return;
      for (int64_t j = j0; j < j1; ++j) {
        const uint8_t code = o.aq[r * n + j];
        const double got = decode(code, s);
        const double tol = std::ldexp(std::fabs(a[j]) + ea[j], -4) + std::ldexp(static_cast<double>(s), -10) +
                           std::ldexp(amax, -15) + ea[j];
        if (code == 0xff || !(std::fabs(got - a[j]) <= tol))
          if (!fail("row " + std::to_string(r) + " A col " + std::to_string(j) + ": code " + std::to_string(code) +
                    " -> " + std::to_string(got) + ", want " + std::to_string(a[j]))) return;
      }
    }
  }
}

std::vector<uint16_t> random_bias(const GemmData& d, mtest::Rng& rng) {
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  std::vector<uint16_t> b(static_cast<size_t>(d.E * d.N));
  for (auto& v : b) v = ref::float_to_bf16(static_cast<float>(u(rng)));
  return b;
}

void check_case(const GemmCase& k, const GluSetup& g, uint64_t salt) {
  const uint64_t seed = mtest::test_seed(salt);
  SCOPED_TRACE(mtest::seed_msg(seed));
  SCOPED_TRACE("N=" + std::to_string(k.N) + " K=" + std::to_string(k.K) + " T=" + std::to_string(k.T) +
               " activation " + std::to_string(static_cast<int>(g.act)) + (g.bias ? " bias" : ""));
  mtest::Rng rng(seed);
  const GemmData d = mtest::make_data(k, rng);
  const std::vector<uint16_t> bias = random_bias(d, rng);
  const GluOut o = run_glu(d, d.a.scales, bias, g);
  check_glu(d, o, bias, g);
  EXPECT_TRUE(run_glu(d, d.a.scales, bias, g) == o) << "two calls differ";
}

TEST(GpuFp8Glu, SwiGLUPartialTilesAnEmptyExpertAndATail) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  // N = 288: a full 256-column tile and a partial one (H groups 128, 128, 32; A groups 128, 16).
  check_case({{130, 0, 77, 256}, 288, 272, 0, 5}, {}, 1);
  check_case({{130, 0, 77, 256}, 288, 272, 0, 5}, {Activation::SwiGLU, {}, true}, 2);
}

TEST(GpuFp8Glu, GatheredWithBiasAndEveryGluKind) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const GemmCase k{{100, 3, 0, 160}, 800, 400, 0, 0, false, 0, 211};  // n = 400: A groups 128 x 3 + 16
  check_case(k, {Activation::SwiGLU, {}, true}, 3);
  check_case(k, {Activation::GeGLU, {}, false}, 4);
  check_case(k, {Activation::ReGLU, {}, true}, 5);
  check_case(k, {Activation::ClampedSwiGLU, {1.702f, 7.f, 1.f, false}, true}, 6);  // gpt-oss
  check_case(k, {Activation::ClampedSwiGLU, {1.f, 10.f, 0.f, true}, false}, 7);    // clamp after the activation
}

TEST(GpuFp8Glu, StructuredMagnitudesCatchMisplacedScales) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_case({{150, 0, 90}, 512, 384, 0, 0, true, 0, 97}, {}, 8);
  check_case({{150, 40}, 512, 384, 0, 3, true}, {Activation::SwiGLU, {}, true}, 9);
}

TEST(GpuFp8Glu, ANonFiniteRowGivesNanCodesAndScales) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  mtest::Rng rng(mtest::test_seed(10));
  GemmData d = mtest::make_data({{60, 70}, 256, 256}, rng);
  std::vector<float> sa = d.a.scales;
  const int64_t bad = 17;
  sa[bad * d.a.tiles] = std::nanf("");  // row 17's first K block: H and A of that row are NaN
  const GluOut o = run_glu(d, sa, {}, {});
  const int64_t N = d.N, n = N / 2;
  for (int64_t c = 0; c < N; ++c) ASSERT_EQ(o.hq[bad * N + c], 0x7f) << c;
  for (int64_t j = 0; j < n; ++j) ASSERT_EQ(o.aq[bad * n + j], 0x7f) << j;
  EXPECT_TRUE(std::isnan(o.h_scales[bad * 2]) && std::isnan(o.h_scales[bad * 2 + 1]) && std::isnan(o.a_scales[bad]));
  EXPECT_TRUE(std::isfinite(o.h_scales[(bad + 1) * 2]) && std::isfinite(o.a_scales[bad + 1]));
}

TEST(GemmFp8GluApi, RefusesBadArguments) {
  // Fake device addresses: every call below is refused before it touches one.
  auto* p16 = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  auto* f16 = reinterpret_cast<float*>(p16 + 4096);
  GroupedGemmFp8Args base;
  base.a_q = p16, base.a_scales = f16, base.R = 256, base.w_q = p16, base.w_scales = f16;
  base.expert_offsets = reinterpret_cast<int32_t*>(p16 + 8192), base.E = 4, base.N = 256, base.K = 256;
  base.epilogue = Fp8GemmEpilogue::Glu, base.hq = p16, base.h_scales = f16, base.act_q = p16, base.act_scales = f16;
  auto refused = [&](auto change, const char* arg, const char* what) {
    mtest::expect_refused(base, change, arg, what, [](const GroupedGemmFp8Args& a) { grouped_gemm_fp8(a, nullptr); });
  };
  using A = GroupedGemmFp8Args;
  refused([](A& a) { a.N = 240; }, "N", "N not a multiple of 32");
  refused([](A& a) { a.activation = Activation::ReLU; }, "activation", "not a GLU kind");
  refused([](A& a) { a.act_q = nullptr; }, "hq/h_scales/act_q/act_scales", "act_q null");
  refused([&](A& a) { a.hq = p16 + 8; }, "hq/act_q", "hq misaligned");
  refused([&](A& a) { a.act_scales = reinterpret_cast<float*>(p16 + 2); }, "h_scales/act_scales", "act_scales misaligned");
  refused([&](A& a) { a.bias = p16 + 1; }, "bias", "bias misaligned");
  refused([&](A& a) {
    a.epilogue = Fp8GemmEpilogue::Store, a.c = p16, a.ldc = 256, a.bias = p16;
    a.gather = reinterpret_cast<int32_t*>(p16), a.T = 256;
  }, "bias", "a bias with a gather and the plain store");
  refused([&](A& a) { a.epilogue = Fp8GemmEpilogue::Store, a.c = p16, a.ldc = 256, a.bias = p16 + 1; }, "bias",
          "a misaligned bias with the plain store");
  refused([](A& a) { a.epilogue = static_cast<Fp8GemmEpilogue>(7); }, "epilogue", "an unknown epilogue");
}

}  // namespace
