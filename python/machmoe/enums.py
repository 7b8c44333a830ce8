"""String enums for the layer's options, and the one parser every public entry point uses.

Every function that takes one of these enums also takes a plain string: the enum's value
("swiglu", "nr", ...) or its member name ("SWIGLU", "NEAREST", ...), in any case. Anything else
raises ValueError naming the argument and listing the accepted values.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Optional, TypeVar, Union


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
    # gpt-oss's / DeepSeek-V4's clamped SwiGLU; its parameters are a GluClamp (docs/LAYER.md)
    CLAMPED_SWIGLU = "clamped_swiglu"


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


class Precision(_StrEnum):
    """The expert GEMMs' number format (docs/LAYER.md, "FP8")."""

    BF16 = "bf16"  # bfloat16 operands, fp32 accumulation (the layer as it always ran)
    FP8 = "fp8"  # E4M3 operands in DeepSeek-V3's tile scaling (machmoe.fp8_layer), fp32 accumulation


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
    return act in (ActivationType.SWIGLU, ActivationType.GEGLU, ActivationType.REGLU,
                   ActivationType.CLAMPED_SWIGLU)


@dataclass(frozen=True)
class GluClamp:
    """The parameters of the "clamped_swiglu" activation (docs/LAYER.md), with L = limit:

    clamp_after=False: g' = min(g, L), u' = clamp(u, -L, L), A = g'·sigmoid(alpha·g')·(u' + up_offset)
    clamp_after=True:  A = min(g·sigmoid(alpha·g), L)·(clamp(u, -L, L) + up_offset)

    The defaults are gpt-oss's (GluClamp.gpt_oss()); DeepSeek-V4's is GluClamp.deepseek_v4(L).
    Every backend uses the values rounded to float32 (resolve_glu_clamp rounds them).
    """

    alpha: float = 1.702
    limit: float = 7.0
    up_offset: float = 1.0
    clamp_after: bool = False

    @classmethod
    def gpt_oss(cls, limit: float = 7.0, alpha: float = 1.702) -> "GluClamp":
        """gpt-oss: gate clamped above, up clamped, gate·sigmoid(alpha·gate)·(up + 1)."""
        return cls(alpha=alpha, limit=limit, up_offset=1.0)

    @classmethod
    def deepseek_v4(cls, limit: float = 10.0) -> "GluClamp":
        """DeepSeek-V4: gate clamped above, up clamped, then plain SwiGLU silu(gate)·up."""
        return cls(alpha=1.0, limit=limit, up_offset=0.0)

    @classmethod
    def post_activation(cls, limit: float) -> "GluClamp":
        """The clamp after the activation: min(silu(gate), L)·clamp(up, -L, L)."""
        return cls(alpha=1.0, limit=limit, up_offset=0.0, clamp_after=True)

    def as_list(self) -> list[float]:
        """[alpha, limit, up_offset, clamp_after] as the ops take it (`float[] glu_clamp`)."""
        return [float(self.alpha), float(self.limit), float(self.up_offset), 1.0 if self.clamp_after else 0.0]


def resolve_glu_clamp(activation: Union[ActivationType, str], glu_clamp: Optional[GluClamp]) -> Optional[GluClamp]:
    """The clamp parameters of `activation`: a GluClamp for "clamped_swiglu" (the defaults where
    glu_clamp is None), None for every other activation, which takes none (ValueError if given)."""
    act = parse_enum(ActivationType, activation, "activation")
    if glu_clamp is not None and not isinstance(glu_clamp, GluClamp):
        raise ValueError(f"glu_clamp must be a machmoe.GluClamp or None, got {type(glu_clamp).__name__}")
    if act != ActivationType.CLAMPED_SWIGLU:
        if glu_clamp is not None:
            raise ValueError(f"glu_clamp is taken by activation 'clamped_swiglu' only, got activation {act.value!r}")
        return None
    c = glu_clamp if glu_clamp is not None else GluClamp()
    for name in ("alpha", "limit", "up_offset"):
        v = getattr(c, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"glu_clamp.{name} must be a finite number, got {v!r}")
    if not c.alpha > 0:
        raise ValueError(f"glu_clamp.alpha must be > 0, got {c.alpha!r}")
    if not c.limit > 0:
        raise ValueError(f"glu_clamp.limit must be > 0, got {c.limit!r}")
    # Every implementation uses the parameters as float32 (the kernels' arguments), as a model
    # running in float32 or bfloat16 does with its Python-float constants.
    return GluClamp(alpha=_to_float32(c.alpha), limit=_to_float32(c.limit), up_offset=_to_float32(c.up_offset),
                    clamp_after=bool(c.clamp_after))


def _to_float32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", float(v)))[0]


def glu_clamp_list(glu_clamp: Optional[GluClamp]) -> list[float]:
    """The ops' `glu_clamp` argument: [] for None (no clamp parameters)."""
    return [] if glu_clamp is None else glu_clamp.as_list()
