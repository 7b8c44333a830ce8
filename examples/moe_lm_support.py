"""Support code for train_moe_lm.py: the text corpus, the batches, the experts profiler, the
DeepSeek-V3 routing-bias update and the report (loss-curve PNG and JSON summary).

Kept apart so that train_moe_lm.py reads as the training recipe itself.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Data: the Python standard library's own source, as bytes (vocabulary 256).
# Every Python installation has it, so the example needs no download and no tokenizer files.
# ---------------------------------------------------------------------------------------------


def load_stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's .py files, sorted by path and concatenated (each followed by a NUL
    byte), up to max_bytes. Returns a uint8 tensor [N] on the CPU; the same bytes on every machine
    with the same Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    # site-packages lives under the stdlib directory in many installs: it differs between
    # machines, so it is left out (as are the test suites' deliberately odd files).
    paths = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    chunks, total = [], 0
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\0")
        total += len(data) + 1
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise RuntimeError(f"the standard library under {root} holds only {total} bytes of .py "
                           "source; the example needs at least 64 KiB")
    corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    return torch.from_numpy(corpus.copy())


def batch_for_step(corpus: torch.Tensor, step: int, global_batch: int, seq: int, seed: int,
                   rank: int = 0, world: int = 1) -> torch.Tensor:
    """This rank's rows of step `step`'s global batch: int64 [global_batch // world, seq].

    The windows' start offsets depend only on (seed, step), so every implementation, every world
    size and every rerun sees the same tokens in the same order; rank r takes rows
    [r·B/W, (r+1)·B/W) of the global batch."""
    return _windows(corpus, np.random.default_rng([seed, step]), global_batch, seq, rank, world)


def _windows(corpus: torch.Tensor, rng: np.random.Generator, global_batch: int, seq: int, rank: int,
             world: int) -> torch.Tensor:
    """global_batch windows of seq bytes at offsets drawn from rng -> this rank's rows, int64
    [global_batch // world, seq]."""
    if global_batch % world:
        raise ValueError(f"--batch ({global_batch}) must be a multiple of the world size ({world})")
    starts = rng.integers(0, corpus.numel() - seq, size=global_batch)
    per_rank = global_batch // world
    return torch.stack([corpus[s:s + seq] for s in starts[rank * per_rank:(rank + 1) * per_rank]]).long()


def split_held_out(corpus: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held_out): the corpus's last `fraction` of bytes held out for evaluation, the rest
    to train on (contiguous, so no training window overlaps a held-out one)."""
    cut = int(corpus.numel() * (1 - fraction))
    return corpus[:cut], corpus[cut:]


def eval_batch(held_out: torch.Tensor, index: int, global_batch: int, seq: int, seed: int,
               rank: int = 0, world: int = 1) -> torch.Tensor:
    """Held-out batch `index`: the same windows for every implementation, step and rerun (their
    offsets depend on (seed, index) only, from a random stream of their own)."""
    if held_out.numel() <= seq:
        raise ValueError(f"the held-out part of the corpus ({held_out.numel()} bytes) is shorter than a "
                         f"sequence ({seq}): raise --corpus-mib")
    return _windows(held_out, np.random.default_rng([seed, index, 1]), global_batch, seq, rank, world)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3's auxiliary-loss-free balancing: the router picks experts by sigmoid score plus a
# per-expert bias (e_score_correction_bias, a buffer, not trained by the optimizer); after each
# step the bias of every overloaded expert goes down by `rate` and that of every underloaded one
# up by `rate`.
# ---------------------------------------------------------------------------------------------


class RoutingBiasUpdater:
    """Counts each router's selections over a step (forward hooks) and nudges its bias after it."""

    def __init__(self, model: torch.nn.Module, rate: float):
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = {}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs):
        top_k_index = outputs[2]                      # [T, K] expert ids of each token
        counts = torch.bincount(top_k_index.reshape(-1), minlength=router.num_experts)
        key = id(router)
        self.counts[key] = counts if key not in self.counts else self.counts[key] + counts

    @torch.no_grad()
    def update(self):
        for router in self.routers:
            counts = self.counts.pop(id(router), None)
            if counts is None:
                continue
            counts = counts.float()
            if torch.distributed.is_initialized():   # the load over all ranks' tokens
                torch.distributed.all_reduce(counts)
            bias = router.e_score_correction_bias
            bias += self.rate * torch.sign(counts.mean() - counts).to(bias.dtype)


# ---------------------------------------------------------------------------------------------
# Profiling: what share of a training step the routed experts take.
# Each experts module's forward and backward run inside a named profiler range, opened and closed
# by module hooks; the range's GPU time is the sum of the kernels launched inside it.
# ---------------------------------------------------------------------------------------------

EXPERTS_FORWARD = "moe_experts.forward"
EXPERTS_BACKWARD = "moe_experts.backward"


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routed-experts modules (the ones transformers dispatches through experts_implementation),
    and machmoe's fused blocks (fuse_moe), whose range then covers the whole block: router and
    shared experts included."""
    return [m for m in model.modules()
            if type(m).__name__ == "FusedSparseMoeBlock"
            or (type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj"))]


class ExpertsRanges:
    """Opens a profiler range around every experts module's forward and backward."""

    def __init__(self, model: torch.nn.Module):
        self.handles, self.open = [], {}
        for module in experts_modules(model):
            self.handles += [
                module.register_forward_pre_hook(lambda m, a: self._enter(m, EXPERTS_FORWARD)),
                module.register_forward_hook(lambda m, a, o: self._exit(m, EXPERTS_FORWARD)),
                module.register_full_backward_pre_hook(lambda m, g: self._enter(m, EXPERTS_BACKWARD)),
                module.register_full_backward_hook(lambda m, gi, go: self._exit(m, EXPERTS_BACKWARD)),
            ]

    def _enter(self, module, name):
        scope = torch.profiler.record_function(name)
        scope.__enter__()
        self.open[(id(module), name)] = scope

    def _exit(self, module, name):
        scope = self.open.pop((id(module), name), None)
        if scope is not None:
            scope.__exit__(None, None, None)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def experts_share(prof, on_gpu: bool, wall_s: float) -> dict:
    """From a finished torch.profiler run: the experts' time, the step's time and their ratio.

    The step's time is the wall time of the profiled steps (each ends in a host sync on its loss,
    so the GPU's queue is drained). On a GPU the experts' time is that of the kernels launched
    inside the experts ranges, on the CPU the ranges' CPU time. (Summing every op's own kernel
    time for the step's total over-counted it several times over with torch 2.11's profiler.)
    The backward range opens when the module's output gradient is ready and closes when its
    input gradients are, so autograd nodes of other branches that run in between (rare: the
    engine follows reverse creation order) count as experts time."""
    cpu = torch.autograd.DeviceType.CPU
    events = prof.events()
    # The host-side ranges (the GPU-side copies of the annotations would count twice).
    ranges = [e for e in events if e.name in (EXPERTS_FORWARD, EXPERTS_BACKWARD)
              and e.device_type == cpu]
    total_us = wall_s * 1e6
    if on_gpu:
        fwd_us = sum(e.device_time_total for e in ranges if e.name == EXPERTS_FORWARD)
        bwd_us = sum(e.device_time_total for e in ranges if e.name == EXPERTS_BACKWARD)
    else:
        fwd_us = sum(e.cpu_time_total for e in ranges if e.name == EXPERTS_FORWARD)
        bwd_us = sum(e.cpu_time_total for e in ranges if e.name == EXPERTS_BACKWARD)
    return {
        "basis": "the steps' wall time",
        "experts_forward_ms": fwd_us / 1e3,
        "experts_backward_ms": bwd_us / 1e3,
        "step_total_ms": total_us / 1e3,
        "experts_share": (fwd_us + bwd_us) / total_us if total_us > 0 else float("nan"),
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def format_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def write_report(out_dir: str, runs: dict, meta: dict) -> tuple[str, str]:
    """Writes summary.json (meta + per implementation: tokens/s, peak memory, final loss, the
    loss curve, the held-out losses if measured) and loss_curve.png into out_dir; returns their
    paths."""
    os.makedirs(out_dir, exist_ok=True)
    summary = {"meta": meta, "implementations": runs}
    json_path = os.path.join(out_dir, "summary.json")
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2)

    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, run in runs.items():
        steps = range(1, len(run["losses"]) + 1)
        label = f"{name}: {run['tokens_per_s']:,.0f} tok/s, peak {format_bytes(run['peak_memory_bytes'])}"
        line, = ax.plot(steps, run["losses"], label=label, linewidth=1.2)
        if run.get("held_out"):  # held-out losses as markers in the run's colour
            ax.plot([e["step"] for e in run["held_out"]], [e["loss"] for e in run["held_out"]], "o",
                    color=line.get_color(), markersize=4, label=f"{name}: held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("language-model loss (nats per byte)")
    ax.set_title(f"{meta['model']} ({meta['preset']}), {meta['device']}, world {meta['world_size']}")
    ax.axhline(math.log(256), color="gray", linestyle=":", linewidth=0.8)  # uniform over bytes
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = os.path.join(out_dir, "loss_curve.png")
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path
