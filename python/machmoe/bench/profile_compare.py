"""Both layers kernel by kernel, side by side, from the profiles `scripts/sonicmoe_compare.sh`
writes (`SONIC_PROFILE=7B-a,30B-b`: `$OUT/profiles.txt`, each section the output of
`python -m machmoe.bench.profile --gaps` for one implementation and config).

    python -m machmoe.bench.profile_compare profiles.txt [--phase fwdbwd|fwd]

Each expert GEMM is found by its kernel name, in launch order (the same in both layers:
up-projection, down-projection, dH, dW2, dW1, dX~), and so is each aggregation (the forward's,
then the backward's dx). Every other device activity (router GEMMs, top-K, metadata, sorting,
elementwise kernels, copies) is summed as "other". SonicMoE adds the router's part of dx in
"other" (a GEMM and an elementwise add); ours is inside the dx aggregation.

Per-kernel times from one layer's calls depend on its launch gaps: idle time between kernels
lets the next one start on a cooler, less power-capped GPU. The table prints each layer's gaps;
compare kernels only where both are small, or by cycles (`python -m machmoe.bench.ncu_compare`).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field

GEMM_ROLES = ("up-proj", "down-proj", "dH", "dW2", "dW1", "dX~")
AGG_ROLES = ("aggregation (forward)", "dx aggregation")
# Kernel-name patterns of each layer's expert GEMMs and aggregations.
GEMM_NAMES = {"machmoe": ("sm90_grouped_gemm", "sm90_grouped_wgrad"), "sonicmoe": ("HopperWgmma",)}
AGG_NAMES = {"machmoe": ("aggregate_rows",), "sonicmoe": ("token_gather_sum",)}

_HEADER = re.compile(r"^== (?P<config>\S+) T=\d+ (?P<impl>\S+) (?P<phase>forward\+backward|forward), per call over \d+: "
                     r"kernels (?P<kernels>[\d.]+) ms.*?wall (?P<wall>[\d.]+) ms.*?gaps (?P<gaps>[\d.]+)% of the wall time",
                     re.M)
_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+(.+?)\s*$")


@dataclass
class LayerProfile:
    impl: str
    config: str
    phase: str  # "fwdbwd" or "fwd"
    kernels_ms: float
    wall_ms: float
    gaps_pct: float
    rows: list[tuple[float, str]] = field(default_factory=list)  # (µs, name) in launch order


def parse(text: str) -> list[LayerProfile]:
    """Every forward and forward+backward table in the file, with its section's implementation."""
    out = []
    for block in re.split(r"\n(?=== )", text):
        m = _HEADER.search(block)
        if not m:
            continue
        prof = LayerProfile(m["impl"], m["config"], "fwdbwd" if m["phase"] == "forward+backward" else "fwd",
                            float(m["kernels"]), float(m["wall"]), float(m["gaps"]))
        table = block.split("activity (one call, in order", 1)
        if len(table) == 2:
            for line in table[1].splitlines()[1:]:
                r = _ROW.match(line)
                if r:
                    prof.rows.append((float(r[2]), r[4]))
                elif line.strip().startswith("sum of gaps"):
                    break
        out.append(prof)
    return out


def by_role(prof: LayerProfile) -> dict[str, float]:
    """µs per role: the expert GEMMs and aggregations by name in launch order, the rest as
    "other". Raises ValueError if the layer launched more GEMMs or aggregations than there are
    roles (a name pattern that no longer matches only one kernel family)."""
    gemms = GEMM_NAMES.get(prof.impl, ())
    aggs = AGG_NAMES.get(prof.impl, ())
    out = {role: 0.0 for role in GEMM_ROLES + AGG_ROLES}
    out["other"] = 0.0
    g = a = 0
    for us, name in prof.rows:
        if any(p in name for p in gemms):
            if g >= len(GEMM_ROLES):
                raise ValueError(f"{prof.impl} {prof.config}: more expert GEMMs than {GEMM_ROLES}")
            out[GEMM_ROLES[g]] += us
            g += 1
        elif any(p in name for p in aggs):
            if a >= len(AGG_ROLES):
                raise ValueError(f"{prof.impl} {prof.config}: more aggregations than {AGG_ROLES}")
            out[AGG_ROLES[a]] += us
            a += 1
        else:
            out["other"] += us
    return out


def table(profiles: list[LayerProfile], phase: str = "fwdbwd", ref: str = "sonicmoe", ours: str = "machmoe") -> str:
    """Markdown: per config, each role's µs for `ref` and `ours` and their ratio (ours ÷ ref)."""
    got = {(p.config, p.impl): p for p in profiles if p.phase == phase}
    configs = list(dict.fromkeys(c for c, _ in got))  # in file order
    lines = []
    for config in configs:
        a, b = got.get((config, ref)), got.get((config, ours))
        if a is None or b is None:
            lines.append(f"{config}: {ref if a is None else ours} not profiled")
            continue
        ra, rb = by_role(a), by_role(b)
        lines += [f"{config}, {'forward + backward' if phase == 'fwdbwd' else 'forward'} (µs per call)", "",
                  f"| kernel | {ref} | {ours} | {ours} ÷ {ref} |", "|---|--:|--:|--:|"]
        for role in GEMM_ROLES + AGG_ROLES + ("other",):
            if ra[role] == 0.0 and rb[role] == 0.0:
                continue
            ratio = f"{rb[role] / ra[role]:.3f}" if ra[role] > 0 else "—"
            lines.append(f"| {role} | {ra[role]:.1f} | {rb[role]:.1f} | {ratio} |")
        lines.append(f"| sum of kernels | {1e3 * a.kernels_ms:.1f} | {1e3 * b.kernels_ms:.1f} | "
                     f"{b.kernels_ms / a.kernels_ms:.3f} |")
        lines.append(f"| wall time | {1e3 * a.wall_ms:.1f} | {1e3 * b.wall_ms:.1f} | {b.wall_ms / a.wall_ms:.3f} |")
        lines.append(f"| launch gaps, % of the wall | {a.gaps_pct:.1f}% | {b.gaps_pct:.1f}% | |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", help="profiles.txt from scripts/sonicmoe_compare.sh (SONIC_PROFILE)")
    p.add_argument("--phase", choices=("fwdbwd", "fwd"), default="fwdbwd")
    args = p.parse_args(argv)
    with open(args.profiles) as fh:
        profiles = parse(fh.read())
    if not profiles:
        print(f"{args.profiles}: no profile tables found")
        return 1
    try:
        print(table(profiles, args.phase))
    except ValueError as err:
        print(err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
