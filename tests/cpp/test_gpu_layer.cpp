// The C++ API without Python: machmoe::layer_forward on the GPU against the CPU reference in
// double (machmoe::ref::layer_forward) on the same bf16-valued inputs. Skips without a GPU
// (CI has none; scripts/gpu_check.sh runs it on the device).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "machmoe/machmoe.hpp"
#include "machmoe/reference.hpp"
#include "gpu_util.hpp"

namespace {

using namespace machmoe;

using mtest::DeviceBuffer;
using mtest::have_gpu;
using mtest::rel_err;
using mtest::upload_bf16;

void check_layer_forward(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, Activation act, bool bias,
                         GateUpLayout layout) {
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(T * 131 + E * 7 + static_cast<int>(act)));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  LayerProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.K = K;
  p.activation = act;
  p.layout = layout;
  p.has_bias = bias;
  const int64_t n1 = is_glu(act) ? 2 * n : n;
  DeviceBuffer x(T * d * 2), wr(E * d * 2), w1(E * n1 * d * 2), w2(E * d * n * 2), b1(E * n1 * 2), b2(E * d * 2);
  const auto hx = upload_bf16(rng, T * d, 1.0, x);
  const auto hwr = upload_bf16(rng, E * d, 0.5, wr);
  const auto hw1 = upload_bf16(rng, E * n1 * d, 1.0 / std::sqrt(double(d)), w1);
  const auto hw2 = upload_bf16(rng, E * d * n, 1.0 / std::sqrt(double(n)), w2);
  const auto hb1 = upload_bf16(rng, E * n1, 0.1, b1);
  const auto hb2 = upload_bf16(rng, E * d, 0.1, b2);

  const WorkspacePlan plan = plan_workspace(p);
  DeviceBuffer out(T * d * 2), aux(4), saved(plan.saved_bytes), ws(plan.forward_workspace_bytes);
  ASSERT_EQ(cudaMemset(out.ptr, 0xff, T * d * 2), cudaSuccess);  // poison: NaN bf16
  LayerForwardArgs a;
  a.x = x.ptr, a.router_weight = wr.ptr, a.w1 = w1.ptr, a.w2 = w2.ptr;
  a.b1 = bias ? b1.ptr : nullptr, a.b2 = bias ? b2.ptr : nullptr;
  a.out = out.ptr, a.aux_loss = static_cast<float*>(aux.ptr), a.saved = saved.ptr, a.workspace = ws.ptr;
  layer_forward(p, a, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<__nv_bfloat16> hout(T * d);
  float haux = 0;
  ASSERT_EQ(cudaMemcpy(hout.data(), out.ptr, T * d * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&haux, aux.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<double> got(T * d);
  for (int64_t i = 0; i < T * d; ++i) got[i] = __bfloat162float(hout[i]);

  ref::LayerConfig c;
  c.shape = {T, d, n, E, act, layout, bias};
  c.K = K;
  const auto f = ref::layer_forward(c, hx.data(), hwr.data(), {hw1.data(), hb1.data(), hw2.data(), hb2.data()},
                                    nullptr);
  // Four bf16 roundings (H, A, Y, out) of 2^-9 each bound the relative error: 2^-7.
  EXPECT_LT(rel_err(got, f.experts.out), std::ldexp(1.0, -7));
  EXPECT_NEAR(haux, f.aux, 1e-4 * std::fabs(f.aux) + 1e-6);
}

TEST(GpuLayerForward, MatchesTheReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_layer_forward(200, 64, 32, 8, 2, Activation::SwiGLU, false, GateUpLayout::Interleaved);
  check_layer_forward(67, 128, 64, 16, 4, Activation::GeGLU, true, GateUpLayout::Concatenated);
  check_layer_forward(33, 64, 48, 4, 1, Activation::ReLU2, true, GateUpLayout::Interleaved);
  check_layer_forward(1, 64, 32, 8, 8, Activation::SiLU, false, GateUpLayout::Interleaved);
}

}  // namespace
