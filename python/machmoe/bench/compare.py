"""Compare a benchmark run with a baseline run (both `python -m machmoe.bench --out` JSON files):

  python -m machmoe.bench.compare NEW.json [BASE.json]      (BASE: results/baseline_h100.json)

Prints, per layer config (forward and backward TFLOPS) and per expert GEMM kernel, the ratio of
the new figure to the baseline's, raw and normalised by each run's own dense cuBLAS ceiling (lent
machines differ by up to ~10% in clocks: the normalised ratio is the one to trust), and flags every
normalised drop beyond the tolerance. A speed figure is only comparable with the references of its
own run (SPEC §4); this is a regression alarm between commits, not a result.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_BASELINE = Path(__file__).resolve().parents[3] / "results" / "baseline_h100.json"


def _figures(run: dict) -> dict[str, float]:
    """name -> TFLOPS of every comparable figure of a run."""
    out: dict[str, float] = {}
    for c in run.get("configs", []):
        m = c.get("machmoe", {})
        if m.get("status") != "ok":
            continue
        name = c["config"]["name"]
        out[f"{name} layer fwd"] = float(m["fwd_tflops"])
        out[f"{name} layer bwd"] = float(m["bwd_tflops"])
    for k in run.get("gemm_kernels", []):
        if "machmoe_tflops" in k:
            out[k["kernel"]] = float(k["machmoe_tflops"])
    return out


def compare(new: dict, base: dict, tolerance: float = 0.08) -> list[dict]:
    """One row per figure present in both runs: raw and ceiling-normalised ratios, and whether
    the normalised ratio fell below 1 - tolerance."""
    scale = float(base["ceilings"]["matmul_tflops"]) / float(new["ceilings"]["matmul_tflops"])
    f_new, f_base = _figures(new), _figures(base)
    rows = []
    for name, b in f_base.items():
        if name not in f_new or b <= 0:
            continue
        raw = f_new[name] / b
        norm = raw * scale
        rows.append({"figure": name, "base": b, "new": f_new[name], "ratio": raw, "normalised": norm,
                     "regression": norm < 1.0 - tolerance})
    return rows


def format_rows(rows: list[dict], new: dict, base: dict) -> str:
    head = (f"new: commit {new['header'].get('commit')} ({new['ceilings']['matmul_tflops']:.0f} TFLOPS cuBLAS); "
            f"baseline: commit {base['header'].get('commit')} ({base['ceilings']['matmul_tflops']:.0f})")
    lines = [head, "", "| figure | baseline | new | new ÷ baseline | normalised | |", "|---|--:|--:|--:|--:|---|"]
    for r in rows:
        flag = "REGRESSION" if r["regression"] else ""
        lines.append(f"| {r['figure']} | {r['base']:.0f} | {r['new']:.0f} | {r['ratio']:.2f} | {r['normalised']:.2f} | {flag} |")
    bad = [r["figure"] for r in rows if r["regression"]]
    lines.append("")
    lines.append(f"regressions beyond tolerance: {len(bad)}" + (f" ({', '.join(bad)})" if bad else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m machmoe.bench.compare")
    p.add_argument("new", type=Path)
    p.add_argument("base", type=Path, nargs="?", default=DEFAULT_BASELINE)
    p.add_argument("--tolerance", type=float, default=0.08, help="flag normalised drops beyond this (0.08)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a figure regressed")
    args = p.parse_args(argv)
    if not args.base.is_file():
        print(f"no baseline at {args.base}: nothing to compare")
        return 0
    new, base = json.loads(args.new.read_text()), json.loads(args.base.read_text())
    rows = compare(new, base, args.tolerance)
    print(format_rows(rows, new, base))
    return 1 if args.strict and any(r["regression"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
