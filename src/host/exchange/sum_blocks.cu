// Launcher of sum_blocks (kernels/exchange/sum_blocks.cuh): checks the arguments, picks the
// vectorised path when every address is 16-byte aligned, and sizes the grid from the SM count, on
// the caller's stream.
#include <algorithm>
#include <string>

#include "host/common/check.hpp"
#include "kernels/exchange/sum_blocks.cuh"
#include "machmoe/machmoe.hpp"
#include "machmoe/sum_blocks.hpp"

namespace machmoe {
using detail::ceil_div;
using detail::require_arg;

void sum_blocks(const SumBlocksArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "sum_blocks";
  require_arg(a.count >= 1 && a.count <= kernels::kSumMaxBlocks, fn, "count",
              "must be in [1, " + std::to_string(kernels::kSumMaxBlocks) + "], got " + std::to_string(a.count));
  require_arg(a.elems >= 0, fn, "elems", "must be >= 0, got " + std::to_string(a.elems));
  require_arg(a.dtype == DType::BF16 || a.dtype == DType::FP32, fn, "dtype", "must be BF16 or FP32");
  if (a.elems == 0) return;
  require_arg(a.parts != nullptr, fn, "parts", "must be a host array of count device addresses");
  bool aligned = detail::aligned16(a.out);
  for (int64_t q = 0; q < a.count; ++q) {
    require_arg(a.parts[q] != nullptr, fn, "parts", "part " + std::to_string(q) + " is null");
    aligned = aligned && detail::aligned16(a.parts[q]);
  }
  require_arg(a.out != nullptr, fn, "out", "must be non-null");

  kernels::SumBlocksParams p{};
  std::copy(a.parts, a.parts + a.count, p.parts);
  p.count = static_cast<int32_t>(a.count);
  p.elems = a.elems;
  const int64_t per_unit = a.dtype == DType::BF16 ? 8 : 4;
  p.units = aligned ? a.elems / per_unit : 0;
  p.out = a.out;
  const auto kernel =
      a.dtype == DType::BF16 ? kernels::sum_blocks_kernel<__nv_bfloat16> : kernels::sum_blocks_kernel<float>;
  // As many blocks as fit at once (the loop is grid-strided), but no more than the work needs.
  const int per_sm = std::max(1, detail::blocks_per_sm(reinterpret_cast<const void*>(kernel), kernels::kSumThreads, 0,
                                                       "sum_blocks: occupancy"));
  const int64_t resident = static_cast<int64_t>(device_info().sm_count) * per_sm;
  const int64_t items = std::max(ceil_div(p.units, int64_t{kernels::kSumUnroll}), a.elems - p.units * per_unit);
  const auto blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min(resident, ceil_div(items, int64_t{kernels::kSumThreads}))));
  kernel<<<blocks, kernels::kSumThreads, 0, stream>>>(p);
  detail::check_launch("sum_blocks");
}

}  // namespace machmoe
