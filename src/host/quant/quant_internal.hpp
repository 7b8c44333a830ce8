// Host helpers shared by the FP8 quantisation launchers (quantize_rows.cu, quantize_columns.cu,
// quantize_weights.cu): the argument rules of a bf16 row source and the persistent grid size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "host/common/check.hpp"
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

}  // namespace machmoe::detail
