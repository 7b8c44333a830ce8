"""Nsight Compute figures of SonicMoE's expert GEMMs beside ours, one forward + backward each.

`scripts/sonicmoe_compare.sh` with `SONIC_NCU=7B-a` runs, for each implementation,

    ncu --clock-control none -k regex:'HopperWgmma|sm90_grouped' -s 6 -c 6 ... \\
        python -m machmoe.bench.profile --config 7B-a --impl IMPL --plain-calls 2

(the six expert GEMMs of the second forward + backward call: up-projection, down-projection,
dH, dW2, dW1, dX~, in launch order, which is the same in both layers) and exports each report
with `ncu --page raw --csv`. This module reads the two CSV files and prints one table: per
kernel and implementation its time, TFLOPS, SM clock, DRAM bytes, L2 hit rate, tensor-pipe
activity, L2 -> SM bytes, launch shape and the largest warp-stall reasons. The question it
answers is *why* a kernel of one layer is faster than the same GEMM of the other on one board.

Usage: python -m machmoe.bench.ncu_compare CONFIG sonic.csv machmoe.csv
       python -m machmoe.bench.ncu_compare --launches LABEL=report.csv ...
The second form prints every profiled launch of each CSV, one row each (scripts/gpu_ab.sh's AB_NCU:
one kernel-table row per variant under Nsight Compute).
"""

from __future__ import annotations

import csv
import io
import re
import sys

from .configs import CONFIGS_BY_NAME

# Launch order of the expert GEMMs in one forward + backward (both layers), with the FLOPs of
# each as multiples of 2·T·K·n·d (the GLU's up-projection and W1-side GEMMs have 2n columns).
KERNELS = (("up-proj", 2), ("down-proj", 1), ("dH", 1), ("dW2", 1), ("dW1", 2), ("dX~", 2))

# Units as `ncu --page raw --csv` writes them (lowercased), to base units (bytes, seconds, hertz,
# per cent, counts); ncu's K/M/G are decimal. A number under any other unit is kept as text, so
# that it prints as "—" rather than at a wrong scale.
_SCALE = {"": 1.0, "%": 1.0, "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "byte/block": 1.0, "kbyte/block": 1e3, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0,
          "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
          "hz": 1.0, "khz": 1e3, "mhz": 1e6, "ghz": 1e9, "cycle": 1.0, "inst": 1.0, "ratio": 1.0,
          "warp": 1.0, "sm": 1.0, "block": 1.0, "thread": 1.0, "cluster": 1.0, "pass": 1.0,
          "register/thread": 1.0}
_STALL = re.compile(r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")


def read_raw_csv(text: str) -> list[dict[str, float | str]]:
    """Rows of `ncu --page raw --csv`: one dict per kernel, metric -> value in base units
    (bytes, seconds, hertz, per cent), "Kernel Name" -> the name. The first row after the
    header holds the units; text before the header (the profiled program's output) is skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a \"Kernel Name\" column) in the file")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, body = rows[0], rows[1], rows[2:]
    out = []
    for row in body:
        if len(row) != len(header):
            continue
        rec: dict[str, float | str] = {}
        for name, unit, value in zip(header, units, row):
            v = value.replace(",", "").strip()
            try:
                num = float(v)
            except ValueError:
                rec[name] = value
                continue
            scale = _SCALE.get(unit.strip().lower())
            rec[name] = value if scale is None else num * scale
        out.append(rec)
    return out


def stalls(rec: dict, top: int = 3) -> str:
    """The `top` largest warp-stall reasons (cycles per issued instruction), e.g. 'long_scoreboard 3.1'."""
    found = []
    for name, v in rec.items():
        m = _STALL.match(name)
        if m and isinstance(v, float) and v > 0:
            found.append((v, m.group(1)))
    found.sort(reverse=True)
    return ", ".join(f"{reason} {v:.1f}" for v, reason in found[:top])


def _get(rec: dict, name: str) -> float | None:
    v = rec.get(name)
    return v if isinstance(v, float) else None


def _fmt(v, fmt, scale=1.0) -> str:
    return "—" if v is None else format(v * scale, fmt)


def _common(r: dict) -> dict:
    """The figures both tables print: time, SM clock, elapsed cycles (the comparison that does not
    depend on the clock each kernel ran at), tensor pipe, L2 -> SM bytes, launch shape."""
    grid, block = _get(r, "launch__grid_size"), _get(r, "launch__block_size")
    regs, smem = _get(r, "launch__registers_per_thread"), _get(r, "launch__shared_mem_per_block_dynamic")
    cluster = _get(r, "launch__cluster_dim_x")
    return {
        "t": _get(r, "gpu__time_duration.sum"),
        "clk": _get(r, "sm__cycles_elapsed.avg.per_second") or _get(r, "gpc__cycles_elapsed.avg.per_second"),
        "cyc": _get(r, "sm__cycles_elapsed.max") or _get(r, "gpc__cycles_elapsed.max"),
        "tp": _get(r, "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
        "x2l": _get(r, "l1tex__m_xbar2l1tex_read_bytes.sum"),
        "shape": (f"{_fmt(grid, '.0f')} x {_fmt(block, '.0f')}, {_fmt(regs, '.0f')}, {_fmt(smem, '.0f', 1 / 1024)}"
                  + (f", cluster {cluster:.0f}" if cluster and cluster > 1 else "")),
    }


def table(config: str, impls: dict[str, list[dict]]) -> str:
    cfg = CONFIGS_BY_NAME[config]
    unit = 2.0 * cfg.T * cfg.K * cfg.n * cfg.d
    lines = [f"Nsight Compute, {config} (T={cfg.T}, d={cfg.d}, n={cfg.n}, E={cfg.E}, K={cfg.K}), "
             "one launch of each expert GEMM (second forward + backward call), --clock-control none.",
             "",
             "| kernel | layer | µs | TFLOPS | SM GHz | M cycles | M warp inst | DRAM read / write MB | L2 hit | tensor pipe | "
             "L2→SM GB | grid x block, regs, smem KiB, cluster | top stalls (cycles per issue) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    for i, (label, mult) in enumerate(KERNELS):
        for impl, recs in impls.items():
            if i >= len(recs):
                lines.append(f"| {label} | {impl} | (not profiled) | | | | | | | | | | |")
                continue
            r = recs[i]
            c, f = _common(r), _fmt
            inst = _get(r, "smsp__inst_executed.sum")  # warp instructions issued, all SMs
            rd, wr = _get(r, "dram__bytes_read.sum"), _get(r, "dram__bytes_write.sum")
            hit = _get(r, "lts__t_sector_hit_rate.pct")
            t = c["t"]
            lines.append(
                f"| {label} | {impl} | {f(t, '.1f', 1e6)} | {f(None if not t else mult * unit / t, '.0f', 1e-12)} | "
                f"{f(c['clk'], '.2f', 1e-9)} | {f(c['cyc'], '.3f', 1e-6)} | {f(inst, '.1f', 1e-6)} | "
                f"{f(rd, '.0f', 1e-6)} / {f(wr, '.0f', 1e-6)} | {f(hit, '.1f')}% | "
                f"{f(c['tp'], '.1f')}% | {f(c['x2l'], '.2f', 1e-9)} | {c['shape']} | {stalls(r)} |")
    names = {impl: [str(r.get("Kernel Name", ""))[:60] for r in recs] for impl, recs in impls.items()}
    lines.append("")
    lines.append("Kernels by launch order (the labels above assume the order of both layers' backward: "
                 "dH, dW2, dW1, dX~):")
    for impl, ns in names.items():
        lines.append(f"- {impl}: " + "; ".join(ns))
    return "\n".join(lines)


def launches(files: list[tuple[str, list[dict]]]) -> str:
    """One row per profiled launch: label, kernel, µs, SM GHz, M cycles, tensor pipe, L2->SM GB,
    DRAM GB read / written (— where not profiled), launch shape, top stalls."""
    lines = ["| variant | kernel | µs | SM GHz | M cycles | tensor pipe | L2→SM GB | DRAM GB rd / wr | "
             "grid x block, regs, smem KiB, cluster | top stalls (cycles per issue) |",
             "|---|---|--:|--:|--:|--:|--:|--:|---|---|"]
    for label, recs in files:
        if not recs:
            lines.append(f"| {label} | (nothing profiled) | | | | | | | | |")
        for r in recs:
            c, f = _common(r), _fmt
            lines.append(f"| {label} | {str(r.get('Kernel Name', ''))[:48]} | {f(c['t'], '.1f', 1e6)} | "
                         f"{f(c['clk'], '.2f', 1e-9)} | {f(c['cyc'], '.3f', 1e-6)} | {f(c['tp'], '.1f')}% | "
                         f"{f(c['x2l'], '.2f', 1e-9)} | {f(_get(r, 'dram__bytes_read.sum'), '.2f', 1e-9)} / "
                         f"{f(_get(r, 'dram__bytes_write.sum'), '.2f', 1e-9)} | {c['shape']} | {stalls(r, 5)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--launches":
        files = []
        for spec in argv[1:]:
            label, _, path = spec.rpartition("=")  # (a label may hold "=": @KNOB=1=file.csv)
            try:
                with open(path) as fh:
                    files.append((label, read_raw_csv(fh.read())))
            except (OSError, ValueError) as err:
                print(f"{label}: {err}")
                files.append((label, []))
        print(launches(files))
        return 0
    if len(argv) != 3:
        print("usage: python -m machmoe.bench.ncu_compare CONFIG sonic.csv machmoe.csv")
        return 2
    config, sonic, ours = argv
    impls = {}
    for impl, path in (("sonicmoe", sonic), ("machmoe", ours)):
        try:
            with open(path) as fh:
                impls[impl] = read_raw_csv(fh.read())
        except (OSError, ValueError) as err:
            print(f"{impl}: {err}")
            impls[impl] = []
    print(table(config, impls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
