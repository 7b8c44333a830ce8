"""The all-gather exchange of expert parallelism: every rank's tokens to every rank, the experts'
partial sums reduced back to their owners, with no host synchronisation.

Rank q of W holds experts [q·E/W, (q+1)·E/W). Each rank has routed its own T tokens (scores and
experts [T, K]). Then, per chunk of tokens:

1. all-gather x [Tc, d], the experts and the scores [Tc, K] over the group -> [W·Tc, ...], rank r's
   rows at [r·Tc, (r+1)·Tc) (a token crosses to each other rank once, whatever its K);
2. this rank's experts on the gathered rows (`functional.experts_topk`), a pair whose expert
   another rank holds marked out of range and so dropped -> partial sums [W·Tc, d];
3. reduce-scatter (sum) the partial sums: rank r gets its own Tc rows summed over the ranks.

Every size is known on the host before anything runs (T, the same on every rank, and K), so
nothing waits for the device: the host queues a whole forward or backward ahead of the GPU, and
the sequence is CUDA-graph capturable. The collectives are torch's functional collectives: each
is issued at once on the process group's stream and waited on by the stream that first needs its
result, so chunk c+1's gather runs while chunk c's experts compute, and chunk c's reduce-scatter
while chunk c+1's do (the backward mirrors it: the output gradient's gathers first, then per
chunk the experts' backward and the reduce-scatters of dx and of the scores' gradient).

Bytes each rank sends per forward: (W-1)·T·d·b for the gather and as many for the
reduce-scatter (b bytes per element), the same again in the backward. A filtered all-to-all sends
a token only to the ranks that hold one of its experts: the fraction 1 - C(E-E/W, K)/C(E, K) of
these bytes, which is 0.996 at W = 2 and 0.90 at W = 4 with E = 128, K = 8, but 0.66 at W = 8
(docs/SCALING.md).

Numerics: each rank's partial sum is rounded to x's dtype before the reduction, which adds in that
dtype; the reduction order is fixed, so two runs are bitwise equal.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import get_gradient_edge

from . import functional

_c10d = torch.ops._c10d_functional


def _gather(t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
    """[R, ...] -> [W·R, ...] in rank order: issued now, to be waited on with _wait."""
    return _c10d.all_gather_into_tensor(t.contiguous(), W, group_name)


def _reduce_scatter(t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
    """[W·R, ...] -> [R, ...], the sum over the ranks of this rank's block: issued now."""
    return _c10d.reduce_scatter_tensor(t.contiguous(), "sum", W, group_name)


def _wait(t: torch.Tensor) -> torch.Tensor:
    """The issuing collective's result, ordered before whatever the current stream runs next
    (a stream dependency, not a host wait, on CUDA)."""
    return _c10d.wait_tensor(t)


def chunk_bounds(T: int, chunks: int) -> list[tuple[int, int]]:
    """[0, T) in `chunks` contiguous parts of near-equal size (the first T % chunks one row
    longer), empty parts left out; the same on every rank for the same T."""
    chunks = max(1, min(chunks, T)) if T else 1
    base, extra = divmod(T, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class _GatheredExperts(torch.autograd.Function):
    """(x [T, d], scores [T, K], experts [T, K], w1, w2, b1, b2) -> out [T, d]: the module
    docstring's steps 1-3 over the chunks.

    Each chunk's experts call keeps its own autograd graph (from the gathered rows and scores and
    the weights' detached leaves); the backward walks those graphs chunk by chunk between the
    collectives, so that the exchange of one chunk overlaps the experts of another in both
    directions. Only a gradient edge of each graph's output is kept, not the output."""

    @staticmethod
    def forward(ctx, x, scores, experts, w1, w2, b1, b2, spec):
        W, rank, group_name, E_local, bounds, kwargs = spec
        ctx.spec = spec
        weights = [w for w in (w1, w2, b1, b2)]
        leaves = [None if w is None else w.detach().requires_grad_(w.requires_grad) for w in weights]
        ctx.leaves = leaves
        # 1. Every chunk's gathers first: the first chunk's experts wait for its own only.
        gathered = [(_gather(x[a:b], W, group_name), _gather(scores[a:b], W, group_name),
                     _gather(experts[a:b], W, group_name)) for a, b in bounds]
        offset = rank * E_local
        pieces, ctx.chunks = [], []
        for xg, sg, eg in gathered:
            xg = _wait(xg).detach().requires_grad_(ctx.needs_input_grad[0])
            sg = _wait(sg).detach().requires_grad_(ctx.needs_input_grad[1])
            local = _wait(eg) - offset
            # Experts another rank holds: out of [0, E_local), so dropped (no host check).
            local = torch.where((local >= 0) & (local < E_local), local, E_local)
            # 2. This rank's experts on all ranks' rows of the chunk.
            with torch.enable_grad():
                y = functional.experts_topk(xg, leaves[0], leaves[1], sg, local, b1=leaves[2],
                                            b2=leaves[3], **kwargs)  # [W·Tc, d]
            ctx.chunks.append((get_gradient_edge(y) if y.requires_grad else None, xg, sg))
            # 3. Issued now; waited on below, after the next chunk's experts are queued.
            pieces.append(_reduce_scatter(y.detach(), W, group_name))
        out = torch.cat([_wait(p) for p in pieces]) if pieces else x.new_empty(x.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        W, rank, group_name, E_local, bounds, kwargs = ctx.spec
        dout = dout.contiguous()
        grads_out = [_gather(dout[a:b], W, group_name) for a, b in bounds]
        leaves = ctx.leaves
        wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        dx_parts, ds_parts, dweights = [], [], [None] * len(wanted)
        for (edge, xg, sg), dyg in zip(ctx.chunks, grads_out):
            dyg = _wait(dyg)
            if edge is None:
                continue
            inputs = [t for t in (xg, sg) if t.requires_grad] + wanted
            got = torch.autograd.grad([edge], inputs, [dyg], allow_unused=True)
            got = list(got)
            if xg.requires_grad:
                dx_parts.append(_reduce_scatter(got.pop(0), W, group_name))
            if sg.requires_grad:
                ds_parts.append(_reduce_scatter(got.pop(0), W, group_name))
            for i, g in enumerate(got):  # weight gradients: summed over the chunks in >= fp32
                if g is not None:
                    acc = torch.promote_types(g.dtype, torch.float32)
                    dweights[i] = g.to(acc) if dweights[i] is None else dweights[i].add_(g)
        ctx.chunks = None
        dx = torch.cat([_wait(p) for p in dx_parts]) if dx_parts else None
        ds = torch.cat([_wait(p) for p in ds_parts]) if ds_parts else None
        by_leaf = {id(leaf): g for leaf, g in zip(wanted, dweights)}
        dw = [None if leaf is None or id(leaf) not in by_leaf or by_leaf[id(leaf)] is None
              else by_leaf[id(leaf)].to(leaf.dtype) for leaf in leaves]
        return (dx, ds, None, *dw, None)


def gathered_experts(x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                     w1: torch.Tensor, w2: torch.Tensor, b1: Optional[torch.Tensor],
                     b2: Optional[torch.Tensor], *, world: int, rank: int, group_name: str,
                     num_experts: int, chunks: int, **experts_kwargs) -> torch.Tensor:
    """out [T, d]: the experts of the whole group on this rank's tokens x [T, d] with their
    routing (scores [T, K] float, experts [T, K] global ids), this rank holding w1 [E/W, N1, d],
    w2 [E/W, d, n] (and b1, b2). T must be the same on every rank of the group (the caller pads);
    experts_kwargs go to functional.experts_topk (activation, layout, backend, glu_clamp)."""
    E_local = num_experts // world
    spec = (world, rank, group_name, E_local, chunk_bounds(x.shape[0], chunks), experts_kwargs)
    return _GatheredExperts.apply(x, scores, experts, w1, w2, b1, b2, spec)
