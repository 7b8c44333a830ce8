"""What `python -m machmoe.bench` does without a CUDA GPU: a small layer on the CPU.

Forward + backward of a small MoE layer (float32) through the `torch` backend and through the
grouped_mm baseline's CPU path, each compared with the C++ float64 reference
(torch.ops.machmoe.reference_layer) when the op library is built, else with the baseline layer
run in float64. Prints ‖out − ref‖ / ‖ref‖ per tensor and the wall time; never needs a GPU.
With an output directory it also writes what it printed to cpu_demo.md and the figures to
cpu_demo.json there.
"""

from __future__ import annotations

import json
import os
import time

import torch

from .grouped_mm_layer import grouped_mm_moe

TENSORS = ("out", "aux", "dx", "d_router_weight", "dw1", "dw2")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    denom = float(torch.linalg.vector_norm(b64))
    num = float(torch.linalg.vector_norm(a64 - b64))
    return num / denom if denom > 0 else num


def make_inputs(T=256, d=128, n=64, E=8, K=2, seed=0):
    """float64 master inputs: x [T, d], router_weight [E, d], w1 [E, 2n, d], w2 [E, d, n],
    dout [T, d]; weights ~ N(0, 0.02) (the layer's default init), x and dout ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(T, d, generator=g, dtype=torch.float64),
        "router_weight": torch.randn(E, d, generator=g, dtype=torch.float64) * 0.02,
        "w1": torch.randn(E, 2 * n, d, generator=g, dtype=torch.float64) * 0.02,
        "w2": torch.randn(E, d, n, generator=g, dtype=torch.float64) * 0.02,
        "dout": torch.randn(T, d, generator=g, dtype=torch.float64),
        "K": K,
    }


def run_layer(call, inp: dict, dtype: torch.dtype) -> dict:
    """call(x, router_weight, w1, w2, K) -> (out, aux), on copies in `dtype`; returns tensors
    named as in TENSORS (the gradients of out·dout, aux not differentiated)."""
    x = inp["x"].to(dtype).requires_grad_(True)
    wr = inp["router_weight"].to(dtype).requires_grad_(True)
    w1 = inp["w1"].to(dtype).requires_grad_(True)
    w2 = inp["w2"].to(dtype).requires_grad_(True)
    out, aux = call(x, wr, w1, w2, inp["K"])
    dx, dwr, dw1, dw2 = torch.autograd.grad(out, [x, wr, w1, w2], inp["dout"].to(dtype))
    res = {"out": out.detach(), "dx": dx, "d_router_weight": dwr, "dw1": dw1, "dw2": dw2}
    if aux is not None:
        res["aux"] = aux.detach().reshape(())
    return res


def cpp_reference(inp: dict) -> tuple[dict | None, str]:
    """The C++ float64 reference through torch.ops.machmoe.reference_layer, or (None, why not)."""
    try:
        from machmoe import _ops
    except Exception as err:  # noqa: BLE001 - reported, the demo goes on without it
        return None, f"machmoe._ops does not import ({err})"
    if not _ops.ops_available():
        try:
            _ops.require_ops()
        except RuntimeError as err:
            return None, str(err)
        return None, "op library not loaded"
    r = torch.ops.machmoe.reference_layer(
        inp["x"], inp["router_weight"], inp["w1"], None, inp["w2"], None, None, inp["dout"], 0.0,
        inp["K"], "swiglu", "interleaved", "softmax_topk", False, "none", 128, 0)
    # (out, aux, token, expert, score, dx, d_router_weight, dw1, db1, dw2, db2, d_logits)
    names = {"out": 0, "aux": 1, "dx": 5, "d_router_weight": 6, "dw1": 7, "dw2": 9}
    return {k: r[i] for k, i in names.items()}, "C++ float64 reference (torch.ops.machmoe.reference_layer)"


def torch_backend_call():
    """call(x, wr, w1, w2, K) through the `torch` backend, or (None, why not)."""
    why = "machmoe.functional has no moe()"
    try:
        from machmoe import functional
    except Exception as err:
        functional = None
        why = f"machmoe.functional does not import ({err})"
    if functional is not None and hasattr(functional, "moe"):
        def call(x, wr, w1, w2, K):
            return functional.moe(x, wr, w1, w2, num_experts_per_tok=K, backend="torch")
        return call, "machmoe.functional.moe(backend='torch')"
    try:
        from machmoe import torch_backend
    except Exception as err:
        return None, f"{why}; machmoe.torch_backend does not import ({err})"

    def call(x, wr, w1, w2, K):
        return torch_backend.moe(x, wr, w1, None, w2, None, K, "swiglu", "interleaved",
                                 "softmax_topk", False, None, "none", 128, 0)
    return call, "machmoe.torch_backend.moe"


def run(T=256, d=128, n=64, E=8, K=2, seed=0, out_dir: str | None = None) -> int:
    """Runs the demo, printing as it goes; with out_dir, writes cpu_demo.md (the printed text) and
    cpu_demo.json (the shape, the reference used, wall times and errors) there. Returns 0."""
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"CPU demo: MoE layer T={T} d={d} n={n} E={E} K={K}, SwiGLU (interleaved), "
        "softmax over top-K; forward + backward in float32")
    inp = make_inputs(T, d, n, E, K, seed)

    t0 = time.perf_counter()
    ref, ref_name = cpp_reference(inp)
    t_ref = time.perf_counter() - t0
    if ref is None:
        say(f"C++ reference: not built ({ref_name})")
        say("  comparing with the grouped_mm baseline layer run in float64 instead")
        t0 = time.perf_counter()
        ref = run_layer(lambda *a: grouped_mm_moe(*a, impl="loop"), inp, torch.float64)
        t_ref = time.perf_counter() - t0
        ref_name = "grouped_mm baseline layer in float64 (per-expert loop)"
    say(f"reference: {ref_name}  [{t_ref * 1e3:.1f} ms]")

    candidates = []
    call, name = torch_backend_call()
    if call is None:
        say(f"torch backend: unavailable ({name})")
    else:
        candidates.append(("torch backend", name, call))
    candidates.append(("grouped_mm layer", "machmoe.bench.grouped_mm_layer (CPU per-expert loop)",
                       lambda *a: grouped_mm_moe(*a, impl="loop")))

    results, walls = {}, {}
    for label, desc, fn in candidates:
        t0 = time.perf_counter()
        try:
            res = run_layer(fn, inp, torch.float32)
        except NotImplementedError as err:
            say(f"{label}: not implemented ({err})")
            continue
        walls[label] = time.perf_counter() - t0
        results[label] = res
        say(f"{label}: {desc}  [forward + backward {walls[label] * 1e3:.1f} ms wall]")

    say()
    labels = list(results)
    say(f"{'‖x − ref‖ / ‖ref‖':<18}" + "".join(f"{lab:>20}" for lab in labels))
    worst = 0.0
    errors: dict[str, dict[str, float]] = {lab: {} for lab in labels}
    for t in TENSORS:
        cells = []
        for lab in labels:
            if t in results[lab] and t in ref:
                e = _rel(results[lab][t], ref[t])
                errors[lab][t] = e
                worst = max(worst, e) if e == e else float("inf")
                cells.append(f"{e:>20.2e}")
            else:
                cells.append(f"{'—':>20}")
        say(f"{t:<18}" + "".join(cells))
    # float32 arithmetic against a float64 reference lands far below 1e-4 here.
    verdict = "OK" if worst < 1e-4 else "LARGE (check the implementations)"
    say()
    say(f"worst relative error {worst:.2e}: {verdict}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        md_path = os.path.join(out_dir, "cpu_demo.md")
        json_path = os.path.join(out_dir, "cpu_demo.json")
        with open(md_path, "w") as f:
            f.write("# machmoe CPU demo\n\n```\n" + "\n".join(lines) + "\n```\n")
        with open(json_path, "w") as f:
            json.dump({"shape": {"T": T, "d": d, "n": n, "E": E, "K": K}, "seed": seed,
                       "reference": ref_name, "reference_ms": t_ref * 1e3,
                       "wall_ms": {k: v * 1e3 for k, v in walls.items()},
                       "relative_errors": errors, "worst": worst, "verdict": verdict}, f, indent=1)
        print(f"wrote {md_path}\nwrote {json_path}")
    return 0
