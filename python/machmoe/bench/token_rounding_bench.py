"""Layer forward with and without token rounding on a sparse config (T 16384, d 1536, n 1024,
E 128, K 2), FLOPs counted on the T*K routed rows (with rounding the processed rows differ by
less than one tile per expert). Needs an H100 or H200:

    python -m machmoe.bench.token_rounding_bench
"""

from __future__ import annotations

import sys

T, D, N, E, K = 16384, 1536, 1024, 128, 2


def main() -> int:
    import torch

    from machmoe import _ops, functional
    from machmoe.bench.timing import cuda_time

    why = _ops.kernels_unavailable_reason()
    if why is not None:
        print(f"token_rounding_bench: nothing to measure: {why}")
        return 0
    xs = [torch.randn(T, D, device="cuda").bfloat16() for _ in range(3)]  # rotated inputs [T, d]
    wr = (torch.randn(E, D, device="cuda") * 0.02).bfloat16()  # [E, d]
    w1 = (torch.randn(E, 2 * N, D, device="cuda") * 0.02).bfloat16()  # [E, 2n, d]
    w2 = (torch.randn(E, D, N, device="cuda") * 0.02).bfloat16()  # [E, d, n]

    def forward(x, mode):
        with torch.no_grad():
            return functional.moe(x, wr, w1, w2, num_experts_per_tok=K, token_rounding=mode, tile_m=128,
                                  backend="machmoe")

    for mode in ("none", "nr"):
        ms = cuda_time(lambda x, m=mode: forward(x, m), [(x,) for x in xs]).median_ms
        print(f"machmoe forward T={T} d={D} n={N} E={E} K={K} token_rounding={mode}: {ms:.3f} ms, "
              f"{6 * T * K * N * D / ms / 1e9:.0f} TFLOPS (routed rows T*K)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
