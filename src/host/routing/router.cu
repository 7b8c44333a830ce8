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
#include "host/layer/experts_internal.hpp"
#include "host/routing/routing_internal.hpp"
#include "kernels/layer/layer_backward.cuh"
#include "kernels/routing/aux_loss.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::align256;
using detail::ceil_div;
using detail::check_cublas;
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;

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

}  // namespace detail

namespace {

constexpr int kAuxTokens = detail::kRouterAuxTokens;     // tokens per row of the aux partials
constexpr size_t kCublasBytes = size_t{4} << 20;          // as the layer's
constexpr int kThreads = detail::kBackwardThreads;

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

template <typename P>
P* at(void* base, size_t offset) { return reinterpret_cast<P*>(static_cast<char*>(base) + offset); }

void check_problem(const RouterProblem& p, const char* fn) {
  require_arg(p.T >= 0, fn, "T", "must be >= 0, got " + std::to_string(p.T));
  require_arg(p.d >= 1, fn, "d", "must be >= 1, got " + std::to_string(p.d));
  require_arg(p.E >= 1 && p.K >= 1 && p.K <= p.E, fn, "K",
              "must be in [1, E], got K=" + std::to_string(p.K) + ", E=" + std::to_string(p.E));
}

void check_given(const char* fn, const char* name, const void* ptr) {
  require_arg(ptr != nullptr, fn, name, "must be given");
}

}  // namespace

size_t router_workspace_bytes(const RouterProblem& p) { return RouterWorkspace(p).bytes; }

void router_forward(const RouterProblem& p, const RouterForwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "router_forward";
  check_problem(p, fn);
  require_arg(a.expert_offsets && a.aux_loss && a.workspace, fn, "expert_offsets/aux_loss/workspace",
              "must be given");
  require_arg((a.router_bias != nullptr) == p.has_router_bias, fn, "router_bias",
              "is given exactly when has_router_bias");
  const RouterWorkspace L(p);
  void* w = a.workspace;
  if (p.T == 0) {  // no pair: offsets 0, aux 0
    check_cuda(cudaMemsetAsync(a.expert_offsets, 0, static_cast<size_t>(p.E + 1) * 4, stream),
               "router_forward: memset");
    check_cuda(cudaMemsetAsync(a.aux_loss, 0, sizeof(float), stream), "router_forward: memset");
    return;
  }
  check_given(fn, "x", a.x);
  check_given(fn, "router_weight", a.router_weight);
  require_arg(a.logits && a.scores && a.experts, fn, "logits/scores/experts", "must be given");
  // 1. logits = (bias) + x·Wrᵀ
  if (p.has_router_bias) detail::router_bias_broadcast(a.router_bias, p.T, p.E, a.logits, stream);
  detail::router_gemm(a.x, a.router_weight, a.logits, p.T, p.E, p.d, p.has_router_bias, w, kCublasBytes, stream, fn);
  // 2. top-K, with the aux loss's column sums of softmax(logits) where the kernel can
  float* partials = at<float>(w, L.aux_partials);
  const int blocks = static_cast<int>(ceil_div(p.T, static_cast<int64_t>(kAuxTokens)));
  if (!detail::topk_router_with_aux(a.logits, p.T, p.E, p.K, p.routing, p.renormalize, p.options, a.selection_bias,
                                    a.scores, a.experts, partials, stream)) {
    kernels::aux_colsum_partial<kAuxTokens><<<blocks, 256, 0, stream>>>(a.logits, p.T, static_cast<int>(p.E), partials);
    check_launch("router_forward: aux partial sums");
  }
  // 3. the experts' pair counts, as offsets (the aux loss's frequencies)
  RoutingMetadataOutputs md;
  md.expert_offsets = a.expert_offsets;
  md.row_token = at<int32_t>(w, L.row_token);
  md.row_pair = at<int32_t>(w, L.row_pair);
  md.pair_row = at<int32_t>(w, L.pair_row);
  routing_metadata(a.experts, nullptr, p.T * p.K, p.K, p.T, p.E, md, at<void>(w, L.metadata), L.metadata_bytes, stream);
  // 4. the aux loss
  kernels::aux_finalize<1024><<<1, 1024, 0, stream>>>(partials, blocks, static_cast<int>(p.E), a.expert_offsets,
                                                      at<float>(w, L.aux_colsum), a.aux_loss);
  check_launch("router_forward: aux loss");
}

void router_backward(const RouterProblem& p, const RouterBackwardArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "router_backward";
  check_problem(p, fn);
  require_arg(a.d_router_weight && a.workspace, fn, "d_router_weight/workspace", "must be given");
  require_arg((a.d_router_bias != nullptr) == p.has_router_bias, fn, "d_router_bias",
              "is given exactly when has_router_bias");
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
  check_given(fn, "x", a.x);
  check_given(fn, "router_weight", a.router_weight);
  check_given(fn, "dx", a.dx);
  require_arg(a.logits && a.scores && a.experts && a.expert_offsets, fn, "logits/scores/experts/expert_offsets",
              "must be given (the forward's)");
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
  if (a.d_aux) {
    const int blocks = static_cast<int>(ceil_div(p.T, static_cast<int64_t>(kAuxTokens)));
    float* grad = at<float>(w, L.aux_grad);
    kernels::aux_colsum_partial<kAuxTokens><<<blocks, kThreads, 0, stream>>>(a.logits, p.T, static_cast<int>(p.E),
                                                                             partials);
    check_launch("router_backward: aux partial sums");
    kernels::bwd_aux_coefficients<1024><<<1, 1024, 0, stream>>>(partials, blocks, static_cast<int>(p.E),
                                                                a.expert_offsets, 0.f, a.d_aux, grad);
    check_launch("router_backward: aux coefficients");
    kernels::bwd_aux_apply<kThreads><<<detail::blocks_for(p.T, detail::kBackwardWarpsPerBlock), kThreads, 0, stream>>>(
        a.logits, p.T, static_cast<int>(p.E), grad, d_logits, d_logits_bf16);
    check_launch("router_backward: aux backward");
  }
  // 3. d_router_bias = Σ_t d_logits (fp32, fixed order)
  if (p.has_router_bias)
    detail::router_bias_grad(d_logits, p.T, p.E, partials, a.d_router_bias, a.weight_grad_dtype, stream);
  // 4. Column-major views of row-major arrays: dWrᵀ [d, E] = xᵀ [d, T] · d_logits [T, E];
  //    dxᵀ [d, T] = Wrᵀ [d, E] · d_logitsᵀ [E, T].
  cublasHandle_t h = detail::cublas_on(stream, w, kCublasBytes, fn);
  const int T = static_cast<int>(p.T), E = static_cast<int>(p.E), d = static_cast<int>(p.d);
  const float one = 1.f, zero = 0.f;
  check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, d, E, T, &one, a.x, CUDA_R_16BF, d, d_logits_bf16, CUDA_R_16BF,
                            E, &zero, a.d_router_weight, detail::cuda_type(a.weight_grad_dtype), d, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "router_backward: d_router_weight GEMM (cublasGemmEx)");
  check_cublas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, T, E, &one, a.router_weight, CUDA_R_16BF, d, d_logits_bf16,
                            CUDA_R_16BF, E, &zero, a.dx, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "router_backward: dx GEMM (cublasGemmEx)");
}

}  // namespace machmoe
