"""What a pre-gathered operand would buy the gathered expert GEMMs (a diagnostic, not the main job):

  python -m machmoe.bench.pregather [--configs 7B-a,120B-c]

For the up-projection (x gathered) and dH (dout gathered) at each config: the kernel with its
cp.async gather, the same kernel on rows gathered beforehand into a contiguous [R, d] buffer (A by
TMA), the gather copy alone (torch.index_select: reads R·d, writes R·d), and the copy followed by
the pre-gathered kernel timed as one call. The pre-gathered kernel's outputs are checked bitwise
equal to the gathered kernel's. The weight gradients with contiguous A still copy it by cp.async,
so for them the row says only what the gather index costs.
"""

from __future__ import annotations

import argparse

import torch

from .gemm_kernels import expert_inputs, expert_weights
from .timing import copy_bandwidth, cuda_time, matmul_tflops


def run_config(name: str, T: int, d: int, n: int, E: int, K: int) -> None:
    m = torch.ops.machmoe
    R, n1 = T * K, 2 * n
    w1, w2 = expert_weights(E, d, n)
    # expert_inputs + the pre-gathered rows' buffer [R, d].
    sets = [expert_inputs(T, d, n, E, K) + (torch.empty(R, d, device="cuda", dtype=torch.bfloat16),)
            for _ in range(2)]

    def gather(x, idx, xg):
        torch.index_select(x, 0, idx.long(), out=xg)

    def up(x, idx, offs, *_):
        return m.grouped_gemm(x, idx, offs, w1, None, R, "glu", "swiglu", "interleaved")

    def dh(x, idx, offs, h, s, pair, _):
        return m.grouped_gemm_nmajor(x, idx, offs, w2, R, h, s, pair, "swiglu", "interleaved")

    for label, fn, flops in (("up-proj", up, 2.0 * R * d * n1), ("dH", dh, 2.0 * R * d * n)):
        x, idx, offs, h, s, pair, xg = sets[0]
        gather(x, idx, xg)
        ref, pre = fn(x, idx, offs, h, s, pair, xg), fn(xg, None, offs, h, s, pair, xg)
        same = all(torch.equal(a, b) for a, b in zip(ref, pre))
        t_g = cuda_time(lambda x, idx, offs, h, s, pair, xg: fn(x, idx, offs, h, s, pair, xg), sets).median_ms
        t_p = cuda_time(lambda x, idx, offs, h, s, pair, xg: fn(xg, None, offs, h, s, pair, xg), sets).median_ms
        t_c = cuda_time(lambda x, idx, offs, h, s, pair, xg: gather(x, idx, xg), sets).median_ms

        def both(x, idx, offs, h, s, pair, xg):
            gather(x, idx, xg)
            return fn(xg, None, offs, h, s, pair, xg)

        t_b = cuda_time(both, sets).median_ms
        print(f"{name} {label}: gathered {t_g:.3f} ms ({flops / t_g / 1e9:.0f} TFLOPS) | pre-gathered "
              f"{t_p:.3f} ms ({flops / t_p / 1e9:.0f}) | copy {t_c:.3f} ms ({2 * R * d * 2 / t_c / 1e6:.0f} GB/s; "
              f"token-major floor {(K + 1) * T * d * 2 / 3.0e12 * 1e3:.3f} ms at 3 TB/s) | copy + pre-gathered "
              f"{t_b:.3f} ms ({flops / t_b / 1e9:.0f}) | bitwise equal: {same}", flush=True)

    def dw(x, idx, offs, h, s, pair, xg):
        return m.grouped_gemm_wgrad(x, idx, h, offs, True, False)

    flops = 2.0 * R * d * n1
    t_g = cuda_time(dw, sets).median_ms
    t_i = cuda_time(lambda x, idx, offs, h, s, pair, xg: dw(xg, None, offs, h, s, pair, xg), sets).median_ms
    print(f"{name} dW1: gathered {t_g:.3f} ms ({flops / t_g / 1e9:.0f} TFLOPS) | contiguous A, cp.async "
          f"{t_i:.3f} ms ({flops / t_i / 1e9:.0f})", flush=True)


def main(argv=None) -> None:
    from machmoe import _ops

    from .configs import select_configs

    p = argparse.ArgumentParser(prog="python -m machmoe.bench.pregather")
    p.add_argument("--configs", default="7B-a,7B-c,30B-c,120B-c")
    args = p.parse_args(argv)
    _ops.require_ops()
    tf, _ = matmul_tflops(8192)
    bw, _ = copy_bandwidth()
    print(f"cuBLAS bf16 8192^3 {tf:.0f} TFLOPS; device copy {bw:.0f} GB/s", flush=True)
    for c in select_configs(args.configs):
        run_config(c.name, c.T, c.d, c.n, c.E, c.K)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
