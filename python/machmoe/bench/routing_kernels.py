"""Kernel-level benchmark of the routing and data-movement kernels, each
beside its PyTorch counterpart measured in the same run:

* top-K router (machmoe.topk_router) vs torch.topk + softmax over the K, at T=32768 with
  (E=128, K=8) and (E=256, K=16);
* routing metadata (machmoe.routing_metadata) vs the stable-argsort metadata of the
  torch._grouped_mm reference layer (sort, searchsorted offsets, row -> token), T=32768, E=128, K=8;
* aggregation (machmoe.aggregate, bf16 rows -> bf16 out, with scores) at T=32768, d=4096, K=8,
  as a fraction of the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import torch

from . import grouped_mm_layer as gml
from .timing import cuda_time


def _ops():
    from machmoe import _ops

    _ops.require_ops()
    return torch.ops.machmoe


def graph_time(fn, arg_sets) -> float:
    """Median ms of replaying fn(*args) captured in a CUDA graph per argument set: GPU time
    without the host's launch overhead (the eager figures include it)."""
    graphs = []
    for args in arg_sets:
        fn(*args)  # warm-up outside capture (allocator, lazy init)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append(g)
    return cuda_time(lambda g: g.replay(), [(g,) for g in graphs]).median_ms


def _row(name, ours_ms, ref_ms, target, extra=""):
    ratio = ref_ms / ours_ms
    return {"kernel": name, "machmoe_us": ours_ms * 1e3, "torch_us": ref_ms * 1e3,
            "speedup": ratio, "target": target, "note": extra}


def bench_router(T: int, E: int, K: int, sets: int = 4) -> dict:
    ops = _ops()
    logits = [torch.randn(T, E, device="cuda") for _ in range(sets)]

    def ours(l):
        return ops.topk_router(l, K, "softmax_topk", True, None)

    def ref(l):
        v, i = torch.topk(l, K, dim=1)
        return torch.softmax(v, dim=1), i

    t_ours = cuda_time(ours, [(l,) for l in logits]).median_ms
    t_ref = cuda_time(ref, [(l,) for l in logits]).median_ms
    return _row(f"top-K router T={T} E={E} K={K}", t_ours, t_ref, ">= 3x")


def bench_metadata(T: int, E: int, K: int, sets: int = 4) -> dict:
    ops = _ops()
    experts = [torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K].int().contiguous()
               for _ in range(sets)]

    def ours(e):
        return ops.routing_metadata(e, None, T, E)

    def ref(e):  # exactly the grouped_mm reference layer's metadata
        flat = e.long().reshape(-1)
        sorted_experts, order = torch.sort(flat, stable=True)
        return order // K, gml.expert_offsets(sorted_experts, E), order

    t_ours = cuda_time(ours, [(e,) for e in experts]).median_ms
    t_ref = cuda_time(ref, [(e,) for e in experts]).median_ms
    g_ours = graph_time(ours, [(e,) for e in experts])
    g_ref = graph_time(ref, [(e,) for e in experts])
    return [_row(f"routing metadata T={T} E={E} K={K} (eager)", t_ours, t_ref, ">= 5x"),
            _row(f"routing metadata T={T} E={E} K={K} (CUDA graph)", g_ours, g_ref, ">= 5x")]


def bench_aggregate(T: int, d: int, K: int, copy_tbps: float, sets: int = 3) -> dict:
    ops = _ops()
    args = []
    for _ in range(sets):
        experts = torch.argsort(torch.rand(T, 128, device="cuda"), dim=1)[:, :K].int().contiguous()
        _, _, _, pair_row, tok_offs, _ = ops.routing_metadata(experts, None, T, 128)
        rows = torch.randn(T * K, d, device="cuda", dtype=torch.bfloat16)
        scores = torch.rand(T * K, device="cuda")
        args.append((rows, pair_row, tok_offs, scores))

    def ours(rows, pair_row, tok_offs, scores):
        return ops.aggregate(rows, pair_row, tok_offs, scores, torch.bfloat16)

    t = cuda_time(ours, args).median_ms
    bytes_moved = T * K * d * 2 + T * d * 2 + T * K * 8 + (T + 1) * 4
    tbps = bytes_moved / (t * 1e-3) / 1e12
    frac = tbps / copy_tbps if copy_tbps else float("nan")
    return {"kernel": f"aggregation T={T} d={d} K={K} bf16", "machmoe_us": t * 1e3,
            "achieved_TBps": tbps, "copy_TBps": copy_tbps, "fraction_of_copy": frac,
            "target": ">= 0.85 of copy"}


def bench_token_rounding(T: int = 16384, E: int = 128, K: int = 2, M: int = 128) -> dict:
    """Token rounding (nr) on a sparse config (T 16384, E 128, K 2, tile 128) with router
    logits of random data: its time, and the padding rows a tile-M grouped GEMM would process
    for the plain top-K counts vs. the rounded counts."""
    ops = _ops()
    logits = [torch.randn(T, E, device="cuda") for _ in range(3)]

    def ours(lg):
        return ops.token_rounding(lg, K, "nr", M, 0)

    t = cuda_time(ours, [(lg,) for lg in logits]).median_ms
    res = ours(logits[0])
    f = torch.diff(res[7].long())
    r = res[8].long()
    pad = lambda c: int(((c + M - 1) // M * M - c).sum())  # noqa: E731
    before, after = pad(f), pad(r)
    return {"kernel": f"token rounding nr T={T} E={E} K={K} M={M}", "machmoe_us": t * 1e3,
            "padding_rows_topk": before, "padding_rows_rounded": after, "rows_topk": T * K,
            "rows_rounded": int(r.sum()), "target": "report padding removed"}


def run(copy_tbps: float) -> list[dict]:
    """All kernel rows; copy_tbps is the device-to-device copy bandwidth of this run (TB/s)."""
    rows = [bench_router(32768, 128, 8), bench_router(32768, 256, 16), *bench_metadata(32768, 128, 8),
            bench_aggregate(32768, 4096, 8, copy_tbps), bench_token_rounding()]
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| kernel | machmoe (µs) | torch (µs) | speedup / fraction | target |", "|---|---|---|---|---|"]
    for r in rows:
        if "padding_rows_topk" in r:
            lines.append(f"| {r['kernel']} | {r['machmoe_us']:.1f} | — | padding rows {r['padding_rows_topk']} of "
                         f"{r['rows_topk']} (top-K) -> {r['padding_rows_rounded']} of {r['rows_rounded']} "
                         f"(rounded) | {r['target']} |")
        elif "speedup" in r:
            lines.append(f"| {r['kernel']} | {r['machmoe_us']:.1f} | {r['torch_us']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['target']} |")
        else:
            lines.append(f"| {r['kernel']} | {r['machmoe_us']:.1f} | — | {r['achieved_TBps']:.2f} TB/s = "
                         f"{r['fraction_of_copy']:.2f} of copy ({r['copy_TBps']:.2f} TB/s) | {r['target']} |")
    return "\n".join(lines)
