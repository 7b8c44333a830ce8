// machmoe public types: enums and the error type shared by the C++ API, the CPU reference and the
// bindings. No CUDA and no PyTorch here, so a pure-CPU user can include it.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace machmoe {

// Activation of the expert MLP. GLU kinds make W1 produce 2n columns (gate/up pairs).
// ClampedSwiGLU: the clamped SwiGLU of gpt-oss and DeepSeek-V4, with its parameters in GluClamp.
enum class Activation : int32_t {
  SwiGLU = 0, GeGLU = 1, ReGLU = 2, ReLU2 = 3, ReLU = 4, GELU = 5, SiLU = 6, ClampedSwiGLU = 7
};
inline constexpr int kNumActivations = 8;

constexpr bool is_glu(Activation a) {
  return a == Activation::SwiGLU || a == Activation::GeGLU || a == Activation::ReGLU ||
         a == Activation::ClampedSwiGLU;
}

// The parameters of Activation::ClampedSwiGLU, with L = limit, α = alpha, o = up_offset
// (docs/LAYER.md gives the derivatives):
//   clamp_after = false: g' = min(g, L), u' = clamp(u, -L, L), A = g'·σ(α·g')·(u' + o)
//   clamp_after = true:  A = min(g·σ(α·g), L)·(clamp(u, -L, L) + o)
// The defaults are gpt-oss's; DeepSeek-V4's is {alpha = 1, limit = 10, up_offset = 0}. Runtime
// values: the kernels take them as arguments. Any other activation requires the defaults.
struct GluClamp {
  float alpha = 1.702f;
  float limit = 7.f;
  float up_offset = 1.f;
  bool clamp_after = false;
  bool operator==(const GluClamp& o) const {
    return alpha == o.alpha && limit == o.limit && up_offset == o.up_offset && clamp_after == o.clamp_after;
  }
  bool operator!=(const GluClamp& o) const { return !(*this == o); }
};

// Throws Error(InvalidArgument) naming `fn` and the rule: alpha, limit and up_offset finite,
// alpha > 0, limit > 0, and the defaults unless act is ClampedSwiGLU.
void check_glu_clamp(const char* fn, Activation act, const GluClamp& c);

// Where gate and up live among the 2n rows of W1 (and columns of H): see docs/LAYER.md.
enum class GateUpLayout : int32_t { Interleaved = 0, Concatenated = 1 };

// How the router turns logits [T, E] into K (expert, score) pairs per token. Sigmoid and
// SqrtSoftplus score each expert on its own (a gate g(logit)); selection_bias and group-limited
// selection apply to them.
enum class RoutingMethod : int32_t { SoftmaxTopK = 0, TopKSoftmax = 1, Sigmoid = 2, SqrtSoftplus = 3 };

constexpr bool is_gate_routing(RoutingMethod m) {
  return m == RoutingMethod::Sigmoid || m == RoutingMethod::SqrtSoftplus;
}

// The router's options beyond the method (docs/LAYER.md "Routing"); the defaults leave them off.
struct RouterOptions {
  // Scores are multiplied by this after renormalisation (DeepSeek-V3, Kimi, GLM: 2.5, 2.827, ...).
  double routed_scaling_factor = 1.0;
  // Group-limited selection (gate routings only): the E experts form n_group groups of E/n_group
  // consecutive experts; a group's score is the sum of its two largest selection values; only the
  // experts of the topk_group best groups can be selected. n_group = 1: no grouping.
  int64_t n_group = 1;
  int64_t topk_group = 1;
};

// Tile-aware token rounding (training only). None = plain top-K.
enum class TokenRounding : int32_t { None = 0, Nearest = 1, Up = 2, Down = 3, Stochastic = 4 };

enum class DType : int32_t { BF16 = 0, FP16 = 1, FP32 = 2 };

inline constexpr int64_t dtype_size(DType t) { return t == DType::FP32 ? 4 : 2; }

// The operands of the expert GEMMs (docs/LAYER.md, "FP8"). BF16: the data dtype throughout. FP8:
// E4M3 with DeepSeek-V3's tile scaling (1x128 along the reduction dimension for activations and
// gradients, 128x128 blocks for the weights), fp32 accumulation, H kept in E4M3 between forward
// and backward; the router, the scores and the gradients handed back stay in higher precision.
enum class Precision : int32_t { BF16 = 0, FP8 = 1 };

enum class ErrorCode : int32_t {
  InvalidArgument = 1,  // an argument breaks a documented rule; the message names both
  Unsupported = 2,      // valid, but outside what this build handles (message says what is)
  NotBuilt = 3,         // the GPU kernel family is not implemented yet
  CudaError = 4,        // a CUDA runtime call failed
};

// Every error machmoe raises. what() names the function, the argument and the rule broken.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

const char* to_string(Activation a);
const char* to_string(GateUpLayout l);
const char* to_string(RoutingMethod m);
const char* to_string(TokenRounding r);
const char* to_string(DType t);
const char* to_string(Precision p);

// Parse the names used by the Python package ("swiglu", "interleaved", "softmax_topk", "nr", ...).
// Throws Error(InvalidArgument) listing the accepted names.
Activation parse_activation(std::string_view s);
GateUpLayout parse_layout(std::string_view s);
RoutingMethod parse_routing(std::string_view s);
TokenRounding parse_token_rounding(std::string_view s);

}  // namespace machmoe
