"""The all-gather exchange of expert parallelism at W = 2, 4 and 8 with every rank on ONE GPU: the
logic of the transfers overlapped with the expert kernels (machmoe.overlapped_experts) tested
without a multi-GPU machine.

torch's symmetric memory refuses ranks that share a device, so each rank's staging buffer is here
an ordinary CUDA tensor shared with the other ranks through CUDA IPC (torch.multiprocessing), and
a barrier waits on the host: every queued kernel and copy of the rank done (a device
synchronisation), then a gloo barrier. The copies, their order against the kernels on the two
streams and the sums are the library's own; only the transport's synchronisation is stronger than
on real GPUs, so the layer is checked for its values, not its overlap, and the CUDA-graph and
no-host-sync checks stay with test_gpu_distributed.py (several GPUs). Checked, as there: out, dx
and every gradient against the single-GPU layer and float64 (check_ep_layer), two runs bitwise
equal, the overlapped and the plain path's out and dx bitwise equal, torch.compile bitwise eager,
and the FP8 experts against the whole FP8 layer."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spawn_helpers import reporting_failures, spawn_workers

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

_STAGING_BYTES = 64 << 20  # each rank's buffer: the test's largest collective is ~1 MiB


class _IpcStaging:
    """Stands in for torch's symmetric-memory handle: rank q's buffer is buffers[q] (this rank's own,
    or a peer's opened through CUDA IPC), and a barrier waits on the host for every rank."""

    def __init__(self, buffers: list, rank: int):
        self.buffers, self.rank = buffers, rank

    def get_buffer(self, rank, shape, dtype, offset_elems):
        numel = math.prod(shape)
        return self.buffers[rank].view(dtype)[offset_elems:offset_elems + numel].view(shape)

    def barrier(self, channel=0, timeout_ms=0):
        torch.cuda.synchronize()  # this rank's writes (and reads) of the buffers are done
        dist.barrier()


def _share_staging(rank: int, world: int, queues: list) -> _IpcStaging:
    """Every rank's staging buffer on every rank: each sends its own to the others over
    multiprocessing queues (CUDA IPC handles), then all meet at a barrier."""
    own = torch.zeros(_STAGING_BYTES, dtype=torch.uint8, device="cuda")
    for q in range(world):
        if q != rank:
            queues[q].put((rank, own))
    buffers = [None] * world
    buffers[rank] = own
    for _ in range(world - 1):
        q, buf = queues[rank].get()
        buffers[q] = buf
    dist.barrier()
    return _IpcStaging(buffers, rank)


def _use_staging(handle) -> None:
    """The exchange's staging buffers are handle's (None: symmetric memory's again)."""
    from machmoe import symmetric_exchange

    def staging(group_name, nbytes):
        if nbytes > _STAGING_BYTES:
            raise RuntimeError(f"the test's staging buffer holds {_STAGING_BYTES} bytes; a collective needs {nbytes}")
        return handle

    symmetric_exchange._staging = _SYMMETRIC_STAGING if handle is None else staging
    symmetric_exchange._VIEWS.clear()


def _symmetric_staging():
    from machmoe import symmetric_exchange

    return symmetric_exchange._staging


_SYMMETRIC_STAGING = _symmetric_staging()


def _worker(rank, world, init_file, seed, errors, queues):
    import test_gpu_distributed as multi_gpu
    from machmoe.distributed import ExpertParallelMoE

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting_failures(rank, errors):
        _use_staging(_share_staging(rank, world, queues))
        model = multi_gpu._model(seed)
        xs, gs = multi_gpu._ep_batch(seed, world, model)
        ref = multi_gpu._mean_grads(copy.deepcopy(model).double(), [x.double() for x in xs], gs, "torch")
        single = multi_gpu._mean_grads(model, xs, gs, "machmoe")
        max_tokens = multi_gpu.T + 3 * (world - 1)
        for exchange in (dict(max_tokens=max_tokens + 5), dict(max_tokens=max_tokens, capacity_factor=0.9)):
            results = []
            for overlapped in (True, False):
                multi_gpu._force_transfers_overlapped(overlapped)
                layer = ExpertParallelMoE.from_moe(model, exchange="all_gather", **exchange)
                results.append(multi_gpu.check_ep_layer(layer, rank, world, xs, gs, single, ref,
                                                        f"one GPU, {exchange}, transfers overlapped {overlapped}"))
            for name, a, b in zip(("out", "dx"), results[0], results[1]):
                assert torch.equal(a, b), f"{exchange}: the overlapped transfers change {name}"
        multi_gpu._force_transfers_overlapped(True)
        multi_gpu._check_compiled(model, xs[rank], gs[rank], max_tokens)
        multi_gpu._check_fp8_on_kernels(rank, world, seed, "interleaved")
        _use_staging(None)  # the peers' buffers let go ...
        torch.cuda.synchronize()
        dist.barrier()  # ... on every rank before any rank frees its own


@pytest.mark.parametrize("world", [2, 4, 8])
def test_overlapped_exchange_with_every_rank_on_one_gpu(world, seed):
    queues = [mp.get_context("spawn").SimpleQueue() for _ in range(world)]  # each rank's inbox of buffers
    spawn_workers(_worker, world, seed, (queues,))
