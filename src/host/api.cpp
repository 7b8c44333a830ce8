// The public C++ API's host side: problem validation, the workspace plan, and the layer and
// kernel-family entry points. The GPU kernels of the layer land with issues #3-#5; until then every
// entry point that would run one refuses with ErrorCode::NotBuilt instead of pretending.
#include <cstdint>
#include <limits>
#include <string>

#include "machmoe/machmoe.hpp"

namespace machmoe {
namespace {

void require(bool ok, const char* field, const std::string& rule) {
  if (!ok)
    throw Error(ErrorCode::InvalidArgument, std::string("LayerProblem.") + field + ": " + rule);
}

[[noreturn]] void not_built(const char* what) {
  throw Error(ErrorCode::NotBuilt,
              std::string("machmoe::") + what +
                  ": the GPU kernels for this are not built yet in this version of machmoe "
                  "(issues #4 and #5); use the CPU reference (machmoe/reference.hpp) or the "
                  "PyTorch 'torch' backend meanwhile");
}

constexpr size_t kAlign = 256;  // every sub-buffer starts 256-byte aligned (TMA needs 128)
size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Rows the experts may run on: T·K for top-K; token rounding moves each expert by less than one
// tile, so at most T·K + E·(M-1) rows, and never more than T·E.
int64_t max_rows(const LayerProblem& p) {
  int64_t r = p.T * p.K;
  if (p.rounding != TokenRounding::None) r = std::min(r + p.E * (p.rounding_tile_m - 1), p.T * p.E);
  return r;
}

}  // namespace

void validate(const LayerProblem& p) {
  require(p.T >= 0, "T", "must be >= 0, got " + std::to_string(p.T));
  require(p.d >= 1, "d", "must be >= 1, got " + std::to_string(p.d));
  require(p.n >= 1, "n", "must be >= 1, got " + std::to_string(p.n));
  require(p.E >= 1, "E", "must be >= 1, got " + std::to_string(p.E));
  require(p.K >= 1 && p.K <= p.E, "K",
          "must be in [1, E=" + std::to_string(p.E) + "], got " + std::to_string(p.K));
  require(p.rounding_tile_m >= 1, "rounding_tile_m", "must be >= 1, got " + std::to_string(p.rounding_tile_m));
  require(p.rounding == TokenRounding::None || p.routing == RoutingMethod::SoftmaxTopK, "rounding",
          std::string("token rounding is defined for routing=softmax_topk only, got routing=") +
              to_string(p.routing));
  require(p.dtype == DType::BF16 || p.dtype == DType::FP16 || p.dtype == DType::FP32, "dtype",
          "must be bfloat16, float16 or float32");
  // Row indices are int32 on the device; element offsets are 64-bit.
  require(p.T <= std::numeric_limits<int32_t>::max() / p.K, "T",
          "T*K must fit in int32 (rows are indexed by int32), got T=" + std::to_string(p.T) +
              ", K=" + std::to_string(p.K));
}

WorkspacePlan plan_workspace(const LayerProblem& p) {
  validate(p);
  const size_t R = static_cast<size_t>(max_rows(p));
  const size_t T = static_cast<size_t>(p.T), E = static_cast<size_t>(p.E);
  const size_t n1 = static_cast<size_t>(is_glu(p.activation) ? 2 * p.n : p.n);
  const size_t es = static_cast<size_t>(dtype_size(p.dtype));
  WorkspacePlan w;
  // Saved between forward and backward (SPEC §1): H [R, n1], fp32 scores [R], int32 metadata
  // (expert offsets [E+1], row->token [R], pair->row [R], token offsets [T+1]) and fp32 logits
  // [T, E] (the aux loss and top-K-over-softmax backward need the full softmax).
  w.saved_bytes = align_up(R * n1 * es) + align_up(R * 4) + align_up((E + 1) * 4) +
                  align_up(R * 4) * 2 + align_up((T + 1) * 4) + align_up(T * E * 4);
  // Forward scratch: Y [R, d] and A [R, n] (transient), routing scratch [R] x 2.
  w.forward_workspace_bytes = align_up(R * static_cast<size_t>(p.d) * es) +
                              align_up(R * static_cast<size_t>(p.n) * es) + align_up(R * 4) * 2;
  // Backward scratch: dH [R, n1], A' [R, n], dX~ [R, d], dS partials [R], d logits [T, E].
  w.backward_workspace_bytes = align_up(R * n1 * es) + align_up(R * static_cast<size_t>(p.n) * es) +
                               align_up(R * static_cast<size_t>(p.d) * es) + align_up(R * 4) +
                               align_up(T * E * 4);
  return w;
}

bool layer_kernels_available() { return false; }

void layer_forward(const LayerProblem& p, const LayerForwardArgs&, cudaStream_t) {
  validate(p);
  not_built("layer_forward");
}

void layer_backward(const LayerProblem& p, const LayerBackwardArgs&, cudaStream_t) {
  validate(p);
  not_built("layer_backward");
}

}  // namespace machmoe
