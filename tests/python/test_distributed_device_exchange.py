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
- the CUDA transport's own code (PullTransport: padded rows, the header, buffer views, growth,
  the two barriers around the pull), with the staging handle emulated over gloo (a barrier on
  channel 0 hands every rank the peers' buffers as they stand) and the pull_rows op by its
  PyTorch reference (rows it does not write left as stale bytes), gives bitwise the plain
  transport's results;
- max_tokens is required.
"""

import math

import pytest
import torch
import torch.distributed as dist
from spawn_helpers import reporting_failures, spawn_workers


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


def _small_case(rank, world, seed):
    """A small float64 expert-parallel layer on the torch backend with the device-counted exchange
    (4 experts per rank, K = 3) and this rank's tokens x and output gradient g (9 + rank rows)."""
    from machmoe.distributed import ExpertParallelMoE

    torch.manual_seed(seed)
    layer = ExpertParallelMoE(4 * world, 3, 16, 8, "swiglu", True, 0.3, backend="torch",
                              exchange="all_to_all_device", max_tokens=12, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(9 + rank, 16, generator=gen, dtype=torch.float64)
    g = torch.randn(9 + rank, 16, generator=gen, dtype=torch.float64)
    return layer, x, g


def _check_garbage_rows_route_nowhere(rank, world, seed):
    from machmoe import distributed

    layer, x, g = _small_case(rank, world, seed)
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


class _EmulatedStaging:
    """symmetric_exchange's staging handle over gloo: this rank's buffer a CPU tensor of stale
    bytes; barrier(channel=0) gives every rank a copy of every rank's buffer as it stands (what
    pull_rows reads), barrier(channel=1) takes them away again. pull(...) is the pull_rows op,
    allowed only between the two."""

    def __init__(self, nbytes, world):
        self.buf = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
        self.rank, self.world, self.buffer_ptrs, self.peers = dist.get_rank(), world, list(range(world)), None
        self.pulls = 0

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        assert rank == self.rank, "a rank wrote into a peer's staging buffer"
        start, n = storage_offset * dtype.itemsize, math.prod(sizes) * dtype.itemsize
        assert start + n <= self.buf.numel(), "a view past the staging buffer's end"
        return self.buf[start:start + n].view(dtype).view(sizes)

    def barrier(self, channel=0, timeout_ms=0):
        if channel == 0:
            assert self.peers is None, "two barriers on channel 0 in a row"
            self.peers = [torch.empty_like(self.buf) for _ in range(self.world)]
            dist.all_gather(self.peers, self.buf)
        else:
            assert self.peers is not None, "a barrier on channel 1 without one on channel 0"
            self.peers = None

    def pull(self, peers, header_offset, rows_offset, src_rows, rank, out_rows, row_bytes):
        from machmoe.device_count_transport import pull_rows_reference

        assert self.peers is not None, "pull_rows outside the two barriers"
        assert peers.tolist() == self.buffer_ptrs and rank == self.rank
        out, written = pull_rows_reference(self.peers, header_offset, rows_offset, src_rows, rank, out_rows,
                                           row_bytes)
        self.pulls += 1
        return torch.where(written[:, None], out, torch.full((), 0x5A, dtype=torch.uint8))


def _check_pull_transport_emulated(rank, world, seed):
    from types import SimpleNamespace

    from machmoe import device_count_transport as dct
    from machmoe import distributed, symmetric_exchange

    layer, x, g = _small_case(rank, world, seed)
    want = _run(layer, x, g)
    handles = []

    def staging(group_name, nbytes):  # grows as symmetric_exchange's does: a new handle
        if not handles or handles[-1].buf.numel() < nbytes:
            handles.append(_EmulatedStaging(max(nbytes, 2 * handles[-1].buf.numel() if handles else 0), world))
        return handles[-1]

    saved = [(symmetric_exchange, "_staging", symmetric_exchange._staging),
             (dct, "pull_unavailable_reason", dct.pull_unavailable_reason),
             (torch.cuda, "current_device", torch.cuda.current_device),
             (torch.cuda, "is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
             (torch.ops, "machmoe", torch.ops.machmoe),
             (distributed, "_device_count_transports", distributed._device_count_transports)]
    symmetric_exchange._staging = staging
    dct.pull_unavailable_reason = lambda device: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.ops.machmoe = SimpleNamespace(pull_rows=lambda *args: handles[-1].pull(*args))
    distributed._device_count_transports = lambda x, W, group: (dct.PullTransport(dist.group.WORLD.group_name, W, x.device),) * 2
    try:
        got = _run(layer, x, g)
        again = _run(layer, x, g)  # the same buffers again
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        dct._PEERS.clear()
    assert sum(h.pulls for h in handles) == 8, "pull_rows calls in two forwards and backwards"
    assert all(h.peers is None for h in handles), "a call ended between its two barriers"
    for a, b, c in zip(want, got, again):
        assert torch.equal(a, b) and torch.equal(a, c), "the pull transport's rows differ from the plain one's"


def _check_errors():
    from machmoe.distributed import ExpertParallelMoE

    with pytest.raises(ValueError, match="exchange='all_to_all_device' needs max_tokens"):
        ExpertParallelMoE(4, 1, 16, 8, backend="torch", exchange="all_to_all_device")


def _worker(rank, world, init_file, seed, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting_failures(rank, errors):
        _check_garbage_rows_route_nowhere(rank, world, seed)
        _check_overflow_sends_nothing(rank, world)
        _check_overflow_raises(rank, world)
        if world == 1:
            _check_one_rank(seed)
        else:
            _check_pull_transport_emulated(rank, world, seed)
        _check_errors()
        # Every rank past its last collective before any rank tears its group down. Once in about 40
        # runs a worker died of SIGABRT ("terminate called without an active exception") with no
        # Python error; a rank closing its connections while a peer still reads is the suspect.
        dist.barrier()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_device_counted_exchange_on_gloo(world, seed):
    spawn_workers(_worker, world, seed)


def test_capacity_and_send_rows():
    from machmoe.expert_device_exchange import capacity_rows, send_rows

    assert capacity_rows(10, 1.0, 4) == 40 and capacity_rows(10, 0.26, 4) == 11 and capacity_rows(1, 1e-9, 2) == 1
    assert send_rows(10, 8, 4) == 40 and send_rows(10, 2, 4) == 20 and send_rows(0, 2, 4) == 1
