"""GPU timing and device ceilings.

* CUDA events around each call, warm-up first, median of at least `min_reps` calls.
* Calls rotate over several argument sets (different input tensors) so that L2 does not hold the
  inputs from one call to the next.
* Protocols (`--timing`, or MACHMOE_BENCH_TIMING): "rotate" (the default) times the calls back to
  back. "flush" also zeroes a 256 MB buffer before every timed call, outside its events, as
  `triton.testing.do_bench` does: between calls the GPU runs a memory-bound fill, which also
  lowers its average power, so on a board at its power cap the timed calls may run at a higher
  clock. "sonic" approaches how SonicMoE's published benchmark times (the figures of the table's
  SonicMoE column): the flush, and the GPU left idle for 0.5 s before each measurement, so the
  power limiter's average starts low. It keeps this module's median and warm-up (>= 0.1 s).
* The two ceilings measured in the same run: a dense bf16 8192^3 matmul and a large
  device-to-device copy (bytes read + written).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from typing import Any, Callable, Sequence

import torch


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int  # timed calls per round
    sets: int  # number of rotated argument sets
    rounds: int = 1
    # (largest - smallest round median) / pooled median, in percent: the run-to-run noise that a
    # difference between two versions has to exceed.
    spread_pct: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


L2_FLUSH_BYTES = 256 << 20  # do_bench's cache-clearing buffer
PROTOCOLS = ("rotate", "flush", "sonic")
SONIC_IDLE_S = 0.5  # SonicMoE's benchmark sleeps this long before each measurement
_protocol = "rotate"


def set_protocol(name: str) -> None:
    """One of PROTOCOLS (module docstring)."""
    global _protocol
    if name not in PROTOCOLS:
        raise ValueError(f"timing protocol must be one of {', '.join(PROTOCOLS)}; got {name!r}")
    _protocol = name


set_protocol(os.environ.get("MACHMOE_BENCH_TIMING", "rotate"))


def protocol() -> str:
    return _protocol


def describe_protocol() -> str:
    base = "median of CUDA-event times, argument sets rotated"
    if _protocol == "rotate":
        return f"{base}, calls back to back (protocol rotate)"
    flush = f"{base}, 256 MB zeroed before each timed call outside its events (triton do_bench's L2 flush)"
    if _protocol == "flush":
        return f"{flush} (protocol flush)"
    return f"{flush}, the GPU idle for {SONIC_IDLE_S} s before each measurement (protocol sonic: SonicMoE's benchmark)"


def cuda_time(
    fn: Callable[..., Any],
    arg_sets: Sequence[tuple],
    *,
    warmup: int = 3,
    min_reps: int = 20,
    max_reps: int = 200,
    target_s: float = 0.5,
    rounds: int = 2,
    warmup_s: float = 0.1,
) -> Timing:
    """Median GPU time of fn(*arg_sets[i % len(arg_sets)]) in milliseconds.

    The number of timed calls per round is chosen from the warm-up so that all rounds together
    take about `target_s` seconds, clamped to [min_reps, max_reps]. The median is over the calls
    of all rounds; the rounds' medians give the spread. fn's result is dropped right after the
    end event is recorded, so what it allocates (saved activations, gradients) is freed between
    calls; the end event is recorded before that free, so the free is not timed.
    """
    if not arg_sets:
        raise ValueError("need at least one argument set")
    n_sets = len(arg_sets)
    rounds = max(1, rounds)
    torch.cuda.synchronize()
    if _protocol == "sonic":
        time.sleep(SONIC_IDLE_S)
    # Warm-up: at least `warmup` calls and at least `warmup_s` seconds, so that library handles,
    # autotuning and the GPU clocks have settled before the first timed call.
    t0 = time.perf_counter()
    calls = 0
    while calls < max(1, warmup) or time.perf_counter() - t0 < warmup_s:
        r = fn(*arg_sets[calls % n_sets])
        del r
        calls += 1
        if calls >= max(1, warmup):
            torch.cuda.synchronize()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if _protocol != "rotate" else None
    # Estimate the per-call time (now past first-call costs) to size the timed rounds.
    t1 = time.perf_counter()
    for i in range(3):
        r = fn(*arg_sets[i % n_sets])
        del r
    torch.cuda.synchronize()
    per_call_s = (time.perf_counter() - t1) / 3
    reps = int(target_s / rounds / max(per_call_s, 1e-6))
    reps = max(min_reps, min(max_reps, reps))

    all_times: list[float] = []
    round_medians: list[float] = []
    for _ in range(rounds):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            args = arg_sets[i % n_sets]
            if flush is not None:
                flush.zero_()
            starts[i].record()
            r = fn(*args)
            ends[i].record()
            del r
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        all_times += times
        round_medians.append(statistics.median(times))
    med = statistics.median(all_times)
    spread = 100.0 * (max(round_medians) - min(round_medians)) / med if med > 0 else 0.0
    return Timing(med, min(all_times), max(all_times), reps, n_sets, rounds, spread)


def held_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes still allocated after fn() returns, minus the bytes of its outputs.

    fn returns the layer's outputs (tensor or tuple of tensors / None); everything else that stays
    allocated is what autograd keeps for the backward. Returns (held, result); the caller keeps
    or drops `result` (dropping it frees the saved tensors).
    """
    # Free what earlier calls left in reference cycles first: a previous autograd graph collected
    # during fn() would lower `after` (on an H200 this once reported 0.14 GiB for 1.4B-a, whose
    # saved tensors alone are 0.31 GiB).
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    outs = result if isinstance(result, (tuple, list)) else (result,)
    out_bytes = 0
    seen = set()
    for t in outs:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                out_bytes += storage.nbytes()
    return after - before - out_bytes, result


def matmul_tflops(size: int = 8192, *, sets: int = 3, min_reps: int = 20) -> tuple[float, Timing]:
    """Dense bf16 size^3 matmul through torch (cuBLAS) on random data, rotating `sets` pairs."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    pairs = [
        (
            torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen),
        )
        for _ in range(sets)
    ]
    # A longer warm-up: this is the first heavy work of the run, and the clocks must ramp up first.
    timing = cuda_time(torch.matmul, pairs, warmup=5, min_reps=min_reps, max_reps=100, target_s=0.3,
                       warmup_s=0.5)
    del pairs
    return 2.0 * size**3 / (timing.median_ms * 1e-3) / 1e12, timing


def copy_bandwidth(nbytes: int = 1 << 30, *, min_reps: int = 20) -> tuple[float, Timing]:
    """Device-to-device copy of nbytes (1 GiB >> L2); returns GB/s counting read + written bytes."""
    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    timing = cuda_time(lambda: dst.copy_(src), [()], warmup=3, min_reps=min_reps, max_reps=50,
                       target_s=0.2)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / (timing.median_ms * 1e-3) / 1e9, timing


def free_cuda_memory() -> None:
    """Return cached blocks between configs so that a large config starts from a clean pool."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
