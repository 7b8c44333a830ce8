"""Kernel probes for Nsight Compute on the GPU machine (not part of the main job).

  ncu --clock-control none -k regex:sm90_grouped -s 2 -c 1 --section SourceCounters \\
      --section WarpStateStats -o rep python -m machmoe.bench.ncu_probe dh
  ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
  python -m machmoe.bench.ncu_probe --top src.csv

The first form runs one expert GEMM of 7B-a (or `--config NAME`; SwiGLU, interleaved) three times: `up` (gathered
up-projection), `upc` (the same on pre-gathered rows, A by TMA), `down` (down-projection), `dh`,
`dx` (dX~), `dw1` (x gathered), `dw1c` (the same on pre-gathered rows: A still by cp.async, no
index), `dense` (8192³ through the same engine). The second prints the SASS instructions
where the warps were sampled most, with their share: the place to look first.
`scripts/gpu_profile.sh` runs both forms, with the speed-of-light and memory tables, for a list of
kernels in one device call.
"""

from __future__ import annotations

import argparse
import csv


KERNELS = ("up", "upc", "down", "dh", "dx", "dw1", "dw1c", "dw2", "dense")


def run_kernel(which: str, T: int = 24576, d: int = 1536, n: int = 256, E: int = 128, K: int = 8) -> None:
    import torch

    import machmoe  # noqa: F401  (loads the ops)

    from .gemm_kernels import random_routing

    m = torch.ops.machmoe
    R = T * K
    offs, row_token = random_routing(T, E, K)
    w1 = (torch.randn(E, 2 * n, d, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, d, n, device="cuda") * 0.02).bfloat16()
    x = torch.randn(T, d, device="cuda").bfloat16()
    if which == "up":
        fn = lambda: m.grouped_gemm(x, row_token, offs, w1, None, R, "glu", "swiglu", "interleaved")  # noqa: E731
    elif which == "upc":  # the same GEMM on pre-gathered rows (A by TMA): the engine's own ceiling
        xg = x[row_token.long()].contiguous()
        fn = lambda: m.grouped_gemm(xg, None, offs, w1, None, R, "glu", "swiglu", "interleaved")  # noqa: E731
    elif which == "down":
        a = torch.randn(R, n, device="cuda").bfloat16()
        fn = lambda: m.grouped_gemm(a, None, offs, w2, None, R, "store", "swiglu", "interleaved")  # noqa: E731
    elif which == "dh":
        h = torch.randn(R, 2 * n, device="cuda").bfloat16()
        scores, pair = torch.rand(R, device="cuda"), torch.randperm(R, device="cuda").int()
        fn = lambda: m.grouped_gemm_nmajor(x, row_token, offs, w2, R, h, scores, pair, "swiglu", "interleaved")  # noqa: E731
    elif which == "dx":
        dh = torch.randn(R, 2 * n, device="cuda").bfloat16()
        fn = lambda: m.grouped_gemm_nmajor(dh, None, offs, w1, R, None, None, None, "swiglu", "interleaved")  # noqa: E731
    elif which in ("dw1", "dw1c"):
        dh = torch.randn(R, 2 * n, device="cuda").bfloat16()
        xg = x[row_token.long()].contiguous() if which == "dw1c" else x
        idx = None if which == "dw1c" else row_token
        fn = lambda: m.grouped_gemm_wgrad(xg, idx, dh, offs, True, False)  # noqa: E731
    elif which == "dw2":  # dW2 = doutᵀ·A': dout gathered by token (x stands in for it), A' [R, n]
        ap = torch.randn(R, n, device="cuda").bfloat16()
        fn = lambda: m.grouped_gemm_wgrad(x, row_token, ap, offs, False, False)  # noqa: E731
    elif which == "dense":  # 8192³ through the same engine (one expert): the mainloop's ceiling
        a = torch.randn(8192, 8192, device="cuda").bfloat16()
        w = (torch.randn(1, 8192, 8192, device="cuda") / 8192 ** 0.5).bfloat16()
        off = torch.tensor([0, 8192], dtype=torch.int32, device="cuda")
        fn = lambda: m.grouped_gemm(a, None, off, w, None, 8192, "store", "swiglu", "interleaved")  # noqa: E731
    else:
        raise SystemExit(f"unknown kernel {which!r}: {', '.join(KERNELS)}")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()


def top_instructions(path: str, count: int = 40) -> None:
    rows = list(csv.reader(open(path, errors="replace")))
    head = next(i for i, r in enumerate(rows) if "Source" in r)
    names = rows[head]
    data = [r for r in rows[head + 1:] if len(r) == len(names)]
    col = next(i for i, c in enumerate(names) if c.startswith("Warp Stall Sampling (All"))
    src = names.index("Source")

    def num(v: str) -> float:
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[col]) for r in data) or 1.0
    for r in sorted(data, key=lambda r: -num(r[col]))[:count]:
        print(f"{num(r[col]) / total * 100:5.1f}%  {r[0]:>8}  {r[src][:110]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m machmoe.bench.ncu_probe")
    p.add_argument("kernel", nargs="?", help=", ".join(KERNELS))
    p.add_argument("--top", metavar="CSV", help="summarise an ncu source-page CSV instead")
    p.add_argument("--config", default="7B-a", help="the SPEC config whose shapes the kernel runs (default 7B-a)")
    args = p.parse_args(argv)
    if args.top:
        top_instructions(args.top)
    elif args.kernel:
        from .configs import select_configs

        (c,) = select_configs(args.config)
        run_kernel(args.kernel, c.T, c.d, c.n, c.E, c.K)
    else:
        p.error("name a kernel or give --top CSV")


if __name__ == "__main__":
    main()
