// The C++ API without Python: machmoe::layer_backward on the GPU (after layer_forward) against the
// CPU reference in double (machmoe::ref::layer_backward) on the same bf16-valued inputs, with the
// aux loss in the loss (d_aux != 0). Also: exact zeros for experts without rows, and two calls
// giving bitwise-identical gradients. Skips without a GPU (scripts/gpu_check.sh runs it there).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpu_util.hpp"
#include "machmoe/machmoe.hpp"
#include "machmoe/reference.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::download;
using mtest::expect_bitwise_rerun;
using mtest::GradOut;
using mtest::have_gpu;
using mtest::poison;
using mtest::rel_err;
using mtest::upload_bf16;

struct Case {
  int64_t T, d, n, E, K;
  Activation act = Activation::SwiGLU;
  bool bias = false;
  GateUpLayout layout = GateUpLayout::Interleaved;
  RoutingMethod routing = RoutingMethod::SoftmaxTopK;
  bool renormalize = true;
  TokenRounding rounding = TokenRounding::None;
  int64_t tile_m = 8;
  DType grad_dtype = DType::BF16;
};

std::string describe(const Case& c) {
  return "T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" + std::to_string(c.n) +
         " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) + " " + to_string(c.act) + " bias=" +
         std::to_string(c.bias) + " " + to_string(c.layout) + " " + to_string(c.routing) + " rounding=" +
         to_string(c.rounding) + " grads=" + to_string(c.grad_dtype);
}

void check_layer_backward(const Case& c) {
  SCOPED_TRACE(describe(c));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(c.T * 131 + c.E * 7 + static_cast<int>(c.act)));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  LayerProblem p;
  p.T = c.T, p.d = c.d, p.n = c.n, p.E = c.E, p.K = c.K;
  p.activation = c.act, p.layout = c.layout, p.has_bias = c.bias;
  p.routing = c.routing, p.renormalize = c.renormalize;
  p.rounding = c.rounding, p.rounding_tile_m = c.tile_m;
  const int64_t T = c.T, d = c.d, n = c.n, E = c.E, n1 = is_glu(c.act) ? 2 * n : n;
  const uint64_t rounding_seed = 4242;
  const float d_aux = 0.37f;

  DeviceBuffer x(T * d * 2), wr(E * d * 2), w1(E * n1 * d * 2), w2(E * d * n * 2), b1(E * n1 * 2), b2(E * d * 2),
      dout(T * d * 2);
  const auto hx = upload_bf16(rng, T * d, 1.0, x);
  const auto hwr = upload_bf16(rng, E * d, 0.5, wr);
  const auto hw1 = upload_bf16(rng, E * n1 * d, 1.0 / std::sqrt(double(d)), w1);
  const auto hw2 = upload_bf16(rng, E * d * n, 1.0 / std::sqrt(double(n)), w2);
  const auto hb1 = upload_bf16(rng, E * n1, 0.1, b1);
  const auto hb2 = upload_bf16(rng, E * d, 0.1, b2);
  const auto hdout = upload_bf16(rng, T * d, 1.0, dout);

  const WorkspacePlan plan = plan_workspace(p);
  DeviceBuffer out(T * d * 2), aux(4), saved(plan.saved_bytes), fws(plan.forward_workspace_bytes),
      bws(plan.backward_workspace_bytes);
  LayerForwardArgs fa;
  fa.x = x.ptr, fa.router_weight = wr.ptr, fa.w1 = w1.ptr, fa.w2 = w2.ptr;
  fa.b1 = c.bias ? b1.ptr : nullptr, fa.b2 = c.bias ? b2.ptr : nullptr;
  fa.out = out.ptr, fa.aux_loss = static_cast<float*>(aux.ptr), fa.saved = saved.ptr, fa.workspace = fws.ptr;
  fa.seed = rounding_seed;
  layer_forward(p, fa, nullptr);

  const size_t gs = c.grad_dtype == DType::FP32 ? 4 : 2;
  const bool fp32 = c.grad_dtype == DType::FP32;
  GradOut dx("dx", T * d, 2), dwr("d_router_weight", E * d, gs), dw1("dw1", E * n1 * d, gs), db1("db1", E * n1, gs),
      dw2("dw2", E * d * n, gs), db2("db2", E * d, gs);
  const std::vector<GradOut*> outs = {&dx, &dwr, &dw1, &db1, &dw2, &db2};
  LayerBackwardArgs ba;
  ba.x = x.ptr, ba.router_weight = wr.ptr, ba.w1 = w1.ptr, ba.w2 = w2.ptr;
  ba.b1 = c.bias ? b1.ptr : nullptr, ba.b2 = c.bias ? b2.ptr : nullptr;
  ba.saved = saved.ptr, ba.dout = dout.ptr, ba.d_aux = d_aux;
  ba.dx = dx.buf.ptr, ba.d_router_weight = dwr.buf.ptr, ba.dw1 = dw1.buf.ptr, ba.dw2 = dw2.buf.ptr;
  ba.db1 = c.bias ? db1.buf.ptr : nullptr, ba.db2 = c.bias ? db2.buf.ptr : nullptr;
  ba.workspace = bws.ptr;
  ba.weight_grad_dtype = c.grad_dtype;
  poison(outs, bws.ptr, plan.backward_workspace_bytes);
  layer_backward(p, ba, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  ref::LayerConfig cfg;
  cfg.shape = {T, d, n, E, c.act, c.layout, c.bias};
  cfg.K = c.K;
  cfg.routing = c.routing;
  cfg.renormalize = c.renormalize;
  cfg.rounding = {c.rounding, c.tile_m, rounding_seed};
  const ref::Weights rw{hw1.data(), hb1.data(), hw2.data(), hb2.data()};
  const auto f = ref::layer_forward(cfg, hx.data(), hwr.data(), rw, nullptr);
  const auto g = ref::layer_backward(cfg, hx.data(), hwr.data(), rw, f, hdout.data(), d_aux);

  // Tolerances: dx and the expert gradients pass through at most four bf16 roundings of 2^-9 each
  // (H, dH, dX~ or A', the output): 2^-7. The router weight's gradient also goes through the
  // softmax Jacobian, a difference of the pair scores' gradients that can cost one more bit: 2^-6.
  const std::vector<double>* want[] = {&g.dx, &g.dwr, &g.dw1, &g.db1, &g.dw2, &g.db2};
  std::vector<std::vector<double>> got(6);
  for (int i = 0; i < 6; ++i) {
    if (!c.bias && (i == 3 || i == 5)) continue;
    got[i] = download(outs[i]->buf.ptr, outs[i]->count, i > 0 && fp32);
    ASSERT_EQ(got[i].size(), want[i]->size()) << outs[i]->name;
    const double tol = i == 1 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -7);
    EXPECT_LT(rel_err(got[i], *want[i]), tol) << outs[i]->name;
  }

  // Experts without rows: exact zeros (the reference's metadata says which).
  for (int64_t e = 0; e < E; ++e) {
    if (f.md.expert_offsets[e + 1] != f.md.expert_offsets[e]) continue;
    for (int64_t i = 0; i < n1 * d; ++i) ASSERT_EQ(got[2][e * n1 * d + i], 0.0) << "dw1 of empty expert " << e;
    for (int64_t i = 0; i < d * n; ++i) ASSERT_EQ(got[4][e * d * n + i], 0.0) << "dw2 of empty expert " << e;
    if (c.bias) {
      for (int64_t i = 0; i < n1; ++i) ASSERT_EQ(got[3][e * n1 + i], 0.0) << "db1 of empty expert " << e;
      for (int64_t i = 0; i < d; ++i) ASSERT_EQ(got[5][e * d + i], 0.0) << "db2 of empty expert " << e;
    }
  }

  // A second call on the same inputs: bitwise-identical gradients (db1, db2 only with biases).
  expect_bitwise_rerun(outs, [&](size_t i) { return !c.bias && (i == 3 || i == 5); }, bws.ptr,
                       plan.backward_workspace_bytes, [&] { layer_backward(p, ba, nullptr); });
}

TEST(GpuLayerBackward, MatchesTheReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_layer_backward({200, 64, 32, 8, 2});
  check_layer_backward({67, 128, 64, 16, 4, Activation::GeGLU, true, GateUpLayout::Concatenated});
  check_layer_backward({33, 64, 48, 4, 1, Activation::ReLU2, true});
  check_layer_backward({1, 64, 32, 8, 8, Activation::SiLU});
  Case fp32{150, 64, 32, 8, 2, Activation::SwiGLU, true};
  fp32.grad_dtype = DType::FP32;
  check_layer_backward(fp32);
}

TEST(GpuLayerBackward, RoutingVariantsAndTokenRounding) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  Case c{120, 64, 32, 8, 3};
  c.routing = RoutingMethod::TopKSoftmax, c.renormalize = false;
  check_layer_backward(c);
  c.routing = RoutingMethod::Sigmoid, c.renormalize = true, c.bias = true;
  check_layer_backward(c);
  Case r{100, 64, 32, 8, 2, Activation::SwiGLU, true};
  r.rounding = TokenRounding::Nearest;
  check_layer_backward(r);
  r.rounding = TokenRounding::Up, r.bias = false;
  check_layer_backward(r);
}

TEST(GpuLayerBackward, EmptyExpertsGetExactZeros) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_layer_backward({13, 64, 32, 64, 1, Activation::SwiGLU, true});  // at most 13 of 64 experts used
}

// T = 0: nothing to route, every gradient is written as zero; x, dout and dx are empty and null.
TEST(GpuLayerBackward, NoTokensGivesZeroGradients) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  LayerProblem p;
  p.T = 0, p.d = 64, p.n = 32, p.E = 4, p.K = 2, p.has_bias = true;
  const int64_t n1 = 64;
  const WorkspacePlan plan = plan_workspace(p);
  DeviceBuffer in(1 << 20), saved(plan.saved_bytes), ws(plan.backward_workspace_bytes), dwr(4 * 64 * 2),
      dw1(4 * n1 * 64 * 2), db1(4 * n1 * 2), dw2(4 * 64 * 32 * 2), db2(4 * 64 * 2);
  const std::vector<std::pair<DeviceBuffer*, int64_t>> grads = {
      {&dwr, 4 * 64}, {&dw1, 4 * n1 * 64}, {&db1, 4 * n1}, {&dw2, 4 * 64 * 32}, {&db2, 4 * 64}};
  for (const auto& [buf, count] : grads) ASSERT_EQ(cudaMemset(buf->ptr, 0xff, count * 2), cudaSuccess);
  LayerBackwardArgs a;
  a.router_weight = a.w1 = a.w2 = a.b1 = a.b2 = in.ptr;  // x, dout, dx: empty, null as torch gives them
  a.saved = saved.ptr, a.workspace = ws.ptr;
  a.d_router_weight = dwr.ptr, a.dw1 = dw1.ptr, a.db1 = db1.ptr, a.dw2 = dw2.ptr, a.db2 = db2.ptr;
  layer_backward(p, a, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const auto& [buf, count] : grads)
    for (double v : download(buf->ptr, count)) ASSERT_EQ(v, 0.0);
}

}  // namespace
