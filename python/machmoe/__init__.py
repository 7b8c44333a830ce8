"""machmoe: Mixture-of-Experts layers trained on Hopper GPUs (H100, H200), with a PyTorch front
end.

    import torch
    from machmoe import MoE

    layer = MoE(num_experts=64, num_experts_per_tok=4, hidden_size=1536, intermediate_size=512)
    layer = layer.cuda().bfloat16()
    out, aux_loss = layer(torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16))

`backend="auto"` (the default) runs this library's kernels where they can run (bfloat16 tensors
on an sm_90 GPU) and the pure-PyTorch implementation of the same math everywhere else (CPU, other
GPUs, other dtypes). `machmoe.functional` has the functional forms.

Importing the package is cheap: torch and the compiled ops load on first use of MoE,
functional, layer_kernels_available or ops_available.
"""

from __future__ import annotations

import importlib

from .enums import ActivationType, Backend, GateUpLayout, GluClamp, RoutingMethod, TokenRounding, is_glu

__version__ = "0.1.0"

# name -> (submodule, attribute or None for the submodule itself); loaded by __getattr__ below,
# so that `python -m machmoe.bench --help` does not wait for torch.
_LAZY = {
    "MoE": ("moe", "MoE"),
    "shared_experts": ("shared_experts", "shared_experts"),
    "functional": ("functional", None),
    "layer_kernels_available": ("_ops", "layer_kernels_available"),
    "ops_available": ("_ops", "ops_available"),
}

__all__ = [
    "MoE",
    "ActivationType",
    "Backend",
    "GateUpLayout",
    "GluClamp",
    "RoutingMethod",
    "TokenRounding",
    "is_glu",
    "functional",
    "shared_experts",
    "layer_kernels_available",
    "ops_available",
    "__version__",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'machmoe' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(f".{module_name}", __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
