// Launcher of the FP8 quantisation of expert weights in 128x128 blocks (kernels/quant/weights.cuh),
// with or without the transposed copy. One CTA per block. Argument rules: machmoe/fp8.hpp.
#include <string>

#include "host/quant/quant_internal.hpp"
#include "kernels/quant/weights.cuh"
#include "machmoe/fp8.hpp"

namespace machmoe {
using detail::check_launch;
using detail::require_arg;

void quantize_weights_fp8(const QuantizeWeightsArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "quantize_weights_fp8";
  require_arg(a.E >= 0, fn, "E", "must be >= 0, got " + std::to_string(a.E));
  require_arg(a.N >= 0, fn, "N", "must be >= 0, got " + std::to_string(a.N));
  require_arg(a.K >= 0 && a.K % 16 == 0, fn, "K",
              "must be a multiple of 16 (16-byte rows of e4m3 codes), got " + std::to_string(a.K));
  require_arg(!a.transposed || a.N % 16 == 0, fn, "N",
              "must be a multiple of 16 with transposed (16-byte rows of qt), got " + std::to_string(a.N));
  const int64_t nb_n = fp8_tiles(a.N), nb_k = fp8_tiles(a.K);
  require_arg(nb_n == 0 || nb_k == 0 || a.E <= detail::kFp8Int32Limit / (nb_n * nb_k), fn, "E*N*K",
              "must give fewer than 2^31 blocks of 128x128");
  require_arg(a.N == 0 || a.K <= std::numeric_limits<int64_t>::max() / a.N / std::max<int64_t>(a.E, 1), fn,
              "E*N*K", "overflows int64");
  const int64_t blocks = a.E * nb_n * nb_k;
  require_arg(blocks == 0 || (a.w != nullptr && a.q != nullptr && a.scales != nullptr), fn, "w/q/scales",
              "must not be null for a nonempty tensor");
  require_arg(!a.transposed || blocks == 0 || (a.qt != nullptr && a.scales_t != nullptr), fn, "qt/scales_t",
              "must not be null with transposed");
  require_arg(detail::aligned16(a.w), fn, "w", "must be 16-byte aligned");
  require_arg(detail::aligned16(a.q), fn, "q", "must be 16-byte aligned");
  require_arg(detail::aligned4(a.scales), fn, "scales", "must be 4-byte aligned");
  require_arg(!a.transposed || detail::aligned16(a.qt), fn, "qt", "must be 16-byte aligned");
  require_arg(!a.transposed || detail::aligned4(a.scales_t), fn, "scales_t", "must be 4-byte aligned");
  if (blocks == 0) return;

  namespace k = kernels::fp8;
  k::WeightsParams p;
  p.w = static_cast<const __nv_bfloat16*>(a.w);
  p.N = a.N, p.K = a.K, p.nb_n = nb_n, p.nb_k = nb_k;
  p.q = a.q, p.scales = a.scales;
  p.qt = a.transposed ? a.qt : nullptr;
  p.scales_t = a.transposed ? a.scales_t : nullptr;
  const unsigned grid = static_cast<unsigned>(blocks);
  if (a.transposed) {
    k::fp8_quantize_weights_kernel<true><<<grid, k::kWeightsThreads, 0, stream>>>(p);
  } else {
    k::fp8_quantize_weights_kernel<false><<<grid, k::kWeightsThreads, 0, stream>>>(p);
  }
  check_launch("quantize_weights_fp8");
}

}  // namespace machmoe
