// The rules for what enters the GPU calls of the layer and of the experts on a general routing list
// (layer_forward / layer_backward, experts_forward / experts_backward), checked in one place:
// what the GPU path adds to validate()'s problem rules, and the device pointers' rules (given,
// aligned, biases exactly with has_bias). Every refusal names the function, the argument and the
// rule, and happens on the host before any CUDA call.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "host/common/check.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// The data rules of the GPU kernels: bf16 data, 16-byte rows (d and n multiples of 8).
inline void require_gpu_data(DType dtype, int64_t d, int64_t n, const char* fn) {
  if (dtype != DType::BF16)
    throw Error(ErrorCode::Unsupported,
                std::string(fn) + ": the GPU layer runs in bfloat16, got dtype=" + to_string(dtype));
  if (d % 8 != 0 || n % 8 != 0)
    throw Error(ErrorCode::Unsupported, std::string(fn) + ": d and n must be multiples of 8 (16-byte rows), got d=" +
                                            std::to_string(d) + ", n=" + std::to_string(n));
}

// The GPU layer's rules beyond validate(): the data rules, at most 32 experts per token with
// token rounding (the rounding kernels keep a token's choices in registers), at most 32 groups.
inline void require_gpu_problem(const ValidLayerProblem& valid, const char* fn) {
  const LayerProblem& p = *valid;
  require_arg(p.rounding == TokenRounding::None || p.K <= 32, fn, "K", "must be <= 32 with token rounding");
  require_arg(p.n_group <= 32, fn, "n_group",
              "must be <= 32 on the GPU (the router scores one group per lane), got " + std::to_string(p.n_group));
  require_gpu_data(p.dtype, p.d, p.n, fn);
}
inline void require_gpu_problem(const ValidExpertsProblem& valid, const char* fn) {
  require_gpu_data(valid->dtype, valid->d, valid->n, fn);
}

// One device pointer argument of a call, by the name the caller knows it by.
struct PointerArg {
  const char* name;
  const void* ptr;
};
using PointerArgs = std::initializer_list<PointerArg>;

// Each pointer given (not null). `when` names the condition for arrays that are otherwise empty,
// and so may be null as an empty framework tensor's data is ("T > 0"); null: always.
inline void require_given(const char* fn, PointerArgs args, const char* when = nullptr) {
  for (const PointerArg& a : args)
    require_arg(a.ptr != nullptr, fn, a.name,
                when ? std::string("must not be null when ") + when : std::string("must not be null"));
}

// Optional arguments given exactly when `wanted` (the biases and their gradients with has_bias).
inline void require_given_exactly_when(bool wanted, const char* condition, const char* fn, PointerArgs args) {
  for (const PointerArg& a : args)
    require_arg((a.ptr != nullptr) == wanted, fn, a.name,
                std::string(wanted ? "must be given when " : "must be null unless ") + condition);
}

// Rows the kernels read or write as 16-byte vectors (TMA tiles, vector loads): each pointer
// 16-byte aligned where given.
inline void require_row_aligned(const char* fn, PointerArgs args) {
  for (const PointerArg& a : args)
    require_arg(a.ptr == nullptr || aligned16(a.ptr), fn, a.name, "must be 16-byte aligned (16-byte row vectors)");
}

// The caller's `saved` block and workspace: 256-byte aligned, as every part inside them is
// (host/layer/saved_layout.hpp).
inline void require_block_aligned(const char* fn, PointerArgs args) {
  for (const PointerArg& a : args)
    require_arg((reinterpret_cast<uintptr_t>(a.ptr) & 255) == 0, fn, a.name, "must be 256-byte aligned");
}

// The weights' FP8 copies: given exactly with precision FP8, every pointer of them then given and
// aligned as the FP8 GEMMs read them (codes 16-byte, scales 4-byte); an FP8 call is whole
// (`whole`: the split calls' parts run in bf16 only).
inline void require_fp8_weights(Precision precision, const Fp8ExpertWeights* w, bool whole, const char* fn) {
  const bool fp8 = precision == Precision::FP8;
  require_arg((w != nullptr) == fp8, fn, "fp8_weights",
              fp8 ? "must be given with precision FP8 (quantize_expert_weights_fp8)" : "must be null unless precision is FP8");
  if (!fp8) return;
  require_arg(whole, fn, "part", "must be All with precision FP8 (the split calls run in bf16 only)");
  const PointerArgs codes{{"fp8_weights.w1", w->w1}, {"fp8_weights.w1_t", w->w1_t}, {"fp8_weights.w2", w->w2},
                          {"fp8_weights.w2_t", w->w2_t}};
  const PointerArgs scales{{"fp8_weights.w1_scales", w->w1_scales}, {"fp8_weights.w1_t_scales", w->w1_t_scales},
                           {"fp8_weights.w2_scales", w->w2_scales}, {"fp8_weights.w2_t_scales", w->w2_t_scales}};
  require_given(fn, codes);
  require_given(fn, scales);
  require_row_aligned(fn, codes);
  for (const PointerArg& a : scales)
    require_arg((reinterpret_cast<uintptr_t>(a.ptr) & 3) == 0, fn, a.name, "must be 4-byte aligned");
}

// The weight gradients' dtype: what the weight-gradient GEMMs write.
inline void require_weight_grad_dtype(DType t, const char* fn) {
  require_arg(t == DType::BF16 || t == DType::FP32, fn, "weight_grad_dtype",
              std::string("must be bfloat16 or float32, got ") + to_string(t));
}

}  // namespace machmoe::detail
