"""Running a test's worker on W processes (gloo or NCCL, the worker initialises its group):
each worker gets (rank, world, init_file, seed, errors) and runs its body inside
reporting_failures, which puts its traceback on `errors` before re-raising, so that the test fails
with every rank's message rather than the spawn's alone."""

import contextlib
import os
import tempfile
import traceback

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_workers(worker, world: int, seed: int, extra_args: tuple = ()) -> None:
    """worker(rank, world, init_file, seed, errors, *extra_args) on `world` processes; a failure on
    any rank fails the calling test with the ranks' tracebacks."""
    errors = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(worker, args=(world, os.path.join(tmp, "init"), seed, errors) + tuple(extra_args), nprocs=world,
                     join=True)
        except Exception:
            messages = []
            while not errors.empty():
                messages.append(errors.get())
            pytest.fail("\n".join(messages) or "a worker failed", pytrace=False)


@contextlib.contextmanager
def reporting_failures(rank: int, errors):
    """A worker's body, after it joined its process group: a failure puts the rank's traceback on
    `errors` (spawn_workers reports them) before it propagates; the group is torn down either way."""
    try:
        yield
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
