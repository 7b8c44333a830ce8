// The machmoe op library's device-facing ops (schemas in docs/OPS.md). Layer ops arrive with the
// GPU kernels (issues #3-#5); until then Python asks layer_kernels_available() and refuses.
#include <torch/library.h>

#include <vector>

#include "bindings/common.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

bool op_layer_kernels_available() { return layer_kernels_available(); }

// These two take no tensor, so PyTorch's CUDA state may not be up yet (asking it for its current
// stream then crashed on the GPU machine): they use the CUDA runtime directly and the legacy
// default stream. device_self_test synchronises anyway; it is a diagnostic.
void op_device_self_test() {
  translate_errors([] { device_self_test(nullptr); });
}

// [sm_count, cc_major, cc_minor, shared memory per block (opt-in), L2 bytes]. Plain integers: a
// `str` return crashed the op dispatcher on the GPU machine (torch 2.11), ints do not.
std::vector<int64_t> op_device_info() {
  return translate_errors([] {
    const DeviceInfo i = device_info();
    return std::vector<int64_t>{i.sm_count, i.cc_major, i.cc_minor, static_cast<int64_t>(i.smem_per_block_optin),
                                static_cast<int64_t>(i.l2_bytes)};
  });
}

}  // namespace

TORCH_LIBRARY(machmoe, m) {
  m.def("layer_kernels_available() -> bool", &op_layer_kernels_available);
  m.def("device_self_test() -> ()", &op_device_self_test);
  m.def("device_info() -> int[]", &op_device_info);
}

}  // namespace machmoe::bindings
