// The argument rules of machmoe::pull_rows (include/machmoe/pull_rows.hpp), checked before any GPU
// work: each broken rule throws InvalidArgument naming the argument. No GPU needed (the kernel's
// results are checked by tests/python/test_gpu_pull_rows.py).
#include <gtest/gtest.h>

#include <cstdint>

#include "machmoe/pull_rows.hpp"
#include "test_util.hpp"

namespace {

using machmoe::PullRowsArgs;

TEST(PullRowsApi, RefusesBrokenRules) {
  // Addresses are never dereferenced on the host: any aligned values pass the host's checks.
  alignas(16) static int64_t peers[2];
  alignas(16) static uint8_t out[16];
  PullRowsArgs base;
  base.peers = peers;
  base.W = 2, base.rank = 1, base.header_offset = 0, base.rows_offset = 512;
  base.src_rows = 10, base.row_bytes = 32, base.out = out, base.out_rows = 4;
  auto call = [](const PullRowsArgs& a) { machmoe::pull_rows(a, nullptr); };
  using A = PullRowsArgs;
  mtest::expect_refused(base, [](A& a) { a.W = 0; }, "W", "W = 0", call);
  mtest::expect_refused(base, [](A& a) { a.W = 65; }, "W", "W = 65", call);
  mtest::expect_refused(base, [](A& a) { a.rank = 2; }, "rank", "rank = W", call);
  mtest::expect_refused(base, [](A& a) { a.rank = -1; }, "rank", "rank < 0", call);
  mtest::expect_refused(base, [](A& a) { a.row_bytes = 24; }, "row_bytes", "row_bytes not a multiple of 16", call);
  mtest::expect_refused(base, [](A& a) { a.row_bytes = 0; }, "row_bytes", "row_bytes = 0", call);
  mtest::expect_refused(base, [](A& a) { a.header_offset = 4; }, "header_offset", "header_offset % 8", call);
  mtest::expect_refused(base, [](A& a) { a.rows_offset = 8; }, "rows_offset", "rows_offset % 16", call);
  mtest::expect_refused(base, [](A& a) { a.src_rows = -1; }, "src_rows", "src_rows < 0", call);
  mtest::expect_refused(base, [](A& a) { a.out_rows = int64_t{1} << 31; }, "out_rows", "out_rows = 2^31", call);
  mtest::expect_refused(base, [](A& a) { a.out_rows = 1 << 26, a.row_bytes = 1 << 10; }, "out",
                        "out of 2^36 bytes", call);
  mtest::expect_refused(base, [](A& a) { a.peers = nullptr; }, "peers", "peers null", call);
  mtest::expect_refused(base, [](A& a) { a.peers = reinterpret_cast<const int64_t*>(out + 4); }, "peers",
                        "peers misaligned", call);
  mtest::expect_refused(base, [](A& a) { a.out = out + 8; }, "out", "out misaligned", call);
  mtest::expect_refused(base, [](A& a) { a.out = nullptr; }, "out", "out null", call);
}

}  // namespace
