"""SonicMoE's own benchmark beside ours on the same GPU (`scripts/sonicmoe_compare.sh`).

The script runs SonicMoE's `benchmarks/moe-cute.py` (Dao-AILab/sonic-moe at 8565e84) per config
and `python -m machmoe.bench --timing sonic` in the same device call. This module reads the
script's logs and our bench.json and prints one table: SonicMoE here, SonicMoE published
(SPEC §5), machmoe, and the ratios.

Both sides count FLOPs the same way (SPEC §1: forward 6·T·K·n·d, backward 12·T·K·n·d, backward
time = (forward + backward) − forward). SonicMoE's figures are triton do_bench means, ours
medians of CUDA-event times under the same protocol (the L2 flush and 0.5 s idle).

SonicMoE's forward is timed alone and its backward is the difference, so a noisy forward makes
both halves wrong. Where its forward is not self-consistent (`forward_doubts`), only the
forward + backward ratio is meaningful.

Usage: python -m machmoe.bench.sonic_compare OUT CONFIG[,CONFIG...]
  reads OUT/sonic_<config>.log and OUT/ours/bench.json.
"""

from __future__ import annotations

import json
import os
import re
import sys

from .configs import CONFIGS_BY_NAME, MoEConfig

_LINE = re.compile(r"Cute-DSL (Fwd|Fwd, inference mode|Fwd \+ Bwd|Bwd),? Average time: "
                   r"([-\d.]+) ms, TFLOPS: ([-\d.]+)")
_KEYS = {"Fwd": "fwd", "Fwd, inference mode": "infer", "Fwd + Bwd": "fwdbwd", "Bwd": "bwd"}


def parse_sonic_log(text: str) -> dict[str, tuple[float, float]]:
    """{"fwd" | "infer" | "fwdbwd" | "bwd": (ms, TFLOPS)} for the lines moe-cute.py printed."""
    out = {}
    for m in _LINE.finditer(text):
        out[_KEYS[m.group(1)]] = (float(m.group(2)), float(m.group(3)))
    return out


def fwdbwd_tflops(fwd_tflops: float, bwd_tflops: float) -> float:
    """Forward + backward TFLOPS (18·T·K·n·d over the sum of the two times) from the two halves."""
    return 18.0 / (6.0 / fwd_tflops + 12.0 / bwd_tflops)


def forward_doubts(s: dict[str, tuple[float, float]], cfg: MoEConfig) -> list[str]:
    """Why SonicMoE's forward timing (and so its backward, a difference) is not to be trusted.

    The inference-mode forward does a subset of the training forward's work, so it must not be
    slower; the two should be close; and a forward far below the published figure on the same
    kind of GPU says the timing measured something else (we read it as host-bound: not profiled).
    """
    why = []
    if "fwd" not in s or "infer" not in s:
        return ["forward not timed"]
    fwd_ms, fwd_tf = s["fwd"]
    inf_ms, _ = s["infer"]
    if inf_ms > 1.03 * fwd_ms:
        why.append(f"inference-mode forward slower ({inf_ms:.3f} vs {fwd_ms:.3f} ms)")
    elif abs(fwd_ms - inf_ms) > 0.25 * fwd_ms:
        why.append(f"inference-mode and training forwards differ by {abs(fwd_ms - inf_ms) / fwd_ms:.0%}")
    if fwd_tf < 0.85 * cfg.sonic_fwd:
        why.append(f"forward {fwd_tf:.0f} against {cfg.sonic_fwd:.0f} published")
    return why


def _num(x, digits=0) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return "—" if not a or not b else f"{a / b:.3f}"


def table(names: list[str], sonic_logs: dict[str, str], ours: dict[str, dict]) -> str:
    """Markdown table; `ours[name]` holds fwd_tflops / bwd_tflops (bench.json's "machmoe")."""
    rows = ["| config | SonicMoE here fwd / bwd / both | SonicMoE published | machmoe fwd / bwd / both "
            "| machmoe ÷ SonicMoE here fwd / bwd / both | SonicMoE's forward split |",
            "|---|--:|--:|--:|--:|---|"]
    for name in names:
        cfg = CONFIGS_BY_NAME[name]
        s = parse_sonic_log(sonic_logs.get(name, ""))
        mm = ours.get(name) or {}
        f, b = mm.get("fwd_tflops"), mm.get("bwd_tflops")
        both = fwdbwd_tflops(f, b) if f and b else None
        sf = s.get("fwd", (None, None))[1]
        sb = s.get("bwd", (None, None))[1]
        sboth = s.get("fwdbwd", (None, None))[1]
        doubts = forward_doubts(s, cfg) if s else ["not run"]
        if doubts and s:  # only the forward + backward ratio stands
            rf = rb = "(—)"
        else:
            rf, rb = _ratio(f, sf), _ratio(b, sb)
        rows.append(
            f"| {name} | {_num(sf)} / {_num(sb)} / {_num(sboth)} | {cfg.sonic_fwd:.0f} / {cfg.sonic_bwd:.0f} "
            f"| {_num(f)} / {_num(b)} / {_num(both)} | {rf} / {rb} / {_ratio(both, sboth)} "
            f"| {'; '.join(doubts) if doubts else 'consistent'} |")
    return "\n".join(rows)


def read_ours(path: str) -> dict[str, dict]:
    """bench.json (python -m machmoe.bench --out) -> {config name: its "machmoe" entry}."""
    with open(path) as f:
        data = json.load(f)
    return {row["config"]["name"]: row.get("machmoe") or {} for row in data.get("configs", [])}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    out, names = argv[0], [n for n in argv[1].split(",") if n]
    unknown = [n for n in names if n not in CONFIGS_BY_NAME]
    if unknown:
        print(f"sonic_compare: unknown config(s) {unknown}; known: {sorted(CONFIGS_BY_NAME)}", file=sys.stderr)
        return 2
    logs = {}
    for n in names:
        p = os.path.join(out, f"sonic_{n}.log")
        if os.path.exists(p):
            with open(p) as f:
                logs[n] = f.read()
    p = os.path.join(out, "ours", "bench.json")
    ours = read_ours(p) if os.path.exists(p) else {}
    print(table(names, logs, ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
