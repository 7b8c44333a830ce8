// Names of the public enums, in both directions. The Python package and the op schemas use the
// same lower-case names, so a user sees one vocabulary everywhere.
#include "machmoe/types.hpp"

#include <array>
#include <cmath>
#include <string>
#include <utility>

namespace machmoe {
namespace {

template <typename Enum, size_t N>
using NameTable = std::array<std::pair<Enum, const char*>, N>;

constexpr NameTable<Activation, 8> kActivations{{{Activation::SwiGLU, "swiglu"},
                                                 {Activation::GeGLU, "geglu"},
                                                 {Activation::ReGLU, "reglu"},
                                                 {Activation::ReLU2, "relu2"},
                                                 {Activation::ReLU, "relu"},
                                                 {Activation::GELU, "gelu"},
                                                 {Activation::SiLU, "silu"},
                                                 {Activation::ClampedSwiGLU, "clamped_swiglu"}}};
constexpr NameTable<GateUpLayout, 2> kLayouts{
    {{GateUpLayout::Interleaved, "interleaved"}, {GateUpLayout::Concatenated, "concatenated"}}};
constexpr NameTable<RoutingMethod, 4> kRoutings{{{RoutingMethod::SoftmaxTopK, "softmax_topk"},
                                                 {RoutingMethod::TopKSoftmax, "topk_softmax"},
                                                 {RoutingMethod::Sigmoid, "sigmoid"},
                                                 {RoutingMethod::SqrtSoftplus, "sqrt_softplus"}}};
constexpr NameTable<TokenRounding, 5> kRoundings{{{TokenRounding::None, "none"},
                                                  {TokenRounding::Nearest, "nr"},
                                                  {TokenRounding::Up, "up"},
                                                  {TokenRounding::Down, "down"},
                                                  {TokenRounding::Stochastic, "stochastic"}}};
constexpr NameTable<DType, 3> kDTypes{
    {{DType::BF16, "bfloat16"}, {DType::FP16, "float16"}, {DType::FP32, "float32"}}};
constexpr NameTable<Precision, 2> kPrecisions{{{Precision::BF16, "bf16"}, {Precision::FP8, "fp8"}}};

template <typename Enum, size_t N>
const char* name_of(const NameTable<Enum, N>& table, Enum v) {
  for (const auto& [e, name] : table)
    if (e == v) return name;
  return "<invalid>";
}

template <typename Enum, size_t N>
Enum parse(const NameTable<Enum, N>& table, std::string_view s, const char* what) {
  std::string choices;
  for (const auto& [e, name] : table) {
    if (s == name) return e;
    choices += choices.empty() ? "" : ", ";
    choices += name;
  }
  throw Error(ErrorCode::InvalidArgument,
              std::string(what) + ": unknown value '" + std::string(s) + "'; choose one of " + choices);
}

}  // namespace

const char* to_string(Activation a) { return name_of(kActivations, a); }
const char* to_string(GateUpLayout l) { return name_of(kLayouts, l); }
const char* to_string(RoutingMethod m) { return name_of(kRoutings, m); }
const char* to_string(TokenRounding r) { return name_of(kRoundings, r); }
const char* to_string(DType t) { return name_of(kDTypes, t); }
const char* to_string(Precision p) { return name_of(kPrecisions, p); }

Activation parse_activation(std::string_view s) { return parse(kActivations, s, "activation"); }
GateUpLayout parse_layout(std::string_view s) { return parse(kLayouts, s, "layout"); }
RoutingMethod parse_routing(std::string_view s) { return parse(kRoutings, s, "routing"); }
TokenRounding parse_token_rounding(std::string_view s) {
  return parse(kRoundings, s, "token_rounding");
}

void check_glu_clamp(const char* fn, Activation act, const GluClamp& c) {
  const auto fail = [&](const std::string& rule) {
    throw Error(ErrorCode::InvalidArgument, std::string(fn) + ": glu_clamp " + rule);
  };
  if (!std::isfinite(c.alpha) || !std::isfinite(c.limit) || !std::isfinite(c.up_offset))
    fail("alpha, limit and up_offset must be finite");
  if (!(c.alpha > 0.f)) fail("alpha must be > 0 (got " + std::to_string(c.alpha) + ")");
  if (!(c.limit > 0.f)) fail("limit must be > 0 (got " + std::to_string(c.limit) + ")");
  if (act != Activation::ClampedSwiGLU && c != GluClamp{})
    fail(std::string("parameters are taken by activation clamped_swiglu only (activation is ") + to_string(act) +
         "); leave them at their defaults");
}

}  // namespace machmoe
