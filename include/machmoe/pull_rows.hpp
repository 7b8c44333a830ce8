// The receive side of expert parallelism's device-counted all-to-all (src/kernels/exchange/
// pull_rows.cuh): rank `rank` of W copies, from every peer's staging buffer, the rows that peer
// sends it, with every count read on the device. Each peer q's staging buffer (its base address
// peers[q], device-addressable from this GPU: symmetric memory, or on one GPU plain buffers) holds
//   at base + header_offset: count_q [W] int64, the rows q sends to each rank, and
//   at base + rows_offset:   rows [src_rows, row_bytes], rank-major (rank 0's chunk first).
// out [out_rows, row_bytes] receives peer 0's rows for `rank`, then peer 1's, ... (sender order);
// rows past those that arrived are not written. A count is clamped to [0, src_rows]; rows landing
// at or past out_rows, or lying past a peer's src_rows, are skipped.
// Rules: 1 <= W <= 64; 0 <= rank < W; row_bytes > 0 and a multiple of 16; header_offset a
// multiple of 8 and rows_offset of 16 (every base 16-byte aligned: not checkable on the host);
// 0 <= src_rows, out_rows < 2^31 and out_rows · row_bytes < 2^34; peers 8- and out 16-byte
// aligned. Asynchronous on `stream`; throws machmoe::Error(InvalidArgument) naming the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace machmoe {

struct PullRowsArgs {
  const int64_t* peers = nullptr;  // [W] on the device
  int64_t W = 0, rank = 0;
  int64_t header_offset = 0, rows_offset = 0;  // bytes
  int64_t src_rows = 0, row_bytes = 0;
  void* out = nullptr;             // [out_rows, row_bytes]
  int64_t out_rows = 0;
};
void pull_rows(const PullRowsArgs& args, cudaStream_t stream);

}  // namespace machmoe
