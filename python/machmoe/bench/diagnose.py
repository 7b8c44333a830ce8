"""Where the time goes, for kernel work on the GPU machine (not part of the main job):

  python -m machmoe.bench.diagnose

* per-kernel device time of routing_metadata (torch.profiler), to see which pass dominates;
* the up-projection GEMM at a config's shapes in six variants - A gathered by token, gathered by
  an identity index (the cp.async path over consecutive rows) or pre-gathered (TMA), each with the
  GLU or the plain-store epilogue - to separate the cost of the gather from the cost of the epilogue.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from .gemm_kernels import random_routing
from .timing import cuda_time, matmul_tflops


def metadata_breakdown(T: int = 32768, E: int = 128, K: int = 8) -> None:
    import machmoe  # noqa: F401  (loads the ops)

    m = torch.ops.machmoe
    e = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K].int().contiguous()
    for _ in range(3):
        m.routing_metadata(e, None, T, E)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            m.routing_metadata(e, None, T, E)
        torch.cuda.synchronize()
    print(f"routing_metadata T={T} E={E} K={K}, 20 calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


def dense_reference() -> None:
    """cuBLAS bf16 8192^3 in the same run: the yardstick to compare runs on different machines."""
    tflops, _ = matmul_tflops(8192)
    print(f"cuBLAS bf16 8192^3 (this run's yardstick): {tflops:.0f} TFLOPS")


def gemm_variants(T: int, d: int, n: int, E: int, K: int) -> None:
    import machmoe  # noqa: F401

    m = torch.ops.machmoe
    R = T * K
    offs, row_token = random_routing(T, E, K)
    x = torch.randn(T, d, device="cuda").bfloat16()
    xg = x[row_token.long()].contiguous()
    w1 = (torch.randn(E, 2 * n, d, device="cuda") * 0.02).bfloat16()
    flops = 2.0 * R * d * 2 * n
    ident = torch.arange(R, device="cuda", dtype=torch.int32)
    # "identity" runs the cp.async gather path over rows that follow each other in memory: if it
    # is as slow as "gathered", the cost is the cp.async path itself, not where the rows live.
    for name, a, idx in (("gathered", x, row_token), ("identity", xg, ident), ("pre-gathered", xg, None)):
        for epi in ("glu", "store"):
            t = cuda_time(lambda: m.grouped_gemm(a, idx, offs, w1, None, R, epi, "swiglu", "interleaved"), [()]).median_ms
            print(f"up-proj T={T} d={d} n={n} E={E} K={K}: A {name:12s} epilogue {epi:5s}: "
                  f"{t:.3f} ms = {flops / t / 1e9:.0f} TFLOPS")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m machmoe.bench.diagnose")
    p.add_argument("--skip-metadata", action="store_true")
    p.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K",
                   help="up-projection shapes to run (default: 7B-a and 30B-b)")
    args = p.parse_args(argv)
    if not args.skip_metadata:
        metadata_breakdown()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] or [
        (24576, 1536, 256, 128, 8),  # 7B-a
        (32768, 4096, 512, 128, 8),  # 30B-b
    ]
    dense_reference()
    for shape in shapes:
        gemm_variants(*shape)


if __name__ == "__main__":
    main()
