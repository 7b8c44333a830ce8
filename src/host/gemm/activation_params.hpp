// The activation fields of the GEMM engine's kernel parameters, shared by the bf16 and FP8
// launchers: the GemmActivation code and the clamped SwiGLU's parameters, its two variants as
// limits (+inf: not applied) so that the epilogues have no branch. Included by .cu files only.
#pragma once

#include <limits>

#include "kernels/gemm/params.cuh"
#include "machmoe/types.hpp"

namespace machmoe::detail {

inline void set_activation(kernels::GroupedGemmParams& p, Activation activation, const GluClamp& clamp) {
  const float no_limit = std::numeric_limits<float>::infinity();
  p.act = static_cast<int>(activation);
  p.clamp_alpha = clamp.alpha;
  p.clamp_gate_limit = clamp.clamp_after ? no_limit : clamp.limit;
  p.clamp_act_limit = clamp.clamp_after ? clamp.limit : no_limit;
  p.clamp_up_limit = clamp.limit;
  p.clamp_up_offset = clamp.up_offset;
}

}  // namespace machmoe::detail
