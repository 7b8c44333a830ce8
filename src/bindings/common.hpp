// Helpers shared by the op bindings: argument checks that name the argument, and the translation
// of machmoe::Error into the PyTorch exception a Python user expects.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "machmoe/machmoe.hpp"
#include "machmoe/types.hpp"

namespace machmoe::bindings {

// The expert weights' FP8 copies as the C++ calls read them, from the 8 tensors
// fp8_quantize_weights wrote with transposed = true for w1 [E, 2n, d] (gate/up interleaved) and
// w2 [E, d, n]: [w1_q, w1_scales, w1_qt, w1_scales_t, w2_q, w2_scales, w2_qt, w2_scales_t], each
// checked (device, dtype, shape) against E, d, n. Defined in fp8_ops.cpp; the FP8 experts ops and
// the layer ops take them.
Fp8ExpertWeights fp8_weights_of(at::TensorList w, int64_t E, int64_t d, int64_t n, const at::Device& device);

// The copies of a layer or experts call (problem p: its E, d, n) when given: precision FP8.
template <typename Problem>
std::optional<Fp8ExpertWeights> optional_fp8_weights(const std::optional<at::TensorList>& fp8_weights,
                                                     const Problem& p, const at::Device& device) {
  if (!fp8_weights) return std::nullopt;
  return fp8_weights_of(*fp8_weights, p.E, p.d, p.n, device);
}

// Error messages are built here from std::string and std::to_string and handed to PyTorch as one
// finished string, never through an ostream (which TORCH_CHECK's variadic form, c10::str, uses).
// With the PyTorch of a GPU machine (torch 2.11), formatting an integer through an ostream inside
// this library killed the process with a segfault instead of raising (every shape check that
// printed a size did so; strings and dtypes did not), so no message here takes that path.
inline std::string msg_part(const char* s) { return s; }
inline std::string msg_part(const std::string& s) { return s; }
template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
std::string msg_part(I v) {
  return std::to_string(v);
}
inline std::string msg_part(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
inline std::string msg_part(at::ScalarType t) { return c10::toString(t); }
inline std::string msg_part(const at::Device& d) { return d.str(); }

template <typename... Args>
std::string message(const Args&... args) {
  return (std::string() + ... + msg_part(args));
}

[[noreturn]] inline void throw_value_error(const std::string& m) { C10_THROW_ERROR(ValueError, m); }

// TORCH_CHECK_VALUE without c10::str: raises ValueError with the concatenated message.
#define MACHMOE_CHECK_VALUE(cond, ...)                                                          \
  do {                                                                                          \
    if (!(cond)) ::machmoe::bindings::throw_value_error(::machmoe::bindings::message(__VA_ARGS__)); \
  } while (0)

// Runs fn and maps machmoe::Error: InvalidArgument -> ValueError, NotBuilt -> NotImplementedError,
// everything else -> RuntimeError. The message is machmoe's own (it names argument and rule).
template <typename Fn>
auto translate_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    switch (e.code()) {
      case ErrorCode::InvalidArgument: C10_THROW_ERROR(ValueError, std::string(e.what()));
      case ErrorCode::NotBuilt: C10_THROW_ERROR(NotImplementedError, std::string(e.what()));
      default: C10_THROW_ERROR(Error, std::string(e.what()));
    }
  }
}

inline void check_dims(const at::Tensor& t, const char* name, int64_t dims) {
  MACHMOE_CHECK_VALUE(t.dim() == dims, name, " must be ", dims, "-D, got shape ", t.sizes());
}

// The rules for a tensor entering a CUDA op, in one place: on a CUDA device (on `device` when
// given: the op's first tensor's, so that one op never mixes devices), of `dtype`, contiguous
// (the kernels index raw rows), of `shape` (pass t.sizes() to accept any). The first rule broken
// raises ValueError naming the argument and the rule.
inline void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                         const at::Device* device = nullptr) {
  MACHMOE_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  if (device)
    MACHMOE_CHECK_VALUE(t.device() == *device, name, " must be on the device of the op's first tensor (", *device,
                        "), got ", t.device());
  MACHMOE_CHECK_VALUE(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
  MACHMOE_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  MACHMOE_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

inline void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  MACHMOE_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

// A bfloat16 CUDA tensor, contiguous, of the given shape (the layer's data).
inline void check_bf16(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                       const at::Device* device = nullptr) {
  check_tensor(t, name, at::kBFloat16, shape, device);
}

// The clamped SwiGLU's parameters as the ops take them (`float[] glu_clamp`): empty for the
// defaults (machmoe::GluClamp), or [alpha, limit, up_offset, clamp_after] with clamp_after 0 or 1.
inline GluClamp glu_clamp_from(at::ArrayRef<double> v) {
  GluClamp c;
  if (v.empty()) return c;
  MACHMOE_CHECK_VALUE(v.size() == 4, "glu_clamp must be empty or [alpha, limit, up_offset, clamp_after], got ",
                      static_cast<int64_t>(v.size()), " values");
  MACHMOE_CHECK_VALUE(v[3] == 0.0 || v[3] == 1.0, "glu_clamp: clamp_after (its 4th value) must be 0 or 1");
  c.alpha = static_cast<float>(v[0]);
  c.limit = static_cast<float>(v[1]);
  c.up_offset = static_cast<float>(v[2]);
  c.clamp_after = v[3] == 1.0;
  return c;
}

// The fields a LayerProblem or an ExpertsProblem takes from the tensors (x [T, d], w1 [E, n1, d],
// w2 [E, d, n]) and the options both have; the caller sets the rest and validates.
template <typename Problem>
Problem problem_from_tensors(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, bool has_bias,
                             const std::string& activation, const std::string& layout,
                             at::ArrayRef<double> glu_clamp) {
  check_dims(x, "x", 2);
  check_dims(w1, "w1", 3);
  check_dims(w2, "w2", 3);
  Problem p;
  p.T = x.size(0);
  p.d = x.size(1);
  p.E = w1.size(0);
  p.n = w2.size(2);
  p.activation = parse_activation(activation);
  p.glu_clamp = glu_clamp_from(glu_clamp);
  p.layout = parse_layout(layout);
  p.has_bias = has_bias;
  p.dtype = DType::BF16;
  return p;
}

// The `saved` block a forward op returned, handed back to its backward op: 1-D uint8 of the plan's
// size for the same problem, on `device`, contiguous.
inline void check_saved(const at::Tensor& saved, size_t bytes, const at::Device& device, const char* forward_op) {
  MACHMOE_CHECK_VALUE(saved.dim() == 1 && saved.numel() == static_cast<int64_t>(bytes), "saved must have ", bytes,
                      " bytes for this problem (what ", forward_op, " returned for the same arguments), got shape ",
                      saved.sizes());
  check_tensor(saved, "saved", at::kByte, saved.sizes(), &device);
}

}  // namespace machmoe::bindings
