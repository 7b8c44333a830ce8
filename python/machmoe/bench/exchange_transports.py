"""The transports an expert-parallel exchange can ride on, measured on this host's GPUs.

For each block size (the bytes one rank contributes, e.g. T·d·2 for a bf16 [T, d] activation):

- NCCL all-gather and reduce-scatter (torch.distributed, the process group's stream);
- a copy-engine all-gather from torch's symmetric memory: every rank's block in a buffer the
  others can address, each rank pulling the other blocks with cudaMemcpyAsync (no SMs);
- each of them running beside a bf16 GEMM on the compute stream: how much the GEMM slows, and
  how long the transfer takes, when the two share the GPU.

Times are per operation, the slowest rank's, after a barrier; "GB/s" is the bytes each rank
receives, (W-1)·block, over the time. Use it to fit docs/SCALING.md's bandwidth term.

    python -m machmoe.bench.exchange_transports --world 2 --mb 8,38,75,134
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, reps: int, stream=None) -> float:
    """ms per call of fn, the slowest rank's, measured on `stream` (default: current)."""
    stream = stream or torch.cuda.current_stream()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / reps], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _run(rank: int, world: int, init_file: str, sizes_mb: list, reps: int) -> None:
    import torch.distributed._symmetric_memory as symm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group_name = dist.group.WORLD.group_name
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_out = torch.empty_like(a)

    def gemm():
        torch.mm(a, a, out=gemm_out)

    gemm_ms = _time(gemm, reps)
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; bf16 GEMM 8192^3 alone {gemm_ms:.3f} ms")
        print()
        print("| block MB | transport | alone ms | GB/s received | beside GEMM: transfer ms | GEMM ms |")
        print("|--:|---|--:|--:|--:|--:|")
    for mb in sizes_mb:
        rows = int(mb * 2**20) // (2 * 4096)
        block = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(world * rows, 4096, device="cuda", dtype=torch.bfloat16)
        buf = symm.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)
        buf.copy_(block)
        handle = symm.rendezvous(buf, group_name)
        peers = [handle.get_buffer(q, (rows, 4096), torch.bfloat16) for q in range(world)]

        def nccl_gather():
            dist.all_gather_into_tensor(gathered, block)

        def nccl_reduce_scatter():
            dist.reduce_scatter_tensor(block, gathered)

        def ce_gather():
            handle.barrier(channel=0)
            for step in range(1, world):
                q = (rank + step) % world
                gathered[q * rows:(q + 1) * rows].copy_(peers[q])
            handle.barrier(channel=1)

        received = (world - 1) * rows * 4096 * 2 / 1e9
        for name, fn in (("NCCL all-gather", nccl_gather), ("NCCL reduce-scatter", nccl_reduce_scatter),
                         ("copy-engine all-gather", ce_gather)):
            alone = _time(fn, reps)

            def both():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                gemm()
                torch.cuda.current_stream().wait_stream(side)

            # Transfer time beside the GEMM: measured on its own stream in a second pass.
            for _ in range(3):
                both()
            torch.cuda.synchronize()
            dist.barrier()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            marks[0].record(side)
            marks[2].record()
            for _ in range(reps):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                gemm()
                torch.cuda.current_stream().wait_stream(side)
            marks[1].record(side)
            marks[3].record()
            torch.cuda.synchronize()
            t = torch.tensor([marks[0].elapsed_time(marks[1]) / reps, marks[2].elapsed_time(marks[3]) / reps],
                             device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"| {mb} | {name} | {alone:.3f} | {received / alone * 1e3:.0f} | "
                      f"{t[0].item():.3f} | {t[1].item():.3f} |", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m machmoe.bench.exchange_transports", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--mb", default="8,38,75,134", help="comma-separated block sizes in MiB")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("exchange_transports: needs two or more CUDA GPUs; nothing to measure")
        return
    world = args.world or torch.cuda.device_count()
    sizes = [float(s) for s in args.mb.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(world, os.path.join(tmp, "init"), sizes, args.reps), nprocs=world, join=True)


if __name__ == "__main__":
    main()
