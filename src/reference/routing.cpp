// CPU reference, routing half: top-K routing variants, token rounding, aux loss, and the routing
// metadata. double precision, plain loops: the executable form of docs/LAYER.md.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "machmoe/reference.hpp"

namespace machmoe::ref {
namespace {

void require(bool ok, const std::string& msg) {
  if (!ok) throw Error(ErrorCode::InvalidArgument, msg);
}

// Selection order: larger key first, NaN counts as the largest, ties to the lower index.
bool ranks_before(double ka, int64_t a, double kb, int64_t b) {
  const bool na = std::isnan(ka), nb = std::isnan(kb);
  if (na || nb) return na && nb ? a < b : na;
  return ka != kb ? ka > kb : a < b;
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Softmax of one row of logits [E].
std::vector<double> softmax_row(const double* l, int64_t E) {
  std::vector<double> p(E);
  double m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - m));
  for (auto& v : p) v /= sum;
  return p;
}

// Backward of y = softmax(z) restricted to `idx`: dz_i = y_i (g_i - Σ_j y_j g_j).
void softmax_backward(const std::vector<double>& y, const std::vector<double>& g, double* dz) {
  double dot = 0;
  for (size_t i = 0; i < y.size(); ++i) dot += y[i] * g[i];
  for (size_t i = 0; i < y.size(); ++i) dz[i] = y[i] * (g[i] - dot);
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

double gate(RoutingMethod method, double logit) {
  if (method == RoutingMethod::Sigmoid) return sigmoid(logit);
  // softplus as torch.nn.functional.softplus computes it (threshold 20: the identity above it)
  const double softplus = logit > 20.0 ? logit : std::log1p(std::exp(logit));
  return std::sqrt(softplus);
}

double gate_derivative(RoutingMethod method, double logit) {
  if (method == RoutingMethod::Sigmoid) {
    const double s = sigmoid(logit);
    return s * (1.0 - s);
  }
  // d sqrt(sp)/dl = sp'(l) / (2 sqrt(sp)), sp'(l) = σ(l) below the threshold, 1 above it
  const double d_softplus = logit > 20.0 ? 1.0 : sigmoid(logit);
  return d_softplus / (2.0 * gate(method, logit));
}

namespace {

void check_router_options(RoutingMethod method, int64_t E, int64_t K, const RouterOptions& o,
                          const double* selection_bias) {
  require(o.routed_scaling_factor > 0.0 && std::isfinite(o.routed_scaling_factor),
          "topk_route: routed_scaling_factor must be finite and > 0");
  require(selection_bias == nullptr || is_gate_routing(method),
          "topk_route: selection_bias is only used with routing=sigmoid or sqrt_softplus");
  require(o.n_group >= 1 && E % o.n_group == 0, "topk_route: n_group must be >= 1 and divide E");
  require(o.topk_group >= 1 && o.topk_group <= o.n_group, "topk_route: topk_group must be in [1, n_group]");
  if (o.n_group > 1) {
    require(is_gate_routing(method), "topk_route: group-limited selection (n_group > 1) needs a gate routing");
    require(E / o.n_group >= 2, "topk_route: group-limited selection needs >= 2 experts per group");
    require(K <= o.topk_group * (E / o.n_group), "topk_route: K must be <= topk_group * E / n_group");
  }
}

}  // namespace

std::vector<uint8_t> kept_groups(const double* key, int64_t E, const RouterOptions& o) {
  const int64_t G = o.n_group, S = E / G;
  std::vector<uint8_t> keep(G, 1);
  if (G == 1) return keep;
  // Group score: the sum of the group's two largest selection values (NaN ranks largest).
  std::vector<double> score(G);
  std::vector<int64_t> order(S);
  for (int64_t g = 0; g < G; ++g) {
    std::iota(order.begin(), order.end(), g * S);
    std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                      [&](int64_t a, int64_t b) { return ranks_before(key[a], a, key[b], b); });
    score[g] = key[order[0]] + key[order[1]];
  }
  std::vector<int64_t> groups(G);
  std::iota(groups.begin(), groups.end(), 0);
  std::partial_sort(groups.begin(), groups.begin() + o.topk_group, groups.end(),
                    [&](int64_t a, int64_t b) { return ranks_before(score[a], a, score[b], b); });
  std::fill(keep.begin(), keep.end(), 0);
  for (int64_t i = 0; i < o.topk_group; ++i) keep[groups[i]] = 1;
  return keep;
}

TopK topk_route(const double* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                bool renormalize, const double* selection_bias) {
  return topk_route(logits, T, E, K, method, renormalize, RouterOptions{}, selection_bias);
}

TopK topk_route(const double* logits, int64_t T, int64_t E, int64_t K, RoutingMethod method,
                bool renormalize, const RouterOptions& options, const double* selection_bias) {
  require(T >= 0 && E >= 1, "topk_route: need T >= 0 and E >= 1");
  require(K >= 1 && K <= E, "topk_route: K must be in [1, E]");
  check_router_options(method, E, K, options, selection_bias);
  const int64_t S = E / options.n_group;
  TopK r;
  r.T = T;
  r.K = K;
  r.expert.resize(T * K);
  r.score.resize(T * K);
  std::vector<int64_t> order(E);
  std::vector<double> key(E);
  for (int64_t t = 0; t < T; ++t) {
    const double* l = logits + t * E;
    for (int64_t e = 0; e < E; ++e) {
      key[e] = l[e];
      if (is_gate_routing(method)) key[e] = gate(method, l[e]) + (selection_bias ? selection_bias[e] : 0.0);
    }
    // Group-limited selection: the experts of dropped groups are out of the selection (as a
    // selection value of -inf would be; K <= topk_group * S leaves enough kept experts).
    const auto keep = kept_groups(key.data(), E, options);
    order.clear();
    for (int64_t e = 0; e < E; ++e)
      if (keep[e / S]) order.push_back(e);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int64_t a, int64_t b) { return ranks_before(key[a], a, key[b], b); });
    double* s = r.score.data() + t * K;
    for (int64_t k = 0; k < K; ++k) r.expert[t * K + k] = static_cast<int32_t>(order[k]);
    if (method == RoutingMethod::SoftmaxTopK ||
        (method == RoutingMethod::TopKSoftmax && renormalize)) {
      // softmax over the K selected logits (= renormalised top-K of the full softmax)
      std::vector<double> sel(K);
      for (int64_t k = 0; k < K; ++k) sel[k] = l[order[k]];
      const auto p = softmax_row(sel.data(), K);
      std::copy(p.begin(), p.end(), s);
    } else if (method == RoutingMethod::TopKSoftmax) {
      const auto p = softmax_row(l, E);
      for (int64_t k = 0; k < K; ++k) s[k] = p[order[k]];
    } else {  // gate routings
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += (s[k] = gate(method, l[order[k]]));
      if (renormalize)
        for (int64_t k = 0; k < K; ++k) s[k] /= sum;
    }
    for (int64_t k = 0; k < K; ++k) s[k] *= options.routed_scaling_factor;
  }
  return r;
}

std::vector<double> topk_route_backward(const double* logits, int64_t T, int64_t E,
                                        RoutingMethod method, bool renormalize, const TopK& topk,
                                        const double* d_score) {
  return topk_route_backward(logits, T, E, method, renormalize, RouterOptions{}, topk, d_score);
}

std::vector<double> topk_route_backward(const double* logits, int64_t T, int64_t E,
                                        RoutingMethod method, bool renormalize, const RouterOptions& options,
                                        const TopK& topk, const double* d_score) {
  const int64_t K = topk.K;
  const double c = options.routed_scaling_factor;
  std::vector<double> dl(T * E, 0.0);
  std::vector<double> y(K), g(K), dz(K);
  for (int64_t t = 0; t < T; ++t) {
    const double* l = logits + t * E;
    const int32_t* ex = topk.expert.data() + t * K;
    const double* s = topk.score.data() + t * K;
    double* d = dl.data() + t * E;
    // s = c · s0: the gradient into the unscaled scores s0 is c · d_score
    for (int64_t k = 0; k < K; ++k) g[k] = c * d_score[t * K + k];
    for (int64_t k = 0; k < K; ++k) y[k] = s[k] / c;
    if (method == RoutingMethod::SoftmaxTopK ||
        (method == RoutingMethod::TopKSoftmax && renormalize)) {
      softmax_backward(y, g, dz.data());
      for (int64_t k = 0; k < K; ++k) d[ex[k]] += dz[k];
    } else if (method == RoutingMethod::TopKSoftmax) {
      // s_k = p_{e_k} with p = softmax over all E: dl_j = Σ_k g_k p_{e_k} (δ - p_j)
      const auto p = softmax_row(l, E);
      double dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += g[k] * p[ex[k]];
      for (int64_t j = 0; j < E; ++j) d[j] -= p[j] * dot;
      for (int64_t k = 0; k < K; ++k) d[ex[k]] += g[k] * p[ex[k]];
    } else {  // gate routings: s_k = g_k (/ Σ g when renormalised), g_k = gate(l_k)
      std::vector<double> sg(K), dsg(K);
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += (sg[k] = gate(method, l[ex[k]]));
      if (renormalize) {
        double dot = 0;
        for (int64_t k = 0; k < K; ++k) dot += g[k] * sg[k];
        for (int64_t k = 0; k < K; ++k) dsg[k] = g[k] / sum - dot / (sum * sum);
      } else {
        dsg = g;
      }
      for (int64_t k = 0; k < K; ++k) d[ex[k]] += dsg[k] * gate_derivative(method, l[ex[k]]);
    }
  }
  return dl;
}

RoutingList to_list(const TopK& topk) {
  RoutingList r;
  r.expert = topk.expert;
  r.score = topk.score;
  r.token.resize(topk.T * topk.K);
  for (int64_t p = 0; p < topk.T * topk.K; ++p) r.token[p] = static_cast<int32_t>(p / topk.K);
  return r;
}

double stochastic_uniform(uint64_t seed, int64_t e) {
  const uint64_t z = splitmix64(seed ^ (static_cast<uint64_t>(e) * 0x9E3779B97F4A7C15ull));
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

TokenRoundingResult token_round(const double* logits, int64_t T, int64_t E, int64_t K,
                                const TokenRoundingOptions& opt) {
  require(opt.tile_m >= 1, "token_round: tile_m must be >= 1");
  require(opt.mode != TokenRounding::None, "token_round: mode must not be None");
  TokenRoundingResult r;
  r.topk = topk_route(logits, T, E, K, RoutingMethod::SoftmaxTopK, true, nullptr);
  const int64_t M = opt.tile_m;
  // selected_rank[t*E+e] = k if token t picked e as its k-th choice, else -1
  std::vector<int64_t> selected_rank(T * E, -1);
  r.count_topk.assign(E, 0);
  for (int64_t p = 0; p < T * K; ++p) {
    selected_rank[(p / K) * E + r.topk.expert[p]] = p % K;
    ++r.count_topk[r.topk.expert[p]];
  }
  std::vector<double> P(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const auto p = softmax_row(logits + t * E, E);
    std::copy(p.begin(), p.end(), P.begin() + t * E);
  }
  r.count_rounded.assign(E, 0);
  std::vector<uint8_t> kept(T * E, 0);
  std::vector<int64_t> order(T);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t f = r.count_topk[e], lo = (f / M) * M, hi = lo + (f % M ? M : 0);
    int64_t target = f;
    switch (opt.mode) {
      case TokenRounding::Nearest: target = ((f + M / 2) / M) * M; break;
      case TokenRounding::Up: target = hi; break;
      case TokenRounding::Down: target = lo; break;
      case TokenRounding::Stochastic:
        target = stochastic_uniform(opt.seed, e) < static_cast<double>(f % M) / M ? hi : lo;
        break;
      case TokenRounding::None: break;
    }
    target = std::clamp<int64_t>(target, 0, T);
    r.count_rounded[e] = target;
    // Selected tokens first, by top-K score; then the rest by softmax probability.
    auto sel_score = [&](int64_t t) { return r.topk.score[t * K + selected_rank[t * E + e]]; };
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const bool sa = selected_rank[a * E + e] >= 0, sb = selected_rank[b * E + e] >= 0;
      if (sa != sb) return sa;
      return sa ? ranks_before(sel_score(a), a, sel_score(b), b)
                : ranks_before(P[a * E + e], a, P[b * E + e], b);
    });
    for (int64_t i = 0; i < target; ++i) kept[order[i] * E + e] = 1;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      if (!kept[t * E + e]) continue;
      const int64_t k = selected_rank[t * E + e];
      r.list.token.push_back(static_cast<int32_t>(t));
      r.list.expert.push_back(static_cast<int32_t>(e));
      r.list.score.push_back(k >= 0 ? r.topk.score[t * K + k] : P[t * E + e]);
      r.padded.push_back(k < 0 ? 1 : 0);
    }
  return r;
}

std::vector<double> token_round_backward(const double* logits, int64_t T, int64_t E,
                                         const TokenRoundingResult& tr, const double* d_score) {
  const int64_t K = tr.topk.K;
  // Selected pairs: gradient into the token's top-K scores (dropped ranks get none).
  std::vector<double> d_topk(T * K, 0.0);
  std::vector<double> d_prob(T * E, 0.0);  // padded pairs: gradient into P[t, e]
  for (int64_t p = 0; p < tr.list.size(); ++p) {
    const int64_t t = tr.list.token[p], e = tr.list.expert[p];
    if (tr.padded[p]) {
      d_prob[t * E + e] += d_score[p];
      continue;
    }
    for (int64_t k = 0; k < K; ++k)
      if (tr.topk.expert[t * K + k] == e) d_topk[t * K + k] += d_score[p];
  }
  auto dl = topk_route_backward(logits, T, E, RoutingMethod::SoftmaxTopK, true, tr.topk,
                                d_topk.data());
  std::vector<double> g(E), dz(E);
  for (int64_t t = 0; t < T; ++t) {
    const auto P = softmax_row(logits + t * E, E);
    g.assign(d_prob.begin() + t * E, d_prob.begin() + (t + 1) * E);
    softmax_backward(P, g, dz.data());
    for (int64_t e = 0; e < E; ++e) dl[t * E + e] += dz[e];
  }
  return dl;
}

double aux_loss(const double* logits, int64_t T, int64_t E, const int32_t* expert, int64_t R) {
  if (T == 0 || R == 0) return 0.0;
  std::vector<double> acc(E, 0.0), freq(E, 0.0);
  double acc_sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    const auto p = softmax_row(logits + t * E, E);
    for (int64_t e = 0; e < E; ++e) acc[e] += p[e], acc_sum += p[e];
  }
  for (int64_t i = 0; i < R; ++i) freq[expert[i]] += 1.0;
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) loss += (acc[e] / acc_sum) * (freq[e] / R);
  return E * loss;
}

void aux_loss_backward(const double* logits, int64_t T, int64_t E, const int32_t* expert,
                       int64_t R, double d_aux, double* d_logits) {
  if (T == 0 || R == 0) return;
  std::vector<std::vector<double>> P(T);
  std::vector<double> acc(E, 0.0), freq(E, 0.0);
  double S = 0;
  for (int64_t t = 0; t < T; ++t) {
    P[t] = softmax_row(logits + t * E, E);
    for (int64_t e = 0; e < E; ++e) acc[e] += P[t][e], S += P[t][e];
  }
  for (int64_t i = 0; i < R; ++i) freq[expert[i]] += 1.0;
  // aux = E Σ_e (acc_e / S) w_e with w_e = freq_e / R and S = Σ acc: ∂aux/∂acc_j = E (w_j/S − Σ_e acc_e w_e / S²)
  double aw = 0;
  for (int64_t e = 0; e < E; ++e) aw += acc[e] * freq[e] / R;
  std::vector<double> g(E), dz(E);
  for (int64_t e = 0; e < E; ++e) g[e] = d_aux * E * (freq[e] / R / S - aw / (S * S));
  for (int64_t t = 0; t < T; ++t) {
    softmax_backward(P[t], g, dz.data());
    for (int64_t e = 0; e < E; ++e) d_logits[t * E + e] += dz[e];
  }
}

Metadata build_metadata(const RoutingList& list, int64_t T, int64_t E) {
  const int64_t R = list.size();
  require(static_cast<int64_t>(list.expert.size()) == R && static_cast<int64_t>(list.score.size()) == R,
          "build_metadata: token, expert and score lists must have the same length");
  Metadata md;
  md.expert_offsets.assign(E + 1, 0);
  md.token_offsets.assign(T + 1, 0);
  for (int64_t p = 0; p < R; ++p) {
    const int64_t t = list.token[p], e = list.expert[p];
    require(t >= 0 && t < T, "build_metadata: token index " + std::to_string(t) + " at pair " +
                                 std::to_string(p) + " is outside [0, T=" + std::to_string(T) + ")");
    require(e >= 0 && e < E, "build_metadata: expert index " + std::to_string(e) + " at pair " +
                                 std::to_string(p) + " is outside [0, E=" + std::to_string(E) + ")");
    require(p == 0 || list.token[p - 1] <= t,
            "build_metadata: pairs must be ordered by token (pair " + std::to_string(p) + ")");
    ++md.expert_offsets[e + 1];
    ++md.token_offsets[t + 1];
  }
  for (int64_t e = 0; e < E; ++e) md.expert_offsets[e + 1] += md.expert_offsets[e];
  for (int64_t t = 0; t < T; ++t) md.token_offsets[t + 1] += md.token_offsets[t];
  md.row_pair.resize(R);
  md.row_token.resize(R);
  md.pair_row.resize(R);
  // Stable counting sort by expert: pairs are ordered by token, so each expert keeps token order.
  std::vector<int64_t> cursor(md.expert_offsets.begin(), md.expert_offsets.end() - 1);
  for (int64_t p = 0; p < R; ++p) {
    const int64_t row = cursor[list.expert[p]]++;
    md.row_pair[row] = static_cast<int32_t>(p);
    md.row_token[row] = list.token[p];
    md.pair_row[p] = static_cast<int32_t>(row);
  }
  return md;
}

}  // namespace machmoe::ref
