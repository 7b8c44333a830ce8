// Tests of the public host API (include/machmoe/machmoe.hpp, types.hpp) that need no GPU:
// problem validation, workspace planning, the refusals before any GPU work, and the name parsers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "machmoe/machmoe.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;

LayerProblem valid_problem() {
  LayerProblem p;
  p.T = 256, p.d = 128, p.n = 64, p.E = 8, p.K = 2;
  return p;
}

// validate must throw InvalidArgument whose message names `field` (any of `names`).
void expect_invalid(const LayerProblem& p, const std::vector<std::string>& names,
                    const std::string& what) {
  const std::string msg = mtest::expect_error(
      ErrorCode::InvalidArgument, [&] { validate(p); }, what);
  if (msg.empty()) return;
  bool named = false;
  for (const auto& n : names)
    named =
        named || mtest::contains_word(msg, n) || (n.size() > 1 && msg.find(n) != std::string::npos);
  EXPECT_TRUE(named) << what << ": message does not name the field: \"" << msg << "\"";
}

TEST(Validate, AcceptsValidProblems) {
  LayerProblem p = valid_problem();
  EXPECT_NO_THROW(validate(p));
  p.T = 0;  // zero tokens is allowed
  EXPECT_NO_THROW(validate(p));
  p = valid_problem();
  p.K = p.E;  // K = E
  EXPECT_NO_THROW(validate(p));
  p.K = 1;
  EXPECT_NO_THROW(validate(p));
  for (int a = 0; a < kNumActivations; ++a) {
    p = valid_problem();
    p.activation = Activation(a);
    p.layout = GateUpLayout::Concatenated;
    p.has_bias = true;
    EXPECT_NO_THROW(validate(p)) << to_string(Activation(a));
  }
  for (RoutingMethod m :
       {RoutingMethod::SoftmaxTopK, RoutingMethod::TopKSoftmax, RoutingMethod::Sigmoid})
    for (bool renorm : {false, true}) {
      p = valid_problem();
      p.routing = m, p.renormalize = renorm;
      EXPECT_NO_THROW(validate(p)) << to_string(m);
    }
  for (TokenRounding r : {TokenRounding::Nearest, TokenRounding::Up, TokenRounding::Down,
                          TokenRounding::Stochastic}) {
    p = valid_problem();
    p.rounding = r;
    EXPECT_NO_THROW(validate(p)) << to_string(r);
    p.rounding_tile_m = 1;
    EXPECT_NO_THROW(validate(p)) << to_string(r) << " tile_m=1";
  }
}

// Only validate() makes a validated problem: no default, no construction or conversion from a
// plain problem, and read-only access afterwards. So a function that takes one (plan_workspace,
// the forward and backward calls) may rely on the problem's rules without checking them again.
static_assert(!std::is_default_constructible_v<ValidLayerProblem>);
static_assert(!std::is_constructible_v<ValidLayerProblem, LayerProblem>);
static_assert(!std::is_convertible_v<LayerProblem, ValidLayerProblem>);
static_assert(std::is_same_v<decltype(*std::declval<const ValidLayerProblem&>()), const LayerProblem&>);
static_assert(!std::is_default_constructible_v<ValidExpertsProblem>);
static_assert(!std::is_constructible_v<ValidExpertsProblem, ExpertsProblem>);
static_assert(!std::is_convertible_v<ExpertsProblem, ValidExpertsProblem>);
static_assert(std::is_same_v<decltype(*std::declval<const ValidExpertsProblem&>()), const ExpertsProblem&>);

TEST(Validate, ReturnsTheProblemItAccepted) {
  LayerProblem p = valid_problem();
  p.K = 3, p.activation = Activation::GELU, p.rounding = TokenRounding::Up, p.rounding_tile_m = 64;
  const ValidLayerProblem v = validate(p);
  EXPECT_EQ(v->T, p.T);
  EXPECT_EQ(v->K, 3);
  EXPECT_EQ(v.problem().activation, Activation::GELU);
  EXPECT_EQ((*v).rounding_tile_m, 64);
  // The plan of the validated problem is the plan of the plain one (which validates it first).
  EXPECT_EQ(plan_workspace(v).saved_bytes, plan_workspace(p).saved_bytes);
  EXPECT_EQ(plan_workspace(v).backward_workspace_bytes, plan_workspace(p).backward_workspace_bytes);
}

TEST(Validate, RejectsEachBadField) {
  LayerProblem p = valid_problem();
  p.T = -1;
  expect_invalid(p, {"T"}, "T < 0");
  for (int64_t v : {0, -64}) {
    p = valid_problem(), p.d = v;
    expect_invalid(p, {"d"}, "d <= 0");
    p = valid_problem(), p.n = v;
    expect_invalid(p, {"n"}, "n <= 0");
    p = valid_problem(), p.E = v;
    expect_invalid(p, {"E"}, "E <= 0");
  }
  p = valid_problem(), p.K = 0;
  expect_invalid(p, {"K"}, "K < 1");
  p = valid_problem(), p.K = -3;
  expect_invalid(p, {"K"}, "K < 1");
  p = valid_problem(), p.K = p.E + 1;
  expect_invalid(p, {"K"}, "K > E");
  p = valid_problem(), p.E = 1, p.K = 2;
  expect_invalid(p, {"K"}, "K > E (E = 1)");
  for (int64_t m : {0, -128}) {
    p = valid_problem(), p.rounding = TokenRounding::Nearest, p.rounding_tile_m = m;
    expect_invalid(p, {"rounding_tile_m", "tile_m"}, "rounding_tile_m < 1");
  }
  for (RoutingMethod m : {RoutingMethod::TopKSoftmax, RoutingMethod::Sigmoid})
    for (TokenRounding r : {TokenRounding::Nearest, TokenRounding::Up, TokenRounding::Down,
                            TokenRounding::Stochastic}) {
      p = valid_problem(), p.routing = m, p.rounding = r;
      expect_invalid(p, {"rounding", "routing"},
                     std::string("token rounding with ") + to_string(m));
    }
  p = valid_problem(), p.glu_clamp.limit = 3.f;  // swiglu takes no clamp parameters
  expect_invalid(p, {"glu_clamp"}, "glu_clamp with swiglu");
  p = valid_problem(), p.activation = Activation::ClampedSwiGLU, p.glu_clamp.limit = 0.f;
  expect_invalid(p, {"glu_clamp"}, "glu_clamp.limit = 0");
  p = valid_problem(), p.activation = Activation::ClampedSwiGLU, p.glu_clamp.alpha = -1.f;
  expect_invalid(p, {"glu_clamp"}, "glu_clamp.alpha < 0");
  p = valid_problem(), p.activation = Activation::ClampedSwiGLU, p.glu_clamp.up_offset = NAN;
  expect_invalid(p, {"glu_clamp"}, "glu_clamp.up_offset NaN");
  p = valid_problem(), p.activation = Activation::ClampedSwiGLU, p.glu_clamp = GluClamp{1.f, 10.f, 0.f, true};
  EXPECT_NO_THROW(validate(p));
  // Shared experts: a count >= 0, not with token rounding, scores only with shared experts, and
  // T·(K + S) rows within int32.
  p = valid_problem(), p.num_shared = -1;
  expect_invalid(p, {"num_shared"}, "num_shared < 0");
  p = valid_problem(), p.num_shared = 1, p.rounding = TokenRounding::Nearest;
  expect_invalid(p, {"num_shared", "token rounding"}, "shared experts with token rounding");
  p = valid_problem(), p.has_shared_scores = true;
  expect_invalid(p, {"has_shared_scores"}, "shared scores without shared experts");
  p = valid_problem(), p.K = 8, p.num_shared = 2, p.T = std::numeric_limits<int32_t>::max() / 9;
  expect_invalid(p, {"T", "num_shared"}, "T*(K+S) past int32");
  p = valid_problem(), p.K = 8, p.num_shared = 2, p.has_shared_scores = true, p.T = 1000;
  EXPECT_NO_THROW(validate(p));
  // Qwen's gate: with shared experts only, and not beside given scores.
  p = valid_problem(), p.has_shared_gate = true;
  expect_invalid(p, {"has_shared_gate", "num_shared"}, "a shared gate without shared experts");
  p = valid_problem(), p.num_shared = 1, p.has_shared_gate = true, p.has_shared_scores = true;
  expect_invalid(p, {"has_shared_gate", "has_shared_scores"}, "a shared gate and shared scores");
  p = valid_problem(), p.num_shared = 1, p.has_shared_gate = true;
  EXPECT_NO_THROW(validate(p));
}

// With S shared experts the layer's rows are T·(K+S) and its expert offsets cover E+S experts:
// the saved block grows by exactly the S extra rows' H, score and indices, the offsets and the
// router's own [T, K] scores.
TEST(PlanWorkspace, SharedExpertsAddTheirRows) {
  LayerProblem p = valid_problem();
  p.T = 1000, p.E = 64, p.K = 8;
  const WorkspacePlan base = plan_workspace(p);
  p.num_shared = 2;
  const WorkspacePlan shared = plan_workspace(p);
  const int64_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  const int64_t extra_rows = p.T * p.num_shared;
  const int64_t want = extra_rows * (n1 * 2 + 12) + p.num_shared * 4 + p.T * p.K * 4;
  const int64_t got = static_cast<int64_t>(shared.saved_bytes) - static_cast<int64_t>(base.saved_bytes);
  EXPECT_GE(got, want);
  EXPECT_LE(got, want + 5 * 256) << "alignment padding of the five parts that changed at most";
  EXPECT_GT(shared.forward_workspace_bytes, base.forward_workspace_bytes);
  EXPECT_GT(shared.backward_workspace_bytes, base.backward_workspace_bytes);
}

// ---------------------------------------------------------------- workspace planning
size_t saved_minimum(const LayerProblem& p) {  // H [R, n1] bf16 + fp32 scores [R], R = T*K
  const size_t n1 = is_glu(p.activation) ? 2 * p.n : p.n;
  const size_t R = size_t(p.T) * size_t(p.K);
  return 2 * R * n1 + 4 * R;
}

TEST(PlanWorkspace, SavedCoversHAndScoresAndIsMonotoneInT) {
  for (int a = 0; a < kNumActivations; ++a)
    for (RoutingMethod m :
         {RoutingMethod::SoftmaxTopK, RoutingMethod::TopKSoftmax, RoutingMethod::Sigmoid}) {
      LayerProblem p = valid_problem();
      p.activation = Activation(a), p.routing = m;
      SCOPED_TRACE(std::string(to_string(p.activation)) + " " + to_string(m));
      size_t prev = 0;
      for (int64_t T : {0, 1, 2, 3, 7, 64, 100, 127, 128, 129, 1000, 4096, 40960}) {
        p.T = T;
        const WorkspacePlan w = plan_workspace(p);
        EXPECT_GE(w.saved_bytes, saved_minimum(p)) << "T=" << T;
        EXPECT_GE(w.saved_bytes, prev) << "saved_bytes decreased at T=" << T;
        prev = w.saved_bytes;
      }
    }
}

TEST(PlanWorkspace, LargeProblemsUse64BitSizes) {
  LayerProblem p = valid_problem();  // T*K*n1 far above 2^31
  p.T = 1 << 20, p.d = 4096, p.n = 2048, p.E = 256, p.K = 16;
  const WorkspacePlan w = plan_workspace(p);
  EXPECT_GE(w.saved_bytes, saved_minimum(p));
  EXPECT_GT(w.saved_bytes, size_t(1) << 32);
}

// Token rounding can route more pairs than T*K: the saved buffer must hold the worst case.
TEST(PlanWorkspace, TokenRoundingCoversMoreRowsThanTK) {
  LayerProblem p = valid_problem();
  p.activation = Activation::SwiGLU;
  const size_t n1 = 2 * p.n;
  // Up, T = E = 4, K = 1, M = 128: one token per expert rounds up to all 4 tokens: R = T*E = 16.
  p.T = 4, p.E = 4, p.K = 1, p.rounding = TokenRounding::Up, p.rounding_tile_m = 128;
  EXPECT_GE(plan_workspace(p).saved_bytes, 16 * (2 * n1 + 4)) << "up";
  p.rounding = TokenRounding::Stochastic;  // may round up like `up`
  EXPECT_GE(plan_workspace(p).saved_bytes, 16 * (2 * n1 + 4)) << "stochastic";
  // Nearest, T = 256, E = 4, K = 1, M = 128: 64 tokens per expert round to 128: R = 512 = 2*T*K.
  p.T = 256, p.rounding = TokenRounding::Nearest;
  EXPECT_GE(plan_workspace(p).saved_bytes, 512 * (2 * n1 + 4)) << "nearest";
}

TEST(PlanWorkspace, RejectsInvalidProblems) {
  LayerProblem p = valid_problem();
  p.K = p.E + 1;
  mtest::expect_error(
      ErrorCode::InvalidArgument, [&] { plan_workspace(p); }, "plan_workspace K > E");
  p = valid_problem(), p.d = 0;
  mtest::expect_error(
      ErrorCode::InvalidArgument, [&] { plan_workspace(p); }, "plan_workspace d = 0");
}

// The backward workspace holds, per routed row, dH [n1] + A' [n] + dX~ [d] bf16 and the fp32 dS
// partials and d score, plus d_logits [T, E] in fp32 and bf16 and the cuBLAS workspace; biases
// add the per-chunk partial sums. Checked against those sizes, within sub-buffer alignment.
TEST(PlanWorkspace, BackwardHoldsTheGradientBuffers) {
  for (bool bias : {false, true})
    for (Activation act : {Activation::SwiGLU, Activation::ReLU}) {
      LayerProblem p = valid_problem();
      p.T = 1000, p.d = 256, p.n = 320, p.E = 16, p.K = 4, p.activation = act, p.has_bias = bias;
      SCOPED_TRACE(std::string(to_string(act)) + (bias ? " bias" : ""));
      const size_t R = size_t(p.T * p.K), n1 = is_glu(act) ? 2 * p.n : p.n, T = p.T, E = p.E;
      const size_t tiles = static_cast<size_t>(grouped_gemm_column_tiles(p.n));
      size_t need = R * 2 * (n1 + p.n + p.d) + R * 4 * (tiles + 1) + T * E * (4 + 2) + (size_t{4} << 20);
      const size_t chunks = (R + 255) / 256 + E;
      if (bias) need += chunks * std::max<size_t>(p.d, n1) * 4;
      const size_t bytes = plan_workspace(p).backward_workspace_bytes;
      EXPECT_GE(bytes, need);
      // The rest: row_token, the pairs' experts, token_offsets, tile offsets, the experts' first
      // late rows, aux scratch, chunk offsets, alignment.
      const size_t aux = ((T + 63) / 64) * E * 4 + (E + 1) * 4;
      EXPECT_LE(bytes, need + 2 * R * 4 + (T + 1) * 4 + 2 * (E + 1) * 4 + E * 4 + aux + 18 * 256);
    }
}

// ---------------------------------------------------------------- refusals before any GPU work
// Every GPU entry point, called with the pointers `ptr` (all of them) and a null stream.
std::vector<std::pair<const char*, std::function<void()>>> gpu_calls(void* ptr) {
  const LayerProblem p = valid_problem();
  const cudaStream_t s = nullptr;
  LayerForwardArgs fa;
  fa.x = fa.router_weight = fa.w1 = fa.b1 = fa.w2 = fa.b2 = ptr;
  fa.selection_bias = static_cast<const float*>(ptr);
  fa.out = fa.saved = fa.workspace = ptr;
  fa.aux_loss = static_cast<float*>(ptr);
  LayerBackwardArgs ba;
  ba.x = ba.router_weight = ba.w1 = ba.b1 = ba.w2 = ba.b2 = ba.saved = ba.dout = ptr;
  ba.dx = ba.d_router_weight = ba.dw1 = ba.db1 = ba.dw2 = ba.db2 = ba.workspace = ptr;
  ba.d_aux = 1.f;
  auto* f = static_cast<float*>(ptr);
  auto* i = static_cast<int32_t*>(ptr);
  RoutingMetadataOutputs mo{i, i, i, i, i, i};
  return {
      {"layer_forward", [=] { layer_forward(p, fa, s); }},
      {"layer_backward", [=] { layer_backward(p, ba, s); }},
      {"topk_router",
       [=] { topk_router(f, 16, 8, 2, RoutingMethod::SoftmaxTopK, true, nullptr, f, i, s); }},
      {"topk_router_backward",
       [=] { topk_router_backward(f, f, i, f, 16, 8, 2, RoutingMethod::SoftmaxTopK, true, f, s); }},
      {"routing_metadata", [=] { routing_metadata(i, i, 32, 2, 16, 8, mo, ptr, 1 << 16, s); }},
      {"aggregate", [=] { aggregate(ptr, DType::BF16, i, i, f, 16, 64, ptr, DType::BF16, s); }},
  };
}

// The layer backward refuses, before touching memory (this machine may have no GPU), what it does
// not run: non-bf16 data, sizes that are not multiples of 8, biases and bias gradients not given
// together with has_bias, a weight-gradient dtype other than bf16/fp32, a misaligned workspace.
TEST(LayerBackward, RefusesWhatItDoesNotRun) {
  std::vector<uint64_t> buf(1 << 17, 0x5555555555555555ull);
  void* ptr = buf.data();  // 8-byte aligned host memory that nothing may touch
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ptr) + 255) & ~uintptr_t{255});
  LayerBackwardArgs ba;
  ba.x = ba.router_weight = ba.w1 = ba.w2 = ba.dout = aligned;
  ba.dx = ba.d_router_weight = ba.dw1 = ba.dw2 = aligned;
  ba.saved = ba.workspace = aligned;
  auto refuses = [&](ErrorCode code, LayerProblem p, LayerBackwardArgs a, const std::string& what,
                     const std::string& word) {
    const std::string msg = mtest::expect_error(code, [&] { layer_backward(p, a, nullptr); }, what);
    EXPECT_NE(msg.find(word), std::string::npos) << what << ": message does not name " << word << ": " << msg;
  };
  LayerProblem p = valid_problem();
  p.dtype = DType::FP32;
  refuses(ErrorCode::Unsupported, p, ba, "fp32 data", "bfloat16");
  p = valid_problem(), p.n = 100;
  refuses(ErrorCode::Unsupported, p, ba, "n % 8", "multiples of 8");
  p = valid_problem(), p.rounding = TokenRounding::Up, p.E = 64, p.K = 33;
  refuses(ErrorCode::InvalidArgument, p, ba, "rounding K > 32", "K");
  p = valid_problem(), p.has_bias = true;
  refuses(ErrorCode::InvalidArgument, p, ba, "has_bias without biases", "b1 must be given when has_bias");
  LayerBackwardArgs half = ba;
  half.b1 = half.b2 = half.db1 = aligned;  // db2 missing
  refuses(ErrorCode::InvalidArgument, p, half, "db2 missing", "db2 must be given when has_bias");
  p = valid_problem();
  refuses(ErrorCode::InvalidArgument, p, half, "biases without has_bias", "b1 must be null unless has_bias");
  LayerBackwardArgs a = ba;
  a.weight_grad_dtype = DType::FP16;
  refuses(ErrorCode::InvalidArgument, p, a, "fp16 weight gradients", "weight_grad_dtype");
  a = ba, a.workspace = static_cast<char*>(aligned) + 16;
  refuses(ErrorCode::InvalidArgument, p, a, "workspace 16-byte aligned", "workspace must be 256-byte aligned");
  a = ba, a.dout = static_cast<char*>(aligned) + 2;
  refuses(ErrorCode::InvalidArgument, p, a, "dout 2-byte aligned", "dout must be 16-byte aligned");
  a = ba, a.dw1 = nullptr;
  refuses(ErrorCode::InvalidArgument, p, a, "null dw1", "dw1 must not be null");
  a = ba, a.dout = nullptr;  // allowed only when T = 0 (an empty tensor)
  refuses(ErrorCode::InvalidArgument, p, a, "null dout", "dout must not be null when T > 0");
  // The router bias's gradient exactly with has_router_bias; at most 32 groups on the GPU.
  p = valid_problem(), p.has_router_bias = true;
  refuses(ErrorCode::InvalidArgument, p, ba, "has_router_bias without d_router_bias",
          "d_router_bias must be given when has_router_bias");
  a = ba, a.d_router_bias = aligned;
  refuses(ErrorCode::InvalidArgument, valid_problem(), a, "d_router_bias without has_router_bias",
          "d_router_bias must be null unless has_router_bias");
  p = valid_problem(), p.E = 128, p.routing = RoutingMethod::SqrtSoftplus, p.n_group = 64, p.topk_group = 2;
  refuses(ErrorCode::InvalidArgument, p, ba, "64 groups", "n_group");
}

// The layer forward refuses, before touching memory, what it does not run: non-bf16 data and
// sizes that are not multiples of 8 (unsupported), token rounding with K > 32, missing biases.
// precision FP8 on the layer: the experts' rules, plus no shared experts (token rounding and
// biases run in FP8 too).
TEST(Validate, Fp8Rules) {
  LayerProblem p = valid_problem();
  p.precision = Precision::FP8;
  EXPECT_NO_THROW(validate(p));
  LayerProblem q = p;
  q.rounding = TokenRounding::Nearest, q.has_bias = true;
  EXPECT_NO_THROW(validate(q));
  q = p, q.num_shared = 1;
  expect_invalid(q, {"num_shared"}, "FP8 with shared experts");
  q = p, q.activation = Activation::ReLU;
  expect_invalid(q, {"activation"}, "FP8 ReLU");
  q = p, q.n = 72;
  expect_invalid(q, {"n"}, "FP8 n % 16");
  // The saved block keeps H in E4M3: smaller than bf16's by R·(n1 - 4·ceil(n1/128)) bytes, rounded.
  const WorkspacePlan fp8 = plan_workspace(p), bf16 = plan_workspace(valid_problem());
  EXPECT_LT(fp8.saved_bytes, bf16.saved_bytes);
  EXPECT_EQ(fp8.inference_saved_bytes, bf16.inference_saved_bytes);  // everything but H is the same
}

TEST(LayerForward, RefusesWhatItDoesNotRun) {
  std::vector<uint64_t> buf(1 << 17, 0x5555555555555555ull);
  LayerForwardArgs fa;
  void* ptr = buf.data();
  fa.x = fa.router_weight = fa.w1 = fa.w2 = ptr;
  fa.out = fa.saved = fa.workspace = ptr;
  fa.aux_loss = static_cast<float*>(ptr);
  LayerProblem p = valid_problem();
  p.rounding = TokenRounding::Nearest;
  p.E = 64, p.K = 33;
  mtest::expect_error(ErrorCode::InvalidArgument, [&] { layer_forward(p, fa, nullptr); }, "rounding K > 32");
  p = valid_problem();
  p.dtype = DType::FP32;
  mtest::expect_error(ErrorCode::Unsupported, [&] { layer_forward(p, fa, nullptr); }, "fp32");
  p = valid_problem();
  p.d = 100;
  mtest::expect_error(ErrorCode::Unsupported, [&] { layer_forward(p, fa, nullptr); }, "d % 8");
  p = valid_problem();
  p.has_bias = true;  // biases announced but not given
  mtest::expect_error(ErrorCode::InvalidArgument, [&] { layer_forward(p, fa, nullptr); }, "bias");
  p = valid_problem();
  p.has_router_bias = true;  // router bias announced but not given
  EXPECT_NE(mtest::expect_error(ErrorCode::InvalidArgument, [&] { layer_forward(p, fa, nullptr); }, "router bias")
                .find("router_bias"),
            std::string::npos);
  LayerForwardArgs sb = fa;
  sb.selection_bias = static_cast<float*>(ptr);  // only with the gate routings
  mtest::expect_error(ErrorCode::InvalidArgument, [&] { layer_forward(valid_problem(), sb, nullptr); },
                      "selection bias with softmax_topk");
  p = valid_problem(), p.routing = RoutingMethod::SqrtSoftplus;
  EXPECT_NO_THROW(validate(p));
  // FP8: the refusals after the block checks, so with 256-byte aligned blocks.
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ptr) + 255) & ~uintptr_t{255});
  fa.x = fa.router_weight = fa.w1 = fa.w2 = aligned;
  fa.out = fa.saved = fa.workspace = aligned;
  fa.aux_loss = static_cast<float*>(aligned);
  p = valid_problem(), p.precision = Precision::FP8;
  EXPECT_NE(mtest::expect_error(ErrorCode::InvalidArgument, [&] { layer_forward(p, fa, nullptr); }, "FP8, no copies")
                .find("fp8_weights must be given"),
            std::string::npos);
}

// The gather loaders address rows in 32-bit offsets of 16 bytes: a gathered operand of 2^35
// elements or more is refused by name, on the host, before any CUDA call.
TEST(GroupedGemm, RefusesGatheredOperandsTooLargeFor32BitOffsets) {
  std::vector<uint64_t> buf(64, 0);
  void* ptr = buf.data();
  GroupedGemmArgs g;
  g.a = g.w = g.c = ptr;
  g.gather = g.expert_offsets = g.tile_offsets = static_cast<int32_t*>(ptr);
  g.E = 1, g.N = 64, g.K = 64, g.ldc = 64;
  g.lda = 64, g.a_rows = (int64_t{1} << 31) - 1;  // 2^37 elements
  const std::string msg =
      mtest::expect_error(ErrorCode::InvalidArgument, [&] { grouped_gemm(g, nullptr); }, "gathered A of 2^37");
  EXPECT_NE(msg.find("a_rows*lda"), std::string::npos) << msg;
  GroupedWgradArgs w;
  w.a = w.b = w.c = ptr;
  w.a_gather = w.expert_offsets = static_cast<int32_t*>(ptr);
  w.E = 1, w.M = 64, w.N = 64, w.ldb = 64, w.b_rows = 64;
  w.lda = 64, w.a_rows = (int64_t{1} << 31) - 1;
  const std::string wmsg =
      mtest::expect_error(ErrorCode::InvalidArgument, [&] { grouped_gemm_wgrad(w, nullptr); }, "wgrad A of 2^37");
  EXPECT_NE(wmsg.find("a_rows*lda"), std::string::npos) << wmsg;
  // B's rows (the experts' rows R) leave the kernel's int32 row counters room past the last row.
  w.a_rows = 64, w.ldb = 8, w.N = 8, w.b_rows = (int64_t{1} << 31) - 100;
  const std::string bmsg =
      mtest::expect_error(ErrorCode::InvalidArgument, [&] { grouped_gemm_wgrad(w, nullptr); }, "wgrad R near 2^31");
  EXPECT_NE(bmsg.find("b_rows"), std::string::npos) << bmsg;
}

// The activation output c2 is written by 16-byte stores: an 8-byte aligned c2 is refused by name
// on the host, before any CUDA call, as a, w and c are.
TEST(GroupedGemm, RefusesMisalignedActivationOutput) {
  alignas(256) static uint64_t buf[64] = {};
  GroupedGemmArgs g;
  g.a = g.w = g.c = buf;
  g.gather = g.expert_offsets = g.tile_offsets = reinterpret_cast<int32_t*>(buf);
  g.E = 1, g.N = 64, g.K = 64, g.lda = 64, g.ldc = 64, g.a_rows = 64;
  g.epilogue = GemmEpilogue::GLU;
  g.c2 = reinterpret_cast<char*>(buf) + 8, g.ldc2 = 32;
  const std::string msg =
      mtest::expect_error(ErrorCode::InvalidArgument, [&] { grouped_gemm(g, nullptr); }, "c2 8-byte aligned");
  EXPECT_NE(msg.find("c2/ldc2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16-byte aligned"), std::string::npos) << msg;
}

// Null pointers are refused on the host, before any CUDA call (this machine may have no GPU).
TEST(NotBuilt, NullPointersAreRefusedWithoutACrash) {
  for (auto& [name, call] : gpu_calls(nullptr)) {
    try {
      call();
      ADD_FAILURE() << name << ": did not throw";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == ErrorCode::NotBuilt || e.code() == ErrorCode::InvalidArgument)
          << name << ": code " << int(e.code()) << ": " << e.what();
    }
  }
}

// ---------------------------------------------------------------- names
template <class Enum, class Parse>
void check_names(const std::vector<std::pair<Enum, std::string>>& names, Parse parse,
                 const char* what) {
  for (const auto& [v, name] : names) {
    EXPECT_EQ(to_string(v), name) << what;
    EXPECT_EQ(parse(name), v) << what << " " << name;
    EXPECT_EQ(parse(to_string(v)), v) << what << " round trip";
  }
  for (const std::string bad : {"", "bogus", "swiglu2", "NR-"}) {
    bool known = false;
    for (const auto& nv : names) known = known || nv.second == bad;
    if (known) continue;
    const std::string msg = mtest::expect_error(
        ErrorCode::InvalidArgument, [&] { parse(bad); }, std::string(what) + " \"" + bad + "\"");
    for (const auto& nv : names)
      EXPECT_TRUE(mtest::contains_word(msg, nv.second))
          << what << ": message does not list \"" << nv.second << "\": " << msg;
  }
}

TEST(Names, ParseRoundTripsAndRejectsBadNames) {
  check_names<Activation>(
      {{Activation::SwiGLU, "swiglu"},
       {Activation::GeGLU, "geglu"},
       {Activation::ReGLU, "reglu"},
       {Activation::ReLU2, "relu2"},
       {Activation::ReLU, "relu"},
       {Activation::GELU, "gelu"},
       {Activation::SiLU, "silu"}},
      [](std::string_view s) { return parse_activation(s); }, "activation");
  check_names<GateUpLayout>(
      {{GateUpLayout::Interleaved, "interleaved"}, {GateUpLayout::Concatenated, "concatenated"}},
      [](std::string_view s) { return parse_layout(s); }, "layout");
  check_names<RoutingMethod>(
      {{RoutingMethod::SoftmaxTopK, "softmax_topk"},
       {RoutingMethod::TopKSoftmax, "topk_softmax"},
       {RoutingMethod::Sigmoid, "sigmoid"}},
      [](std::string_view s) { return parse_routing(s); }, "routing");
  check_names<TokenRounding>(
      {{TokenRounding::None, "none"},
       {TokenRounding::Nearest, "nr"},
       {TokenRounding::Up, "up"},
       {TokenRounding::Down, "down"},
       {TokenRounding::Stochastic, "stochastic"}},
      [](std::string_view s) { return parse_token_rounding(s); }, "token rounding");
  // DType names: distinct and non-empty.
  const std::string a = to_string(DType::BF16), b = to_string(DType::FP16),
                    c = to_string(DType::FP32);
  EXPECT_FALSE(a.empty() || b.empty() || c.empty());
  EXPECT_TRUE(a != b && b != c && a != c);
  EXPECT_EQ(dtype_size(DType::BF16), 2);
  EXPECT_EQ(dtype_size(DType::FP32), 4);
}

TEST(Names, GluKinds) {
  EXPECT_TRUE(is_glu(Activation::SwiGLU) && is_glu(Activation::GeGLU) && is_glu(Activation::ReGLU));
  EXPECT_FALSE(is_glu(Activation::ReLU2) || is_glu(Activation::ReLU) || is_glu(Activation::GELU) ||
               is_glu(Activation::SiLU));
}

}  // namespace

namespace {

// The saved block is the memory minimum: H (bf16, 4·n bytes per routed pair for a GLU), 12 bytes
// per pair (scores, row -> pair, pair -> row; each pair's expert is rebuilt by the backward),
// fp32 logits [T, E], expert offsets [E+1], plus at most 256 bytes of alignment per sub-buffer.
// Nothing of size T·K·d (no Y). With x it stays within the layer's memory target
// 2·T·d + 4·T·K·n + 16·T·K + 4·T·E bytes.
TEST(PlanWorkspace, SavedIsTheMemoryMinimum) {
  struct Cfg { int64_t T, d, n, E, K; };
  for (const Cfg c : {Cfg{24576, 1536, 256, 128, 8}, Cfg{32768, 4096, 512, 128, 8}, Cfg{7, 64, 24, 3, 2},
                      Cfg{32768, 7168, 2048, 256, 8}}) {
    LayerProblem p;
    p.T = c.T, p.d = c.d, p.n = c.n, p.E = c.E, p.K = c.K;
    const size_t saved = plan_workspace(p).saved_bytes;
    const size_t pairs = static_cast<size_t>(c.T * c.K);
    const size_t minimum = pairs * 4 * c.n + 12 * pairs + 4 * static_cast<size_t>(c.T * c.E);
    EXPECT_GE(saved, minimum) << "T=" << c.T;
    EXPECT_LE(saved, minimum + 4 * static_cast<size_t>(c.E + 1) + 6 * 256) << "T=" << c.T;
    const size_t bound = pairs * 4 * c.n + 16 * pairs + 4 * static_cast<size_t>(c.T * c.E);  // less x
    // The 4 bytes per pair of slack cover the expert offsets and the sub-buffers' alignment once
    // there are more than E + 1 + 384 pairs (every benchmark configuration; not the tiny one).
    if (pairs >= static_cast<size_t>(c.E) + 1 + 384) EXPECT_LE(saved, bound) << "T=" << c.T;
  }
}

// Inference (write_h = false) needs the saved block less H: R·n1 bf16 rounded to 256 bytes, for
// every activation kind and with token rounding (more rows); an experts call always writes H.
TEST(PlanWorkspace, InferenceSavedDropsExactlyH) {
  for (const Activation act : {Activation::SwiGLU, Activation::GELU})
    for (const TokenRounding rnd : {TokenRounding::None, TokenRounding::Nearest})
      for (const int64_t T : {1, 5, 1000}) {  // token rounding's capacity at its T·E cap, and below it
        LayerProblem p;
        p.T = T, p.d = 256, p.n = 72, p.E = 16, p.K = 3;
        p.activation = act, p.rounding = rnd;
        const WorkspacePlan w = plan_workspace(p);
        const int64_t n1 = is_glu(act) ? 2 * p.n : p.n;
        // With token rounding, H has a row for each place of the rounded list, as the token
        // rounding kernels size it.
        const int64_t rows =
            rnd == TokenRounding::None ? p.T * p.K : token_rounding_capacity(p.T, p.E, p.K, p.rounding_tile_m);
        const size_t h = (static_cast<size_t>(rows * n1 * 2) + 255) / 256 * 256;
        EXPECT_EQ(w.inference_saved_bytes + h, w.saved_bytes) << to_string(act) << " " << to_string(rnd) << " T=" << T;
      }
  ExpertsProblem e;
  e.T = 100, e.d = 64, e.n = 32, e.E = 4, e.R = 150;
  const WorkspacePlan we = plan_workspace(e);
  EXPECT_EQ(we.inference_saved_bytes, we.saved_bytes);
}

}  // namespace
