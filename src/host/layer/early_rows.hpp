// A layer call split into the rows of its early tokens and those of its late ones (expert
// parallelism: a GPU's own tokens are at hand while the other GPUs' still travel): the split point
// of each expert's rows, and the row ranges a GEMM of one part runs over.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace machmoe::detail {

// row_split [E] (device): the first row of expert e whose token is >= early_tokens (rows of an
// expert are in token order), from expert_offsets [E+1] and row_token [R]; on `stream`.
void launch_expert_row_split(const int32_t* expert_offsets, const int32_t* row_token, int64_t E,
                             int64_t early_tokens, int32_t* row_split, cudaStream_t stream);

// The rows of each expert one part of a split call covers: [begins[e], ends[e]).
struct ExpertRowRange {
  const int32_t* begins;  // [E]
  const int32_t* ends;    // [E], or null: begins + 1 (whole experts, begins = expert_offsets [E+1])
};
// The early tokens' rows [off[e], split[e]), the late ones' [split[e], off[e+1]), or all of them.
enum class RowPart { All, Early, Late };
inline ExpertRowRange expert_rows(RowPart part, const int32_t* expert_offsets, const int32_t* row_split) {
  switch (part) {
    case RowPart::Early: return {expert_offsets, row_split};
    case RowPart::Late: return {row_split, expert_offsets + 1};
    default: return {expert_offsets, nullptr};
  }
}

}  // namespace machmoe::detail
