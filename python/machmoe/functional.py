"""machmoe's functional API: the MoE layer, the experts on a general routing list, top-K routing
and token rounding.

Every argument is validated before any work: a broken rule raises TypeError (wrong kind of
object) or ValueError (wrong value, shape, dtype or device) whose message names the argument and
the rule. `backend` picks the implementation (resolve_backend):
  "auto"     (default) the kernels where they can run, the torch backend everywhere else;
  "machmoe"  this library's CUDA kernels: bfloat16 tensors on an sm_90 GPU (H100, H200), hidden
             and intermediate sizes multiples of 8; anything else is an error;
  "torch"    pure PyTorch on any device and float dtype, differentiable by autograd.
Both implementations compute the layer of docs/LAYER.md; the kernels in bf16 with fp32
accumulation, the torch backend in the input dtype with fp32 (or fp64) routing.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from . import _ops, torch_backend
from .enums import (
    ActivationType,
    Backend,
    GateUpLayout,
    GluClamp,
    Precision,
    RoutingMethod,
    TokenRounding,
    parse_enum,
    resolve_glu_clamp,
)
from .fp8_weights import FP8WeightCache

# Argument rules (also read as functional.<name> by shared_experts, distributed and moe).
from ._arguments import (
    _tensor,
    _float_tensor,
    _shape,
    _same_dtype,
    _same_device,
    _validate_experts,
    _parse_experts_call,
    _same_dtype_and_device,
    _validate_routing,
    _validate_router_options,
    _validate_routing_list,
    _INT_DTYPES,
)


def _run_experts(x, w1, b1, w2, b2, scores, token, expert, activation, layout, glu_clamp, on_kernels: bool,
                 repeats: int = 1, fp8=None) -> torch.Tensor:
    """The experts on a checked list (scores, token, expert) [R] on the kernels or the torch
    backend (repeats: machmoe_backend._General's copies per expert, kernels only). fp8: None, or
    (cache, concatenated): the experts in FP8 (the kernels, or the emulation on the torch
    backend; machmoe.fp8_layer)."""
    if on_kernels:
        from . import machmoe_backend

        return machmoe_backend.moe_general(x, w1, b1, w2, b2, scores, token, expert, activation, layout,
                                           glu_clamp, repeats=repeats, fp8=fp8)
    if fp8 is not None:
        from . import fp8_emulation

        return fp8_emulation.experts_on_list(x, w1, w2, token, expert, scores, fp8[0], fp8[1], glu_clamp, b1, b2)
    return torch_backend.experts(x, w1, b1, w2, b2, token, expert, scores, activation, layout, glu_clamp)


_LOG = logging.getLogger("machmoe")
_AUTO_ANNOUNCED: set = set()  # the backends "auto" has already said it chose, in this process


def kernels_unavailable_reason(x: torch.Tensor, d: int, n: int) -> Optional[str]:
    """None when the kernels can run the layer on x [T, d] with intermediate size n, else why not."""
    why = _ops.kernels_unavailable_reason(x.device)
    if why is None and x.dtype != torch.bfloat16:
        why = f"the kernels take bfloat16 tensors; x is {x.dtype}"
    if why is None and (d % 8 or n % 8):
        why = f"the kernels need hidden and intermediate sizes that are multiples of 8; got {d}, {n}"
    return why


def resolve_backend(backend: Union[Backend, str], x: torch.Tensor, d: int, n: int) -> Backend:
    """The backend that runs a call on x [T, d] with intermediate size n: `backend` itself when it
    is "machmoe" or "torch", and for "auto" the kernels when they can run (compiled ops loaded, a
    device of compute capability 9.0, x on it, bfloat16, d and n multiples of 8), the torch
    backend otherwise. The first time "auto" picks each backend it says so, once per process, on
    the "machmoe" logger: INFO for the kernels or for a CPU tensor, WARNING when a CUDA tensor
    falls back to the torch backend (likely not what was meant on a GPU)."""
    backend = parse_enum(Backend, backend, "backend")
    if backend != Backend.AUTO:
        return backend
    why = kernels_unavailable_reason(x, d, n)
    chosen = Backend.MACHMOE if why is None else Backend.TORCH
    # (Not while torch.compile traces: the message would be a graph break; eager calls say it.)
    if chosen not in _AUTO_ANNOUNCED and not torch.compiler.is_compiling():
        _AUTO_ANNOUNCED.add(chosen)
        if why is None:
            _LOG.info("machmoe: backend='auto' runs the machmoe kernels on %s", x.device)
        else:
            level = logging.WARNING if x.device.type == "cuda" else logging.INFO
            _LOG.log(level, "machmoe: backend='auto' runs the torch backend: %s (said once per "
                     "process; pass backend='torch' to choose it explicitly)", why)
    return chosen


# ---------------------------------------------------------------- public API


def moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    num_experts_per_tok: int,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
    token_rounding: Union[TokenRounding, str] = TokenRounding.NONE,
    tile_m: int = 128,
    seed: int = 0,
    backend: Union[Backend, str] = Backend.AUTO,
    router_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    glu_clamp: Optional[GluClamp] = None,
    shared_w1: Optional[torch.Tensor] = None,
    shared_w2: Optional[torch.Tensor] = None,
    shared_b1: Optional[torch.Tensor] = None,
    shared_b2: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    precision: Union[Precision, str] = Precision.BF16,
    fp8_cache: Optional[FP8WeightCache] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer (router, top-K routing, experts, weighted sum, shared experts) -> (out, aux_loss).

    Semantics: docs/LAYER.md. Tensors share x's dtype and device (selection_bias: device only).

    Args:
        x: [T, d] tokens, float16/bfloat16/float32/float64.
        router_weight: [E, d] router weights (logits = x · router_weightᵀ (+ router_bias),
            computed in fp32 or fp64).
        w1: [E, N1, d] up-projection (gate and up) weights; N1 = 2n for the GLU activations
            (swiglu, geglu, reglu), n for the others.
        w2: [E, d, n] down-projection weights.
        num_experts_per_tok: K, experts per token, 1 <= K <= E.
        activation: ActivationType or its name: "swiglu" (default), "geglu", "reglu", "relu2",
            "relu", "gelu" (tanh approximation), "silu", "clamped_swiglu" (gpt-oss's and
            DeepSeek-V4's clamped SwiGLU, a GLU; its parameters are glu_clamp).
        b1: [E, N1] up-projection bias, or None (default). Given with b2 or not at all.
        b2: [E, d] down-projection bias, or None (default).
        layout: where gate and up rows sit in w1 for GLU activations: "interleaved" (default;
            row 2j gate j, row 2j+1 up j) or "concatenated" (gate rows [0, n), up rows [n, 2n)).
        routing: "softmax_topk" (default; top-K logits, softmax over those K), "topk_softmax"
            (softmax over all E, then top-K), "sigmoid" (sigmoid scores) or "sqrt_softplus"
            (sqrt(softplus(logit)) scores, DeepSeek-V4).
        renormalize: for topk_softmax, sigmoid and sqrt_softplus, divide a token's K scores by
            their sum (default True); softmax_topk scores already sum to 1.
        selection_bias: [E] added to the sigmoid / sqrt_softplus scores when choosing experts,
            never to the scores themselves (those routings only; default None).
        token_rounding: "none" (default), or "nr", "up", "down", "stochastic": round each
            expert's token count to a multiple of tile_m (softmax_topk routing only). A batch
            whose every expert rounds to zero tokens gives a zero output; the torch backend warns
            then (the kernels' row counts stay on the GPU, so they do not check: that would cost
            a host sync per call).
        tile_m: the rounding tile, rows per expert GEMM tile (default 128; >= 1).
        seed: the seed of stochastic token rounding, 0 <= seed < 2**63 (default 0).
        backend: "auto" (default), "machmoe" or "torch"; see resolve_backend.
        router_bias: [E] bias of the router (gpt-oss), or None (default); receives a gradient.
        routed_scaling_factor: the scores are multiplied by it after renormalisation (DeepSeek-V3,
            Kimi, GLM-4.5; default 1.0; > 0).
        n_group: group-limited selection (DeepSeek-V3; sigmoid / sqrt_softplus only): the E
            experts form n_group groups of E / n_group consecutive experts (>= 2 each), a group
            scores the sum of its two largest selection values, and only the experts of the
            topk_group best groups can be chosen (default 1: no grouping).
        topk_group: the groups kept per token (1 <= topk_group <= n_group; default 1).
        glu_clamp: the parameters of activation "clamped_swiglu" (a machmoe.GluClamp; None:
            gpt-oss's, GluClamp()); GluClamp.deepseek_v4(limit) and GluClamp.post_activation(limit)
            give the other variants. Other activations take none.
        shared_w1: [S, N1s, d] up-projection weights of S >= 1 shared experts that every token
            visits (machmoe.shared_experts.shared_experts), their outputs added to the routed
            experts'; None (default): no shared experts. On the kernels, shared experts of the
            routed experts' size (n_s = n, without token rounding) run in the routed experts'
            launches, as S more pairs per token; other sizes run in launches of their own.
        shared_w2: [S, d, n_s] their down-projection weights (given with shared_w1).
        shared_b1: [S, N1s] their up-projection bias, or None (default); with shared_b2 or not at all.
        shared_b2: [S, d] their down-projection bias, or None (default).
        shared_gate: [1, d] Qwen's shared-expert gate: the shared experts' sum is weighted per
            token by sigmoid(x · shared_gateᵀ); None (default): weight 1.
        precision: "bf16" (default) or "fp8": the experts' GEMMs in E4M3 with DeepSeek-V3's tile
            scaling, the router in fp32 (machmoe.fp8_layer; bfloat16 tensors, swiglu or
            clamped_swiglu, d and n multiples of 16; shared experts run beside in bf16).
        fp8_cache: with precision="fp8", the FP8WeightCache of the weights' FP8 copies (None: one
            for the process); remade after every torch.optim step and every in-place write of a
            weight (machmoe.fp8_weights; call its invalidate() after writes it cannot see).

    Returns:
        out: [T, d] in x's dtype.
        aux_loss: [] the load-balancing loss, float32 (float64 for float64 x).
    """
    parse_enum(Backend, backend, "backend")
    activation = parse_enum(ActivationType, activation, "activation")
    glu_clamp = resolve_glu_clamp(activation, glu_clamp)
    layout = parse_enum(GateUpLayout, layout, "layout")
    router_weight = _float_tensor(router_weight, "router_weight", 2)
    E = router_weight.shape[0]
    if E < 1:
        raise ValueError(f"router_weight must have shape [E, d] with E >= 1; "
                         f"got {list(router_weight.shape)}")
    T, d, _, _ = _validate_experts(x, w1, w2, b1, b2, activation, E)
    _shape(router_weight, "router_weight", (E, d), "[E, d] with d = x.shape[1]")
    K, routing, rounding = _validate_routing(E, num_experts_per_tok, routing, renormalize,
                                             selection_bias, token_rounding, tile_m, seed)
    options = _validate_router_options(E, K, routing, rounding, routed_scaling_factor, n_group, topk_group)
    weights = {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2, "b1": b1, "b2": b2}
    if router_bias is not None:
        weights["router_bias"] = _float_tensor(router_bias, "router_bias", 1)
        _shape(router_bias, "router_bias", (E,), "[E]")
    _same_dtype(weights, "x")
    _same_device({**weights, "selection_bias": selection_bias}, "x")
    has_shared = any(t is not None for t in (shared_w1, shared_w2, shared_b1, shared_b2, shared_gate))
    if has_shared:
        from .shared_experts import check_shared_experts

        if shared_w1 is None or shared_w2 is None:
            raise ValueError("shared_w1 and shared_w2 must both be given for shared experts (shared_b1, "
                             "shared_b2 and shared_gate need them)")
        try:
            n_s = check_shared_experts(x, shared_w1, shared_w2, shared_b1, shared_b2, shared_gate, activation,
                                       layout, backend, glu_clamp)[6]
        except (TypeError, ValueError) as e:  # name the shared experts' arguments, not the routed ones'
            raise type(e)(f"shared experts (shared_w1, shared_w2, shared_b1, shared_b2, shared_gate): {e}") from None

    fused_shared = False
    if parse_enum(Precision, precision, "precision") == Precision.FP8 or fp8_cache is not None:
        from . import fp8_layer

        out, aux = fp8_layer.moe(precision, fp8_cache, backend, x, router_weight, w1, b1, w2, b2, K, activation,
                                 layout, routing, renormalize, selection_bias, rounding, tile_m, seed, router_bias,
                                 options, glu_clamp)
    else:
        n = w2.shape[2]
        on_kernels = resolve_backend(backend, x, d, n) == Backend.MACHMOE
        # Shared experts in the routed launches: same size, no token rounding, biases on both or neither.
        fused_shared = (has_shared and on_kernels and n_s == n and rounding == TokenRounding.NONE
                        and (b1 is None) == (shared_b1 is None))
        if on_kernels:
            from . import machmoe_backend

            shared = None
            if fused_shared:  # Qwen's gate, if any, computed by the layer (its logits in fp32)
                shared = (shared_w1, shared_b1, shared_w2, shared_b2, None, shared_gate)
            out, aux = machmoe_backend.moe(x, router_weight, w1, b1, w2, b2, K, activation, layout, routing,
                                           renormalize, selection_bias, rounding, tile_m, seed, router_bias,
                                           options, glu_clamp, shared)
        else:
            out, aux = torch_backend.moe(x, router_weight, w1, b1, w2, b2, K, activation, layout, routing,
                                         renormalize, selection_bias, rounding, tile_m, seed, router_bias,
                                         options, glu_clamp)
    if has_shared and not fused_shared:  # shared experts in launches of their own
        from .shared_experts import shared_experts

        out = out + shared_experts(x, shared_w1, shared_w2, gate_weight=shared_gate, b1=shared_b1, b2=shared_b2,
                                   activation=activation, layout=layout, backend=backend, glu_clamp=glu_clamp)
    return out, aux


def moe_general(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    scores: torch.Tensor,
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    backend: Union[Backend, str] = Backend.AUTO,
    glu_clamp: Optional[GluClamp] = None,
) -> torch.Tensor:
    """The experts on a general routing list -> out [T, d] in x's dtype.

    Pair r sends token token_idx[r] to expert expert_idx[r] with weight scores[r]. Pairs must be
    ordered by token and must not repeat a (token, expert) pair; a token may have any number of
    pairs (none gives a zero output row). No router, so no aux loss.

    Args:
        x: [T, d] tokens, float16/bfloat16/float32/float64.
        w1: [E, N1, d] up-projection weights, x's dtype; N1 = 2n for GLU activations, else n.
        w2: [E, d, n] down-projection weights, x's dtype.
        scores: [R] pair weights, any float dtype; they receive gradients on both backends.
        token_idx: [R] integer token of each pair, in [0, T), non-decreasing.
        expert_idx: [R] integer expert of each pair, in [0, E).
        b1: [E, N1] up-projection bias, or None (default). Given with b2 or not at all.
        b2: [E, d] down-projection bias, or None (default).
        activation: ActivationType or its name (default "swiglu"); see moe().
        layout: "interleaved" (default) or "concatenated" gate/up rows in w1; see moe().
        backend: "auto" (default), "machmoe" or "torch"; see resolve_backend.
        glu_clamp: the parameters of activation "clamped_swiglu"; see moe().
    """
    activation, layout, glu_clamp, T, d, E, n = _parse_experts_call(x, w1, w2, b1, b2, activation, layout,
                                                                   backend, glu_clamp)
    _validate_routing_list(scores, token_idx, expert_idx, T, E)
    _same_dtype_and_device({"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2},
                           {"scores": scores, "token_idx": token_idx, "expert_idx": expert_idx})
    return _run_experts(x, w1, b1, w2, b2, scores, token_idx, expert_idx, activation, layout, glu_clamp,
                        resolve_backend(backend, x, d, n) == Backend.MACHMOE)


def experts_topk(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_scores: torch.Tensor,
    topk_experts: torch.Tensor,
    *,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    backend: Union[Backend, str] = Backend.AUTO,
    glu_clamp: Optional[GluClamp] = None,
    precision: Union[Precision, str] = Precision.BF16,
    fp8_cache=None,
) -> torch.Tensor:
    """The experts on a top-K routing result -> out [T, d] in x's dtype: moe_general on the list
    of the T·K pairs (t, topk_experts[t, k], topk_scores[t, k]) in (t, k) order, with every pair
    whose expert is outside [0, E) dropped (it adds nothing and its score's gradient is 0; expert
    parallelism marks the experts another rank holds that way).

    Such a list is ordered by token by construction, and a token's K experts are distinct where
    they come from a top-K selection, so none of moe_general's checks of the list's values is
    made: they would read the list on the host, a synchronisation per call. The caller
    guarantees that a token's in-range experts are distinct (a repeat is not detected here).
    On the machmoe kernels the list goes to the device as it is (their routing metadata gives an
    out-of-range pair no row); the torch backend filters it (it synchronises anyway, for its
    per-expert loop).

    Args:
        x, w1, w2, b1, b2, activation, layout, backend, glu_clamp: as moe_general.
        topk_scores: [T, K] pair weights, any float dtype; they receive gradients.
        topk_experts: [T, K] integer experts; values outside [0, E) are dropped.
        precision, fp8_cache: as for moe: "fp8" runs the experts' GEMMs in FP8 (machmoe.fp8_layer's
            rules: swiglu or clamped_swiglu, bfloat16, d and n multiples of 16), on the weights'
            FP8 copies in fp8_cache (None: one cache for the process).
    """
    activation, layout, glu_clamp, T, d, E, n = _parse_experts_call(x, w1, w2, b1, b2, activation, layout,
                                                                   backend, glu_clamp)
    fp8 = _fp8_setting(precision, fp8_cache, x, activation, layout, d, n)
    topk_scores = _float_tensor(topk_scores, "topk_scores", 2)
    topk_experts = _tensor(topk_experts, "topk_experts", 2)
    if topk_experts.dtype not in _INT_DTYPES:
        raise ValueError(f"topk_experts must have an integer dtype; got {topk_experts.dtype}")
    if topk_experts.shape[0] != T:
        raise ValueError(f"topk_experts must have shape [T, K] with T = x.shape[0] = {T}; "
                         f"got {list(topk_experts.shape)}")
    _shape(topk_scores, "topk_scores", topk_experts.shape, "[T, K], the shape of topk_experts")
    _same_dtype_and_device({"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2},
                           {"topk_scores": topk_scores, "topk_experts": topk_experts})

    K = topk_experts.shape[1]
    scores = topk_scores.reshape(-1)  # [T·K], pair (t, k) at t·K + k
    expert = topk_experts.reshape(-1)
    token = torch.arange(T, device=x.device)[:, None].expand(T, K).reshape(-1)  # [T·K], non-decreasing
    if resolve_backend(backend, x, d, n) == Backend.MACHMOE:
        return _run_experts(x, w1, b1, w2, b2, scores, token, expert, activation, layout, glu_clamp, True, fp8=fp8)
    keep = (expert >= 0) & (expert < E)  # boolean indexing: the torch backend's host sync
    return _run_experts(x, w1, b1, w2, b2, scores[keep], token[keep], expert[keep], activation, layout,
                        glu_clamp, False, fp8=fp8)


def _fp8_setting(precision, fp8_cache, x, activation, layout, d: int, n: int):
    """None (bf16), or the experts' FP8 setting (cache, concatenated) after FP8's rules
    (machmoe.fp8_layer), naming the argument that breaks one."""
    if parse_enum(Precision, precision, "precision") != Precision.FP8:
        if fp8_cache is not None:
            raise ValueError(f"fp8_cache is only used with precision='fp8'; got precision={precision!r}")
        return None
    from . import fp8_layer
    from .fp8_weights import FP8WeightCache

    if fp8_cache is not None and not isinstance(fp8_cache, FP8WeightCache):
        raise TypeError(f"fp8_cache must be a machmoe.fp8_weights.FP8WeightCache or None; "
                        f"got {type(fp8_cache).__name__}")
    fp8_layer.check_options(fp8_layer.FUNCTIONAL_NAMES, activation, d, n)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 with precision='fp8' (and so the weights, which share x's dtype); "
                         f"got {x.dtype}")
    cache = fp8_layer.default_cache() if fp8_cache is None else fp8_cache
    return cache, layout == GateUpLayout.CONCATENATED


def route(
    logits: torch.Tensor,
    num_experts_per_tok: int,
    *,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K routing of logits -> (scores [T, K] float32/float64, experts [T, K] int64).

    Column k is the k-th choice (descending selection key, ties to the lower expert index, NaN
    above everything). Scores are differentiable w.r.t. logits. Runs in PyTorch on any device.

    Args:
        logits: [T, E] router logits, any float dtype (routing runs in float32, or float64 for
            float64 logits).
        num_experts_per_tok: K, experts per token, 1 <= K <= E.
        routing: "softmax_topk" (default), "topk_softmax", "sigmoid" or "sqrt_softplus"; see moe().
        renormalize: divide a token's K scores by their sum (all but softmax_topk; default True).
        selection_bias: [E] sigmoid / sqrt_softplus only: added to the scores when choosing experts.
        routed_scaling_factor: scores × this after renormalisation; see moe().
        n_group: group-limited selection's groups (default 1: none); see moe().
        topk_group: the groups kept (default 1); see moe().
    """
    logits = _float_tensor(logits, "logits", 2)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must have shape [T, E] with E >= 1; got {list(logits.shape)}")
    K, routing, _ = _validate_routing(E, num_experts_per_tok, routing, renormalize,
                                      selection_bias, TokenRounding.NONE, 1, 0)
    options = _validate_router_options(E, K, routing, TokenRounding.NONE, routed_scaling_factor, n_group,
                                       topk_group)
    _same_device({"logits": logits, "selection_bias": selection_bias}, "logits")
    return torch_backend.route_topk(logits, K, routing, renormalize, selection_bias, options)


def token_rounding(
    logits: torch.Tensor,
    num_experts_per_tok: int,
    *,
    mode: Union[TokenRounding, str] = TokenRounding.NEAREST,
    tile_m: int = 128,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tile-aware token rounding (softmax_topk routing) -> a general routing list
    (token [R] int64, expert [R] int64, score [R] float32/float64), ordered by token then expert;
    feed it to moe_general. Scores are differentiable w.r.t. logits. Runs in PyTorch on any
    device; warns when it keeps no pair at all (every expert rounded down to zero tokens).

    Args:
        logits: [T, E] router logits, any float dtype.
        num_experts_per_tok: K, experts per token before rounding, 1 <= K <= E.
        mode: "nr" (default; nearest multiple of tile_m, halves up), "up", "down" or
            "stochastic" (up with probability (count mod tile_m) / tile_m).
        tile_m: the multiple each expert's token count is rounded to (default 128; >= 1).
        seed: stochastic mode's seed, 0 <= seed < 2**63 (default 0).
    """
    logits = _float_tensor(logits, "logits", 2)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must have shape [T, E] with E >= 1; got {list(logits.shape)}")
    mode = parse_enum(TokenRounding, mode, "mode")
    if mode == TokenRounding.NONE:
        raise ValueError("mode must be 'nr', 'up', 'down' or 'stochastic'; got 'none' "
                         "(plain top-K routing is machmoe.functional.route)")
    K, _, _ = _validate_routing(E, num_experts_per_tok, RoutingMethod.SOFTMAX_TOPK, True, None,
                                mode, tile_m, seed)
    token, expert, score, _ = torch_backend.token_rounding(logits, K, mode, tile_m, seed)
    return token, expert, score
