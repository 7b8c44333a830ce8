// Where each expert's rows of the late tokens begin, for a call split into early and late tokens
// (machmoe::ExpertsForwardPart / ExpertsBackwardPart): the rows of expert e are
// [expert_offsets[e], expert_offsets[e+1]) in token order (kernels/routing/routing_metadata.cuh),
// so those of the tokens [0, early_tokens) come first and the late ones follow from
// row_split[e] on. The GEMMs then run each part as its own row range per expert.
#pragma once

#include <cstdint>

namespace machmoe::kernels {

// row_split [E]: the first row of expert e whose token (row_token [R]) is >= early_tokens, by a
// binary search of the expert's rows; one thread per expert.
__global__ void expert_row_split(const int32_t* __restrict__ expert_offsets, const int32_t* __restrict__ row_token,
                                 int E, int early_tokens, int32_t* __restrict__ row_split) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int lo = expert_offsets[e], hi = expert_offsets[e + 1];
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (row_token[mid] < early_tokens) lo = mid + 1;
    else hi = mid;
  }
  row_split[e] = lo;
}

}  // namespace machmoe::kernels
