// The clamped SwiGLU's parameters (machmoe::GluClamp) as the FP8 SwiGLU backward kernels take them
// (kernels/layer/fp8_swiglu_math.cuh): its two variants as limits, +inf where a clamp is not
// applied, as the GEMM epilogues' (host/gemm/activation_params.hpp). Included by .cu files only.
#pragma once

#include <limits>

#include "kernels/layer/fp8_swiglu_math.cuh"
#include "machmoe/types.hpp"

namespace machmoe::detail {

inline kernels::SwigluClamp swiglu_clamp_params(const GluClamp& c) {
  const float no_limit = std::numeric_limits<float>::infinity();
  kernels::SwigluClamp k;
  k.alpha = c.alpha;
  k.gate_limit = c.clamp_after ? no_limit : c.limit;
  k.act_limit = c.clamp_after ? c.limit : no_limit;
  k.up_limit = c.limit;
  k.up_offset = c.up_offset;
  return k;
}

}  // namespace machmoe::detail
