// Tests of the experts-on-a-general-list API (include/machmoe/machmoe.hpp: ExpertsProblem,
// experts_forward, experts_backward) that need no GPU: problem validation, the exact workspace
// plan, and the refusals before any GPU work.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "host/layer/layer_layout.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/machmoe.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;

ExpertsProblem valid_experts() {
  ExpertsProblem p;
  p.T = 256, p.d = 128, p.n = 64, p.E = 8, p.R = 600;
  return p;
}

// validate must throw InvalidArgument whose message names ExpertsProblem.<field>.
void expect_invalid(const ExpertsProblem& p, const std::string& field, const std::string& what) {
  const std::string msg = mtest::expect_error(ErrorCode::InvalidArgument, [&] { validate(p); }, what);
  if (msg.empty()) return;
  EXPECT_NE(msg.find("ExpertsProblem." + field + ":"), std::string::npos)
      << what << ": message does not name the field " << field << ": \"" << msg << "\"";
}

TEST(ExpertsValidate, AcceptsValidProblems) {
  ExpertsProblem p = valid_experts();
  EXPECT_NO_THROW(validate(p));
  p.R = 0;  // an empty list
  EXPECT_NO_THROW(validate(p));
  p.T = 0;  // no tokens, no pairs
  EXPECT_NO_THROW(validate(p));
  p = valid_experts(), p.R = p.T * p.E;  // every token to every expert
  EXPECT_NO_THROW(validate(p));
  for (int a = 0; a < kNumActivations; ++a) {
    p = valid_experts();
    p.activation = Activation(a), p.layout = GateUpLayout::Concatenated, p.has_bias = true;
    EXPECT_NO_THROW(validate(p)) << to_string(Activation(a));
  }
}

TEST(ExpertsValidate, RejectsEachBadField) {
  ExpertsProblem p = valid_experts();
  p.T = -1;
  expect_invalid(p, "T", "T < 0");
  for (int64_t v : {0, -8}) {
    p = valid_experts(), p.d = v;
    expect_invalid(p, "d", "d <= 0");
    p = valid_experts(), p.n = v;
    expect_invalid(p, "n", "n <= 0");
    p = valid_experts(), p.E = v;
    expect_invalid(p, "E", "E <= 0");
  }
  p = valid_experts(), p.R = -1;
  expect_invalid(p, "R", "R < 0");
  // More pairs than T·E is a valid size: the extra pairs may be out of range (they get no row).
  p = valid_experts(), p.R = p.T * p.E + 1;
  EXPECT_NO_THROW(validate(p)) << "R > T*E";
  p = valid_experts(), p.T = 0, p.R = 1;
  expect_invalid(p, "R", "R > 0 with T = 0");
  // Rows are int32 on the device.
  p = valid_experts(), p.T = 1 << 20, p.E = 1 << 12, p.R = int64_t{1} << 31;
  expect_invalid(p, "R", "R = 2^31");
  p = valid_experts(), p.T = std::numeric_limits<int32_t>::max(), p.R = 0;
  expect_invalid(p, "T", "T = 2^31 - 1");
  p = valid_experts(), p.E = (int64_t{1} << 30) + 1;
  expect_invalid(p, "E", "E > 2^30");
  mtest::expect_error(ErrorCode::InvalidArgument, [&] { plan_workspace(p); }, "plan_workspace E > 2^30");
}

// ---------------------------------------------------------------- the plan, restated
size_t a256(size_t v) { return (v + 255) / 256 * 256; }

// The blocks of experts_forward/backward written out from BACKWARD.md / the API comments: saved =
// H [R, n1] bf16, scores fp32 [R], expert_offsets [E+1], row_pair [R], pair_row [R], token offsets
// [T+1]; forward = row_token [R], A [R, n], Y [R, d] bf16, metadata workspace, tile offsets [E+1];
// backward = row_token [R], dH [R, n1], A' [R, n], dX~ [R, d] bf16, dS partials [R, tiles] fp32,
// tile offsets [E+1], each expert's first late row [E] (both), with biases chunk offsets [E+1] and partial sums [ceil(R/256) + E, max(d, n1)]
// fp32. Each sub-buffer starts on a 256-byte boundary.
WorkspacePlan restated(const ExpertsProblem& p) {
  const size_t R = p.R, T = p.T, E = p.E, d = p.d, n = p.n, n1 = is_glu(p.activation) ? 2 * n : n;
  const size_t tiles = static_cast<size_t>(grouped_gemm_column_tiles(p.n));
  WorkspacePlan w;
  w.saved_bytes = a256(R * n1 * 2) + 3 * a256(R * 4) + a256((E + 1) * 4) + a256((T + 1) * 4);
  w.forward_workspace_bytes = a256(R * 4) + a256(R * n * 2) + a256(R * d * 2) +
                              a256(routing_metadata_workspace_bytes(p.T, p.E)) + a256((E + 1) * 4) + a256(E * 4);
  w.backward_workspace_bytes = a256(R * 4) + a256(R * n1 * 2) + a256(R * n * 2) + a256(R * d * 2) +
                               a256(R * tiles * 4) + a256((E + 1) * 4) + a256(E * 4);
  if (p.has_bias) {
    const size_t chunks = (R + 255) / 256 + E;
    w.backward_workspace_bytes += a256((E + 1) * 4) + a256(chunks * std::max(d, n1) * 4);
  }
  return w;
}

TEST(ExpertsPlan, IsExact) {
  struct Cfg {
    int64_t T, d, n, E, R;
  };
  for (const Cfg c : {Cfg{24576, 1536, 256, 128, 24576 * 8}, Cfg{1, 64, 32, 8, 3}, Cfg{13, 64, 40, 64, 13},
                      Cfg{4096, 4096, 512, 128, 0}, Cfg{0, 64, 32, 4, 0}, Cfg{777, 768, 1024, 32, 1501}})
    for (Activation act : {Activation::SwiGLU, Activation::ReLU2})
      for (bool bias : {false, true}) {
        ExpertsProblem p;
        p.T = c.T, p.d = c.d, p.n = c.n, p.E = c.E, p.R = c.R, p.activation = act, p.has_bias = bias;
        SCOPED_TRACE("T=" + std::to_string(c.T) + " R=" + std::to_string(c.R) + " " + to_string(act) +
                     (bias ? " bias" : ""));
        const WorkspacePlan got = plan_workspace(p), want = restated(p);
        EXPECT_EQ(got.saved_bytes, want.saved_bytes);
        EXPECT_EQ(got.forward_workspace_bytes, want.forward_workspace_bytes);
        EXPECT_EQ(got.backward_workspace_bytes, want.backward_workspace_bytes);
      }
}

// The saved block holds no Y and no copy of x: below H + 12 bytes a pair + offsets + alignment.
TEST(ExpertsPlan, SavedIsTheMemoryMinimum) {
  ExpertsProblem p;
  p.T = 32768, p.d = 4096, p.n = 512, p.E = 128, p.R = 32768 * 8;
  const size_t R = p.R, minimum = R * 4 * p.n + 12 * R + 4 * (p.E + 1) + 4 * (p.T + 1);
  const size_t saved = plan_workspace(p).saved_bytes;
  EXPECT_GE(saved, minimum);
  EXPECT_LE(saved, minimum + 6 * 256);
}

// ---------------------------------------------------------------- refusals before any GPU work
// Host memory that nothing may touch (this machine may have no GPU): every refusal must come first.
struct HostArgs {
  std::vector<uint64_t> buf = std::vector<uint64_t>(1 << 17, 0x5555555555555555ull);
  void* ptr() { return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(buf.data()) + 255) & ~uintptr_t{255}); }
};

void expect_refusal(ErrorCode code, const std::function<void()>& call, const std::string& what,
                    const std::string& word) {
  const std::string msg = mtest::expect_error(code, call, what);
  EXPECT_NE(msg.find(word), std::string::npos) << what << ": message does not say " << word << ": " << msg;
}

// Every pointer of a call's arguments at m (host memory: the refusals come before any CUDA call).
ExpertsForwardArgs forward_args_at(void* m) {
  ExpertsForwardArgs fa;
  fa.x = fa.w1 = fa.w2 = m;
  fa.out = fa.saved = fa.workspace = m;
  fa.scores = static_cast<const float*>(m);
  fa.pair_token = fa.pair_expert = static_cast<const int32_t*>(m);
  return fa;
}
ExpertsBackwardArgs backward_args_at(void* m) {
  ExpertsBackwardArgs ba;
  ba.x = ba.w1 = ba.w2 = ba.saved = ba.dout = m;
  ba.dx = ba.dw1 = ba.dw2 = ba.workspace = m;
  ba.d_scores = static_cast<float*>(m);
  ba.pair_token = ba.pair_expert = static_cast<const int32_t*>(m);
  return ba;
}

TEST(ExpertsForward, RefusesWhatItDoesNotRun) {
  HostArgs h;
  void* m = h.ptr();
  const ExpertsForwardArgs fa = forward_args_at(m);
  auto refuses = [&](ErrorCode code, ExpertsProblem p, ExpertsForwardArgs a, const std::string& what,
                     const std::string& word) {
    expect_refusal(code, [&] { experts_forward(p, a, nullptr); }, what, word);
  };
  ExpertsProblem p = valid_experts();
  p.dtype = DType::FP32;
  refuses(ErrorCode::Unsupported, p, fa, "fp32 data", "bfloat16");
  p = valid_experts(), p.n = 100;
  refuses(ErrorCode::Unsupported, p, fa, "n % 8", "multiples of 8");
  p = valid_experts(), p.T = 0, p.R = 1;
  refuses(ErrorCode::InvalidArgument, p, fa, "R > 0 with T = 0", "ExpertsProblem.R");
  p = valid_experts(), p.has_bias = true;
  refuses(ErrorCode::InvalidArgument, p, fa, "has_bias without biases", "b1 must be given when has_bias");
  ExpertsForwardArgs a = fa;
  a.b1 = a.b2 = m;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "biases without has_bias",
          "b1 must be null unless has_bias");
  a = fa, a.pair_token = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null pair_token", "pair_token must not be null when R > 0");
  a = fa, a.scores = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null scores", "scores must not be null when R > 0");
  a = fa, a.out = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null out", "out must not be null when T > 0");
  a = fa, a.w2 = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null w2", "w2 must not be null");
  a = fa, a.saved = static_cast<char*>(m) + 128;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "saved 128-byte aligned", "saved must be 256-byte aligned");
  a = fa, a.x = static_cast<char*>(m) + 8;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "x 8-byte aligned", "x must be 16-byte aligned");
  // A split call: its early tokens within [0, T], and a known part.
  a = fa, a.part = ExpertsForwardPart::LateRows, a.early_tokens = valid_experts().T + 1;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "early_tokens past T", "early_tokens must be in [0, T = ");
  a = fa, a.part = ExpertsForwardPart::EarlyRows, a.early_tokens = -1;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "negative early_tokens", "early_tokens must be in [0, T");
  a = fa, a.part = ExpertsForwardPart::EarlyRows, a.x_early = static_cast<char*>(m) + 8;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "x_early 8-byte aligned", "x_early must be 16-byte aligned");
  a = fa, a.part = static_cast<ExpertsForwardPart>(9);
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "an unknown part", "part must be All, EarlyRows");
}

// precision FP8: the problem's rules (SwiGLU or the clamped SwiGLU, interleaved, bf16, d and n
// multiples of 16; biases allowed), the weights' FP8 copies given exactly with it, and whole calls
// only, refused by name.
TEST(ExpertsForward, RefusesWhatFp8DoesNotRun) {
  ExpertsProblem p = valid_experts();
  p.precision = Precision::FP8;
  EXPECT_NO_THROW(validate(p));
  auto invalid = [](ExpertsProblem q, const std::string& what, const std::string& word) {
    expect_refusal(ErrorCode::InvalidArgument, [&] { validate(q); }, what, word);
  };
  ExpertsProblem q = p;
  q.activation = Activation::GeGLU;
  invalid(q, "FP8 GeGLU", "ExpertsProblem.activation: must be SwiGLU or ClampedSwiGLU with precision FP8");
  q = p, q.layout = GateUpLayout::Concatenated;
  invalid(q, "FP8 concatenated", "ExpertsProblem.layout: must be interleaved with precision FP8");
  q = p, q.has_bias = true;
  EXPECT_NO_THROW(validate(q));  // the expert biases run in FP8 too
  q = p, q.d = 136;  // a multiple of 8, not of 16
  invalid(q, "FP8 d % 16", "ExpertsProblem.d: must be a multiple of 16 with precision FP8");
  q = p, q.n = 40;
  invalid(q, "FP8 n % 16", "ExpertsProblem.n: must be a multiple of 16 with precision FP8");
  q = p, q.precision = static_cast<Precision>(7);
  invalid(q, "unknown precision", "ExpertsProblem.precision: must be BF16 or FP8");

  HostArgs h;
  void* m = h.ptr();
  const ExpertsForwardArgs fa = forward_args_at(m);
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_forward(p, fa, nullptr); }, "FP8 without its weights",
                 "fp8_weights must be given with precision FP8");
  Fp8ExpertWeights w;
  w.w1 = w.w1_t = w.w2 = w.w2_t = static_cast<const uint8_t*>(m);
  w.w1_scales = w.w1_t_scales = w.w2_scales = w.w2_t_scales = static_cast<const float*>(m);
  ExpertsForwardArgs a = fa;
  a.fp8_weights = &w;
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_forward(valid_experts(), a, nullptr); },
                 "FP8 weights with BF16", "fp8_weights must be null unless precision is FP8");
  a.part = ExpertsForwardPart::EarlyRows;
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_forward(p, a, nullptr); }, "FP8 split call",
                 "part must be All with precision FP8");
  Fp8ExpertWeights missing = w;
  missing.w2_t_scales = nullptr;
  a = fa, a.fp8_weights = &missing;
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_forward(p, a, nullptr); }, "FP8 copy missing a scale",
                 "fp8_weights.w2_t_scales must not be null");
  Fp8ExpertWeights odd = w;
  odd.w1_t = static_cast<const uint8_t*>(m) + 4;
  a = fa, a.fp8_weights = &odd;
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_forward(p, a, nullptr); }, "FP8 codes misaligned",
                 "fp8_weights.w1_t must be 16-byte aligned");

  ExpertsBackwardArgs ba = backward_args_at(m);
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_backward(p, ba, nullptr); },
                 "FP8 backward without its weights", "fp8_weights must be given with precision FP8");
  ba.fp8_weights = &w;
  ba.part = ExpertsBackwardPart::DataGradients;
  expect_refusal(ErrorCode::InvalidArgument, [&] { experts_backward(p, ba, nullptr); }, "FP8 backward part",
                 "part must be All with precision FP8");
}

// FP8 keeps H as E4M3 codes and 1x128 scales: n1 + 4·ceil(n1/128) bytes a row against 2·n1.
TEST(ExpertsPlan, Fp8SavesHInE4M3) {
  ExpertsProblem p = valid_experts();
  const WorkspacePlan bf16 = plan_workspace(p);
  p.precision = Precision::FP8;
  const WorkspacePlan fp8 = plan_workspace(p);
  const int64_t n1 = 2 * p.n;
  const int64_t h_bf16 = p.R * n1 * 2, h_fp8 = p.R * (n1 + 4 * ((n1 + 127) / 128));
  const auto round = [](int64_t b) { return (b + 255) / 256 * 256; };
  EXPECT_EQ(static_cast<int64_t>(bf16.saved_bytes) - static_cast<int64_t>(fp8.saved_bytes),
            round(h_bf16) - round(h_fp8));
  EXPECT_GT(fp8.backward_workspace_bytes, bf16.backward_workspace_bytes);  // the FP8 operands' region
}

// The FP8 backward's shared region (host/layer/layer_layout.hpp, Fp8BackwardScratch): in every
// step of host/layer/fp8_experts.cu the buffers alive together (written by that step or an
// earlier one and read by it or a later one) are disjoint and inside the region, for awkward
// shapes.
TEST(ExpertsPlan, Fp8BackwardPhasesDoNotOverlap) {
  struct Span {
    const char* name;
    size_t at, bytes;
  };
  const auto rows = [](int64_t r, int64_t c) { return detail::fp8_rows_bytes(r, c); };
  for (const auto& [T, d, n, E, R] : {std::array<int64_t, 5>{256, 128, 64, 8, 600}, {1, 16, 16, 1, 1},
                                     {333, 2880, 2880, 16, 999}, {67, 144, 80, 64, 13}, {5, 4096, 512, 128, 0}}) {
    ExpertsProblem p;
    p.T = T, p.d = d, p.n = n, p.E = E, p.R = R, p.precision = Precision::FP8;
    const detail::ExpertsLayout L(validate(p));
    const detail::Fp8BackwardScratch& F = L.bwd.fp8;
    const int64_t n1 = 2 * n;
    const Fp8ColumnsLayout cd = fp8_columns_layout(R, E, d), cn = fp8_columns_layout(R, E, n),
                           cn1 = fp8_columns_layout(R, E, n1);
    const size_t da = static_cast<size_t>(R * n * 2), region = F.region_bytes;
    EXPECT_GE(F.chunk_offsets, F.region + F.region_bytes) << "the chunk offsets overlap the region";
    const Span dh_rows{"dH rows", F.dh_q, rows(R, n1)}, dh_cols{"dH columns", F.dh_cols, cn1.qt_bytes},
        dh_cols_scales{"dH column scales", F.dh_cols_scales, cn1.scales_bytes},
        ap_cols{"A' columns", F.ap_cols, cn.qt_bytes},
        ap_cols_scales{"A' column scales", F.ap_cols_scales, cn.scales_bytes};
    const std::vector<std::vector<Span>> phases = {
        // 1. dout's rows, dA' = dout·W2
        {{"dout rows", F.dout_q, rows(T, d)}, {"dA'", F.da, da}},
        // 2. the fused SwiGLU backward: dA' -> dH's rows and columns, A''s columns
        {{"dA'", F.da, da}, dh_rows, dh_cols, dh_cols_scales, ap_cols, ap_cols_scales},
        // 3. dout's columns, dW2
        {dh_rows, dh_cols, dh_cols_scales, ap_cols, ap_cols_scales, {"dout columns", F.dout_cols, cd.qt_bytes},
         {"dout column scales", F.dout_cols_scales, cd.scales_bytes}},
        // 4. dX~ = dH·W1, dx
        {dh_rows, dh_cols, dh_cols_scales, {"dX~", F.dx_rows, static_cast<size_t>(R * d * 2)}},
        // 5. x's columns, dW1
        {dh_cols, dh_cols_scales, {"x columns", F.x_cols, cd.qt_bytes},
         {"x column scales", F.x_cols_scales, cd.scales_bytes}}};
    for (const auto& live : phases)
      for (size_t i = 0; i < live.size(); ++i) {
        EXPECT_LE(live[i].at + live[i].bytes, region) << live[i].name << " past the region, R=" << R;
        EXPECT_EQ(live[i].at % 16, 0u) << live[i].name << " not 16-byte aligned";
        for (size_t j = 0; j < i; ++j)
          EXPECT_TRUE(live[i].at >= live[j].at + live[j].bytes || live[j].at >= live[i].at + live[i].bytes)
              << live[i].name << " overlaps " << live[j].name << ", R=" << R;
      }
    EXPECT_EQ(F.max_chunks, cd.max_chunks);
  }
}

// The weights' FP8 copies: the sizes of the four parts, each 256-byte aligned; the rules by name.
TEST(Fp8Weights, BytesAndRules) {
  const int64_t E = 3, d = 144, n = 80;
  const auto round = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t t_d = 2, t_n = 1, t_n1 = 2;  // ceil(144/128), ceil(80/128), ceil(160/128)
  const int64_t want = 2 * (round(E * 2 * n * d) + round(4 * E * t_n1 * t_d)) + 2 * (round(E * d * n) + round(4 * E * t_n * t_d));
  EXPECT_EQ(static_cast<int64_t>(fp8_expert_weights_bytes(E, d, n)), want);
  expect_refusal(ErrorCode::InvalidArgument, [&] { fp8_expert_weights_bytes(0, d, n); }, "E = 0", "E must be >= 1");
  expect_refusal(ErrorCode::InvalidArgument, [&] { fp8_expert_weights_bytes(E, 40, n); }, "d = 40",
                 "d must be a positive multiple of 16");
  expect_refusal(ErrorCode::InvalidArgument, [&] { quantize_expert_weights_fp8(E, d, 8, nullptr, nullptr, nullptr, nullptr); },
                 "n = 8", "n must be a positive multiple of 16");
}

TEST(ExpertsBackward, RefusesWhatItDoesNotRun) {
  HostArgs h;
  void* m = h.ptr();
  ExpertsBackwardArgs ba = backward_args_at(m);
  auto refuses = [&](ErrorCode code, ExpertsProblem p, ExpertsBackwardArgs a, const std::string& what,
                     const std::string& word) {
    expect_refusal(code, [&] { experts_backward(p, a, nullptr); }, what, word);
  };
  ExpertsProblem p = valid_experts();
  p.dtype = DType::FP16;
  refuses(ErrorCode::Unsupported, p, ba, "fp16 data", "bfloat16");
  p = valid_experts(), p.d = 60;
  refuses(ErrorCode::Unsupported, p, ba, "d % 8", "multiples of 8");
  p = valid_experts(), p.has_bias = true;
  ExpertsBackwardArgs a = ba;
  a.b1 = a.b2 = a.db1 = m;  // db2 missing
  refuses(ErrorCode::InvalidArgument, p, a, "db2 missing", "db2 must be given when has_bias");
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "biases without has_bias",
          "b1 must be null unless has_bias");
  a = ba, a.weight_grad_dtype = DType::FP16;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "fp16 weight gradients", "weight_grad_dtype");
  a = ba, a.d_scores = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null d_scores",
          "d_scores must not be null when R > 0");
  a = ba, a.pair_expert = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null pair_expert",
          "pair_expert must not be null when R > 0");
  a = ba, a.dout = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null dout", "dout must not be null when T > 0");
  a = ba, a.dw1 = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "null dw1", "dw1 must not be null");
  a = ba, a.workspace = static_cast<char*>(m) + 16;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "workspace 16-byte aligned",
          "workspace must be 256-byte aligned");
  a = ba, a.dout = static_cast<char*>(m) + 2;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "dout 2-byte aligned", "dout must be 16-byte aligned");
  // The two parts: each needs its own outputs, and says which part needs them.
  a = ba, a.part = ExpertsBackwardPart::DataGradients, a.dx = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "data part without dx",
          "dx must not be null when T > 0 and the data gradients are computed");
  a = ba, a.part = ExpertsBackwardPart::DataGradients, a.d_scores = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "data part without d_scores", "d_scores must not be null");
  a = ba, a.part = ExpertsBackwardPart::WeightGradients, a.dw2 = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "weight part without dw2",
          "dw2 must not be null when the weight gradients are computed");
  p = valid_experts(), p.has_bias = true;
  a = ba, a.part = ExpertsBackwardPart::WeightGradients, a.b1 = a.b2 = a.db1 = m;  // db2 missing
  refuses(ErrorCode::InvalidArgument, p, a, "weight part without db2", "db2 must be given when has_bias");
  a = ba, a.weights_max_ctas = -1;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "negative weights_max_ctas", "weights_max_ctas must be >= 0");
  a = ba, a.part = ExpertsBackwardPart::DataEarlyRows, a.early_tokens = valid_experts().T + 1;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "early_tokens past T", "early_tokens must be in [0, T = ");
  a = ba, a.part = ExpertsBackwardPart::DataLateRows, a.dx = nullptr;
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "a data part without dx", "dx must not be null");
  a = ba, a.part = static_cast<ExpertsBackwardPart>(7);
  refuses(ErrorCode::InvalidArgument, valid_experts(), a, "an unknown part", "part must be All, DataGradients");
}

// All-null arguments are refused on the host, before any CUDA call, for the empty cases too.
TEST(ExpertsApi, NullPointersAreRefusedWithoutACrash) {
  for (ExpertsProblem p : {valid_experts(), ExpertsProblem{0, 64, 32, 4, 0}}) {
    mtest::expect_error(ErrorCode::InvalidArgument, [&] { experts_forward(p, ExpertsForwardArgs{}, nullptr); },
                        "experts_forward with null pointers");
    mtest::expect_error(ErrorCode::InvalidArgument, [&] { experts_backward(p, ExpertsBackwardArgs{}, nullptr); },
                        "experts_backward with null pointers");
  }
}

}  // namespace
