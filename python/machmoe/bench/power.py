"""Clock and power of the GPU while each kernel of the table runs back to back.

Why: the timing probes (docs/PERF.md) show loads alone and wgmmas alone each taking about the
same time, and both together 1.4-1.6x that. Whether the SM clock falls when both run (a power cap)
or stays (a scheduling problem) decides which lever is worth trying. `nvidia-smi` samples the
clock, the board power and the active clock-event reasons every `interval_ms` in the background;
each kernel runs on its rotated inputs for `seconds`; the samples inside each window (minus a
settling margin) are summarised per kernel.

Run on the GPU machine: python -m machmoe.bench.power [--seconds 2] [--only 7B-a]
(the probe build's MACHMOE_GEMM_PROBE applies as usual).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import time

# Sampled fields, first choice then fallbacks (names differ between driver versions).
FIELDS = (("clocks.sm",), ("power.draw.instant", "power.draw"),
          ("clocks_event_reasons.active", "clocks_throttle_reasons.active"), ("temperature.gpu",))

# Bits of the clock-event reason mask (nvml.h, nvmlClocksEventReason*).
REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x20: "sw-thermal",
           0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}


def reason_names(mask: int) -> str:
    names = [name for bit, name in REASONS.items() if mask & bit]
    return "+".join(names) if names else "none"


def pick_fields(query=subprocess.run) -> list[str]:
    """The first name of each field that this nvidia-smi accepts."""
    chosen = []
    for options in FIELDS:
        for name in options:
            r = query(["nvidia-smi", f"--query-gpu={name}", "--format=csv,noheader,nounits", "-i", "0"],
                      capture_output=True, text=True)
            if r.returncode == 0 and "not a valid field" not in (r.stdout + r.stderr).lower():
                chosen.append(name)
                break
        else:
            raise RuntimeError(f"nvidia-smi accepts none of {options}")
    return chosen


def parse_samples(text: str) -> list[tuple[float, float, float, int, float]]:
    """Lines 'YYYY/MM/DD HH:MM:SS.mmm, clock MHz, power W, reasons 0x.., temp C' ->
    (epoch seconds, MHz, W, reason mask, C); lines that do not parse (headers, N/A) are dropped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            stamp = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, float(parts[1]), float(parts[2]), int(parts[3], 16), float(parts[4])))
        except ValueError:
            continue
    return out


def summarise(samples, start: float, end: float, settle_s: float = 0.3) -> dict:
    """Median clock/power/temperature and the reasons seen over the samples in [start+settle, end]."""
    window = [s for s in samples if start + settle_s <= s[0] <= end]
    if not window:
        return {"samples": 0}
    mask = 0
    for s in window:
        mask |= s[3]
    return {"samples": len(window), "sm_mhz": statistics.median(s[1] for s in window),
            "sm_mhz_min": min(s[1] for s in window), "watts": statistics.median(s[2] for s in window),
            "watts_max": max(s[2] for s in window), "temp_c": statistics.median(s[4] for s in window),
            "reasons": reason_names(mask)}


def sustain(case, seconds: float) -> tuple[float, float, float, float]:
    """Runs case.fn over its sets for about `seconds`; returns (wall start, wall end, TFLOPS, ms per call)."""
    import torch

    n = len(case.sets)
    for i in range(3):
        case.fn(*case.sets[i % n])
    torch.cuda.synchronize()
    t0 = time.time()
    calls = 0
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    while time.time() - t0 < seconds:
        for _ in range(8):  # queue a few calls between host checks; the queue stays full
            r = case.fn(*case.sets[calls % n])
            del r
            calls += 1
        if calls % 64 == 0:
            torch.cuda.synchronize()
    ev1.record()
    torch.cuda.synchronize()
    t1 = time.time()
    ms = ev0.elapsed_time(ev1) / calls
    return t0, t1, case.flops / (ms * 1e-3) / 1e12 if case.flops else 0.0, ms


def idle_case():
    """One thread spinning on the clock (torch.cuda._sleep): the GPU awake, at its clock, doing
    nothing else. Its power is the baseline that 'mJ above idle' subtracts."""
    import torch

    from .gemm_kernels import KernelCase

    return KernelCase("idle (one spinning thread)", lambda: torch.cuda._sleep(1_000_000), [()], 0.0)


def limits(device: int = 0, query=subprocess.run) -> str:
    """The board's power limits as nvidia-smi reports them (W), or why not."""
    r = query(["nvidia-smi", "--query-gpu=name,power.limit,enforced.power.limit,power.max_limit,clocks.max.sm",
               "--format=csv,noheader", "-i", str(device)], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else f"(nvidia-smi: {r.stderr.strip()})"


def energy_mj(watts: float, ms: float, idle_watts: float | None) -> tuple[float, float | None]:
    """Energy per call in mJ, total and above the idle baseline."""
    total = watts * ms
    return total, None if idle_watts is None else (watts - idle_watts) * ms


class Sampler:
    """nvidia-smi sampling in the background: `with Sampler() as smp: ...; smp.summary(t0, t1)`.
    Without nvidia-smi (or with fields it lacks) it samples nothing and summary() says so."""

    def __init__(self, interval_ms: int = 50, device: int = 0):
        self.interval_ms, self.device = interval_ms, device
        self.fields: list[str] = []
        self.samples: list = []
        self._proc = None
        self._log = None
        self.error = ""

    def __enter__(self):
        try:
            self.fields = pick_fields()
            self._log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp," + ",".join(self.fields), "--format=csv,noheader,nounits",
                 "-i", str(self.device), "-lms", str(self.interval_ms)], stdout=self._log, stderr=subprocess.DEVNULL)
            time.sleep(0.3)  # nvidia-smi's own start
        except (OSError, RuntimeError) as err:
            self.error = f"{type(err).__name__}: {err}"
            self._proc = None
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._log.seek(0)
            self.samples = parse_samples(self._log.read())
            self._log.close()
        return False

    def summary(self, start: float, end: float, settle_s: float = 0.3) -> dict:
        if self._proc is None:
            return {"samples": 0, "error": self.error or "not sampled"}
        return summarise(self.samples, start, end, settle_s)


def describe(s: dict) -> str:
    """'SM 1425 MHz, 759 W, sw-power-cap' (medians over the window), or why there is nothing."""
    if not s.get("samples"):
        return f"clock not sampled ({s.get('error', 'no samples')})"
    return f"SM {s['sm_mhz']:.0f} MHz, {s['watts']:.0f} W, clock-event reasons: {s['reasons']}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--interval-ms", type=int, default=50)
    p.add_argument("--only", default="", help="comma-separated substrings of the kernel labels")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("power: no CUDA GPU here; nothing to sample")
        return 0
    from . import gemm_kernels

    wanted = gemm_kernels.row_filter(args.only)
    windows = []
    with Sampler(args.interval_ms, torch.cuda.current_device()) as smp:
        t0, t1, _, ms = sustain(idle_case(), args.seconds)
        windows.append(("idle (one spinning thread)", t0, t1, 0.0, ms))
        time.sleep(0.3)
        for case in gemm_kernels.cases():
            if not gemm_kernels.row_wanted(case.kernel, wanted):
                continue
            runs = [case]
            if case.reference is not None:  # cuBLAS on the same GEMMs: the same question for it
                runs.append(dataclasses.replace(case, kernel=f"{case.ref_label} {case.kernel}", fn=case.reference,
                                                sets=case.reference_sets()))
            for c in runs:
                t0, t1, tflops, ms = sustain(c, args.seconds)
                windows.append((c.kernel, t0, t1, tflops, ms))
                time.sleep(0.3)  # a gap between windows, so the next one starts from its own state
    if smp.error:
        print(f"power: {smp.error}")
        return 1
    print(f"board: {limits(smp.device)}")
    print(f"fields: {', '.join(smp.fields)}; {len(smp.samples)} samples every {args.interval_ms} ms")
    print("| kernel | TFLOPS (sustained) | ms/call | SM MHz median (min) | W median (max) | mJ/call | mJ above idle"
          " | C | clock-event reasons |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|---|")
    idle_watts = None
    for kernel, t0, t1, tflops, ms in windows:
        s = smp.summary(t0, t1)
        if not s["samples"]:
            print(f"| {kernel} | {tflops:.0f} | {ms:.3f} | no samples | | | | | |")
            continue
        if kernel.startswith("idle"):
            idle_watts = s["watts"]
            total, above = None, None
        else:
            total, above = energy_mj(s["watts"], ms, idle_watts)
        cells = ["—" if total is None else f"{total:.0f}", "—" if above is None else f"{above:.0f}"]
        print(f"| {kernel} | {tflops:.0f} | {ms:.3f} | {s['sm_mhz']:.0f} ({s['sm_mhz_min']:.0f}) | {s['watts']:.0f} "
              f"({s['watts_max']:.0f}) | {cells[0]} | {cells[1]} | {s['temp_c']:.0f} | {s['reasons']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
