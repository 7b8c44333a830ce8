"""The `machmoe` backend: the layer on this library's sm_90a kernels, forward and backward.

Forward, one C++ call (machmoe::layer_forward): logits = x · Wrᵀ (cuBLAS, fp32 out) -> top-K router
(or token rounding) -> routing_metadata -> grouped_gemm (gather + GLU/activation epilogue: H, A) ->
grouped_gemm (store Y) -> aggregate (scores) -> aux loss. It returns a `saved` block (H, scores,
routing metadata, logits) and nothing else is kept for the backward: the activation memory of
the layer is x, H and O(T·K + T·E) routing state.
Backward, one C++ call (machmoe::layer_backward, docs/BACKWARD.md): from x, the weights and
`saved`, every gradient (dx, router weight, w1, b1, w2, b2), the aux loss's included.

General routing lists (moe_general), the same way: forward = machmoe::experts_forward (routing
metadata of the given list -> the two grouped GEMMs -> aggregate with the scores), saving H, a copy
of the scores and the metadata; backward = machmoe::experts_backward: dx, the weights', the biases'
and the scores' gradients (no router, no aux loss).

No host synchronisation: row counts stay on the device (expert_offsets), and the aux loss's
gradient is passed to the backward as a device scalar. Buffers are sized for R = T·K rows, or for
the rounded list's capacity with token rounding, or for the general list's length.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _ops
from .enums import ActivationType, GateUpLayout, GluClamp, RoutingMethod, TokenRounding, glu_clamp_list
from .fp8_weights import concatenate_gate_up, interleave_gate_up


def _check(x: torch.Tensor, d: int, n: int) -> None:
    """What the kernels run: the op library built with them, x on an sm_90 device, bf16, 16-byte
    rows. backend='machmoe' was asked for explicitly: each gap is an error saying what to do."""
    if x.device.type != "cuda":
        raise ValueError(f"the machmoe backend runs on CUDA tensors; use backend='torch' or 'auto' "
                         f"on the CPU (x is on {x.device})")
    _ops.require_ops()
    if torch.compiler.is_compiling():
        # torch.compile traces this once with the device of the real inputs (a constant to it).
        why = _ops.kernels_unavailable_reason(x.device)
    elif is_fake(x):
        # FakeTensorMode runs no kernel: the ops' fake implementations give the shapes, so no
        # device needs to be present.
        why = None if _ops.kernels_compiled() else "the library was built without the GPU layer kernels"
    else:
        why = _ops.kernels_unavailable_reason(x.device)
    if why is not None:
        raise RuntimeError(f"backend='machmoe': the kernels cannot run here: {why} "
                           "(backend='auto' or 'torch' runs the torch backend instead)")
    if x.dtype != torch.bfloat16:
        raise NotImplementedError(f"machmoe backend: the kernels take bfloat16 x and weights; got {x.dtype} "
                                  "(use backend='torch' for other dtypes)")
    if d % 8 or n % 8:
        raise NotImplementedError(f"machmoe backend: hidden_size and intermediate_size must be multiples of 8 "
                                  f"(16-byte rows); got d={d}, n={n} (use backend='torch')")


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


class _Layer(torch.autograd.Function):
    """The layer as one autograd node: forward = machmoe::layer_forward, backward =
    machmoe::layer_backward. Saves x, the weights (which the caller holds anyway) and the `saved`
    block; nothing else. selection_bias changes only which experts are selected: no gradient.
    router_opts: (routed_scaling_factor, n_group, topk_group). Shared experts (w1s [S, N1, d],
    b1s, w2s, b2s, shared_scores [T] fp32 or None, or Qwen's gate shared_gate [1, d] whose sigmoid
    the op computes) run in the same launches as the routed ones; the op returns their weight
    gradients after the routed experts' ([E+S, ...]), split here.
    fp8: None (bf16), or (cache, concatenated) for precision FP8: the op reads the weights' FP8
    copies from the FP8WeightCache (fetched again by the backward: the same copies while the weights
    are unchanged; weights changed in between are read as they are then, as the bf16 backward reads
    them), and dw1 comes back in the interleaved order of those copies (concatenated again here
    when w1 is)."""

    @staticmethod
    def forward(ctx, x, router_weight, w1, b1, w2, b2, selection_bias, router_bias, opts, router_opts, glu_clamp,
                w1s, b1s, w2s, b2s, shared_scores, shared_gate, fp8=None):
        out, aux, saved = torch.ops.machmoe.layer_forward(
            x, router_weight, w1, b1, w2, b2, selection_bias, *opts, True, router_bias, *router_opts,
            glu_clamp=glu_clamp, w1_shared=w1s, b1_shared=b1s, w2_shared=w2s, b2_shared=b2s,
            shared_scores=shared_scores, shared_gate=shared_gate, fp8_weights=_fp8_copies(fp8, w1, w2))
        ctx.save_for_backward(x, router_weight, w1, b1, w2, b2, router_bias, w1s, b1s, w2s, b2s, shared_gate,
                              saved)  # saved last
        ctx.opts = opts
        ctx.router_opts = router_opts
        ctx.glu_clamp = glu_clamp
        ctx.has_shared_scores = shared_scores is not None
        ctx.fp8 = fp8
        # Unused outputs arrive as None (no zero tensors made): d_aux None means 0.
        ctx.set_materialize_grads(False)
        return out, aux

    @staticmethod
    def backward(ctx, dout, d_aux):
        x, router_weight, w1, b1, w2, b2, router_bias, w1s, b1s, w2s, b2s, shared_gate, saved = ctx.saved_tensors
        K, activation, layout, routing, renormalize, rounding, tile_m, _seed = ctx.opts
        dout = torch.zeros_like(x) if dout is None else dout.to(torch.bfloat16).contiguous()  # [T, d]
        # d_aux stays a device tensor: the backward reads it on the stream (no .item() sync).
        dx, dwr, dw1, db1, dw2, db2, dbr, d_shared_scores, d_shared_gate = torch.ops.machmoe.layer_backward(
            x, router_weight, w1, b1, w2, b2, saved, dout, d_aux, K, activation, layout, routing, renormalize,
            rounding, tile_m, router_bias, *ctx.router_opts, glu_clamp=ctx.glu_clamp, w1_shared=w1s,
            b1_shared=b1s, w2_shared=w2s, b2_shared=b2s, has_shared_scores=ctx.has_shared_scores,
            shared_gate=shared_gate, fp8_weights=_fp8_copies(ctx.fp8, w1, w2))
        if ctx.fp8 is not None and ctx.fp8[1]:  # the FP8 copies' interleaved rows -> w1's concatenated ones
            dw1 = concatenate_gate_up(dw1)
        dw1s = db1s = dw2s = db2s = None
        if w1s is not None:  # [E+S, ...] -> the routed experts' [E, ...] and the shared ones' [S, ...]
            E = w1.shape[0]
            dw1, dw1s = dw1[:E], dw1[E:]
            dw2, dw2s = dw2[:E], dw2[E:]
            if db1 is not None:
                db1, db1s = db1[:E], db1[E:]
                db2, db2s = db2[:E], db2[E:]
        return (dx, dwr, dw1, db1, dw2, db2, None, dbr, None, None, None, dw1s, db1s, dw2s, db2s,
                d_shared_scores, d_shared_gate, None)


def _fp8_row_order(fp8, b1):
    """b1 in the row order of the FP8 copies, which hold w1's rows interleaved whatever w1's layout
    (with fp8 = (cache, concatenated)): permuted when concatenated, by a differentiable
    permutation, so that db1 comes back in b1's own order through autograd."""
    if fp8[1] and b1 is not None:
        return interleave_gate_up(b1.unsqueeze(-1)).squeeze(-1)
    return b1


def _fp8_copies(fp8, w1, w2):
    """The weights' FP8 copies as the layer ops take them (fp8_weights), or None for bf16."""
    if fp8 is None:
        return None
    cache, concatenated = fp8
    return [*cache.get(w1, True, concatenated), *cache.get(w2, True)]


def moe(x, router_weight, w1, b1, w2, b2, K: int, activation: ActivationType, layout: GateUpLayout,
        routing: RoutingMethod, renormalize: bool, selection_bias, rounding: TokenRounding, tile_m: int,
        seed: int, router_bias=None, router_options=None, glu_clamp: Optional[GluClamp] = None,
        shared=None, fp8=None):
    """The layer on the kernels. shared: None, or (w1s, b1s, w2s, b2s, shared_scores, shared_gate)
    of S shared experts of the routed experts' size, weighted by shared_scores [T] fp32, or by
    sigmoid(x · shared_gateᵀ) (Qwen's gate [1, d], computed in the layer's launches), or by 1."""
    T, d = x.shape
    n = w2.shape[2]
    _check(x, d, n)
    x, router_weight, w1, w2, b1, b2, router_bias = (_contiguous(t) for t in (x, router_weight, w1, w2, b1, b2,
                                                                              router_bias))
    bias = None if selection_bias is None else selection_bias.detach().float().contiguous()
    if fp8 is not None:
        b1 = _fp8_row_order(fp8, b1)
        layout = GateUpLayout.INTERLEAVED
    opts = (K, activation.value, layout.value, routing.value, renormalize, rounding.value, tile_m, seed)
    router_opts = (1.0, 1, 1) if router_options is None else (float(router_options.routed_scaling_factor),
                                                              int(router_options.n_group),
                                                              int(router_options.topk_group))
    glu = glu_clamp_list(glu_clamp)  # [] or [alpha, limit, up_offset, clamp_after]
    shared = (None,) * 6 if shared is None else tuple(_contiguous(t) for t in shared)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (x, router_weight, w1, b1, w2, b2, router_bias, *shared))):
        # Inference: no autograd node, and H is not saved (write_h false: the returned block stops
        # before it; the FP8 up-projection's copy of H goes to workspace).
        w1s, b1s, w2s, b2s, shared_scores, shared_gate = shared
        out, aux, _ = torch.ops.machmoe.layer_forward(x, router_weight, w1, b1, w2, b2, bias, *opts, False,
                                                      router_bias, *router_opts, glu_clamp=glu, w1_shared=w1s,
                                                      b1_shared=b1s, w2_shared=w2s, b2_shared=b2s,
                                                      shared_scores=shared_scores, shared_gate=shared_gate,
                                                      fp8_weights=_fp8_copies(fp8, w1, w2))
        return out, aux
    return _Layer.apply(x, router_weight, w1, b1, w2, b2, bias, router_bias, opts, router_opts, glu, *shared, fp8)


class _General(torch.autograd.Function):
    """The experts on a general routing list as one autograd node: forward =
    machmoe::experts_forward, backward = machmoe::experts_backward. Saves x, the weights, the list's
    int32 indices (which the caller holds anyway) and the `saved` block (H, the fp32 scores, the
    routing metadata); nothing else. The indices get no gradient.

    `repeats` m > 1 runs each expert as m kernel experts with the same weights (expert e's copies
    are e·m .. e·m + m − 1 of the list): the weight-gradient GEMMs then split an expert's rows m
    ways, which keeps the GPU busy when there are few experts with many rows each (shared
    experts). The copies exist during each kernel call only; the m partial weight gradients are
    summed (fp32 accumulation) into the expert's.

    fp8: None (bf16), or (cache, concatenated) for precision FP8, as _Layer's (repeats 1 only)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, scores, token, expert, opts, repeats=1, fp8=None):
        # scores [R] any float dtype -> fp32 for the kernels; token/expert [R] int32.
        # opts: (activation, layout, glu_clamp list)
        w1r, b1r, w2r, b2r = (_repeat(t, repeats) for t in (w1, b1, w2, b2))
        out, saved = torch.ops.machmoe.experts_forward(x, w1r, b1r, w2r, b2r, scores.float().contiguous(), token,
                                                       expert, *opts, fp8_weights=_fp8_copies(fp8, w1, w2))
        ctx.save_for_backward(x, w1, b1, w2, b2, token, expert, saved)
        ctx.opts = opts
        ctx.repeats = repeats
        ctx.fp8 = fp8
        ctx.scores_dtype = scores.dtype
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 11
        x, w1, b1, w2, b2, token, expert, saved = ctx.saved_tensors
        m = ctx.repeats
        dout = dout.to(torch.bfloat16).contiguous()  # [T, d]
        dx, dw1, db1, dw2, db2, d_scores = torch.ops.machmoe.experts_backward(
            x, *(_repeat(t, m) for t in (w1, b1, w2, b2)), token, expert, saved, dout, *ctx.opts,
            fp8_weights=_fp8_copies(ctx.fp8, w1, w2))
        if ctx.fp8 is not None and ctx.fp8[1]:  # the FP8 copies' interleaved rows -> w1's concatenated ones
            dw1 = concatenate_gate_up(dw1)
        dw1, db1, dw2, db2 = (_sum_repeats(g, m) for g in (dw1, db1, dw2, db2))
        return dx, dw1, db1, dw2, db2, d_scores.to(ctx.scores_dtype), None, None, None, None, None


def _repeat(t: Optional[torch.Tensor], m: int) -> Optional[torch.Tensor]:
    """[E, ...] -> [E·m, ...], each expert's slice m times in a row."""
    return t if t is None or m == 1 else t.repeat_interleave(m, dim=0)


def _sum_repeats(g: Optional[torch.Tensor], m: int) -> Optional[torch.Tensor]:
    """[E·m, ...] -> [E, ...]: the sum of each expert's m partial gradients (fp32 accumulation)."""
    if g is None or m == 1:
        return g
    return g.unflatten(0, (-1, m)).sum(dim=1, dtype=torch.float32).to(g.dtype)


def moe_general(x, w1, b1, w2, b2, scores, token_idx, expert_idx, activation: ActivationType,
                layout: GateUpLayout, glu_clamp: Optional[GluClamp] = None, repeats: int = 1, fp8=None):
    """out [T, d] of the experts on the list (scores, token_idx, expert_idx) [R], differentiable in x,
    the weights, the biases and the scores. machmoe.functional has checked the list (ordered by
    token, no repeated (token, expert) pair: the kernels' metadata would merge a repeat into one
    row, whose backward is wrong; a pair whose expert is out of range gets no row). With repeats
    m, expert_idx counts kernel experts (E·m of them, see _General). fp8: None, or (cache,
    concatenated): the experts in FP8 on the weights' cached FP8 copies (precision FP8)."""
    T, d = x.shape
    n = w2.shape[2]
    _check(x, d, n)
    if fp8 is not None:
        if repeats != 1:
            raise ValueError(f"repeats must be 1 with the FP8 experts (their copies are per expert); got {repeats}")
        b1 = _fp8_row_order(fp8, b1)
        layout = GateUpLayout.INTERLEAVED
    x, w1, w2, b1, b2 = (_contiguous(t) for t in (x, w1, w2, b1, b2))
    tok = token_idx.to(torch.int32).contiguous()
    exp = expert_idx.to(torch.int32).contiguous()
    return _General.apply(x, w1, b1, w2, b2, scores, tok, exp,
                          (activation.value, layout.value, glu_clamp_list(glu_clamp)), repeats, fp8)
