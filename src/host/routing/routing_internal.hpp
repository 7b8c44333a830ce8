// Routing internals shared by the launchers: the layout of routing_metadata's workspace (also
// read by token rounding, which uses the bit matrix the metadata pass leaves behind: bit (e, t)
// set <=> token t routed to expert e), and the top-K router with the aux loss's partial sums.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "host/common/check.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

inline size_t align256(size_t v) { return (v + 255) / 256 * 256; }

// [bits E x W u32 | done counter u32 | duplicate flag u32 | pad] [word prefix E x W i32]
// [totals E i32] [tile flags W i32]
// General path: the bits and the two flags are zeroed by one memset at the start of the call.
// Tiled top-K path: no memset; the prefix region holds the tile counts [tiles, E] (tiles <= W) and
// the tile flags region one duplicate flag per tile. Either way the bits are all written.
struct MetadataWorkspace {
  size_t bits_bytes, counter_offset, prefix_offset, total_offset, tile_flag_offset, bytes;
  MetadataWorkspace(int64_t T, int64_t E) {
    const size_t W = static_cast<size_t>(ceil_div(T, 32));
    const size_t words = static_cast<size_t>(E) * W;
    bits_bytes = words * 4;
    counter_offset = bits_bytes;
    prefix_offset = align256(counter_offset + 8);
    total_offset = prefix_offset + align256(words * 4);
    tile_flag_offset = total_offset + align256(static_cast<size_t>(E) * 4);
    bytes = tile_flag_offset + align256(W * 4);
  }
};

// topk_router, and where the kernel can (E <= 256, K <= 32) also the aux loss's column sums of
// softmax(logits) per 64 tokens into aux_partials [ceil(T / 64), E] (kernels/routing/aux_loss.cuh's
// aux_colsum_partial layout) in the same pass. Returns whether it wrote them; if not, the caller
// runs aux_colsum_partial.
constexpr int kRouterAuxTokens = 64;  // tokens per block of aux_partials
bool topk_router_with_aux(const float* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                          bool renormalize, const RouterOptions& options, const float* selection_bias, float* scores,
                          int32_t* experts, float* aux_partials, cudaStream_t stream);

// topk_router_backward that also writes the bf16 copy of d_logits (d_logits_bf16 [T, E]) in the
// same pass: the layer backward's router GEMMs take it, without a separate conversion kernel.
void topk_router_backward_bf16(const float* logits, const float* scores, const int32_t* experts,
                               const float* d_scores, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                               bool renormalize, const RouterOptions& options, float* d_logits,
                               __nv_bfloat16* d_logits_bf16, cudaStream_t stream);

// logits [T, E] fp32 = x [T, d] bf16 · Wrᵀ (Wr [E, d] bf16) by cuBLAS, fp32 accumulation, plus
// (accumulate: beta = 1) what logits already hold (the broadcast router bias). ws: cuBLAS's
// workspace (ours, so the call is graph-capturable). fn names the caller in errors.
void router_gemm(const void* x, const void* wr, float* logits, int64_t T, int64_t E, int64_t d, bool accumulate,
                 void* ws, size_t ws_bytes, cudaStream_t stream, const char* fn);

// aux [1] = the layer's load-balancing loss of the T·K pairs counted by expert_offsets [E+1]
// (docs/LAYER.md), from partials [ceil(T / kRouterAuxTokens), E], the column sums of
// softmax(logits) by token block: already written where have_partials (topk_router_with_aux
// wrote them), else computed here from logits [T, E]. colsum [E] fp32: scratch.
void aux_loss_forward(const float* logits, int64_t T, int64_t E, const int32_t* expert_offsets, bool have_partials,
                      float* partials, float* colsum, float* aux, cudaStream_t stream, const char* fn);

// d_logits [T, E] (fp32 and its bf16 copy, both updated) += d_aux · ∂aux/∂logits, the layer's
// load-balancing loss of the T·K pairs counted by expert_offsets [E+1] (docs/LAYER.md). The loss's
// gradient is the host value d_aux plus, where given, the device scalar d_aux_device [1].
// partials [ceil(T / kRouterAuxTokens), E] and grad [E+1] fp32: scratch. fn names the caller.
void aux_loss_backward(const float* logits, int64_t T, int64_t E, const int32_t* expert_offsets, float d_aux,
                       const float* d_aux_device, float* partials, float* grad, float* d_logits,
                       __nv_bfloat16* d_logits_bf16, cudaStream_t stream, const char* fn);

// The router's two backward GEMMs by cuBLAS on `h` (bf16 operands, fp32 accumulation), from
// d_logits [T, E] rounded to bf16: d_router_weight [E, d] (in `dtype`) = d_logitsᵀ · x [T, d],
// written; dx [T, d] bf16 = d_logits · Wr [E, d], added to what dx holds when accumulate.
void router_weight_gradient(cublasHandle_t h, const void* x, const __nv_bfloat16* d_logits_bf16, int64_t T,
                            int64_t E, int64_t d, void* d_router_weight, DType dtype, const char* fn);
void router_input_gradient(cublasHandle_t h, const void* router_weight, const __nv_bfloat16* d_logits_bf16, int64_t T,
                           int64_t E, int64_t d, void* dx, bool accumulate, const char* fn);

// The router bias b_r [E] bf16: logits [T, E] fp32 <- b_r on every row (the router GEMM then adds
// x·Wrᵀ with beta = 1).
void router_bias_broadcast(const void* bias, int64_t T, int64_t E, float* logits, cudaStream_t stream);
// Its gradient d_bias [E] (fp32 or bf16) = Σ_t d_logits [T, E], in a fixed order through
// partials [router_bias_grad_chunks(T), E] fp32 (<= ceil(T / 64) rows: the aux partials' block fits).
int64_t router_bias_grad_chunks(int64_t T);
void router_bias_grad(const float* d_logits, int64_t T, int64_t E, float* partials, void* d_bias, DType d_bias_dtype,
                      cudaStream_t stream);

}  // namespace machmoe::detail
