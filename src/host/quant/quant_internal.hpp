// Host helpers shared by the FP8 quantisation launchers (quantize_rows.cu, quantize_columns.cu,
// quantize_weights.cu, fp8_swiglu_columns.cu): the argument rules of a bf16 row source and the
// persistent grid size; the column layout's chunk offsets; and the library-internal fused SwiGLU
// backward with the column operands (the FP8 experts' backward calls it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

inline constexpr int64_t kFp8Int32Limit = std::numeric_limits<int32_t>::max();  // 2^31 - 1

// x bf16 [T, d] (ld) read through a gather [R] (or the identity with R = T), quantised in tiles
// along d with 16-byte rows of codes.
inline void check_fp8_row_source(const char* fn, const void* x, int64_t T, int64_t d, int64_t ld,
                                 const int32_t* gather, int64_t R) {
  require_arg(T >= 0 && T <= kFp8Int32Limit, fn, "T", "must be in [0, 2^31 - 1], got " + std::to_string(T));
  require_arg(R >= 0 && R <= kFp8Int32Limit, fn, "R", "must be in [0, 2^31 - 1], got " + std::to_string(R));
  require_arg(d >= 16 && d % 16 == 0, fn, "d",
              "must be a positive multiple of 16 (16-byte rows of e4m3 codes), got " + std::to_string(d));
  require_arg(ld >= d && ld % 8 == 0, fn, "ld",
              "must be >= d and a multiple of 8 (16-byte aligned bf16 rows), got ld=" + std::to_string(ld) +
                  ", d=" + std::to_string(d));
  require_arg(gather != nullptr || R == T || R == 0, fn, "R",
              "must equal T (or be 0) without a gather index, got R=" + std::to_string(R) + ", T=" + std::to_string(T));
  require_arg(T == 0 || x != nullptr, fn, "x", "must not be null when T > 0");
  require_arg(aligned16(x), fn, "x", "must be 16-byte aligned");
  require_arg(R == 0 || gather == nullptr || aligned4(gather), fn, "gather", "must be 4-byte aligned");
  require_arg(T == 0 || (T - 1) <= std::numeric_limits<int64_t>::max() / ld, fn, "T*ld", "overflows int64");
}

// Blocks of a persistent grid-stride kernel: enough for `items` blocks' worth of work, at most
// what the device keeps resident (device_info's SM count times the occupancy at `smem` bytes of
// dynamic shared memory).
inline int persistent_blocks(const void* kernel, int threads, int64_t block_items, const char* what,
                             size_t smem = 0) {
  const int per_sm = std::max(1, blocks_per_sm(kernel, threads, smem, what));
  const int64_t resident = int64_t{per_sm} * device_info().sm_count;
  return static_cast<int>(std::max<int64_t>(1, std::min(block_items, resident)));
}

// chunk_offsets [E+1] of the column layout (machmoe/fp8.hpp) from expert_offsets [E+1], on the
// device (one small kernel on `stream`, no host sync): what quantize_columns_fp8 writes first.
// Takes checked arguments (quantize_columns.cu).
void launch_fp8_chunk_offsets(const int32_t* expert_offsets, int64_t E, int64_t R, int32_t* chunk_offsets,
                              cudaStream_t stream);

// quantize_columns_fp8 with args.chunk_offsets read, not written: the chunk offsets of these
// expert_offsets, already written on `stream` (by launch_fp8_chunk_offsets, quantize_columns_fp8
// or swiglu_backward_columns_fp8). The FP8 experts' backward quantises three operands on the same
// rows and so scans the offsets once. Same rules as quantize_columns_fp8.
void quantize_columns_fp8_given_offsets(const QuantizeColumnsArgs& args, cudaStream_t stream);

// The FP8 experts' SwiGLU backward (machmoe/fp8_swiglu.hpp states the math) fused with the column
// quantisation of its dH and A' (kernels/layer/fp8_swiglu_columns.cuh), for rows grouped by
// expert (expert_offsets [E+1], device). Writes bitwise what these write, without dH or A' in
// memory:
//   swiglu_backward_fp8 (with dh_q):   d_scores, dh_q / dh_scales  (for the experts' rows)
//   quantize_columns_fp8 of dH:        chunk_offsets, dh_qt [max_chunks, 2n, 128], dh_col_scales [max_chunks, 2n]
//   quantize_columns_fp8 of A':        ap_qt [max_chunks, n, 128], ap_col_scales [max_chunks, n]
// and, when dh_col_sums is given (expert biases), each chunk's column sums of the bf16 dH.
// (max_chunks: fp8_columns_layout(R, E, ·)). Rows outside [off[0], off[E]) are not
// computed (their d score and dH rows are not written). Rules (Error InvalidArgument naming the
// argument): n >= 16 and a multiple of 16; 0 <= R < 2^31; 1 <= E < 2^31 - 1; da, dh_qt, ap_qt
// 16-byte aligned; hq, dh_q 8-byte aligned; the rest 4-byte aligned; no pointer null when R > 0
// but dh_col_sums (expert_offsets and chunk_offsets never).
struct SwigluBackwardColumnsFp8Args {
  const void* da = nullptr;                 // [R, n] bf16 dA'
  const uint8_t* hq = nullptr;              // [R, 2n] E4M3 codes of H
  const float* h_scales = nullptr;          // [R, fp8_tiles(2n)]
  const float* scores = nullptr;            // [pairs] fp32
  const int32_t* row_pair = nullptr;        // [R]
  int64_t R = 0, n = 0;
  const int32_t* expert_offsets = nullptr;  // [E+1] device
  int64_t E = 0;
  int32_t* chunk_offsets = nullptr;         // [E+1] out
  float* d_scores = nullptr;                // [pairs]: written at row_pair[r]
  uint8_t* dh_q = nullptr;                  // [R, 2n] E4M3
  float* dh_scales = nullptr;               // [R, fp8_tiles(2n)]
  uint8_t* dh_qt = nullptr;                 // [max_chunks, 2n, 128] E4M3
  float* dh_col_scales = nullptr;           // [max_chunks, 2n]
  uint8_t* ap_qt = nullptr;                 // [max_chunks, n, 128] E4M3
  float* ap_col_scales = nullptr;           // [max_chunks, n]
  float* dh_col_sums = nullptr;             // [max_chunks, 2n] fp32 out (expert biases: db1's partials), or null
  const GluClamp* clamp = nullptr;          // the clamped SwiGLU's parameters, or null: SwiGLU
};
void swiglu_backward_columns_fp8(const SwigluBackwardColumnsFp8Args& args, cudaStream_t stream);

}  // namespace machmoe::detail
