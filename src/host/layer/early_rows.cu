// The split point of each expert's rows between early and late tokens (host/layer/early_rows.hpp).
#include "host/layer/early_rows.hpp"

#include "host/common/check.hpp"
#include "kernels/layer/early_rows.cuh"

namespace machmoe::detail {

void launch_expert_row_split(const int32_t* expert_offsets, const int32_t* row_token, int64_t E,
                             int64_t early_tokens, int32_t* row_split, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const unsigned blocks = static_cast<unsigned>(ceil_div(E, int64_t{kThreads}));
  kernels::expert_row_split<<<blocks, kThreads, 0, stream>>>(expert_offsets, row_token, static_cast<int>(E),
                                                              static_cast<int>(early_tokens), row_split);
  check_launch("expert row split");
}

}  // namespace machmoe::detail
