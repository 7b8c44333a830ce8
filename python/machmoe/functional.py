"""machmoe's functional API: the MoE layer, the experts on a general routing list, top-K routing
and token rounding.

Every argument is validated before any work: a broken rule raises TypeError (wrong kind of
object) or ValueError (wrong value, shape, dtype or device) whose message names the argument and
the rule. `backend` picks the implementation: "torch" (pure PyTorch, CPU or GPU, differentiable)
or "machmoe" (this library's CUDA kernels, CUDA tensors only).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _ops, torch_backend
from .enums import (
    ActivationType,
    Backend,
    GateUpLayout,
    RoutingMethod,
    TokenRounding,
    is_glu,
    parse_enum,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_SEED_LIMIT = 1 << 63  # seeds travel to the C++ ops as int64

# ---------------------------------------------------------------- argument checks


def _tensor(value, arg: str, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor; got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{arg} must be {ndim}-D; got shape {tuple(value.shape)}")
    return value


def _float_tensor(value, arg: str, ndim: int) -> torch.Tensor:
    t = _tensor(value, arg, ndim)
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{arg} must be float16, bfloat16, float32 or float64; got {t.dtype}")
    return t


def _index_tensor(value, arg: str) -> torch.Tensor:
    t = _tensor(value, arg, 1)
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{arg} must have an integer dtype (int32 or int64); got {t.dtype}")
    return t


def _shape(t: torch.Tensor, arg: str, expected: Sequence[int], rule: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{arg} must have shape {list(expected)} ({rule}); "
                         f"got {list(t.shape)}")


def _int(value, arg: str, low: int, high: Optional[int] = None) -> int:
    """An int in [low, high] (bool is refused: it is an int to Python, never a size to us)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int; got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{arg} must be {bound}; got {value}")
    return value


def _bool(value, arg: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool; got {type(value).__name__}")
    return value


def _same_dtype(tensors: dict[str, Optional[torch.Tensor]], first: str) -> None:
    dtype = tensors[first].dtype
    for arg, t in tensors.items():
        if t is not None and t.dtype != dtype:
            raise ValueError(f"{arg} must have the same dtype as {first} ({dtype}); got {t.dtype}")


def _same_device(tensors: dict[str, Optional[torch.Tensor]], first: str) -> None:
    device = tensors[first].device
    for arg, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{arg} must be on the same device as {first} ({device}); "
                             f"got {t.device}")


def _validate_experts(x, w1, w2, b1, b2, activation, num_experts: Optional[int]) -> tuple:
    """Checks x [T, d], w1 [E, N1, d], w2 [E, d, n], b1 [E, N1], b2 [E, d]; returns (T, d, E, n).
    `num_experts` is E when the caller already knows it (from the router weight)."""
    x = _float_tensor(x, "x", 2)
    T, d = x.shape
    if d < 1:
        raise ValueError(f"x must have a hidden size (x.shape[1]) >= 1; got shape {list(x.shape)}")
    w2 = _float_tensor(w2, "w2", 3)
    E, _, n = w2.shape
    if num_experts is not None and E != num_experts:
        raise ValueError(f"w2 must have shape [E, d, n] with E = router_weight.shape[0] = "
                         f"{num_experts}; got {list(w2.shape)}")
    if E < 1 or n < 1:
        raise ValueError(f"w2 must have shape [E, d, n] with E >= 1 and n >= 1; "
                         f"got {list(w2.shape)}")
    _shape(w2, "w2", (E, d, n), "[E, d, n] with d = x.shape[1]")
    n1 = 2 * n if is_glu(activation) else n
    glu_rule = f"N1 = 2n for the GLU activation {activation}" if is_glu(activation) else \
        f"N1 = n for the non-GLU activation {activation}"
    _shape(_float_tensor(w1, "w1", 3), "w1", (E, n1, d), f"[E, N1, d], {glu_rule}, n = w2.shape[2]")
    if (b1 is None) != (b2 is None):
        missing = "b2" if b2 is None else "b1"
        raise ValueError(f"{missing} must be given when {'b1' if b2 is None else 'b2'} is: "
                         "biases are both on or both off")
    if b1 is not None:
        _shape(_float_tensor(b1, "b1", 2), "b1", (E, n1), "[E, N1]")
        _shape(_float_tensor(b2, "b2", 2), "b2", (E, d), "[E, d]")
    return T, d, E, n


def _validate_routing(E: int, num_experts_per_tok, routing, renormalize, selection_bias,
                      token_rounding, tile_m, seed):
    """Checks the routing options for E experts; returns (K, routing, rounding)."""
    K = _int(num_experts_per_tok, "num_experts_per_tok", 1, E)
    routing = parse_enum(RoutingMethod, routing, "routing")
    rounding = parse_enum(TokenRounding, token_rounding, "token_rounding")
    _bool(renormalize, "renormalize")
    _int(tile_m, "tile_m", 1)
    _int(seed, "seed", 0, _SEED_LIMIT - 1)
    if selection_bias is not None:
        if routing != RoutingMethod.SIGMOID:
            raise ValueError(f"selection_bias is only used with routing='sigmoid'; "
                             f"got routing={routing.value!r}")
        _shape(_float_tensor(selection_bias, "selection_bias", 1), "selection_bias", (E,), "[E]")
    if rounding != TokenRounding.NONE and routing != RoutingMethod.SOFTMAX_TOPK:
        raise ValueError(f"token_rounding={rounding.value!r} needs routing='softmax_topk'; "
                         f"got routing={routing.value!r}")
    return K, routing, rounding


def _validate_routing_list(scores, token_idx, expert_idx, T: int, E: int) -> None:
    """scores [R] float, token_idx / expert_idx [R] integer, in range, ordered by token, no
    (token, expert) pair twice."""
    scores = _float_tensor(scores, "scores", 1)
    token_idx = _index_tensor(token_idx, "token_idx")
    expert_idx = _index_tensor(expert_idx, "expert_idx")
    R = scores.shape[0]
    for arg, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if t.shape[0] != R:
            raise ValueError(f"{arg} must have the same length as scores ({R}); "
                             f"got {t.shape[0]}")
    if R == 0:
        return
    if int(token_idx.min()) < 0 or int(token_idx.max()) >= T:
        raise ValueError(f"token_idx must be in [0, T) with T = x.shape[0] = {T}; got values in "
                         f"[{int(token_idx.min())}, {int(token_idx.max())}]")
    if int(expert_idx.min()) < 0 or int(expert_idx.max()) >= E:
        raise ValueError(f"expert_idx must be in [0, E) with E = {E}; got values in "
                         f"[{int(expert_idx.min())}, {int(expert_idx.max())}]")
    if R > 1 and bool((token_idx[1:] < token_idx[:-1]).any()):
        raise ValueError("token_idx must be ordered by token (non-decreasing)")
    # No (token, expert) pair twice (LAYER.md). The machmoe kernels' routing metadata would give
    # the repeats one shared row, whose backward carries one pair's score only; every backend
    # refuses them, so both compute the same function.
    keys = (token_idx.long() * E + expert_idx.long()).sort().values
    repeated = keys[1:] == keys[:-1]
    if R > 1 and bool(repeated.any()):
        token, expert = divmod(int(keys[1:][repeated][0]), E)
        raise ValueError(f"token_idx/expert_idx must not repeat a (token, expert) pair; token {token} is "
                         f"sent to expert {expert} more than once")


def _backend(backend) -> Backend:
    return parse_enum(Backend, backend, "backend")


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
    backend: Union[Backend, str] = Backend.MACHMOE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer on x [T, d] -> (out [T, d] in x's dtype, aux_loss [] float32/float64).

    router_weight [E, d]; w1 [E, N1, d] (N1 = 2n for GLU activations, n otherwise);
    w2 [E, d, n]; b1 [E, N1] and b2 [E, d] optional, both or neither; selection_bias [E]
    (sigmoid routing only). Semantics: docs/LAYER.md.
    """
    backend = _backend(backend)
    activation = parse_enum(ActivationType, activation, "activation")
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
    weights = {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2, "b1": b1, "b2": b2}
    _same_dtype(weights, "x")
    _same_device({**weights, "selection_bias": selection_bias}, "x")

    if backend == Backend.MACHMOE:
        from . import machmoe_backend

        return machmoe_backend.moe(x, router_weight, w1, b1, w2, b2, K, activation, layout, routing,
                                   renormalize, selection_bias, rounding, tile_m, seed)
    return torch_backend.moe(x, router_weight, w1, b1, w2, b2, K, activation, layout, routing,
                             renormalize, selection_bias, rounding, tile_m, seed)


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
    backend: Union[Backend, str] = Backend.MACHMOE,
) -> torch.Tensor:
    """The experts on a general routing list -> out [T, d].

    Pair r sends token token_idx[r] to expert expert_idx[r] with weight scores[r] (any float
    dtype; it receives gradients, on both backends). Pairs must be ordered by token and must not
    repeat a (token, expert) pair; a token may have any number of pairs (none gives a zero output
    row). No router, so no aux loss.
    """
    backend = _backend(backend)
    activation = parse_enum(ActivationType, activation, "activation")
    layout = parse_enum(GateUpLayout, layout, "layout")
    T, _, E, _ = _validate_experts(x, w1, w2, b1, b2, activation, None)
    _validate_routing_list(scores, token_idx, expert_idx, T, E)
    _same_dtype({"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2}, "x")
    _same_device({"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2, "scores": scores,
                  "token_idx": token_idx, "expert_idx": expert_idx}, "x")

    if backend == Backend.MACHMOE:
        from . import machmoe_backend

        return machmoe_backend.moe_general(x, w1, b1, w2, b2, scores, token_idx, expert_idx, activation,
                                           layout)
    return torch_backend.experts(x, w1, b1, w2, b2, token_idx, expert_idx, scores, activation,
                                 layout)


def route(
    logits: torch.Tensor,
    num_experts_per_tok: int,
    *,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K routing of logits [T, E] -> (scores [T, K] float32/float64, experts [T, K] int64).

    Column k is the k-th choice (descending selection key, ties to the lower expert index, NaN
    above everything). Scores are differentiable w.r.t. logits. Runs in PyTorch on any device.
    """
    logits = _float_tensor(logits, "logits", 2)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must have shape [T, E] with E >= 1; got {list(logits.shape)}")
    K, routing, _ = _validate_routing(E, num_experts_per_tok, routing, renormalize,
                                      selection_bias, TokenRounding.NONE, 1, 0)
    _same_device({"logits": logits, "selection_bias": selection_bias}, "logits")
    return torch_backend.route_topk(logits, K, routing, renormalize, selection_bias)


def token_rounding(
    logits: torch.Tensor,
    num_experts_per_tok: int,
    *,
    mode: Union[TokenRounding, str] = TokenRounding.NEAREST,
    tile_m: int = 128,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tile-aware token rounding of logits [T, E] (softmax_topk routing) -> a general routing
    list (token [R] int64, expert [R] int64, score [R] float32/float64), ordered by token then
    expert; feed it to moe_general. Scores are differentiable w.r.t. logits."""
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
