"""The all-to-all exchange of expert parallelism without host synchronisation: fixed-capacity
blocks (machmoe.distributed, exchange="all_to_all" with max_tokens given).

Rank q of W holds experts [q·E/W, (q+1)·E/W). A token goes once to each rank that holds one of
its K experts (deduplicated per rank), as in machmoe.expert_all_to_all, but every block of the
exchange has a fixed size known on the host: C = ceil(capacity_factor · max_tokens) rows per
(sender, receiver) pair. So nothing waits for the device, and the sequence is CUDA-graph
capturable. With capacity_factor 1 (the default) no batch overflows: a rank sends a token to a
peer at most once, and has at most max_tokens of them. A smaller factor sends fewer bytes (the
blocks are sent whole, filled or not) and bounds the imbalance a batch may have.

Forward, per rank, on its tokens x [T, d] routed to experts [T, K] with scores [T, K]:
1. slots: owners [T, W] (token t has an expert on rank q); a token's slot in block q is the
   number of earlier tokens owned by q (a prefix sum: stable, no sort). Slots past C overflow.
2. send blocks [W·C, d] of rows, and for each row its K (local expert, score) pairs for that
   block's rank, the others marked out of range; empty slots hold no pair.
3. all-to-all of equal blocks (rows, experts, scores): block q to rank q.
4. this rank's experts on the W·C received rows (`functional.experts_topk`, out-of-range pairs
   dropped) -> partial sums [W·C, d], back by the same all-to-all.
5. combine: a token's output is the sum of its slots' partial sums, added in rank order.
The backward is the same exchange reversed. Every sum has a fixed order and no scatter repeats
an index: two runs give bitwise the same results.

Overflow: when a rank would send more than C rows to a peer, the rows past C are not sent (no
buffer is overrun) and every rank's output of that call is NaN (the ranks agree through a
one-int all-reduce on the device), so a loss computed from it is NaN. `check_capacity()` then
raises a RuntimeError naming the count and the capacity, on every rank (it waits for the device;
call it where the host waits anyway). On the CPU the count is known without waiting, and the
call itself raises, on every rank, before any exchange.

Memory: the received rows [W·C, d] and the experts' buffers for W·C·K pairs (H [W·C·K, N1]):
W·C/T times the single layer's H; with capacity_factor f·b, where f is the fraction of tokens a
peer needs (docs/SCALING.md) and b >= 1 a bound on imbalance, less than the all-gather exchange's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from . import functional, torch_backend
from .exchange_overflow import ROWS_PER_PEER, agreed_overflow, forget_finished, poison
from .expert_exchange import _SwapBlocks, _swap_blocks


def _slot_sum(rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """out [T, d] = Σ_q rows[slot[t, q]] over the slots >= 0, in rank order, accumulated in the
    routing dtype (fp32 for bf16): a token has at most one slot per rank."""
    acc = torch_backend.routing_dtype(rows.dtype)
    out = torch.zeros(slot.shape[0], rows.shape[1], dtype=acc, device=rows.device)
    for q in range(slot.shape[1] if rows.shape[0] else 0):
        index = slot[:, q]
        picked = rows.index_select(0, index.clamp_min(0)).to(acc)
        out += torch.where((index >= 0)[:, None], picked, torch.zeros((), dtype=acc, device=rows.device))
    return out.to(rows.dtype)


def _slot_rows(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """rows [W·C, ...] = t[source] where source >= 0, else 0."""
    if t.shape[0] == 0:  # a rank without tokens sends only empty slots
        return t.new_zeros((source.shape[0],) + tuple(t.shape[1:]))
    picked = t.index_select(0, source.clamp_min(0))
    keep = (source >= 0).reshape((-1,) + (1,) * (t.dim() - 1))
    return torch.where(keep, picked, torch.zeros((), dtype=t.dtype, device=t.device))


class _ToSlots(torch.autograd.Function):
    """x [T, d] -> send rows [W·C, d] (row r: x[source[r]], or 0 for an empty slot); backward:
    the slot sum (a token's gradient from each of its slots, in rank order)."""

    @staticmethod
    def forward(ctx, x, source, slot):
        ctx.save_for_backward(slot)
        return _slot_rows(x, source)

    @staticmethod
    def backward(ctx, grad):
        (slot,) = ctx.saved_tensors
        return _slot_sum(grad.contiguous(), slot), None, None


class _FromSlots(torch.autograd.Function):
    """partial sums [W·C, d] -> out [T, d], the slot sum; backward: the gather to the slots."""

    @staticmethod
    def forward(ctx, rows, slot, source):
        ctx.save_for_backward(source)
        return _slot_sum(rows, slot)

    @staticmethod
    def backward(ctx, grad):
        (source,) = ctx.saved_tensors
        return _slot_rows(grad, source), None, None


class _ScoresToSlots(torch.autograd.Function):
    """scores [T, K] -> [W·C, K]: row r's pairs whose expert rank r // C holds (`mine`), else 0.
    Backward: a pair's gradient from the one slot that carried it (the slot of its token in its
    expert's rank's block), a gather, so no index is added to twice."""

    @staticmethod
    def forward(ctx, scores, source, mine, pair_slot):
        ctx.save_for_backward(pair_slot)
        rows = _slot_rows(scores, source)
        return torch.where(mine, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    @staticmethod
    def backward(ctx, grad):
        (pair_slot,) = ctx.saved_tensors  # [T, K]: the row that carried pair (t, k), or -1
        K = pair_slot.shape[1]
        flat = grad.reshape(-1)
        index = pair_slot.clamp_min(0) * K + torch.arange(K, device=grad.device)
        got = flat.index_select(0, index.reshape(-1)).reshape(pair_slot.shape)
        return torch.where(pair_slot >= 0, got, torch.zeros((), dtype=got.dtype, device=got.device)), None, None, None


def capacity_rows(max_tokens: int, capacity_factor: float) -> int:
    """C, rows per (sender, receiver) block: ceil(capacity_factor · max_tokens), at least 1."""
    return max(1, math.ceil(capacity_factor * max_tokens))


def capacity_all_to_all_experts(x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                                w1: torch.Tensor, w2: torch.Tensor, b1: Optional[torch.Tensor],
                                b2: Optional[torch.Tensor], *, num_experts: int, group,
                                group_name: str, capacity: int, **experts_kwargs) -> torch.Tensor:
    """out [T, d]: steps 1-5 of the module docstring on this rank's tokens x [T, d], routed by
    the caller (scores [T, K], experts [T, K] global ids), this rank
    holding w1 [E/W, N1, d], w2 [E/W, d, n] (and b1, b2); capacity: C. experts_kwargs go to
    functional.experts_topk. Every rank of `group` calls this together with the same C."""
    forget_finished()
    T, K = experts.shape
    W = dist.get_world_size(group)
    E_local, C, dev = num_experts // W, capacity, x.device
    phase = torch.profiler.record_function
    with phase("ep.slots"):
        owner = torch.div(experts.long(), E_local, rounding_mode="floor")  # [T, K] owning rank
        owners = torch.zeros(T, W, dtype=torch.int32, device=dev).scatter_(
            1, owner, torch.ones_like(owner, dtype=torch.int32))  # [T, W] 1: t goes to q
        position = (owners.t().cumsum(1) - owners.t()).t()  # [T, W] slot inside block q (scan along the last dim)
        sent = (owners > 0) & (position < C)
        block = torch.arange(W, device=dev)
        slot = torch.where(sent, block * C + position, -1)  # [T, W] send row, or -1
        # source [W·C]: the token in each send row (-1: empty). Unsent (t, q) go to a spare
        # entry past the end, which is dropped; the real entries are each written once.
        spill = torch.where(sent, slot, W * C).reshape(-1)
        token = torch.arange(T, device=dev).repeat_interleave(W)
        source = torch.full((W * C + 1,), -1, dtype=torch.int64, device=dev).scatter_(
            0, spill, token)[:W * C]
        # The worst count, the same on every rank: an overflow on any rank poisons every output.
        overflow = agreed_overflow(owners.sum(0).max(), C, group, ROWS_PER_PEER)
        # Each send row's K pairs for its block's rank: local expert (E/W: none) and score.
        row_rank = block.repeat_interleave(C)  # [W·C]
        row_experts = _slot_rows(experts.long(), source)  # [W·C, K]
        mine = (torch.div(row_experts, E_local, rounding_mode="floor") == row_rank[:, None]) & \
            (source >= 0)[:, None]
        local = torch.where(mine, row_experts - row_rank[:, None] * E_local, E_local).to(torch.int32)
        pair_slot = slot.gather(1, owner)  # [T, K]: the send row carrying pair (t, k), or -1
    with phase("ep.dispatch"):
        x_send = _ToSlots.apply(x, source, slot)  # [W·C, d]
        s_send = _ScoresToSlots.apply(scores, source, mine, pair_slot)  # [W·C, K]
        x_recv = _SwapBlocks.apply(x_send, W, group_name)
        s_recv = _SwapBlocks.apply(s_send, W, group_name)
        e_recv = _swap_blocks(local, W, group_name)
    with phase("ep.experts"):
        y_recv = functional.experts_topk(x_recv, w1, w2, s_recv, e_recv, b1=b1, b2=b2,
                                         **experts_kwargs)  # [W·C, d]
    with phase("ep.combine"):
        y_send = _SwapBlocks.apply(y_recv, W, group_name)
        out = _FromSlots.apply(y_send, slot, source)
        out = poison(out, overflow)
    return out
