"""Timing and memory of one layer implementation on one config (GPU only).

A layer implementation is `call(x) -> (out, aux)` with fixed parameters; the timed region is the
whole call as a user makes it (router GEMM, top-K, metadata, expert GEMMs, aggregation) and, for
the backward, torch.autograd.grad of `out` with respect to x and every parameter.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .configs import GIB, MoEConfig, layer_flops, tflops
from .timing import cuda_time, held_bytes

NOT_BUILT = "not built"
NOT_AVAILABLE = "not available"  # the kernels exist but cannot run on this GPU
OOM = "OOM"


class LayerInputs:
    """Parameters and rotated inputs of one config, bf16, on the GPU.

    Weights ~ N(0, 0.02) as in SonicMoE; x and dout ~ N(0, 1). `sets` different x (and dout)
    tensors are rotated between timed calls so that L2 does not keep the inputs.
    """

    def __init__(self, cfg: MoEConfig, *, sets: int = 3, seed: int = 0, glu: bool = True):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        n1 = 2 * cfg.n if glu else cfg.n
        bf16 = torch.bfloat16

        def normal(shape, std):
            return torch.empty(shape, device="cuda", dtype=bf16).normal_(0.0, std, generator=gen)

        self.cfg = cfg
        self.router_weight = normal((cfg.E, cfg.d), 0.02).requires_grad_(True)  # [E, d]
        self.w1 = normal((cfg.E, n1, cfg.d), 0.02).requires_grad_(True)  # [E, N1, d]
        self.w2 = normal((cfg.E, cfg.d, cfg.n), 0.02).requires_grad_(True)  # [E, d, n]
        self.xs = [normal((cfg.T, cfg.d), 1.0).requires_grad_(True) for _ in range(sets)]
        self.douts = [normal((cfg.T, cfg.d), 1.0) for _ in range(sets)]
        self.extra_params: list[torch.Tensor] = []  # a variant's own weights (shared experts)

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.router_weight, self.w1, self.w2, *self.extra_params]


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def bench_layer(call: Callable[[torch.Tensor], tuple], inputs: LayerInputs, *,
                min_reps: int = 20) -> dict:
    """Forward time, forward+backward time and held activation memory of `call` on `inputs`."""
    cfg = inputs.cfg
    params = inputs.params
    fwd_flop, bwd_flop = layer_flops(cfg.T, cfg.K, cfg.n, cfg.d)

    def forward(x, dout):
        out, aux = call(x)
        return out

    def forward_backward(x, dout):
        out, aux = call(x)
        # autograd.grad returns fresh gradients (no accumulation into .grad), as after
        # zero_grad(set_to_none=True) in training.
        return torch.autograd.grad(out, [x, *params], dout)

    # Memory first, after one untimed forward+backward so that one-time allocations (cuBLAS
    # workspaces, library handles) are not counted: bytes kept alive by the graph after the
    # forward, less the outputs.
    del_me = forward_backward(inputs.xs[0], inputs.douts[0])
    del del_me
    held, result = held_bytes(lambda: call(inputs.xs[0]))
    del result

    arg_sets: Sequence[tuple] = list(zip(inputs.xs, inputs.douts))
    t_fwd = cuda_time(forward, arg_sets, warmup=3, min_reps=min_reps, max_reps=200, target_s=0.6)
    t_all = cuda_time(forward_backward, arg_sets, warmup=3, min_reps=min_reps, max_reps=200,
                      target_s=1.0)
    bwd_ms = t_all.median_ms - t_fwd.median_ms
    return {
        "status": "ok",
        "fwd_ms": t_fwd.median_ms,
        "fwdbwd_ms": t_all.median_ms,
        "bwd_ms": bwd_ms,
        "fwd_tflops": tflops(fwd_flop, t_fwd.median_ms),
        "bwd_tflops": tflops(bwd_flop, bwd_ms),
        "held_bytes": held,
        "held_gib": held / GIB,
        "fwd_timing": t_fwd.as_dict(),
        "fwdbwd_timing": t_all.as_dict(),
    }


def bench_forward_only(call: Callable[[torch.Tensor], tuple], inputs: LayerInputs, *,
                       min_reps: int = 20) -> dict:
    """Forward time of `call` under torch.no_grad(), for an implementation whose backward is not
    built (it refuses to run with gradients) or failed; the caller records why in "backward". The
    grouped_mm reference's forward is timed with autograd recording; that costs it no extra
    kernels, only host work."""
    cfg = inputs.cfg
    fwd_flop, _ = layer_flops(cfg.T, cfg.K, cfg.n, cfg.d)

    def forward(x):
        with torch.no_grad():
            out, aux = call(x)
        return out

    t_fwd = cuda_time(forward, [(x,) for x in inputs.xs], warmup=3, min_reps=min_reps, max_reps=200,
                      target_s=0.6)
    res = {"status": "ok", "fwd_ms": t_fwd.median_ms, "fwd_tflops": tflops(fwd_flop, t_fwd.median_ms),
           "fwd_timing": t_fwd.as_dict(), "backward": "not built"}
    try:
        held = machmoe_saved_bytes(inputs)
        res.update({"held_bytes": held, "held_gib": held / GIB})
    except Exception as err:  # noqa: BLE001 - the timing stands; say why the memory is missing
        res["held_error"] = f"{type(err).__name__}: {err}"
    return res


def machmoe_saved_bytes(inputs: LayerInputs) -> int:
    """Bytes the machmoe forward keeps for the backward, measured: the memory still allocated after
    machmoe::layer_forward while its `saved` block is alive, less the output and the aux loss
    (the layer op returns the block; without the backward nothing else would hold it)."""
    import machmoe  # noqa: F401  (loads the ops)

    cfg = inputs.cfg
    keep = []

    def forward():
        with torch.no_grad():
            out, aux, saved = torch.ops.machmoe.layer_forward(
                inputs.xs[0].detach(), inputs.router_weight.detach(), inputs.w1.detach(), None,
                inputs.w2.detach(), None, None, cfg.K, "swiglu", "interleaved", "softmax_topk", True,
                "none", 128, 0)
        keep.append(saved)
        return out, aux

    held, result = held_bytes(forward)
    del result, keep
    return held


def compare_forward(call: Callable, ref_call: Callable, inputs: LayerInputs) -> dict:
    """Relative error of call's out against ref_call's (forward only)."""
    x = inputs.xs[1]
    with torch.no_grad():
        ref_out, _ = ref_call(x)
        out, _ = call(x)
    return {"err_out": rel_err(out, ref_out)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float32 (NaN propagates)."""
    a32, b32 = a.detach().float(), b.detach().float()
    return float(torch.linalg.vector_norm(a32 - b32) / torch.linalg.vector_norm(b32))


def compare_outputs(call: Callable, ref_call: Callable, inputs: LayerInputs) -> dict:
    """Relative error of call's out and dx against ref_call's on the same inputs (one pass each).

    Only out and dx are compared here (small tensors); the tests do the full check.
    """
    x, dout = inputs.xs[1], inputs.douts[1]
    ref_out, _ = ref_call(x)
    (ref_dx,) = torch.autograd.grad(ref_out, [x], dout)
    ref_out = ref_out.detach()
    out, _ = call(x)
    (dx,) = torch.autograd.grad(out, [x], dout)
    return {"err_out": rel_err(out, ref_out), "err_dx": rel_err(dx, ref_dx)}


def machmoe_call(inputs: LayerInputs) -> Callable:
    """call(x) through machmoe.functional.moe(..., backend="machmoe"). Import errors propagate."""
    from machmoe import functional  # noqa: WPS433 (imported late: the package may be partial)

    K = inputs.cfg.K

    def call(x):
        return functional.moe(x, inputs.router_weight, inputs.w1, inputs.w2,
                              num_experts_per_tok=K, backend="machmoe")

    return call


def probe_machmoe(inputs: LayerInputs) -> tuple[Callable | None, str]:
    """(call, "ok") when the machmoe backend runs, else (None, status) with status "not built"
    (no op library, or one without the kernels; NotImplementedError), "not available" (the kernels
    cannot run on this GPU) or the error message."""
    try:
        call = machmoe_call(inputs)
        from machmoe import _ops
    except ImportError as err:
        return None, f"{NOT_BUILT} ({err})"
    why = _ops.kernels_unavailable_reason(inputs.xs[0].device)
    if why is not None:
        status = NOT_BUILT if not _ops.kernels_compiled() else NOT_AVAILABLE
        return None, f"{status} ({why})"
    try:
        with torch.no_grad():
            out, _ = call(inputs.xs[0])
        del out
        torch.cuda.synchronize()
    except NotImplementedError as err:
        return None, f"{NOT_BUILT} ({err})"
    return call, "ok"
