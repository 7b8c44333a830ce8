"""Shared experts: S always-on expert MLPs that every token visits, beside the routed ones
(DeepSeek-V2/V3, Kimi K2, GLM-4.5, Qwen2/Qwen3-Next's shared expert).

They run on the same expert kernels as the routed experts: the shared experts are a routing list
in which token t goes to each of the S shared experts with weight 1, or with Qwen's per-token
gate sigmoid(x_t · g) (g [1, d]). The list is ordered and free of repeated pairs by construction,
so it needs no check (and no host synchronisation). As for the routed experts, the backward keeps
only H [T·S, N1] between forward and backward, never the experts' outputs.

A shared expert of intermediate size n_s is one expert of that size; a model whose shared MLP is m
times the routed expert's size (`n_shared_experts = m` in DeepSeek's configs) has S = 1 and
n_s = m · n.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _ops, functional, torch_backend
from .enums import ActivationType, Backend, GateUpLayout, GluClamp


def shared_expert_routing(T: int, S: int, device: torch.device, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The list that sends every token to every shared expert, ordered by token: token_idx [T·S]
    = 0,0..,1,1.. and expert_idx [T·S] (int32). With `chunks` m, the tokens are cut into m
    consecutive runs and token t of run j goes to kernel expert s·m + j of shared expert s (the
    kernels' copies of it, see token_chunks); m = 1: expert_idx = 0..S-1, 0..S-1, ..."""
    t = torch.arange(T, device=device, dtype=torch.int32)
    run = (t.long() * chunks // max(T, 1)).to(torch.int32)  # [T] run of each token, in [0, m)
    token = t.repeat_interleave(S)
    expert = (torch.arange(S, device=device, dtype=torch.int32)[None, :] * chunks + run[:, None]).reshape(-1)
    return token, expert


# Kernel tile (128 x 128) of the weight-gradient GEMMs, and the fewest rows a token run keeps, so
# that each weight-gradient tile still loops over enough rows to pay for its epilogue.
_WGRAD_TILE = 128
_MIN_RUN_ROWS = 1024


def token_chunks(T: int, N1: int, d: int, n: int, S: int, sms: int) -> int:
    """How many runs m to cut the tokens into for the kernels (>= 1): the weight-gradient GEMMs of
    S experts with T rows each have only S·(N1/128)(d/128) and S·(d/128)(n/128) output tiles; m
    copies of each expert, one per run of T/m tokens, multiply both by m. Chosen so that the smaller
    one covers two waves of the GPU's `sms` multiprocessors, with runs of at least 1024 rows."""
    tiles = S * min(-(-N1 // _WGRAD_TILE) * -(-d // _WGRAD_TILE), -(-d // _WGRAD_TILE) * -(-n // _WGRAD_TILE))
    want = -(-2 * sms // max(tiles, 1))
    return max(1, min(want, T // _MIN_RUN_ROWS))


def check_shared_experts(x, w1, w2, b1, b2, gate_weight, activation, layout, backend, glu_clamp) -> tuple:
    """The argument checks of shared experts (w1 [S, N1, d], w2 [S, d, n_s], b1, b2, gate_weight
    [1, d] or None) on x [T, d]; returns (activation, layout, glu_clamp, T, d, S, n_s)."""
    parsed = functional._parse_experts_call(x, w1, w2, b1, b2, activation, layout, backend, glu_clamp)
    d = parsed[4]
    if gate_weight is not None:
        gate_weight = functional._float_tensor(gate_weight, "gate_weight", 2)
        functional._shape(gate_weight, "gate_weight", (1, d), "[1, d] with d = x.shape[1]")
    functional._same_dtype_and_device(
        {"x": x, "w1": w1, "w2": w2, "b1": b1, "b2": b2, "gate_weight": gate_weight}, {})
    return parsed


def shared_gate_scores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Qwen's shared-expert gate sigmoid(x · gate_weightᵀ) -> [T] in the routing dtype (fp32, fp64
    for fp64 x): the kernels weight the experts' rows in fp32 anyway."""
    gate_logit = torch.nn.functional.linear(x, gate_weight).to(torch_backend.routing_dtype(x.dtype)).squeeze(1)
    return torch.sigmoid(gate_logit)


def shared_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    gate_weight: Optional[torch.Tensor] = None,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    backend: Union[Backend, str] = Backend.AUTO,
    glu_clamp: Optional[GluClamp] = None,
) -> torch.Tensor:
    """The sum of S shared experts' outputs -> out [T, d] in x's dtype.

        out_t = g_t · Σ_s MLP_s(x_t),  g_t = sigmoid(x_t · gate_weightᵀ) or 1 without a gate.

    Args:
        x: [T, d] tokens.
        w1: [S, N1, d] up-projection weights of the S shared experts, x's dtype; N1 = 2·n_s for
            GLU activations, else n_s.
        w2: [S, d, n_s] down-projection weights.
        gate_weight: [1, d] Qwen's shared-expert gate (a bias-free nn.Linear(d, 1)'s weight), or
            None (default): every shared expert's output is added with weight 1.
        b1, b2: [S, N1] and [S, d] biases, or None (default); both or neither.
        activation, layout, backend, glu_clamp: as machmoe.functional.moe.
    Every input that is a floating tensor receives its gradient.
    """
    activation, layout, glu_clamp, T, d, S, n = check_shared_experts(x, w1, w2, b1, b2, gate_weight, activation,
                                                                     layout, backend, glu_clamp)
    on_kernels = functional.resolve_backend(backend, x, d, n) == Backend.MACHMOE
    chunks = token_chunks(T, w1.shape[1], d, n, S, _ops.sm_count(x.device)) if on_kernels else 1
    token, expert = shared_expert_routing(T, S, x.device, chunks)  # [T·S] each
    if gate_weight is None:
        scores = torch.ones(T * S, device=x.device, dtype=torch_backend.routing_dtype(x.dtype))
    else:
        scores = shared_gate_scores(x, gate_weight).repeat_interleave(S)  # [T·S]
    return functional._run_experts(x, w1, b1, w2, b2, scores, token, expert, activation, layout, glu_clamp,
                                   on_kernels, repeats=chunks)
