// Launchers of the routing and data-movement kernels (top-K router, routing metadata, aggregation): argument
// checks, the choice of kernel variant, and launches on the caller's stream. No host sync.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "host/common/check.hpp"
#include "host/routing/routing_internal.hpp"
#include "kernels/layer/aggregate.cuh"
#include "kernels/routing/router_bias.cuh"
#include "kernels/routing/routing_metadata.cuh"
#include "kernels/routing/topk_router.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::ceil_div;
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;

namespace {

constexpr int kRouterThreads = 256;  // 8 tokens (warps) per block
constexpr int kMaxRegisterExperts = 4096;
constexpr int kMaxRegisterK = 32;
constexpr int64_t kMaxGroups = 32;  // group-limited selection: one group per lane

int router_method(RoutingMethod m) {
  switch (m) {
    case RoutingMethod::SoftmaxTopK: return kernels::kSoftmaxTopK;
    case RoutingMethod::TopKSoftmax: return kernels::kTopKSoftmax;
    case RoutingMethod::Sigmoid: return kernels::kSigmoid;
    case RoutingMethod::SqrtSoftplus: return kernels::kSqrtSoftplus;
  }
  throw Error(ErrorCode::InvalidArgument, "routing method out of range");
}

void check_router_shape(const char* fn, int64_t T, int64_t E, int64_t K) {
  require_arg(T >= 0, fn, "T", "must be >= 0, got " + std::to_string(T));
  require_arg(E >= 1 && E <= std::numeric_limits<int32_t>::max(), fn, "E",
              "must be in [1, 2^31), got " + std::to_string(E));
  require_arg(K >= 1 && K <= E, fn, "K",
              "must be in [1, E=" + std::to_string(E) + "], got " + std::to_string(K));
  require_arg(T <= std::numeric_limits<int32_t>::max() / K, fn, "T",
              "T*K must fit in int32, got T=" + std::to_string(T) + ", K=" + std::to_string(K));
}

// The router options' rules (the layer's validate() states the same for LayerProblem).
void check_router_options(const char* fn, RoutingMethod method, int64_t E, int64_t K, const RouterOptions& o) {
  require_arg(o.routed_scaling_factor > 0.0 && std::isfinite(static_cast<float>(o.routed_scaling_factor)), fn,
              "routed_scaling_factor", "must be finite and > 0, got " + std::to_string(o.routed_scaling_factor));
  require_arg(o.n_group >= 1 && o.n_group <= kMaxGroups && E % o.n_group == 0, fn, "n_group",
              "must be in [1, " + std::to_string(kMaxGroups) + "] and divide E=" + std::to_string(E) + ", got " +
                  std::to_string(o.n_group));
  require_arg(o.topk_group >= 1 && o.topk_group <= o.n_group, fn, "topk_group",
              "must be in [1, n_group=" + std::to_string(o.n_group) + "], got " + std::to_string(o.topk_group));
  if (o.n_group == 1) return;
  require_arg(is_gate_routing(method), fn, "n_group",
              "group-limited selection (n_group > 1) needs routing=sigmoid or sqrt_softplus");
  require_arg(E / o.n_group >= 2, fn, "n_group", "group-limited selection needs >= 2 experts per group (E / n_group)");
  require_arg(K <= o.topk_group * (E / o.n_group), fn, "K",
              "must be <= topk_group * E / n_group = " + std::to_string(o.topk_group * (E / o.n_group)) + ", got " +
                  std::to_string(K));
}

template <int V>
void launch_router_registers(const kernels::RouterParams& p, unsigned blocks, cudaStream_t s) {
  kernels::topk_router_registers<V><<<blocks, kRouterThreads, 0, s>>>(p);
}

// Runs `launch<T_in, T_out>` for the runtime dtypes (bf16, fp16, fp32 each).
template <typename F>
void dispatch_dtypes(DType in, DType out, F&& launch) {
  auto with_out = [&](auto in_tag) {
    using TIn = decltype(in_tag);
    switch (out) {
      case DType::BF16: return launch(TIn{}, __nv_bfloat16{});
      case DType::FP16: return launch(TIn{}, __half{});
      case DType::FP32: return launch(TIn{}, float{});
    }
    throw Error(ErrorCode::InvalidArgument, "aggregate: out_dtype out of range");
  };
  switch (in) {
    case DType::BF16: return with_out(__nv_bfloat16{});
    case DType::FP16: return with_out(__half{});
    case DType::FP32: return with_out(float{});
  }
  throw Error(ErrorCode::InvalidArgument, "aggregate: rows_dtype out of range");
}

// Tiled top-K metadata: words per tile G (32*G tokens), the largest of 8, 4, 2, 1 whose kernels
// fit in the default 48 KB of shared memory (no opt-in attribute call; 1 KB left for the static
// arrays); 0 = general path. E = 128, K = 8: G = 8, 22 KB. Roughly E <= 3500 (K = 8) or K <= 180
// (E = 128) fit.
constexpr size_t kTopkSmemLimit = 47 * 1024;

int topk_tile_words(int64_t E, int64_t K) {
  if (E > (1 << 16) || K > (1 << 16)) return 0;  // keeps the smem arithmetic small; never fits
  for (int G = 8; G >= 1; G /= 2)
    if (kernels::topk_place_smem(E, G, K) <= kTopkSmemLimit && kernels::topk_mark_smem(E, G, K) <= kTopkSmemLimit)
      return G;
  return 0;
}

template <int G>
void launch_topk_metadata(const kernels::MetadataParams& p, cudaStream_t stream) {
  const auto tiles = static_cast<unsigned>(p.num_tiles);
  kernels::metadata_topk_mark<G>
      <<<tiles, kernels::kTileThreads, kernels::topk_mark_smem(p.E, G, p.K), stream>>>(p);
  check_launch("routing_metadata: topk_mark");
  kernels::metadata_topk_scan<<<static_cast<unsigned>(ceil_div(p.E, kernels::kWarpSize)),
                                kernels::kTileScanThreads, 0, stream>>>(p);
  check_launch("routing_metadata: topk_scan");
  kernels::metadata_topk_place<G>
      <<<tiles, kernels::kTileThreads, kernels::topk_place_smem(p.E, G, p.K), stream>>>(p);
  check_launch("routing_metadata: topk_place");
}

}  // namespace

namespace detail {

static_assert(kernels::kRouterBlockTokens == kRouterAuxTokens, "aux partials: 64 tokens per block");

bool topk_router_with_aux(const float* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                          bool renormalize, const RouterOptions& options, const float* selection_bias, float* scores,
                          int32_t* experts, float* aux_partials, cudaStream_t stream) {
  constexpr const char* fn = "topk_router";
  check_router_shape(fn, T, E, K);
  check_router_options(fn, method, E, K, options);
  require_arg(selection_bias == nullptr || is_gate_routing(method), fn, "selection_bias",
              "is only used with routing=sigmoid or sqrt_softplus");
  if (T == 0) return aux_partials != nullptr;  // no token: no partials to write
  require_arg(logits && scores && experts, fn, "logits/scores/experts", "must not be null");
  kernels::RouterParams p{logits, selection_bias, scores, experts, nullptr, T, static_cast<int>(E),
                          static_cast<int>(K), router_method(method), renormalize,
                          static_cast<float>(options.routed_scaling_factor), static_cast<int>(options.n_group),
                          static_cast<int>(options.topk_group)};
  const int64_t v = ceil_div(E, 32);
  const bool grouped = options.n_group > 1;  // the register kernel does not select by groups
  if (v <= kernels::kRouterSortedMaxV && K <= kMaxRegisterK) {
    p.aux_partials = aux_partials;
    const auto blocks = static_cast<unsigned>(ceil_div(T, kernels::kRouterBlockTokens));
    constexpr unsigned threads = kernels::kRouterBlockWarps * kernels::kWarpSize;
    if (v <= 1) kernels::topk_router_sorted<1><<<blocks, threads, 0, stream>>>(p);
    else if (v <= 2) kernels::topk_router_sorted<2><<<blocks, threads, 0, stream>>>(p);
    else if (v <= 4) kernels::topk_router_sorted<4><<<blocks, threads, 0, stream>>>(p);
    else kernels::topk_router_sorted<8><<<blocks, threads, 0, stream>>>(p);
    check_launch(fn);
    return aux_partials != nullptr;
  }
  const auto blocks = static_cast<unsigned>(ceil_div(T, kRouterThreads / 32));
  if (!grouped && E <= kMaxRegisterExperts && K <= kMaxRegisterK) {
    if (v <= 16) launch_router_registers<16>(p, blocks, stream);
    else if (v <= 32) launch_router_registers<32>(p, blocks, stream);
    else if (v <= 64) launch_router_registers<64>(p, blocks, stream);
    else launch_router_registers<128>(p, blocks, stream);
  } else {
    kernels::topk_router_general<<<blocks, kRouterThreads, 0, stream>>>(p);
  }
  check_launch(fn);
  return false;
}

}  // namespace detail

void topk_router(const float* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                 bool renormalize, const float* selection_bias, float* scores, int32_t* experts,
                 cudaStream_t stream) {
  topk_router(logits, T, E, K, method, renormalize, RouterOptions{}, selection_bias, scores, experts, stream);
}

void topk_router(const float* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                 bool renormalize, const RouterOptions& options, const float* selection_bias, float* scores,
                 int32_t* experts, cudaStream_t stream) {
  detail::topk_router_with_aux(logits, T, E, K, method, renormalize, options, selection_bias, scores, experts,
                               nullptr, stream);
}

void topk_router_backward(const float* logits, const float* scores, const int32_t* experts,
                          const float* d_scores, int64_t T, int64_t E, int64_t K,
                          RoutingMethod method, bool renormalize, float* d_logits,
                          cudaStream_t stream) {
  topk_router_backward(logits, scores, experts, d_scores, T, E, K, method, renormalize, RouterOptions{}, d_logits,
                       stream);
}

void topk_router_backward(const float* logits, const float* scores, const int32_t* experts,
                          const float* d_scores, int64_t T, int64_t E, int64_t K,
                          RoutingMethod method, bool renormalize, const RouterOptions& options,
                          float* d_logits, cudaStream_t stream) {
  detail::topk_router_backward_bf16(logits, scores, experts, d_scores, T, E, K, method, renormalize, options,
                                    d_logits, nullptr, stream);
}

namespace detail {
void topk_router_backward_bf16(const float* logits, const float* scores, const int32_t* experts,
                               const float* d_scores, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                               bool renormalize, const RouterOptions& options, float* d_logits,
                               __nv_bfloat16* d_logits_bf16, cudaStream_t stream) {
  constexpr const char* fn = "topk_router_backward";
  check_router_shape(fn, T, E, K);
  check_router_options(fn, method, E, K, options);
  if (T == 0) return;
  require_arg(logits && scores && experts && d_scores && d_logits, fn, "pointers", "must not be null");
  kernels::RouterBackwardParams p{logits, scores, experts, d_scores, d_logits, d_logits_bf16, T,
                                  static_cast<int>(E), static_cast<int>(K), router_method(method),
                                  renormalize, static_cast<float>(options.routed_scaling_factor)};
  kernels::topk_router_backward<<<static_cast<unsigned>(ceil_div(T, kRouterThreads / 32)),
                                  kRouterThreads, 0, stream>>>(p);
  check_launch(fn);
}

void router_bias_broadcast(const void* bias, int64_t T, int64_t E, float* logits, cudaStream_t stream) {
  if (T == 0) return;
  const int64_t total = T * E;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, 256), 4096));
  kernels::router_bias_broadcast<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(bias), T,
                                                             static_cast<int>(E), logits);
  check_launch("router bias: broadcast into logits");
}

int64_t router_bias_grad_chunks(int64_t T) {
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(T, kRouterAuxTokens), kernels::kBiasGradMaxChunks));
}

void router_bias_grad(const float* d_logits, int64_t T, int64_t E, float* partials, void* d_bias, DType d_bias_dtype,
                      cudaStream_t stream) {
  const int64_t chunks = router_bias_grad_chunks(T);
  const int64_t rows_per_chunk = std::max<int64_t>(1, ceil_div(T, chunks));
  const dim3 grid(static_cast<unsigned>(ceil_div(E, kernels::kWarpSize)), static_cast<unsigned>(chunks));
  kernels::router_bias_grad_partial<<<grid, kernels::kWarpSize * kernels::kBiasGradRowsPerThread, 0, stream>>>(
      d_logits, T, static_cast<int>(E), rows_per_chunk, partials);
  check_launch("router bias gradient: partial sums");
  const auto blocks = static_cast<unsigned>(ceil_div(E, 256));
  if (d_bias_dtype == DType::FP32)
    kernels::router_bias_grad_finish<float><<<blocks, 256, 0, stream>>>(partials, static_cast<int>(chunks),
                                                                         static_cast<int>(E),
                                                                         static_cast<float*>(d_bias));
  else
    kernels::router_bias_grad_finish<__nv_bfloat16><<<blocks, 256, 0, stream>>>(
        partials, static_cast<int>(chunks), static_cast<int>(E), static_cast<__nv_bfloat16*>(d_bias));
  check_launch("router bias gradient: sums");
}
}  // namespace detail

size_t routing_metadata_workspace_bytes(int64_t T, int64_t E) {
  require_arg(T >= 0, "routing_metadata_workspace_bytes", "T", "must be >= 0");
  require_arg(E >= 1, "routing_metadata_workspace_bytes", "E", "must be >= 1");
  return detail::MetadataWorkspace(T, E).bytes;
}

void routing_metadata(const int32_t* pair_expert, const int32_t* pair_token, int64_t R, int64_t K,
                      int64_t T, int64_t E, const RoutingMetadataOutputs& out, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* fn = "routing_metadata";
  require_arg(T >= 0 && T < std::numeric_limits<int32_t>::max(), fn, "T", "must be in [0, 2^31 - 1)");
  require_arg(E >= 1 && E <= std::numeric_limits<int32_t>::max() / 2, fn, "E", "must be in [1, 2^30]");
  require_arg(R >= 0 && R <= std::numeric_limits<int32_t>::max(), fn, "R", "must be in [0, 2^31)");
  require_arg(pair_token != nullptr || R == 0 || (K >= 1 && R == T * K), fn, "K",
              "a top-K list (pair_token null) needs K >= 1 and R == T*K");
  require_arg(out.expert_offsets && (R == 0 || (out.row_token && out.row_pair && out.pair_row)), fn,
              "out", "needs expert_offsets, row_token, row_pair and pair_row");
  require_arg(R == 0 || pair_expert, fn, "pair_expert", "must not be null");
  const detail::MetadataWorkspace ws(T, E);
  require_arg(workspace && workspace_bytes >= ws.bytes, fn, "workspace",
              "needs routing_metadata_workspace_bytes(T, E) = " + std::to_string(ws.bytes) + " bytes");
  char* base = static_cast<char*>(workspace);
  kernels::MetadataParams p{};
  p.pair_expert = pair_expert;
  p.pair_token = pair_token;
  p.R = R;
  p.T = T;
  p.E = static_cast<int>(E);
  p.K = static_cast<int>(std::max<int64_t>(K, 1));
  p.W = static_cast<int>(ceil_div(T, 32));
  p.bits = reinterpret_cast<uint32_t*>(base);
  p.done_counter = reinterpret_cast<uint32_t*>(base + ws.counter_offset);
  p.duplicate_flag = reinterpret_cast<uint32_t*>(base + ws.counter_offset + 4);
  p.duplicate_out = out.duplicate_flag;
  p.word_prefix = reinterpret_cast<int32_t*>(base + ws.prefix_offset);
  p.expert_total = reinterpret_cast<int32_t*>(base + ws.total_offset);
  p.expert_offsets = out.expert_offsets;
  p.row_token = out.row_token;
  p.row_pair = out.row_pair;
  p.pair_row = out.pair_row;
  // With no pairs every token offset is 0 (the memset below); the kernels leave them alone.
  p.token_offsets = R == 0 ? nullptr : out.token_offsets;

  // Top-K list: the tiled path (three kernels, no memset) when a tile fits in shared memory.
  const int G = pair_token == nullptr && R > 0 ? topk_tile_words(E, K) : 0;
  if (G > 0) {
    const int64_t tiles = ceil_div(p.W, G);  // <= W: C [tiles, E] fits in the prefix region
    p.num_tiles = static_cast<int>(tiles);
    p.tile_counts = p.word_prefix;
    p.tile_dup = reinterpret_cast<int32_t*>(base + ws.tile_flag_offset);
    p.experts_aligned16 = detail::aligned16(pair_expert);
    switch (G) {
      case 8: launch_topk_metadata<8>(p, stream); break;
      case 4: launch_topk_metadata<4>(p, stream); break;
      case 2: launch_topk_metadata<2>(p, stream); break;
      default: launch_topk_metadata<1>(p, stream); break;
    }
    return;
  }

  // General path: any list, any E (memset, global atomics, per-expert word scan, place).
  check_cuda(cudaMemsetAsync(base, 0, ws.counter_offset + 8, stream), "routing_metadata: memset");
  if (out.token_offsets && R == 0)
    check_cuda(cudaMemsetAsync(out.token_offsets, 0, (T + 1) * sizeof(int32_t), stream),
               "routing_metadata: memset token_offsets");
  constexpr int kThreads = 256;
  const auto pair_blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(std::max<int64_t>(R, 1), kThreads), 1 << 16));
  const auto place_blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(std::max(R, T + 1), kThreads), 1 << 16));
  if (R > 0) {
    kernels::metadata_mark<<<pair_blocks, kThreads, 0, stream>>>(p);
    check_launch("routing_metadata: mark");
  }
  const int scan_threads = static_cast<int>(std::clamp<int64_t>(ceil_div(p.W, 32) * 32, 128, 512));
  kernels::metadata_scan<<<static_cast<unsigned>(E), scan_threads, 0, stream>>>(p);
  check_launch("routing_metadata: scan");
  // Also copies the duplicate flag into out.duplicate_flag (no memcpy node).
  kernels::metadata_place<<<place_blocks, kThreads, 0, stream>>>(p);
  check_launch("routing_metadata: place");
}

void aggregate(const void* rows, DType rows_dtype, const int32_t* pair_row,
               const int32_t* token_offsets, const float* scores, int64_t T, int64_t d, void* out,
               DType out_dtype, cudaStream_t stream) {
  constexpr const char* fn = "aggregate";
  require_arg(T >= 0 && T <= std::numeric_limits<int32_t>::max(), fn, "T", "must be in [0, 2^31)");
  require_arg(d >= 1, fn, "d", "must be >= 1, got " + std::to_string(d));
  if (T == 0) return;
  require_arg(token_offsets && out, fn, "token_offsets/out", "must not be null");
  kernels::AggregateParams p{rows, pair_row, token_offsets, scores, out, T, d};
  dispatch_dtypes(rows_dtype, out_dtype, [&](auto in_tag, auto out_tag) {
    using TIn = decltype(in_tag);
    using TOut = decltype(out_tag);
    constexpr int in_elems = kernels::Vec16<TIn>::kElems;
    constexpr bool out_fits = in_elems % kernels::Vec16<TOut>::kElems == 0;
    const bool vec = out_fits && d % in_elems == 0 && detail::aligned16(rows) && detail::aligned16(out) &&
                     d % kernels::Vec16<TOut>::kElems == 0;
    const int64_t work = vec ? d / in_elems : d;
    const int threads = static_cast<int>(std::clamp<int64_t>(ceil_div(work, 32) * 32, 32, 256));
    if constexpr (out_fits) {
      if (vec) {
        kernels::aggregate_rows_vec<TIn, TOut><<<static_cast<unsigned>(T), threads, 0, stream>>>(p);
        return;
      }
    }
    kernels::aggregate_rows_scalar<TIn, TOut><<<static_cast<unsigned>(T), threads, 0, stream>>>(p);
  });
  check_launch(fn);
}

}  // namespace machmoe
