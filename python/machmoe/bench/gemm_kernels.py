"""Kernel-level benchmark of the grouped GEMM engine (issue #4 targets), beside cuBLAS measured in
the same run:

* the engine as a plain dense GEMM (one expert) at 8192 x 8192 x 8192 bf16 vs torch.matmul;
* the up-projection (gather + GLU epilogue writing H and A) and the down-projection (contiguous
  rows, plain store) at a SPEC config's shapes with random top-K routing.
"""

from __future__ import annotations

import torch

from .timing import cuda_time


def _ops():
    from machmoe import _ops

    _ops.require_ops()
    return torch.ops.machmoe


def bench_dense(M: int = 8192, N: int = 8192, K: int = 8192) -> dict:
    ops = _ops()
    sets = [(torch.randn(M, K, device="cuda").bfloat16(), (torch.randn(1, N, K, device="cuda") / K ** 0.5).bfloat16())
            for _ in range(2)]
    off = torch.tensor([0, M], dtype=torch.int32, device="cuda")

    def ours(a, w):
        return ops.grouped_gemm(a, None, off, w, None, M, "store", "swiglu", "interleaved")

    def cublas(a, w):
        return a @ w[0].T

    flops = 2.0 * M * N * K
    t_ours = cuda_time(ours, sets, min_reps=10).median_ms
    t_ref = cuda_time(cublas, sets, min_reps=10).median_ms
    return {"kernel": f"dense GEMM {M}x{N}x{K} bf16", "machmoe_tflops": flops / t_ours / 1e9, "ms": t_ours,
            "cublas_tflops": flops / t_ref / 1e9, "fraction": t_ref / t_ours, "target": ">= 0.90 of cuBLAS"}


def _routing(T: int, E: int, K: int):
    ops = _ops()
    experts = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K].int().contiguous()
    offs, row_token, _, _, _, _ = ops.routing_metadata(experts, None, T, E)
    return offs, row_token


def bench_expert_gemms(name: str, T: int, d: int, n: int, E: int, K: int) -> list[dict]:
    ops = _ops()
    R = T * K
    sets_up, sets_down = [], []
    w1 = (torch.randn(E, 2 * n, d, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, d, n, device="cuda") * 0.02).bfloat16()
    for _ in range(3):
        offs, row_token = _routing(T, E, K)
        x = torch.randn(T, d, device="cuda").bfloat16()
        a = torch.randn(R, n, device="cuda").bfloat16()
        sets_up.append((x, row_token, offs))
        sets_down.append((a, offs))

    def up(x, row_token, offs):
        return ops.grouped_gemm(x, row_token, offs, w1, None, R, "glu", "swiglu", "interleaved")

    def down(a, offs):
        return ops.grouped_gemm(a, None, offs, w2, None, R, "store", "swiglu", "interleaved")

    t_up = cuda_time(up, sets_up).median_ms
    t_down = cuda_time(down, sets_down).median_ms
    rows = bench_backward_gemms(name, T, d, n, E, K)
    return [
        {"kernel": f"{name} up-proj (gather + SwiGLU, H and A)", "machmoe_tflops": 2.0 * R * d * 2 * n / t_up / 1e9,
         "ms": t_up, "target": ">= 560 TFLOPS" if name == "7B-a" else ""},
        {"kernel": f"{name} down-proj (contiguous, store Y)", "machmoe_tflops": 2.0 * R * n * d / t_down / 1e9,
         "ms": t_down, "target": ""},
    ] + rows


def bench_backward_gemms(name: str, T: int, d: int, n: int, E: int, K: int) -> list[dict]:
    """The backward's four expert GEMMs (SwiGLU, interleaved) at a config's shapes, random top-K."""
    ops = _ops()
    R, n1 = T * K, 2 * n
    w1 = (torch.randn(E, n1, d, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, d, n, device="cuda") * 0.02).bfloat16()
    sets = []
    for _ in range(3):
        offs, row_token = _routing(T, E, K)
        sets.append((torch.randn(T, d, device="cuda").bfloat16(), row_token, offs,
                     torch.randn(R, n1, device="cuda").bfloat16(), torch.rand(R, device="cuda"),
                     torch.randperm(R, device="cuda").int(), torch.randn(R, n, device="cuda").bfloat16()))

    def dh(dout, row_token, offs, h, scores, row_pair, _ap):
        return ops.grouped_gemm_nmajor(dout, row_token, offs, w2, R, h, scores, row_pair, "swiglu", "interleaved")

    def dx(dout, row_token, offs, dH, *_):
        return ops.grouped_gemm_nmajor(dH, None, offs, w1, R, None, None, None, "swiglu", "interleaved")

    def dw2(dout, row_token, offs, h, scores, row_pair, ap):
        return ops.grouped_gemm_wgrad(dout, row_token, ap, offs, False, False)

    def dw1(x, row_token, offs, dH, *_):
        return ops.grouped_gemm_wgrad(x, row_token, dH, offs, True, False)

    out = []
    for label, fn, flops, target in (
            ("dH (gather dout·W2 + dSwiGLU, A', dS)", dh, 2.0 * R * d * n, ">= 330 TFLOPS"),
            ("dX~ (dH·W1, contiguous)", dx, 2.0 * R * n1 * d, ">= 620 TFLOPS"),
            ("dW2 (varlen-K, dout gathered, bf16)", dw2, 2.0 * R * d * n, ""),
            ("dW1 (varlen-K, x gathered, bf16)", dw1, 2.0 * R * d * n1, "")):
        t = cuda_time(fn, sets).median_ms
        out.append({"kernel": f"{name} {label}", "machmoe_tflops": flops / t / 1e9, "ms": t,
                    "target": target if name == "7B-a" else ""})
    return out


def run() -> list[dict]:
    rows = [bench_dense()]
    rows += bench_expert_gemms("7B-a", 24576, 1536, 256, 128, 8)
    rows += bench_expert_gemms("30B-b", 32768, 4096, 512, 128, 8)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| kernel | machmoe TFLOPS | reference | target |", "|---|---|---|---|"]
    for r in rows:
        ref = f"cuBLAS {r['cublas_tflops']:.0f} TFLOPS ({r['fraction']:.2f})" if "cublas_tflops" in r else \
            f"{r['ms']:.3f} ms"
        lines.append(f"| {r['kernel']} | {r['machmoe_tflops']:.0f} | {ref} | {r['target']} |")
    return "\n".join(lines)
