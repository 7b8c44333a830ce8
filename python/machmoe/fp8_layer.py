"""`precision="fp8"` of the layer (machmoe.functional.moe, machmoe.MoE): the router in high
precision, the experts in FP8 (E4M3, DeepSeek-V3's tile scaling; docs/LAYER.md, "FP8").

    logits = x·Wrᵀ (+ b_r) in fp32 (from the bf16 operands with fp32 accumulation);  scores,
    experts = top-K routing (every routing option);  aux = the load-balancing loss of those logits
    and experts;  out = the FP8 experts on (scores, experts).
  backend "machmoe": the bf16 layer's one C++ call per direction (machmoe.machmoe_backend:
    router GEMM, routing kernels, aux loss, aggregation) with the expert GEMMs in FP8, reading the
    weights' FP8 copies (machmoe::layer_forward / layer_backward with precision FP8);
  backend "torch": the router, routing and aux loss as the torch backend's PyTorch code, the
    experts as machmoe.fp8_emulation.experts_on_list (the same recipe in PyTorch, any device), the
    gradients of the router weight, its bias and x through the scores and the aux loss by autograd.

The weights' FP8 copies come from an FP8WeightCache (machmoe.fp8_weights), remade only when a
weight changes: MoE keeps one per module, the functional API takes one as `fp8_cache` (default: one
for the whole process). Its quantiser is the kernels' for bfloat16 CUDA weights where the kernels
can run, else the emulation's (the same codes and scales by the recipe; tests/python/
test_gpu_fp8_layer.py compares them bitwise).

The expert biases (b1 in the up-projection's epilogue, b2 in the down-projection's store, as in
bf16) are supported; db1 is summed from the bf16 dH the backward quantises, db2 from dout.
Token rounding runs as in bf16 (the rounded list's experts in FP8). What the FP8 experts do not
support is refused with an error naming the argument: activations other than swiglu and
clamped_swiglu, dtypes other than bfloat16, and d
or n not multiples of 16 (the FP8 ops' rule: 16-byte rows of E4M3 codes; d and n need not be
multiples of 128, the edge tiles are partial). Shared experts (MoE's
num_shared_experts) run beside in bf16: they are a dense MLP over every token, not the routed
experts the FP8 path composes, and keeping them out leaves one code path for them.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _ops, fp8_emulation, torch_backend
from .enums import ActivationType, Backend, GateUpLayout, Precision, RoutingMethod, TokenRounding
from .fp8_weights import FP8WeightCache, _quantize_on_kernels

_ALIGN = 16  # d and n: the FP8 ops' rows of E4M3 codes are read 16 bytes at a time


def quantize_weights(w: torch.Tensor, transposed: bool) -> tuple:
    """The FP8 copies of w [E, N, K] (fp8_quantize_weights' tuple): on the kernels for a bfloat16
    CUDA weight where they can run, else by the emulation (the same codes and scales)."""
    if w.is_cuda and w.dtype == torch.bfloat16 and _ops.kernels_unavailable_reason(w.device) is None:
        return _quantize_on_kernels(w, transposed)
    return fp8_emulation.quantize_weights(w, transposed)


def new_cache() -> FP8WeightCache:
    """An empty cache of FP8 weight copies with the layer's quantiser (MoE holds one)."""
    return FP8WeightCache(quantize_weights)


_DEFAULT_CACHE = new_cache()  # the functional API's, when no fp8_cache is given


def default_cache() -> FP8WeightCache:
    """The process-wide cache of the functional calls given no fp8_cache."""
    return _DEFAULT_CACHE


def check_options(names: dict, activation: ActivationType, d: int, n: int) -> None:
    """Refuses, naming the argument (names: rule -> the caller's argument name, for "activation",
    "d", "n"), what the FP8 experts do not compute. Both gate/up layouts are computed (the
    concatenated one through an interleaved FP8 copy of w1 and of b1)."""
    rule = "with precision='fp8'"
    if activation not in (ActivationType.SWIGLU, ActivationType.CLAMPED_SWIGLU):
        raise ValueError(f"{names['activation']} must be 'swiglu' or 'clamped_swiglu' {rule} (the FP8 experts' "
                         f"backward kernels); got {activation.value!r}")
    for key, size in (("d", d), ("n", n)):
        if size % _ALIGN:
            raise ValueError(f"{names[key]} must be a multiple of {_ALIGN} {rule} (16-byte rows of E4M3 codes "
                             f"in the FP8 ops); got {size}")


FUNCTIONAL_NAMES = {"activation": "activation", "d": "x.shape[1] (d)", "n": "w2.shape[2] (n)"}
MODULE_NAMES = {"activation": "activation_function", "d": "hidden_size", "n": "intermediate_size"}


def check_module(module) -> None:
    """MoE's constructor arguments against precision='fp8' (the dtype is checked per call)."""
    check_options(MODULE_NAMES, module.activation_function, module.hidden_size, module.intermediate_size)


def moe(precision: Union[Precision, str], fp8_cache: Optional[FP8WeightCache], backend: Union[Backend, str],
        x, router_weight, w1, b1, w2, b2, K: int, activation: ActivationType, layout: GateUpLayout,
        routing: RoutingMethod, renormalize: bool, selection_bias, rounding: TokenRounding, tile_m: int, seed: int,
        router_bias, options: torch_backend.RouterOptions, glu_clamp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """machmoe.functional.moe with precision='fp8' (module docstring), on arguments it has checked
    already but for the rules of FP8 -> (out [T, d] bf16, aux [] fp32). glu_clamp: the clamped
    SwiGLU's parameters (resolved: a machmoe.GluClamp with activation 'clamped_swiglu', else None)."""
    from .functional import _fp8_setting, resolve_backend  # functional imports this module on use

    T, d = x.shape
    n = w2.shape[2]
    # FP8's rules; the cache, and whether w1's FP8 copy is of its concatenated rows interleaved.
    cache, concatenated = _fp8_setting(precision, fp8_cache, x, activation, layout, d, n)
    on_kernels = resolve_backend(backend, x, d, n) == Backend.MACHMOE
    if on_kernels:  # the bf16 layer's one call per direction, the experts' GEMMs in FP8
        from . import machmoe_backend

        return machmoe_backend.moe(x, router_weight, w1, b1, w2, b2, K, activation, layout, routing,
                                   renormalize, selection_bias, rounding, tile_m, seed, router_bias, options,
                                   glu_clamp, fp8=(cache, concatenated))
    logits = torch_backend.router_logits(x, router_weight, router_bias)  # [T, E] fp32
    # The routing list: the T·K top-K pairs, or the token-rounded list.
    token, expert, score = torch_backend.route_pairs(logits, K, routing, renormalize, selection_bias, rounding,
                                                     tile_m, seed, options)
    aux = torch_backend.aux_loss(logits, expert)
    out = fp8_emulation.experts_on_list(x, w1, w2, token, expert, score, cache, concatenated, glu_clamp, b1, b2)
    return out, aux
