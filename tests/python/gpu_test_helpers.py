"""Pieces the GPU test files share: the activation table of the float64 references, the GLU
names, the relative error per tensor (SPEC §4), expert offsets from row counts, the op namespace,
random layer tensors."""

import torch
import torch.nn.functional as F

from machmoe import _ops

# act(gate) for the GLU kinds, act(h) for the others (the kernels' tanh-form GELU).
ACTS = {
    "swiglu": F.silu, "geglu": lambda g: F.gelu(g, approximate="tanh"), "reglu": F.relu,
    "relu2": lambda h: F.relu(h) ** 2, "relu": F.relu, "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}
GLU = ("swiglu", "geglu", "reglu")


def ops():
    _ops.require_ops()
    return torch.ops.machmoe


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def offsets(counts):
    """expert_offsets [E+1] int32 on the GPU for per-expert row counts."""
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def make_layer(T, d, n, E, act, bias, std=0.02):
    """Random bf16 layer tensors on the GPU: x, router_weight, w1 [E, n1, d], w2 [E, d, n], biases."""
    n1 = 2 * n if act in GLU else n
    dev = "cuda"
    return {
        "x": torch.randn(T, d, device=dev).bfloat16(),
        "router_weight": (torch.randn(E, d, device=dev) * std).bfloat16(),
        "w1": (torch.randn(E, n1, d, device=dev) * std).bfloat16(),
        "w2": (torch.randn(E, d, n, device=dev) * std).bfloat16(),
        "b1": (torch.randn(E, n1, device=dev) * 0.1).bfloat16() if bias else None,
        "b2": (torch.randn(E, d, device=dev) * 0.1).bfloat16() if bias else None,
    }
