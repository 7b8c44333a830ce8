"""The experts of the all-gather exchange (machmoe.expert_exchange) on the kernels, with every
transfer of the forward and the backward running beside the experts' GEMMs.

The gathered rows are kept rotated: this rank's own T tokens first, then those of the ranks after
it (symmetric_exchange.rotated_place), so that the own tokens are the "early" ones of a split
experts call (machmoe::ExpertsForwardPart, docs/LAYER.md): the kernels cut each expert's rows at
its first row of another rank's token. Forward, W ranks, x [T, d]:

    side streams                             this stream
    pull the peers' routing, -------->       the gathered routing list [W·T·K]
    then their x blocks, -----         early rows: routing metadata, up-projection of the
    (beside: copy x into xg)  |                own tokens' rows, from x (xg is not read)
                              '------->      late rows: both projections of the peers' tokens'
                                               rows, out's peer blocks [(W-1)·T, d]
    send out's peer blocks    <--------      early out: down-projection of the own rows, out's
    to their ranks, pull theirs                own block
                                    ---->    y = Σ_q (rank q's partial sum of this rank's tokens)

x's own block of xg is copied on a stream of its own, beside the pulls: the late rows do not
read it (the backward does), and queued behind the pulls it held the late rows up by its copy
(~40 us at 7B-a's T·d).

The routing (scores and experts [T, K]) and x travel in one round of the staging buffer (one pair
of barriers), the routing's blocks first: only they are waited for before the early rows. The
backward likewise pulls the output gradient's peer blocks while the dH kernel runs on the own
tokens' rows, and sends dx's peer blocks and the pairs' d scores to their ranks, in one round,
while the weight gradients run. (With a pair capacity the caller gathers and compacts the routing
itself and passes the list; its d scores then go back by the caller's reduce-scatter.) Transfers
are copy-engine pulls through symmetric memory (machmoe.symmetric_exchange); each is ordered
against the kernels by stream waits only, so nothing waits for the host and the sequence is
CUDA-graph capturable. out and dx are written by the kernels straight into the staging buffer the
peers pull from. The side stream's barriers are small kernels: they are queued before the kernels
beside them are launched, and the GEMMs that run beside a transfer's end (the forward's last
part, the weight gradients) leave two SMs free, so that the barriers find an SM.

Each part is bitwise the whole call's (the kernels compute every row the same way), and the sums
over the ranks are taken in rank order in float32 and rounded once: out and dx are bitwise the
plain exchange's, and every result is bitwise equal over runs. The weight gradients add each
expert's rows in the rotated order, so on ranks > 0 they differ from the plain exchange's in the
last bits.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import _ops, symmetric_exchange

# SMs the GEMMs beside a transfer leave free (the forward's last part, the weight gradients): the
# transfers are copy-engine copies and two barriers, each barrier one small kernel that needs an SM
# to start, and a persistent GEMM's CTAs hold every SM they are given until it ends.
_SMS_LEFT_TO_THE_EXCHANGE = 2


@functools.lru_cache(maxsize=None)
def _stream_of(index: int, role: str) -> torch.cuda.Stream:
    """A side stream per GPU and role, made once: "transfers" (the pulls and their barriers) and
    "copies" (this rank's own blocks copied into the gathered tensors, beside the pulls: behind
    them on one stream they would hold up the part that waits for the pulls)."""
    return torch.cuda.Stream(device=index)


def _gemm_ctas(device: torch.device) -> int:
    """The persistent CTAs of GEMMs that run beside a transfer."""
    return max(1, _ops.sm_count(device) - _SMS_LEFT_TO_THE_EXCHANGE)


def _streams(device: torch.device) -> tuple:
    """(this stream, the transfers' side stream, the copies' side stream) of a CUDA device. (The
    index given, current_stream skips the lookup of the current device, which costs host time per
    call.)"""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_stream(index), _stream_of(index, "transfers"), _stream_of(index, "copies")


def _rotated_gather(ts: list, W: int, group_name: str, here, side, copies, whole_first: int = 0) -> list:
    """Each t [T, ...] of ts -> [W·T, ...] rotated, in one round of transfers: the peers' blocks
    pulled on the side stream, t itself copied into its block on the copies stream, once the side
    stream has put t into the staging buffer (the copy engines ran the two copies one after the
    other, and the peers wait at the barrier for the staging one). The first whole_first outs are
    whole on this stream when it returns; of the others, the peers' blocks are there once this
    stream waits for the side stream (which also waits out the round's last barrier), and the own
    blocks once it waits for the copies stream (the first part of a split call reads t itself, not
    its block)."""
    outs = [t.new_empty((W * t.shape[0],) + tuple(t.shape[1:])) for t in ts]
    pulled = torch.cuda.Event()

    def own_blocks():  # on the copies stream, after the staging copies (queued on the side stream)
        copies.wait_stream(side)
        torch.cuda.set_stream(copies)
        for i, (t, out) in enumerate(zip(ts, outs)):
            out[: t.shape[0]].copy_(t)
            if i + 1 == whole_first:
                here.wait_stream(copies)
        torch.cuda.set_stream(side)

    side.wait_stream(here)
    torch.cuda.set_stream(side)  # (torch.cuda.stream's context, without its lookups)
    try:
        symmetric_exchange.gather_parts(list(zip(ts, outs)), W, group_name, rotated=True, staged=own_blocks,
                                        after=lambda i: pulled.record(side) if i + 1 == whole_first else None)
    finally:
        torch.cuda.set_stream(here)
    if whole_first:
        here.wait_event(pulled)
    for t in ts + outs:
        t.record_stream(side)
        t.record_stream(copies)
    return outs


def _send_peer_blocks(staged: list, W: int, group_name: str, here, side) -> list:
    """staged: tensors [W·T, ...] rotated, in the staging buffer as symmetric_exchange.staging_views
    laid them out, their peer blocks final on this stream (their own blocks may still be in the
    making). For each, the W blocks that sum to this rank's rows, in rank order, pulled on the side
    stream in one round (its own block a view of the tensor)."""
    side.wait_stream(here)
    torch.cuda.set_stream(side)
    try:
        return symmetric_exchange.pull_staged(staged, W, group_name)
    finally:
        torch.cuda.set_stream(here)


def _sum_parts(pulled: list, staged: list, here, side) -> list:
    """Σ of each list of blocks that _send_peer_blocks returned for `staged` (in rank order,
    symmetric_exchange.sum_blocks, into fresh tensors), on this stream once the side stream has
    pulled them. A tensor's own block (its first, in the staging buffer) is the one not pulled."""
    here.wait_stream(side)
    for parts, t in zip(pulled, staged):
        for p in parts:
            if p.data_ptr() != t.data_ptr():  # pulled on the side stream: used here now
                p.record_stream(here)
    return [symmetric_exchange.sum_blocks(parts) for parts in pulled]


def _experts_bytes(T: int, d: int, w1: torch.Tensor, w2: torch.Tensor, R: int, activation: str, bias: bool):
    return _workspace_bytes(T, d, w2.shape[2], w1.shape[0], R, activation, bias)


@functools.lru_cache(maxsize=64)
def _workspace_bytes(T: int, d: int, n: int, E: int, R: int, activation: str, bias: bool) -> tuple:
    # (A plain function of the sizes; cached: an op call per experts call costs host time that a
    # small layer's GPU time does not hide.)
    return tuple(torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, R, activation, bias))


def pack_routing(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """scores [R, K] float and experts [R, K] -> [R, 2K] integers of the scores' width: the scores'
    bits beside the experts, so that one transfer carries both (unpack_routing undoes it)."""
    twin = {4: torch.int32, 8: torch.int64}[scores.element_size()]
    return torch.cat([scores.contiguous().view(twin), experts.to(twin)], 1)


def unpack_routing(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_routing's [R, 2K] -> (scores [R, K] of dtype, experts [R, K] of the packed integers)."""
    K = packed.shape[1] // 2
    return packed[:, :K].contiguous().view(dtype), packed[:, K:].contiguous()


def row_of_each_pair(rows: int, K: int, device) -> torch.Tensor:
    """[rows·K] int32: 0, ..., 0, 1, ..., 1, ... (K each), the row of each pair of a [rows, K]
    routing in (row, k) order (nothing is read back to the host)."""
    return torch.arange(rows, device=device, dtype=torch.int32).repeat_interleave(K)


def _gather_routing(x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, first_expert: int, W: int,
                    group_name: str, here, side, copies) -> tuple:
    """x [T, d] and this rank's routing (scores [T, K] fp32, experts [T, K] int32 global ids) gathered
    rotated in one round of the staging buffer: the routing's blocks pulled first, then x's, on the
    side stream. -> (xg [W·T, d], still in the making on the side streams; the routing list over
    xg's rows: scores fp32, token, expert int32 [W·T·K] in (row, k) order, ready on this stream
    (which waits for the routing's blocks only), experts of other ranks out of [0, E/W))."""
    T, K = scores.shape
    rg, xg = _rotated_gather([pack_routing(scores, experts), x], W, group_name, here, side, copies, whole_first=1)
    score, expert = (t.reshape(-1) for t in unpack_routing(rg, torch.float32))
    if first_expert:
        expert -= first_expert
    return xg, score, row_of_each_pair(W * T, K, x.device), expert


def _forward(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
             b2: Optional[torch.Tensor], scores: torch.Tensor, token: Optional[torch.Tensor], expert: torch.Tensor,
             first_expert: int, activation: str, layout: str, glu_clamp: list[float], W: int,
             group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, d], xg [W·T, d], saved, token, expert): this rank's experts on every rank's tokens, x
    [T, d] gathered rotated. With token None, scores [T, K] fp32 and expert [T, K] int32 (global
    ids) are this rank's routing, gathered here with x (_gather_routing; first_expert = this rank's
    first expert), and the list built from them is returned (token, expert [W·T·K]); otherwise
    (scores fp32, token, expert int32 [R], ordered by token) is the list over the rotated rows,
    experts of other ranks out of range, and the returned token and expert are empty. xg, saved
    and the list are what the backward reads."""
    T, d = x.shape
    ops = torch.ops.machmoe
    here, side, copies = _streams(x.device)
    opts = (activation, layout, glu_clamp)
    # out is written where the peers pull it (no copy into the staging buffer); the gather below
    # is done with that buffer before the kernels write into it (the late part waits for it), and
    # the buffer is grown first to what the gather needs too.
    gather = [((T, d), x.dtype)] + ([((T, 2 * scores.shape[1]), torch.int32)] if token is None else [])
    out = symmetric_exchange.staging_views(group_name, [((W * T, d), x.dtype)],
                                           reserve_bytes=symmetric_exchange.staging_bytes(gather))[0]
    if token is None:
        xg, scores, token, expert = _gather_routing(x, scores, expert, first_expert, W, group_name, here, side,
                                                    copies)
        listed = (token, expert)
    else:
        (xg,) = _rotated_gather([x], W, group_name, here, side, copies)
        listed = (expert.new_empty(0), expert.new_empty(0))
    saved_bytes, fwd_bytes, _ = _experts_bytes(W * T, d, w1, w2, token.numel(), activation, b1 is not None)
    saved = x.new_empty(saved_bytes, dtype=torch.uint8)
    workspace = x.new_empty(fwd_bytes, dtype=torch.uint8)
    args = (xg, w1, b1, w2, b2, scores, token, expert, out, saved, workspace)
    ops.experts_forward_part(*args, "early_rows", T, *opts, x_early=x)  # x's rows: xg's are still in the making
    here.wait_stream(side)  # the peers' rows have landed (the late rows are theirs only)
    ops.experts_forward_part(*args, "late_rows", T, *opts)
    pulled = _send_peer_blocks([out], W, group_name, here, side)
    ops.experts_forward_part(*args, "early_out", T, *opts, _gemm_ctas(x.device))
    here.wait_stream(copies)  # xg's own block, which the backward reads (long since copied)
    return (_sum_parts(pulled, [out], here, side)[0], xg, saved) + listed


overlapped_experts_forward = torch.library.custom_op("machmoe::overlapped_experts_forward", _forward,
                                                     mutates_args=())


@overlapped_experts_forward.register_fake
def _(x, w1, b1, w2, b2, scores, token, expert, first_expert, activation, layout, glu_clamp, W, group_name):
    from . import _fake

    T, d = x.shape
    R = W * scores.numel() if token is None else token.numel()
    saved = _fake.experts_saved_bytes(W * T, R, w2.shape[2], w1.shape[0], activation)
    listed = R if token is None else 0
    return (x.new_empty(T, d), x.new_empty(W * T, d), x.new_empty(saved, dtype=torch.uint8),
            x.new_empty(listed, dtype=torch.int32), x.new_empty(listed, dtype=torch.int32))


def _backward(xg: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
              b2: Optional[torch.Tensor], token: torch.Tensor, expert: torch.Tensor, saved: torch.Tensor,
              dout: torch.Tensor, K: int, activation: str, layout: str, glu_clamp: list[float], W: int,
              group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
    """(dx [T, d], d_scores, dw1, db1, dw2, db2; a bias's gradient is empty without it) of
    overlapped_experts_forward, from its xg, saved and list and the output gradient dout [T, d].
    K > 0 (the forward gathered the routing): d_scores [T, K] of this rank's routing, each pair's
    summed over the ranks in the same round as dx's blocks; K = 0: d_scores [R] of the list."""
    T, d = dout.shape
    ops = torch.ops.machmoe
    here, side, copies = _streams(xg.device)
    R = token.numel()
    _, _, bwd_bytes = _experts_bytes(W * T, d, w1, w2, R, activation, b1 is not None)
    opts = (activation, layout, glu_clamp)
    # dx [W·T, d] (and with K the pairs' d scores [R]) written where the peers pull them, as the
    # forward's out; the buffer holds dout's gather too (dx's rows are written after it).
    staged = [((W * T, d), dout.dtype)] + ([((R,), torch.float32)] if K else [])
    staged = symmetric_exchange.staging_views(group_name, staged)
    dxg = staged[0]
    (dg,) = _rotated_gather([dout], W, group_name, here, side, copies)
    d_scores = staged[1] if K else dout.new_empty(R, dtype=torch.float32)
    workspace = dout.new_empty(bwd_bytes, dtype=torch.uint8)
    args = (xg, w1, b1, w2, b2, token, expert, saved, dg, dxg, d_scores, workspace)
    ops.experts_backward_data_part(*args, "early_rows", T, *opts, dout_early=dout)  # dout's rows, as the forward
    here.wait_stream(side)  # the peers' output gradients have landed (the late rows are theirs only)
    ops.experts_backward_data_part(*args, "late_rows", T, *opts)
    pulled = _send_peer_blocks(staged, W, group_name, here, side)
    here.wait_stream(copies)  # dg's own block, which the weight gradients read
    dw1, db1, dw2, db2 = ops.experts_backward_weights(xg, w1, b1, w2, b2, token, expert, saved, dg, workspace, *opts,
                                                      _gemm_ctas(xg.device))
    sums = _sum_parts(pulled, staged, here, side)
    dx = sums[0]
    if K:
        d_scores = sums[1].view(T, K)
    # (an op's outputs may not alias one another: a fresh empty tensor for each missing bias)
    return (dx, d_scores, dw1, xg.new_empty(0) if db1 is None else db1, dw2,
            xg.new_empty(0) if db2 is None else db2)


overlapped_experts_backward = torch.library.custom_op("machmoe::overlapped_experts_backward", _backward,
                                                      mutates_args=())


@overlapped_experts_backward.register_fake
def _(xg, w1, b1, w2, b2, token, expert, saved, dout, K, activation, layout, glu_clamp, W, group_name):
    E, n1, d = w1.shape
    T = dout.shape[0]
    d_scores = dout.new_empty(T, K, dtype=torch.float32) if K else dout.new_empty(token.shape[0], dtype=torch.float32)
    return (dout.new_empty(dout.shape), d_scores, w1.new_empty(w1.shape),
            w1.new_empty(E, n1) if b1 is not None else w1.new_empty(0), w2.new_empty(w2.shape),
            w2.new_empty(E, d) if b2 is not None else w2.new_empty(0))


def _op(custom_op, function):
    """The custom op under torch.compile (an opaque node of the graph); in eager mode its Python
    function, called directly: the dispatcher's round trip costs host time per call that a small
    layer's GPU time does not hide."""
    return custom_op if torch.compiler.is_compiling() else function


class OverlappedExperts(torch.autograd.Function):
    """x [T, d] -> out [T, d]: overlapped_experts_forward; its backward overlapped_experts_backward.
    With token None, scores [T, K] and expert [T, K] are this rank's routing (gathered with x, its
    experts' ids offset by first_expert); else the list over the rotated rows ([R] each). scores
    (any float dtype) get their gradient in their dtype and shape."""

    @staticmethod
    def forward(ctx, x, scores, token, expert, first_expert, w1, b1, w2, b2, opts, W, group_name):
        forward = _op(overlapped_experts_forward, _forward)
        out, xg, saved, listed_token, listed_expert = forward(
            x, w1, b1, w2, b2, scores.float().contiguous(), token, expert.to(torch.int32).contiguous(), first_expert,
            *opts, W, group_name)
        gathered = token is None
        if gathered:
            token, expert = listed_token, listed_expert
        ctx.save_for_backward(xg, w1, b1, w2, b2, token, expert, saved)
        ctx.opts, ctx.W, ctx.group_name = opts, W, group_name
        ctx.K = scores.shape[1] if gathered else 0
        ctx.scores_shape, ctx.scores_dtype = scores.shape, scores.dtype
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 12
        xg, w1, b1, w2, b2, token, expert, saved = ctx.saved_tensors
        dx, d_scores, dw1, db1, dw2, db2 = _op(overlapped_experts_backward, _backward)(
            xg, w1, b1, w2, b2, token, expert, saved, dout.to(torch.bfloat16).contiguous(), ctx.K, *ctx.opts, ctx.W,
            ctx.group_name)
        d_scores = d_scores.reshape(ctx.scores_shape).to(ctx.scores_dtype)
        return (dx, d_scores, None, None, None, dw1, db1 if b1 is not None else None, dw2,
                db2 if b2 is not None else None, None, None, None)
