// The top-K router. logits [T, E] fp32 -> scores [T, K] fp32 and
// experts [T, K] int32, for the routing variants of docs/LAYER.md, and its backward
// d_scores [T, K] -> d_logits [T, E].
// Gate routings (sigmoid, sqrt-softplus) score each expert by a gate g(logit); scores are
// multiplied by the routed scaling factor last; group-limited selection (gate routings only) runs
// in both kernels.
//
// One warp per token. Selection is K rounds of a warp-wide max over 64-bit keys (value, then lower
// index; see common.cuh); round k takes the best key strictly below round k-1's winner, so nothing
// has to be marked as taken and ties resolve exactly as the reference does.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common.cuh"

namespace machmoe::kernels {

// Values >= kSigmoid are the gate routings.
enum RouterMethod : int { kSoftmaxTopK = 0, kTopKSoftmax = 1, kSigmoid = 2, kSqrtSoftplus = 3 };

struct RouterParams {
  const float* logits;          // [T, E]
  const float* selection_bias;  // [E] or null (gate routings only)
  float* scores;                // [T, K]
  int32_t* experts;             // [T, K]
  float* aux_partials;          // [ceil(T / 64), E] column sums of softmax(logits), or null
  int64_t T;
  int E, K;
  int method;
  bool renormalize;
  float scale;              // routed scaling factor (1: none)
  int n_group, topk_group;  // group-limited selection (n_group = 1: none)
};

__device__ __forceinline__ float sigmoidf_(float v) { return 1.f / (1.f + __expf(-v)); }

// sqrt(softplus(v)), softplus as torch's: the identity above 20, else log(1 + e^v).
__device__ __forceinline__ float sqrt_softplusf_(float v) { return sqrtf(v > 20.f ? v : log1pf(__expf(v))); }

__device__ __forceinline__ float router_gate(int method, float v) {
  return method == kSigmoid ? sigmoidf_(v) : sqrt_softplusf_(v);
}

// d gate / d logit: σ(1 - σ), or softplus'(v) / (2 sqrt(softplus(v))) with softplus' = σ (1 above 20).
__device__ __forceinline__ float router_gate_derivative(int method, float v) {
  if (method == kSigmoid) {
    const float sg = sigmoidf_(v);
    return sg * (1.f - sg);
  }
  return (v > 20.f ? 1.f : sigmoidf_(v)) / (2.f * sqrt_softplusf_(v));
}

__device__ __forceinline__ float router_selection_value(const RouterParams& p, float logit, int e) {
  return p.method >= kSigmoid ? router_gate(p.method, logit) + (p.selection_bias ? p.selection_bias[e] : 0.f)
                              : logit;
}

// Turns the selected logits into scores. Lane k < K holds the k-th selected logit `l` (K <= 32);
// `row_max` and `row_sum` describe the full softmax (used by top-K over softmax without
// renormalisation only). Returns lane k's score, times the routed scaling factor (× 1 is exact).
__device__ __forceinline__ float router_score(const RouterParams& p, int lane, float l, float row_max,
                                              float row_sum) {
  const bool mine = lane < p.K;
  if (p.method >= kSigmoid) {
    const float s = mine ? router_gate(p.method, l) : 0.f;
    return (p.renormalize ? s / warp_sum(s) : s) * p.scale;
  }
  if (p.method == kTopKSoftmax && !p.renormalize) return (mine ? __expf(l - row_max) / row_sum : 0.f) * p.scale;
  // softmax over the K selected logits (= renormalised top-K of the full softmax)
  const float m = warp_max(mine ? l : -INFINITY);
  const float e = mine ? __expf(l - m) : 0.f;
  return e / warp_sum(e) * p.scale;
}

// Fast path: the row lives in registers, V values per lane (E <= 32 * V), K <= 32.
template <int V>
__global__ void __launch_bounds__(256) topk_router_registers(RouterParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = global_warp_index();
  if (t >= p.T) return;
  const float* row = p.logits + t * p.E;
  float value[V];  // selection value of expert lane + 32 j
  float local_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + kWarpSize * j;
    const float l = e < p.E ? row[e] : -INFINITY;
    local_max = fmaxf(local_max, l);
    value[j] = e < p.E ? router_selection_value(p, l, e) : 0.f;
  }
  int my_expert = 0;
  uint64_t prev = ~0ull;
  for (int k = 0; k < p.K; ++k) {
    uint64_t best = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + kWarpSize * j;
      const uint64_t key = e < p.E ? selection_key(value[j], e) : 0;
      if (key < prev && key > best) best = key;
    }
    prev = warp_max_u64(best);
    if (lane == k) my_expert = key_index(prev);
  }
  const float l = lane < p.K ? row[my_expert] : 0.f;
  float row_max = 0.f, row_sum = 1.f;
  if (p.method == kTopKSoftmax && !p.renormalize) {
    row_max = warp_max(local_max);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + kWarpSize * j;
      if (e < p.E) s += __expf(row[e] - row_max);
    }
    row_sum = warp_sum(s);
  }
  const float score = router_score(p, lane, l, row_max, row_sum);
  if (lane < p.K) {
    p.scores[t * p.K + lane] = score;
    p.experts[t * p.K + lane] = my_expert;
  }
}

// Group-limited selection of one token (n_group <= 32 groups of S = E / n_group consecutive
// experts): lane g scores group g by the sum of its two largest selection values (larger key
// first, as the selection compares), then topk_group rounds of a warp max pick the kept groups
// (ties to the lower group). Returns the kept groups as a bit mask, the same in every lane.
__device__ __forceinline__ uint32_t router_kept_groups(const RouterParams& p, const float* row, int lane) {
  const int S = p.E / p.n_group;
  uint64_t first = 0, second = 0;
  float v1 = 0.f, v2 = 0.f;
  if (lane < p.n_group) {
    for (int e = lane * S; e < (lane + 1) * S; ++e) {
      const float v = router_selection_value(p, row[e], e);
      const uint64_t key = selection_key(v, e);
      if (key > first) {
        second = first, v2 = v1;
        first = key, v1 = v;
      } else if (key > second) {
        second = key, v2 = v;
      }
    }
  }
  const uint64_t group_key = lane < p.n_group ? selection_key(v1 + v2, lane) : 0;
  uint32_t kept = 0;
  uint64_t prev = ~0ull;
  for (int i = 0; i < p.topk_group; ++i) {
    prev = warp_max_u64(group_key < prev ? group_key : 0);
    kept |= 1u << key_index(prev);
  }
  return kept;
}

// Whether the groups of a group-limited selection align with the sorted kernel's registers (expert
// lane + 32·j in lane's slot j): S = E / n_group divides 32 (a group is S consecutive lanes of one
// slot) or is a multiple of 32 (S / 32 consecutive slots of the whole warp).
__device__ __forceinline__ bool router_groups_in_lanes(int E, int n_group) {
  const int S = E / n_group;
  return (S <= kWarpSize && kWarpSize % S == 0) || S % kWarpSize == 0;
}

// (a1 >= a2) merged with (b1 >= b2): the two largest of the four, in (a1, a2). NaN counts as the
// largest value, as selection_key orders it, so a group holding a NaN keeps a NaN score and is
// kept first (as router_kept_groups does), and the token's output shows it.
__device__ __forceinline__ float router_nan_max(float a, float b) { return b != b || b > a ? b : a; }
__device__ __forceinline__ float router_nan_min(float a, float b) { return b != b || b > a ? a : b; }
__device__ __forceinline__ void router_top2_merge(float& a1, float& a2, float b1, float b2) {
  const float hi = router_nan_max(a1, b1), lo = router_nan_max(router_nan_min(a1, b1), router_nan_max(a2, b2));
  a1 = hi, a2 = lo;
}

// router_kept_groups from the registers of topk_router_sorted, where router_groups_in_lanes: every
// group's two largest selection values by a butterfly over its lanes (and slots), then
// topk_group rounds of two REDUX each over the groups' keys (lane g holding group g's). The same
// mask as router_kept_groups: the score is the sum of the two largest values (larger first), ties
// go to the lower group. Without the shared-memory row and the serial scan of 8 lanes.
template <int V>
__device__ __forceinline__ uint32_t router_kept_groups_lanes(const RouterParams& p, const float (&cur)[V], int lane) {
  const int S = p.E / p.n_group;
  const int span = S < kWarpSize ? S : kWarpSize;        // lanes of a group in one slot
  const int group_slots = S > kWarpSize ? S / kWarpSize : 1;  // slots of a group
  // Lane g < n_group takes group g's score: from slot g·S / 32 at lane g·S % 32 (S <= 32), or
  // from the last of its slots, where every lane holds it (S > 32). A shuffle in both cases: a
  // plain select of a per-slot value would become a local-memory load at a lane-dependent index.
  const int my_slot = S <= kWarpSize ? lane * S / kWarpSize : (lane + 1) * group_slots - 1;
  const int src = S <= kWarpSize ? (lane * S) % kWarpSize : lane;
  float mine = 0.f;
  float top1 = -INFINITY, top2 = -INFINITY;  // the two largest values of the slot's group so far
#pragma unroll
  for (int j = 0; j < V; ++j) {  // one slot at a time: few live registers beside the caller's
    const int e = lane + kWarpSize * j;
    if (j % group_slots == 0) top1 = -INFINITY, top2 = -INFINITY;  // a new group (uniform)
    router_top2_merge(top1, top2, e < p.E ? router_selection_value(p, cur[j], e) : -INFINITY, -INFINITY);
    if (j % group_slots != group_slots - 1) continue;  // the group goes on in the next slot (uniform)
    float t1 = top1, t2 = top2;
#pragma unroll
    for (int off = kWarpSize / 2; off >= 1; off /= 2) {
      if (off >= span) continue;  // uniform
      const float b1 = __shfl_xor_sync(kFullMask, t1, off), b2 = __shfl_xor_sync(kFullMask, t2, off);
      router_top2_merge(t1, t2, b1, b2);
    }
    const float score = __shfl_sync(kFullMask, t1 + t2, src);
    if (j == my_slot) mine = score;
  }
  const uint64_t key = lane < p.n_group ? selection_key(mine, lane) : 0;
  uint32_t kept = 0;
  bool taken = false;
  for (int i = 0; i < p.topk_group; ++i) {
    const uint32_t hi = taken ? 0u : static_cast<uint32_t>(key >> 32);
    const uint32_t best_hi = __reduce_max_sync(kFullMask, hi);
    const uint32_t best_lo = __reduce_max_sync(kFullMask, !taken && hi == best_hi ? static_cast<uint32_t>(key) : 0u);
    const uint64_t best = (static_cast<uint64_t>(best_hi) << 32) | best_lo;
    taken = taken || key == best;
    kept |= 1u << key_index(best);
  }
  return kept;
}

// Fast path for E <= 32 * kRouterSortedMaxV: each lane sorts its V candidate keys once, so that a
// selection round is two warp reductions (REDUX) over the lanes' heads and a shift in the winning
// lane, instead of a rescan of V keys plus a 64-bit shuffle tree per round (which leaves the
// selection bound by instruction issue). A block takes kRouterBlockTokens consecutive tokens, 4
// per warp in order, with the next token's logits loaded while this one is selected; with
// aux_partials it also writes the aux loss's column sums of softmax(logits) over its tokens
// (partials [blocks, E]; fixed order, so deterministic), which saves the aux loss a second pass
// over the logits and a launch.
constexpr int kRouterSortedMaxV = 8;
constexpr int kRouterBlockTokens = 64;
constexpr int kRouterBlockWarps = 16;  // 4 tokens per warp: enough warps per SM to hide the loads

template <int V>
__global__ void __launch_bounds__(kRouterBlockWarps * kWarpSize) topk_router_sorted(RouterParams p) {
  constexpr int kTokensPerWarp = kRouterBlockTokens / kRouterBlockWarps;
  __shared__ float red[kRouterBlockWarps][V * kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRouterBlockTokens + warp * kTokensPerWarp;
  const bool full_softmax = p.method == kTopKSoftmax && !p.renormalize;
  auto load = [&](int64_t t, float (&v)[V]) {
    const float* row = p.logits + t * p.E;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + kWarpSize * j;
      v[j] = e < p.E ? row[e] : -INFINITY;
    }
  };
  float acc[V] = {};  // this lane's experts: Σ over the warp's tokens of softmax(logits)
  float cur[V];
  if (t0 < p.T) load(t0, cur);
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const int64_t t = t0 + i;
    if (t >= p.T) break;  // warp-uniform
    float nxt[V];
    const bool more = i + 1 < kTokensPerWarp && t + 1 < p.T;
    if (more) load(t + 1, nxt);
    // Group-limited selection: from the registers where the groups align with the lanes, else
    // through this warp's shared-memory row (the group scores read a group's S consecutive
    // experts, which live in other lanes' registers); the experts of dropped groups get key 0, as
    // padding, which no round selects while K <= topk_group·S (checked on the host).
    const bool grouped = p.n_group > 1;  // uniform over the grid
    uint32_t kept = ~0u;
    if (grouped && router_groups_in_lanes(p.E, p.n_group)) {
      kept = router_kept_groups_lanes<V>(p, cur, lane);
    } else if (grouped) {
#pragma unroll
      for (int j = 0; j < V; ++j) red[warp][lane + kWarpSize * j] = cur[j];
      __syncwarp();
      kept = router_kept_groups(p, red[warp], lane);
      __syncwarp();  // the row is rewritten for the next token
    }
    const int group_size = p.E / p.n_group;
    uint64_t key[V];  // descending after the sort; 0 (below every real key) pads
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = lane + kWarpSize * j;
      const bool selectable = e < p.E && (!grouped || ((kept >> (e / group_size)) & 1u));
      key[j] = selectable ? selection_key(router_selection_value(p, cur[j], e), e) : 0;
    }
#pragma unroll
    for (int pass = 0; pass < V; ++pass)  // odd-even transposition sort
#pragma unroll
      for (int j = pass & 1; j + 1 < V; j += 2)
        if (key[j] < key[j + 1]) {
          const uint64_t x = key[j];
          key[j] = key[j + 1];
          key[j + 1] = x;
        }
    int my_expert = 0;
    for (int k = 0; k < p.K; ++k) {
      // The warp's largest head: the largest high word, then among those the largest low word.
      const uint32_t hi = static_cast<uint32_t>(key[0] >> 32);
      const uint32_t best_hi = __reduce_max_sync(kFullMask, hi);
      const uint32_t best_lo = __reduce_max_sync(kFullMask, hi == best_hi ? static_cast<uint32_t>(key[0]) : 0u);
      const uint64_t best = (static_cast<uint64_t>(best_hi) << 32) | best_lo;
      if (key[0] == best) {  // keys are unique: one lane
#pragma unroll
        for (int j = 0; j + 1 < V; ++j) key[j] = key[j + 1];
        key[V - 1] = 0;
      }
      if (lane == k) my_expert = key_index(best);
    }
    float row_max = 0.f, row_sum = 1.f;
    if (full_softmax || p.aux_partials) {  // softmax(logits) over all E, as warp_softmax_stats
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (lane + kWarpSize * j < p.E) m = fmaxf(m, cur[j]);
      row_max = warp_max(m);
      float ex[V], s = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        ex[j] = lane + kWarpSize * j < p.E ? __expf(cur[j] - row_max) : 0.f;
        s += ex[j];
      }
      row_sum = warp_sum(s);
      const float inv = 1.f / row_sum;
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += ex[j] * inv;
    }
    const float l = lane < p.K ? p.logits[t * p.E + my_expert] : 0.f;
    const float score = router_score(p, lane, l, row_max, row_sum);
    if (lane < p.K) {
      p.scores[t * p.K + lane] = score;
      p.experts[t * p.K + lane] = my_expert;
    }
    if (!more) break;
#pragma unroll
    for (int j = 0; j < V; ++j) cur[j] = nxt[j];
  }
  if (p.aux_partials == nullptr) return;  // uniform over the block
#pragma unroll
  for (int j = 0; j < V; ++j) red[warp][lane + kWarpSize * j] = acc[j];
  __syncthreads();
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kRouterBlockWarps; ++w) s += red[w][e];
    p.aux_partials[static_cast<int64_t>(blockIdx.x) * p.E + e] = s;
  }
}

// General path: any E and K, and group-limited selection. Each round rescans the row from global
// memory (L1/L2 hits); the selected logits are parked in `scores` and normalised in a final pass.
// The experts of dropped groups are left out of every round (as transformers' -inf fill does).
__global__ void __launch_bounds__(256) topk_router_general(RouterParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = global_warp_index();
  if (t >= p.T) return;
  const float* row = p.logits + t * p.E;
  float* out_s = p.scores + t * p.K;
  int32_t* out_e = p.experts + t * p.K;
  const bool grouped = p.n_group > 1;
  const uint32_t kept = grouped ? router_kept_groups(p, row, lane) : ~0u;
  const int group_size = p.E / p.n_group;
  uint64_t prev = ~0ull;
  for (int k = 0; k < p.K; ++k) {
    uint64_t best = 0;
    for (int e = lane; e < p.E; e += kWarpSize) {
      if (grouped && !((kept >> (e / group_size)) & 1u)) continue;
      const uint64_t key = selection_key(router_selection_value(p, row[e], e), e);
      if (key < prev && key > best) best = key;
    }
    prev = warp_max_u64(best);
    if (lane == 0) {
      out_e[k] = key_index(prev);
      out_s[k] = row[key_index(prev)];
    }
  }
  __syncwarp();
  // Normalisation constants over the K selected logits (or the full row), then the scores.
  float m = 0.f, sum = 0.f;
  const bool full_softmax = p.method == kTopKSoftmax && !p.renormalize;
  if (p.method < kSigmoid) {
    const SoftmaxStats st = full_softmax ? warp_softmax_stats(row, p.E, lane) : warp_softmax_stats(out_s, p.K, lane);
    m = st.max;
    sum = st.sum;
  } else {
    for (int i = lane; i < p.K; i += kWarpSize) sum += router_gate(p.method, out_s[i]);
    sum = warp_sum(sum);
  }
  __syncwarp();
  for (int k = lane; k < p.K; k += kWarpSize) {
    const float l = out_s[k];
    float s;
    if (p.method >= kSigmoid) s = p.renormalize ? router_gate(p.method, l) / sum : router_gate(p.method, l);
    else s = __expf(l - m) / sum;
    out_s[k] = s * p.scale;
  }
}

struct RouterBackwardParams {
  const float* logits;    // [T, E]
  const float* scores;    // [T, K] from the forward
  const int32_t* experts; // [T, K]
  const float* d_scores;  // [T, K]
  float* d_logits;        // [T, E], every element written
  __nv_bfloat16* d_logits_bf16;  // [T, E] bf16 copy of d_logits, or null (the router GEMMs' operand)
  int64_t T;
  int E, K;
  int method;
  bool renormalize;
  float scale;  // routed scaling factor: the saved scores carry it
};

// One warp per token: writes the whole d_logits row (zeros where the Jacobian is zero), then the
// lanes of the selected experts add their terms (distinct experts: no two lanes share a column).
__global__ void __launch_bounds__(256) topk_router_backward(RouterBackwardParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = global_warp_index();
  if (t >= p.T) return;
  const float* row = p.logits + t * p.E;
  float* drow = p.d_logits + t * p.E;
  const float* s = p.scores + t * p.K;
  const float* g = p.d_scores + t * p.K;
  const int32_t* ex = p.experts + t * p.K;
  const bool full_softmax = p.method == kTopKSoftmax && !p.renormalize;
  // Σ_k s_k g_k (softmax kinds) or, for the gate routings, the pieces of the renormalisation.
  // With the routed scaling factor c the saved scores are c·s, and the gate routings' gradient
  // into the unscaled scores is c·g.
  const bool gated = p.method >= kSigmoid;
  float dot = 0.f, sig_sum = 0.f, sig_dot = 0.f;
  for (int k = lane; k < p.K; k += kWarpSize) {
    dot += s[k] * g[k];
    if (gated) {
      const float sg = router_gate(p.method, row[ex[k]]);
      sig_sum += sg;
      sig_dot += sg * (g[k] * p.scale);
    }
  }
  dot = warp_sum(dot);
  sig_sum = warp_sum(sig_sum);
  sig_dot = warp_sum(sig_dot);
  SoftmaxStats st{0.f, 1.f};
  if (full_softmax) st = warp_softmax_stats(row, p.E, lane);
  const float row_max = st.max, row_sum = st.sum;
  // With d_logits_bf16, each write also goes to the bf16 copy (the second write of a selected
  // column after the __syncwarp, so the copy holds the final value).
  __nv_bfloat16* brow = p.d_logits_bf16 ? p.d_logits_bf16 + t * p.E : nullptr;
  for (int e = lane; e < p.E; e += kWarpSize) {
    const float v = full_softmax ? -(__expf(row[e] - row_max) / row_sum) * dot : 0.f;
    drow[e] = v;
    if (brow) brow[e] = __float2bfloat16_rn(v);
  }
  __syncwarp();
  for (int k = lane; k < p.K; k += kWarpSize) {
    const int e = ex[k];
    float d;
    if (gated) {
      const float gk = g[k] * p.scale;
      const float dsg = p.renormalize ? gk / sig_sum - sig_dot / (sig_sum * sig_sum) : gk;
      if (p.method == kSigmoid) {
        const float sg = sigmoidf_(row[e]);
        d = dsg * sg * (1.f - sg);  // this order of products, as before the other gates came
      } else {
        d = dsg * router_gate_derivative(p.method, row[e]);
      }
    } else if (full_softmax) {
      d = g[k] * s[k];  // added to the -p_e·dot already written (both carry c already)
    } else {
      d = s[k] * (g[k] - dot / p.scale);  // c·s (g - Σ s g): s, dot carry c
    }
    const float v = drow[e] + d;
    drow[e] = v;
    if (brow) brow[e] = __float2bfloat16_rn(v);
  }
}

}  // namespace machmoe::kernels
