// The machmoe op library's device-facing ops (schemas in docs/OPS.md). Layer ops arrive with the
// GPU kernels (issues #3-#5); until then Python asks layer_kernels_available() and refuses.
#include <torch/library.h>

#include <sstream>
#include <string>

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

std::string op_device_info() {
  return translate_errors([] {
    const DeviceInfo i = device_info();
    std::ostringstream s;
    s << "name=" << i.name << ", sm_count=" << i.sm_count << ", cc=" << i.cc_major << "." << i.cc_minor
      << ", smem_optin=" << i.smem_per_block_optin << ", l2=" << i.l2_bytes;
    return s.str();
  });
}

}  // namespace

TORCH_LIBRARY(machmoe, m) {
  m.def("layer_kernels_available() -> bool", &op_layer_kernels_available);
  m.def("device_self_test() -> ()", &op_device_self_test);
  m.def("device_info() -> str", &op_device_info);
}

}  // namespace machmoe::bindings
