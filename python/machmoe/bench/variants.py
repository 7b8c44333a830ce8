"""The layer with the routing, activation and shared-expert variants of real models, beside the
default layer (softmax over the top-K logits, SwiGLU) in the same run (GPU only):

    python -m machmoe.bench.variants [--configs 7B-a,30B-b] [--out DIR]

Every variant runs the config's routed layer (T, d, n, E, K) through machmoe.functional.moe on the
kernels, timed as the main benchmark times the layer (forward; forward + backward with gradients
of x and every weight). The figure of merit is the time ratio to the default layer: 1.00 = free.
A variant with shared experts does more work; its "share" column is the time ratio it is allowed,
1 + S·n_s / (K·n) (the shared rows' FLOPs over the routed rows').
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Optional

from .configs import select_configs


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    # functional.moe keyword arguments, given the config's E (selection biases are [E] tensors).
    kwargs: Callable[[int], dict] = lambda E: {}
    shared: int = 0  # S shared experts of the routed experts' size n
    shared_gate: bool = False
    glu: bool = True

    def share(self, K: int) -> float:
        return 1.0 + self.shared / K


def _bias(E: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.empty(E, device="cuda").uniform_(-0.05, 0.05, generator=g)  # [E] fp32


def _glu_clamp(preset: str, limit: float):
    from machmoe.enums import GluClamp

    return getattr(GluClamp, preset)(limit)


def _router_bias(E: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(2)
    return torch.empty(E, device="cuda", dtype=torch.bfloat16).normal_(0, 0.1, generator=g).requires_grad_(True)


VARIANTS: tuple[Variant, ...] = (
    Variant("default: softmax over top-K, SwiGLU"),
    Variant("top-K over softmax, renormalised (Qwen3)", lambda E: {"routing": "topk_softmax"}),
    Variant("top-K over softmax, not renormalised", lambda E: {"routing": "topk_softmax", "renormalize": False}),
    Variant("sigmoid + selection bias, renormalised", lambda E: {"routing": "sigmoid", "selection_bias": _bias(E)}),
    Variant("sigmoid + bias, 8 groups keep 4, scaling 2.5 (DeepSeek-V3)",
            lambda E: {"routing": "sigmoid", "selection_bias": _bias(E), "n_group": 8, "topk_group": 4,
                       "routed_scaling_factor": 2.5}),
    Variant("sqrt-softplus + bias, scaling 1.5 (DeepSeek-V4)",
            lambda E: {"routing": "sqrt_softplus", "selection_bias": _bias(E), "routed_scaling_factor": 1.5}),
    Variant("router bias (gpt-oss)", lambda E: {"router_bias": _router_bias(E)}),
    Variant("concatenated gate/up (Hugging Face layout)", lambda E: {"layout": "concatenated"}),
    Variant("clamped SwiGLU (gpt-oss: alpha 1.702, limit 7, up + 1)", lambda E: {"activation": "clamped_swiglu"}),
    Variant("clamped SwiGLU (DeepSeek-V4: limit 10)",
            lambda E: {"activation": "clamped_swiglu", "glu_clamp": _glu_clamp("deepseek_v4", 10.0)}),
    Variant("post-activation clamp (limit 10)",
            lambda E: {"activation": "clamped_swiglu", "glu_clamp": _glu_clamp("post_activation", 10.0)}),
    Variant("shared expert, n_s = n (DeepSeek)", shared=1),
    Variant("shared expert with sigmoid gate (Qwen)", shared=1, shared_gate=True),
)


def _layer_call(inputs, variant: Variant, shared_params: list) -> Callable:
    from machmoe import functional

    cfg = inputs.cfg
    kwargs = variant.kwargs(cfg.E)
    if variant.shared:
        kwargs.update(shared_w1=shared_params[0], shared_w2=shared_params[1],
                      shared_gate=shared_params[2] if variant.shared_gate else None)

    def call(x):
        return functional.moe(x, inputs.router_weight, inputs.w1, inputs.w2, num_experts_per_tok=cfg.K,
                              backend="machmoe", **kwargs)

    return call


def _packed(routed, shared):
    """Leaf copies of routed [E, ...] and shared [S, ...] weights in one allocation, as machmoe.MoE
    places them (the kernels then read [E+S, ...] without a copy)."""
    import torch

    block = torch.cat([routed.detach(), shared])
    return (block[: routed.shape[0]].detach().requires_grad_(True),
            block[routed.shape[0]:].detach().requires_grad_(True))


def run_config(cfg, variants, min_reps: int, seed: int) -> list[dict]:
    import torch

    from .layer_bench import LayerInputs, bench_layer

    rows = []
    for v in variants:
        inputs = LayerInputs(cfg, seed=seed, glu=v.glu)
        shared_params = []
        if v.shared:
            g = torch.Generator(device="cuda").manual_seed(seed + 7)
            shared_params = [
                torch.empty(v.shared, 2 * cfg.n, cfg.d, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g),
                torch.empty(v.shared, cfg.d, cfg.n, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g),
                torch.empty(1, cfg.d, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g),
            ][: 3 if v.shared_gate else 2]
            inputs.w1, shared_params[0] = _packed(inputs.w1, shared_params[0])
            inputs.w2, shared_params[1] = _packed(inputs.w2, shared_params[1])
            for p in shared_params:
                p.requires_grad_(True)
            inputs.extra_params = shared_params
        row = {"config": cfg.name, "variant": v.name, "share": v.share(cfg.K)}
        try:
            call = _layer_call(inputs, v, shared_params)
            res = bench_layer(call, inputs, min_reps=min_reps)
            row.update(fwd_ms=res["fwd_ms"], fwdbwd_ms=res["fwdbwd_ms"], held_gib=res["held_gib"])
        except TypeError as err:  # an option this build's functional.moe does not have
            row["status"] = f"not in this build ({err})"
        except Exception as err:  # noqa: BLE001 - one variant's failure must not hide the others
            row["status"] = f"{type(err).__name__}: {err}"
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    base = rows[0] if "fwd_ms" in rows[0] else None
    for row in rows:
        if base is not None and "fwd_ms" in row:
            row["fwd_ratio"] = row["fwd_ms"] / base["fwd_ms"]
            row["fwdbwd_ratio"] = row["fwdbwd_ms"] / base["fwdbwd_ms"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| config | variant | fwd ms | fwd+bwd ms | ÷ default fwd | ÷ default fwd+bwd | allowed | held GiB |",
             "|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "fwd_ms" not in r:
            lines.append(f"| {r['config']} | {r['variant']} | {r.get('status', '?')} | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
                     f"{r.get('fwd_ratio', float('nan')):.3f} | {r.get('fwdbwd_ratio', float('nan')):.3f} | "
                     f"{r['share']:.3f} | {r['held_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m machmoe.bench.variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="7B-a,30B-b", help="comma-separated config names (default 7B-a,30B-b)")
    p.add_argument("--out", default=None, metavar="DIR", help="write variants.md and variants.json there")
    p.add_argument("--min-reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        configs = select_configs(args.configs)
    except ValueError as err:
        p.error(str(err))  # exits 2 with the message, before any GPU work

    from machmoe import _ops

    why = _ops.kernels_unavailable_reason()
    if why is not None:
        print(f"machmoe.bench.variants: nothing to measure: {why}")
        return 0
    rows = []
    for cfg in configs:
        rows += run_config(cfg, VARIANTS, args.min_reps, args.seed)
    text = table(rows)
    print(text)
    if args.out:
        from .report import write_table

        write_table(args.out, "variants", text, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
