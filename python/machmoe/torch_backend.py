"""The `torch` backend: docs/LAYER.md written in plain, autograd-differentiable PyTorch.

It runs on the CPU and on GPUs, in any float dtype, and is the independent float64 check of the
C++ CPU reference (tests/python/test_reference_matrix.py). It is written from LAYER.md alone.

Precision: the expert GEMMs and activations run in the input dtype. Routing math (router GEMM,
sigmoid, softmax, scores, aux loss) and the weighted sum over a token's experts run in the
"routing dtype": float32 for half inputs, float64 for float64 inputs. The router GEMM is part of
routing on purpose: rounding logits to bf16 would let the rounding decide which expert a token
gets, which no fp32-accumulating kernel does.

Arguments are assumed valid; `machmoe.functional` validates them before calling in here.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from .enums import (
    ActivationType,
    GateUpLayout,
    GluClamp,
    RoutingMethod,
    TokenRounding,
    is_gate_routing,
    is_glu,
    parse_enum,
    resolve_glu_clamp,
)

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half inputs, float64 for float64: the dtype of logits, scores and aux."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------- exact ordering


def _descending_order(keys: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Indices sorting `keys` in descending order along `dim`, as LAYER.md compares: NaN above
    every number (+inf included), equal keys in ascending index order. Two stable sorts make the
    order lexicographic in (is NaN, value, index); nothing relies on how torch.sort treats NaN.
    """
    keys = keys.detach()
    nan = torch.isnan(keys)
    # `+ 0.0` turns -0.0 into +0.0, so that a bitwise (radix) sort also sees them as equal.
    by_value = torch.where(nan, torch.full_like(keys, float("inf")), keys + 0.0)
    order = torch.sort(by_value, dim=dim, descending=True, stable=True).indices
    nan_first = torch.sort(nan.gather(dim, order).to(torch.uint8), dim=dim, descending=True,
                           stable=True).indices
    return order.gather(dim, nan_first)


# ---------------------------------------------------------------- routing


def router_logits(x: torch.Tensor, router_weight: torch.Tensor,
                  router_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [T, E] = x [T, d] · router_weight [E, d]ᵀ (+ router_bias [E]), in the routing dtype."""
    dtype = routing_dtype(x.dtype)
    bias = None if router_bias is None else router_bias.to(dtype)
    return F.linear(x.to(dtype), router_weight.to(dtype), bias)


class RouterOptions(NamedTuple):
    """The router's options beyond the method (LAYER.md "Routing"); the defaults leave them off."""

    routed_scaling_factor: float = 1.0  # scores × this after renormalisation
    n_group: int = 1  # group-limited selection: E experts in n_group groups (gate routings)
    topk_group: int = 1  # groups kept


def gate(logits: torch.Tensor, method: RoutingMethod) -> torch.Tensor:
    """The gate routings' per-expert score: sigmoid(logit), or sqrt(softplus(logit)) with
    torch's softplus (the identity above 20)."""
    if method == RoutingMethod.SIGMOID:
        return torch.sigmoid(logits)
    return F.softplus(logits).sqrt()


def _kept_group_experts(key: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Group-limited selection: [T, E] bool, True for the experts of each token's topk_group best
    groups. A group's score is the sum of its two largest selection keys (as LAYER.md orders
    them), groups rank by score with ties to the lower group."""
    T, E = key.shape
    grouped = key.detach().reshape(T, n_group, E // n_group)  # [T, G, S]
    top2 = grouped.gather(2, _descending_order(grouped, dim=2)[:, :, :2])  # [T, G, 2]
    group_score = top2[:, :, 0] + top2[:, :, 1]  # [T, G]
    kept = _descending_order(group_score, dim=1)[:, :topk_group]  # [T, topk_group]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=key.device).scatter_(1, kept, True)
    return keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)


def route_topk(
    logits: torch.Tensor,
    K: int,
    method: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
    options: RouterOptions = RouterOptions(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K routing of logits [T, E] -> (scores [T, K] routing dtype, experts [T, K] int64).

    Column k is the token's k-th choice (descending selection key, ties to the lower expert).
    Scores are differentiable w.r.t. logits; the selection is not (it is piecewise constant).
    """
    method = parse_enum(RoutingMethod, method, "routing")
    logits = logits.to(routing_dtype(logits.dtype))
    if is_gate_routing(method):
        gates = gate(logits, method)  # [T, E]
        key = gates if selection_bias is None else gates + selection_bias.to(logits.dtype)
    else:
        key = logits
    order = _descending_order(key, dim=1)  # [T, E]
    if options.n_group > 1:
        # The experts of dropped groups go behind every kept one (a stable sort on "kept" keeps
        # the order inside each part): transformers' -inf fill, also for -inf and NaN keys.
        keep = _kept_group_experts(key, options.n_group, options.topk_group).gather(1, order)
        order = order.gather(1, torch.sort(keep.to(torch.uint8), dim=1, descending=True, stable=True).indices)
    experts = order[:, :K]  # [T, K]

    if method == RoutingMethod.SOFTMAX_TOPK:
        scores = torch.softmax(logits.gather(1, experts), dim=1)
    else:
        if method == RoutingMethod.TOPK_SOFTMAX:
            scores = torch.softmax(logits, dim=1).gather(1, experts)
        else:
            scores = gates.gather(1, experts)
        if renormalize:
            scores = scores / scores.sum(dim=1, keepdim=True)
    if options.routed_scaling_factor != 1.0:
        scores = scores * options.routed_scaling_factor
    return scores, experts


def splitmix64(z: int) -> int:
    """One SplitMix64 step on a 64-bit unsigned integer (LAYER.md, token rounding)."""
    z = (z + _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stochastic_uniform(seed: int, expert: int) -> float:
    """u_e in [0, 1) of stochastic token rounding; exact: the 53-bit integer / 2^53 is a double."""
    z = splitmix64((seed & _MASK64) ^ ((expert * _GOLDEN64) & _MASK64))
    return (z >> 11) / float(1 << 53)


def _rounded_counts(counts: torch.Tensor, T, mode: TokenRounding, tile_m: int,
                    seed: int, first_expert: int = 0) -> torch.Tensor:
    """r_e [E] int64 from f_e [E] int64 per LAYER.md step 2, clamped to [0, T] (T an int or a
    0-d tensor). Expert j of `counts` is global expert first_expert + j (stochastic mode draws
    u_e from the global id)."""
    floor = counts // tile_m * tile_m
    ceil = (counts + tile_m - 1) // tile_m * tile_m
    if mode == TokenRounding.NEAREST:
        rounded = (counts + tile_m // 2) // tile_m * tile_m  # halves round up
    elif mode == TokenRounding.UP:
        rounded = ceil
    elif mode == TokenRounding.DOWN:
        rounded = floor
    else:  # STOCHASTIC
        uniforms = torch.tensor([stochastic_uniform(seed, first_expert + e) for e in range(counts.numel())],
                                dtype=torch.float64, device=counts.device)
        fraction = (counts % tile_m).to(torch.float64) / tile_m
        rounded = torch.where(uniforms < fraction, ceil, floor)
    return torch.minimum(rounded.clamp_min(0), torch.as_tensor(T, device=rounded.device))


def rounding_keep(pair_score: torch.Tensor, selected: torch.Tensor,
                  rounded: torch.Tensor) -> torch.Tensor:
    """keep [T, E] bool: per expert e, the first rounded[e] of the T tokens in LAYER.md's order
    (selected before non-selected, each group by pair_score [T, E] descending, ties to the lower
    token). selected [T, E] bool: the top-K pairs; rounded [E] int64: the rounded counts."""
    T, E = pair_score.shape
    # Stable sorts keep the previous order on ties.
    order = _descending_order(pair_score.T, dim=1)  # [E, T] token ids
    group = selected.T.gather(1, order).to(torch.uint8)  # [E, T] 1 = selected
    order = order.gather(1, torch.sort(group, dim=1, descending=True, stable=True).indices)
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(T, device=pair_score.device).expand(E, T))  # rank[e, t]
    return (rank < rounded[:, None]).T


class RoundedRouting(NamedTuple):
    token: torch.Tensor  # [R] int64, non-decreasing
    expert: torch.Tensor  # [R] int64, ascending within a token
    score: torch.Tensor  # [R] routing dtype, differentiable w.r.t. logits
    padded: torch.Tensor  # [R] bool: pair added by rounding (score = P[t, e])


def token_rounding(
    logits: torch.Tensor,
    K: int,
    mode: Union[TokenRounding, str] = TokenRounding.NEAREST,
    tile_m: int = 128,
    seed: int = 0,
) -> RoundedRouting:
    """Tile-aware token rounding of logits [T, E] (LAYER.md) -> a general routing list."""
    mode = parse_enum(TokenRounding, mode, "mode")
    if mode == TokenRounding.NONE:
        raise ValueError("mode must be a rounding mode ('nr', 'up', 'down', 'stochastic'); "
                         "'none' is plain top-K routing (use route_topk)")
    logits = logits.to(routing_dtype(logits.dtype))
    T, E = logits.shape
    topk_scores, topk_experts = route_topk(logits, K, RoutingMethod.SOFTMAX_TOPK)  # [T, K]
    probs = torch.softmax(logits, dim=1)  # P [T, E]
    selected = torch.zeros(T, E, dtype=torch.bool, device=logits.device)
    selected.scatter_(1, topk_experts, True)
    selected_score = torch.zeros_like(probs).scatter(1, topk_experts, topk_scores)  # [T, E]
    # The score a kept pair gets, and the value it ranks by inside its group.
    pair_score = torch.where(selected, selected_score, probs)  # [T, E]

    rounded = _rounded_counts(selected.sum(dim=0), T, mode, tile_m, seed)  # [E]
    keep = rounding_keep(pair_score, selected, rounded)  # [T, E]

    token, expert = keep.nonzero(as_tuple=True)  # row-major: by token, then by expert
    # nonzero() has already brought the row count to the host, so this check is free here.
    if T > 0 and token.numel() == 0:
        warnings.warn(f"token rounding (mode {mode.value!r}, tile_m {tile_m}) rounded every "
                      f"expert's token count down to zero on this batch of {T} tokens, so the "
                      "experts' output is zero. Use a larger batch, a smaller tile_m, or mode "
                      "'nr' or 'up'.", RuntimeWarning, stacklevel=2)
    return RoundedRouting(token, expert, pair_score[token, expert], ~selected[token, expert])


def aux_loss(logits: torch.Tensor, experts_of_pairs: torch.Tensor) -> torch.Tensor:
    """Load-balancing loss (LAYER.md) from logits [T, E] and the experts of the R routed pairs
    (aux_loss_from_counts takes per-expert counts computed elsewhere).

    Differentiable through P = softmax(logits); the expert frequencies are counts, not
    differentiated. Returns a scalar in the routing dtype (a plain 0 when T = 0 or R = 0).
    """
    logits = logits.to(routing_dtype(logits.dtype))
    T, E = logits.shape
    R = experts_of_pairs.numel()
    if T == 0 or R == 0:
        return logits.new_zeros(())
    probs = torch.softmax(logits, dim=1)  # [T, E]
    importance = probs.sum(dim=0) / probs.sum()  # [E]
    idx = experts_of_pairs.reshape(-1).long()
    # scatter_add, not bincount: bincount reads its input's maximum on the host (a sync).
    counts = torch.zeros(E, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))
    frequency = counts.to(logits.dtype) / R
    return E * (importance * frequency).sum()


class _AuxFromCounts(torch.autograd.Function):
    """aux_loss from per-expert counts as one autograd node: the same forward, and a backward
    written out (~7 ops in one node instead of ~8 nodes), which recomputes P from the logits
    instead of keeping it (the logits are usually kept anyway, by the router's backward). For
    hosts that issue the layer op by op (machmoe.distributed), where every node costs time.
    With S = Σ_te P[t, e] (= T up to rounding) and f_e = counts_e / R:
      aux = E Σ_e (Σ_t P[t, e]) f_e / S,  ∂aux/∂P[t, e] = (E / S)(f_e - aux / E),
    and through the softmax, where a term constant in e cancels (S's own derivative, -aux / E):
      ∂aux/∂logits[t, e] = P[t, e] (c_e - Σ_e' P[t, e'] c_e'),  c_e = E f_e / S."""

    @staticmethod
    def forward(ctx, logits, counts, R):
        probs = torch.softmax(logits, dim=1)  # [T, E]
        column = probs.sum(dim=0)  # [E]
        total = column.sum()
        frequency = counts.to(logits.dtype) / R
        E = logits.shape[1]
        aux = E * (column / total * frequency).sum()
        ctx.save_for_backward(logits, frequency, total)
        return aux

    @staticmethod
    def backward(ctx, grad):
        logits, frequency, total = ctx.saved_tensors
        probs = torch.softmax(logits, dim=1)
        c = (grad * logits.shape[1] / total) * frequency  # [E]
        pc = probs * c
        return pc - probs * pc.sum(dim=1, keepdim=True), None, None


def aux_loss_from_counts(logits: torch.Tensor, counts: torch.Tensor, R: int) -> torch.Tensor:
    """aux_loss(logits, <R pairs>, counts) as one autograd node (_AuxFromCounts)."""
    logits = logits.to(routing_dtype(logits.dtype))
    if logits.shape[0] == 0 or R == 0:
        return logits.new_zeros(())
    return _AuxFromCounts.apply(logits, counts, R)


def route_pairs(
    logits: torch.Tensor,
    K: int,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
    rounding: Union[TokenRounding, str] = TokenRounding.NONE,
    tile_m: int = 128,
    seed: int = 0,
    options: RouterOptions = RouterOptions(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing list (token [R], expert [R], score [R]) the experts run on: the T·K top-K
    pairs in (t, k) order, or the token-rounded list (then `routing` must be softmax_topk)."""
    rounding = parse_enum(TokenRounding, rounding, "rounding")
    if rounding != TokenRounding.NONE:
        token, expert, score, _ = token_rounding(logits, K, rounding, tile_m, seed)
        return token, expert, score
    scores, experts = route_topk(logits, K, routing, renormalize, selection_bias, options)
    tokens = torch.arange(logits.shape[0], device=logits.device).repeat_interleave(K)
    return tokens, experts.reshape(-1), scores.reshape(-1)


# ---------------------------------------------------------------- experts


def _gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


_GATE_FUNCTIONS = {
    ActivationType.SWIGLU: F.silu,
    ActivationType.GEGLU: _gelu_tanh,
    ActivationType.REGLU: torch.relu,
}
_PLAIN_FUNCTIONS = {
    ActivationType.RELU_SQ: lambda h: torch.relu(h).square(),  # relu2'(0) = 0 via relu'(0) = 0
    ActivationType.RELU: torch.relu,  # torch's relu has derivative 0 at 0, as LAYER.md asks
    ActivationType.GELU: _gelu_tanh,
    ActivationType.SILU: F.silu,
}


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, c: GluClamp) -> torch.Tensor:
    # torch.clamp passes the gradient where min <= x <= max (bounds included), as gpt-oss's and
    # DeepSeek-V4's clamps do.
    if c.clamp_after:
        f = (gate * torch.sigmoid(gate * c.alpha)).clamp(max=c.limit)
    else:
        gate = gate.clamp(max=c.limit)
        f = gate * torch.sigmoid(gate * c.alpha)
    return f * (up.clamp(min=-c.limit, max=c.limit) + c.up_offset)


def apply_activation(h: torch.Tensor, activation: Union[ActivationType, str],
                     layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
                     glu_clamp: Optional[GluClamp] = None) -> torch.Tensor:
    """A = act(H): H [rows, N1] -> A [rows, n] (N1 = 2n for GLU, n otherwise). glu_clamp: the
    parameters of "clamped_swiglu" (None: its defaults; other activations take none)."""
    act = parse_enum(ActivationType, activation, "activation")
    clamp = resolve_glu_clamp(act, glu_clamp)
    if not is_glu(act):
        return _PLAIN_FUNCTIONS[act](h)
    layout = parse_enum(GateUpLayout, layout, "layout")
    n = h.shape[-1] // 2
    if layout == GateUpLayout.INTERLEAVED:
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h[..., :n], h[..., n:]
    if clamp is not None:
        return _clamped_swiglu(gate, up, clamp)
    return _GATE_FUNCTIONS[act](gate) * up


def experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: Optional[torch.Tensor],
    w2: torch.Tensor,
    b2: Optional[torch.Tensor],
    token: torch.Tensor,
    expert: torch.Tensor,
    score: torch.Tensor,
    activation: Union[ActivationType, str],
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    glu_clamp: Optional[GluClamp] = None,
) -> torch.Tensor:
    """The experts on a general routing list: out [T, d] = Σ_pairs score · MLP_expert(x_token).

    x [T, d]; w1 [E, N1, d]; b1 [E, N1] or None; w2 [E, d, n]; b2 [E, d] or None;
    token, expert, score [R] with the pairs ordered by token. Gradients reach x, the weights,
    the biases and score. Experts with no pairs get exactly zero weight gradients.
    """
    T, d = x.shape
    E = w1.shape[0]
    token, expert = token.long(), expert.long()
    acc_dtype = routing_dtype(x.dtype)

    # Rows grouped by expert; the stable sort keeps (token, pair) order inside an expert, which
    # is LAYER.md's row order.
    row_pair = torch.sort(expert, stable=True).indices  # [R]
    row_token = token[row_pair]  # [R]
    rows_per_expert = torch.bincount(expert, minlength=E).tolist()
    x_rows = x[row_token].split(rows_per_expert)  # E chunks of [T_e, d]

    # unbind once: its backward stacks the E per-expert gradients in one go.
    w1_e, w2_e = w1.unbind(0), w2.unbind(0)
    b1_e = b1.unbind(0) if b1 is not None else [None] * E
    b2_e = b2.unbind(0) if b2 is not None else [None] * E
    y_rows = []
    for e in range(E):  # every expert, empty ones too: they still get (zero) gradients
        h = F.linear(x_rows[e], w1_e[e], b1_e[e])  # H [T_e, N1]
        a = apply_activation(h, activation, layout, glu_clamp)  # A [T_e, n]
        y_rows.append(F.linear(a, w2_e[e], b2_e[e]))  # Y [T_e, d]
    y = torch.cat(y_rows)  # [R, d]

    # out_t = Σ s · Y over the token's pairs, accumulated in the routing dtype.
    weighted = y.to(acc_dtype) * score[row_pair].to(acc_dtype)[:, None]  # [R, d]
    out = torch.zeros(T, d, dtype=acc_dtype, device=x.device).index_add(0, row_token, weighted)
    return out.to(x.dtype)


# ---------------------------------------------------------------- the layer


class LayerForward(NamedTuple):
    out: torch.Tensor  # [T, d] input dtype
    aux: torch.Tensor  # [] routing dtype
    logits: torch.Tensor  # [T, E] routing dtype
    token: torch.Tensor  # [R] int64
    expert: torch.Tensor  # [R] int64
    score: torch.Tensor  # [R] routing dtype


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    b1: Optional[torch.Tensor],
    w2: torch.Tensor,
    b2: Optional[torch.Tensor],
    K: int,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
    rounding: Union[TokenRounding, str] = TokenRounding.NONE,
    tile_m: int = 128,
    seed: int = 0,
    router_bias: Optional[torch.Tensor] = None,
    router_options: RouterOptions = RouterOptions(),
    glu_clamp: Optional[GluClamp] = None,
) -> LayerForward:
    """The whole layer, with its intermediates (logits and the routing list) exposed."""
    logits = router_logits(x, router_weight, router_bias)
    token, expert, score = route_pairs(logits, K, routing, renormalize, selection_bias,
                                       rounding, tile_m, seed, router_options)
    out = experts(x, w1, b1, w2, b2, token, expert, score, activation, layout, glu_clamp)
    return LayerForward(out, aux_loss(logits, expert), logits, token, expert, score)


def moe(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, d], aux []) of the MoE layer on x [T, d]; arguments as moe_forward."""
    result = moe_forward(*args, **kwargs)
    return result.out, result.aux
