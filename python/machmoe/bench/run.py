"""`python -m machmoe.bench`: the MoE layer benchmark.

On a CUDA GPU, for each config (--list shows them): the layer on machmoe's kernels beside two
references measured in the same run, the torch._grouped_mm layer (the layer as plain PyTorch
writes it) and the dense cuBLAS bound (the same FLOPs as balanced batched GEMMs), forward and
backward TFLOPS and the activation memory held between forward and backward; then the
kernel-level tables (routing kernels, grouped GEMMs vs cuBLAS). With --out DIR it writes
bench.md (the table), bench.json (every figure) and bench.png (a chart, when matplotlib is
installed) there.

Without a CUDA GPU it says so and runs a small CPU demo of the layer instead (forward and
backward against the float64 reference); with --out DIR the demo writes cpu_demo.md and
cpu_demo.json there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .configs import CONFIGS, GIB, MoEConfig, activation_bytes_formula, held_bound_less_x_bytes, layer_flops, \
    select_configs

NO_GPU_LINE = "No CUDA GPU found: running a small CPU demo of the layer instead"
IMPLEMENTATIONS = ("grouped_mm", "dense", "machmoe")
# machmoe.bench.timing.PROTOCOLS, repeated here so that --help answers without importing torch.
TIMING_PROTOCOLS = ("rotate", "flush", "sonic")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; a bad argument exits with status 2 and argparse's message."""
    p = argparse.ArgumentParser(prog="python -m machmoe.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="all",
                   help="comma-separated config names, case-insensitive (default: all; see --list): "
                        + ", ".join(c.name for c in CONFIGS))
    p.add_argument("--T-scale", dest="t_scale", type=float, default=1.0,
                   help="multiply every config's T by this (rounded to a multiple of 64)")
    p.add_argument("--list", action="store_true", help="list the configs and exit")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for bench.md, bench.json and bench.png (the CPU demo: "
                        "cpu_demo.md, cpu_demo.json); created if missing")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                   help="which of grouped_mm,dense,machmoe to run (default: all)")
    p.add_argument("--min-reps", type=int, default=20, help="least number of timed calls (>= 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    p.add_argument("--cpu-demo", action="store_true", help="run the CPU demo even with a GPU")
    p.add_argument("--timing", choices=TIMING_PROTOCOLS, default=None,
                   help="rotate: calls back to back (default; or MACHMOE_BENCH_TIMING); flush: 256 MB "
                        "zeroed before each timed call, as triton's do_bench does; sonic: the flush and "
                        "0.5 s idle before each measurement, as SonicMoE's published benchmark times, "
                        "to compare with the table's SonicMoE (paper) column")
    p.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                   help="the kernel-level tables (routing kernels, grouped GEMMs vs cuBLAS); auto: "
                        "when the op library is loaded")
    args = p.parse_args(argv)
    if args.t_scale <= 0:
        p.error("--T-scale must be positive")
    try:
        args.config_list = select_configs(args.configs, args.t_scale)
    except ValueError as err:
        p.error(f"--configs: {err}")
    if not args.config_list:
        p.error("--configs names no config; known: " + ", ".join(c.name for c in CONFIGS))
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [s for s in args.impls if s not in IMPLEMENTATIONS]
    if bad:
        p.error(f"unknown --impls {bad}; choose from {IMPLEMENTATIONS}")
    args.min_reps = max(20, args.min_reps)
    return args


def list_configs() -> None:
    print(f"{'name':<12}{'T':>7}{'d':>6}{'n':>6}{'E':>5}{'K':>4}  SonicMoE fwd/bwd  "
          f"fwd GFLOP  formula GiB")
    for c in CONFIGS:
        fwd, _ = layer_flops(c.T, c.K, c.n, c.d)
        gib = activation_bytes_formula(c.T, c.d, c.K, c.n) / GIB
        print(f"{c.name:<12}{c.T:>7}{c.d:>6}{c.n:>6}{c.E:>5}{c.K:>4}  "
              f"{c.sonic_fwd:>7.0f} / {c.sonic_bwd:<7.0f} {fwd / 1e9:>10.0f}  {gib:>11.3f}")


def _failure(err: BaseException) -> dict:
    """The result dict of a failed measurement: {"status": "OOM"} or {"status": "error: ..."}."""
    from .layer_bench import OOM, is_oom

    if is_oom(err):
        return {"status": OOM}
    text = str(err).strip()
    first_line = text.splitlines()[0][:300] if text else ""
    return {"status": f"error: {type(err).__name__}: {first_line}"}


def bench_config(cfg: MoEConfig, impls: list[str], min_reps: int, seed: int) -> dict:
    """One config's row: each implementation's figures (or status), the formulas and ratios."""
    from .dense_bound import dense_bound
    from .grouped_mm_layer import grouped_mm_moe
    from .layer_bench import LayerInputs, bench_layer
    from .report import derived_ratios
    from .timing import free_cuda_memory

    fwd_flop, bwd_flop = layer_flops(cfg.T, cfg.K, cfg.n, cfg.d)
    row = {
        "config": {"name": cfg.name, "T": cfg.T, "d": cfg.d, "n": cfg.n, "E": cfg.E, "K": cfg.K},
        "flop": {"fwd": fwd_flop, "bwd": bwd_flop},
        "sonicmoe": {"fwd_tflops": cfg.sonic_fwd, "bwd_tflops": cfg.sonic_bwd},
        "formula_bytes": activation_bytes_formula(cfg.T, cfg.d, cfg.K, cfg.n),
    }
    row["formula_gib"] = row["formula_bytes"] / GIB
    # The memory bound (configs.held_bound_bytes) less x: neither layer's held-bytes measurement
    # counts the caller's x.
    row["bound_gib"] = held_bound_less_x_bytes(cfg) / GIB

    # Dense bound first, before the layer's weights exist: on DeepSeek-V3 the two sets of weights
    # and weight gradients would not fit on an 80 GB GPU together.
    if "dense" in impls:
        try:
            row["dense"] = {"status": "ok", **dense_bound(cfg, min_reps=min_reps, seed=seed)}
        except Exception as err:  # noqa: BLE001 - reported per config, the run goes on
            row["dense"] = _failure(err)
        free_cuda_memory()

    if "grouped_mm" in impls or "machmoe" in impls:
        inputs = None
        try:
            inputs = LayerInputs(cfg, sets=3, seed=seed)
        except Exception as err:  # noqa: BLE001
            fail = _failure(err)
            for k in ("grouped_mm", "machmoe"):
                if k in impls:
                    row[k] = dict(fail)
        if inputs is not None:
            def baseline(x, _inp=inputs):
                return grouped_mm_moe(x, _inp.router_weight, _inp.w1, _inp.w2, cfg.K,
                                      impl="grouped_mm")

            if "grouped_mm" in impls:
                try:
                    row["grouped_mm"] = bench_layer(baseline, inputs, min_reps=min_reps)
                except Exception as err:  # noqa: BLE001
                    row["grouped_mm"] = _failure(err)
                free_cuda_memory()
            if "machmoe" in impls:
                row["machmoe"] = _bench_machmoe(inputs, baseline, min_reps)
                free_cuda_memory()
        del inputs
        free_cuda_memory()
    row["ratios"] = derived_ratios(row)
    return row


def _bench_machmoe(inputs, baseline, min_reps: int) -> dict:
    """The machmoe row of one config (inputs: a layer_bench.LayerInputs)."""
    from .layer_bench import (NOT_BUILT, bench_forward_only, bench_layer, compare_forward, compare_outputs,
                              is_oom, probe_machmoe)
    from .timing import free_cuda_memory

    try:
        call, status = probe_machmoe(inputs)
    except Exception as err:  # noqa: BLE001
        return _failure(err)
    if call is None:
        return {"status": status}
    # Forward + backward through autograd, as for grouped_mm. If the backward is refused
    # (NotImplementedError: not built) or fails, the forward is still timed on its own and the
    # row says why the backward is missing ("backward": "not built" or the error).
    forward_only, why = False, None
    try:
        res = bench_layer(call, inputs, min_reps=min_reps)
    except NotImplementedError as err:
        forward_only, why = True, f"{NOT_BUILT} ({str(err).strip()[:200]})"
    except Exception as err:  # noqa: BLE001
        if is_oom(err):
            return _failure(err)
        forward_only, why = True, _failure(err)["status"]
    if forward_only:
        free_cuda_memory()
        try:
            res = bench_forward_only(call, inputs, min_reps=min_reps)
        except Exception as err:  # noqa: BLE001
            return _failure(err)
        res["backward"] = why
    free_cuda_memory()
    try:
        res.update((compare_forward if forward_only else compare_outputs)(call, baseline, inputs))
    except Exception as err:  # noqa: BLE001
        res["compare_error"] = _failure(err)["status"]
    return res


def _kernel_rows(mode: str, copy_gbps: float | None):
    """Rows of routing_kernels.run() (list), or a string saying why there are none."""
    from .layer_bench import NOT_BUILT
    from .timing import free_cuda_memory

    if mode == "off":
        return "not run (--kernels off)"
    try:
        from machmoe import _ops

        loaded = _ops.ops_available()
    except Exception as err:  # noqa: BLE001
        loaded, why = False, f"{type(err).__name__}: {err}"
    else:
        why = "op library not loaded"
    if not loaded:
        return f"not run ({why})" if mode == "auto" else f"error: {why}"
    try:
        from . import routing_kernels

        rows = routing_kernels.run((copy_gbps or 0.0) / 1e3)  # TB/s
    except Exception as err:  # noqa: BLE001
        if "no such operator" in str(err).lower():  # an op not built yet: not an error
            return f"{NOT_BUILT} ({str(err).strip().splitlines()[0]})"
        return _failure(err)["status"]
    finally:
        free_cuda_memory()
    print("kernel-level: " + "; ".join(
        f"{r['kernel']}: {r['speedup']:.2f}x" if "speedup" in r else
        f"{r['kernel']}: {r['padding_rows_topk']} -> {r['padding_rows_rounded']} padding rows"
        if "padding_rows_topk" in r else
        f"{r['kernel']}: {r.get('fraction_of_copy', float('nan')):.2f} of copy" for r in rows), flush=True)
    return rows


def _gemm_rows(mode: str):
    """Rows of gemm_kernels.run() (grouped GEMM engine vs cuBLAS), or a string saying why not."""
    from .timing import free_cuda_memory

    if mode == "off":
        return "not run (--kernels off)"
    from machmoe import _ops

    if not _ops.ops_available():
        return "not run (op library not loaded)"
    try:
        from . import gemm_kernels

        return gemm_kernels.run()
    except Exception as err:  # noqa: BLE001
        return _failure(err)["status"]
    finally:
        free_cuda_memory()


def _fmt_impl(name: str, res: dict | None) -> str:
    """One implementation's progress-line fragment: "machmoe 370/410, held 0.40 GiB"."""
    from .report import backward_status

    if res is None:
        return ""
    if res.get("status") != "ok":
        return f"{name} {res['status'].split(' (')[0]}"
    mem = f", held {res['held_gib']:.2f} GiB" if "held_gib" in res else ""
    bwd = f"{res['bwd_tflops']:.0f}" if "bwd_tflops" in res else backward_status(res)
    return f"{name} {res['fwd_tflops']:.0f}/{bwd}{mem}"


def main(argv=None) -> int:
    """Runs the benchmark (or the CPU demo); 0 on success, 1 when a measurement failed with an
    error (out of memory and "not built" are reported, not failures)."""
    args = parse_args(argv)
    if args.list:
        list_configs()
        return 0

    import torch

    if not torch.cuda.is_available() or args.cpu_demo:
        from . import cpu_demo

        if not torch.cuda.is_available():
            print(NO_GPU_LINE, flush=True)
        rc = cpu_demo.run(seed=args.seed, out_dir=args.out)
        if not torch.cuda.is_available() and os.environ.get("MACHMOE_REQUIRE_GPU") == "1":
            print("error: MACHMOE_REQUIRE_GPU=1 but no CUDA GPU is visible", file=sys.stderr)
            return 1
        return rc

    from . import timing
    from .report import markdown, run_header, write_outputs
    from .timing import copy_bandwidth, free_cuda_memory, matmul_tflops

    if args.timing:
        timing.set_protocol(args.timing)
    header = run_header()
    print(f"GPU: {header['gpu']}\ncommit: {header['commit']}\ndate: {header['date_utc']}\n"
          f"torch: {header['torch']} (CUDA {header['cuda']})\ntiming: {header['timing']}", flush=True)
    try:
        from machmoe import _ops

        why = _ops.kernels_unavailable_reason()
        print(f"machmoe ops: {'loaded from ' + str(_ops.library_path()) if _ops.ops_available() else 'not loaded'}; "
              f"layer kernels: {'yes' if why is None else 'no (' + why + ')'}", flush=True)
    except Exception as err:  # noqa: BLE001 - informational only
        print(f"machmoe ops: unavailable ({type(err).__name__}: {err})", flush=True)

    t_start = time.perf_counter()
    ceilings = {}
    try:
        ceilings["matmul_tflops"], t_mm = matmul_tflops(8192, min_reps=args.min_reps)
        ceilings["matmul_timing"] = t_mm.as_dict()
        ceilings["copy_gbps"], t_copy = copy_bandwidth(1 << 30, min_reps=args.min_reps)
        ceilings["copy_timing"] = t_copy.as_dict()
    except Exception as err:  # noqa: BLE001
        ceilings["error"] = _failure(err)["status"]
    free_cuda_memory()
    print(f"dense bf16 8192x8192x8192 matmul: {ceilings.get('matmul_tflops', float('nan')):.0f} TFLOPS;"
          f" device-to-device copy: {ceilings.get('copy_gbps', float('nan')):.0f} GB/s "
          f"(bytes read + written)", flush=True)

    kernel_rows = _kernel_rows(args.kernels, ceilings.get("copy_gbps"))
    gemm_rows = _gemm_rows(args.kernels)

    rows = []
    for cfg in args.config_list:
        t0 = time.perf_counter()
        row = bench_config(cfg, args.impls, args.min_reps, args.seed)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        parts = [_fmt_impl(k, row.get(k)) for k in IMPLEMENTATIONS]
        print(f"[{cfg.name} T={cfg.T}] " + "; ".join(p for p in parts if p)
              + f"  ({row['wall_s']:.1f} s)", flush=True)

    print(f"\ntotal benchmark time {time.perf_counter() - t_start:.0f} s\n")
    table = markdown(header, ceilings, rows)
    if isinstance(kernel_rows, list) and kernel_rows:
        from .routing_kernels import format_rows

        table += "\nKernel-level (routing and aggregation kernels vs. PyTorch):\n\n" + format_rows(kernel_rows) + "\n"
    elif isinstance(kernel_rows, str):
        table += f"\nKernel-level rows: {kernel_rows}\n"
    if isinstance(gemm_rows, list) and gemm_rows:
        from .gemm_kernels import format_rows as format_gemm_rows

        table += "\nKernel-level (grouped GEMM engine vs. cuBLAS):\n\n" + format_gemm_rows(gemm_rows) + "\n"
    else:
        table += f"\nGrouped GEMM rows: {gemm_rows}\n"
    print(table, flush=True)
    if args.out:
        run_args = {"configs": args.configs, "t_scale": args.t_scale, "impls": args.impls, "timing": timing.protocol(),
                    "min_reps": args.min_reps, "seed": args.seed}
        extra = {"kernels": kernel_rows, "gemm_kernels": gemm_rows}
        for path in write_outputs(args.out, header, ceilings, rows, run_args, extra=extra,
                                  markdown_text=table):
            print(f"wrote {path}")
    # Exit non-zero only for real errors (not for OOM or "not built"), so scripts notice them.
    errors = [r for r in rows for k in IMPLEMENTATIONS
              if r.get(k) and r[k]["status"].startswith("error")]
    kernel_error = isinstance(kernel_rows, str) and kernel_rows.startswith("error")
    return 1 if errors or kernel_error or "error" in ceilings else 0
