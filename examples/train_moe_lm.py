"""Train a 2026-style MoE language model from scratch and compare expert implementations.

The model is Hugging Face transformers' own architecture, built from a config with random weights:
`Qwen3MoeForCausalLM` (softmax router, top-K, renormalised, load-balancing loss) or
`DeepseekV3ForCausalLM` (a shared expert beside the routed ones, sigmoid scores plus a selection
bias, group-limited top-K, routed scaling; the bias balanced without an auxiliary loss). The
routed experts run through transformers' `experts_implementation`:

    eager       transformers' loop over experts (one small GEMM pair per expert)
    grouped_mm  transformers' grouped GEMMs (torch.nn.functional.grouped_mm)
    machmoe     machmoe's fused Hopper kernels, registered by `import machmoe.integrations.transformers`
    machmoe-fused  machmoe's whole MoE block (router, routing, experts in one call) through
                `machmoe.integrations.transformers.fuse_moe`, on the same parameters
    machmoe-fp8    the same fused blocks with the routed experts' GEMMs in FP8 (precision="fp8")

The text is the Python standard library's source on this machine, read as bytes (vocabulary 256):
nothing is downloaded, the seed is fixed and the batches depend only on (seed, step).

    # one GPU (bf16) or the CPU (fp32), a model the size of a small test:
    python examples/train_moe_lm.py --preset tiny --experts grouped_mm
    # two implementations from the same seed and data; loss_curve.png and summary.json in --out:
    python examples/train_moe_lm.py --preset 7b-a --compare grouped_mm,machmoe --out runs/7b-a
    # what share of a step the experts take (torch.profiler):
    python examples/train_moe_lm.py --preset qwen3-30b-a3b --experts machmoe --profile --out runs/q
    # FSDP2 over the GPUs of one host (fully_shard per decoder layer, bf16 compute, fp32 master):
    torchrun --nproc_per_node=8 examples/train_moe_lm.py --preset deepseek-v3-small --batch 16

Every preset value can be overridden by its flag (`--layers 2 --num-experts 64 ...`);
`--help` lists them. Exit status 2: the requested implementation is not available.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_lm_support import (  # noqa: E402  (the module beside this file)
    ExpertsRanges, RoutingBiasUpdater, batch_for_step, eval_batch, experts_share, format_bytes,
    load_stdlib_corpus, split_held_out, write_report)

IMPLEMENTATIONS = ("machmoe", "machmoe-fused", "machmoe-fp8", "grouped_mm", "eager")

# Shapes: hidden d, moe_intermediate n, num_experts E, top_k K; tokens per step = batch * seq.
# Attention is kept small beside the experts (few heads, sdpa): the experts are what is compared.
PRESETS = {
    # A CPU runs this in about a minute (--cpu-threads 1 on a busy machine).
    "tiny": dict(model="qwen3-moe", layers=2, hidden=64, moe_intermediate=32, num_experts=8,
                 top_k=2, heads=4, kv_heads=2, head_dim=16, seq=128, batch=8, steps=40,
                 lr=3e-3, lr_warmup=0),
    # The layer of the benchmark's 7B-a config: 24576 tokens a step.
    "7b-a": dict(model="qwen3-moe", layers=8, hidden=1536, moe_intermediate=256, num_experts=128,
                 top_k=8, heads=12, kv_heads=4, head_dim=128, seq=4096, batch=6, steps=60,
                 lr=1e-3, lr_warmup=10),
    # Qwen3-30B-A3B's MoE layer (48 layers in the real model; 4 here so that one GPU holds it),
    # 24576 tokens a step as 7b-a.
    "qwen3-30b-a3b": dict(model="qwen3-moe", layers=4, hidden=2048, moe_intermediate=768,
                          num_experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128,
                          seq=4096, batch=6, steps=40, lr=6e-4, lr_warmup=10),
    # DeepSeek-V3's routing (256 experts in 8 groups, top-4 groups, top-8, one shared expert,
    # routed scaling 2.5, first layer dense) at a small width, on a CPU.
    "deepseek-v3-tiny": dict(model="deepseek-v3", layers=3, hidden=64, moe_intermediate=32,
                             num_experts=16, top_k=4, n_group=4, topk_group=2, heads=4,
                             kv_heads=4, head_dim=16, seq=128, batch=8, steps=40, lr=3e-3,
                             lr_warmup=0),
    # The same routing at GPU size: d 1024, n 256 (DeepSeek-V3's n/d ratio), 256 experts.
    "deepseek-v3-small": dict(model="deepseek-v3", layers=8, hidden=1024, moe_intermediate=256,
                              num_experts=256, top_k=8, n_group=8, topk_group=4, heads=8,
                              kv_heads=8, head_dim=128, seq=4096, batch=6, steps=60, lr=1e-3,
                              lr_warmup=10),
}
DEFAULTS = dict(n_group=1, topk_group=1, shared_experts=1, first_dense=1, routed_scaling=2.5,
                aux_loss_coef=1e-3, bias_update_rate=1e-3, dense_intermediate=None)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--experts", choices=IMPLEMENTATIONS, default="grouped_mm",
                   help="transformers experts_implementation for the routed experts")
    p.add_argument("--compare", metavar="A,B", help="run these implementations one after the "
                   "other from the same seed and data, and write the report to --out")
    p.add_argument("--out", help="directory for summary.json, loss_curve.png, profile tables")
    p.add_argument("--profile", action="store_true", help="after training, profile "
                   "--profile-steps more steps and report the experts' share of a step")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-mib", type=float, default=48.0, help="bytes of stdlib source read")
    p.add_argument("--log-every", type=int, default=0, help="0: about 20 lines per run")
    p.add_argument("--eval-batches", type=int, default=0,
                   help="held-out batches (the corpus's last 5%%, then not trained on) whose mean loss is "
                        "measured every --eval-every steps and after the last; 0: no evaluation")
    p.add_argument("--eval-every", type=int, default=0, help="0: only after the last step")
    p.add_argument("--eval-other-precision", action="store_true",
                   help="machmoe-fused / machmoe-fp8: also measure each held-out loss with the fused "
                        "blocks' routed experts in the other precision (bf16 <-> fp8), which separates "
                        "what evaluating in a precision costs from what training in it does")
    p.add_argument("--skip-timing", type=int, default=2,
                   help="first steps left out of tokens/s (allocator and kernel warm-up)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="compute dtype; auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--cpu-threads", type=int, default=0, help="torch's CPU threads (0: its "
                   "default); 1 runs the tiny presets fastest on a CPU shared with other work")
    knobs = p.add_argument_group("model and training (default: the preset's value)")
    for name, kind, what in [
        ("model", str, "qwen3-moe | deepseek-v3"), ("layers", int, "decoder layers"),
        ("hidden", int, "hidden size d"), ("moe-intermediate", int, "expert intermediate size n"),
        ("num-experts", int, "routed experts E"), ("top-k", int, "experts per token K"),
        ("heads", int, "attention heads"), ("kv-heads", int, "key/value heads (qwen3-moe)"),
        ("head-dim", int, "attention head size"), ("seq", int, "tokens per sequence"),
        ("batch", int, "sequences per step, over all ranks"), ("steps", int, "optimizer steps"),
        ("lr", float, "AdamW peak learning rate"), ("lr-warmup", int, "linear warm-up steps"),
        ("n-group", int, "deepseek-v3: expert groups"),
        ("topk-group", int, "deepseek-v3: groups a token may route to"),
        ("shared-experts", int, "deepseek-v3: shared experts"),
        ("first-dense", int, "deepseek-v3: leading layers with a dense MLP"),
        ("routed-scaling", float, "deepseek-v3: routed scaling factor"),
        ("dense-intermediate", int, "deepseek-v3: dense MLP size (default 4n)"),
        ("aux-loss-coef", float, "qwen3-moe: load-balancing loss weight (0: off)"),
        ("bias-update-rate", float, "deepseek-v3: selection-bias step per optimizer step"),
    ]:
        knobs.add_argument(f"--{name}", type=kind, default=None, help=what)
    args = p.parse_args(argv)
    for key, value in {**DEFAULTS, **PRESETS[args.preset]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model not in ("qwen3-moe", "deepseek-v3"):
        p.error(f"--model must be qwen3-moe or deepseek-v3, got {args.model!r}")
    args.implementations = args.compare.split(",") if args.compare else [args.experts]
    for name in args.implementations:
        if name not in IMPLEMENTATIONS:
            p.error(f"--compare: {name!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if len(set(args.implementations)) != len(args.implementations):
        p.error(f"--compare names an implementation twice: {args.compare}")
    if args.model == "deepseek-v3" and args.num_experts % args.n_group:
        p.error(f"--num-experts ({args.num_experts}) must be a multiple of --n-group ({args.n_group})")
    if args.log_every <= 0:
        args.log_every = max(1, args.steps // 20)
    return args


def require_experts_implementation(name: str) -> None:
    """transformers is needed for every implementation; machmoe's exists once its transformers
    integration is imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("train_moe_lm.py needs Hugging Face transformers 5.x (pip install 'transformers>=5.17').",
              file=sys.stderr)
        sys.exit(2)
    if not name.startswith("machmoe"):
        return
    try:
        import machmoe.integrations.transformers as integration
    except ImportError as error:
        print(f"--experts machmoe: machmoe.integrations.transformers could not be imported "
              f"({error}). Install machmoe (or put its python/ directory on PYTHONPATH) with its "
              "transformers integration, or pick --experts grouped_mm or eager.", file=sys.stderr)
        sys.exit(2)
    if hasattr(integration, "register"):
        integration.register()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if "machmoe" not in ALL_EXPERTS_FUNCTIONS:
        print("--experts machmoe: machmoe.integrations.transformers imported but registered no "
              "'machmoe' experts implementation.", file=sys.stderr)
        sys.exit(2)


def build_config(args):
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    common = dict(vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, moe_intermediate_size=args.moe_intermediate,
                  num_experts_per_tok=args.top_k, max_position_embeddings=args.seq,
                  hidden_act="silu", tie_word_embeddings=False, use_cache=False, norm_topk_prob=True,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if args.model == "qwen3-moe":
        return Qwen3MoeConfig(**common, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                              num_experts=args.num_experts,
                              intermediate_size=args.dense_intermediate or 4 * args.moe_intermediate,
                              output_router_logits=args.aux_loss_coef > 0,
                              router_aux_loss_coef=args.aux_loss_coef)
    # Multi-head latent attention with DeepSeek-V3's proportions (rope half the nope size, the
    # latent four heads wide) but no query compression: cheap beside the experts.
    return DeepseekV3Config(**common, num_key_value_heads=args.heads, n_routed_experts=args.num_experts,
                            n_shared_experts=args.shared_experts, n_group=args.n_group,
                            topk_group=args.topk_group, routed_scaling_factor=args.routed_scaling,
                            first_k_dense_replace=args.first_dense,
                            intermediate_size=args.dense_intermediate or 4 * args.moe_intermediate,
                            q_lora_rank=None, kv_lora_rank=4 * args.head_dim,
                            qk_nope_head_dim=args.head_dim, qk_rope_head_dim=args.head_dim // 2,
                            v_head_dim=args.head_dim)


class Distributed:
    """The process group under torchrun (or one a caller initialised); rank 0 of 1 otherwise."""

    def __init__(self, device_kind: str):
        if not torch.distributed.is_initialized() and "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group("nccl" if device_kind == "cuda" else "gloo")
        self.active = torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self.active else 0
        self.world = torch.distributed.get_world_size() if self.active else 1
        if device_kind == "cuda":
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks (each rank holds the same number of tokens)."""
        if self.active:
            torch.distributed.all_reduce(value)   # a sum: gloo has no average
            value /= self.world
        return value

    def max(self, value: float) -> float:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.item()


def compute_dtype_of(args, dist: Distributed) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def fused_blocks(model) -> list:
    """The model's blocks fused by machmoe (machmoe-fused, machmoe-fp8), in module order."""
    from machmoe.integrations.transformers import FusedSparseMoeBlock
    return [m for m in model.modules() if isinstance(m, FusedSparseMoeBlock)]


@contextlib.contextmanager
def experts_precision(blocks: list, precision):
    """The fused blocks' routed experts in `precision` inside the block, as trained after it."""
    saved = [(b.precision, b.__dict__.get("fp8_cache")) for b in blocks]
    try:
        for b in blocks:
            b.precision = precision
            if precision.value == "fp8" and b.__dict__.get("fp8_cache") is None:
                from machmoe import fp8_layer
                b.fp8_cache = fp8_layer.new_cache()
        yield
    finally:
        for b, (precision_was, cache) in zip(blocks, saved):
            b.precision = precision_was
            if cache is None:
                b.__dict__.pop("fp8_cache", None)


def build_model(args, implementation: str, dist: Distributed):
    """The model with the same random weights for every implementation (the seed is reset here).

    One device: parameters in the compute dtype (bf16 on a GPU; the routers' weights and
    selection biases stay fp32, as transformers keeps them). FSDP2 (a process group is active):
    fp32 parameters sharded per decoder layer, gathered in the compute dtype for the forward and
    backward, gradients reduced in fp32."""
    from transformers import AutoModelForCausalLM
    compute_dtype = compute_dtype_of(args, dist)
    dtype = torch.float32 if dist.active else compute_dtype
    torch.manual_seed(args.seed)
    with dist.device:
        model = AutoModelForCausalLM.from_config(build_config(args), dtype=dtype,
                                                 attn_implementation="sdpa",
                                                 experts_implementation=implementation.split("-")[0])
    if implementation in ("machmoe-fused", "machmoe-fp8"):
        from machmoe.integrations.transformers import fuse_moe
        # in place, same parameters; unfused blocks keep machmoe's (bf16) experts
        report = fuse_moe(model, precision="fp8" if implementation == "machmoe-fp8" else "bf16")
        if dist.rank == 0 and report.unfused:
            print(f"{implementation}: {len(report.unfused)} block(s) not fused: "
                  f"{next(iter(report.unfused.values()))}", file=sys.stderr)
    if dist.active:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        # DeepSeek-V3's routers score in fp32 from fp32 weights (transformers keeps them fp32 in
        # a bf16 model): their own FSDP unit gathers them in fp32.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            for module in layer.modules():
                if hasattr(module, "e_score_correction_bias"):
                    fully_shard(module, mp_policy=fp32)
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    return model.train()


def peak_memory(dist: Distributed, all_ranks: bool = True) -> tuple[int, str]:
    """The peak so far: the largest over the ranks (a collective: every rank must call it), or
    with all_ranks=False this rank's."""
    if dist.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dist.device)
        return int(dist.max(peak) if all_ranks else peak), "CUDA allocated"
    # Linux reports kilobytes; the process's peak, so it includes earlier runs of --compare.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def progress_line(implementation, step, steps, loss, tokens_per_s, peak) -> str:
    done = int(20 * step / steps)
    return (f"[{implementation:>10}] {'#' * done}{'.' * (20 - done)} step {step:>{len(str(steps))}}"
            f"/{steps} | loss {loss:.4f} | {tokens_per_s:>11,.0f} tok/s | peak {format_bytes(peak)}")


def train(args, implementation: str, dist: Distributed, corpus: torch.Tensor) -> dict:
    """Trains one model for args.steps steps; returns its losses, tokens/s and peak memory."""
    gc.collect()                  # the previous run's model (its hooks make reference cycles)
    if dist.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dist.device)
    model = build_model(args, implementation, dist)
    # fused: one kernel per parameter group on a GPU instead of a pass per AdamW term (with the
    # foreach kernels the optimizer step took a fifth of a 30B-A3B-shaped step).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=dist.device.type == "cuda")
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.lr_warmup) if args.lr_warmup else 1.0)
    bias_updater = RoutingBiasUpdater(model, args.bias_update_rate) \
        if args.model == "deepseek-v3" and args.bias_update_rate > 0 else None
    tokens_per_step = args.batch * args.seq               # over all ranks
    # With held-out batches the training windows come from the rest of the corpus only.
    train_corpus, held_out = split_held_out(corpus, 0.05) if args.eval_batches else (corpus, None)

    fused = fused_blocks(model)
    trained_in = fused[0].precision if fused else None
    other = None
    if args.eval_other_precision and trained_in is not None:
        from machmoe.enums import Precision
        other = Precision.BF16 if trained_in == Precision.FP8 else Precision.FP8

    @torch.no_grad()
    def evaluate() -> float:
        """The mean language-model loss over the held-out batches, the model in eval mode."""
        model.eval()
        total = 0.0
        for i in range(args.eval_batches):
            input_ids = eval_batch(held_out, i, args.batch, args.seq, args.seed,
                                   dist.rank, dist.world).to(dist.device, non_blocking=True)
            out = model(input_ids=input_ids, labels=input_ids)
            aux_loss = getattr(out, "aux_loss", None)
            lm_loss = out.loss if aux_loss is None else out.loss - args.aux_loss_coef * aux_loss
            total += dist.mean(lm_loss.detach().float()).item()
        model.train()
        return total / args.eval_batches

    def evaluate_in(precision) -> float:
        """evaluate() with the fused blocks' routed experts switched to `precision` (the same
        weights; FP8 makes its own copies of them), then switched back."""
        with experts_precision(fused, precision):
            return evaluate()

    def step(index: int) -> torch.Tensor:
        input_ids = batch_for_step(train_corpus, index, args.batch, args.seq, args.seed,
                                   dist.rank, dist.world).to(dist.device, non_blocking=True)
        out = model(input_ids=input_ids, labels=input_ids)  # labels shifted inside the model
        # out.loss includes the load-balancing term; the curve shows the language-model loss.
        aux_loss = getattr(out, "aux_loss", None)         # Qwen3-MoE's, when enabled
        lm_loss = out.loss if aux_loss is None else out.loss - args.aux_loss_coef * aux_loss
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if bias_updater is not None:
            bias_updater.update()
        return dist.mean(lm_loss.detach().float())

    losses, evals, other_evals, timed_s, timed_steps = [], [], [], 0.0, 0
    for index in range(args.steps):
        start = time.perf_counter()
        loss = step(index).item()                           # .item() waits for the GPU
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if args.eval_batches and ((args.eval_every and (index + 1) % args.eval_every == 0)
                                  or index + 1 == args.steps):
            evals.append((index + 1, evaluate()))           # outside the timed region
            if other is not None:
                other_evals.append((index + 1, evaluate_in(other)))
            if dist.rank == 0:
                also = f" ({other_evals[-1][1]:.4f} with {other.value} experts)" if other is not None else ""
                print(f"[{implementation:>10}] step {index + 1}: held-out loss {evals[-1][1]:.4f}{also} "
                      f"over {args.eval_batches} batches", flush=True)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{implementation}: loss is {loss} at step {index + 1}")
        if index >= args.skip_timing:
            timed_s, timed_steps = timed_s + elapsed, timed_steps + 1
        if dist.rank == 0 and ((index + 1) % args.log_every == 0 or index + 1 == args.steps):
            rate = tokens_per_step * (timed_steps / timed_s if timed_steps else 1 / elapsed)
            print(progress_line(implementation, index + 1, args.steps, loss, rate,
                                peak_memory(dist, all_ranks=False)[0]), flush=True)
    peak, peak_kind = peak_memory(dist)
    result = {
        "losses": losses, "final_loss": losses[-1],
        "tokens_per_s": tokens_per_step * timed_steps / timed_s if timed_steps else float("nan"),
        "step_s": timed_s / timed_steps if timed_steps else float("nan"),
        "peak_memory_bytes": peak, "peak_memory_kind": peak_kind,
        "parameters": sum(p.numel() for p in model.parameters()),  # FSDP2's DTensors: global sizes
    }
    if evals:
        result["held_out"] = [{"step": s_, "loss": v} for s_, v in evals]
        result["final_held_out_loss"] = evals[-1][1]
    if other_evals:
        result["held_out_other_precision"] = {
            "precision": other.value, "losses": [{"step": s_, "loss": v} for s_, v in other_evals]}
    if args.profile:
        result["profile"] = profile(args, implementation, model, step, dist)
    return result


def profile(args, implementation, model, step, dist: Distributed) -> dict:
    """Runs --profile-steps more training steps under torch.profiler; returns the experts' share."""
    on_gpu = dist.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ranges = ExpertsRanges(model)
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        start = time.perf_counter()
        for index in range(args.steps, args.steps + args.profile_steps):
            step(index).item()
        wall_s = time.perf_counter() - start
    ranges.remove()
    share = experts_share(prof, on_gpu, wall_s)
    if dist.rank == 0:
        print(f"[{implementation:>10}] profile over {args.profile_steps} steps: the experts take "
              f"{100 * share['experts_share']:.1f}% of {share['basis']} "
              f"(forward {share['experts_forward_ms']:.1f} ms, backward "
              f"{share['experts_backward_ms']:.1f} ms of {share['step_total_ms']:.1f} ms)")
        if args.out:  # the top kernels / ops by their own time, to see which ones make the share
            os.makedirs(args.out, exist_ok=True)
            sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
            with open(os.path.join(args.out, f"profile_{implementation}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by=sort, row_limit=30))
    return share


def main(argv=None) -> dict:
    args = parse_args(argv)
    for name in args.implementations:
        require_experts_implementation(name)
    device_kind = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    dist = Distributed(device_kind)
    corpus = load_stdlib_corpus(int(args.corpus_mib * 2**20))
    if dist.rank == 0:
        print(f"{args.model} ({args.preset}): {args.layers} layers, d {args.hidden}, "
              f"n {args.moe_intermediate}, E {args.num_experts}, K {args.top_k}; "
              f"{args.batch} x {args.seq} tokens a step on {dist.world} x {dist.device.type}; "
              f"corpus {corpus.numel() / 2**20:.1f} MiB of stdlib source", flush=True)

    runs = {name: train(args, name, dist, corpus) for name in args.implementations}

    if dist.rank == 0:
        for name, run in runs.items():
            held_out = f" | held-out {run['final_held_out_loss']:.4f}" if "final_held_out_loss" in run else ""
            if "held_out_other_precision" in run:
                other = run["held_out_other_precision"]
                held_out += f" ({other['losses'][-1]['loss']:.4f} with {other['precision']} experts)"
            print(f"[{name:>10}] final loss {run['final_loss']:.4f}{held_out} | {run['tokens_per_s']:,.0f} "
                  f"tok/s | peak {format_bytes(run['peak_memory_bytes'])} ({run['peak_memory_kind']})")
        if args.out:
            meta = {"model": args.model, "preset": args.preset, "world_size": dist.world,
                    "device": torch.cuda.get_device_name(dist.device) if device_kind == "cuda"
                    else "cpu", "torch": torch.__version__,
                    "args": {k: v for k, v in vars(args).items() if k != "implementations"}}
            json_path, png_path = write_report(args.out, runs, meta)
            print(f"wrote {json_path} and {png_path}")
    return runs


if __name__ == "__main__":
    with contextlib.ExitStack() as cleanup:
        if "WORLD_SIZE" in os.environ:
            cleanup.callback(lambda: torch.distributed.is_initialized()
                             and torch.distributed.destroy_process_group())
        main()
