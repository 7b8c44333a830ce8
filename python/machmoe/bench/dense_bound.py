"""The dense cuBLAS bound: the fastest the expert GEMMs could run with cuBLAS.

The layer's expert FLOPs done as batched dense bf16 GEMMs with perfectly balanced experts
(m = ceil(T·K / E) rows per expert), no routing, no gather, no activation:

forward  (6·TK·n·d for GLU):
    H  = X  · W1ᵀ      [E, m, d]  x [E, d, N1]  -> [E, m, N1]
    Y  = A  · W2ᵀ      [E, m, n]  x [E, n, d]   -> [E, m, d]
backward (twice that: a data- and a weight-gradient GEMM for each):
    dA  = dY  · W2     [E, m, d]  x [E, d, n]   -> [E, m, n]
    dW2 = dYᵀ · A      [E, d, m]  x [E, m, n]   -> [E, d, n]
    dX  = dH  · W1     [E, m, N1] x [E, N1, d]  -> [E, m, d]
    dW1 = dHᵀ · X      [E, N1, m] x [E, m, d]   -> [E, N1, d]

The weights use the layer's nn.Linear layout (W1 [E, N1, d], W2 [E, d, n]) and the transposes are
strided views, as in the real layer. TFLOPS use the FLOPs of these exact shapes.
"""

from __future__ import annotations

import torch

from .configs import MoEConfig, tflops
from .timing import Timing, cuda_time

# Rotating input sets only matters while a set could sit in L2 (50 MB on an H100). A set above
# this size is > 20x L2, so one set is enough, and the largest configs (DeepSeek-V3: ~11 GB per
# backward set) could not hold three next to their weights and weight gradients anyway.
ROTATE_LIMIT_BYTES = 1 << 30


def _randn(shape, gen, std=1.0):
    t = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    return t.normal_(0.0, std, generator=gen)


def _forward(X, A, W1, W2):
    H = torch.bmm(X, W1.transpose(1, 2))  # [E, m, N1]
    Y = torch.bmm(A, W2.transpose(1, 2))  # [E, m, d]
    return H, Y


def _backward(X, A, dH, dY, W1, W2):
    dA = torch.bmm(dY, W2)  # [E, m, n]
    dW2 = torch.bmm(dY.transpose(1, 2), A)  # [E, d, n]
    dX = torch.bmm(dH, W1)  # [E, m, d]
    dW1 = torch.bmm(dH.transpose(1, 2), X)  # [E, N1, d]
    return dA, dW2, dX, dW1


def dense_bound(cfg: MoEConfig, *, glu: bool = True, min_reps: int = 20, seed: int = 0) -> dict:
    """Times the forward-equivalent and backward-equivalent GEMMs; returns a result dict."""
    E, d, n = cfg.E, cfg.d, cfg.n
    n1 = 2 * n if glu else n
    m = -(-cfg.TK // E)  # ceil: rows per expert with perfect balance
    fwd_flop = 2 * E * m * d * n1 + 2 * E * m * n * d
    bwd_flop = 2 * fwd_flop
    gen = torch.Generator(device="cuda").manual_seed(seed)

    W1 = _randn((E, n1, d), gen, 0.02)
    W2 = _randn((E, d, n), gen, 0.02)

    # Forward phase: sets of (X, A).
    fwd_set_bytes = 2 * E * m * (d + n)
    n_fwd = 3 if fwd_set_bytes <= ROTATE_LIMIT_BYTES else 1
    fwd_sets = [(_randn((E, m, d), gen), _randn((E, m, n), gen), W1, W2) for _ in range(n_fwd)]
    t_fwd: Timing = cuda_time(_forward, fwd_sets, warmup=3, min_reps=min_reps, max_reps=200,
                              target_s=0.5)
    del fwd_sets

    # Backward phase: sets of (X, A, dH, dY).
    bwd_set_bytes = 2 * E * m * (d + n + n1 + d)
    n_bwd = 3 if bwd_set_bytes <= ROTATE_LIMIT_BYTES else 1
    bwd_sets = [
        (_randn((E, m, d), gen), _randn((E, m, n), gen), _randn((E, m, n1), gen),
         _randn((E, m, d), gen), W1, W2)
        for _ in range(n_bwd)
    ]
    t_bwd: Timing = cuda_time(_backward, bwd_sets, warmup=3, min_reps=min_reps, max_reps=200,
                              target_s=0.5)
    del bwd_sets, W1, W2

    return {
        "rows_per_expert": m,
        "fwd_flop": fwd_flop,
        "bwd_flop": bwd_flop,
        "fwd_ms": t_fwd.median_ms,
        "bwd_ms": t_bwd.median_ms,
        "fwd_tflops": tflops(fwd_flop, t_fwd.median_ms),
        "bwd_tflops": tflops(bwd_flop, t_bwd.median_ms),
        "fwd_timing": t_fwd.as_dict(),
        "bwd_timing": t_bwd.as_dict(),
    }
