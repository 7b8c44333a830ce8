// Tests of the CPU reference's routing metadata (include/machmoe/reference.hpp, docs/LAYER.md):
// the properties of build_metadata on random general routing lists, and its refusals of bad ones.
// (Split from test_reference.cpp, which keeps the layer, routing and token-rounding tests.)
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "machmoe/reference.hpp"
#include "test_formulas.hpp"
#include "test_util.hpp"

namespace {

using namespace machmoe;
using namespace mtest;  // Rng, Vec, the formulas of test_formulas.hpp

// ================================================================ metadata
void check_metadata(const ref::RoutingList& l, int64_t T, int64_t E) {
  const auto md = ref::build_metadata(l, T, E);
  const int64_t R = l.size();
  ASSERT_EQ(md.expert_offsets.size(), size_t(E + 1));
  ASSERT_EQ(md.token_offsets.size(), size_t(T + 1));
  ASSERT_EQ(md.row_pair.size(), size_t(R));
  ASSERT_EQ(md.row_token.size(), size_t(R));
  ASSERT_EQ(md.pair_row.size(), size_t(R));
  EXPECT_EQ(md.expert_offsets[0], 0);
  for (int64_t e = 0; e < E; ++e)
    EXPECT_EQ(md.expert_offsets[e + 1] - md.expert_offsets[e],
              std::count(l.expert.begin(), l.expert.end(), int32_t(e)));
  std::vector<int> seen(R, 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = md.expert_offsets[e]; r < md.expert_offsets[e + 1]; ++r) {
      const int32_t p = md.row_pair[r];
      ASSERT_TRUE(p >= 0 && p < R);
      seen[p]++;
      EXPECT_EQ(l.expert[p], e);
      EXPECT_EQ(md.row_token[r], l.token[p]);
      EXPECT_EQ(md.pair_row[p], r);
      if (r > md.expert_offsets[e])  // by token, then by pair
        EXPECT_LT(std::make_pair(md.row_token[r - 1], md.row_pair[r - 1]),
                  std::make_pair(md.row_token[r], p));
    }
  for (int64_t p = 0; p < R; ++p) EXPECT_EQ(seen[p], 1) << "pair " << p;
  for (int64_t t = 0; t <= T; ++t)
    EXPECT_EQ(md.token_offsets[t],
              std::lower_bound(l.token.begin(), l.token.end(), int32_t(t)) - l.token.begin());
}
TEST(Metadata, Properties) {
  for (int trial = 0; trial < 30; ++trial) {
    const uint64_t seed = mtest::test_seed(trial);
    SCOPED_TRACE(mtest::seed_msg(seed));
    Rng rng(seed);
    const int64_t T = rng() % 14, E = 1 + rng() % 7;
    check_metadata(random_list(rng, T, E, trial % 2), T, E);
  }
  const auto tk = ref::topk_route(Vec{3, 1, 2, 0.5, 1, 2, -1, 0.25}.data(), 2, 4, 3,
                                  RoutingMethod::SoftmaxTopK, true, nullptr);
  check_metadata(ref::to_list(tk), 2, 4);
  ref::RoutingList empty;
  check_metadata(empty, 0, 3);  // T = 0
  check_metadata(empty, 4, 3);  // R = 0
  ref::RoutingList gaps{{0, 0, 2, 2, 3}, {4, 1, 4, 1, 1}, {0.5, 0.5, 0.5, 0.5, 0.5}};
  check_metadata(gaps, 5, 6);  // experts 0, 2, 3, 5 empty; tokens 1, 4 without pairs
  const auto md = ref::build_metadata(gaps, 5, 6);
  EXPECT_EQ(md.expert_offsets, (std::vector<int64_t>{0, 0, 3, 3, 3, 5, 5}));
  EXPECT_EQ(md.row_pair, (std::vector<int32_t>{1, 3, 4, 0, 2}));
}
TEST(Metadata, RejectsBadLists) {
  using L = ref::RoutingList;
  const auto bad = [](const L& l, int64_t T, int64_t E, const char* what) {
    mtest::expect_error(
        ErrorCode::InvalidArgument, [&] { ref::build_metadata(l, T, E); }, what);
  };
  bad(L{{0, 1}, {0, 3}, {1, 1}}, 2, 3, "expert == E");
  bad(L{{0, 1}, {-1, 0}, {1, 1}}, 2, 3, "expert < 0");
  bad(L{{0, 2}, {0, 1}, {1, 1}}, 2, 3, "token == T");
  bad(L{{-1, 0}, {0, 1}, {1, 1}}, 2, 3, "token < 0");
  bad(L{{1, 0}, {0, 1}, {1, 1}}, 2, 3, "not ordered by token");
  bad(L{{0}, {0}, {1}}, 0, 3, "token with T = 0");
}

}  // namespace
