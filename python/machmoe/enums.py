"""String enums for the layer's options, and the one parser every public entry point uses.

Every function that takes one of these enums also takes a plain string: the enum's value
("swiglu", "nr", ...) or its member name ("SWIGLU", "NEAREST", ...), in any case. Anything else
raises ValueError naming the argument and listing the accepted values.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar, Union


class _StrEnum(str, Enum):
    def __str__(self) -> str:  # "swiglu", not "ActivationType.SWIGLU": the names the C++ ops take
        return self.value


class ActivationType(_StrEnum):
    """Expert MLP activation. GLU kinds make W1 produce 2n rows (gate/up pairs)."""

    SWIGLU = "swiglu"
    GEGLU = "geglu"
    REGLU = "reglu"
    RELU_SQ = "relu2"
    RELU = "relu"
    GELU = "gelu"  # tanh approximation
    SILU = "silu"


class GateUpLayout(_StrEnum):
    """Where gate and up live among the 2n rows of W1 (docs/LAYER.md)."""

    INTERLEAVED = "interleaved"  # row 2j gate j, row 2j+1 up j
    CONCATENATED = "concatenated"  # rows [0, n) gate, rows [n, 2n) up (Hugging Face)


class RoutingMethod(_StrEnum):
    """How router logits become the K experts of a token and their scores (docs/LAYER.md)."""

    SOFTMAX_TOPK = "softmax_topk"  # top-K of logits, softmax over the K selected
    TOPK_SOFTMAX = "topk_softmax"  # softmax over all E, top-K, optional renormalisation
    SIGMOID = "sigmoid"  # sigmoid scores, optional renormalisation and selection bias
    SQRT_SOFTPLUS = "sqrt_softplus"  # sqrt(softplus(logit)) scores (DeepSeek-V4), as sigmoid's


def is_gate_routing(method: "RoutingMethod") -> bool:
    """The routings that score each expert by a gate of its own logit (sigmoid, sqrt_softplus):
    the selection bias and group-limited selection apply to them."""
    return method in (RoutingMethod.SIGMOID, RoutingMethod.SQRT_SOFTPLUS)


class TokenRounding(_StrEnum):
    """Tile-aware token rounding: each expert's token count is rounded to a multiple of tile_m
    (to the nearest multiple, up, down, or stochastically) by adding or dropping the
    lowest-scoring pairs, so no GEMM tile is partly empty. NONE is plain top-K routing."""

    NONE = "none"
    NEAREST = "nr"
    UP = "up"
    DOWN = "down"
    STOCHASTIC = "stochastic"


class Backend(_StrEnum):
    """Which implementation runs the layer (machmoe.functional.resolve_backend picks for AUTO)."""

    AUTO = "auto"  # the kernels where they can run (bf16 CUDA tensors on sm_90), else torch
    MACHMOE = "machmoe"  # the CUDA kernels of this library; an error where they cannot run
    TORCH = "torch"  # pure PyTorch (CPU or GPU, any float dtype), autograd-differentiable


_E = TypeVar("_E", bound=_StrEnum)


def parse_enum(enum_type: type[_E], value: Union[_E, str], arg: str) -> _E:
    """`value` as a member of `enum_type`; `arg` is the argument's name for the error message."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in enum_type:
            if key == member.value or key == member.name.lower():
                return member
    choices = ", ".join(repr(m.value) for m in enum_type)
    raise ValueError(f"{arg} must be one of {choices} (or a {enum_type.__name__}); got {value!r}")


def is_glu(activation: Union[ActivationType, str]) -> bool:
    """True for the gated activations, whose up-projection has 2n rows per expert."""
    act = parse_enum(ActivationType, activation, "activation")
    return act in (ActivationType.SWIGLU, ActivationType.GEGLU, ActivationType.REGLU)
