// Launcher of the weight-gradient grouped GEMM (varlen K, kernels/sm90_grouped_wgrad.cuh).
#include "host/check.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {

void grouped_gemm_wgrad(const GroupedWgradArgs&, cudaStream_t) {
  throw Error(ErrorCode::NotBuilt, "grouped_gemm_wgrad: not built yet (issue #5)");
}

}  // namespace machmoe
