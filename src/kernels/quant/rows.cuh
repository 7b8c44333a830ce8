// FP8 quantisation along rows (1x128 tiles): the operand of a GEMM whose reduction dimension is
// the row, d (the forward up-projection X·W1ᵀ, the dH kernel's dout·W2).
//   x bf16 [T, d] (rows ld elements apart), gather [R] int32 or null (row r = x[gather[r]], else x[r])
//   -> q e4m3 [R, d] (rows d bytes apart), scales fp32 [R, tiles], tiles = ceil(d / 128).
// Tile j of row r covers columns [128j, min(128j + 128, d)). A row whose gather index is outside
// [0, T) is quantised as all NaN (NaN scales, 0x7f codes): a bad index shows rather than reading
// out of bounds. Included by host/quant/quantize_rows.cu only.
//
// Work split: one warp per (row, 512-column span): 64 chunks of 8 bf16 (16 bytes). Lane i loads
// chunks i and 32 + i (each load instruction reads 512 contiguous bytes: whole sectors), so the
// half-warp of lanes 0-15 holds tile 0 of the span in its first load and tile 2 in its second,
// lanes 16-31 tiles 1 and 3; the amax is a 16-lane shuffle reduction. After quantising, one lane
// pair exchange (fp8_common.cuh) gives each lane 16 contiguous output bytes: the store instruction
// writes the span's 512 bytes, 16 per lane.
#pragma once

#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels::fp8 {

constexpr int kRowsThreads = 256;
constexpr int kRowsWarps = kRowsThreads / kWarpSize;
constexpr int kSpanChunks = 64;             // 16-byte chunks (8 bf16) per warp item
constexpr int kSpanElems = kSpanChunks * 8;  // 512 columns, 4 tiles

struct RowsParams {
  const __nv_bfloat16* x;  // [T, d], ld
  int64_t ld, T;
  const int32_t* gather;   // [R] or null
  int64_t R, d;            // d % 16 == 0
  int64_t spans;           // ceil(d / 512)
  int64_t tiles;           // ceil(d / 128): the scales' row stride
  uint8_t* q;              // [R, d]
  float* scales;           // [R, tiles]
};

// Persistent: the grid's warps stride over the R * spans items.
__global__ void __launch_bounds__(kRowsThreads) fp8_quantize_rows_kernel(const RowsParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t items = p.R * p.spans;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsWarps;
  const int64_t row_chunks = p.d / 8;
  for (int64_t item = global_warp_index(); item < items; item += stride) {
    const int64_t r = item / p.spans;
    const int64_t span = item - r * p.spans;
    const int64_t src = p.gather ? static_cast<int64_t>(p.gather[r]) : r;
    const bool bad_row = src < 0 || src >= p.T;
    const int64_t c0 = span * kSpanChunks;                                   // first chunk of the span
    const int valid = static_cast<int>(min64(kSpanChunks, row_chunks - c0));  // even (d % 16 == 0)
    // base + (ok ? off : 0): a bad row reads nothing, and the address stays in the tensor.
    const __nv_bfloat16* row = p.x + (bad_row ? 0 : src * p.ld + c0 * 8);
    uint4 a = make_uint4(0, 0, 0, 0), b = a;
    if (!bad_row && lane < valid) a = load16(row + lane * 8);
    if (!bad_row && lane + 32 < valid) b = load16(row + (lane + 32) * 8);
    // a: tile (lane / 16) of the span, b: tile 2 + lane / 16. Missing chunks are zeros (no effect
    // on the amax); a bad row is NaN everywhere.
    uint32_t amax_a = group_max_bits<16>(abs_max_bits8(a));
    uint32_t amax_b = group_max_bits<16>(abs_max_bits8(b));
    if (bad_row) amax_a = amax_b = kBf16NanBits;
    const TileScale sa = tile_scale(amax_a), sb = tile_scale(amax_b);
    const uint4 out = pair_exchange(quantize8(a, sa), quantize8(b, sb), lane);
    // Lane 2k writes chunks 2k, 2k+1 (from a); lane 2k+1 chunks 32+2k, 33+2k (from b).
    const int pair = (lane & 1) ? 16 + lane / 2 : lane / 2;
    if (2 * pair < valid) store16(p.q + r * p.d + (c0 + 2 * pair) * 8, out);
    if ((lane & 15) == 0) {
      const int half = lane / 16;
      float* srow = p.scales + r * p.tiles + span * 4;
      if (16 * half < valid) srow[half] = sa.s;
      if (32 + 16 * half < valid) srow[2 + half] = sb.s;
    }
  }
}

}  // namespace machmoe::kernels::fp8
