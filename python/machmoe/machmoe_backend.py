"""The `machmoe` backend: the layer forward on this library's sm_90a kernels.

    logits = x · Wrᵀ (cuBLAS, fp32 out) -> topk_router -> routing_metadata -> grouped_gemm (gather
    + GLU/activation epilogue: H, A) -> grouped_gemm (contiguous A, store Y) -> aggregate (scores)
    -> aux loss; for top-K routing all of it in one C++ call (machmoe::layer_forward).

No host synchronisation: row counts stay on the device (expert_offsets); buffers are sized for
R = T·K rows, or for the rounded list's capacity with token rounding. The backward kernels are
issue #5: a call that would need gradients is refused with NotImplementedError rather than
silently detaching.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ops
from .enums import ActivationType, GateUpLayout, RoutingMethod, TokenRounding, is_glu


def _check(x: torch.Tensor, tensors: dict, d: int, n: int) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"the machmoe backend runs on CUDA tensors; use backend='torch' on the CPU "
                         f"(x is on {x.device})")
    _ops.require_ops()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors.values()):
        raise NotImplementedError("machmoe backend: the backward kernels are not built yet (issue #5); run the "
                                  "forward under torch.no_grad() / torch.inference_mode(), or use "
                                  "backend='torch' to train")
    if x.dtype != torch.bfloat16:
        raise NotImplementedError(f"machmoe backend: the kernels take bfloat16 x and weights; got {x.dtype} "
                                  "(use backend='torch' for other dtypes)")
    if d % 8 or n % 8:
        raise NotImplementedError(f"machmoe backend: hidden_size and intermediate_size must be multiples of 8 "
                                  f"(16-byte rows); got d={d}, n={n} (use backend='torch')")


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _experts(x, w1, b1, w2, b2, activation, layout, experts_by, T, E, R, scores_flat, pair_token=None):
    """The expert MLP and the aggregation for pairs given by `experts_by` ([T, K] or [R])."""
    ops = torch.ops.machmoe
    offs, row_token, _, pair_row, tok_offs, _ = ops.routing_metadata(experts_by, pair_token, T, E)
    epi = "glu" if is_glu(activation) else "activation"
    _, a = ops.grouped_gemm(x, row_token, offs, w1, b1, R, epi, activation.value, layout.value)
    y, _ = ops.grouped_gemm(a, None, offs, w2, b2, R, "store", activation.value, layout.value)
    return ops.aggregate(y, pair_row, tok_offs, scores_flat, x.dtype), offs


def moe(x, router_weight, w1, b1, w2, b2, K: int, activation: ActivationType, layout: GateUpLayout,
        routing: RoutingMethod, renormalize: bool, selection_bias, rounding: TokenRounding, tile_m: int,
        seed: int):
    T, d = x.shape
    E, n = w1.shape[0], w2.shape[2]
    _check(x, {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2, "b1": b1, "b2": b2}, d, n)
    x, router_weight, w1, w2, b1, b2 = (_contiguous(t) for t in (x, router_weight, w1, w2, b1, b2))
    bias = None if selection_bias is None else selection_bias.float().contiguous()
    # One C++ call for the whole layer (machmoe::layer_forward): router GEMM, top-K, metadata,
    # both grouped GEMMs, aggregation and aux loss. `saved` is what the backward will read.
    out, aux, _saved = torch.ops.machmoe.layer_forward(x, router_weight, w1, b1, w2, b2, bias, K, activation.value,
                                                       layout.value, routing.value, renormalize, rounding.value,
                                                       tile_m, seed)
    return out, aux


def moe_general(x, w1, b1, w2, b2, scores, token_idx, expert_idx, activation: ActivationType,
                layout: GateUpLayout):
    T, d = x.shape
    E, n = w1.shape[0], w2.shape[2]
    _check(x, {"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2, "scores": scores}, d, n)
    x, w1, w2, b1, b2 = (_contiguous(t) for t in (x, w1, w2, b1, b2))
    tok = token_idx.to(torch.int32).contiguous()
    exp = expert_idx.to(torch.int32).contiguous()
    out, _ = _experts(x, w1, b1, w2, b2, activation, layout, exp, T, E, tok.numel(),
                      scores.float().contiguous(), pair_token=tok)
    return out
