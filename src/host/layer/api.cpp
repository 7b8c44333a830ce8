// The public C++ API's host side: problem validation and the workspace plans (the layer's and the
// experts' on a general routing list), and the calls on a plain problem. validate() is the only
// maker of a ValidLayerProblem / ValidExpertsProblem; every overload that takes a plain problem is
// here, validates it once and passes the result on. The layer forward is in layer.cu, the backward in
// layer_backward.cu, their expert part (and experts_forward/backward) in experts.cpp and
// experts_backward.cu, the kernel families in routing.cu, token_rounding.cu, grouped_gemm.cu and
// grouped_wgrad.cu.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "host/layer/layer_layout.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
namespace {

void require(bool ok, const char* field, const std::string& rule) {
  if (!ok)
    throw Error(ErrorCode::InvalidArgument, std::string("LayerProblem.") + field + ": " + rule);
}

// precision FP8's rules common to both problems (the FP8 experts: the GLU epilogue and backward
// kernels of SwiGLU and the clamped SwiGLU, 16-byte rows of E4M3 codes); `require` names the
// problem's field.
template <typename Problem, typename Require>
void check_fp8_rules(const Problem& p, Require require) {
  require(p.precision == Precision::BF16 || p.precision == Precision::FP8, "precision", "must be BF16 or FP8");
  if (p.precision != Precision::FP8) return;
  const std::string rule = " with precision FP8";
  require(p.activation == Activation::SwiGLU || p.activation == Activation::ClampedSwiGLU, "activation",
          "must be SwiGLU or ClampedSwiGLU" + rule + " (the FP8 experts' backward kernels), got " +
              to_string(p.activation));
  require(p.layout == GateUpLayout::Interleaved, "layout", "must be interleaved" + rule + " (quantise the weights " +
                                                               "of a concatenated layout with their rows interleaved)");
  require(p.dtype == DType::BF16, "dtype", "must be bfloat16" + rule + ", got " + std::string(to_string(p.dtype)));
  require(p.d >= 16 && p.d % 16 == 0, "d",
          "must be a multiple of 16" + rule + " (16-byte rows of E4M3 codes), got " + std::to_string(p.d));
  require(p.n >= 16 && p.n % 16 == 0, "n",
          "must be a multiple of 16" + rule + " (16-byte rows of E4M3 codes), got " + std::to_string(p.n));
}

}  // namespace

ValidLayerProblem validate(const LayerProblem& p) {
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
  check_glu_clamp("LayerProblem", p.activation, p.glu_clamp);
  // The router options (docs/LAYER.md "Routing").
  require(p.routed_scaling_factor > 0.0 && std::isfinite(static_cast<float>(p.routed_scaling_factor)),
          "routed_scaling_factor", "must be finite (in fp32) and > 0, got " + std::to_string(p.routed_scaling_factor));
  require(p.n_group >= 1 && p.E % p.n_group == 0, "n_group",
          "must be >= 1 and divide E=" + std::to_string(p.E) + ", got " + std::to_string(p.n_group));
  require(p.topk_group >= 1 && p.topk_group <= p.n_group, "topk_group",
          "must be in [1, n_group=" + std::to_string(p.n_group) + "], got " + std::to_string(p.topk_group));
  if (p.n_group > 1) {
    require(is_gate_routing(p.routing), "n_group",
            std::string("group-limited selection (n_group > 1) needs routing=sigmoid or sqrt_softplus, got routing=") +
                to_string(p.routing));
    require(p.E / p.n_group >= 2, "n_group",
            "group-limited selection needs >= 2 experts per group (E / n_group), got E=" + std::to_string(p.E) +
                ", n_group=" + std::to_string(p.n_group));
    require(p.K <= p.topk_group * (p.E / p.n_group), "K",
            "must be <= topk_group * E / n_group = " + std::to_string(p.topk_group * (p.E / p.n_group)) + ", got " +
                std::to_string(p.K));
  }
  require(p.rounding == TokenRounding::None || (p.routed_scaling_factor == 1.0 && p.n_group == 1), "rounding",
          "token rounding takes no routed_scaling_factor (must be 1) and no group-limited selection (n_group 1)");
  // Shared experts: experts E..E+S-1 of the weights, in every token's list after its K routed pairs.
  require(p.num_shared >= 0 && p.num_shared <= (int64_t{1} << 30) - p.E, "num_shared",
          "must be in [0, 2^30 - E], got " + std::to_string(p.num_shared));
  require(p.num_shared == 0 || p.rounding == TokenRounding::None, "num_shared",
          "shared experts are not available with token rounding (rounding must be none)");
  require(!p.has_shared_scores || p.num_shared >= 1, "has_shared_scores", "needs num_shared >= 1");
  require(!p.has_shared_gate || p.num_shared >= 1, "has_shared_gate", "needs num_shared >= 1");
  require(!(p.has_shared_gate && p.has_shared_scores), "has_shared_gate",
          "the shared experts' weight is either given (has_shared_scores) or computed from a gate "
          "(has_shared_gate), not both");
  check_fp8_rules(p, require);
  require(p.precision != Precision::FP8 || p.num_shared == 0, "num_shared",
          "shared experts are not available with precision FP8 (run them beside the layer)");
  // Row indices are int32 on the device; element offsets are 64-bit.
  const int64_t pairs_per_token = p.K + p.num_shared;
  require(p.T <= std::numeric_limits<int32_t>::max() / pairs_per_token, "T",
          "T*(K + num_shared) must fit in int32 (rows are indexed by int32), got T=" + std::to_string(p.T) +
              ", K=" + std::to_string(p.K) + ", num_shared=" + std::to_string(p.num_shared));
  return ValidLayerProblem(p);
}

WorkspacePlan plan_workspace(const LayerProblem& p) { return plan_workspace(validate(p)); }

WorkspacePlan plan_workspace(const ValidLayerProblem& p) {
  const detail::LayerLayout L(p);  // the same layout layer_forward carves the blocks with
  WorkspacePlan w;
  w.saved_bytes = L.saved_bytes;
  w.inference_saved_bytes = L.inference_saved_bytes;
  w.forward_workspace_bytes = L.forward_bytes;
  w.backward_workspace_bytes = L.backward_bytes;
  return w;
}

namespace {

void require_experts(bool ok, const char* field, const std::string& rule) {
  if (!ok) throw Error(ErrorCode::InvalidArgument, std::string("ExpertsProblem.") + field + ": " + rule);
}

}  // namespace

ValidExpertsProblem validate(const ExpertsProblem& p) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  require_experts(p.T >= 0 && p.T < kInt32Max, "T", "must be in [0, 2^31 - 1), got " + std::to_string(p.T));
  require_experts(p.d >= 1, "d", "must be >= 1, got " + std::to_string(p.d));
  require_experts(p.n >= 1, "n", "must be >= 1, got " + std::to_string(p.n));
  require_experts(p.E >= 1 && p.E <= kInt32Max / 2, "E", "must be in [1, 2^30], got " + std::to_string(p.E));
  // Rows and pairs are indexed by int32 on the device. The list may be longer than the T·E pairs a
  // list without repeats has in range: pairs out of range are allowed and get no row (expert
  // parallelism's gathered lists hold every rank's pairs, most of them other ranks' experts).
  require_experts(p.R >= 0 && p.R <= kInt32Max, "R", "must be in [0, 2^31), got " + std::to_string(p.R));
  require_experts(p.T > 0 || p.R == 0, "R", "must be 0 when T = 0, got " + std::to_string(p.R));
  require_experts(p.dtype == DType::BF16 || p.dtype == DType::FP16 || p.dtype == DType::FP32, "dtype",
                  "must be bfloat16, float16 or float32");
  check_glu_clamp("ExpertsProblem", p.activation, p.glu_clamp);
  check_fp8_rules(p, require_experts);
  return ValidExpertsProblem(p);
}

WorkspacePlan plan_workspace(const ExpertsProblem& p) { return plan_workspace(validate(p)); }

WorkspacePlan plan_workspace(const ValidExpertsProblem& p) {
  const detail::ExpertsLayout L(p);  // the same layout experts_forward/backward carve the blocks with
  WorkspacePlan w;
  w.saved_bytes = L.saved_bytes;
  w.inference_saved_bytes = L.saved_bytes;  // experts_forward always writes H
  w.forward_workspace_bytes = L.forward_bytes;
  w.backward_workspace_bytes = L.backward_bytes;
  return w;
}

// The calls on a plain problem: validated here, once, then the calls on the validated problem
// (layer.cu, layer_backward.cu, experts.cpp, experts_backward.cu), which check nothing of it again.
void layer_forward(const LayerProblem& p, const LayerForwardArgs& a, cudaStream_t stream) {
  layer_forward(validate(p), a, stream);
}
void layer_backward(const LayerProblem& p, const LayerBackwardArgs& a, cudaStream_t stream) {
  layer_backward(validate(p), a, stream);
}
void experts_forward(const ExpertsProblem& p, const ExpertsForwardArgs& a, cudaStream_t stream) {
  experts_forward(validate(p), a, stream);
}
void experts_backward(const ExpertsProblem& p, const ExpertsBackwardArgs& a, cudaStream_t stream) {
  experts_backward(validate(p), a, stream);
}

// Both directions of the layer run on the GPU (layer.cu, layer_backward.cu).
bool layer_kernels_available() { return true; }

}  // namespace machmoe
