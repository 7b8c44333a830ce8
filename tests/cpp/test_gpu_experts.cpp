// The C++ API without Python: machmoe::experts_forward / experts_backward on a general routing list,
// on the GPU, against the CPU reference in double (ref::general_forward / general_backward) on the
// same bf16-valued inputs (fp32 scores). Also: exact zeros for experts without rows, bitwise-equal
// repeats, the empty list, and the duplicate flag. Skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
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
using mtest::expect_bitwise_rerun;
using mtest::GradOut;
using mtest::have_gpu;
using mtest::poison;
using mtest::rel_err;
using mtest::upload_bf16;

struct Case {
  int64_t T, d, n, E;
  int max_per_token = 3;  // each token gets 0..max_per_token distinct experts
  Activation act = Activation::SwiGLU;
  bool bias = false;
  GateUpLayout layout = GateUpLayout::Interleaved;
  DType grad_dtype = DType::BF16;
};

std::string describe(const Case& c) {
  return "T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" + std::to_string(c.n) + " E=" +
         std::to_string(c.E) + " max/token=" + std::to_string(c.max_per_token) + " " + to_string(c.act) +
         " bias=" + std::to_string(c.bias) + " " + to_string(c.layout) + " grads=" + to_string(c.grad_dtype);
}

// Ordered by token, distinct experts per token in random order, fp32-exact scores in [-1, 1).
ref::RoutingList random_list(mtest::Rng& rng, int64_t T, int64_t E, int max_per_token) {
  ref::RoutingList l;
  std::vector<int32_t> experts(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) experts[e] = static_cast<int32_t>(e);
    std::shuffle(experts.begin(), experts.end(), rng);
    const int64_t count = std::min<int64_t>(static_cast<int64_t>(rng() % (max_per_token + 1)), E);
    for (int64_t i = 0; i < count; ++i) {
      l.token.push_back(static_cast<int32_t>(t));
      l.expert.push_back(experts[i]);
      l.score.push_back(static_cast<float>(mtest::uniform(rng, 1, -1, 1)[0]));
    }
  }
  return l;
}

template <typename T>
void upload(const std::vector<T>& h, DeviceBuffer& dst) {
  ASSERT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

void check_experts(const Case& c, const ref::RoutingList* given = nullptr, bool expect_duplicate = false) {
  SCOPED_TRACE(describe(c));
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(c.T * 131 + c.E * 7 + static_cast<int>(c.act)));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const int64_t T = c.T, d = c.d, n = c.n, E = c.E, n1 = is_glu(c.act) ? 2 * n : n;
  const ref::RoutingList list = given ? *given : random_list(rng, T, E, c.max_per_token);
  const int64_t R = list.size();
  ExpertsProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.R = R;
  p.activation = c.act, p.layout = c.layout, p.has_bias = c.bias;

  DeviceBuffer x(T * d * 2), w1(E * n1 * d * 2), w2(E * d * n * 2), b1(E * n1 * 2), b2(E * d * 2), dout(T * d * 2);
  const auto hx = upload_bf16(rng, T * d, 1.0, x);
  const auto hw1 = upload_bf16(rng, E * n1 * d, 1.0 / std::sqrt(double(d)), w1);
  const auto hw2 = upload_bf16(rng, E * d * n, 1.0 / std::sqrt(double(n)), w2);
  const auto hb1 = upload_bf16(rng, E * n1, 0.1, b1);
  const auto hb2 = upload_bf16(rng, E * d, 0.1, b2);
  const auto hdout = upload_bf16(rng, T * d, 1.0, dout);
  DeviceBuffer tok(R * 4), exp(R * 4), scores(R * 4), flag(4);
  upload(list.token, tok);
  upload(list.expert, exp);
  upload(std::vector<float>(list.score.begin(), list.score.end()), scores);

  const WorkspacePlan plan = plan_workspace(p);
  DeviceBuffer out(T * d * 2), saved(plan.saved_bytes), fws(plan.forward_workspace_bytes),
      bws(plan.backward_workspace_bytes);
  ASSERT_EQ(cudaMemset(out.ptr, 0xff, T * d * 2), cudaSuccess);  // poison: NaN bf16
  ASSERT_EQ(cudaMemset(flag.ptr, 0x7f, 4), cudaSuccess);
  ExpertsForwardArgs fa;
  fa.x = x.ptr, fa.w1 = w1.ptr, fa.w2 = w2.ptr;
  fa.b1 = c.bias ? b1.ptr : nullptr, fa.b2 = c.bias ? b2.ptr : nullptr;
  fa.scores = static_cast<const float*>(scores.ptr);
  fa.pair_token = static_cast<const int32_t*>(tok.ptr), fa.pair_expert = static_cast<const int32_t*>(exp.ptr);
  fa.out = out.ptr, fa.saved = saved.ptr, fa.workspace = fws.ptr;
  fa.duplicate_flag = static_cast<int32_t*>(flag.ptr);
  experts_forward(p, fa, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int32_t hflag = -1;
  ASSERT_EQ(cudaMemcpy(&hflag, flag.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(hflag, expect_duplicate ? 1 : 0) << "duplicate flag";

  const ref::Shape shape{T, d, n, E, c.act, c.layout, c.bias};
  const ref::Weights rw{hw1.data(), hb1.data(), hw2.data(), hb2.data()};
  const auto f = ref::general_forward(shape, hx.data(), rw, list);
  // Four bf16 roundings (H, A, Y, out) of 2^-9 each: 2^-7 (as the layer's GPU tests).
  const double tol = std::ldexp(1.0, -7);
  const auto got_out = download(out.ptr, T * d);
  if (R == 0) {
    for (double v : got_out) ASSERT_EQ(v, 0.0) << "out of an empty list";
  } else {
    EXPECT_LT(rel_err(got_out, f.experts.out), tol) << "out";
  }
  if (expect_duplicate) return;  // the backward of a repeated pair is not defined (machmoe.hpp)

  const bool fp32 = c.grad_dtype == DType::FP32;
  const size_t gs = fp32 ? 4 : 2;
  GradOut dx("dx", T * d, 2), dw1("dw1", E * n1 * d, gs), db1("db1", E * n1, gs), dw2("dw2", E * d * n, gs),
      db2("db2", E * d, gs), ds("d_scores", R, 4);
  const std::vector<GradOut*> outs = {&dx, &dw1, &db1, &dw2, &db2, &ds};
  ExpertsBackwardArgs ba;
  ba.x = x.ptr, ba.w1 = w1.ptr, ba.w2 = w2.ptr;
  ba.b1 = fa.b1, ba.b2 = fa.b2;
  ba.pair_token = fa.pair_token, ba.pair_expert = fa.pair_expert;
  ba.saved = saved.ptr, ba.dout = dout.ptr;
  ba.dx = dx.buf.ptr, ba.dw1 = dw1.buf.ptr, ba.dw2 = dw2.buf.ptr;
  ba.db1 = c.bias ? db1.buf.ptr : nullptr, ba.db2 = c.bias ? db2.buf.ptr : nullptr;
  ba.d_scores = static_cast<float*>(ds.buf.ptr);
  ba.workspace = bws.ptr;
  ba.weight_grad_dtype = c.grad_dtype;
  poison(outs, bws.ptr, plan.backward_workspace_bytes);
  experts_backward(p, ba, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto g = ref::general_backward(shape, hx.data(), rw, f, hdout.data());
  const std::vector<double>* want[] = {&g.dx, &g.dw1, &g.db1, &g.dw2, &g.db2, &g.d_score};
  std::vector<std::vector<double>> got(6);
  for (int i = 0; i < 6; ++i) {
    if (!c.bias && (i == 2 || i == 4)) continue;
    got[i] = download(outs[i]->buf.ptr, outs[i]->count, outs[i]->elem == 4);
    ASSERT_EQ(got[i].size(), want[i]->size()) << outs[i]->name;
    if (R == 0) {
      for (double v : got[i]) ASSERT_EQ(v, 0.0) << outs[i]->name << " of an empty list";
    } else {
      EXPECT_LT(rel_err(got[i], *want[i]), tol) << outs[i]->name;
    }
  }

  // Experts without rows: exact zeros (the reference's metadata says which).
  for (int64_t e = 0; e < E; ++e) {
    if (f.md.expert_offsets[e + 1] != f.md.expert_offsets[e]) continue;
    for (int64_t i = 0; i < n1 * d; ++i) ASSERT_EQ(got[1][e * n1 * d + i], 0.0) << "dw1 of empty expert " << e;
    for (int64_t i = 0; i < d * n; ++i) ASSERT_EQ(got[3][e * d * n + i], 0.0) << "dw2 of empty expert " << e;
    if (c.bias) {
      for (int64_t i = 0; i < n1; ++i) ASSERT_EQ(got[2][e * n1 + i], 0.0) << "db1 of empty expert " << e;
      for (int64_t i = 0; i < d; ++i) ASSERT_EQ(got[4][e * d + i], 0.0) << "db2 of empty expert " << e;
    }
  }
  // Tokens without pairs: dx exactly zero.
  for (int64_t t = 0; t < T; ++t) {
    if (f.md.token_offsets[t + 1] != f.md.token_offsets[t]) continue;
    for (int64_t i = 0; i < d; ++i) ASSERT_EQ(got[0][t * d + i], 0.0) << "dx of token " << t << " without pairs";
  }

  // A second call on the same inputs: bitwise-identical gradients (db1, db2 only with biases).
  expect_bitwise_rerun(outs, [&](size_t i) { return !c.bias && (i == 2 || i == 4); }, bws.ptr,
                       plan.backward_workspace_bytes, [&] { experts_backward(p, ba, nullptr); });
}

TEST(GpuExperts, MatchesTheReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_experts({200, 64, 32, 8});
  check_experts({67, 128, 64, 16, 3, Activation::GeGLU, true, GateUpLayout::Concatenated});
  check_experts({33, 64, 48, 4, 4, Activation::ReLU2, true});
  check_experts({1, 64, 32, 8, 3, Activation::SiLU});
  check_experts({150, 64, 32, 8, 2, Activation::SwiGLU, true, GateUpLayout::Interleaved, DType::FP32});
}

TEST(GpuExperts, EmptyExpertsGetExactZeros) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_experts({13, 64, 32, 64, 1, Activation::SwiGLU, true});  // at most 13 of 64 experts used
}

// R = 0: out, dx and every weight gradient are zero, d_scores is empty; nothing else runs.
TEST(GpuExperts, EmptyListGivesZeros) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const ref::RoutingList empty;
  check_experts({5, 64, 32, 4, 0, Activation::SwiGLU, true}, &empty);
}

// A repeated (token, expert) pair: the flag reports it, and the forward is still the reference's.
TEST(GpuExperts, DuplicateFlagReportsARepeatedPair) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const ref::RoutingList l{{0, 0, 0, 2, 3}, {1, 3, 1, 0, 2}, {0.5, -0.25, 0.75, 1.0, 0.125}};
  check_experts({4, 64, 32, 4}, &l, /*expect_duplicate=*/true);
}

}  // namespace
