"""Kernel-level breakdown of one layer call on the GPU (torch.profiler / kineto).

    python -m machmoe.bench.profile --config 7B-a [--impl grouped_mm|machmoe|sonicmoe] [--T-scale 0.5]

Prints the CUDA kernels of a forward and of a forward+backward, sorted by device time, so that
the layer's time can be attributed (GEMMs vs. routing, gather, scatter, elementwise).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .configs import GIB, held_bound_less_x_bytes, layer_flops, select_configs
from .grouped_mm_layer import grouped_mm_moe
from .layer_bench import LayerInputs, machmoe_call
from .timing import held_bytes


def print_gaps(prof, iters: int) -> None:
    """Device activities in stream order, one call's sequence: mean duration and mean idle time
    before each (from the end of the previous activity). The first activity's gap is left out: it
    is the host's time between calls. Launch gaps are where the device waits for the host or for
    the launch of the next kernel."""
    acts = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    if not acts or len(acts) % iters:
        print(f"gaps: {len(acts)} device activities for {iters} calls, not a whole sequence per call")
        return
    per = len(acts) // iters
    rows = []
    for i in range(per):
        seq = [acts[c * per + i] for c in range(iters)]
        dur = sum(e.time_range.end - e.time_range.start for e in seq) / iters
        # idle time since the previous activity in stream order (none before the very first)
        gaps = [e.time_range.start - acts[c * per + i - 1].time_range.end
                for c, e in enumerate(seq) if c * per + i > 0]
        gap = sum(gaps) / max(1, len(gaps))
        rows.append((seq[0].name, dur, gap))
    print(f"{'#':>3} {'us':>9} {'gap us':>7}  activity (one call, in order; mean of {iters})")
    for i, (name, dur, gap) in enumerate(rows):
        print(f"{i:>3} {dur:>9.1f} {gap:>7.1f}  {name[:90]}")
    print(f"    sum of gaps inside a call: {sum(g for _, _, g in rows[1:]):.1f} us; "
          f"before the call: {rows[0][2]:.1f} us")


def sonicmoe_call(inputs: LayerInputs):
    """SonicMoE's layer on the same inputs, for a kernel-by-kernel comparison on one GPU.

    Uses `sonicmoe.functional.moe_TC_softmax_topk_layer` (Dao-AILab/sonic-moe; importable once
    scripts/sonicmoe_compare.sh has put .sonic/ on the path; never a dependency of machmoe). Our
    W1 [E, 2n, d] and W2 [E, d, n] go in as its [2n, d, E] and [d, n, E] views, SwiGLU, no biases.
    Its gate/up columns are interleaved where ours may not be: the values differ, the work does
    not. Called eagerly (its benchmark wraps it in torch.compile), so the gaps include its host
    time.
    """
    try:
        from sonicmoe.functional import moe_TC_softmax_topk_layer
    except ImportError as err:
        raise SystemExit(f"--impl sonicmoe: SonicMoE is not importable ({err}); "
                         "see scripts/sonicmoe_prepare.sh and scripts/sonicmoe_compare.sh")
    stream = torch.cuda.current_stream().cuda_stream
    K = inputs.cfg.K

    def call(x):
        out, _logits, _freq = moe_TC_softmax_topk_layer(
            x, inputs.router_weight, inputs.w1.permute(1, 2, 0), None, inputs.w2.permute(1, 2, 0), None,
            K, stream, "swiglu")
        return out, None

    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m machmoe.bench.profile")
    p.add_argument("--config", default="7B-a")
    p.add_argument("--impl", default="grouped_mm", choices=("grouped_mm", "machmoe", "sonicmoe"))
    p.add_argument("--T-scale", dest="t_scale", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=25, help="kernel rows to print")
    p.add_argument("--iters", type=int, default=1, help="calls profiled back to back (times are per call)")
    p.add_argument("--warmup-s", dest="warmup_s", type=float, default=0.0,
                   help="seconds of calls before profiling (1-2 s reaches the sustained power state)")
    p.add_argument("--memory", action="store_true",
                   help="also print the bytes the forward keeps for the backward (as the benchmark measures them)")
    p.add_argument("--gaps", action="store_true",
                   help="also print, per kernel in stream order, its time and the idle gap before it")
    p.add_argument("--plain-calls", dest="plain_calls", type=int, default=0,
                   help="only run N forward+backward calls and exit, without torch.profiler: the "
                        "driver for Nsight Compute (python -m machmoe.bench.ncu_compare)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    (cfg,) = select_configs(args.config, args.t_scale)
    inputs = LayerInputs(cfg, sets=1)
    if args.impl == "machmoe":
        call = machmoe_call(inputs)
    elif args.impl == "sonicmoe":
        call = sonicmoe_call(inputs)
    else:
        def call(x):
            return grouped_mm_moe(x, inputs.router_weight, inputs.w1, inputs.w2, cfg.K,
                                  impl="grouped_mm")
    x, dout = inputs.xs[0], inputs.douts[0]
    params = [x, *inputs.params]
    fwd_flop, bwd_flop = layer_flops(cfg.T, cfg.K, cfg.n, cfg.d)

    def fwd():
        out, _ = call(x)
        return out

    def fwd_bwd():
        out, _ = call(x)
        return torch.autograd.grad(out, params, dout)

    if args.plain_calls:
        for _ in range(args.plain_calls):
            fwd_bwd()
        torch.cuda.synchronize()
        return 0
    if args.memory:
        fwd_bwd()  # one-time allocations (library handles, workspaces) first, as in the benchmark
        held, res = held_bytes(fwd)
        del res
        print(f"== {cfg.name} {args.impl} memory: {held / GIB:.3f} GiB held between forward and backward "
              f"(output and x excluded); issue #5's bound {held_bound_less_x_bytes(cfg) / GIB:.3f} GiB")
    for name, fn, flop in (("forward", fwd, fwd_flop), ("forward+backward", fwd_bwd, fwd_flop + bwd_flop)):
        # Warm-up: handles and autotuning, then (--warmup-s) the sustained clock and power state
        # that the benchmark's timed loop runs in (the GPU sits at its power cap there).
        t0 = time.perf_counter()
        calls = 0
        while calls < 3 or time.perf_counter() - t0 < args.warmup_s:
            fn()
            calls += 1
            if calls % 8 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            torch.cuda.synchronize()
        wall_us = start.elapsed_time(end) * 1e3 / args.iters
        events = prof.key_averages()
        total_us = sum(e.self_device_time_total for e in events) / args.iters
        print(f"\n== {cfg.name} T={cfg.T} {args.impl} {name}, per call over {args.iters}: kernels "
              f"{total_us / 1e3:.3f} ms -> {flop / (total_us * 1e-6) / 1e12:.0f} TFLOPS if launch gaps were zero; "
              f"wall {wall_us / 1e3:.3f} ms -> {flop / (wall_us * 1e-6) / 1e12:.0f} TFLOPS; "
              f"gaps {100 * (1 - total_us / wall_us):.1f}% of the wall time")
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
        if args.gaps:
            print_gaps(prof, args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
