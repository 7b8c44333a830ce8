"""The table of `scripts/gpu_probe.sh`: milliseconds per expert GEMM under each timing probe.

The script runs `gemm_kernels.run()` once per build/probe and saves each run's rows as
`<column>.json` in one folder (`normal`, `probe<P>` for each probe P, `normal2`); this module
lines them up. The weight-gradient kernels (dW1, dW2) have probes 1, 2 and 4 (no TMA store: 8 is
the same as the normal build for them).

    python -m machmoe.bench.probe_table FOLDER "0 1 8 2 4 3 5 6 s4:1 s4:3"

A column "s4:P" is probe P of the extra-stage build (`stages4_probe<P>.json`: one more operand
stage in place of the staged output tile, no epilogue; PROBE_STAGES4=1 of the script).
"""

from __future__ import annotations

import json
import os
import sys

# What each MACHMOE_GEMM_PROBE value skips (bits: 1 epilogue, 2 wgmma, 4 loads, 8 TMA store; the
# dH epilogue only: 16 its H loads, 32 its dH stores, 64 its A' stores; 128 A loaded for a row
# block's first column tile only; the weight gradients only: 256 their partial last B block by TMA,
# 512 half of B's boxes).
PROBE_NAMES = {"0": "probe build", "1": "no epilogue", "2": "no wgmma", "4": "no loads", "3": "loads only",
               "5": "wgmma only", "6": "epilogue only", "8": "no TMA store", "16": "dH: no H loads",
               "32": "dH: no dH stores", "64": "dH: no A' stores", "96": "dH: no stores",
               "112": "dH: no H loads, no stores", "128": "A for the first column tile only",
               "256": "dW: partial B block by TMA", "512": "dW: half of B's boxes"}


def _file(probe: str) -> str:
    """The JSON file name (less .json) of a column: probe<P>, or stages4_probe<P> for "s4:P"."""
    return f"stages4_probe{probe[3:]}" if probe.startswith("s4:") else f"probe{probe}"


def _head(probe: str) -> str:
    if probe.startswith("s4:"):
        p = probe[3:]
        return f"+1 stage: {p}: {PROBE_NAMES.get(p, 'probe ' + p)}"
    return f"{probe}: {PROBE_NAMES.get(probe, 'probe ' + probe)}"


def load_columns(folder: str, probes: list[str]) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The columns in order and, per column, kernel name -> ms (empty where a run failed)."""
    cols = ["normal"] + [_file(p) for p in probes] + ["normal2"]
    data: dict[str, dict[str, float]] = {}
    for c in cols:
        path = os.path.join(folder, c + ".json")
        rows = json.load(open(path)) if os.path.exists(path) else []
        data[c] = {r["kernel"]: float(r["ms"]) for r in rows if "ms" in r}
    return cols, data


def format_table(folder: str, probes: list[str]) -> str:
    cols, data = load_columns(folder, probes)
    # Kernel order: the first column that has rows (the normal build, unless it failed).
    names = next((list(data[c]) for c in cols if data[c]), [])
    heads = ["normal"] + [_head(p) for p in probes] + ["normal again"]
    lines = ["Milliseconds per call (probe results are wrong; only their times mean something).", "",
             "| kernel | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for k in names:
        cells = [f"{data[c][k]:.3f}" if k in data[c] else "—" for c in cols]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m machmoe.bench.probe_table FOLDER 'PROBE ...'")
    print(format_table(sys.argv[1], sys.argv[2].split()))
