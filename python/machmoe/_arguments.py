"""The argument rules of machmoe's functional API (machmoe.functional and the modules built on
it: shared_experts, distributed, moe): each check raises TypeError (wrong kind of object) or
ValueError (wrong value, shape, dtype or device) with a message naming the argument and the rule.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import torch_backend
from .enums import (
    ActivationType,
    Backend,
    GateUpLayout,
    RoutingMethod,
    TokenRounding,
    is_gate_routing,
    is_glu,
    parse_enum,
    resolve_glu_clamp,
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


def _parse_experts_call(x, w1, w2, b1, b2, activation, layout, backend, glu_clamp) -> tuple:
    """The checks every experts entry point makes (moe_general, experts_topk, shared_experts):
    backend, activation, layout and clamp parsed, the tensors' shapes checked. Returns
    (activation, layout, glu_clamp, T, d, E, n)."""
    parse_enum(Backend, backend, "backend")
    activation = parse_enum(ActivationType, activation, "activation")
    layout = parse_enum(GateUpLayout, layout, "layout")
    glu_clamp = resolve_glu_clamp(activation, glu_clamp)
    return (activation, layout, glu_clamp, *_validate_experts(x, w1, w2, b1, b2, activation, None))


def _same_dtype_and_device(same_dtype: dict, same_device: dict) -> None:
    """The tensors of `same_dtype` (x first) share x's dtype; those and `same_device`'s share its
    device."""
    _same_dtype(same_dtype, "x")
    _same_device({**same_dtype, **same_device}, "x")


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
        if not is_gate_routing(routing):
            raise ValueError(f"selection_bias is only used with routing='sigmoid' or 'sqrt_softplus'; "
                             f"got routing={routing.value!r}")
        _shape(_float_tensor(selection_bias, "selection_bias", 1), "selection_bias", (E,), "[E]")
    if rounding != TokenRounding.NONE and routing != RoutingMethod.SOFTMAX_TOPK:
        raise ValueError(f"token_rounding={rounding.value!r} needs routing='softmax_topk'; "
                         f"got routing={routing.value!r}")
    return K, routing, rounding


# float32's largest value plus half its last ulp (2^103): a cast rounds anything at or above it
# (ties to even: the largest value's mantissa is odd) to infinity.
_FLOAT32_OVERFLOW = 3.4028234663852886e38 + 2.0 ** 103


def _finite_in_float32(value: float) -> bool:
    """Whether value rounds to a finite float32 (NaN compares false). No math.isfinite: under
    torch.compile(dynamic=True) value may be a symbolic float, which math.isfinite cannot take."""
    return abs(value) < _FLOAT32_OVERFLOW


def _validate_router_options(E: int, K: int, routing: RoutingMethod, rounding: TokenRounding,
                             routed_scaling_factor, n_group, topk_group) -> torch_backend.RouterOptions:
    """Checks the router options (LAYER.md "Routing") for E experts, K per token."""
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a float; got {type(routed_scaling_factor).__name__}")
    scale = float(routed_scaling_factor)
    # finite in fp32 too: the kernels scale in fp32 (checked without a tensor, which would be an
    # .item() inside torch.compile)
    if not (scale > 0 and _finite_in_float32(scale)):
        raise ValueError(f"routed_scaling_factor must be finite (in float32) and > 0; got {routed_scaling_factor}")
    n_group = _int(n_group, "n_group", 1, E)
    if E % n_group != 0:
        raise ValueError(f"n_group must divide E = {E}; got {n_group}")
    topk_group = _int(topk_group, "topk_group", 1, n_group)
    if n_group > 1:
        if not is_gate_routing(routing):
            raise ValueError(f"group-limited selection (n_group > 1) needs routing='sigmoid' or 'sqrt_softplus'; "
                             f"got routing={routing.value!r}")
        if E // n_group < 2:
            raise ValueError(f"group-limited selection needs >= 2 experts per group (E / n_group); got E = {E}, "
                             f"n_group = {n_group}")
        if K > topk_group * (E // n_group):
            raise ValueError(f"num_experts_per_tok must be <= topk_group * E / n_group = "
                             f"{topk_group * (E // n_group)}; got {K}")
    if rounding != TokenRounding.NONE and (scale != 1.0 or n_group != 1):
        raise ValueError("token rounding takes no routed_scaling_factor (must be 1) and no group-limited "
                         f"selection (n_group must be 1); got {scale} and {n_group}")
    return torch_backend.RouterOptions(scale, n_group, topk_group)


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
