// The layer's router on its own (router_forward, router_backward): the same kernels and cuBLAS
// calls as layer_forward / layer_backward run for their router, for callers that route tokens
// before they travel (expert parallelism). Forward: (bias broadcast) -> router GEMM -> top-K with
// the aux loss's partial sums -> routing metadata of the T·K pairs (their expert offsets) -> aux
// finalize. Backward: top-K backward (d_logits fp32 and its bf16 copy) -> aux backward -> router
// bias gradient -> dWr and dx GEMMs. No host synchronisation.
#include <algorithm>
#include <cstdint>
#include <string>

#include "host/common/check.hpp"
#include "host/common/cublas_internal.hpp"
#include "host/layer/call_rules.hpp"
#include "host/layer/experts_internal.hpp"
#include "host/routing/routing_internal.hpp"
#include "kernels/layer/layer_backward.cuh"
#include "kernels/routing/aux_loss.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::align256;
using detail::at;
using detail::ceil_div;
using detail::check_cublas;
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;
using detail::require_given;
using detail::require_given_exactly_when;

namespace detail {

void router_gemm(const void* x, const void* wr, float* logits, int64_t T, int64_t E, int64_t d, bool accumulate,
                 void* ws, size_t ws_bytes, cudaStream_t stream, const char* fn) {
  // Column-major view: logitsᵀ [E, T] = Wr · xᵀ.
  cublasHandle_t h = cublas_on(stream, ws, ws_bytes, fn);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(E), static_cast<int>(T),
                            static_cast<int>(d), &alpha, wr, CUDA_R_16BF, static_cast<int>(d), x, CUDA_R_16BF,
                            static_cast<int>(d), &beta, logits, CUDA_R_32F, static_cast<int>(E),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               (std::string(fn) + ": router GEMM (cublasGemmEx)").c_str());
}

void aux_loss_forward(const float* logits, int64_t T, int64_t E, const int32_t* expert_offsets, bool have_partials,
                      float* partials, float* colsum, float* aux, cudaStream_t stream, const char* fn) {
  const int blocks = static_cast<int>(ceil_div(T, static_cast<int64_t>(kRouterAuxTokens)));
  const std::string where(fn);
  if (!have_partials) {
    kernels::aux_colsum_partial<kRouterAuxTokens><<<blocks, 256, 0, stream>>>(logits, T, static_cast<int>(E), partials);
    check_launch((where + ": aux partial sums").c_str());
  }
  kernels::aux_finalize<1024><<<1, 1024, 0, stream>>>(partials, blocks, static_cast<int>(E), expert_offsets, colsum, aux);
  check_launch((where + ": aux loss").c_str());
}

void aux_loss_backward(const float* logits, int64_t T, int64_t E, const int32_t* expert_offsets, float d_aux,
                       const float* d_aux_device, float* partials, float* grad, float* d_logits,
                       __nv_bfloat16* d_logits_bf16, cudaStream_t stream, const char* fn) {
  constexpr int kThreads = kBackwardThreads;
  const int blocks = static_cast<int>(ceil_div(T, static_cast<int64_t>(kRouterAuxTokens)));
  const std::string where(fn);
  kernels::aux_colsum_partial<kRouterAuxTokens><<<blocks, kThreads, 0, stream>>>(logits, T, static_cast<int>(E),
                                                                                 partials);
  check_launch((where + ": aux partial sums").c_str());
  kernels::bwd_aux_coefficients<1024><<<1, 1024, 0, stream>>>(partials, blocks, static_cast<int>(E), expert_offsets,
                                                              d_aux, d_aux_device, grad);
  check_launch((where + ": aux coefficients").c_str());
  // (returns at once when the loss has no gradient: grad[E] == 0, known on the device only)
  kernels::bwd_aux_apply<kThreads><<<blocks_for(T, kBackwardWarpsPerBlock), kThreads, 0, stream>>>(
      logits, T, static_cast<int>(E), grad, d_logits, d_logits_bf16);
  check_launch((where + ": aux backward").c_str());
}

// Column-major views of row-major arrays: dWrᵀ [d, E] = xᵀ [d, T] · d_logits [T, E].
void router_weight_gradient(cublasHandle_t h, const void* x, const __nv_bfloat16* d_logits_bf16, int64_t T,
                            int64_t E, int64_t d, void* d_router_weight, DType dtype, const char* fn) {
  const float one = 1.f, zero = 0.f;
  check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(d), static_cast<int>(E), static_cast<int>(T),
                            &one, x, CUDA_R_16BF, static_cast<int>(d), d_logits_bf16, CUDA_R_16BF, static_cast<int>(E),
                            &zero, d_router_weight, cuda_type(dtype), static_cast<int>(d), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               (std::string(fn) + ": d_router_weight GEMM (cublasGemmEx)").c_str());
}

// dxᵀ [d, T] (+)= Wrᵀ [d, E] · d_logitsᵀ [E, T].
void router_input_gradient(cublasHandle_t h, const void* router_weight, const __nv_bfloat16* d_logits_bf16, int64_t T,
                           int64_t E, int64_t d, void* dx, bool accumulate, const char* fn) {
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(d), static_cast<int>(T), static_cast<int>(E),
                            &one, router_weight, CUDA_R_16BF, static_cast<int>(d), d_logits_bf16, CUDA_R_16BF,
                            static_cast<int>(E), &beta, dx, CUDA_R_16BF, static_cast<int>(d), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               (std::string(fn) + ": dx router GEMM (cublasGemmEx)").c_str());
}

}  // namespace detail

namespace {

constexpr int kAuxTokens = detail::kRouterAuxTokens;     // tokens per row of the aux partials
constexpr size_t kCublasBytes = size_t{4} << 20;          // as the layer's

// The workspace: cuBLAS's, then the forward's buffers or the backward's (never both at once).
struct RouterWorkspace {
  size_t cublas = 0;
  // forward
  size_t aux_partials = 0, aux_colsum = 0, metadata = 0, metadata_bytes = 0, row_token = 0, row_pair = 0,
         pair_row = 0;
  // backward
  size_t d_logits = 0, d_logits_bf16 = 0, partials = 0, aux_grad = 0;
  size_t bytes = 0;

  explicit RouterWorkspace(const RouterProblem& p) {
    const size_t T = static_cast<size_t>(std::max<int64_t>(p.T, 1)), E = static_cast<size_t>(p.E);
    const size_t R = T * static_cast<size_t>(p.K);
    const size_t blocks = ceil_div(T, static_cast<size_t>(kAuxTokens));
    size_t at = align256(kCublasBytes);
    auto take = [&](size_t& offset, size_t n) { offset = at, at = align256(at + n); };
    const size_t shared = at;
    take(aux_partials, blocks * E * 4);
    take(aux_colsum, E * 4);
    metadata_bytes = routing_metadata_workspace_bytes(static_cast<int64_t>(T), p.E);
    take(metadata, metadata_bytes);
    take(row_token, R * 4);
    take(row_pair, R * 4);
    take(pair_row, R * 4);
    const size_t forward_end = at;
    at = shared;
    take(d_logits, T * E * 4);
    take(d_logits_bf16, T * E * 2);
    take(partials, blocks * E * 4);  // the aux partials, then the router bias's (<= blocks rows)
    take(aux_grad, (E + 1) * 4);
    bytes = std::max(forward_end, at);
  }
};

void check_problem(const RouterProblem& p, const char* fn) {
  require_arg(p.T >= 0, fn, "T", "must be >= 0, got " + std::to_string(p.T));
  require_arg(p.d >= 1, fn, "d", "must be >= 1, got " + std::to_string(p.d));
  require_arg(p.E >= 1 && p.K >= 1 && p.K <= p.E, fn, "K",
              "must be in [1, E], got K=" + std::to_string(p.K) + ", E=" + std::to_string(p.E));
}

}  // namespace

size_t router_workspace_bytes(const RouterProblem& p) { return RouterWorkspace(p).bytes; }

void router_forward(const RouterProblem& p, const RouterForwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "router_forward";
  check_problem(p, fn);
  require_given(fn, {{"expert_offsets", a.expert_offsets}, {"aux_loss", a.aux_loss}, {"workspace", a.workspace}});
  require_given_exactly_when(p.has_router_bias, "has_router_bias", fn, {{"router_bias", a.router_bias}});
  const RouterWorkspace L(p);
  void* w = a.workspace;
  if (p.T == 0) {  // no pair: offsets 0, aux 0
    check_cuda(cudaMemsetAsync(a.expert_offsets, 0, static_cast<size_t>(p.E + 1) * 4, stream),
               "router_forward: memset");
    check_cuda(cudaMemsetAsync(a.aux_loss, 0, sizeof(float), stream), "router_forward: memset");
    return;
  }
  require_given(fn,
                {{"x", a.x}, {"router_weight", a.router_weight}, {"logits", a.logits}, {"scores", a.scores},
                 {"experts", a.experts}},
                "T > 0");
  // 1. logits = (bias) + x·Wrᵀ
  if (p.has_router_bias) detail::router_bias_broadcast(a.router_bias, p.T, p.E, a.logits, stream);
  detail::router_gemm(a.x, a.router_weight, a.logits, p.T, p.E, p.d, p.has_router_bias, w, kCublasBytes, stream, fn);
  // 2. top-K, with the aux loss's column sums of softmax(logits) where the kernel can
  float* partials = at<float>(w, L.aux_partials);
  const bool have_partials = detail::topk_router_with_aux(a.logits, p.T, p.E, p.K, p.routing, p.renormalize,
                                                          p.options, a.selection_bias, a.scores, a.experts, partials,
                                                          stream);
  // 3. the experts' pair counts, as offsets (the aux loss's frequencies)
  RoutingMetadataOutputs md;
  md.expert_offsets = a.expert_offsets;
  md.row_token = at<int32_t>(w, L.row_token);
  md.row_pair = at<int32_t>(w, L.row_pair);
  md.pair_row = at<int32_t>(w, L.pair_row);
  routing_metadata(a.experts, nullptr, p.T * p.K, p.K, p.T, p.E, md, at<void>(w, L.metadata), L.metadata_bytes, stream);
  // 4. the aux loss
  detail::aux_loss_forward(a.logits, p.T, p.E, a.expert_offsets, have_partials, partials, at<float>(w, L.aux_colsum),
                           a.aux_loss, stream, fn);
}

void router_backward(const RouterProblem& p, const RouterBackwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "router_backward";
  check_problem(p, fn);
  require_given(fn, {{"d_router_weight", a.d_router_weight}, {"workspace", a.workspace}});
  require_given_exactly_when(p.has_router_bias, "has_router_bias", fn, {{"d_router_bias", a.d_router_bias}});
  const RouterWorkspace L(p);
  void* w = a.workspace;
  const size_t grad_bytes = static_cast<size_t>(dtype_size(a.weight_grad_dtype));
  if (p.T == 0) {  // no token: the gradients are zero
    check_cuda(cudaMemsetAsync(a.d_router_weight, 0, static_cast<size_t>(p.E * p.d) * grad_bytes, stream),
               "router_backward: memset");
    if (p.has_router_bias)
      check_cuda(cudaMemsetAsync(a.d_router_bias, 0, static_cast<size_t>(p.E) * grad_bytes, stream),
                 "router_backward: memset");
    return;
  }
  require_given(fn,
                {{"x", a.x}, {"router_weight", a.router_weight}, {"dx", a.dx}, {"logits", a.logits},
                 {"scores", a.scores}, {"experts", a.experts}, {"expert_offsets", a.expert_offsets}},
                "T > 0");
  float* d_logits = at<float>(w, L.d_logits);
  auto* d_logits_bf16 = at<__nv_bfloat16>(w, L.d_logits_bf16);
  // 1. d_logits from the scores' gradient (fp32 and its bf16 copy), or zero
  if (a.d_scores) {
    detail::topk_router_backward_bf16(a.logits, a.scores, a.experts, a.d_scores, p.T, p.E, p.K, p.routing,
                                      p.renormalize, p.options, d_logits, d_logits_bf16, stream);
  } else {
    check_cuda(cudaMemsetAsync(d_logits, 0, static_cast<size_t>(p.T * p.E) * 4, stream), "router_backward: memset");
    check_cuda(cudaMemsetAsync(d_logits_bf16, 0, static_cast<size_t>(p.T * p.E) * 2, stream),
               "router_backward: memset");
  }
  // 2. + d_aux · ∂aux/∂logits (both copies)
  float* partials = at<float>(w, L.partials);
  if (a.d_aux)
    detail::aux_loss_backward(a.logits, p.T, p.E, a.expert_offsets, 0.f, a.d_aux, partials, at<float>(w, L.aux_grad),
                              d_logits, d_logits_bf16, stream, fn);
  // 3. d_router_bias = Σ_t d_logits (fp32, fixed order)
  if (p.has_router_bias)
    detail::router_bias_grad(d_logits, p.T, p.E, partials, a.d_router_bias, a.weight_grad_dtype, stream);
  // 4. dWr and dx (written)
  cublasHandle_t h = detail::cublas_on(stream, w, kCublasBytes, fn);
  detail::router_weight_gradient(h, a.x, d_logits_bf16, p.T, p.E, p.d, a.d_router_weight, a.weight_grad_dtype, fn);
  detail::router_input_gradient(h, a.router_weight, d_logits_bf16, p.T, p.E, p.d, a.dx, false, fn);
}

}  // namespace machmoe
