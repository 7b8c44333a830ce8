// Launcher of the weight-gradient grouped GEMM (varlen K, kernels/gemm/wgrad.cuh): argument rules,
// the TMA descriptors, and the persistent launch of the configuration that choose_wgrad_config
// (host/gemm/config.cpp) picked.
#include <cuda.h>

#include <algorithm>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/common/tensor_map.hpp"
#include "host/gemm/config.hpp"
#include "kernels/gemm/wgrad.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;

namespace {

// units: work units (tiles, or tile pairs with kPair); max_ctas: the caller's bound (0: none).
template <int BN, bool kPair>
void launch(const CUtensorMap& map_b, const CUtensorMap& map_c, const kernels::GroupedWgradParams& p, int64_t units,
            int64_t max_ctas, cudaStream_t stream) {
  constexpr int smem = kernels::WgradSmem<BN>::kBytes;
  auto* kernel = kernels::sm90_grouped_wgrad<BN, kPair>;
  detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, "grouped_gemm_wgrad: cudaFuncSetAttribute");
  require_arg(device_info().smem_per_block_optin >= static_cast<size_t>(smem), "grouped_gemm_wgrad", "device",
              "needs " + std::to_string(smem) + " bytes of shared memory per block");
  const int sms = device_info().sm_count;
  const int64_t cap = max_ctas > 0 ? std::min<int64_t>(max_ctas, sms) : sms;
  if constexpr (!kPair) {
    kernel<<<static_cast<int>(std::min(cap, units)), kernels::kWgradThreads, smem, stream>>>(map_b, map_c, p);
    return;
  }
  // Clusters of two CTAs: as many as the device runs at once (one CTA per SM), at most one per
  // unit.
  detail::ClusterLaunch launch(2, kernels::kWgradThreads, smem, stream);
  const int clusters = detail::max_active_clusters(reinterpret_cast<const void*>(kernel), launch.config,
                                                   "grouped_gemm_wgrad: cudaOccupancyMaxActiveClusters");
  launch.config.gridDim =
      dim3(static_cast<unsigned>(2 * std::max<int64_t>(1, std::min({int64_t{clusters}, cap / 2, units}))));
  check_cuda(cudaLaunchKernelEx(&launch.config, kernel, map_b, map_c, p), "grouped_gemm_wgrad: cudaLaunchKernelEx");
}

}  // namespace

void grouped_gemm_wgrad(const GroupedWgradArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "grouped_gemm_wgrad";
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  require_arg(a.E >= 1 && a.E <= (1 << 24), fn, "E", "must be in [1, 2^24], got " + std::to_string(a.E));
  require_arg(a.M >= 8 && a.M % 8 == 0 && a.M <= (1 << 24), fn, "M",
              "must be a positive multiple of 8 (16-byte rows), got " + std::to_string(a.M));
  require_arg(a.N >= 8 && a.N % 8 == 0 && a.N <= (1 << 24), fn, "N",
              "must be a positive multiple of 8 (16-byte rows), got " + std::to_string(a.N));
  require_arg(a.lda >= a.M && a.lda % 8 == 0, fn, "lda", "must be >= M and a multiple of 8");
  require_arg(a.ldb >= a.N && a.ldb % 8 == 0, fn, "ldb", "must be >= N and a multiple of 8");
  require_arg(a.a_rows >= 1 && a.a_rows <= kInt32Max && a.b_rows >= 1 && a.b_rows <= kInt32Max, fn, "a_rows/b_rows",
              "must be in [1, 2^31)");
  // Row counters run in int32 up to a K block and two index chunks past an expert's last row.
  constexpr int64_t kRowSlack = 2 * kernels::kWgradIdxChunk;
  require_arg(a.b_rows <= kInt32Max - kRowSlack, fn, "b_rows",
              "must be at most 2^31 - 1 - " + std::to_string(kRowSlack) + " (int32 row counters), got " +
                  std::to_string(a.b_rows));
  // The loaders address rows in 16-byte units held in 32 bits.
  require_arg(a.a_rows * (a.lda / 8) <= (int64_t{1} << 32) - 1 && a.b_rows * (a.ldb / 8) <= (int64_t{1} << 32) - 1, fn,
              "a_rows*lda/b_rows*ldb", "each operand must hold fewer than 2^35 elements (64 GiB of bf16)");
  require_arg(a.a && a.b && a.c && a.expert_offsets, fn, "a/b/c/expert_offsets", "must not be null");
  require_arg(detail::aligned16(a.a) && detail::aligned16(a.b) && detail::aligned16(a.c), fn, "a/b/c",
              "must be 16-byte aligned");
  require_arg(a.c_dtype == DType::FP32 || a.c_dtype == DType::BF16, fn, "c_dtype", "must be FP32 or BF16");
  require_arg(a.kernel >= WgradKernel::Auto && a.kernel <= WgradKernel::CtaPairs, fn, "kernel", "out of range");
  detail::WgradShape shape;
  shape.E = a.E;
  shape.M = a.M;
  shape.N = a.N;
  shape.max_ctas = a.max_ctas;
  shape.kernel = a.kernel;
  const detail::WgradConfig cfg = detail::choose_wgrad_config(shape);
  static_assert(detail::kWgradTileM == kernels::kWgradBM, "the configuration's tile height is the kernel's");
  const int bn = cfg.bn;
  require_arg(a.E * cfg.m_tiles * cfg.n_tiles <= kInt32Max, fn, "E*M*N", "too many output tiles for int32 tile indices");

  kernels::GroupedWgradParams p{};
  p.a = static_cast<const __nv_bfloat16*>(a.a);
  p.lda = a.lda;
  p.gather = a.a_gather;
  p.b = static_cast<const __nv_bfloat16*>(a.b);
  p.ldb = a.ldb;
  p.expert_offsets = a.expert_offsets;
  p.E = static_cast<int>(a.E);
  p.M = static_cast<int>(a.M);
  p.N = static_cast<int>(a.N);
  p.m_tiles = static_cast<int>(cfg.m_tiles);
  p.n_tiles = static_cast<int>(cfg.n_tiles);
  p.c = a.c;
  p.c_fp32 = a.c_dtype == DType::FP32;
  p.transpose_c = a.transpose_c;
  // B [b_rows, N] in boxes of 64 columns x 64 rows (an MN-major operand block).
  const CUtensorMap map_b = detail::tensor_map_2d(a.b, a.b_rows, a.N, a.ldb, 64, kernels::kWgradBK, fn);
  // bf16 C: full tiles leave by TMA from each consumer warpgroup's staged part: C [E*M, N] in
  // boxes {64 n, 64 m}, or transposed C [E*N, M] in boxes {64 m, bn n}.
  p.tma_c = a.c_dtype == DType::BF16;
  const CUtensorMap map_c = !p.tma_c ? map_b
                            : a.transpose_c ? detail::tensor_map_2d(a.c, a.E * a.N, a.M, a.M, 64, std::min(bn, 128), fn)
                                            : detail::tensor_map_2d(a.c, a.E * a.M, a.N, a.N, 64, 64, fn);
  // CTA pairs share the gathered A tile (kernels/gemm/wgrad.cuh).
  const bool pair = cfg.cta_pairs;
  const int64_t units = cfg.units;
  if (bn == 256) {
    if (pair)
      launch<256, true>(map_b, map_c, p, units, a.max_ctas, stream);
    else
      launch<256, false>(map_b, map_c, p, units, a.max_ctas, stream);
  } else {
    if (pair)
      launch<128, true>(map_b, map_c, p, units, a.max_ctas, stream);
    else
      launch<128, false>(map_b, map_c, p, units, a.max_ctas, stream);
  }
  check_launch(fn);
}

}  // namespace machmoe
