// The receive side of expert parallelism's device-counted all-to-all (the launcher is
// src/host/exchange/pull_rows.cu; python/machmoe/device_count_transport.py stages the rows): every
// rank has put, in a staging buffer that every GPU of the group can address,
//   at base + header_offset: its send counts [W] int64 (count[q] rows for rank q), and
//   at base + rows_offset:   its send rows [src_rows, B] bytes, rank-major (rank 0's chunk first),
// and this kernel, on rank `rank`, copies the rows every peer q sends here into
//   out [out_rows, B]: peer 0's rows first, then peer 1's, ... (sender order).
// Peer q's rows for this rank start at row Σ_{j < rank} count_q[j] of its staging rows, and land
// here at Σ_{q' < q} count_{q'}[rank]. Every count is read on the device, over NVLink from the
// peers' headers: the host knows none of them, so the launch needs no synchronisation and can be
// captured in a CUDA graph.
//
// Work split: the received rows, seen as one run of 16-byte vectors [total · B/16], are shared by
// a persistent grid (sized from the SM count) in grid strides, kPullUnroll loads in flight per
// thread before their stores (NVLink reads have microseconds of latency: bandwidth needs many
// loads outstanding). A thread walks its vectors in increasing rows, so it finds each one's peer
// by moving forward over the landing offsets in shared memory: a peer sending nothing or
// everything costs nothing special.
//
// Bounds: a count is clamped to [0, src_rows]; a row landing at or past out_rows is not written,
// and a row past the peer's src_rows is not read (its place here is left as it was). Rows of out
// past those that arrived are left unwritten: the caller masks them.
#pragma once

#include <cstdint>

namespace machmoe::kernels {

constexpr int kPullThreads = 512;
constexpr int kPullMaxPeers = 64;  // the peers' bookkeeping lives in shared memory
constexpr int kPullUnroll = 4;     // 16-byte loads in flight per thread

struct PullRowsParams {
  const int64_t* peers;   // [W] each peer's staging base address (device-addressable here)
  int64_t header_offset;  // bytes from a base to that peer's counts [W] int64
  int64_t rows_offset;    // bytes from a base to that peer's rows [src_rows, B] (16-byte aligned)
  int32_t src_rows;       // rows of every peer's staging area
  int32_t out_rows;       // rows of out
  int32_t vecs_per_row;   // B / 16
  int32_t W, rank;
  int4* out;              // [out_rows, B]
};

__global__ void __launch_bounds__(kPullThreads) pull_rows_kernel(PullRowsParams p) {
  __shared__ const int4* src[kPullMaxPeers];               // peer q's first row for this rank
  __shared__ int32_t start[kPullMaxPeers + 1];              // where peer q's rows land; [W]: total
  __shared__ int32_t readable[kPullMaxPeers];               // of those, rows inside q's src_rows
  __shared__ int64_t count[kPullMaxPeers];                  // count_q[rank]
  __shared__ unsigned long long before[kPullMaxPeers];      // Σ_{j < rank} count_q[j]
  const int W = p.W, span = p.rank + 1;
  for (int q = threadIdx.x; q < W; q += blockDim.x) before[q] = 0;
  __syncthreads();
  // The W · (rank + 1) header entries this rank needs, one remote 8-byte load each, in parallel.
  for (int i = threadIdx.x; i < W * span; i += blockDim.x) {
    const int q = i / span, j = i - q * span;
    const auto* counts = reinterpret_cast<const int64_t*>(p.peers[q] + p.header_offset);
    int64_t v = __ldcg(counts + j);
    v = v < 0 ? 0 : (v > p.src_rows ? p.src_rows : v);
    if (j == p.rank) count[q] = v;
    else atomicAdd(&before[q], static_cast<unsigned long long>(v));
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // W is small: a serial prefix
    int64_t at = 0;
    for (int q = 0; q < W; ++q) {
      const int64_t first = static_cast<int64_t>(before[q]);
      start[q] = static_cast<int32_t>(at < p.out_rows ? at : p.out_rows);
      const int64_t room = p.src_rows - first;
      readable[q] = static_cast<int32_t>(room < 0 ? 0 : (room < count[q] ? room : count[q]));
      src[q] = reinterpret_cast<const int4*>(p.peers[q] + p.rows_offset) + first * p.vecs_per_row;
      at += count[q];
    }
    start[W] = static_cast<int32_t>(at < p.out_rows ? at : p.out_rows);
  }
  __syncthreads();
  // out_rows · B/16 < 2^30 (the launcher checks): 32-bit indices cannot wrap below. A thread's
  // vectors are idx, idx + stride, ...: its (row, col) advance by (stride / vpr, stride % vpr)
  // with a carry, and its peer only ever moves forward (rows only grow), so the loop needs no
  // division and no search.
  const uint32_t vpr = static_cast<uint32_t>(p.vecs_per_row);
  const uint32_t total = static_cast<uint32_t>(start[W]) * vpr;
  const uint32_t stride = gridDim.x * blockDim.x;
  const uint32_t step_rows = stride / vpr, step_cols = stride - step_rows * vpr;
  uint32_t idx = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t row = idx / vpr, col = idx - row * vpr;
  int q = 0;  // the peer whose rows hold `row`: start[q] <= row < start[q + 1]
  while (idx < total) {
    int4 v[kPullUnroll];
    uint32_t at[kPullUnroll];
    bool ok[kPullUnroll];
#pragma unroll
    for (int u = 0; u < kPullUnroll; ++u) {
      at[u] = idx;
      ok[u] = idx < total;
      if (ok[u]) {
        while (row >= static_cast<uint32_t>(start[q + 1])) ++q;  // ends below W: row < start[W]
        const uint32_t r = row - static_cast<uint32_t>(start[q]);
        ok[u] = r < static_cast<uint32_t>(readable[q]);
        if (ok[u]) v[u] = __ldcg(src[q] + static_cast<size_t>(r) * vpr + col);
      }
      idx += stride;
      row += step_rows;
      col += step_cols;
      if (col >= vpr) col -= vpr, ++row;
    }
#pragma unroll
    for (int u = 0; u < kPullUnroll; ++u)
      if (ok[u]) p.out[at[u]] = v[u];
  }
}

}  // namespace machmoe::kernels
