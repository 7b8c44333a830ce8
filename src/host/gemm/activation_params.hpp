// The activation fields of the GEMM engine's kernel parameters, shared by the bf16 and FP8
// launchers: the GemmActivation code and the clamped SwiGLU's parameters, its two variants as
// limits (+inf: not applied) so that the epilogues have no branch; the same limits for the FP8
// SwiGLU backward's launchers. Included by .cu files only.
#pragma once

#include <limits>

#include "kernels/common.cuh"
#include "kernels/gemm/params.cuh"
#include "machmoe/types.hpp"

namespace machmoe::detail {

// machmoe::GluClamp as the kernels take it (kernels/common.cuh, GluClampLimits): the GEMM
// epilogues' clamped SwiGLU and the FP8 SwiGLU backward's.
inline kernels::GluClampLimits glu_clamp_limits(const GluClamp& c) {
  const float no_limit = std::numeric_limits<float>::infinity();
  kernels::GluClampLimits k;
  k.alpha = c.alpha;
  k.gate_limit = c.clamp_after ? no_limit : c.limit;
  k.act_limit = c.clamp_after ? c.limit : no_limit;
  k.up_limit = c.limit;
  k.up_offset = c.up_offset;
  return k;
}

inline void set_activation(kernels::GroupedGemmParams& p, Activation activation, const GluClamp& clamp) {
  const kernels::GluClampLimits k = glu_clamp_limits(clamp);
  p.act = static_cast<int>(activation);
  p.clamp_alpha = k.alpha;
  p.clamp_gate_limit = k.gate_limit;
  p.clamp_act_limit = k.act_limit;
  p.clamp_up_limit = k.up_limit;
  p.clamp_up_offset = k.up_offset;
}

}  // namespace machmoe::detail
