// The argument rules of machmoe::sum_blocks (include/machmoe/sum_blocks.hpp), checked before any GPU
// work: each broken rule throws InvalidArgument naming the argument. No GPU needed (the kernel's
// results are checked bitwise against PyTorch's sum by tests/python/test_gpu_sum_blocks.py).
#include <gtest/gtest.h>

#include <cstdint>

#include "machmoe/sum_blocks.hpp"
#include "test_util.hpp"

namespace {

using machmoe::SumBlocksArgs;

TEST(SumBlocksApi, RefusesBrokenRules) {
  // Addresses are never dereferenced on the host.
  alignas(16) static uint8_t block[64];
  static const void* parts[65] = {};
  for (const void*& p : parts) p = block;
  SumBlocksArgs base;
  base.parts = parts;
  base.count = 3, base.elems = 16, base.dtype = machmoe::DType::BF16, base.out = block;
  auto call = [](const SumBlocksArgs& a) { machmoe::sum_blocks(a, nullptr); };
  using A = SumBlocksArgs;
  mtest::expect_refused(base, [](A& a) { a.count = 0; }, "count", "count = 0", call);
  mtest::expect_refused(base, [](A& a) { a.count = 65; }, "count", "count = 65", call);
  mtest::expect_refused(base, [](A& a) { a.elems = -1; }, "elems", "elems < 0", call);
  mtest::expect_refused(base, [](A& a) { a.dtype = machmoe::DType::FP16; }, "dtype", "fp16", call);
  mtest::expect_refused(base, [](A& a) { a.parts = nullptr; }, "parts", "parts null", call);
  static const void* with_null[3] = {block, nullptr, block};
  mtest::expect_refused(base, [](A& a) { a.parts = with_null; }, "parts", "a null part", call);
  mtest::expect_refused(base, [](A& a) { a.out = nullptr; }, "out", "out null", call);
}

}  // namespace
