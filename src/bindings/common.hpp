// Helpers shared by the op bindings: argument checks that name the argument, and the translation
// of machmoe::Error into the PyTorch exception a Python user expects.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>
#include <utility>

#include "machmoe/types.hpp"

namespace machmoe::bindings {

// Error messages are built here from std::string and std::to_string and handed to PyTorch as one
// finished string, never through an ostream (which TORCH_CHECK's variadic form, c10::str, uses).
// On the lent GPU machine's PyTorch, formatting an integer through an ostream inside this library
// killed the process with a segfault instead of raising (session 22: every shape check that
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

inline void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  MACHMOE_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

// A bfloat16 CUDA tensor, contiguous, of the given shape (the layer's data).
inline void check_bf16(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  MACHMOE_CHECK_VALUE(t.is_cuda() && t.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CUDA tensor, got ",
                    t.scalar_type(), " on ", t.device());
  MACHMOE_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  check_shape(t, name, shape);
}

// The fields a LayerProblem or an ExpertsProblem takes from the tensors (x [T, d], w1 [E, n1, d],
// w2 [E, d, n]) and the options both have; the caller sets the rest and validates.
template <typename Problem>
Problem problem_from_tensors(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, bool has_bias,
                             const std::string& activation, const std::string& layout) {
  check_dims(x, "x", 2);
  check_dims(w1, "w1", 3);
  check_dims(w2, "w2", 3);
  Problem p;
  p.T = x.size(0);
  p.d = x.size(1);
  p.E = w1.size(0);
  p.n = w2.size(2);
  p.activation = parse_activation(activation);
  p.layout = parse_layout(layout);
  p.has_bias = has_bias;
  p.dtype = DType::BF16;
  return p;
}

// The `saved` block a forward op returned, handed back to its backward op: uint8, contiguous,
// on `device`, of the plan's size for the same problem.
inline void check_saved(const at::Tensor& saved, size_t bytes, const at::Device& device, const char* forward_op) {
  MACHMOE_CHECK_VALUE(saved.is_cuda() && saved.scalar_type() == at::kByte && saved.is_contiguous() && saved.dim() == 1,
                    "saved must be the contiguous uint8 CUDA tensor ", forward_op, " returned");
  MACHMOE_CHECK_VALUE(saved.numel() == static_cast<int64_t>(bytes), "saved must have ", bytes,
                    " bytes for this problem (the ", forward_op, " call with the same arguments), got ", saved.numel());
  MACHMOE_CHECK_VALUE(saved.device() == device, "saved must be on x's device (", device, "), got ", saved.device());
}

}  // namespace machmoe::bindings
