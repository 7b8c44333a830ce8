// Launcher of the FP8 quantisation along rows (kernels/quant/rows.cuh) and of the element-wise
// conversion check (kernels/quant/convert.cuh). Argument rules: machmoe/fp8.hpp.
#include <algorithm>
#include <string>

#include "host/quant/quant_internal.hpp"
#include "kernels/quant/convert.cuh"
#include "kernels/quant/rows.cuh"
#include "machmoe/fp8.hpp"

namespace machmoe {
using detail::check_launch;
using detail::require_arg;

void quantize_rows_fp8(const QuantizeRowsArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "quantize_rows_fp8";
  detail::check_fp8_row_source(fn, a.x, a.T, a.d, a.ld, a.gather, a.R);
  require_arg(a.R == 0 || a.q != nullptr, fn, "q", "must not be null when R > 0");
  require_arg(a.R == 0 || a.scales != nullptr, fn, "scales", "must not be null when R > 0");
  require_arg(detail::aligned16(a.q), fn, "q", "must be 16-byte aligned");
  require_arg(detail::aligned4(a.scales), fn, "scales", "must be 4-byte aligned");
  if (a.R == 0) return;

  kernels::fp8::RowsParams p;
  p.x = static_cast<const __nv_bfloat16*>(a.x);
  p.ld = a.ld, p.T = a.T, p.gather = a.gather, p.R = a.R, p.d = a.d;
  p.spans = detail::ceil_div(a.d, kernels::fp8::kSpanElems);
  p.tiles = fp8_tiles(a.d);
  p.q = a.q, p.scales = a.scales;
  const int64_t block_items = detail::ceil_div(a.R * p.spans, kernels::fp8::kRowsWarps);
  const int blocks = detail::persistent_blocks(reinterpret_cast<const void*>(kernels::fp8::fp8_quantize_rows_kernel),
                                               kernels::fp8::kRowsThreads, block_items,
                                               "quantize_rows_fp8: occupancy");
  kernels::fp8::fp8_quantize_rows_kernel<<<blocks, kernels::fp8::kRowsThreads, 0, stream>>>(p);
  check_launch("quantize_rows_fp8");
}

void convert_float_to_e4m3(const float* x, uint8_t* q, int64_t n, cudaStream_t stream) {
  constexpr const char* fn = "convert_float_to_e4m3";
  require_arg(n >= 0, fn, "n", "must be >= 0, got " + std::to_string(n));
  require_arg(n == 0 || (x != nullptr && q != nullptr), fn, "x/q", "must not be null when n > 0");
  require_arg(detail::aligned4(x), fn, "x", "must be 4-byte aligned");
  if (n == 0) return;
  const int blocks = detail::persistent_blocks(reinterpret_cast<const void*>(kernels::fp8::fp8_convert_kernel),
                                               kernels::fp8::kConvertThreads,
                                               detail::ceil_div(n, kernels::fp8::kConvertThreads),
                                               "convert_float_to_e4m3: occupancy");
  kernels::fp8::fp8_convert_kernel<<<blocks, kernels::fp8::kConvertThreads, 0, stream>>>(x, q, n);
  check_launch("convert_float_to_e4m3");
}

}  // namespace machmoe
