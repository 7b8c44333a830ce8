// Launcher of the FP8 experts' SwiGLU backward (machmoe/fp8_swiglu.hpp,
// kernels/layer/fp8_swiglu_backward.cuh): one warp per row, a grid of a few waves.
#include <algorithm>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/gemm/activation_params.hpp"
#include "kernels/layer/fp8_swiglu_backward.cuh"
#include "machmoe/fp8_swiglu.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::check_launch;
using detail::require_arg;

void swiglu_backward_fp8(const SwigluBackwardFp8Args& a, cudaStream_t stream) {
  constexpr const char* fn = "swiglu_backward_fp8";
  require_arg(a.n >= 4 && a.n % 4 == 0 && a.n <= std::numeric_limits<int32_t>::max() / 2, fn, "n",
              "must be >= 4, a multiple of 4 and 2n < 2^31, got " + std::to_string(a.n));
  require_arg(a.R >= 0 && a.R <= std::numeric_limits<int32_t>::max(), fn, "R",
              "must be in [0, 2^31), got " + std::to_string(a.R));
  if (a.R == 0) return;
  require_arg(a.da && a.hq && a.h_scales && a.scores && a.row_pair && a.dh && a.a_prime && a.d_scores, fn,
              "da/hq/h_scales/scores/row_pair/dh/a_prime/d_scores", "must not be null when R > 0");
  require_arg(detail::aligned16(a.da) && detail::aligned16(a.dh) && detail::aligned16(a.a_prime), fn,
              "da/dh/a_prime", "must be 16-byte aligned");
  require_arg(reinterpret_cast<uintptr_t>(a.hq) % 8 == 0, fn, "hq", "must be 8-byte aligned");
  require_arg((a.dh_q == nullptr) == (a.dh_scales == nullptr), fn, "dh_q/dh_scales", "must be given together or not");
  if (a.dh_q) {
    require_arg(a.n % 8 == 0, fn, "n", "must be a multiple of 8 with dh_q (16-byte rows of codes), got " +
                                         std::to_string(a.n));
    require_arg(reinterpret_cast<uintptr_t>(a.dh_q) % 8 == 0 && detail::aligned4(a.dh_scales), fn, "dh_q/dh_scales",
                "must be 8- and 4-byte aligned");
  }
  if (a.clamp) check_glu_clamp(fn, Activation::ClampedSwiGLU, *a.clamp);
  kernels::Fp8SwigluBackwardParams p;
  p.da = static_cast<const __nv_bfloat16*>(a.da);
  p.hq = a.hq;
  p.h_scales = a.h_scales;
  p.scores = a.scores;
  p.row_pair = a.row_pair;
  p.R = a.R;
  p.n = static_cast<int>(a.n);
  p.h_tiles = static_cast<int>((2 * a.n + 127) / 128);
  p.dh = static_cast<__nv_bfloat16*>(a.dh);
  p.a_prime = static_cast<__nv_bfloat16*>(a.a_prime);
  p.d_scores = a.d_scores;
  p.dh_q = a.dh_q;
  p.dh_scales = a.dh_scales;
  p.clamp = detail::glu_clamp_limits(a.clamp ? *a.clamp : GluClamp{});
  constexpr int kWarps = 8;
  // A few waves of 8-warp blocks over the rows (memory-bound: enough warps in flight to cover
  // the loads), never more blocks than rows need.
  const int64_t blocks = std::min<int64_t>((a.R + kWarps - 1) / kWarps, int64_t{8} * device_info().sm_count);
  const auto kernel =
      a.clamp ? kernels::fp8_swiglu_backward<kWarps, true> : kernels::fp8_swiglu_backward<kWarps, false>;
  kernel<<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(p);
  check_launch(fn);
}

}  // namespace machmoe
