// Launcher of the FP8 weight-gradient grouped GEMM (kernels/gemm/fp8_wgrad.cuh): argument rules,
// the TMA descriptors of the two e4m3 operands and (bf16 C) of the output for the staged TMA
// store, and the persistent launch (at most one CTA per SM, none idle: never more CTAs than
// tiles). The rules and the formula: machmoe/fp8_wgrad.hpp.
#include <cuda.h>

#include <algorithm>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/common/tensor_map.hpp"
#include "kernels/gemm/fp8_wgrad.cuh"
#include "machmoe/fp8_wgrad.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::aligned4;
using detail::ceil_div;
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;

namespace {

constexpr const char* kFn = "grouped_wgrad_fp8";
// The tile: 128 M x 256 N, two 128-column waves per consumer warpgroup (64 x 256 fp32
// accumulators, 128 registers, beside one wave's temporary, 64), as the forward FP8 GEMM.
constexpr int kTileN = 256;
// The staged bf16 store's boxes, per consumer warpgroup (64 rows of M): transposed, C[e]ᵀ's
// columns m0 .. m0 + 63 of rows n0 .. n0 + 255, one box; plain, 64 columns n x 64 rows m, four
// boxes.
constexpr int kEpiCols = kernels::kFp8WgradEpiCols;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// The kernel's tile counter steps past the last tile by at most the grid (<= the SM count).
constexpr int64_t kTileSlack = int64_t{1} << 16;

static_assert(kernels::kFp8WgradBK == 128, "detail::e4m3_tile_map's boxes are 128 codes wide");

// Every rule the kernel relies on, before any CUDA call (so that they hold without a GPU).
void check_args(const GroupedWgradFp8Args& a) {
  require_arg(a.E >= 1 && a.E <= (1 << 24), kFn, "E", "must be in [1, 2^24], got " + std::to_string(a.E));
  require_arg(a.M >= 16 && a.M % 16 == 0 && a.M <= (1 << 24), kFn, "M",
              "must be a multiple of 16 in [16, 2^24] (quantize_columns_fp8's d), got " + std::to_string(a.M));
  require_arg(a.N >= 16 && a.N % 16 == 0 && a.N <= (1 << 24), kFn, "N",
              "must be a multiple of 16 in [16, 2^24] (quantize_columns_fp8's d), got " + std::to_string(a.N));
  require_arg(a.max_chunks >= 0 && a.max_chunks <= kInt32Max / kernels::kFp8WgradBK, kFn, "max_chunks",
              "must be >= 0 with 128·max_chunks < 2^31 (int32 row counts of the chunk layout), got " +
                  std::to_string(a.max_chunks));
  // (at most 2^24 · 2^17 · 2^16: no overflow in int64)
  const int64_t tiles = a.E * ceil_div(a.M, kernels::kFp8WgradBM) * ceil_div(a.N, kTileN);
  require_arg(tiles <= kInt32Max - kTileSlack, kFn, "E*M*N",
              "give too many tiles: E·ceil(M/128)·ceil(N/256) must be below 2^31 - 2^16, got " + std::to_string(tiles));
  require_arg(a.c_dtype == DType::FP32 || a.c_dtype == DType::BF16, kFn, "c_dtype", "must be FP32 or BF16");
  require_arg(a.c && a.chunk_offsets, kFn, "c/chunk_offsets", "must not be null");
  require_arg(a.max_chunks == 0 || (a.a_qt && a.a_scales && a.b_qt && a.b_scales), kFn,
              "a_qt/a_scales/b_qt/b_scales", "must not be null (max_chunks > 0)");
  require_arg(detail::aligned16(a.a_qt), kFn, "a_qt", "must be 16-byte aligned (TMA)");
  require_arg(detail::aligned16(a.b_qt), kFn, "b_qt", "must be 16-byte aligned (TMA)");
  require_arg(detail::aligned16(a.c), kFn, "c", "must be 16-byte aligned (TMA store)");
  require_arg(detail::aligned16(a.a_scales), kFn, "a_scales", "must be 16-byte aligned (TMA)");
  require_arg(detail::aligned16(a.b_scales), kFn, "b_scales", "must be 16-byte aligned (TMA)");
  require_arg(aligned4(a.chunk_offsets), kFn, "chunk_offsets", "must be 4-byte aligned");
  require_arg(a.max_ctas >= 0, kFn, "max_ctas", "must be >= 0 (0: one CTA per SM), got " + std::to_string(a.max_ctas));
}

}  // namespace

void grouped_wgrad_fp8(const GroupedWgradFp8Args& a, cudaStream_t stream) {
  check_args(a);
  const int64_t c_bytes = a.E * a.M * a.N * dtype_size(a.c_dtype);
  if (a.max_chunks == 0) {  // R = 0: no expert has a chunk, every C[e] is 0 (and no TMA map of width 0)
    check_cuda(cudaMemsetAsync(a.c, 0, static_cast<size_t>(c_bytes), stream), "grouped_wgrad_fp8: cudaMemsetAsync");
    return;
  }

  const DeviceInfo info = device_info();
  if (info.cc_major != 9)
    throw Error(ErrorCode::Unsupported, std::string(kFn) + ": needs an sm_90 GPU (wgmma), the device is sm_" +
                                            std::to_string(info.cc_major) + std::to_string(info.cc_minor));
  const bool fp32 = a.c_dtype == DType::FP32;
  // bf16 C: 3 stages and the staging tile; fp32 C: 4 stages (kernels::Fp8WgradSmem).
  const int smem =
      fp32 ? kernels::Fp8WgradSmem<kTileN, false>::kBytes : kernels::Fp8WgradSmem<kTileN, true>::kBytes;
  require_arg(info.smem_per_block_optin >= static_cast<size_t>(smem), kFn, "device",
              "needs " + std::to_string(smem) + " bytes of shared memory per block, the device allows " +
                  std::to_string(info.smem_per_block_optin));

  kernels::Fp8WgradParams p{};
  p.chunk_offsets = a.chunk_offsets;
  p.E = static_cast<int>(a.E);
  p.M = static_cast<int>(a.M);
  p.N = static_cast<int>(a.N);
  p.max_chunks = static_cast<int>(a.max_chunks);
  p.m_tiles = static_cast<int>(ceil_div(a.M, kernels::kFp8WgradBM));
  p.n_tiles = static_cast<int>(ceil_div(a.N, kTileN));
  p.c = a.c;

  // Aqt [max_chunks, M, 128], Bqt [max_chunks, N, 128]: one box = one 128-row chunk of an expert
  // for 128 rows; their scales [max_chunks, M | N]: one box = a chunk's scales of a tile's rows.
  const CUtensorMap map_a = detail::e4m3_chunk_map(a.a_qt, a.max_chunks, a.M, kFn);
  const CUtensorMap map_b = detail::e4m3_chunk_map(a.b_qt, a.max_chunks, a.N, kFn);
  const CUtensorMap map_sa = detail::f32_row_map(a.a_scales, a.max_chunks, a.M, kernels::kFp8WgradBM, kFn);
  const CUtensorMap map_sb = detail::f32_row_map(a.b_scales, a.max_chunks, a.N, kTileN, kFn);
  // C as [E][rows][cols] bf16 for the staged store (C[e]ᵀ [N, M] with transpose_c, else
  // C[e] [M, N]); fp32 C is stored from the registers and the kernel never reads this map.
  CUtensorMap map_c{};
  if (!fp32)
    map_c = a.transpose_c ? detail::tensor_map_experts(a.c, a.E, a.N, a.M, kEpiCols, kTileN, kFn)
                          : detail::tensor_map_experts(a.c, a.E, a.M, a.N, kEpiCols, 64, kFn);
  const int64_t tiles = a.E * p.m_tiles * p.n_tiles;
  const int64_t cap = a.max_ctas > 0 ? std::min(a.max_ctas, info.sm_count) : info.sm_count;
  const int ctas = static_cast<int>(std::min(cap, tiles));
  auto* kernel = fp32 ? (a.transpose_c ? kernels::sm90_grouped_wgrad_fp8<kTileN, float, true>
                                       : kernels::sm90_grouped_wgrad_fp8<kTileN, float, false>)
                      : (a.transpose_c ? kernels::sm90_grouped_wgrad_fp8<kTileN, __nv_bfloat16, true>
                                       : kernels::sm90_grouped_wgrad_fp8<kTileN, __nv_bfloat16, false>);
  detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, "grouped_wgrad_fp8: cudaFuncSetAttribute");
  kernel<<<ctas, kernels::kFp8WgradThreads, smem, stream>>>(map_a, map_b, map_sa, map_sb, map_c, p);
  check_launch(kFn);
}

}  // namespace machmoe
