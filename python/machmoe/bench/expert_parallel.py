"""Expert parallelism on the GPUs of one host (a measurement, not the main job):

  python -m machmoe.bench.expert_parallel [--configs 7B-a,30B-b] [--world W] [--reps 20] [--profile]
                                          [--exchange all_gather,all_to_all,all_to_all_capacity] [--out DIR]
  python -m machmoe.bench.expert_parallel --exchange all_to_all_device,all_to_all_capacity
  python -m machmoe.bench.expert_parallel --precision fp8 --exchange all_gather
  python -m machmoe.bench.expert_parallel --graph --exchange all_gather

Each of W ranks (NCCL, one GPU each) holds a whole config's batch of T tokens and E / W experts;
`machmoe.distributed.ExpertParallelMoE` trains the layer with tokens exchanged (each --exchange, the
all-gather one with max_tokens = T). Beside
it, in the same processes, the single-GPU layer (all E experts on every GPU, no exchange) on the
same batch: the bound an exchange can only add to. Forward + backward per call; TFLOPS per rank
on the benchmark's convention (6·T·K·n·d forward, the work of T tokens), so the two columns compare directly. Also the
bytes each rank sends per forward (rows of x out, partial sums back), the host's time to issue
one call (above the device's time per call, the host bounds the loop) and the peak memory.

all_to_all_device (the all-to-all's rows with their counts on the device, max_tokens = T and
capacity_factor 1) moves its rows by the pull_rows kernel through the same symmetric-memory
staging buffer as all_gather's copy-engine collectives: both run in one call.

--graph times both layers' forward + backward captured in a CUDA graph and replayed (the host's
cost per call then is one replay: what a training step captured whole pays), for the exchanges
without a host sync.

--precision fp8 runs both layers' experts in FP8 (exchange all_gather only: the FP8 experts' calls
are whole, so the sharded layer's transfers are not overlapped with them).

--profile adds, per config, rank 0's GPU time per call by kernel and by autograd op
(torch.profiler over 5 calls), for the single-GPU layer and the expert-parallel one.

Every rank runs a fixed number of calls in lockstep (the layer runs collectives), timed by CUDA
events around the whole loop; the figure is the slowest rank's. With --out DIR the table is also
written to DIR/expert_parallel.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .configs import layer_flops, select_configs, tflops


def _host_ms(step, calls: int = 5) -> float:
    """The host's time to issue one call from an idle GPU (median of `calls`), slowest rank: when
    it is above the device's time per call, the host bounds the loop. A call that waits for the
    device (the all-to-all exchange's row counts) includes that wait."""
    times = []
    for _ in range(calls):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    ms = torch.tensor([sorted(times)[len(times) // 2]], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _graphed(step, warmup: int = 3):
    """step captured in a CUDA graph (after warm-up calls on a side stream, which create the
    gradients the captured backward accumulates into): a callable that replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _loop_ms(step, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    dist.barrier()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    stop.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(stop) / reps], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _host_during(cpu_events, start: float, stop: float, top: int = 3) -> str:
    """The innermost host ops that ran during [start, stop] (us, the profiler's clock), with how
    long each overlapped it: what the host was doing while the device had nothing queued."""
    overlap, phases = {}, {}
    for e in cpu_events:
        t = min(stop, e.time_range.end) - max(start, e.time_range.start)
        if t <= 0:
            continue
        if e.name.startswith("ep.") or e.name.endswith("Backward"):  # the layer's phases
            phases[e.name] = phases.get(e.name, 0.0) + t
        if not e.cpu_children:
            overlap[e.name] = overlap.get(e.name, 0.0) + t
    best = sorted(overlap.items(), key=lambda kv: kv[1], reverse=True)[:top]
    where = sorted(phases.items(), key=lambda kv: kv[1], reverse=True)[:2]
    return (", ".join(f"{name[:40]} {t:.0f}" for name, t in best) or "python only") + \
        (" [in " + ", ".join(f"{name[:30]} {t:.0f}" for name, t in where) + "]" if where else "")


def _print_idle(prof, calls: int, top: int = 8) -> None:
    """Where the device sat idle between the first and the last device activity: the total per
    call and the longest gaps, each with the activities on either side and the host ops (leaves
    of the op tree) that ran during it."""
    events = prof.events()
    # (user annotations such as the layer's ep.* ranges also appear on the device's timeline,
    # spanning their kernels and the gaps between them: not device activity)
    acts = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False) and not e.name.startswith("ep.")),
                  key=lambda e: e.time_range.start)
    if not acts:
        return
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    gaps, end, last = [], acts[0].time_range.end, acts[0]
    for e in acts[1:]:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, last.name, e.name, end, e.time_range.start))
        if e.time_range.end > end:
            end, last = e.time_range.end, e
    span = (end - acts[0].time_range.start) / calls / 1e3
    idle = sum(g[0] for g in gaps) / calls / 1e3
    print(f"  device span {span:.3f} ms per call, idle {idle:.3f} ms; longest gaps (us, after -> before;"
          f" host: its innermost ops during the gap, us):")
    for g, before, after, g0, g1 in sorted(gaps, reverse=True)[:top]:
        print(f"    {g:8.1f}  {before[:40]} -> {after[:40]}\n              host: {_host_during(cpu, g0, g1)}")


def _profile(name: str, step, rank: int, calls: int = 5) -> None:
    """rank 0 prints the GPU time per call of the kernels and of the ops that launched them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    dist.barrier()
    if rank:
        return
    print(f"\n{name} (rank 0, {calls} calls; ms per call; a kernel's time shows on its own row and "
          f"again on the op that launched it)")
    _print_idle(prof, calls)
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)
    for e in rows[:40]:
        if e.self_device_time_total:
            print(f"  self {e.self_device_time_total / calls / 1e3:7.3f}  x{e.count // calls:<3} {e.key[:96]}")
    ops = sorted((e for e in events if e.key.startswith(("experts_", "aten::", "machmoe::", "c10d::", "nccl:",
                                                           "autograd::", "_")) and e.device_time_total),
                 key=lambda e: e.device_time_total, reverse=True)
    for e in ops[:16]:
        print(f"  incl {e.device_time_total / calls / 1e3:7.3f}  x{e.count // calls:<3} {e.key[:96]}")
    # Host time in CUDA runtime calls: where the host blocks (synchronisations, blocking copies,
    # cudaMalloc) and the device, having run out of queued work, sits idle.
    runtime = sorted((e for e in events if e.key.startswith("cuda")), key=lambda e: e.cpu_time_total,
                     reverse=True)
    for e in runtime[:8]:
        print(f"  host {e.cpu_time_total / calls / 1e3:7.3f}  x{e.count // calls:<3} {e.key[:96]}")
    # Host time per phase: the forward's ep.* ranges, the layer ops and the backward's autograd
    # nodes (a device waiting on the host waits on these).
    phases = sorted((e for e in events if e.key.startswith(("ep.", "machmoe::layer", "machmoe::experts",
                                                               "autograd::engine::evaluate_function"))),
                    key=lambda e: e.cpu_time_total, reverse=True)
    for e in phases[:16]:
        print(f"  phase host {e.cpu_time_total / calls / 1e3:7.3f}  x{e.count // calls:<3} {e.key[:90]}")


# --exchange names -> ExpertParallelMoE settings (max_tokens = the config's T where it is True).
EXCHANGE_SETTINGS = {
    "all_gather": (dict(exchange="all_gather"), True),
    "all_to_all": (dict(exchange="all_to_all"), False),  # exact rows, one host sync a forward
    "all_to_all_capacity": (dict(exchange="all_to_all"), True),  # fixed blocks, no host sync
    "all_to_all_device": (dict(exchange="all_to_all_device"), True),  # exact rows, counts on the device
    # the experts sized for 1.25x a balanced rank's pairs (capacity_factor 1.25 / W, set per run)
    "all_gather_capacity": (dict(exchange="all_gather", capacity_factor=None), True),
}


def _settings_for(settings: dict, world: int) -> dict:
    """The settings with a capacity_factor of None made 1.25 / W (at most 1)."""
    if settings.get("capacity_factor", 1.0) is None:
        return {**settings, "capacity_factor": min(1.0, 1.25 / world)}
    return settings


def _variants(exchanges: list[str]) -> list[tuple[str, dict, bool]]:
    """(label, ExpertParallelMoE settings, whether max_tokens = T is given) per exchange."""
    return [(name,) + EXCHANGE_SETTINGS[name] for name in exchanges]


def _run(rank: int, world: int, init_file: str, configs: list, reps: int, warmup: int,
         profile_calls: bool = False, out_dir: str | None = None,
         variants: list | None = None, precision: str = "bf16", graph: bool = False) -> None:
    from machmoe import MoE
    from machmoe.distributed import ExpertParallelMoE

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    table: list[str] = []  # rank 0's lines, for --out

    def say(line: str) -> None:
        print(line, flush=True)
        table.append(line)

    try:
        if rank == 0:
            say(f"expert parallelism over {world} x {torch.cuda.get_device_name()} (NCCL); "
                f"forward + backward, {reps} calls after {warmup}, slowest rank; experts in {precision}"
                + ("; each call one CUDA graph replay" if graph else ""))
            say("")
            say("| config | exchange | T per rank | E per rank | single GPU ms (TFLOPS) | expert parallel ms "
                "(TFLOPS) | ratio | host ms per call (single / EP) | MB sent per rank per forward | "
                "peak GiB (single / EP) |")
            say("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
        for cfg in configs:
            torch.manual_seed(0)
            with torch.device("cuda"):  # drawn on the GPU: DeepSeek-V3's 45 GB of fp32 takes minutes on the CPU
                full = MoE(cfg.E, cfg.K, cfg.d, cfg.n, precision=precision).bfloat16()
            gen = torch.Generator(device="cuda").manual_seed(1 + rank)
            x = torch.randn(cfg.T, cfg.d, device="cuda", generator=gen).bfloat16().requires_grad_(True)
            dout = torch.randn(cfg.T, cfg.d, device="cuda", generator=gen).bfloat16()

            def step(model):
                out, _ = model(x)
                out.backward(dout)

            torch.cuda.reset_peak_memory_stats()
            single_step = _graphed(lambda: step(full)) if graph else (lambda: step(full))
            single_ms = _loop_ms(single_step, reps, warmup)
            single_peak = torch.cuda.max_memory_allocated()
            single_host = _host_ms(single_step)
            del single_step
            full.zero_grad(set_to_none=True)
            flop = sum(layer_flops(cfg.T, cfg.K, cfg.n, cfg.d))
            for label, settings, bounded in variants:
                layer = ExpertParallelMoE.from_moe(full, max_tokens=cfg.T if bounded else None,
                                                   **_settings_for(settings, world))
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                ep_step = _graphed(lambda: step(layer)) if graph else (lambda: step(layer))
                ep_ms = _loop_ms(ep_step, reps, warmup)
                ep_peak = torch.cuda.max_memory_allocated()
                ep_host = _host_ms(ep_step)
                del ep_step
                # Rows this rank sends, there and back, d bf16 each: all-to-all one per (token,
                # owning rank); all-gather every token to every other rank.
                with torch.no_grad():
                    logits = x.float() @ layer.router.weight.float().T
                    top = logits.topk(cfg.K, dim=1).indices // (cfg.E // world)  # [T, K] owning rank
                    owners = torch.zeros(cfg.T, world, dtype=torch.bool, device="cuda")
                    owners.scatter_(1, top, True)
                    # all-to-all with max_tokens sends whole blocks of T rows, filled or not.
                    rows = owners.sum() - owners[:, rank].sum() if label in ("all_to_all", "all_to_all_device") \
                        else torch.tensor(cfg.T * (world - 1), device="cuda")
                    sent = torch.tensor([float(rows * cfg.d * 2 * 2)], device="cuda")
                dist.all_reduce(sent, op=dist.ReduceOp.MAX)
                if rank == 0:
                    say(f"| {cfg.name} | {label} | {cfg.T} | {cfg.E // world} | {single_ms:.3f} "
                        f"({tflops(flop, single_ms):.0f}) | {ep_ms:.3f} ({tflops(flop, ep_ms):.0f}) | "
                        f"{single_ms / ep_ms:.2f} | {single_host:.2f} / {ep_host:.2f} | {float(sent) / 1e6:.0f} | "
                        f"{single_peak / 2**30:.2f} / {ep_peak / 2**30:.2f} |")
                del layer
            del full
            if profile_calls:
                with torch.device("cuda"):
                    full = MoE(cfg.E, cfg.K, cfg.d, cfg.n, precision=precision).bfloat16()
                label, settings, bounded = variants[0]
                layer = ExpertParallelMoE.from_moe(full, max_tokens=cfg.T if bounded else None,
                                                   **_settings_for(settings, world))
                _profile(f"{cfg.name} single GPU", lambda: step(full), rank)
                _profile(f"{cfg.name} expert parallel ({label}), W = {world}", lambda: step(layer), rank)
                del full, layer
            del x, dout
            torch.cuda.empty_cache()
        if rank == 0 and out_dir:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, "expert_parallel.md")
            with open(path, "w") as f:
                f.write("\n".join(table) + "\n")
            print(f"wrote {path}")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m machmoe.bench.expert_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="7B-a,30B-b", help="comma-separated config names")
    parser.add_argument("--world", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--T-scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also print rank 0's kernels and ops per call")
    parser.add_argument("--exchange", default="all_gather,all_to_all_capacity",
                        help="comma-separated exchanges to time: all_gather, all_to_all_capacity and "
                             "all_to_all_device (max_tokens = T: no host sync), all_to_all (exact rows, a host sync)")
    parser.add_argument("--out", default=None, metavar="DIR", help="also write the table to DIR/expert_parallel.md")
    parser.add_argument("--graph", action="store_true",
                        help="time each layer's forward + backward as one CUDA graph replay (exchanges without a "
                             "host sync)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                        help="the experts' precision in both layers (fp8: --exchange all_gather only)")
    args = parser.parse_args(argv)
    try:
        configs = select_configs(args.configs, args.T_scale)
    except ValueError as err:
        parser.error(f"--configs: {err}")
    exchanges = args.exchange.split(",")
    for exchange in exchanges:
        if exchange not in EXCHANGE_SETTINGS:
            parser.error(f"--exchange: {exchange!r} is not one of {', '.join(EXCHANGE_SETTINGS)}")
    variants = _variants(exchanges)
    if args.graph and any(not bounded for _, _, bounded in variants):
        parser.error("--graph needs exchanges without a host sync (all_to_all without max_tokens has one)")
    if args.precision == "fp8" and exchanges != ["all_gather"]:
        parser.error(f"--precision fp8 runs with --exchange all_gather only; got {args.exchange!r}")
    if not torch.cuda.is_available():
        print("expert_parallel: no CUDA GPU; nothing to measure")
        return
    world = args.world or torch.cuda.device_count()
    if not 1 <= world <= torch.cuda.device_count():
        raise SystemExit(f"--world must be in [1, {torch.cuda.device_count()}] (GPUs here); got {world}")
    for cfg in configs:
        if cfg.E % world:
            raise SystemExit(f"{cfg.name}: E = {cfg.E} is not a multiple of --world {world}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(world, os.path.join(tmp, "init"), configs, args.reps, args.warmup, args.profile,
                             args.out, variants, args.precision, args.graph), nprocs=world, join=True)


if __name__ == "__main__":
    main()
