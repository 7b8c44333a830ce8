// Launcher of pull_rows (kernels/exchange/pull_rows.cuh): checks the arguments and sizes the grid
// from the SM count (every block reads the peers' headers once, then strides over the rows), on
// the caller's stream.
#include <algorithm>
#include <string>

#include "host/common/check.hpp"
#include "kernels/exchange/pull_rows.cuh"
#include "machmoe/machmoe.hpp"
#include "machmoe/pull_rows.hpp"

namespace machmoe {
using detail::ceil_div;
using detail::require_arg;

void pull_rows(const PullRowsArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "pull_rows";
  const std::string W = std::to_string(a.W);
  require_arg(a.W >= 1 && a.W <= kernels::kPullMaxPeers, fn, "W",
              "must be in [1, " + std::to_string(kernels::kPullMaxPeers) + "], got " + W);
  require_arg(a.rank >= 0 && a.rank < a.W, fn, "rank", "must be in [0, W=" + W + "), got " + std::to_string(a.rank));
  require_arg(a.row_bytes > 0 && a.row_bytes % 16 == 0, fn, "row_bytes",
              "must be a positive multiple of 16 (pad the rows), got " + std::to_string(a.row_bytes));
  require_arg(a.header_offset >= 0 && a.header_offset % 8 == 0, fn, "header_offset",
              "must be a non-negative multiple of 8, got " + std::to_string(a.header_offset));
  require_arg(a.rows_offset >= 0 && a.rows_offset % 16 == 0, fn, "rows_offset",
              "must be a non-negative multiple of 16, got " + std::to_string(a.rows_offset));
  constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;
  require_arg(a.src_rows >= 0 && a.src_rows <= kMaxRows, fn, "src_rows",
              "must be in [0, 2^31), got " + std::to_string(a.src_rows));
  require_arg(a.out_rows >= 0 && a.out_rows <= kMaxRows, fn, "out_rows",
              "must be in [0, 2^31), got " + std::to_string(a.out_rows));
  require_arg(a.row_bytes < (int64_t{1} << 34), fn, "row_bytes", "must be below 2^34, got " + std::to_string(a.row_bytes));
  const int64_t vecs = a.out_rows * (a.row_bytes / 16);  // < 2^31 · 2^30: no overflow
  require_arg(vecs < (int64_t{1} << 30), fn, "out",
              "must have out_rows · row_bytes < 2^34 bytes, got " + std::to_string(a.out_rows) + " rows of " +
                  std::to_string(a.row_bytes));
  require_arg(a.peers != nullptr && (reinterpret_cast<uintptr_t>(a.peers) & 7u) == 0,
              fn, "peers", "must be a non-null, 8-byte aligned device array of W addresses");
  require_arg(a.out_rows == 0 || (a.out != nullptr && detail::aligned16(a.out)), fn, "out",
              "must be non-null and 16-byte aligned");
  if (vecs == 0) return;

  kernels::PullRowsParams p{};
  p.peers = a.peers;
  p.header_offset = a.header_offset;
  p.rows_offset = a.rows_offset;
  p.src_rows = static_cast<int32_t>(a.src_rows);
  p.out_rows = static_cast<int32_t>(a.out_rows);
  p.vecs_per_row = static_cast<int32_t>(a.row_bytes / 16);
  p.W = static_cast<int32_t>(a.W);
  p.rank = static_cast<int32_t>(a.rank);
  p.out = static_cast<int4*>(a.out);
  // As many blocks as fit at once (the loop is persistent), but no more than the most vectors that
  // can arrive need: a small exchange does not pay every block's header reads.
  const int per_sm = std::max(1, detail::blocks_per_sm(reinterpret_cast<const void*>(kernels::pull_rows_kernel),
                                                       kernels::kPullThreads, 0, "pull_rows: occupancy"));
  const int64_t resident = static_cast<int64_t>(device_info().sm_count) * per_sm;
  const int64_t needed = ceil_div(vecs, static_cast<int64_t>(kernels::kPullThreads) * kernels::kPullUnroll);
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(resident, needed)));
  kernels::pull_rows_kernel<<<blocks, kernels::kPullThreads, 0, stream>>>(p);
  detail::check_launch("pull_rows");
}

}  // namespace machmoe
