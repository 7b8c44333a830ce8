"""The device-counted all-to-all exchange (exchange="all_to_all_device") on two GPUs: NCCL for the
counts, torch's symmetric memory and machmoe's pull_rows kernel for the rows (PullTransport).
Skipped without two GPUs or without the compiled ops; the layer's checks also run on one GPU
(W = 1, a local copy).

- the transport alone against NCCL's all_to_all_single, for random counts (some zero), no rows
  at all, every rank sending all its rows to one peer into a receive buffer that just fits, and
  row widths that are not multiples of 16 bytes; with the all-gather exchange's collectives on
  the same staging buffer between its calls (the two exchanges share a process); then its
  bandwidth against NCCL's beside it, printed (pytest -s);
- the layer on the machmoe backend against a float64 reference of the whole layer (the torch
  backend) beside the single-GPU machmoe layer on the same batches, every tensor held to 2x the
  single GPU's error plus 2^-8, as test_gpu_distributed.py's expert-parallel cases derive it
  (the sharded layer rounds each rank's partial sum to bf16 before the combine); two runs
  bitwise equal;
- forward + backward without a host synchronisation, and captured in a CUDA graph, replaying to
  bitwise the eager results;
- an overflow: NaN output on every rank, check_capacity() raising, the next roomy call finite.
"""

import faulthandler
import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_test_helpers import eager_and_graph_replay
from test_gpu_distributed import _ep_batch, _mean_grads, _model, check_ep_layer, T

pytestmark = pytest.mark.gpu

def _device(world, **settings):
    """The exchange's settings at W = world: max_tokens the largest rank's T (_ep_batch gives rank
    q T + 3q tokens) and 5 spare rows."""
    return dict(exchange="all_to_all_device", max_tokens=T + 3 * (world - 1) + 5, **settings)


def _skip_reason(world):
    if torch.cuda.device_count() < world:
        return f"needs {world} GPUs"
    if world == 1:  # one rank: a local copy, no symmetric memory
        return None
    from machmoe.device_count_transport import pull_unavailable_reason

    return pull_unavailable_reason(torch.device("cuda", 0))


def _spawn(worker, seed, world):
    reason = _skip_reason(world)
    if reason is not None:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), seed), nprocs=world, join=True)


def _init(rank, world, init_file):
    faulthandler.dump_traceback_later(600, exit=True)  # a rank stuck in a collective shows where
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _run(rank, world, init_file, check, *args):
    """check(rank, world, *args) in an initialised group. A failing rank reports and leaves at
    once: its peers would wait for it in their next collective (a hang, not a failure)."""
    _init(rank, world, init_file)
    try:
        check(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _transport_worker(rank, world, init_file, seed):
    _run(rank, world, init_file, _check_transport, seed)


def _counts(kind, R, rank, world, gen):
    """[W] rows this rank sends each rank: random (about a third of them 0), none, or all R to the
    next rank."""
    if kind == "random":
        counts = torch.randint(0, R // world + 1, (world,), device="cuda", generator=gen)
        return counts * (torch.rand(world, device="cuda", generator=gen) > 0.33)
    counts = torch.zeros(world, dtype=torch.int64, device="cuda")
    if kind == "everything":
        counts[(rank + 1) % world] = R
    return counts


def _check_transport(rank, world, seed):
    from machmoe import symmetric_exchange
    from machmoe.device_count_transport import PullTransport

    name = dist.group.WORLD.group_name
    transport = PullTransport.get(name, world, torch.device("cuda", rank))
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    # (rows R, part widths in bytes (their sum never a multiple of 16: the transport pads), counts,
    # out_rows). The staging buffer grows at the larger calls; "everything" fills its receive
    # buffer exactly (each rank receives R rows).
    calls = [(100, [6, 4, 8], "random", world * 100), (100, [2, 2], "nothing", 5),
             (5000, [514, 16, 16], "random", world * 5000), (7001, [1], "everything", 7001),
             (4096, [4096, 36, 36], "everything", 4096), (3001, [4100], "random", world * 3001)]
    for call, (R, widths, kind, cap) in enumerate(calls):
        parts = [torch.randint(0, 256, (R, w), device="cuda", generator=gen, dtype=torch.uint8)
                 for w in widths]
        counts = _counts(kind, R, rank, world, gen)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)
        got = transport(parts, counts, recv, cap).clone()
        rows = torch.cat(parts, 1)
        send_h, recv_h = counts.tolist(), recv.tolist()
        want = rows.new_empty(sum(recv_h), rows.shape[1])
        dist.all_to_all_single(want, rows[:sum(send_h)].contiguous(), recv_h, send_h)
        assert got.shape == (cap, rows.shape[1]), f"call {call}: shape {tuple(got.shape)}"
        assert torch.equal(got[:sum(recv_h)], want), f"pull transport call {call} ({kind}): rows differ from NCCL's"
        # The all-gather exchange's collective on the same staging buffer, between two calls.
        block = torch.randn(R, 8, device="cuda", generator=gen).bfloat16()
        gathered = torch.empty(world * R, 8, dtype=block.dtype, device="cuda")
        dist.all_gather_into_tensor(gathered, block)
        assert torch.equal(symmetric_exchange.all_gather(block, world, name), gathered), "all_gather differs"
    _time_transport(transport, rank, world)


def _time_transport(transport, rank, world):
    """Bandwidth of a dispatch-sized call (7B-a's: 8192 tokens of d = 2048, bf16, K = 8) against
    NCCL's all_to_all_single of the same rows, printed on rank 0: received bytes per second."""
    R, B = 8192, 2 * 2048 + 64
    rows = torch.randint(0, 256, (R, B), device="cuda", dtype=torch.uint8)
    counts = torch.full((world,), R // world, dtype=torch.int64, device="cuda")
    out = torch.empty(R, B, dtype=torch.uint8, device="cuda")
    runs = {"pull_rows": lambda: transport([rows], counts, counts, R),
            "nccl": lambda: dist.all_to_all_single(out, rows)}
    for label, fn in runs.items():
        for _ in range(3):
            fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            fn()
        stop.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(stop) / 20
        if rank == 0:
            print(f"W={world} {label}: {R} rows of {B} bytes in {ms * 1e3:.0f} us, "
                  f"{R * B * (world - 1) / world / ms / 1e6:.0f} GB/s from the peers")


def _check_no_sync_and_graph(model, x, g):
    """Forward + backward without a host sync, and the same call captured in a CUDA graph
    replaying to bitwise the eager results (gpu_test_helpers.eager_and_graph_replay)."""
    from machmoe.distributed import ExpertParallelMoE, check_capacity

    eager, captured = eager_and_graph_replay(
        lambda: ExpertParallelMoE.from_moe(model, **_device(dist.get_world_size())), x, g)
    check_capacity()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b), "all_to_all_device: the graph's replay differs from the eager call"


def _check_overflow(model, x, rank):
    from machmoe.distributed import ExpertParallelMoE, check_capacity

    world = dist.get_world_size()
    tight = ExpertParallelMoE.from_moe(model, **_device(world, capacity_factor=0.05))
    out, _ = tight(x)
    assert torch.isnan(out).all(), f"rank {rank}: an overflowing call's output is not all NaN"
    capacity = -(-5 * world * _device(world)["max_tokens"] // 100)  # ceil(0.05 · W · max_tokens)
    with pytest.raises(RuntimeError, match=f"rows to receive, more than its capacity of {capacity} "):
        check_capacity()
    out, _ = ExpertParallelMoE.from_moe(model, **_device(world))(x)
    check_capacity()
    assert torch.isfinite(out).all(), f"rank {rank}: the call after an overflow is not finite"


def _layer_worker(rank, world, init_file, seed):
    _run(rank, world, init_file, _check_layer, seed)


def _check_layer(rank, world, seed):
    import copy

    from machmoe.distributed import ExpertParallelMoE

    model = _model(seed)
    xs, gs = _ep_batch(seed, world, model)
    ref_out, ref_dx, ref_grads = _mean_grads(copy.deepcopy(model).double(),
                                             [x.double() for x in xs], gs, "torch")
    one_out, one_dx, one_grads = _mean_grads(model, xs, gs, "machmoe")
    check_ep_layer(ExpertParallelMoE.from_moe(model, **_device(world)), rank, world, xs, gs,
                   (one_out, one_dx, one_grads), (ref_out, ref_dx, ref_grads), "all_to_all_device")
    _check_no_sync_and_graph(model, xs[rank], gs[rank])
    _check_overflow(model, xs[rank], rank)


@pytest.mark.ops
def test_pull_transport_equals_nccls_all_to_all(seed):
    _spawn(_transport_worker, seed, 2)


@pytest.mark.ops
@pytest.mark.parametrize("world", [1, 2])
def test_device_counted_exchange_on_the_gpus(world, seed):
    _spawn(_layer_worker, seed, world)
