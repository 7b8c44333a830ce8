"""The all-gather exchange of expert parallelism: every rank's tokens to every rank, the experts'
partial sums reduced back to their owners, with no host synchronisation.

Rank q of W holds experts [q·E/W, (q+1)·E/W). Each rank has routed its own T tokens (scores and
experts [T, K]). Then:

1. all-gather x [T, d], the experts and the scores [T, K] over the group -> [W·T, ...], rank r's
   rows at [r·T, (r+1)·T) (a token crosses to each other rank once, whatever its K);
2. this rank's experts on the gathered rows (`functional.experts_topk`), a pair whose expert
   another rank holds marked out of range and so dropped -> partial sums [W·T, d];
3. reduce-scatter (sum) the partial sums: rank r gets its own T rows summed over the ranks.

The backward is the same exchange reversed (the output gradient gathered, the gradients of x and
of the scores reduce-scattered). Every size is known on the host before anything runs (T, the
same on every rank, and K), so nothing waits for the device: the host queues a whole forward or
backward ahead of the GPU, and the sequence is CUDA-graph capturable. On CUDA the all-gathers and
reduce-scatters are copy-engine pulls through symmetric memory on the current stream
(machmoe.symmetric_exchange); elsewhere (gloo on the CPU) torch's functional collectives.

Overlap. On the kernels over symmetric memory every transfer runs beside the experts' GEMMs
(machmoe.overlapped_experts): the gathered rows are kept rotated, this rank's own tokens first,
and the experts calls are split at them (ExpertsForwardPart / ExpertsBackwardPart): the own
tokens' rows are computed while the peers' arrive, the peers' partial sums leave while the own
rows' down-projection runs, and the backward likewise with the output gradient and dx (dx beside
the weight gradients); the routing travels with x and the scores' gradient with dx, in the same
rounds of transfers. Splitting the tokens into chunks pipelined through gather, experts and
reduce-scatter was measured slower even before any traffic (one H200, one rank: 7B-a forward +
backward 4.4 ms in one chunk, 5.3 in two, 8.2 in four): each chunk's weight-gradient GEMMs see a
fraction of the rows, and the chunks' weight gradients have to be summed; the split calls keep
one weight-gradient pass over all rows. Elsewhere (the torch backend, gloo) the exchange runs as
three nodes: gather, experts, reduce-scatter.

Bytes each rank sends per forward: (W-1)·T·d·b for the gather and as many for the
reduce-scatter (b bytes per element), the same again in the backward. A filtered all-to-all sends
a token only to the ranks that hold one of its experts: the fraction 1 - C(E-E/W, K)/C(E, K) of
these bytes, which is 0.996 at W = 2 and 0.90 at W = 4 with E = 128, K = 8, but 0.66 at W = 8
(docs/SCALING.md).

Memory: without a host sync the experts' buffers are sized before the pairs are counted. By
default they hold all W·T·K gathered pairs, most of them other ranks': the saved H is
[W·T·K, N1], W times the single layer's (7B-a on two H200s: 3.57 GiB peak against 2.27). With a
pair capacity (capacity_factor < 1), this rank's pairs are kept in order and the list is cut
to the capacity, its padding spread over the tokens (compact_pairs: prefix sums and a search, no
sort), so H is [capacity, N1]; a batch that needs more poisons every rank's output with NaN and
check_capacity() raises (machmoe.exchange_overflow).

Numerics: each rank's partial sum is rounded to x's dtype before the reduction, which adds the
ranks' blocks in rank order in float32 and rounds once (on the CPU, gloo's reduce-scatter adds); the
order is fixed, so two runs are bitwise equal.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import exchange_overflow, functional, overlapped_experts, symmetric_exchange, torch_backend
from .enums import ActivationType, Backend, GateUpLayout, glu_clamp_list

_c10d = torch.ops._c10d_functional


def _all_gather(t: torch.Tensor, W: int, group_name: str, rotated: bool = False) -> torch.Tensor:
    """[R, ...] -> [W·R, ...] in rank order (rotated: this rank's rows first, then the ranks after
    it; symmetric memory only), ordered before whatever the current stream runs next (a stream
    dependency, not a host wait, on CUDA). On CUDA by the copy engines through symmetric memory
    (machmoe.symmetric_exchange: 1.5x NCCL's bandwidth on NVLink), elsewhere by torch's
    functional collective."""
    return _all_gather_parts([t], W, group_name, rotated)[0]


def _sum_scatter(t: torch.Tensor, W: int, group_name: str, rotated: bool = False) -> torch.Tensor:
    """[W·R, ...] -> [R, ...], the sum over the ranks of this rank's block (in rank order on
    CUDA; rotated: the adjoint of the rotated _all_gather; see _all_gather for the transport)."""
    return _sum_scatter_parts([t], W, group_name, rotated)[0]


def _all_gather_parts(ts: list, W: int, group_name: str, rotated: bool = False) -> list:
    """_all_gather of each of ts, in one round of transfers over symmetric memory."""
    return _collective(ts, W, group_name, rotated, symmetric_exchange.all_gather_parts_op,
                       symmetric_exchange.all_gather_parts,
                       lambda t: _c10d.all_gather_into_tensor(t, W, group_name))


def _sum_scatter_parts(ts: list, W: int, group_name: str, rotated: bool = False) -> list:
    """_sum_scatter of each of ts, in one round of transfers over symmetric memory."""
    return _collective(ts, W, group_name, rotated, symmetric_exchange.reduce_scatter_parts_op,
                       symmetric_exchange.reduce_scatter_parts,
                       lambda t: _c10d.reduce_scatter_tensor(t, "sum", W, group_name))


def _collective(ts, W, group_name, rotated, symmetric_op, symmetric_function, functional) -> list:
    """ts through a symmetric-memory collective where it runs (its custom op under torch.compile,
    an opaque node of the graph; the function itself in eager mode, whose host time the op's
    Python dispatch would add to), else each through torch's functional collective."""
    ts = [t.contiguous() for t in ts]
    if symmetric_exchange.available(ts[0], W):
        run = symmetric_op if torch.compiler.is_compiling() else symmetric_function
        return list(run(ts, W, group_name, rotated))
    assert not rotated, "the rotated layout runs over symmetric memory only"
    return [_c10d.wait_tensor(functional(t)) for t in ts]


class _GatherRows(torch.autograd.Function):
    """[R, ...] -> [W·R, ...], every rank's rows in rank order; backward: the reduce-scatter
    (sum) of the gradient, each rank's block back to it."""

    @staticmethod
    def forward(ctx, t, W, group_name):
        ctx.W, ctx.group_name = W, group_name
        return _all_gather(t, W, group_name)

    @staticmethod
    def backward(ctx, grad):
        return _sum_scatter(grad, ctx.W, ctx.group_name), None, None


class _GatherRoutingRotated(torch.autograd.Function):
    """scores [R, K] and experts [R, K] -> both gathered [W·R, K], this rank's rows first, in one
    collective (overlapped_experts.pack_routing). Backward: the rotated reduce-scatter (sum) of the
    scores' gradient."""

    @staticmethod
    def forward(ctx, scores, experts, W, group_name):
        ctx.W, ctx.group_name = W, group_name
        packed = overlapped_experts.pack_routing(scores, experts)  # [R, 2K]
        return overlapped_experts.unpack_routing(_all_gather(packed, W, group_name, True), scores.dtype)

    @staticmethod
    def backward(ctx, grad_scores, _):
        return _sum_scatter(grad_scores, ctx.W, ctx.group_name, True), None, None, None


class _GatherTokens(torch.autograd.Function):
    """x [R, d], scores [R, K] and experts [R, K] -> each gathered [W·R, ...] in rank order, in one
    round of transfers (the routing packed by overlapped_experts.pack_routing). Backward: x's and
    the scores' gradients reduce-scattered, in one round."""

    @staticmethod
    def forward(ctx, x, scores, experts, W, group_name):
        ctx.W, ctx.group_name = W, group_name
        xg, got = _all_gather_parts([x, overlapped_experts.pack_routing(scores, experts)], W, group_name)
        return (xg,) + overlapped_experts.unpack_routing(got, scores.dtype)

    @staticmethod
    def backward(ctx, dxg, d_scores, _):
        dx, ds = _sum_scatter_parts([dxg, d_scores], ctx.W, ctx.group_name)
        return dx, ds, None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """[W·R, ...] -> [R, ...], this rank's block summed over the ranks; backward: the all-gather
    of the gradient."""

    @staticmethod
    def forward(ctx, t, W, group_name):
        ctx.W, ctx.group_name = W, group_name
        return _sum_scatter(t, W, group_name)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.W, ctx.group_name), None, None


def gathered_experts(x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                     w1: torch.Tensor, w2: torch.Tensor, b1: Optional[torch.Tensor],
                     b2: Optional[torch.Tensor], *, world: int, rank: int, group_name: str,
                     num_experts: int, group=None, pair_capacity: Optional[int] = None,
                     **experts_kwargs) -> torch.Tensor:
    """out [T, d]: the experts of the whole group on this rank's tokens x [T, d] with their
    routing (scores [T, K] float, experts [T, K] global ids), this rank holding w1 [E/W, N1, d],
    w2 [E/W, d, n] (and b1, b2). T must be the same on every rank of the group (the caller pads);
    experts_kwargs: activation, layout, backend, glu_clamp.

    pair_capacity: None, or the (token, expert) pairs this rank's experts are sized for, fewer
    than the W·T·K gathered ones (compact_pairs); a batch that gives some rank more makes every
    rank's output NaN, and check_capacity() raise (machmoe.exchange_overflow). experts_kwargs'
    fp8 (cache, concatenated): the experts in FP8 (their calls are whole, so the transfers are not
    overlapped with them)."""
    E_local = num_experts // world
    call = _parsed_call(x, w1, w2, b1, b2, experts_kwargs)
    # On the kernels over symmetric memory: the transfers beside the kernels (overlapped_experts),
    # which take the gathered rows rotated, this rank's tokens first.
    overlapped = (_OVERLAP_TRANSFERS and call[3] and experts_kwargs.get("fp8") is None
                  and symmetric_exchange.available(x, world))
    T, K = scores.shape
    if overlapped and (pair_capacity is None or pair_capacity >= world * T * K):
        # The routing travels with x, in the same round of transfers (overlapped_experts).
        return _overlapped(x, scores, None, experts, rank * E_local, w1, w2, b1, b2, world, group_name, call)
    if overlapped:  # with a pair capacity: the routing gathered and compacted here, x by the experts' call
        sg, eg = _GatherRoutingRotated.apply(scores, experts, world, group_name)  # [W·T, K] each
        xg = None
    else:
        xg, sg, eg = _GatherTokens.apply(x, scores, experts, world, group_name)  # [W·T, ...] each
    # This rank's expert ids: an expert another rank holds falls outside [0, E_local), below or
    # above, and every experts path drops such pairs (no host check).
    local = eg - rank * E_local if rank else eg
    rows, K = local.shape
    score, expert = sg.reshape(-1), local.to(torch.int32).reshape(-1)  # [W·T·K], (t, k) order
    token = overlapped_experts.row_of_each_pair(rows, K, x.device)
    if pair_capacity is None or pair_capacity >= rows * K:
        return _experts_on_gathered_rows(x, score, token, expert, w1, w2, b1, b2, world, group_name,
                                         experts_kwargs, overlapped, call, xg)
    score, token, expert, count = compact_pairs(score, token, expert, E_local, pair_capacity, rows)
    overflow = exchange_overflow.agreed_overflow(count, pair_capacity, group, exchange_overflow.PAIRS_PER_RANK)
    out = _experts_on_gathered_rows(x, score, token, expert, w1, w2, b1, b2, world, group_name,
                                    experts_kwargs, overlapped, call, xg)
    return exchange_overflow.poison(out, overflow)


def compact_pairs(score: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, E_local: int,
                  capacity: int, tokens: int) -> tuple:
    """A routing list [R] (ordered by token, tokens in [0, tokens); experts out of [0, E_local)
    are other ranks') -> `capacity` pairs: the first `capacity` in-range pairs in their order,
    merged with padding pairs of no expert (E_local, score 0) spread evenly over the tokens, the
    whole still ordered by token: (score, token, expert) [capacity], and the number of in-range
    pairs (a 0-d device tensor; those past the capacity are left out). The experts' buffers are
    then sized for `capacity` pairs instead of R. No host sync; the scores' gradient flows back
    to the kept pairs (the others get 0).

    Why spread: the kernels loop over each token's pairs, so P padding pairs on one token would
    make that token's loop P long (tens of thousands at 4 ranks) while the rest wait for it.
    Padding pair j of P sits on token j·tokens/P (at most ceil(P/tokens) per token)."""
    C, tokens = capacity, max(tokens, 1)
    mine = (expert >= 0) & (expert < E_local)
    position = torch.cumsum(mine.to(torch.int64), 0) - 1  # [R] place among the in-range pairs
    count = mine.sum()
    keep = mine & (position < C)
    pads = C - torch.clamp(count, max=C)  # P, on the device
    # Merge by token (a kept pair before the padding of its own token): kept pair i of token t
    # moves up by the pads on tokens < t, ceil(t·P / tokens); pad j by the kept pairs on tokens
    # <= its own (a search in the kept tokens, which are ordered). Together a permutation of [0, C).
    kept_index = position + (token.to(torch.int64) * pads + tokens - 1) // tokens
    j = torch.arange(C, device=token.device, dtype=torch.int64)
    pad_token = j * tokens // torch.clamp(pads, min=1)  # [C]; valid for j < P
    kept_tokens = torch.full((C + 1,), tokens, dtype=torch.int64, device=token.device)
    kept_tokens = kept_tokens.scatter(0, torch.where(keep, position, C), token.to(torch.int64))[:C]
    pad_index = j + torch.searchsorted(kept_tokens, pad_token, right=True)
    spare = torch.full_like(j, C)  # entries past C (dropped pairs, j >= P) land in a spare slot
    index = torch.cat([torch.where(keep, kept_index, C), torch.where(j < pads, pad_index, spare)])
    all_token = torch.cat([token, pad_token.to(token.dtype)])
    all_expert = torch.cat([expert, torch.full((C,), E_local, dtype=expert.dtype, device=expert.device)])
    all_score = torch.cat([score, score.new_zeros(C)])  # differentiable in score

    def placed(values):  # [C] at their merged places (the spare slot C cut off)
        return values.new_zeros(C + 1).scatter(0, index, values)[:C]

    return placed(all_score), placed(all_token), placed(all_expert), count


# Whether the kernels' gathered experts run with their transfers overlapped (overlapped_experts);
# the tests turn it off to compare with the plain three-node path on the same GPUs.
_OVERLAP_TRANSFERS = True


def _parsed_call(x, w1, w2, b1, b2, experts_kwargs) -> tuple:
    """(activation, layout, glu_clamp, on_kernels) of an experts call."""
    activation, layout, glu_clamp, T, d, E, n = functional._parse_experts_call(
        x, w1, w2, b1, b2, experts_kwargs.get("activation", ActivationType.SWIGLU),
        experts_kwargs.get("layout", GateUpLayout.INTERLEAVED), experts_kwargs.get("backend", Backend.AUTO),
        experts_kwargs.get("glu_clamp"))
    on_kernels = functional.resolve_backend(experts_kwargs.get("backend", Backend.AUTO), x, d, n) == Backend.MACHMOE
    return activation, layout, glu_clamp, on_kernels


def _experts_on_gathered_rows(x, score, token, expert, w1, w2, b1, b2, world, group_name, experts_kwargs,
                              overlapped=False, call=None, xg=None):
    """out [T, d]: x [T, d] gathered, the experts on the gathered rows [W·T, d] with the routing
    list (score, token, expert) [R'] (ordered by token; experts out of [0, E/W) dropped), the
    partial sums reduce-scattered. overlapped: the list indexes the rows rotated (this rank's
    first), and the transfers run beside the kernels (overlapped_experts); otherwise as three
    nodes (gather, unless the caller gathered x already into xg; experts; reduce-scatter). call:
    _parsed_call's result, where the caller has it."""
    activation, layout, glu_clamp, on_kernels = call or _parsed_call(x, w1, w2, b1, b2, experts_kwargs)
    if overlapped:
        return _overlapped(x, score, token, expert, 0, w1, w2, b1, b2, world, group_name, call)
    if xg is None:
        xg = _GatherRows.apply(x, world, group_name)  # [W·T, d]
    if not on_kernels:  # the torch backend takes in-range pairs only (it synchronises anyway)
        keep = (expert >= 0) & (expert < w1.shape[0])
        score, token, expert = score[keep], token[keep], expert[keep]
    y = functional._run_experts(xg, w1, b1, w2, b2, score, token, expert, activation, layout, glu_clamp,
                                on_kernels, fp8=experts_kwargs.get("fp8"))  # [W·T, d]
    return _ReduceScatterRows.apply(y, world, group_name)


def _overlapped(x, scores, token, expert, first_expert, w1, w2, b1, b2, world, group_name, call):
    """overlapped_experts.OverlappedExperts on x [T, d]: with token None, scores and expert [T, K]
    are this rank's routing (global expert ids; first_expert: this rank's first), else the list
    over the rotated gathered rows."""
    activation, layout, glu_clamp, _ = call
    opts = (activation.value, layout.value, glu_clamp_list(glu_clamp))
    return overlapped_experts.OverlappedExperts.apply(x.contiguous(), scores, token, expert, first_expert,
                                                      w1.contiguous(), _contiguous(b1), w2.contiguous(),
                                                      _contiguous(b2), opts, world, group_name)


def _contiguous(t):
    return None if t is None else t.contiguous()


class _SwapBlocks(torch.autograd.Function):
    """[W·R, ...] -> [W·R, ...]: block q goes to rank q, and block q of the result came from rank
    q (an all-to-all of equal blocks). It is its own adjoint, so the backward is the same
    exchange of the gradient."""

    @staticmethod
    def forward(ctx, t, W, group_name):
        ctx.W, ctx.group_name = W, group_name
        return _swap_blocks(t, W, group_name)

    @staticmethod
    def backward(ctx, grad):
        return _swap_blocks(grad, ctx.W, ctx.group_name), None, None


def _swap_blocks(t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
    rows = [t.shape[0] // W] * W
    return _c10d.wait_tensor(_c10d.all_to_all_single(t.contiguous(), rows, rows, group_name))


def rounded_gathered_experts(x: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor,
                             experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                             b1: Optional[torch.Tensor], b2: Optional[torch.Tensor], *, world: int,
                             rank: int, group_name: str, num_experts: int, mode, tile_m: int,
                             seed: int, **experts_kwargs) -> torch.Tensor:
    """gathered_experts with tile-aware token rounding over the group's whole batch: out [T, d].

    Token rounding (LAYER.md) rounds each expert's row count to a multiple of tile_m by dropping
    its lowest-scored top-K pairs or adding the best-scored other tokens. Each expert's decision
    reads one column of the batch: the pair scores of every token for that expert and whether the
    token chose it. So each rank sends its tokens' columns [T, E/W] of rank q's experts to rank q
    (an all-to-all of equal blocks, T·E·4 bytes a rank), and rank q rounds its experts over the
    whole batch of the group, as the whole layer would on the ranks' batches put end to end. The
    rounded list goes to the experts as a dense [W·T, E/W] routing, a dropped pair marked out of
    range, so nothing here waits for the host.

    logits [T, E], scores and experts [T, K]: this rank's softmax_topk routing; rows of no token
    (padding up to the group's T) have logits and scores of -inf and 0 and no expert in range."""
    T, E = logits.shape
    E_local = num_experts // world
    probs = torch.softmax(logits, dim=1)  # [T, E]
    in_range = experts < E
    index = torch.where(in_range, experts, 0).long()
    selected = torch.zeros(T, E, dtype=torch.bool, device=logits.device)
    selected.scatter_(1, index, in_range)
    selected_score = torch.zeros_like(probs).scatter(1, index, torch.where(in_range, scores, 0))
    real = torch.isfinite(logits[:, :1])  # [T, 1]: rows of padding have -inf logits
    pair_score = torch.where(selected, selected_score,
                             torch.where(real, probs, torch.full_like(probs, float("-inf"))))

    def columns_of_each_rank(t):  # [T, E] -> [W·T, E/W]: block q = rank q's experts' columns
        return t.reshape(T, world, E_local).transpose(0, 1).reshape(world * T, E_local)

    # Every rank's tokens' columns of this rank's experts [W·T, E/W], in rank order.
    column_scores = _SwapBlocks.apply(columns_of_each_rank(pair_score), world, group_name)
    column_selected = _swap_blocks(columns_of_each_rank(selected.to(torch.uint8)), world,
                                   group_name).bool()
    tokens = torch.isfinite(column_scores[:, 0]).sum()  # the group's tokens, on the device
    rounded = torch_backend._rounded_counts(column_selected.sum(0), tokens, mode, tile_m, seed,
                                            first_expert=rank * E_local)  # [E/W]
    keep = torch_backend.rounding_keep(column_scores, column_selected, rounded)  # [W·T, E/W]
    local = torch.arange(E_local, device=x.device, dtype=torch.int32).expand_as(keep)
    local = torch.where(keep, local, E_local)  # out of range: dropped
    kept_scores = torch.where(keep, column_scores, torch.zeros_like(column_scores))
    rows = local.shape[0]
    token = overlapped_experts.row_of_each_pair(rows, E_local, x.device)
    return _experts_on_gathered_rows(x, kept_scores.reshape(-1), token, local.to(torch.int32).reshape(-1), w1, w2,
                                     b1, b2, world, group_name, experts_kwargs)
