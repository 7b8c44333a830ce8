// The machmoe op library's tensor-free ops (schemas in docs/OPS.md): what the library can run on
// this machine, the device's facts, and the layer's workspace plan and saved-block layout, which
// need no GPU. The tensor ops are in layer_ops.cpp, experts_ops.cpp, routing_ops.cpp, gemm_ops.cpp
// and reference_ops.cpp.
#include <torch/library.h>

#include <vector>

#include "bindings/common.hpp"
#include "host/layer/saved_layout.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

bool op_layer_kernels_available() { return layer_kernels_available(); }

// These two take no tensor, so PyTorch's CUDA state may not be up yet (asking it for its current
// stream then crashed the process): they use the CUDA runtime directly and the legacy
// default stream. device_self_test synchronises anyway; it is a diagnostic.
void op_device_self_test() {
  translate_errors([] { device_self_test(nullptr); });
}

// [sm_count, cc_major, cc_minor, shared memory per block (opt-in), L2 bytes]. Plain integers: a
// `str` return crashed the op dispatcher with torch 2.11 on a GPU machine, ints do not.
std::vector<int64_t> op_device_info() {
  return translate_errors([] {
    const DeviceInfo i = device_info();
    return std::vector<int64_t>{i.sm_count, i.cc_major, i.cc_minor, static_cast<int64_t>(i.smem_per_block_optin),
                                static_cast<int64_t>(i.l2_bytes)};
  });
}

// [saved, forward workspace, backward workspace, saved without H] bytes of one layer call
// (machmoe::plan_workspace): what the forward keeps for the backward, the scratch of each
// direction, and the block an inference forward (write_h = false) returns; fp8: precision FP8.
// No GPU needed.
std::vector<int64_t> op_layer_workspace_bytes(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K,
                                              const std::string& activation, const std::string& rounding,
                                              int64_t tile_m, int64_t num_shared, bool fp8) {
  return translate_errors([&] {
    LayerProblem p;
    p.T = T, p.d = d, p.n = n, p.E = E, p.K = K, p.num_shared = num_shared;
    if (fp8) p.precision = Precision::FP8;
    p.activation = parse_activation(activation);
    p.rounding = parse_token_rounding(rounding);
    p.rounding_tile_m = tile_m;
    const WorkspacePlan w = plan_workspace(p);
    return std::vector<int64_t>{static_cast<int64_t>(w.saved_bytes), static_cast<int64_t>(w.forward_workspace_bytes),
                                static_cast<int64_t>(w.backward_workspace_bytes),
                                static_cast<int64_t>(w.inference_saved_bytes)};
  });
}

// The saved block of a layer call as host/layer/saved_layout.hpp describes it, for every T (and
// d: no part has a size in d), in saved_layout_ints' encoding: the part sizes as functions of the
// rows R and the tokens T, and R as a function of T. The fake kernels (python/machmoe/_fake.py)
// size the block from it on symbolic T, so the fake and the C++ planner share one definition.
// Without write_h the list stops before H (inference); fp8: precision FP8 (H in E4M3 with its
// scales). No GPU needed.
std::vector<int64_t> op_layer_saved_layout(int64_t n, int64_t E, int64_t K, const std::string& activation,
                                           const std::string& rounding, int64_t tile_m, bool write_h,
                                           int64_t num_shared, bool fp8) {
  return translate_errors([&] {
    LayerProblem p;  // T = 0 and d = 16 (FP8's smallest) stand for every T and d
    p.d = 16, p.n = n, p.E = E, p.K = K, p.num_shared = num_shared;
    if (fp8) p.precision = Precision::FP8;
    p.activation = parse_activation(activation);
    p.rounding = parse_token_rounding(rounding);
    p.rounding_tile_m = tile_m;
    return detail::layer_saved_layout_ints(validate(p), write_h);
  });
}

}  // namespace

TORCH_LIBRARY(machmoe, m) {
  m.def("layer_kernels_available() -> bool", &op_layer_kernels_available);
  m.def("device_self_test() -> ()", &op_device_self_test);
  m.def("device_info() -> int[]", &op_device_info);
  m.def("layer_workspace_bytes(int T, int d, int n, int E, int K, str activation, str rounding, int tile_m,"
        " int num_shared=0, bool fp8=False) -> int[]", &op_layer_workspace_bytes);
  m.def("layer_saved_layout(int n, int E, int K, str activation, str rounding, int tile_m, bool write_h=True,"
        " int num_shared=0, bool fp8=False) -> int[]", &op_layer_saved_layout);
}

}  // namespace machmoe::bindings
