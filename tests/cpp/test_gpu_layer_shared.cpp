// The C++ API without Python: a layer with S shared experts in the routed launch
// (LayerProblem::num_shared), weighted by 1, by given per-token scores (has_shared_scores) or by
// Qwen's gate computed in the call (has_shared_gate), on the GPU against the CPU reference in
// double (machmoe::ref::layer_forward / layer_backward with num_shared) on the same bf16-valued
// inputs: the output, the aux loss and every gradient, d_shared_scores or the gate's gradient
// included. The gate composes on the reference by the chain rule (g_t = sigmoid(x_t·g)):
//   d g = Σ_t d_shared_scores[t]·g_t(1 − g_t)·x_t,   dx_t += d_shared_scores[t]·g_t(1 − g_t)·g.
// Also: poisoned outputs and workspace, two calls bitwise equal. Skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_util.hpp"
#include "machmoe/machmoe.hpp"
#include "machmoe/reference.hpp"

namespace {

using namespace machmoe;
using mtest::DeviceBuffer;
using mtest::download;
using mtest::GradOut;
using mtest::have_gpu;
using mtest::poison;
using mtest::rel_err;
using mtest::upload_bf16;

enum class SharedWeight { One, Scores, Gate };

struct Case {
  int64_t T, d, n, E, K, S;
  SharedWeight weight = SharedWeight::One;
  bool bias = false;
};

std::string describe(const Case& c) {
  const char* w = c.weight == SharedWeight::One ? "1" : c.weight == SharedWeight::Scores ? "scores" : "gate";
  return "T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" + std::to_string(c.n) + " E=" +
         std::to_string(c.E) + " K=" + std::to_string(c.K) + " S=" + std::to_string(c.S) + " weight=" + w +
         " bias=" + std::to_string(c.bias);
}

void check_shared_layer(const Case& c) {
  SCOPED_TRACE(describe(c));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(c.T * 17 + c.S * 5 + static_cast<int>(c.weight)));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const int64_t T = c.T, d = c.d, n = c.n, E = c.E, S = c.S, EA = E + S, n1 = 2 * n;
  LayerProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.K = c.K, p.has_bias = c.bias;
  p.num_shared = S;
  p.has_shared_scores = c.weight == SharedWeight::Scores;
  p.has_shared_gate = c.weight == SharedWeight::Gate;
  const float d_aux = 0.37f;

  DeviceBuffer x(T * d * 2), wr(E * d * 2), w1(EA * n1 * d * 2), w2(EA * d * n * 2), b1(EA * n1 * 2),
      b2(EA * d * 2), gate(d * 2), scores(T * 4), dout(T * d * 2);
  const auto hx = upload_bf16(rng, T * d, 1.0, x);
  const auto hwr = upload_bf16(rng, E * d, 0.5, wr);
  const auto hw1 = upload_bf16(rng, EA * n1 * d, 1.0 / std::sqrt(double(d)), w1);
  const auto hw2 = upload_bf16(rng, EA * d * n, 1.0 / std::sqrt(double(n)), w2);
  const auto hb1 = upload_bf16(rng, EA * n1, 0.1, b1);
  const auto hb2 = upload_bf16(rng, EA * d, 0.1, b2);
  const auto hgate = upload_bf16(rng, d, 2.0 / std::sqrt(double(d)), gate);
  const auto hdout = upload_bf16(rng, T * d, 1.0, dout);
  // The shared experts' weight per token: given scores in (0, 1.5), or the gate's sigmoid (double).
  std::vector<double> shared_w(T, 1.0);
  if (c.weight == SharedWeight::Scores) {
    std::vector<float> hs(T);
    for (int64_t t = 0; t < T; ++t) hs[t] = static_cast<float>(mtest::uniform(rng, 1, 0.0, 1.5)[0]), shared_w[t] = hs[t];
    ASSERT_EQ(cudaMemcpy(scores.ptr, hs.data(), T * 4, cudaMemcpyHostToDevice), cudaSuccess);
  } else if (c.weight == SharedWeight::Gate) {
    for (int64_t t = 0; t < T; ++t) {
      double logit = 0;
      for (int64_t i = 0; i < d; ++i) logit += hx[t * d + i] * hgate[i];
      shared_w[t] = 1.0 / (1.0 + std::exp(-logit));
    }
  }

  const WorkspacePlan plan = plan_workspace(p);
  DeviceBuffer out(T * d * 2), aux(4), saved(plan.saved_bytes), fws(plan.forward_workspace_bytes),
      bws(plan.backward_workspace_bytes);
  ASSERT_EQ(cudaMemset(out.ptr, 0xff, T * d * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(fws.ptr, 0xff, plan.forward_workspace_bytes), cudaSuccess);
  LayerForwardArgs fa;
  fa.x = x.ptr, fa.router_weight = wr.ptr, fa.w1 = w1.ptr, fa.w2 = w2.ptr;
  fa.b1 = c.bias ? b1.ptr : nullptr, fa.b2 = c.bias ? b2.ptr : nullptr;
  fa.shared_scores = p.has_shared_scores ? static_cast<const float*>(scores.ptr) : nullptr;
  fa.shared_gate = p.has_shared_gate ? gate.ptr : nullptr;
  fa.out = out.ptr, fa.aux_loss = static_cast<float*>(aux.ptr), fa.saved = saved.ptr, fa.workspace = fws.ptr;
  layer_forward(p, fa, nullptr);

  GradOut dx("dx", T * d, 2), dwr("d_router_weight", E * d, 2), dw1("dw1", EA * n1 * d, 2), db1("db1", EA * n1, 2),
      dw2("dw2", EA * d * n, 2), db2("db2", EA * d, 2), dshared("d_shared_scores", T, 4), dgate("d_shared_gate", d, 2);
  const std::vector<GradOut*> outs = {&dx, &dwr, &dw1, &db1, &dw2, &db2, &dshared, &dgate};
  LayerBackwardArgs ba;
  ba.x = x.ptr, ba.router_weight = wr.ptr, ba.w1 = w1.ptr, ba.w2 = w2.ptr;
  ba.b1 = c.bias ? b1.ptr : nullptr, ba.b2 = c.bias ? b2.ptr : nullptr;
  ba.saved = saved.ptr, ba.dout = dout.ptr, ba.d_aux = d_aux;
  ba.dx = dx.buf.ptr, ba.d_router_weight = dwr.buf.ptr, ba.dw1 = dw1.buf.ptr, ba.dw2 = dw2.buf.ptr;
  ba.db1 = c.bias ? db1.buf.ptr : nullptr, ba.db2 = c.bias ? db2.buf.ptr : nullptr;
  ba.d_shared_scores = p.has_shared_scores ? static_cast<float*>(dshared.buf.ptr) : nullptr;
  ba.shared_gate = p.has_shared_gate ? gate.ptr : nullptr;
  ba.d_shared_gate = p.has_shared_gate ? dgate.buf.ptr : nullptr;
  ba.workspace = bws.ptr;
  poison(outs, bws.ptr, plan.backward_workspace_bytes);
  layer_backward(p, ba, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  ref::LayerConfig cfg;
  cfg.shape = {T, d, n, E, Activation::SwiGLU, GateUpLayout::Interleaved, c.bias};
  cfg.K = c.K;
  cfg.num_shared = S;
  const ref::Weights rw{hw1.data(), hb1.data(), hw2.data(), hb2.data()};
  const auto f = ref::layer_forward(cfg, hx.data(), hwr.data(), nullptr, rw, nullptr, shared_w.data());
  const auto g = ref::layer_backward(cfg, hx.data(), hwr.data(), rw, f, hdout.data(), d_aux);
  std::vector<double> want_dx = g.dx, want_dgate(d, 0.0);
  if (c.weight == SharedWeight::Gate) {
    for (int64_t t = 0; t < T; ++t) {
      const double dl = g.d_shared_scores[t] * shared_w[t] * (1.0 - shared_w[t]);  // ∂loss/∂(x_t·g)
      for (int64_t i = 0; i < d; ++i) want_dx[t * d + i] += dl * hgate[i], want_dgate[i] += dl * hx[t * d + i];
    }
  }

  // Tolerances as the routed layer's backward test: four bf16 roundings (2^-7); the router's and
  // the gate's gradients pass through a score Jacobian that can cost one more bit (2^-6).
  EXPECT_LT(rel_err(download(out.ptr, T * d), f.experts.out), std::ldexp(1.0, -7)) << "out";
  float got_aux = 0;
  ASSERT_EQ(cudaMemcpy(&got_aux, aux.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_NEAR(got_aux, f.aux, 1e-4 * std::abs(f.aux) + 1e-6) << "aux";
  struct Check {
    GradOut* out;
    const std::vector<double>* want;
    bool fp32;
    double tol;
  };
  std::vector<Check> checks = {{&dx, &want_dx, false, std::ldexp(1.0, -7)},
                               {&dwr, &g.dwr, false, std::ldexp(1.0, -6)},
                               {&dw1, &g.dw1, false, std::ldexp(1.0, -7)},
                               {&dw2, &g.dw2, false, std::ldexp(1.0, -7)}};
  if (c.bias) checks.push_back({&db1, &g.db1, false, std::ldexp(1.0, -7)}), checks.push_back({&db2, &g.db2, false, std::ldexp(1.0, -7)});
  if (p.has_shared_scores) checks.push_back({&dshared, &g.d_shared_scores, true, std::ldexp(1.0, -7)});
  if (p.has_shared_gate) checks.push_back({&dgate, &want_dgate, false, std::ldexp(1.0, -6)});
  for (const Check& k : checks) {
    const auto got = download(k.out->buf.ptr, k.out->count, k.fp32);
    ASSERT_EQ(got.size(), k.want->size()) << k.out->name;
    EXPECT_LT(rel_err(got, *k.want), k.tol) << k.out->name;
  }

  // A second call on the same inputs: bitwise-identical gradients (the unused outputs skipped).
  mtest::expect_bitwise_rerun(
      outs,
      [&](size_t i) {
        return (!c.bias && (i == 3 || i == 5)) || (i == 6 && !p.has_shared_scores) || (i == 7 && !p.has_shared_gate);
      },
      bws.ptr, plan.backward_workspace_bytes, [&] { layer_backward(p, ba, nullptr); });
}

TEST(GpuLayerShared, MatchesTheReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_shared_layer({200, 64, 32, 8, 2, 1});
  check_shared_layer({67, 128, 64, 16, 4, 2, SharedWeight::Scores, true});
  check_shared_layer({150, 128, 32, 8, 2, 1, SharedWeight::Gate});
  check_shared_layer({1, 64, 32, 8, 2, 1, SharedWeight::Gate, true});        // T = 1
  check_shared_layer({3000, 64, 32, 8, 2, 2, SharedWeight::Gate});           // shared wgrad cut in runs
  check_shared_layer({40, 64, 32, 264, 4, 1, SharedWeight::Gate});          // E > 256: dx by cuBLAS
}

}  // namespace
