// Helpers shared by the op bindings: argument checks that name the argument, and the translation
// of machmoe::Error into the PyTorch exception a Python user expects.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "machmoe/types.hpp"

namespace machmoe::bindings {

// Runs fn and maps machmoe::Error: InvalidArgument -> ValueError, NotBuilt -> NotImplementedError,
// everything else -> RuntimeError. The message is machmoe's own (it names argument and rule).
template <typename Fn>
auto translate_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    switch (e.code()) {
      case ErrorCode::InvalidArgument: TORCH_CHECK_VALUE(false, e.what());
      case ErrorCode::NotBuilt: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
      default: TORCH_CHECK(false, e.what());
    }
  }
}

inline void check_dims(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK_VALUE(t.dim() == dims, name, " must be ", dims, "-D, got shape ", t.sizes());
}

inline void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

}  // namespace machmoe::bindings
