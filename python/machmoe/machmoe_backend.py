"""The `machmoe` backend: the layer on this library's sm_90a kernels, forward and backward.

Forward, one C++ call (machmoe::layer_forward): logits = x · Wrᵀ (cuBLAS, fp32 out) -> top-K router
(or token rounding) -> routing_metadata -> grouped_gemm (gather + GLU/activation epilogue: H, A) ->
grouped_gemm (store Y) -> aggregate (scores) -> aux loss. It returns a `saved` block (H, scores,
routing metadata, logits) and nothing else is kept for the backward (SPEC §1).
Backward, one C++ call (machmoe::layer_backward, docs/BACKWARD.md): from x, the weights and
`saved`, every gradient (dx, router weight, w1, b1, w2, b2), the aux loss's included.

No host synchronisation: row counts stay on the device (expert_offsets), and the aux loss's
gradient is passed to the backward as a device scalar. Buffers are sized for R = T·K rows, or for
the rounded list's capacity with token rounding. General routing lists (moe_general) run forward
only: their backward (gradients of the scores) is not built yet, and a call that would need
gradients is refused rather than silently detached.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ops
from .enums import ActivationType, GateUpLayout, RoutingMethod, TokenRounding, is_glu


def _check(x: torch.Tensor, d: int, n: int, no_grad_for: Optional[dict] = None) -> None:
    """What the kernels run: CUDA, the op library, bf16, 16-byte rows; and, for the entry points
    without a backward (`no_grad_for`: their differentiable inputs), no gradients asked."""
    if x.device.type != "cuda":
        raise ValueError(f"the machmoe backend runs on CUDA tensors; use backend='torch' on the CPU "
                         f"(x is on {x.device})")
    _ops.require_ops()
    if no_grad_for is not None and torch.is_grad_enabled() and \
            any(t is not None and t.requires_grad for t in no_grad_for.values()):
        raise NotImplementedError("machmoe backend: the backward of moe_general (general routing lists) is not "
                                  "built yet; run it under torch.no_grad() / torch.inference_mode(), or use "
                                  "backend='torch' to train on a general routing list")
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


class _Layer(torch.autograd.Function):
    """The layer as one autograd node: forward = machmoe::layer_forward, backward =
    machmoe::layer_backward. Saves x, the weights (which the caller holds anyway) and the `saved`
    block; nothing else. selection_bias changes only which experts are selected: no gradient."""

    @staticmethod
    def forward(ctx, x, router_weight, w1, b1, w2, b2, selection_bias, opts):
        out, aux, saved = torch.ops.machmoe.layer_forward(x, router_weight, w1, b1, w2, b2, selection_bias, *opts)
        ctx.save_for_backward(x, router_weight, w1, b1, w2, b2, saved)
        ctx.opts = opts
        # Unused outputs arrive as None (no zero tensors made): d_aux None means 0.
        ctx.set_materialize_grads(False)
        return out, aux

    @staticmethod
    def backward(ctx, dout, d_aux):
        x, router_weight, w1, b1, w2, b2, saved = ctx.saved_tensors
        K, activation, layout, routing, renormalize, rounding, tile_m, _seed = ctx.opts
        dout = torch.zeros_like(x) if dout is None else dout.to(torch.bfloat16).contiguous()  # [T, d]
        # d_aux stays a device tensor: the backward reads it on the stream (no .item() sync).
        dx, dwr, dw1, db1, dw2, db2 = torch.ops.machmoe.layer_backward(
            x, router_weight, w1, b1, w2, b2, saved, dout, d_aux, K, activation, layout, routing, renormalize,
            rounding, tile_m)
        return dx, dwr, dw1, db1, dw2, db2, None, None


def moe(x, router_weight, w1, b1, w2, b2, K: int, activation: ActivationType, layout: GateUpLayout,
        routing: RoutingMethod, renormalize: bool, selection_bias, rounding: TokenRounding, tile_m: int,
        seed: int):
    T, d = x.shape
    E, n = w1.shape[0], w2.shape[2]
    _check(x, d, n)
    x, router_weight, w1, w2, b1, b2 = (_contiguous(t) for t in (x, router_weight, w1, w2, b1, b2))
    bias = None if selection_bias is None else selection_bias.detach().float().contiguous()
    opts = (K, activation.value, layout.value, routing.value, renormalize, rounding.value, tile_m, seed)
    return _Layer.apply(x, router_weight, w1, b1, w2, b2, bias, opts)


def moe_general(x, w1, b1, w2, b2, scores, token_idx, expert_idx, activation: ActivationType,
                layout: GateUpLayout):
    T, d = x.shape
    E, n = w1.shape[0], w2.shape[2]
    _check(x, d, n, no_grad_for={"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2, "scores": scores})
    x, w1, w2, b1, b2 = (_contiguous(t) for t in (x, w1, w2, b1, b2))
    tok = token_idx.to(torch.int32).contiguous()
    exp = expert_idx.to(torch.int32).contiguous()
    out, _ = _experts(x, w1, b1, w2, b2, activation, layout, exp, T, E, tok.numel(),
                      scores.float().contiguous(), pair_token=tok)
    return out
