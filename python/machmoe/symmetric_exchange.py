"""All-gather and reduce-scatter over the GPUs of one host by their copy engines, through torch's
symmetric memory: the collectives of the all-gather exchange (machmoe.expert_exchange) on CUDA.

Why not NCCL's: on two H200s over NVLink, NCCL's all-gather of a 75 MiB block (7B-a's x) runs at
223 GB/s received and its reduce-scatter at 211, while copy engines pulling the same block from
a peer run at 335 GB/s (350 at 134 MiB); `python -m machmoe.bench.exchange_transports` measures
both. Copy engines use no SMs, so the copies also leave the expert kernels their SMs.

How: each rank owns one staging buffer in symmetric memory (every rank can address every rank's).
A collective copies what this rank sends into its own staging buffer, waits at a barrier until
every rank has done so, pulls what it receives from the peers' buffers with cudaMemcpyAsync
(device-to-device over NVLink, the copy engines), and waits at a second barrier so that nobody
overwrites its buffer while a peer still reads it. Everything is queued on the current stream:
no host synchronisation, and the sequence is CUDA-graph capturable once the buffer exists.

The staging buffer is allocated (a collective rendezvous, with a host wait) the first time a
group needs it and again only when a call needs more bytes than it has: with `max_tokens` fixed
that is once. Its size is the largest collective's input, W·T·d·b bytes for the reduce-scatter
of the experts' partial sums (b = bytes per element).

Sums: rank r's block of the reduce-scatter is the sum over the ranks q = 0, 1, …, W-1 in that
order, accumulated in float32 and rounded once, so two runs are bitwise equal.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from . import _ops

_STAGING: dict[str, tuple[torch.Tensor, object]] = {}  # group name -> (buffer [bytes] uint8, handle)
# Views of the staging buffers by (handle, rank, shape, dtype, offset): each view is a tensor made on
# the host, which costs more host time per collective than its copy costs a small layer's GPU.
_VIEWS: dict = {}
# The smallest staging buffer: small collectives (the routing's) then never make it grow between
# large ones; memory is mapped in 2 MiB pages anyway.
_MIN_STAGING_BYTES = 16 << 20
# How long a barrier waits for the other ranks before it stops the program with a message naming
# the rank it did not hear from (torch's symmetric-memory barrier traps on the device): a rank that
# never arrives then ends the job, as NCCL's watchdog does after its default ten minutes, instead
# of hanging it.
BARRIER_TIMEOUT_MS = 600_000


@functools.lru_cache(maxsize=None)
def _torch_has_symmetric_memory() -> bool:
    return importlib.util.find_spec("torch.distributed._symmetric_memory") is not None


def available(t: torch.Tensor, W: int) -> bool:
    """Whether t's collectives over W ranks run here: a CUDA tensor, W > 1, and torch built with
    symmetric memory (looked up once per process)."""
    return t.is_cuda and W >= 2 and _torch_has_symmetric_memory()


def _staging(group_name: str, nbytes: int):
    """This group's staging handle, grown (a collective: every rank asks for the same bytes at the
    same call, as T and d are the same on every rank) when nbytes is more than it holds."""
    import torch.distributed._symmetric_memory as symm

    held = _STAGING.get(group_name)
    if held is not None and held[0].numel() >= nbytes:
        return held[1]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"expert parallelism: the exchange's staging buffer must grow to {nbytes} bytes inside a "
            "CUDA-graph capture; run one call of the largest size before capturing")
    # Peers may still read the old buffer: wait for all of this rank's queued work (every stream);
    # the rendezvous then waits for every rank, so all reads of the old buffers have finished
    # before they are freed. The new buffer's signal pads are zeroed when it is allocated: that
    # must be done before a peer's first barrier signals into them, hence the second wait.
    torch.cuda.synchronize()
    size = max(nbytes, _MIN_STAGING_BYTES, 2 * held[0].numel() if held is not None else 0)
    buffer = symm.empty(size, dtype=torch.uint8, device=torch.cuda.current_device())
    torch.cuda.synchronize()
    handle = symm.rendezvous(buffer, group_name)
    _STAGING[group_name] = (buffer, handle)
    _VIEWS.clear()
    return handle


def _view(handle, rank: int, like: torch.Tensor, offset_elems: int = 0) -> torch.Tensor:
    """Rank `rank`'s staging buffer seen as a tensor of like's shape and dtype."""
    return _buffer(handle, rank, tuple(like.shape), like.dtype, offset_elems)


def _buffer(handle, rank: int, shape: tuple, dtype: torch.dtype, offset_elems: int) -> torch.Tensor:
    key = (id(handle), rank, shape, dtype, offset_elems)
    view = _VIEWS.get(key)
    if view is None:
        view = _VIEWS[key] = handle.get_buffer(rank, shape, dtype, offset_elems)
    return view


def all_gather(t: torch.Tensor, W: int, group_name: str, rotated: bool = False) -> torch.Tensor:
    """t [R, ...] on every rank -> [W·R, ...], rank q's rows at [q·R, (q+1)·R), or (rotated) at
    rotated_place(q): this rank's own first."""
    return all_gather_parts([t], W, group_name, rotated)[0]


def all_gather_parts(ts: list, W: int, group_name: str, rotated: bool = False) -> list:
    """all_gather of each of ts, in one round of transfers (gather_parts)."""
    ts = [t.contiguous() for t in ts]
    outs = [t.new_empty((W * t.shape[0],) + tuple(t.shape[1:])) for t in ts]
    rank = gather_parts(list(zip(ts, outs)), W, group_name, rotated)
    place = 0 if rotated else rank
    for t, out in zip(ts, outs):
        out[place * t.shape[0]:(place + 1) * t.shape[0]].copy_(t)
    return outs


def reduce_scatter(t: torch.Tensor, W: int, group_name: str, rotated: bool = False) -> torch.Tensor:
    """t [W·R, ...] on every rank -> [R, ...]: rank r gets the sum over q = 0..W-1 (in that order,
    float32, rounded once) of rank q's block r, or (rotated) of its block rotated_place(r, q): the
    adjoint of all_gather with the same layout."""
    return reduce_scatter_parts([t], W, group_name, rotated)[0]


def reduce_scatter_parts(ts: list, W: int, group_name: str, rotated: bool = False) -> list:
    """reduce_scatter of each of ts, in one round of transfers."""
    return [sum_blocks(parts) for parts in _pull([t.contiguous() for t in ts], W, group_name, rotated, False)]


def rotated_place(q: int, rank: int, W: int) -> int:
    """Where rank q's block sits in this rank's rotated gather: its own first, then the ranks after
    it, (q - rank) mod W."""
    return (q - rank) % W


def _places(shapes_dtypes) -> tuple[list, int]:
    """Byte offsets of tensors of the given (shape, dtype) laid end to end in a staging buffer, each
    at a 256-byte boundary, and the bytes they span."""
    offsets, at = [], 0
    for shape, dtype in shapes_dtypes:
        offsets.append(at)
        at += (math.prod(shape) * dtype.itemsize + 255) // 256 * 256
    return offsets, at


def staging_bytes(layouts: list) -> int:
    """The staging bytes tensors of the given (shape, dtype) take laid out by _places (what
    gather_parts and pull_staged use)."""
    return _places(layouts)[1]


def gather_parts(parts: list, W: int, group_name: str, rotated: bool = False, after=None, staged=None) -> int:
    """The peers' blocks of all-gathers of several tensors in one round (one pair of barriers):
    parts [(t_i [R_i, ...], out_i [W·R_i, ...])], each t_i at its own place of the staging buffer
    (_places); rank q's block of out_i at q, or at rotated_place(q) (this rank's own first). This
    rank's own blocks are not written (the caller places them, on whatever stream it likes).
    after(i), if given, is called on the current stream once part i's blocks are pulled (and before
    the next part's), e.g. to record an event that work needing only part i waits for; staged(),
    once this rank's blocks are in its staging buffer (before the first barrier). Returns this
    rank. Only copies and barriers: it can run on a side stream beside kernels that leave an SM
    free."""
    ts = [t.contiguous() for t, _ in parts]
    offsets, nbytes = _places([(tuple(t.shape), t.dtype) for t in ts])
    handle = _staging(group_name, nbytes)
    rank = handle.rank
    for t, offset in zip(ts, offsets):
        _view(handle, rank, t, offset // t.element_size()).copy_(t)
    if staged is not None:
        staged()
    handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
    for i, (t, (_, out), offset) in enumerate(zip(ts, parts, offsets)):
        blocks = out.chunk(W)
        for step in range(1, W):
            q = (rank + step) % W
            place = rotated_place(q, rank, W) if rotated else q
            blocks[place].copy_(_view(handle, q, t, offset // t.element_size()))  # by a copy engine
        if after is not None:
            after(i)
    handle.barrier(channel=1, timeout_ms=BARRIER_TIMEOUT_MS)
    return rank


def staging_views(group_name: str, layouts: list, reserve_bytes: int = 0) -> list:
    """This rank's staging buffer as tensors of the given (shape, dtype), laid end to end (_places,
    as pull_staged expects them: a caller that writes what it sends there saves the copy into it),
    the buffer first grown to hold them and at least reserve_bytes (growing it later would leave
    these views behind: reserve what the collectives that use them need). Overwritten by this
    group's next collective."""
    offsets, nbytes = _places(layouts)
    handle = _staging(group_name, max(nbytes, reserve_bytes))
    return [_buffer(handle, handle.rank, tuple(shape), dtype, offset // dtype.itemsize)
            for (shape, dtype), offset in zip(layouts, offsets)]


def pull_staged(ts: list, W: int, group_name: str) -> list:
    """The transfer half of a rotated reduce_scatter of several tensors in one round (one pair of
    barriers), their blocks already where the peers pull them: ts are staging_views' tensors of one
    call, in its order, each [W·R_i, ...], block rotated_place(q) for rank q. Returns each one's W
    blocks in rank order (its own, the first, a view, never read here: the caller may still be
    computing it). Only copies and barriers: it can run on a side stream beside kernels that leave
    an SM free."""
    return _pull(ts, W, group_name, True, True)


def _pull(ts: list, W: int, group_name: str, rotated: bool, in_staging: bool) -> list:
    """For each t [W·R, ...]: the W blocks [R, ...] this rank sums, in rank order (rank q's block
    for this rank at q, this rank's own a view of t). t's block q goes to rank q, or (rotated) its
    block rotated_place(q). in_staging: the ts are staging_views' tensors; otherwise they are first
    copied into the staging buffer (each at its _places offset)."""
    for t in ts:
        if t.shape[0] % W:
            raise ValueError(f"reduce_scatter: t has {t.shape[0]} rows, not a multiple of W = {W}")
    offsets, nbytes = _places([(tuple(t.shape), t.dtype) for t in ts])
    handle = _staging(group_name, nbytes)
    rank = handle.rank

    def slot(owner, dest):  # where owner's staging holds its block for dest (in blocks)
        return rotated_place(dest, owner, W) if rotated else dest

    by_destination = []
    for t, offset in zip(ts, offsets):
        chunks = t.chunk(W)
        mine = [chunks[rotated_place(q, rank, W)] for q in range(W)] if rotated else list(chunks)
        block_elems, base = mine[0].numel(), offset // t.element_size()
        by_destination.append((mine, block_elems, base))
        if not in_staging:
            for q in range(W):  # the blocks the other ranks will pull, each at its place
                if q != rank:
                    _view(handle, rank, mine[q], base + slot(rank, q) * block_elems).copy_(mine[q])
    handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
    results = []
    for mine, block_elems, base in by_destination:
        parts = []
        for q in range(W):
            if q == rank:
                parts.append(mine[q])
            else:
                pulled = torch.empty_like(mine[q])
                pulled.copy_(_view(handle, q, mine[q], base + slot(q, rank) * block_elems))  # by a copy engine
                parts.append(pulled)
        results.append(parts)
    handle.barrier(channel=1, timeout_ms=BARRIER_TIMEOUT_MS)
    return results


def sum_blocks(parts: list) -> torch.Tensor:
    """Σ parts in list order, accumulated in float32 and rounded once to their dtype, into a fresh
    tensor (parts[0] can be a view of the caller's input, this rank's own block).

    More than two parts, on a GPU that runs machmoe's kernels: one kernel
    (torch.ops.machmoe.sum_blocks) that reads each part once and writes the sum once, W + 1
    block-sizes of memory traffic. Otherwise PyTorch (sum_blocks_torch): two parts are one add
    (computed in float32, rounded once; 5% faster than the kernel on an H200); more are one pass
    per part, the first copied into a float32 buffer, the middle ones added to it in place, the
    last added while rounding to the parts' dtype (float32 + bf16 computes in float32; bf16 + bf16
    into a float32 output would round the sum to bf16 first), 17 block-sizes at W = 4 and bf16,
    5.3-6.3x the kernel's time at W = 4-8. Both give the same bits."""
    if (2 < len(parts) <= _KERNEL_MAX_PARTS and parts[0].is_cuda
            and _ops.kernels_unavailable_reason(parts[0].device) is None):
        return torch.ops.machmoe.sum_blocks([p.contiguous() for p in parts])
    return sum_blocks_torch(parts)


_KERNEL_MAX_PARTS = 64  # the kernel's limit (machmoe/sum_blocks.hpp)


def sum_blocks_torch(parts: list) -> torch.Tensor:
    """sum_blocks in PyTorch ops (any device, any number of parts)."""
    if len(parts) == 1:
        return parts[0].clone()
    if len(parts) == 2:
        return torch.add(parts[0], parts[1])  # computed in float32 and rounded once
    acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:-1]:
        acc += p
    return torch.add(acc, parts[-1], out=torch.empty_like(parts[0]))


# As custom ops, so that torch.compile keeps each collective as one opaque node of the graph
# (the staging handle and the barriers are not traceable).
# (In eager mode callers call the functions themselves: an op's Python dispatch costs ~0.2 ms of
# host time per call on an H200's host, more than a small layer's collective costs the GPU.)
@torch.library.custom_op("machmoe::symmetric_all_gather_parts", mutates_args=())
def all_gather_parts_op(ts: list[torch.Tensor], W: int, group_name: str, rotated: bool = False) -> list[torch.Tensor]:
    return all_gather_parts(ts, W, group_name, rotated)


@all_gather_parts_op.register_fake
def _(ts, W, group_name, rotated=False):
    return [t.new_empty((W * t.shape[0],) + tuple(t.shape[1:])) for t in ts]


@torch.library.custom_op("machmoe::symmetric_reduce_scatter_parts", mutates_args=())
def reduce_scatter_parts_op(ts: list[torch.Tensor], W: int, group_name: str,
                            rotated: bool = False) -> list[torch.Tensor]:
    return reduce_scatter_parts(ts, W, group_name, rotated)


@reduce_scatter_parts_op.register_fake
def _(ts, W, group_name, rotated=False):
    return [t.new_empty((t.shape[0] // W,) + tuple(t.shape[1:])) for t in ts]
