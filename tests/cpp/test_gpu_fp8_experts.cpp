// precision FP8 through the C++ API alone: experts_forward / experts_backward on a general routing
// list against the CPU references in double, and layer_forward / layer_backward against the bf16
// layer on the same inputs. Skips without a GPU.
//
// The tolerances come from E4M3's rounding: round to nearest with 3 mantissa bits has a relative
// error of at most 2^-4, uniform, so an rms of eps = 2^-4/√3 per quantised operand. A result whose
// path holds q quantised operands (each independent on random data) is off the unquantised result
// by about eps·√q relative (Frobenius): the tests allow twice that. Against the FP8 reference
// (machmoe/reference_fp8_layer.hpp, which quantises at the same points in double) the GPU must be
// much closer than the FP8 reference is to the unquantised one: its only differences are fp32
// accumulation, bf16 intermediates (a code flips where a bf16 rounding crosses an E4M3 rounding
// boundary) and, in dW1, the column operand taken from dH in bf16 rather than from dH's quantised
// rows (one quantisation fewer than the reference).
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
#include "machmoe/reference_fp8_layer.hpp"

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

const double kEps = std::ldexp(1.0, -4) / std::sqrt(3.0);  // rms relative error of one E4M3 rounding
double fp8_bound(int quantised_operands) { return 2 * kEps * std::sqrt(double(quantised_operands)); }

struct Case {
  int64_t T, d, n, E;
  int max_per_token = 3;  // each token gets 0..max_per_token distinct experts
  DType grad_dtype = DType::BF16;
  bool bias = false;   // the expert biases b1, b2
  bool stray = false;  // the GPU's list also holds pairs with experts outside [0, E) (no row)
};

// list with a pair of expert E or -1 (alternately) after every third token's pairs, for the GPU;
// at[q] = the index in list of the GPU list's pair q, or -1 for a stray one.
ref::RoutingList with_stray_pairs(const ref::RoutingList& list, int64_t T, int64_t E, std::vector<int64_t>& at) {
  ref::RoutingList g;
  at.clear();
  size_t p = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (; p < list.token.size() && list.token[p] == t; ++p) {
      g.token.push_back(list.token[p]), g.expert.push_back(list.expert[p]), g.score.push_back(list.score[p]);
      at.push_back(static_cast<int64_t>(p));
    }
    if (t % 3 == 0) {
      g.token.push_back(static_cast<int32_t>(t)), g.expert.push_back(t % 2 ? -1 : static_cast<int32_t>(E));
      g.score.push_back(0.5);
      at.push_back(-1);
    }
  }
  return g;
}

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
      l.score.push_back(static_cast<float>(mtest::uniform(rng, 1, 0.1, 1)[0]));
    }
  }
  return l;
}

template <typename T>
void upload(const std::vector<T>& h, DeviceBuffer& dst) {
  ASSERT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}

// One tensor against both references: within the FP8 error model of the unquantised one, and
// following the FP8 one (closer to it than `follow` times the FP8 reference's own distance).
void expect_fp8(const char* name, const std::vector<double>& got, const std::vector<double>& fp8_ref,
                const std::vector<double>& exact, int quantised_operands, double follow) {
  const double to_exact = rel_err(got, exact), to_fp8 = rel_err(got, fp8_ref), ref_gap = rel_err(fp8_ref, exact);
  std::printf("  %-9s GPU vs unquantised %.4f (bound %.4f), GPU vs FP8 reference %.4f, FP8 reference vs "
              "unquantised %.4f\n", name, to_exact, fp8_bound(quantised_operands), to_fp8, ref_gap);
  EXPECT_LT(to_exact, fp8_bound(quantised_operands)) << name << " against the unquantised reference";
  EXPECT_LT(to_fp8, follow * ref_gap) << name << " does not follow the FP8 reference's quantisation";
}

void check_fp8_experts(const Case& c) {
  const std::string what = "T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) + " n=" + std::to_string(c.n) +
                           " E=" + std::to_string(c.E) + " grads=" + to_string(c.grad_dtype) +
                           (c.bias ? " biases" : "") + (c.stray ? " stray pairs" : "");
  SCOPED_TRACE(what);
  std::printf("%s\n", what.c_str());
  const uint64_t seed = mtest::test_seed(static_cast<uint64_t>(c.T * 131 + c.E * 7 + c.d));
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const int64_t T = c.T, d = c.d, n = c.n, E = c.E, n1 = 2 * n;
  const ref::RoutingList list = random_list(rng, T, E, c.max_per_token);
  std::vector<int64_t> at;  // the GPU list's pairs in `list` (-1: stray)
  const ref::RoutingList gpu_list = c.stray ? with_stray_pairs(list, T, E, at) : list;
  const int64_t R = gpu_list.size();
  ExpertsProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.R = R;
  p.precision = Precision::FP8;
  p.has_bias = c.bias;

  DeviceBuffer x(T * d * 2), w1(E * n1 * d * 2), w2(E * d * n * 2), dout(T * d * 2);
  DeviceBuffer b1(c.bias ? E * n1 * 2 : 0), b2(c.bias ? E * d * 2 : 0);
  const auto hx = upload_bf16(rng, T * d, 1.0, x);
  const auto hw1 = upload_bf16(rng, E * n1 * d, 1.0 / std::sqrt(double(d)), w1);
  const auto hw2 = upload_bf16(rng, E * d * n, 1.0 / std::sqrt(double(n)), w2);
  const auto hdout = upload_bf16(rng, T * d, 1.0, dout);
  // Biases about the scale of the H and Y they are added to: they matter, and the GEMMs' FP8
  // error still shows.
  const auto hb1 = c.bias ? upload_bf16(rng, E * n1, 0.5, b1) : std::vector<double>();
  const auto hb2 = c.bias ? upload_bf16(rng, E * d, 0.05, b2) : std::vector<double>();
  DeviceBuffer tok(R * 4), exp(R * 4), scores(R * 4);
  upload(gpu_list.token, tok);
  upload(gpu_list.expert, exp);
  upload(std::vector<float>(gpu_list.score.begin(), gpu_list.score.end()), scores);
  DeviceBuffer wq(fp8_expert_weights_bytes(E, d, n));
  const Fp8ExpertWeights fw = quantize_expert_weights_fp8(E, d, n, w1.ptr, w2.ptr, wq.ptr, nullptr);

  const WorkspacePlan plan = plan_workspace(p);
  DeviceBuffer out(T * d * 2), saved(plan.saved_bytes), fws(plan.forward_workspace_bytes),
      bws(plan.backward_workspace_bytes);
  ASSERT_EQ(cudaMemset(out.ptr, 0xff, T * d * 2), cudaSuccess);  // poison: NaN bf16
  ASSERT_EQ(cudaMemset(fws.ptr, 0xff, plan.forward_workspace_bytes), cudaSuccess);
  ExpertsForwardArgs fa;
  fa.x = x.ptr, fa.w1 = w1.ptr, fa.w2 = w2.ptr;
  if (c.bias) fa.b1 = b1.ptr, fa.b2 = b2.ptr;
  fa.scores = static_cast<const float*>(scores.ptr);
  fa.pair_token = static_cast<const int32_t*>(tok.ptr), fa.pair_expert = static_cast<const int32_t*>(exp.ptr);
  fa.out = out.ptr, fa.saved = saved.ptr, fa.workspace = fws.ptr;
  fa.fp8_weights = &fw;
  experts_forward(p, fa, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const ref::Shape shape{T, d, n, E, Activation::SwiGLU, GateUpLayout::Interleaved, c.bias};
  const ref::Weights rw{hw1.data(), c.bias ? hb1.data() : nullptr, hw2.data(), c.bias ? hb2.data() : nullptr};
  const ref::Metadata md = ref::build_metadata(list, T, E);
  const auto exact = ref::experts_forward(shape, hx.data(), rw, list, md);
  const auto fp8 = ref::experts_forward_fp8(shape, hx.data(), rw, list, md);
  const auto got_out = download(out.ptr, T * d);
  // out: x, W1, A and W2 quantised; the GPU's differences are bf16 roundings of Y and out.
  expect_fp8("out", got_out, fp8.out, exact.out, 4, 0.25);

  const size_t gs = c.grad_dtype == DType::FP32 ? 4 : 2;
  GradOut dx("dx", T * d, 2), dw1("dw1", E * n1 * d, gs), dw2("dw2", E * d * n, gs), ds("d_scores", R, 4);
  GradOut db1("db1", c.bias ? E * n1 : 0, gs), db2("db2", c.bias ? E * d : 0, gs);
  std::vector<GradOut*> outs = {&dx, &dw1, &dw2, &ds};
  if (c.bias) outs.insert(outs.end(), {&db1, &db2});
  ExpertsBackwardArgs ba;
  ba.x = x.ptr, ba.w1 = w1.ptr, ba.w2 = w2.ptr;
  if (c.bias) ba.b1 = b1.ptr, ba.b2 = b2.ptr, ba.db1 = db1.buf.ptr, ba.db2 = db2.buf.ptr;
  ba.pair_token = fa.pair_token, ba.pair_expert = fa.pair_expert;
  ba.saved = saved.ptr, ba.dout = dout.ptr;
  ba.dx = dx.buf.ptr, ba.dw1 = dw1.buf.ptr, ba.dw2 = dw2.buf.ptr;
  ba.d_scores = static_cast<float*>(ds.buf.ptr);
  ba.workspace = bws.ptr;
  ba.weight_grad_dtype = c.grad_dtype;
  ba.fp8_weights = &fw;
  poison(outs, bws.ptr, plan.backward_workspace_bytes);
  experts_backward(p, ba, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto g_exact = ref::experts_backward(shape, hx.data(), rw, list, md, exact.H.data(), hdout.data());
  const auto g_fp8 = ref::experts_backward_fp8(shape, hx.data(), rw, list, md, fp8.Hq.data(), hdout.data());
  const auto got_dx = download(dx.buf.ptr, T * d);
  const auto got_dw1 = download(dw1.buf.ptr, E * n1 * d, gs == 4);
  const auto got_dw2 = download(dw2.buf.ptr, E * d * n, gs == 4);
  auto got_ds = download(ds.buf.ptr, R, true);
  if (c.stray) {  // a stray pair's score gradient is exactly 0; the others in list order
    std::vector<double> kept;
    for (int64_t q = 0; q < R; ++q) {
      if (at[q] < 0) ASSERT_EQ(got_ds[q], 0.0) << "d_scores of stray pair " << q;
      else kept.push_back(got_ds[q]);
    }
    got_ds = kept;
  }
  // Quantised operands on each path: d scores dout, W2, H (A recomputed from it); dx those and
  // dH, W1; dW2 the columns of dout and of A' (from H); dW1 the columns of x and of dH (from
  // dout, W2, H).
  expect_fp8("d_scores", got_ds, g_fp8.d_score, g_exact.d_score, 3, 0.5);
  expect_fp8("dx", got_dx, g_fp8.dx, g_exact.dx, 5, 0.5);
  expect_fp8("dw2", got_dw2, g_fp8.dw2, g_exact.dw2, 3, 0.5);
  expect_fp8("dw1", got_dw1, g_fp8.dw1, g_exact.dw1, 5, 0.75);
  if (c.bias) {
    // db1 = Σ dH: dout, W2 and H on its path (the GPU sums the bf16 dH, the FP8 reference the
    // unquantised one); db2 = Σ score·dout crosses nothing quantised: bf16 roundings only.
    const auto got_db1 = download(db1.buf.ptr, E * n1, gs == 4), got_db2 = download(db2.buf.ptr, E * d, gs == 4);
    expect_fp8("db1", got_db1, g_fp8.db1, g_exact.db1, 3, 0.5);
    const double db2_err = rel_err(got_db2, g_exact.db2);
    std::printf("  db2       GPU vs unquantised %.5f (bound 2^-7)\n", db2_err);
    EXPECT_LT(db2_err, std::ldexp(1.0, -7)) << "db2";
    for (int64_t e = 0; e < E; ++e) {
      if (md.expert_offsets[e + 1] != md.expert_offsets[e]) continue;
      for (int64_t i = 0; i < n1; ++i) ASSERT_EQ(got_db1[e * n1 + i], 0.0) << "db1 of empty expert " << e;
      for (int64_t i = 0; i < d; ++i) ASSERT_EQ(got_db2[e * d + i], 0.0) << "db2 of empty expert " << e;
    }
  }

  // Experts without rows: exact zeros; tokens without pairs: dx exactly zero.
  for (int64_t e = 0; e < E; ++e) {
    if (md.expert_offsets[e + 1] != md.expert_offsets[e]) continue;
    for (int64_t i = 0; i < n1 * d; ++i) ASSERT_EQ(got_dw1[e * n1 * d + i], 0.0) << "dw1 of empty expert " << e;
    for (int64_t i = 0; i < d * n; ++i) ASSERT_EQ(got_dw2[e * d * n + i], 0.0) << "dw2 of empty expert " << e;
  }
  for (int64_t t = 0; t < T; ++t) {
    if (md.token_offsets[t + 1] != md.token_offsets[t]) continue;
    for (int64_t i = 0; i < d; ++i) ASSERT_EQ(got_dx[t * d + i], 0.0) << "dx of token " << t << " without pairs";
  }
  expect_bitwise_rerun(outs, [](size_t) { return false; }, bws.ptr, plan.backward_workspace_bytes,
                       [&] { experts_backward(p, ba, nullptr); });
}

TEST(GpuFp8Experts, MatchTheReferences) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_fp8_experts({200, 256, 128, 8});
  check_fp8_experts({67, 144, 80, 4, 4, DType::FP32});  // partial 128-tiles along d and n
  check_fp8_experts({1, 128, 64, 8, 3});                 // one token
  check_fp8_experts({13, 128, 64, 64, 1});               // most experts without rows
}

// Pairs whose expert is outside [0, E) get no row, add nothing and get a zero score gradient
// (experts parallelism's lists hold the other ranks' experts so): the result is the valid pairs'.
TEST(GpuFp8Experts, PairsWithoutRowsAddNothing) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  Case c{150, 256, 128, 8};
  c.stray = true;
  check_fp8_experts(c);
  c.bias = true;
  check_fp8_experts(c);
}

// The expert biases (gpt-oss): b1 in the up-projection's epilogue, b2 in the down-projection's
// store, d scores' ⟨dout, b2⟩, db1 from the fused SwiGLU backward's chunk sums, db2.
TEST(GpuFp8Experts, ExpertBiasesMatchTheReferences) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  check_fp8_experts({200, 256, 128, 8, 3, DType::BF16, true});
  check_fp8_experts({300, 144, 80, 4, 4, DType::FP32, true});  // partial tiles, > 128 rows an expert
  check_fp8_experts({13, 128, 64, 64, 1, DType::BF16, true});  // most experts without rows
}

// The layer with precision FP8 against the bf16 layer on the same inputs: the same router (aux
// loss bitwise), the outputs and gradients within FP8's error model of the bf16 layer's.
TEST(GpuFp8Experts, LayerAgainstTheBf16Layer) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU visible";
  const uint64_t seed = mtest::test_seed(77);
  SCOPED_TRACE(mtest::seed_msg(seed));
  mtest::Rng rng(seed);
  const int64_t T = 333, d = 256, n = 128, E = 16, K = 4, n1 = 2 * n;
  DeviceBuffer x(T * d * 2), wr(E * d * 2), w1(E * n1 * d * 2), w2(E * d * n * 2), dout(T * d * 2);
  upload_bf16(rng, T * d, 1.0, x);
  upload_bf16(rng, E * d, 0.5, wr);
  upload_bf16(rng, E * n1 * d, 1.0 / std::sqrt(double(d)), w1);
  upload_bf16(rng, E * d * n, 1.0 / std::sqrt(double(n)), w2);
  upload_bf16(rng, T * d, 1.0, dout);
  DeviceBuffer wq(fp8_expert_weights_bytes(E, d, n));
  const Fp8ExpertWeights fw = quantize_expert_weights_fp8(E, d, n, w1.ptr, w2.ptr, wq.ptr, nullptr);

  struct Run {
    std::vector<double> out, dx, dwr, dw1, dw2;
    float aux;
  };
  auto run = [&](Precision precision, Run& r) {
    LayerProblem p;
    p.T = T, p.d = d, p.n = n, p.E = E, p.K = K, p.precision = precision;
    const WorkspacePlan plan = plan_workspace(p);
    DeviceBuffer out(T * d * 2), aux(4), saved(plan.saved_bytes), fws(plan.forward_workspace_bytes),
        bws(plan.backward_workspace_bytes), gx(T * d * 2), gwr(E * d * 2), gw1(E * n1 * d * 2), gw2(E * d * n * 2);
    LayerForwardArgs fa;
    fa.x = x.ptr, fa.router_weight = wr.ptr, fa.w1 = w1.ptr, fa.w2 = w2.ptr;
    fa.out = out.ptr, fa.aux_loss = static_cast<float*>(aux.ptr), fa.saved = saved.ptr, fa.workspace = fws.ptr;
    fa.fp8_weights = precision == Precision::FP8 ? &fw : nullptr;
    layer_forward(p, fa, nullptr);
    LayerBackwardArgs ba;
    ba.x = x.ptr, ba.router_weight = wr.ptr, ba.w1 = w1.ptr, ba.w2 = w2.ptr;
    ba.saved = saved.ptr, ba.dout = dout.ptr, ba.d_aux = 0.25f;
    ba.dx = gx.ptr, ba.d_router_weight = gwr.ptr, ba.dw1 = gw1.ptr, ba.dw2 = gw2.ptr, ba.workspace = bws.ptr;
    ba.fp8_weights = fa.fp8_weights;
    ASSERT_EQ(cudaMemset(bws.ptr, 0xff, plan.backward_workspace_bytes), cudaSuccess);
    layer_backward(p, ba, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    r.out = download(out.ptr, T * d), r.dx = download(gx.ptr, T * d), r.dwr = download(gwr.ptr, E * d);
    r.dw1 = download(gw1.ptr, E * n1 * d), r.dw2 = download(gw2.ptr, E * d * n);
    ASSERT_EQ(cudaMemcpy(&r.aux, aux.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  Run bf16, fp8;
  run(Precision::BF16, bf16);
  run(Precision::FP8, fp8);
  EXPECT_EQ(bf16.aux, fp8.aux) << "the router and its aux loss run in high precision in both";
  const struct {
    const char* name;
    const std::vector<double>&got, &want;
    int q;
  } checks[] = {{"out", fp8.out, bf16.out, 4}, {"dx", fp8.dx, bf16.dx, 5}, {"d_router_weight", fp8.dwr, bf16.dwr, 3},
                {"dw1", fp8.dw1, bf16.dw1, 5}, {"dw2", fp8.dw2, bf16.dw2, 3}};
  for (const auto& ck : checks) {
    const double e = rel_err(ck.got, ck.want);
    std::printf("  layer %-15s FP8 vs bf16 %.4f (bound %.4f)\n", ck.name, e, fp8_bound(ck.q));
    EXPECT_LT(e, fp8_bound(ck.q)) << ck.name;
  }
}

}  // namespace
