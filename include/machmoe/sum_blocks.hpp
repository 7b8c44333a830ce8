// The sum at the end of expert parallelism's reduce-scatter: each rank receives W blocks of the
// same shape (its own and one from every peer) and adds them,
//   out[i] = round(Σ_{q = 0 .. count-1} parts[q][i]),
// accumulated in float32 in list order and rounded once to the dtype (bf16: to nearest even;
// float32: no rounding), in one pass that reads each block once and writes out once.
// Rules: 1 <= count <= 64; elems >= 0; dtype BF16 or FP32 (the parts and out all of it);
// every part and out non-null when elems > 0 (each a device array of `elems` elements, any
// alignment: 16-byte aligned ones take the vectorised path). out may be one of the parts.
// Asynchronous on `stream`; throws machmoe::Error(InvalidArgument) naming the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "machmoe/types.hpp"

namespace machmoe {

struct SumBlocksArgs {
  const void* const* parts = nullptr;  // [count] device addresses, a host array
  int64_t count = 0;
  int64_t elems = 0;                   // elements of each part and of out
  DType dtype = DType::BF16;
  void* out = nullptr;
};
void sum_blocks(const SumBlocksArgs& args, cudaStream_t stream);

}  // namespace machmoe
