// Launcher of the FP8 quantisation along each expert's rows (kernels/quant/columns.cuh): the chunk
// prefix (one small kernel), then the persistent quantiser; both on the caller's stream, no host
// sync. The layout and the argument rules: machmoe/fp8.hpp.
#include <algorithm>
#include <string>

#include "host/quant/quant_internal.hpp"
#include "kernels/quant/columns.cuh"
#include "machmoe/fp8.hpp"

namespace machmoe {
using detail::check_launch;
using detail::require_arg;

namespace {

void check_layout_shape(const char* fn, int64_t R, int64_t E, int64_t d) {
  require_arg(R >= 0 && R <= detail::kFp8Int32Limit, fn, "R", "must be in [0, 2^31 - 1], got " + std::to_string(R));
  require_arg(E >= 1 && E <= detail::kFp8Int32Limit - 1, fn, "E", "must be in [1, 2^31 - 2], got " + std::to_string(E));
  require_arg(d >= 16 && d % 16 == 0, fn, "d",
              "must be a positive multiple of 16 (16-byte rows of e4m3 codes), got " + std::to_string(d));
}

}  // namespace

void detail::launch_fp8_chunk_offsets(const int32_t* expert_offsets, int64_t E, int64_t R, int32_t* chunk_offsets,
                                      cudaStream_t stream) {
  namespace k = kernels::fp8;
  k::fp8_chunk_offsets_kernel<<<1, k::kScanThreads, 0, stream>>>(expert_offsets, E, R, chunk_offsets);
  check_launch("fp8 column layout: chunk offsets");
}

Fp8ColumnsLayout fp8_columns_layout(int64_t R, int64_t E, int64_t d) {
  check_layout_shape("fp8_columns_layout", R, E, d);
  // Σ_e ceil(rows(e) / 128) over the k nonempty experts is at most k + (R - k) / 128, which grows
  // with k: the bound is reached with k = min(E, R) experts, all but one of one row.
  const int64_t m = std::min(E, R);
  Fp8ColumnsLayout l;
  l.max_chunks = m + (R - m) / kFp8Tile;
  l.r_pad = kFp8Tile * l.max_chunks;
  l.qt_bytes = static_cast<size_t>(d) * static_cast<size_t>(l.r_pad);
  l.scales_bytes = sizeof(float) * static_cast<size_t>(d) * static_cast<size_t>(l.max_chunks);
  l.chunk_offsets_bytes = sizeof(int32_t) * static_cast<size_t>(E + 1);
  return l;
}

namespace {

// The rules of quantize_columns_fp8 (fp8.hpp), checked before any CUDA call; the layout's sizes.
Fp8ColumnsLayout check_columns_args(const char* fn, const QuantizeColumnsArgs& a) {
  check_layout_shape(fn, a.R, a.E, a.d);
  detail::check_fp8_row_source(fn, a.x, a.T, a.d, a.ld, a.gather, a.R);
  const Fp8ColumnsLayout layout = fp8_columns_layout(a.R, a.E, a.d);
  require_arg(a.expert_offsets != nullptr && detail::aligned4(a.expert_offsets), fn, "expert_offsets",
              "must be a 4-byte aligned device array of E+1 int32");
  require_arg(a.chunk_offsets != nullptr && detail::aligned4(a.chunk_offsets), fn, "chunk_offsets",
              "must be a 4-byte aligned device array of E+1 int32");
  require_arg(a.R == 0 || a.qt != nullptr, fn, "qt", "must not be null when R > 0");
  require_arg(a.R == 0 || a.scales != nullptr, fn, "scales", "must not be null when R > 0");
  require_arg(detail::aligned16(a.qt), fn, "qt", "must be 16-byte aligned");
  require_arg(detail::aligned4(a.scales), fn, "scales", "must be 4-byte aligned");
  // Every index of the kernels is int64; qt's byte offsets need d·r_pad to fit.
  require_arg(layout.qt_bytes / static_cast<size_t>(a.d) == static_cast<size_t>(layout.r_pad), fn, "d*r_pad",
              "overflows size_t");
  return layout;
}

// The quantiser itself, on checked arguments, reading chunk_offsets (already on the stream).
void launch_columns(const QuantizeColumnsArgs& a, const Fp8ColumnsLayout& layout, cudaStream_t stream) {
  if (layout.max_chunks == 0) return;
  namespace k = kernels::fp8;
  k::ColumnsParams p;
  p.x = static_cast<const __nv_bfloat16*>(a.x);
  p.ld = a.ld, p.T = a.T, p.gather = a.gather, p.R = a.R, p.d = a.d;
  p.offsets = a.expert_offsets, p.E = a.E, p.chunk_offsets = a.chunk_offsets;
  p.max_chunks = layout.max_chunks;
  p.qt = a.qt, p.scales = a.scales;
  const void* kernel = reinterpret_cast<const void*>(k::fp8_quantize_columns_kernel);
  constexpr size_t smem = k::kColsSmemBytes;  // > 48 KiB: needs the opt-in
  detail::allow_dynamic_smem(kernel, static_cast<int>(smem), "quantize_columns_fp8: cudaFuncSetAttribute");
  // The chunks that exist are known on the device only: size the grid for the most there can be
  // (at most the CTAs resident with this dynamic shared memory: two per SM).
  const int64_t slabs = detail::ceil_div(a.d, int64_t{k::kColsSlab});
  const int blocks = detail::persistent_blocks(kernel, k::kColsThreads, layout.max_chunks * slabs,
                                               "quantize_columns_fp8: occupancy", smem);
  k::fp8_quantize_columns_kernel<<<blocks, k::kColsThreads, smem, stream>>>(p);
  check_launch("quantize_columns_fp8");
}

}  // namespace

void quantize_columns_fp8(const QuantizeColumnsArgs& a, cudaStream_t stream) {
  const Fp8ColumnsLayout layout = check_columns_args("quantize_columns_fp8", a);
  detail::launch_fp8_chunk_offsets(a.expert_offsets, a.E, a.R, a.chunk_offsets, stream);
  launch_columns(a, layout, stream);
}

void detail::quantize_columns_fp8_given_offsets(const QuantizeColumnsArgs& a, cudaStream_t stream) {
  launch_columns(a, check_columns_args("quantize_columns_fp8", a), stream);
}

}  // namespace machmoe
