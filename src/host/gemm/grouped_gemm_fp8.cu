// Launcher of the FP8 grouped GEMM (kernels/gemm/fp8_cooperative.cuh): argument rules, the TMA
// descriptors of the e4m3 operands, and the persistent launch (one CTA per SM). The rules and
// the formula: machmoe/fp8.hpp, grouped_gemm_fp8.
#include <cuda.h>

#include <algorithm>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/common/tensor_map.hpp"
#include "host/gemm/activation_params.hpp"
#include "host/gemm/tile_offsets.hpp"
#include "kernels/gemm/fp8_cooperative.cuh"
#include "machmoe/fp8.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::aligned4;
using detail::ceil_div;
using detail::check_launch;
using detail::require_arg;

namespace {

constexpr const char* kFn = "grouped_gemm_fp8";
// The tile's width: two 128-column waves per consumer warpgroup, 64 x 256 fp32 accumulators
// (128 registers) beside one wave's temporary (64).
constexpr int kTileN = 256;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

static_assert(kernels::kFp8BK == 128, "detail::e4m3_tile_map's boxes are 128 codes wide");

// Every rule the kernel relies on, before any CUDA call (so that they hold without a GPU).
void check_args(const GroupedGemmFp8Args& a) {
  require_arg(a.E >= 1 && a.E <= (1 << 24), kFn, "E", "must be in [1, 2^24], got " + std::to_string(a.E));
  require_arg(a.N >= 8 && a.N % 8 == 0, kFn, "N",
              "must be a positive multiple of 8 (16-byte rows of C), got " + std::to_string(a.N));
  require_arg(a.K >= 16 && a.K % 16 == 0, kFn, "K",
              "must be a positive multiple of 16 (16-byte rows of e4m3 codes for the TMA), got " + std::to_string(a.K));
  require_arg(a.R >= 0 && a.R <= kInt32Max, kFn, "R", "must be in [0, 2^31 - 1], got " + std::to_string(a.R));
  if (a.gather) {
    require_arg(a.T >= 0 && a.T <= kInt32Max, kFn, "T",
                "must be in [0, 2^31 - 1] with a gather (rows of a_q), got " + std::to_string(a.T));
    // The gathered loaders address a_q in 16-byte units held in 32 bits, two values kept as markers.
    require_arg(a.T * (a.K / 16) <= (int64_t{1} << 32) - 3, kFn, "T*K",
                "must be below 2^36 with a gather (a_q's 16-byte chunks are addressed in 32 bits), got T=" +
                    std::to_string(a.T) + ", K=" + std::to_string(a.K));
    require_arg(aligned4(a.gather), kFn, "gather", "must be 4-byte aligned");
  }
  // (W[e] rows e·N + n0 + 128h, h < 2, are int32 TMA coordinates)
  require_arg(a.N <= kInt32Max / a.E && a.E * a.N + kTileN <= kInt32Max, kFn, "E*N",
              "must be below 2^31 - 256 (int32 row coordinates of W [E*N, K]), got E=" + std::to_string(a.E) +
                  ", N=" + std::to_string(a.N));
  require_arg(a.K <= kInt32Max, kFn, "K", "must be below 2^31");
  // The schedule counts tiles in int32: at most (ceil(R/128) + E) row blocks x ceil(N/256) column tiles.
  require_arg((ceil_div(a.R, kernels::kGemmBM) + a.E) * ceil_div(a.N, kTileN) <= kInt32Max, kFn, "R*N",
              "give too many tiles: (ceil(R/128) + E)·ceil(N/256) must be below 2^31");
  require_arg(a.a_q && a.a_scales && a.w_q && a.w_scales && a.expert_offsets, kFn,
              "a_q/a_scales/w_q/w_scales/expert_offsets", "must not be null");
  if (a.epilogue == Fp8GemmEpilogue::Glu) {
    require_arg(a.N % 32 == 0, kFn, "N",
                "must be a multiple of 32 with the GLU epilogue (16-byte rows of act_q [R, N/2]), got " +
                    std::to_string(a.N));
    require_arg(is_glu(a.activation), kFn, "activation",
                "must be a GLU kind (swiglu, geglu, reglu, clamped_swiglu) with the GLU epilogue, got " +
                    std::to_string(static_cast<int>(a.activation)));
    require_arg(a.hq && a.h_scales && a.act_q && a.act_scales, kFn, "hq/h_scales/act_q/act_scales",
                "must not be null with the GLU epilogue");
    require_arg(detail::aligned16(a.hq) && detail::aligned16(a.act_q), kFn, "hq/act_q",
                "must be 16-byte aligned (the down-projection and the backward read them by TMA)");
    require_arg(aligned4(a.h_scales) && aligned4(a.act_scales), kFn, "h_scales/act_scales", "must be 4-byte aligned");
  } else {
    require_arg(a.epilogue == Fp8GemmEpilogue::Store, kFn, "epilogue", "must be Store or Glu");
    require_arg(a.bias == nullptr || a.gather == nullptr, kFn, "bias",
                "must be null with a gather and the plain store (a bias is added by the GLU epilogue or the "
                "staged store of a contiguous A)");
    require_arg(a.c != nullptr, kFn, "c", "must not be null");
    require_arg(a.ldc >= a.N && a.ldc % 8 == 0, kFn, "ldc",
                "must be >= N and a multiple of 8, got ldc=" + std::to_string(a.ldc) + ", N=" + std::to_string(a.N));
    require_arg(detail::aligned16(a.c), kFn, "c", "must be 16-byte aligned");
  }
  require_arg(a.E <= kernels::kGemmSmemTileE || a.tile_offsets != nullptr, kFn, "tile_offsets",
              "must not be null when E > " + std::to_string(kernels::kGemmSmemTileE) + " (the kernel's table is global)");
  require_arg((reinterpret_cast<uintptr_t>(a.bias) & 1u) == 0, kFn, "bias", "must be 2-byte aligned (bf16)");
  require_arg(detail::aligned16(a.a_q), kFn, "a_q", "must be 16-byte aligned (TMA)");
  require_arg(detail::aligned16(a.w_q), kFn, "w_q", "must be 16-byte aligned (TMA)");
  require_arg(aligned4(a.a_scales), kFn, "a_scales", "must be 4-byte aligned");
  require_arg(aligned4(a.w_scales), kFn, "w_scales", "must be 4-byte aligned");
  require_arg(aligned4(a.expert_offsets) && aligned4(a.tile_offsets), kFn, "expert_offsets/tile_offsets",
              "must be 4-byte aligned");
  require_arg(a.max_ctas >= 0, kFn, "max_ctas", "must be >= 0 (0: one CTA per SM), got " + std::to_string(a.max_ctas));
}

}  // namespace

void grouped_gemm_fp8(const GroupedGemmFp8Args& a, cudaStream_t stream) {
  check_args(a);
  if (a.R == 0) return;  // no rows: every expert is empty, nothing to write

  const DeviceInfo info = device_info();
  if (info.cc_major != 9)
    throw Error(ErrorCode::Unsupported, std::string(kFn) + ": needs an sm_90 GPU (wgmma), the device is sm_" +
                                            std::to_string(info.cc_major) + std::to_string(info.cc_minor));
  const bool glu = a.epilogue == Fp8GemmEpilogue::Glu;
  // The plain store of a contiguous A stages its output tile (fp8_cooperative.cuh): a bigger block.
  const bool staged = !glu && !a.gather;
  const int smem = staged ? kernels::Fp8GemmSmem<kTileN, true>::kBytes : kernels::Fp8GemmSmem<kTileN, false>::kBytes;
  require_arg(info.smem_per_block_optin >= static_cast<size_t>(smem), kFn, "device",
              "needs " + std::to_string(smem) + " bytes of shared memory per block, the device allows " +
                  std::to_string(info.smem_per_block_optin));

  kernels::Fp8GemmParams p{};
  p.g.expert_offsets = a.expert_offsets;
  p.g.expert_ends = a.expert_offsets + 1;
  p.g.tile_offsets = a.tile_offsets;
  p.g.c = static_cast<__nv_bfloat16*>(a.c);
  p.g.ldc = a.ldc;
  p.g.E = static_cast<int>(a.E);
  p.g.N = static_cast<int>(a.N);
  p.g.K = static_cast<int>(a.K);
  p.g.n_tiles = static_cast<int>(ceil_div(a.N, kTileN));
  p.g.gather = a.gather;
  p.aq = a.a_q;
  p.sa = a.a_scales;
  p.sb = a.w_scales;
  p.a_rows = static_cast<int>(a.gather ? a.T : a.R);
  p.c_rows = static_cast<int>(a.R);
  p.k_blocks = static_cast<int>(fp8_tiles(a.K));
  p.n_blocks = static_cast<int>(fp8_tiles(a.N));
  if (glu) {
    detail::set_activation(p.g, a.activation, a.glu_clamp);
    p.glu = {a.hq, a.h_scales, a.act_q, a.act_scales};
  }
  p.g.bias = static_cast<const __nv_bfloat16*>(a.bias);  // [E, N] bf16, added in fp32 before rounding

  // Above the kernel's shared-memory table the tile-offset table comes from the scan kernel.
  if (a.E > kernels::kGemmSmemTileE) {
    detail::launch_gemm_tile_offsets(p.g.expert_offsets, p.g.expert_ends, p.g.E, p.g.n_tiles, a.tile_offsets,
                                     "grouped_gemm_fp8: tile offsets", stream);
  }
  const CUtensorMap map_b = detail::e4m3_tile_map(a.w_q, a.E * a.N, a.K, kFn);
  // With a gather the kernel copies A's rows itself: the map is unused (any valid map will do).
  const CUtensorMap map_a = a.gather ? map_b : detail::e4m3_tile_map(a.a_q, a.R, a.K, kFn);
  // C [R, N] (rows ldc apart) in the staged tile's boxes; unused without staging (any valid map).
  const CUtensorMap map_c = staged ? detail::tensor_map_2d(a.c, a.R, a.N, a.ldc, 64, 128, kFn) : map_b;
  const int ctas = a.max_ctas > 0 ? std::min(a.max_ctas, info.sm_count) : info.sm_count;
  using kernels::kFp8EpiGlu;
  using kernels::kFp8EpiStore;
  auto* kernel = a.gather ? (glu ? kernels::sm90_grouped_gemm_fp8<kTileN, true, kFp8EpiGlu>
                                 : kernels::sm90_grouped_gemm_fp8<kTileN, true, kFp8EpiStore>)
                          : (glu ? kernels::sm90_grouped_gemm_fp8<kTileN, false, kFp8EpiGlu>
                                 : kernels::sm90_grouped_gemm_fp8<kTileN, false, kFp8EpiStore>);
  detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, "grouped_gemm_fp8: cudaFuncSetAttribute");
  kernel<<<ctas, kernels::kGemmThreads, smem, stream>>>(map_a, map_b, map_c, p);
  check_launch(kFn);
}

}  // namespace machmoe
