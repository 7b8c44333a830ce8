"""The all-to-all exchange of expert parallelism: a token goes only to the ranks that hold one of
its experts, with one host synchronisation per forward (machmoe.distributed, exchange="all_to_all").

Rank q of W holds experts [q·E/W, (q+1)·E/W). The forward:

1. route the rank's own tokens (logits, top-K, aux loss: as `MoE` on those tokens; done by the
   caller, machmoe.distributed, which shares the router with the all-gather exchange);
2. dispatch: each token goes once to every rank that holds one of its experts, with its
   (expert, score) pairs for that rank — rows are deduplicated per rank, so a token crosses the
   network at most min(K, W) times, not K;
3. the receiving rank runs its experts on the rows it got (`moe_general`: score-weighted and
   summed over its own experts, on machmoe's kernels or the torch backend);
4. combine: the partial sums go back and are added per token in rank order.

The backward is the same exchange reversed; every step is deterministic (no atomics on repeated
indices), so two runs on the same inputs give bitwise the same outputs and gradients.

Costs and limits:
- One host synchronisation per forward: all_to_all needs the row counts on the host.
- Token rounding is not offered: it needs every expert's global row count.
- Each rank's partial sum is rounded to the input dtype before the combine, so a bf16 output
  carries up to min(K, W) roundings of partial sums instead of one (about 2^-9 relative each).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import torch_backend
from .enums import ActivationType, Backend, GateUpLayout, GluClamp


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows [sum(send), ...] -> rows [sum(recv), ...]: chunk q of x goes to rank q, chunk q of
    the result came from rank q."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """_all_to_all with its adjoint (the reverse exchange) as the backward. Gradients are always
    materialised so that every rank takes part in the backward exchange."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _pack_pairs(meta: torch.Tensor, score: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """meta [R, 3] (row in the rank's chunk, local expert, sending rank) and scores [R], both in
    (t, k) order -> [R, 4] in `order` (grouped by rank), in the scores' same-width integer type
    with the scores bit-cast: what _PairExchange sends (the torch path's; on the kernels the
    exchange_plan op packs them). Needs no counts, so it is built before the host waits."""
    twin = {4: torch.int32, 8: torch.int64}[score.element_size()]
    return torch.cat([meta.to(twin), score.detach().contiguous().view(twin).unsqueeze(1)], 1)[order]


class _PairExchange(torch.autograd.Function):
    """The packed pairs (_ExchangePlan.packed, built from `score`) to their ranks in one all_to_all: one
    collective and one autograd node where the pairs' metadata and scores took three and two (the
    exchange is bound by the host's time per op: docs/PERF.md). -> meta [P, 3] and the
    scores [P], differentiable in `score` (whose values travel in `packed`). Backward: the
    scores' gradient sent back, un-permuted by `inverse`."""

    @staticmethod
    def forward(ctx, packed, score, inverse, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.save_for_backward(inverse)
        got = _all_to_all(packed, send, recv, group)  # [P, 4]
        meta_recv = got[:, :3]
        ctx.mark_non_differentiable(meta_recv)
        return meta_recv, got[:, 3].contiguous().view(score.dtype)

    @staticmethod
    def backward(ctx, _, grad_score):
        (inverse,) = ctx.saved_tensors
        grad = _all_to_all(grad_score.contiguous(), ctx.recv, ctx.send, ctx.group)  # [R] in `order`
        return None, grad[inverse], None, None, None, None


class _RowSum:
    """out [T, d] = Σ of the rows [S, d] that belong to each token, in rank order: the combine's
    forward and the dispatch's backward. A token has at most one row per rank.

    On CUDA with the op library: machmoe's aggregation kernel over a token-major list (fp32
    accumulation, one pass at copy bandwidth). Otherwise index_add per rank's chunk, each with
    distinct indices (index_add with repeated indices uses atomics on CUDA). Both deterministic.
    """

    def __init__(self, token, chunks, T, ops=None, token_offsets=None, pair_row=None):
        self.token, self.chunks, self.T = token, chunks, T  # [S] int64, rows per rank, T
        # machmoe's op namespace, [T+1], [S] int32; or None (index_add)
        self.ops, self.token_offsets, self.pair_row = ops, token_offsets, pair_row

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.aggregate(rows.contiguous(), self.pair_row, self.token_offsets, None,
                                      rows.dtype)
        acc = torch_backend.routing_dtype(rows.dtype)
        out = torch.zeros(self.T, rows.shape[1], dtype=acc, device=rows.device)
        start = 0
        for size in self.chunks:
            if size:
                out.index_add_(0, self.token[start:start + size], rows[start:start + size].to(acc))
            start += size
        return out.to(rows.dtype)


class _Dispatch(torch.autograd.Function):
    """x [T, d] -> x[token] [S, d]; backward: the row sum."""

    @staticmethod
    def forward(ctx, x, row_sum):
        ctx.row_sum = row_sum
        return x[row_sum.token]

    @staticmethod
    def backward(ctx, grad):
        return ctx.row_sum(grad), None


class _Combine(torch.autograd.Function):
    """rows [S, d] -> out [T, d], the row sum; backward: gather."""

    @staticmethod
    def forward(ctx, rows, row_sum):
        ctx.row_sum = row_sum
        return row_sum(rows)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.row_sum.token], None


def _to_host_async(t: torch.Tensor):
    """Starts copying t to the host and returns a function that waits for it and returns the
    copy. On CUDA the copy is non-blocking into pinned memory behind an event, so the caller can
    queue more work before it waits; elsewhere the copy is immediate."""
    if not t.is_cuda:
        host = t.cpu()
        return lambda: host
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def wait() -> torch.Tensor:
        done.synchronize()
        return host

    return wait


class _ExchangePlan:
    """Who sends what, from this rank's top-K experts [T, K] and scores [T, K] (no host sync
    before the counts).

    Rows: one per (token, owning rank), numbered rank-major with tokens ascending inside a rank
    (rank q's chunk is rows [row_offsets[q], row_offsets[q+1])). Pairs: the T·K (token, expert)
    pairs, permuted by `order` so that they are grouped by owning rank, token order inside.
    `packed` [R, 4] is what _PairExchange sends: at each grouped position the pair's row inside its
    rank's chunk, its local expert, the sending rank and the score's bits, as integers of the
    score's width. `counts` [W, 2]: rows and pairs sent to each rank.

    With `ops` (machmoe's op namespace, on CUDA) all of it comes from one op,
    `exchange_plan` (machmoe::exchange_plan: the routing-metadata kernel run with the owning rank
    in place of the expert, plus three small kernels), every index int32: the exchange is bound
    by the host's time per op (docs/PERF.md), and this took ~25 ops. With ops None,
    from torch ops: an owners table [T, W] and a stable sort.
    """

    def __init__(self, experts: torch.Tensor, scores: torch.Tensor, E: int, W: int, rank: int, ops=None):
        T, K = experts.shape
        dev, E_local = experts.device, E // W
        self.T, self.ops = T, ops
        if ops is not None:
            (self.counts, self.row_offsets, self._row_token, self.pair_row, self.order, self.inverse,
             self.packed, self._token_offsets, self._distinct_rows, self.expert_counts) = ops.exchange_plan(
                experts.to(torch.int32), scores.detach().contiguous(), E, W, rank)
            return
        dest = torch.div(experts, E_local, rounding_mode="floor").reshape(-1)  # [R] owning rank
        token = torch.arange(T, device=dev).repeat_interleave(K)  # [R]
        owners = torch.zeros(T, W, dtype=torch.bool, device=dev)
        owners[token, dest] = True
        self._owners_rank_major = owners.t().reshape(-1)  # [W·T]
        row_id = torch.cumsum(self._owners_rank_major, 0) - 1  # [W·T]
        self.pair_row = row_id[dest * T + token]
        self.order = torch.sort(dest, stable=True).indices
        self.inverse = torch.argsort(self.order)
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        self.row_offsets = torch.cat([zero, torch.cumsum(owners.sum(0), 0)])
        send_pairs = torch.zeros(W, dtype=torch.int64, device=dev).scatter_add_(0, dest, torch.ones_like(dest))
        self.counts = torch.stack([self.row_offsets.diff(), send_pairs], 1)  # [W, 2]
        self.expert_counts = None
        # Each pair's row inside its rank's chunk, its local expert and the sender (this rank).
        row = self.pair_row - self.row_offsets[dest]
        meta = torch.stack([row, experts.reshape(-1) - dest * E_local, torch.full_like(row, rank)], 1)
        self.packed = _pack_pairs(meta, scores.reshape(-1), self.order)

    @property
    def send_rows(self) -> torch.Tensor:
        return self.counts[:, 0]  # [W]

    @property
    def send_pairs(self) -> torch.Tensor:
        return self.counts[:, 1]  # [W]

    def row_sum(self, chunks: list[int]) -> "_RowSum":
        """The row sum over the rows this rank sends (chunks[q] of them for rank q)."""
        S = sum(chunks)
        if self.ops is None:
            row_token = torch.nonzero_static(self._owners_rank_major, size=S)[:, 0] % max(self.T, 1)
            return _RowSum(row_token, chunks, self.T)
        return _RowSum(self._row_token[:S], chunks, self.T, self.ops, self._token_offsets,
                       self._distinct_rows[:S])


def _local_experts(x, w1, b1, w2, b2, scores, row, expert, activation, layout, backend, glu_clamp=None):
    """The experts this rank holds on the rows it received -> [S, d]. The list was built here:
    ordered by row, no repeated (row, expert) pair, in range, so no checks (and no syncs)."""
    if backend == Backend.MACHMOE:
        from . import machmoe_backend

        return machmoe_backend.moe_general(x, w1, b1, w2, b2, scores, row, expert, activation, layout, glu_clamp)
    return torch_backend.experts(x, w1, b1, w2, b2, row, expert, scores, activation, layout, glu_clamp)


def all_to_all_experts(x: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, b1: Optional[torch.Tensor],
                       b2: Optional[torch.Tensor], *, num_experts: int, group, kernels: bool,
                       activation: ActivationType, layout: GateUpLayout, backend: Backend,
                       glu_clamp: Optional[GluClamp] = None,
                       aux: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, d], aux []): the exchange plan, the aux loss (`aux` when the router gave it, else
    from the plan's expert counts on the kernels) and steps 2-4 of the module docstring on this
    rank's tokens x [T, d], routed by the caller (logits [T, E] in the routing dtype, scores
    [T, K], experts [T, K] global ids, int32 from the kernels, else int64), this rank holding w1 [E/W, N1, d], w2 [E/W, d, n] (and b1
    [E/W, N1], b2 [E/W, d]). Every rank of `group` must call this together (it runs collectives).
    kernels: whether the routing ran on machmoe's kernels (then the plan and the row sums do too);
    activation, layout, backend (resolved: machmoe or torch) and glu_clamp already parsed and checked
    (machmoe.distributed.expert_parallel_moe does)."""
    T, E, W = x.shape[0], num_experts, dist.get_world_size(group)
    # (ep.* ranges name the phases in torch.profiler traces: bench.expert_parallel --profile.)
    phase = torch.profiler.record_function
    with phase("ep.plan"):
        plan = _ExchangePlan(experts, scores, E, W, dist.get_rank(group),
                             torch.ops.machmoe if kernels and T > 0 else None)
        # Counts to the host (the one sync): rows and pairs per peer, both directions. On CUDA
        # they travel by a non-blocking copy behind an event, and the work that needs no counts
        # is queued before the host waits, so the device is not left idle while the host catches up.
        recv_counts = _all_to_all(plan.counts, [1] * W, [1] * W, group)  # [W, 2]
        counts_h = _to_host_async(torch.cat([plan.counts, recv_counts], 1))  # [W, 4]
        if aux is None:
            aux = (torch_backend.aux_loss(logits, experts) if plan.expert_counts is None else
                   torch_backend.aux_loss_from_counts(logits, plan.expert_counts, experts.numel()))
        # The first row of each sender's chunk in what this rank will receive [W].
        recv_row_base = torch.cumsum(recv_counts[:, 0], 0) - recv_counts[:, 0]
    with phase("ep.wait_counts"):
        send_rows_h, send_pairs_h, recv_rows_h, recv_pairs_h = counts_h().t().tolist()

    # 2. Rows out (one per (token, owning rank)); each pair's (row in its rank's chunk, local
    #    expert) and score, grouped by rank.
    with phase("ep.dispatch"):
        row_sum = plan.row_sum(send_rows_h)
        x_send = _Dispatch.apply(x, row_sum)  # [S, d]
        x_recv = _AllToAll.apply(x_send, send_rows_h, recv_rows_h, group)  # [S_recv, d]
        meta_recv, score_recv = _PairExchange.apply(plan.packed, scores.reshape(-1), plan.inverse, send_pairs_h,
                                                    recv_pairs_h, group)  # [P_recv, 3], [P_recv]
        # A pair from peer q addresses q's rows: offset it by where q's rows start here.
        row = meta_recv[:, 0] + recv_row_base[meta_recv[:, 2]]

    # 3. This rank's experts on what it received.
    with phase("ep.experts"):
        y_recv = _local_experts(x_recv, w1, b1, w2, b2, score_recv, row, meta_recv[:, 1],
                                activation, layout, backend, glu_clamp)  # [S_recv, d]

    # 4. Back to the senders, added per token in rank order.
    with phase("ep.combine"):
        y_send = _AllToAll.apply(y_recv, recv_rows_h, send_rows_h, group)  # [S, d]
        out = _Combine.apply(y_send, row_sum)
    return out, aux
