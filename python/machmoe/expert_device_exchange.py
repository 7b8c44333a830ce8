"""The all-to-all exchange of expert parallelism with its row counts on the device
(machmoe.distributed, exchange="all_to_all_device"): a token crosses to each rank that holds one
of its experts once, as in machmoe.expert_all_to_all, but no count is read on the host, so a
forward and backward queue ahead of the GPU and can be captured in a CUDA graph.

Rank q of W holds experts [q·E/W, (q+1)·E/W). Sizes fixed on the host, the same on every rank:
- S = max_tokens · min(K, W): the most rows a rank sends (a token goes to at most min(K, W)
  ranks); the send side's tensors have S rows, the filled ones first.
- C = capacity_rows(max_tokens, capacity_factor, W) = ceil(capacity_factor · W · max_tokens),
  at least 1: the most rows a rank receives. Each peer sends a rank at most max_tokens rows, so
  capacity_factor 1 never overflows; a balanced batch needs a fraction f of that, f the share
  of tokens that need a given rank (1 - C(E-E/W, K)/C(E, K), docs/SCALING.md), so f · b leaves
  room for an imbalance b.

Forward, per rank, on its tokens x [T, d] routed to experts [T, K] with scores [T, K]:
1. rows, on the device: owners [T, W] (token t has an expert on rank q), counts [W] rows for
   each rank; the rows are numbered rank-major, tokens ascending inside a rank (a prefix sum:
   stable, no sort). Each row carries x[t] and its K pairs for that rank: local expert id and
   score, pairs of other ranks as the sentinel id E/W (out of range: the experts drop it) and 0.
2. counts exchanged (an all-to-all of [W] ints) and the overflow decided: the worst received
   total over the group (an all-reduce of one int) against C.
3. dispatch: the packed rows (x bytes, scores bytes, ids bytes side by side) by the transport
   into [C] received rows; rows past what arrived are masked: x and scores 0, ids E/W.
4. this rank's experts on all C received rows (`functional.experts_topk`; the masked and the
   sentinel pairs are dropped) -> partial sums [C, d].
5. combine: the partial sums back by the reverse counts, into [S] rows in the order they left;
   a token's output is the sum of its rows, in rank order, accumulated in the routing dtype
   (fp32 for bf16) and rounded once. No scatter repeats an index: two runs give bitwise the
   same results.
The backward is the same exchanges reversed (autograd Functions): the output gradient goes to
the experts' rows, the gradients of the received x and scores come back and are summed per token
(x) or gathered per pair (scores, then the router), the experts' weights get theirs from the
experts' own backward.

Overflow: when some rank would receive more than C rows, every rank sends nothing (its counts
are zeroed before the transport, so no buffer is written past its end), every rank's output of
that call is NaN, and `check_capacity()` raises naming the count and C (machmoe.exchange_overflow;
on the CPU the call itself raises, on every rank).

The transport is a small swappable function (machmoe.device_count_transport): on CUDA our
pull_rows kernel reading the peers' counts and rows through torch's symmetric memory, over gloo
all_to_all_single with the counts on the host.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from . import functional
from .exchange_overflow import agreed_overflow, forget_finished, poison
from .expert_capacity_exchange import _FromSlots, _ScoresToSlots, _slot_rows, _ToSlots
from .expert_exchange import _swap_blocks

RECEIVED_ROWS = ("rows to receive", "ceil(capacity_factor · W · max_tokens)",
                 "Raise capacity_factor (1.0 never overflows) or max_tokens.")


def capacity_rows(max_tokens: int, capacity_factor: float, W: int) -> int:
    """C, the rows a rank receives at most: ceil(capacity_factor · W · max_tokens), at least 1."""
    return max(1, math.ceil(capacity_factor * W * max_tokens))


def send_rows(max_tokens: int, K: int, W: int) -> int:
    """S, the rows a rank sends at most: max_tokens · min(K, W), at least 1."""
    return max(1, max_tokens * min(K, W))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, c] -> its bytes [R, c · element size] uint8."""
    return t.contiguous().view(torch.uint8)


def _unpack(got: torch.Tensor, filled: torch.Tensor, layout: list) -> list:
    """got [R, B] uint8 received rows, of which the first `filled` (0-d, device) arrived ->
    tensors [R, c] per (c, dtype) in layout, cut from the rows side by side; rows past `filled`
    are 0 (fresh tensors: nothing aliases the transport's buffer). The rows are read in the
    widest words that every piece's width and offset allow (8, 4, 2 or 1 bytes): a masked copy
    of byte elements took ~0.4 ms per piece at 7B-a's 150 MB."""
    widths = [cols * dtype.itemsize for cols, dtype in layout]
    word = next(w for w in (8, 4, 2, 1) if got.shape[1] % w == 0 and got.storage_offset() % w == 0
                and all(x % w == 0 for x in widths))
    words = got.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word])  # [R, B / word]
    valid = (torch.arange(got.shape[0], device=got.device) < filled)[:, None]  # [R, 1]
    zero = torch.zeros((), dtype=words.dtype, device=got.device)
    out, start = [], 0
    for (cols, dtype), width in zip(layout, widths):
        piece = torch.where(valid, words[:, start // word:(start + width) // word], zero)
        out.append(piece.view(dtype))
        start += width
    return out


class _ToExperts(torch.autograd.Function):
    """Send rows x [S, d] and their scores [S, K] and local ids [S, K] (int32) to the experts'
    ranks -> x [C, d], scores [C, K], ids [C, K] received, rows past those that arrived
    holding 0, 0 and the sentinel. Backward: the gradients of the received x and scores back to
    the rows they came from."""

    @staticmethod
    def forward(ctx, x, scores, ids, send_n, recv_n, capacity, sentinel, transports):
        to_experts, to_tokens = transports
        ctx.save_for_backward(send_n, recv_n)
        ctx.to_tokens, ctx.rows = to_tokens, x.shape[0]
        ctx.layout = [(x.shape[1], x.dtype), (scores.shape[1], scores.dtype)]
        got = to_experts([_bytes(x), _bytes(scores), _bytes(ids)], send_n, recv_n, capacity)
        filled = recv_n.sum()
        x_recv, s_recv, id_recv = _unpack(got, filled, ctx.layout + [(ids.shape[1], ids.dtype)])
        arrived = (torch.arange(capacity, device=x.device) < filled)[:, None]
        id_recv = torch.where(arrived, id_recv, torch.full((), sentinel, dtype=ids.dtype, device=ids.device))
        ctx.mark_non_differentiable(id_recv)
        return x_recv, s_recv, id_recv

    @staticmethod
    def backward(ctx, grad_x, grad_scores, _):
        send_n, recv_n = ctx.saved_tensors
        got = ctx.to_tokens([_bytes(grad_x), _bytes(grad_scores)], recv_n, send_n, ctx.rows)
        gx, gs = _unpack(got, send_n.sum(), ctx.layout)
        return gx, gs, None, None, None, None, None, None


class _ToTokens(torch.autograd.Function):
    """The experts' partial sums [C, d] back to the ranks their rows came from -> [S, d] in the
    order they were sent, rows past those that came back 0. Backward: the gradient of those
    rows to the experts' ranks again."""

    @staticmethod
    def forward(ctx, y, send_n, recv_n, rows, transports):
        to_experts, to_tokens = transports
        ctx.save_for_backward(send_n, recv_n)
        ctx.to_experts, ctx.capacity = to_experts, y.shape[0]
        got = to_tokens([_bytes(y)], recv_n, send_n, rows)
        (back,) = _unpack(got, send_n.sum(), [(y.shape[1], y.dtype)])
        return back

    @staticmethod
    def backward(ctx, grad):
        send_n, recv_n = ctx.saved_tensors
        got = ctx.to_experts([_bytes(grad)], send_n, recv_n, ctx.capacity)
        (g,) = _unpack(got, recv_n.sum(), [(grad.shape[1], grad.dtype)])
        return g, None, None, None, None


def device_all_to_all_experts(x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                              w1: torch.Tensor, w2: torch.Tensor, b1, b2, *, num_experts: int, group,
                              group_name: str, max_tokens: int, capacity_factor: float,
                              transports: tuple[Callable, Callable], **experts_kwargs) -> torch.Tensor:
    """out [T, d]: steps 1-5 of the module docstring on this rank's tokens x [T, d] (T <=
    max_tokens, checked by the caller), routed by the caller (scores [T, K], experts [T, K]
    global ids), this rank holding w1 [E/W, N1, d], w2 [E/W, d, n] (and b1, b2).
    transports: (to the experts, to the tokens), each as machmoe.device_count_transport
    describes. experts_kwargs go to functional.experts_topk. Every rank of `group` calls this
    together with the same max_tokens and capacity_factor."""
    forget_finished()
    T, K = experts.shape
    W = dist.get_world_size(group)
    E_local, dev = num_experts // W, x.device
    S, C = send_rows(max_tokens, K, W), capacity_rows(max_tokens, capacity_factor, W)
    phase = torch.profiler.record_function
    with phase("ep.rows"):
        owner = torch.div(experts.long(), E_local, rounding_mode="floor")  # [T, K] owning rank
        owners = torch.zeros(T, W, dtype=torch.int64, device=dev).scatter_(
            1, owner, torch.ones_like(owner))  # [T, W] 1: t goes to q
        counts = owners.sum(0)  # [W] rows to each rank
        start = torch.cumsum(counts, 0) - counts  # [W] first row of each rank's chunk
        sent = owners > 0
        # Running count of each rank's rows down the tokens: scanned along the last dim of the
        # [W, T] transpose (a scan along dim 0 of [T, W] runs as CUDA's slow outer-dim scan: 2.2 ms
        # at 7B-a, W = 2, against microseconds).
        before = (owners.t().cumsum(1) - owners.t()).t()  # [T, W] rows for rank q before token t
        slot = torch.where(sent, start + before, -1)  # [T, W] send row, or -1
        # source [S]: the token of each send row (-1: empty); row_rank [S]: its destination.
        # Pairs (t, q) not sent go to a spare entry past the end, which is dropped.
        spill = torch.where(sent, slot, S).reshape(-1)
        token = torch.arange(T, device=dev).repeat_interleave(W)
        source = torch.full((S + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, spill, token)[:S]
        rank_of = torch.arange(W, device=dev).repeat(T)
        row_rank = torch.zeros(S + 1, dtype=torch.int64, device=dev).scatter_(0, spill, rank_of)[:S]
        # Each send row's K pairs for its rank: local expert (E/W: none) and score.
        row_experts = _slot_rows(experts.long(), source)  # [S, K]
        mine = (torch.div(row_experts, E_local, rounding_mode="floor") == row_rank[:, None]) & \
            (source >= 0)[:, None]
        local = torch.where(mine, row_experts - row_rank[:, None] * E_local, E_local).to(torch.int32)
        pair_slot = slot.gather(1, owner)  # [T, K]: the send row carrying pair (t, k)
    with phase("ep.counts"):
        recv_counts = _swap_blocks(counts, W, group_name)  # [W]: rows each rank sends here
        overflow = agreed_overflow(recv_counts.sum(), C, group, RECEIVED_ROWS)
        none = torch.zeros((), dtype=torch.int64, device=dev)
        send_n = torch.where(overflow, none, counts)  # an overflow sends nothing at all
        recv_n = torch.where(overflow, none, recv_counts)
    with phase("ep.dispatch"):
        x_send = _ToSlots.apply(x, source, slot)  # [S, d]
        s_send = _ScoresToSlots.apply(scores, source, mine, pair_slot)  # [S, K]
        x_recv, s_recv, e_recv = _ToExperts.apply(x_send, s_send, local, send_n, recv_n, C, E_local,
                                                  transports)  # [C, d], [C, K], [C, K]
    with phase("ep.experts"):
        y_recv = functional.experts_topk(x_recv, w1, w2, s_recv, e_recv, b1=b1, b2=b2,
                                         **experts_kwargs)  # [C, d]
    with phase("ep.combine"):
        y_back = _ToTokens.apply(y_recv, send_n, recv_n, S, transports)  # [S, d]
        out = _FromSlots.apply(y_back, slot, source)
        out = poison(out, overflow)
    return out
