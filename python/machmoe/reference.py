"""Keyword-argument wrappers over the C++ CPU reference ops, torch.ops.machmoe.reference_*
(docs/OPS.md). They take CPU tensors of any float dtype and compute in float64; enums or plain
strings are accepted wherever the op takes a name. They need the compiled library.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from . import _ops
from .enums import (ActivationType, GateUpLayout, GluClamp, RoutingMethod, TokenRounding, glu_clamp_list,
                    parse_enum, resolve_glu_clamp)


def _ops_namespace():
    _ops.require_ops()
    return torch.ops.machmoe


class TokenRoundingResult(NamedTuple):
    token: torch.Tensor  # [R] int32, ordered by token then expert
    expert: torch.Tensor  # [R] int32
    score: torch.Tensor  # [R] float64
    padded: torch.Tensor  # [R] bool: added by rounding (score = P[t, e])


class Metadata(NamedTuple):
    expert_offsets: torch.Tensor  # [E+1] int64: rows of expert e are [off[e], off[e+1])
    row_token: torch.Tensor  # [R] int32: row -> token (the gather index)
    row_pair: torch.Tensor  # [R] int32: row -> pair
    pair_row: torch.Tensor  # [R] int32: pair -> row
    token_offsets: torch.Tensor  # [T+1] int64: pairs of token t are [off[t], off[t+1])


class LayerResult(NamedTuple):
    out: torch.Tensor  # [T, d]
    aux: torch.Tensor  # []
    token: torch.Tensor  # [R] int32: the list the experts ran on
    expert: torch.Tensor  # [R] int32
    score: torch.Tensor  # [R]
    dx: torch.Tensor  # [T, d]
    d_router_weight: torch.Tensor  # [E, d]
    dw1: torch.Tensor  # [E, N1, d]
    db1: torch.Tensor  # [E, N1], or [0] without biases
    dw2: torch.Tensor  # [E, d, n]
    db2: torch.Tensor  # [E, d], or [0] without biases
    d_logits: torch.Tensor  # [T, E]
    d_router_bias: torch.Tensor  # [E] = Σ_t d_logits (the router bias's gradient)


class GeneralResult(NamedTuple):
    out: torch.Tensor  # [T, d]
    dx: torch.Tensor  # [T, d]
    dw1: torch.Tensor
    db1: torch.Tensor  # [0] without biases
    dw2: torch.Tensor
    db2: torch.Tensor  # [0] without biases
    d_score: torch.Tensor  # [R]


def topk(
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
    """Top-K routing of logits [T, E] -> (scores [T, K] float64, experts [T, K] int32)."""
    routing = parse_enum(RoutingMethod, routing, "routing")
    scores, experts = _ops_namespace().reference_topk(logits, num_experts_per_tok, routing.value,
                                                      renormalize, selection_bias, float(routed_scaling_factor),
                                                      n_group, topk_group)
    return scores, experts


def token_rounding(
    logits: torch.Tensor,
    num_experts_per_tok: int,
    *,
    mode: Union[TokenRounding, str] = TokenRounding.NEAREST,
    tile_m: int = 128,
    seed: int = 0,
) -> TokenRoundingResult:
    """Token rounding of logits [T, E] -> the rounded routing list."""
    mode = parse_enum(TokenRounding, mode, "mode")
    return TokenRoundingResult(*_ops_namespace().reference_token_rounding(
        logits, num_experts_per_tok, mode.value, tile_m, seed))


def metadata(token: torch.Tensor, expert: torch.Tensor, num_tokens: int,
             num_experts: int) -> Metadata:
    """Routing metadata of a list ordered by token: rows grouped by expert, token, then pair."""
    return Metadata(*_ops_namespace().reference_metadata(token, expert, num_tokens, num_experts))


def layer(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    dout: torch.Tensor,
    *,
    num_experts_per_tok: int,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    selection_bias: Optional[torch.Tensor] = None,
    d_aux: float = 0.0,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    token_rounding: Union[TokenRounding, str] = TokenRounding.NONE,
    tile_m: int = 128,
    seed: int = 0,
    router_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    glu_clamp: Optional[GluClamp] = None,
) -> LayerResult:
    """Forward and backward of the whole layer in float64, for dout [T, d] and d_aux."""
    clamp = glu_clamp_list(resolve_glu_clamp(activation, glu_clamp))
    return LayerResult(*_ops_namespace().reference_layer(
        x, router_weight, w1, b1, w2, b2, selection_bias, dout, float(d_aux),
        num_experts_per_tok,
        parse_enum(ActivationType, activation, "activation").value,
        parse_enum(GateUpLayout, layout, "layout").value,
        parse_enum(RoutingMethod, routing, "routing").value,
        renormalize,
        parse_enum(TokenRounding, token_rounding, "token_rounding").value,
        tile_m, seed, router_bias, float(routed_scaling_factor), n_group, topk_group, glu_clamp=clamp))


def general(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    token: torch.Tensor,
    expert: torch.Tensor,
    score: torch.Tensor,
    dout: torch.Tensor,
    *,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    glu_clamp: Optional[GluClamp] = None,
) -> GeneralResult:
    """Forward and backward of the experts on a general routing list (ordered by token)."""
    clamp = glu_clamp_list(resolve_glu_clamp(activation, glu_clamp))
    return GeneralResult(*_ops_namespace().reference_general(
        x, w1, b1, w2, b2, token, expert, score, dout,
        parse_enum(ActivationType, activation, "activation").value,
        parse_enum(GateUpLayout, layout, "layout").value, glu_clamp=clamp))
