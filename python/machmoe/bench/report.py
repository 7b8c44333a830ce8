"""Benchmark results as files: the Markdown table (also printed), the JSON file with every figure,
and a PNG chart (matplotlib, imported only to draw it)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

from . import timing


def write_table(out_dir: str, name: str, text: str, rows: list) -> None:
    """out_dir/name.md (the Markdown table) and out_dir/name.json (its rows), the directory made
    if needed: what the small benchmarks (variants, fp8_gemm) write with --out."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)


def git_commit() -> str:
    """Short commit of the repository this package lives in, or "unknown". The GPU machine gets a
    copy of the tree without .git: there scripts/gpu_check.sh passes it in $MACHMOE_COMMIT."""
    if os.environ.get("MACHMOE_COMMIT"):
        return os.environ["MACHMOE_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    if out.returncode != 0 or not commit:
        return "unknown"
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        dirty = ""
    return commit + ("+dirty" if dirty else "")


def run_header() -> dict:
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "timing": timing.describe_protocol(),
    }


def _num(v, digits: int = 0) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    return f"{v:.{digits}f}"


def short_status(status: str) -> str:
    """What goes into a table cell for a non-"ok" implementation."""
    if status.startswith("not built"):
        return "not built"
    if status.startswith("not available"):
        return "not available"
    if status.startswith("OOM"):
        return "OOM"
    return "error"


def backward_status(res: dict) -> str:
    """The cell text for an implementation timed forward-only: "bwd not built", or "bwd error"
    when its backward ran and failed (the row's "backward" entry holds the message)."""
    why = str(res.get("backward", "not built"))
    return "bwd not built" if why.startswith("not built") else "bwd error"


def _pair(res: dict | None, key_a: str, key_b: str, digits: int = 0) -> str:
    """"fwd / bwd" cell of an implementation's result dict, or its status."""
    if res is None:
        return "—"
    if res.get("status") != "ok":
        return short_status(res.get("status", "error"))
    return f"{_num(res.get(key_a), digits)} / {_num(res.get(key_b), digits)}"


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def derived_ratios(row: dict) -> dict:
    """machmoe / grouped_mm and machmoe / dense bound, forward and backward."""
    mm, gm, dn = row.get("machmoe"), row.get("grouped_mm"), row.get("dense")
    out = {}
    if mm and mm.get("status") == "ok":
        for tag, ref in (("grouped_mm", gm), ("dense", dn)):
            if ref and ref.get("status") == "ok":
                out[f"fwd_vs_{tag}"] = _ratio(mm.get("fwd_tflops"), ref.get("fwd_tflops"))
                out[f"bwd_vs_{tag}"] = _ratio(mm.get("bwd_tflops"), ref.get("bwd_tflops"))
    return out


def largest_spread(rows: list[dict]):
    """(spread %, "config impl phase") of the noisiest timing in the run, or None."""
    best = None
    for row in rows:
        for impl in ("grouped_mm", "dense", "machmoe"):
            res = row.get(impl) or {}
            for key, val in res.items():
                if key.endswith("_timing") and isinstance(val, dict) and "spread_pct" in val:
                    cand = (val["spread_pct"], f"{row['config']['name']} {impl} {key[:-7]}")
                    if best is None or cand[0] > best[0]:
                        best = cand
    return best


def markdown(header: dict, ceilings: dict, rows: list[dict]) -> str:
    lines = [
        "# machmoe benchmark",
        "",
        f"GPU: {header['gpu']} · commit {header['commit']} · {header['date_utc']} · "
        f"torch {header['torch']} (CUDA {header['cuda']})",
        "",
        f"Ceilings measured in this run: dense bf16 8192³ matmul "
        f"{_num(ceilings.get('matmul_tflops'))} TFLOPS; device-to-device copy "
        f"{_num(ceilings.get('copy_gbps'))} GB/s (bytes read + written).",
        "",
        f"Timing (every figure of this run): {header.get('timing', 'not recorded')}.",
        "",
        "TFLOPS forward / backward (expert FLOPs only: fwd 6·T·K·n·d, bwd 12·T·K·n·d; bwd time = "
        "(fwd+bwd) − fwd, routing inside the timed region). Memory: GiB held between forward and "
        "backward excluding the output and x (the caller's); formula: x and H, 2·T·d + 4·T·K·n "
        "bytes; bound: 2·T·d + 4·T·K·n + 16·T·K + 4·T·E (x, H, per-pair scores and metadata, fp32 "
        "logits) less x's 2·T·d, to compare with the measured machmoe GiB.",
        "",
        "| config | T | d | n | E | K | SonicMoE (paper) | grouped_mm | grouped_mm GiB | formula GiB "
        "| dense bound | machmoe | machmoe GiB | bound GiB | machmoe ÷ grouped_mm | machmoe ÷ dense | machmoe err out / dx |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        c = row["config"]
        gm, dn, mm = row.get("grouped_mm"), row.get("dense"), row.get("machmoe")
        ratios = row.get("ratios", {})
        mm_ok = bool(mm) and mm.get("status") == "ok"
        mm_gib = _num(mm.get("held_gib"), 2) if mm_ok else (short_status(mm["status"]) if mm else "—")
        gm_gib = _num(gm.get("held_gib"), 2) if gm and gm.get("status") == "ok" else (
            short_status(gm["status"]) if gm else "—")
        if mm_ok:
            vs_gm = f"{_num(ratios.get('fwd_vs_grouped_mm'), 2)} / {_num(ratios.get('bwd_vs_grouped_mm'), 2)}"
            vs_dn = f"{_num(ratios.get('fwd_vs_dense'), 2)} / {_num(ratios.get('bwd_vs_dense'), 2)}"
            errs = (f"{mm['err_out']:.1e} / " + (f"{mm['err_dx']:.1e}" if "err_dx" in mm else backward_status(mm))
                    if "err_out" in mm else "—")
        else:
            vs_gm = vs_dn = errs = short_status(mm["status"]) if mm else "—"
        lines.append(
            f"| {c['name']} | {c['T']} | {c['d']} | {c['n']} | {c['E']} | {c['K']} "
            f"| {_num(row['sonicmoe']['fwd_tflops'])} / {_num(row['sonicmoe']['bwd_tflops'])} "
            f"| {_pair(gm, 'fwd_tflops', 'bwd_tflops')} | {gm_gib} | {_num(row['formula_gib'], 2)} "
            f"| {_pair(dn, 'fwd_tflops', 'bwd_tflops')} | {_pair(mm, 'fwd_tflops', 'bwd_tflops')} "
            f"| {mm_gib} | {_num(row.get('bound_gib'), 2)} | {vs_gm} | {vs_dn} | {errs} |"
        )
    spread = largest_spread(rows)
    if spread is not None:
        lines += ["", f"Timing noise: the largest spread between the two timing rounds of one "
                      f"measurement was {spread[0]:.1f}% ({spread[1]}); smaller differences "
                      f"between versions are noise."]
    notes = [r["config"]["name"] + ": " + r[k]["status"]
             for r in rows for k in ("grouped_mm", "dense", "machmoe")
             if r.get(k) and r[k].get("status") not in ("ok",) and not r[k]["status"].startswith("not built")]
    notes += [r["config"]["name"] + ": machmoe backward " + str(r["machmoe"]["backward"])
              for r in rows if (r.get("machmoe") or {}).get("status") == "ok"
              and backward_status(r["machmoe"]) == "bwd error" and "bwd_tflops" not in r["machmoe"]]
    if notes:
        lines += ["", "Problems:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


PLOT_SERIES = (  # (row key, legend label, colour)
    ("machmoe", "machmoe", "tab:blue"),
    ("grouped_mm", "torch._grouped_mm layer", "tab:orange"),
    ("dense", "dense cuBLAS bound", "tab:gray"),
)


def _ok(row: dict, impl: str, key: str):
    res = row.get(impl) or {}
    return res.get(key) if res.get("status") == "ok" else None


def write_plot(path: str, header: dict, rows: list[dict]) -> str | None:
    """Draws bench.png: forward and backward TFLOPS per config (machmoe beside the grouped_mm
    layer and the dense cuBLAS bound) and the GiB held between forward and backward (machmoe and
    grouped_mm beside the bound). A missing figure (not built, OOM, error) is left out, its bar
    absent. Returns the path, or None (saying why once) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.png not written: matplotlib is not installed (pip install matplotlib)")
        return None
    names = [r["config"]["name"] for r in rows]
    xs = list(range(len(rows)))
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.9 * len(rows) + 3), 11), sharex=True)
    panels = (("fwd_tflops", "forward TFLOPS", PLOT_SERIES),
              ("bwd_tflops", "backward TFLOPS", PLOT_SERIES),
              ("held_gib", "GiB held for the backward", PLOT_SERIES[:2]))
    for ax, (key, title, series) in zip(axes, panels):
        width = 0.8 / (len(series) + (key == "held_gib"))
        for i, (impl, label, colour) in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            pts = [(x + offset, _ok(r, impl, key)) for x, r in zip(xs, rows)]
            ok = [(x, v) for x, v in pts if v is not None]
            if ok:
                ax.bar([p[0] for p in ok], [p[1] for p in ok], width, label=label, color=colour)
            for (x, v), r in zip(pts, rows):  # say why a bar is missing: "OOM", "not built", ...
                if v is None and r.get(impl):
                    ax.text(x, 0, " " + short_status(r[impl].get("status", "error")), rotation=90,
                            ha="center", va="bottom", fontsize=7, color=colour)
        if key == "held_gib":
            bound = [(x, r.get("bound_gib")) for x, r in zip(xs, rows) if r.get("bound_gib") is not None]
            if bound:
                ax.scatter([p[0] for p in bound], [p[1] for p in bound], marker="_", s=600,
                           color="black", label="bound (H and routing state)", zorder=3)
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1].set_xticks(xs)
    axes[-1].set_xticklabels(names, rotation=30, ha="right")
    fig.suptitle(f"machmoe benchmark: {header.get('gpu', '?')}, commit {header.get('commit', '?')}, "
                 f"{header.get('date_utc', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(out_dir: str, header: dict, ceilings: dict, rows: list[dict], args: dict,
                  extra: dict | None = None, markdown_text: str | None = None) -> list[str]:
    """Writes bench.json, bench.md and bench.png (when matplotlib is installed) into out_dir;
    returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "bench.json")
    md_path = os.path.join(out_dir, "bench.md")
    with open(json_path, "w") as f:
        json.dump({"header": header, "args": args, "ceilings": ceilings, "configs": rows,
                   **(extra or {})}, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(markdown_text if markdown_text is not None else markdown(header, ceilings, rows))
    png_path = write_plot(os.path.join(out_dir, "bench.png"), header, rows)
    return [json_path, md_path] + ([png_path] if png_path else [])
