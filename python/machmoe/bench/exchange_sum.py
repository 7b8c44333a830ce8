"""The sum that ends expert parallelism's reduce-scatter, on one GPU: W blocks of a config's
[T, d] bf16 activation (one rank's share: its own block and one from each peer) added in float32
in rank order and rounded once, by the one-pass kernel (torch.ops.machmoe.sum_blocks) and by
PyTorch's passes (machmoe.symmetric_exchange.sum_blocks_torch), in the same run. The layer's
forward (the partial sums) and backward (dx) each end in one such sum; "GB/s" counts the bytes
each moves as W + 1 blocks (read W, write one), whatever the implementation.

    python -m machmoe.bench.exchange_sum --configs 7B-a,30B-b --world 2,4,8
"""

from __future__ import annotations

import argparse

import torch

from machmoe import symmetric_exchange
from machmoe.bench.configs import select_configs
from machmoe.bench.timing import cuda_time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m machmoe.bench.exchange_sum", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="7B-a,30B-b,120B-b,DeepSeek-V3")
    parser.add_argument("--world", default="2,4,8", help="comma-separated W (blocks summed)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("exchange_sum: no CUDA device, nothing to measure")
        return
    print(f"# W-way sum of [T, d] bf16 blocks, {torch.cuda.get_device_name()}: ms (GB/s of (W + 1) blocks)")
    print("| config | W | block MiB | kernel | PyTorch passes | PyTorch / kernel |")
    print("|---|--:|--:|--:|--:|--:|")
    for cfg in select_configs(args.configs):
        for W in (int(w) for w in args.world.split(",")):
            sets = [[torch.randn(cfg.T, cfg.d, device="cuda").bfloat16() for _ in range(W)] for _ in range(2)]
            block = cfg.T * cfg.d * 2
            moved = (W + 1) * block
            kernel = cuda_time(lambda p: torch.ops.machmoe.sum_blocks(p), [(s,) for s in sets])
            passes = cuda_time(symmetric_exchange.sum_blocks_torch, [(s,) for s in sets])
            rate = lambda t: f"{t.median_ms:.3f} ({moved / t.median_ms / 1e6:.0f})"  # noqa: E731
            print(f"| {cfg.name} | {W} | {block / 2**20:.0f} | {rate(kernel)} | {rate(passes)} "
                  f"| {passes.median_ms / kernel.median_ms:.2f} |")
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
