"""The device-counted all-to-all exchange (exchange="all_to_all_device",
machmoe.expert_device_exchange) on the CPU: W processes over gloo, the torch backend in float64.

test_distributed.py runs it on every layer case against the whole layer. This file checks what
those cases cannot see on the CPU's zero-filled transport:
- rows of the receive buffers that nothing filled (on CUDA: stale bytes) route nowhere and reach
  no output or gradient: a transport that fills them with NaN (and in-range expert ids) must give
  bitwise the same results as the plain one (the exchange resets both their ids to the sentinel
  and their x and scores to 0: either alone suffices, and with neither this fails);
- an overflow sends no rows at all and makes the output NaN (the device path, which on the CPU
  raises instead: the raise is checked too, on every rank, and a call that fits afterwards works);
- one rank (its transport a local copy) equals the whole layer;
- the CUDA transport's own code (NvshmemTransport: padded rows, buffer views, growth), with
  torch's symmetric memory and all_to_all_vdev emulated over gloo as that op is documented to
  behave (the emulation also asserts the op's even split of each peer's bytes over its blocks),
  gives bitwise the plain transport's results;
- max_tokens is required.
"""

import math
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _garbage_transports(group, calls):
    """host_count_transport, with every received row past those that arrived filled: the x,
    score and gradient bytes with 0xFF (NaN), the expert ids (the third part of a dispatch) with
    0 (an expert this rank holds). calls: a list that records each call's counts."""
    from machmoe.device_count_transport import host_count_transport

    plain = host_count_transport(group)

    def transport(parts, send_counts, recv_counts, out_rows):
        calls.append((send_counts.clone(), recv_counts.clone()))
        got = plain(parts, send_counts, recv_counts, out_rows)
        filled = int(recv_counts.sum())
        start = 0
        for i, part in enumerate(parts):
            width = part.shape[1]
            got[filled:, start:start + width] = 0 if (len(parts) == 3 and i == 2) else 0xFF
            start += width
        return got

    return transport, transport


def _run(layer, x, g):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, aux = layer(x)
    ((out * g).sum() + 0.1 * aux).backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def _check_garbage_rows_route_nowhere(rank, world, seed):
    from machmoe import distributed
    from machmoe.distributed import ExpertParallelMoE

    torch.manual_seed(seed)
    layer = ExpertParallelMoE(4 * world, 3, 16, 8, "swiglu", True, 0.3, backend="torch",
                              exchange="all_to_all_device", max_tokens=12, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(9 + rank, 16, generator=gen, dtype=torch.float64)
    g = torch.randn(9 + rank, 16, generator=gen, dtype=torch.float64)
    want = _run(layer, x, g)
    calls = []
    plain = distributed._device_count_transports
    distributed._device_count_transports = lambda x, W, group: _garbage_transports(group, calls)
    try:
        got = _run(layer, x, g)
    finally:
        distributed._device_count_transports = plain
    assert len(calls) == 4, f"{len(calls)} transport calls (dispatch, combine and their backwards)"
    for a, b in zip(want, got):
        assert torch.equal(a, b), "rows the exchange did not fill reached an output or a gradient"


def _check_overflow_sends_nothing(rank, world):
    """The device path of an overflow, forced on the CPU: no rows travel and every output is NaN."""
    from machmoe import distributed, expert_device_exchange
    from machmoe.distributed import ExpertParallelMoE

    layer = ExpertParallelMoE(2 * world, 2, 16, 8, backend="torch", exchange="all_to_all_device",
                              max_tokens=8).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    calls = []
    plain_transports, plain_overflow = distributed._device_count_transports, expert_device_exchange.agreed_overflow
    distributed._device_count_transports = lambda x, W, group: _garbage_transports(group, calls)
    expert_device_exchange.agreed_overflow = lambda count, capacity, group, what: torch.tensor(True)
    try:
        out, _ = layer(x)
    finally:
        distributed._device_count_transports = plain_transports
        expert_device_exchange.agreed_overflow = plain_overflow
    assert torch.isnan(out).all(), "an overflowing call's output is not all NaN"
    assert len(calls) == 2, f"{len(calls)} transport calls in a forward (dispatch, combine)"
    for send, recv in calls:
        assert send.sum() == 0 and recv.sum() == 0, "an overflowing call still sent rows"


def _check_overflow_raises(rank, world):
    """Receive buffers too small: every rank raises on the CPU, before any rows travel, naming the
    worst count and the capacity; a call that fits afterwards works."""
    from machmoe.distributed import ExpertParallelMoE

    # K = E: every token goes to every rank, so each rank receives W · T rows.
    layer = ExpertParallelMoE(2 * world, 2 * world, 16, 8, backend="torch", exchange="all_to_all_device",
                              max_tokens=10, capacity_factor=0.5)
    x = torch.randn(10, 16, dtype=layer.router.weight.dtype)
    capacity = -(-world * 10 // 2)
    with pytest.raises(RuntimeError, match=f"had {world * 10} rows to receive, more than its capacity of {capacity} "):
        layer(x)
    out, _ = layer(x[:5])
    assert torch.isfinite(out).all()


def _check_one_rank(seed):
    """W = 1: the local transport; output and every gradient equal the whole layer's (float64,
    the same sums in the same order) with room to spare and with a capacity below max_tokens."""
    from machmoe import MoE
    from machmoe.distributed import ExpertParallelMoE

    torch.manual_seed(seed)
    full = MoE(4, 2, 16, 8, "swiglu", True, 0.3, backend="torch").double()
    x = torch.randn(9, 16, dtype=torch.float64)
    g = torch.randn(9, 16, dtype=torch.float64)
    want = _run(full, x, g)
    for factor in (1.0, 0.85):  # 0.85 · 11 rows: 10 >= 9
        layer = ExpertParallelMoE.from_moe(full, exchange="all_to_all_device", max_tokens=11,
                                           capacity_factor=factor)
        got = _run(layer, x, g)
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() <= 1e-12, "one rank differs from the whole layer"


class _EmulatedVdev:
    """torch.ops.symm_mem.all_to_all_vdev over gloo, as the op is documented to behave: rank r
    pulls in_splits[r] rows from each peer q, starting at the exclusive prefix sum of q's
    in_splits, and writes them at the exclusive prefix sum of what it receives, in sender order;
    out_splits_offsets gets the counts and offsets. Each peer's bytes must split evenly over
    num_blocks // W blocks (num_blocks: one per 64 KiB of input, rounded up to a multiple of W, at
    most 64), which the op asserts."""

    def __init__(self, world):
        self.world, self.calls = world, 0

    def all_to_all_vdev(self, inp, out, in_splits, out_splits_offsets, group_name):
        W = self.world
        splits = [torch.empty_like(in_splits) for _ in range(W)]
        dist.all_gather(splits, in_splits.clone())
        rows = [torch.empty_like(inp) for _ in range(W)]
        dist.all_gather(rows, inp.contiguous())
        me = dist.get_rank()
        stride = inp.stride(0) * inp.element_size()
        blocks = min(-(-(-(-inp.numel() * inp.element_size() // 65536)) // W) * W, 64)
        per_peer = max(blocks // W, 1)
        at = 0
        for q in range(W):
            n = int(splits[q][me])
            assert n * stride % per_peer == 0, f"{n} rows of {stride} bytes over {per_peer} blocks"
            start = int(splits[q][:me].sum())
            out[at:at + n] = rows[q][start:start + n]
            out_splits_offsets[0, q], out_splits_offsets[1, q] = n, at
            at += n
        self.calls += 1


def _check_nvshmem_transport_emulated(rank, world, seed):
    import torch.distributed._symmetric_memory as symm

    from machmoe import device_count_transport as dct
    from machmoe import distributed
    from machmoe.distributed import ExpertParallelMoE

    torch.manual_seed(seed)
    layer = ExpertParallelMoE(4 * world, 3, 16, 8, "swiglu", True, 0.3, backend="torch",
                              exchange="all_to_all_device", max_tokens=12, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(9 + rank, 16, generator=gen, dtype=torch.float64)
    g = torch.randn(9 + rank, 16, generator=gen, dtype=torch.float64)
    want = _run(layer, x, g)
    vdev = _EmulatedVdev(world)
    saved = [(symm, "empty", symm.empty), (symm, "rendezvous", symm.rendezvous),
             (symm, "get_backend", symm.get_backend), (dct, "nvshmem_unavailable_reason", dct.nvshmem_unavailable_reason),
             (torch.cuda, "synchronize", torch.cuda.synchronize), (torch.ops, "symm_mem", torch.ops.symm_mem),
             (torch.cuda, "is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
             (distributed, "_device_count_transports", distributed._device_count_transports)]
    # Stale bytes in every new buffer, as symmetric memory may hold.
    symm.empty = lambda *size, dtype=None, device=None: torch.full(
        (math.prod(size) * dtype.itemsize,), 0xA5, dtype=torch.uint8).view(dtype).reshape(size)
    symm.rendezvous = lambda t, group: None
    symm.get_backend = lambda device: "NVSHMEM"
    dct.nvshmem_unavailable_reason = lambda: None
    torch.cuda.synchronize = lambda *args: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.ops.symm_mem = vdev
    distributed._device_count_transports = lambda x, W, group: tuple(
        dct.NvshmemTransport(dist.group.WORLD.group_name, W, x.device) for _ in range(2))
    try:
        got = _run(layer, x, g)
        again = _run(layer, x, g)  # the same buffers again
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    assert vdev.calls == 8, f"{vdev.calls} all_to_all_vdev calls in two forwards and backwards"
    for a, b, c in zip(want, got, again):
        assert torch.equal(a, b) and torch.equal(a, c), "the NVSHMEM transport's rows differ from the plain one's"


def _check_errors():
    from machmoe.distributed import ExpertParallelMoE

    with pytest.raises(ValueError, match="exchange='all_to_all_device' needs max_tokens"):
        ExpertParallelMoE(4, 1, 16, 8, backend="torch", exchange="all_to_all_device")


def _worker(rank, world, init_file, seed, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_garbage_rows_route_nowhere(rank, world, seed)
        _check_overflow_sends_nothing(rank, world)
        _check_overflow_raises(rank, world)
        if world == 1:
            _check_one_rank(seed)
        else:
            _check_nvshmem_transport_emulated(rank, world, seed)
        _check_errors()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_device_counted_exchange_on_gloo(world, seed):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), seed, errors), nprocs=world, join=True)
        except Exception:
            messages = []
            while not errors.empty():
                messages.append(errors.get())
            pytest.fail("\n".join(messages) or "a worker failed", pytrace=False)


def test_capacity_and_send_rows():
    from machmoe.expert_device_exchange import capacity_rows, send_rows

    assert capacity_rows(10, 1.0, 4) == 40 and capacity_rows(10, 0.26, 4) == 11 and capacity_rows(1, 1e-9, 2) == 1
    assert send_rows(10, 8, 4) == 40 and send_rows(10, 2, 4) == 20 and send_rows(0, 2, 4) == 1


@pytest.mark.parametrize("W", [1, 2, 3, 4, 6, 8, 16, 64])
def test_rows_split_evenly_over_the_ops_blocks(W, monkeypatch):
    """all_to_all_vdev splits each peer's bytes over num_blocks // W blocks and asserts they
    divide evenly; on an input of 4 MiB or more num_blocks is 64 (one host), 16 (several) or 8
    (older builds), or TORCH_SYMMMEM_NBLOCKS: padded rows divide evenly for each."""
    from machmoe.device_count_transport import row_quantum

    monkeypatch.delenv("TORCH_SYMMMEM_NBLOCKS", raising=False)
    for blocks in (64, 16, 8):
        assert row_quantum(W) % max(blocks // W, 1) == 0 and row_quantum(W) % 16 == 0
    monkeypatch.setenv("TORCH_SYMMMEM_NBLOCKS", "24")
    assert row_quantum(W) % max(24 // W, 1) == 0
