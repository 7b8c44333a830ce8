// Launcher of the FP8 experts' SwiGLU backward fused with the column quantisation of dH and A'
// (host/quant/quant_internal.hpp states the call, kernels/layer/fp8_swiglu_columns.cuh the
// kernel): the chunk prefix (the column quantiser's kernel), then one CTA per possible chunk; both
// on the caller's stream, no host sync.
#include <limits>
#include <string>

#include "host/gemm/activation_params.hpp"
#include "host/quant/quant_internal.hpp"
#include "kernels/layer/fp8_swiglu_columns.cuh"
#include "machmoe/fp8.hpp"

namespace machmoe::detail {

void swiglu_backward_columns_fp8(const SwigluBackwardColumnsFp8Args& a, cudaStream_t stream) {
  constexpr const char* fn = "swiglu_backward_columns_fp8";
  require_arg(a.n >= 16 && a.n % 16 == 0 && a.n <= std::numeric_limits<int32_t>::max() / 2, fn, "n",
              "must be a positive multiple of 16 (16-byte rows of E4M3 codes) with 2n < 2^31, got " +
                  std::to_string(a.n));
  require_arg(a.R >= 0 && a.R <= kFp8Int32Limit, fn, "R", "must be in [0, 2^31 - 1], got " + std::to_string(a.R));
  require_arg(a.E >= 1 && a.E <= kFp8Int32Limit - 1, fn, "E", "must be in [1, 2^31 - 2], got " + std::to_string(a.E));
  require_arg(a.expert_offsets != nullptr && aligned4(a.expert_offsets), fn, "expert_offsets",
              "must be a 4-byte aligned device array of E+1 int32");
  require_arg(a.chunk_offsets != nullptr && aligned4(a.chunk_offsets), fn, "chunk_offsets",
              "must be a 4-byte aligned device array of E+1 int32");
  const int64_t n1 = 2 * a.n;
  // The two column operands share the chunk bound (fp8_columns_layout depends on R and E only).
  const Fp8ColumnsLayout layout = fp8_columns_layout(a.R, a.E, n1);
  require_arg(layout.qt_bytes / static_cast<size_t>(n1) == static_cast<size_t>(layout.r_pad), fn, "2n*r_pad",
              "overflows size_t");
  if (a.R > 0) {
    require_arg(a.da && a.hq && a.h_scales && a.scores && a.row_pair && a.d_scores && a.dh_q && a.dh_scales &&
                    a.dh_qt && a.dh_col_scales && a.ap_qt && a.ap_col_scales,
                fn, "da/hq/h_scales/scores/row_pair/d_scores/dh_q/dh_scales/dh_qt/dh_col_scales/ap_qt/ap_col_scales",
                "must not be null when R > 0");
  }
  require_arg(aligned16(a.da) && aligned16(a.dh_qt) && aligned16(a.ap_qt), fn, "da/dh_qt/ap_qt",
              "must be 16-byte aligned");
  require_arg(reinterpret_cast<uintptr_t>(a.hq) % 8 == 0 && reinterpret_cast<uintptr_t>(a.dh_q) % 8 == 0, fn,
              "hq/dh_q", "must be 8-byte aligned");
  require_arg(aligned4(a.h_scales) && aligned4(a.scores) && aligned4(a.row_pair) && aligned4(a.d_scores) &&
                  aligned4(a.dh_scales) && aligned4(a.dh_col_scales) && aligned4(a.ap_col_scales) &&
                  aligned4(a.dh_col_sums),
              fn, "h_scales/scores/row_pair/d_scores/dh_scales/dh_col_scales/ap_col_scales/dh_col_sums",
              "must be 4-byte aligned");

  if (a.clamp) check_glu_clamp(fn, Activation::ClampedSwiGLU, *a.clamp);

  launch_fp8_chunk_offsets(a.expert_offsets, a.E, a.R, a.chunk_offsets, stream);
  if (layout.max_chunks == 0) return;

  namespace k = kernels;
  k::Fp8SwigluColumnsParams p;
  p.da = static_cast<const __nv_bfloat16*>(a.da);
  p.hq = a.hq, p.h_scales = a.h_scales, p.scores = a.scores, p.row_pair = a.row_pair;
  p.R = a.R;
  p.n = static_cast<int>(a.n), p.n1 = static_cast<int>(n1), p.h_tiles = static_cast<int>(fp8_tiles(n1));
  p.offsets = a.expert_offsets, p.E = a.E, p.chunk_offsets = a.chunk_offsets;
  p.max_chunks = layout.max_chunks;
  p.d_scores = a.d_scores, p.dh_q = a.dh_q, p.dh_scales = a.dh_scales;
  p.dh_qt = a.dh_qt, p.dh_col_scales = a.dh_col_scales, p.ap_qt = a.ap_qt, p.ap_col_scales = a.ap_col_scales;
  p.dh_col_sums = a.dh_col_sums;
  p.clamp = glu_clamp_limits(a.clamp ? *a.clamp : GluClamp{});
  const auto launch = a.clamp ? k::fp8_swiglu_columns_kernel<true> : k::fp8_swiglu_columns_kernel<false>;
  const void* kernel = reinterpret_cast<const void*>(launch);
  constexpr size_t smem = k::kSwcSmemBytes;  // > 48 KiB: needs the opt-in
  allow_dynamic_smem(kernel, static_cast<int>(smem), "swiglu_backward_columns_fp8: cudaFuncSetAttribute");
  // The chunks that exist are known on the device only: one CTA for each there can be (those past
  // chunk_offsets[E] return at once; max_chunks <= R < 2^31 fits the grid).
  launch<<<static_cast<unsigned>(layout.max_chunks), k::kSwcThreads, smem, stream>>>(p);
  check_launch(fn);
}

}  // namespace machmoe::detail
