"""Kernel-level benchmark of the grouped GEMM engine, beside cuBLAS measured in
the same run:

* the engine as a plain dense GEMM (one expert) at 8192 x 8192 x 8192 bf16 vs torch.matmul;
* the up-projection (gather + GLU epilogue writing H and A), the down-projection (contiguous
  rows, plain store) and the backward's four expert GEMMs at a benchmark config's shapes with random
  top-K routing, each beside cuBLAS on the same per-expert GEMMs as one batched matmul
  (torch.bmm over E equal experts of R/E rows: no gather, no routing, no epilogue), the bound a
  grouped GEMM with those shapes would meet with cuBLAS's kernels.

`cases()` builds each kernel's call and rotated inputs once; `run()` times them. The "target"
column holds the throughput each 7B-a kernel is designed to reach on an H100.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch

from .timing import cuda_time

# (name, T, d, n, E, K): the configs whose expert GEMMs the table shows.
TABLE_CONFIGS = (("7B-a", 24576, 1536, 256, 128, 8), ("30B-b", 32768, 4096, 512, 128, 8))


def table_configs() -> tuple:
    """TABLE_CONFIGS, or the benchmark configs named in MACHMOE_KERNEL_CONFIGS ("30B-a,120B-c"), so that
    a diagnostic run can put any config's expert GEMMs beside cuBLAS."""
    names = os.environ.get("MACHMOE_KERNEL_CONFIGS", "").strip()
    if not names:
        return TABLE_CONFIGS
    from .configs import select_configs

    return tuple((c.name, c.T, c.d, c.n, c.E, c.K) for c in select_configs(names))


@dataclasses.dataclass
class KernelCase:
    kernel: str  # row label
    fn: Callable[..., Any]  # fn(*sets[i]) launches the kernel
    sets: list  # rotated argument sets (fresh tensors, so L2 does not carry inputs over)
    flops: float
    target: str = ""
    reference: Callable[..., Any] | None = None  # cuBLAS: on the same sets (dense), or on ref_sets
    ref_sets: Callable[[], list] | None = None  # builds the reference's own inputs (the batched matmul)
    ref_label: str = "cuBLAS"

    def reference_sets(self) -> list:
        """The inputs the reference runs on: its own (built now) or the kernel's."""
        return self.ref_sets() if self.ref_sets is not None else self.sets


def _ops():
    from machmoe import _ops

    _ops.require_ops()
    return torch.ops.machmoe


def dense_case(M: int = 8192, N: int = 8192, K: int = 8192) -> KernelCase:
    ops = _ops()
    sets = [(torch.randn(M, K, device="cuda").bfloat16(), (torch.randn(1, N, K, device="cuda") / K ** 0.5).bfloat16())
            for _ in range(2)]
    off = torch.tensor([0, M], dtype=torch.int32, device="cuda")

    def ours(a, w):
        return ops.grouped_gemm(a, None, off, w, None, M, "store", "swiglu", "interleaved")

    def cublas(a, w):
        return a @ w[0].T

    return KernelCase(f"dense GEMM {M}x{N}x{K} bf16", ours, sets, 2.0 * M * N * K, ">= 0.90 of cuBLAS", cublas)


def random_routing(T: int, E: int, K: int):
    """Random top-K routing (K distinct experts per token) -> (expert_offsets [E+1], row_token [R]),
    the routing metadata every expert-GEMM diagnostic runs on."""
    ops = _ops()
    experts = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :K].int().contiguous()
    offs, row_token, _, _, _, _ = ops.routing_metadata(experts, None, T, E)
    return offs, row_token


def expert_weights(E: int, d: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random SwiGLU expert weights: w1 [E, 2n, d], w2 [E, d, n] bf16 (std 0.02)."""
    return ((torch.randn(E, 2 * n, d, device="cuda") * 0.02).bfloat16(),
            (torch.randn(E, d, n, device="cuda") * 0.02).bfloat16())


def expert_inputs(T: int, d: int, n: int, E: int, K: int) -> tuple:
    """One argument set of the expert GEMMs on a fresh random top-K routing: x [T, d] (dout's
    stand-in too: same shape), row_token [R], expert_offsets [E+1], H or dH [R, 2n], scores [R],
    row_pair [R]."""
    R = T * K
    offs, row_token = random_routing(T, E, K)
    return (torch.randn(T, d, device="cuda").bfloat16(), row_token, offs,
            torch.randn(R, 2 * n, device="cuda").bfloat16(), torch.rand(R, device="cuda"),
            torch.randperm(R, device="cuda").int())


def expert_cases(name: str, T: int, d: int, n: int, E: int, K: int) -> list[KernelCase]:
    """The forward's two and the backward's four expert GEMMs (SwiGLU, interleaved), random top-K."""
    ops = _ops()
    R, n1 = T * K, 2 * n
    w1, w2 = expert_weights(E, d, n)
    # expert_inputs + A' or A [R, n].
    sets = [expert_inputs(T, d, n, E, K) + (torch.randn(R, n, device="cuda").bfloat16(),) for _ in range(3)]

    def up(x, row_token, offs, *_):
        return ops.grouped_gemm(x, row_token, offs, w1, None, R, "glu", "swiglu", "interleaved")

    def down(x, row_token, offs, h, scores, row_pair, a):
        return ops.grouped_gemm(a, None, offs, w2, None, R, "store", "swiglu", "interleaved")

    def dh(dout, row_token, offs, h, scores, row_pair, _ap):
        return ops.grouped_gemm_nmajor(dout, row_token, offs, w2, R, h, scores, row_pair, "swiglu", "interleaved")

    def dx(dout, row_token, offs, dH, *_):
        return ops.grouped_gemm_nmajor(dH, None, offs, w1, R, None, None, None, "swiglu", "interleaved")

    def dw2(dout, row_token, offs, h, scores, row_pair, ap):
        return ops.grouped_gemm_wgrad(dout, row_token, ap, offs, False, False)

    def dw1(x, row_token, offs, dH, *_):
        return ops.grouped_gemm_wgrad(x, row_token, dH, offs, True, False)

    # The batched-matmul reference of each kernel: C[e] = A[e] @ B[e], [m, k] @ [k, n_out], with
    # the kernel's per-expert shape (R/E rows per expert). The weight gradients reduce over those
    # rows (k = R/E) and read A transposed, as they read A'/X from row-major [R, *] buffers.
    Re = R // E

    def bmm_ref(m: int, k: int, n_out: int, a_transposed: bool = False):
        def make():
            a_shape = (E, k, m) if a_transposed else (E, m, k)
            return [(torch.randn(*a_shape, device="cuda").bfloat16(),
                     (torch.randn(E, k, n_out, device="cuda") * 0.02).bfloat16()) for _ in range(2)]

        fn = (lambda a, b: torch.bmm(a.transpose(1, 2), b)) if a_transposed else torch.bmm
        return fn, make

    first = name == "7B-a"  # the design targets are set on 7B-a's shapes
    rows = (
        ("up-proj (gather + SwiGLU, H and A)", up, 2.0 * R * d * n1, ">= 560 TFLOPS", bmm_ref(Re, d, n1)),
        ("down-proj (contiguous, store Y)", down, 2.0 * R * n * d, "", bmm_ref(Re, n, d)),
        ("dH (gather dout·W2 + dSwiGLU, A', dS)", dh, 2.0 * R * d * n, ">= 330 TFLOPS", bmm_ref(Re, d, n)),
        ("dX~ (dH·W1, contiguous)", dx, 2.0 * R * n1 * d, ">= 620 TFLOPS", bmm_ref(Re, n1, d)),
        ("dW2 (varlen-K, dout gathered, bf16)", dw2, 2.0 * R * d * n, "", bmm_ref(n, Re, d, a_transposed=True)),
        ("dW1 (varlen-K, x gathered, bf16)", dw1, 2.0 * R * d * n1, "", bmm_ref(d, Re, n1, a_transposed=True)))
    return [KernelCase(f"{name} {label}", fn, sets, flops, target if first else "", ref, make, "cuBLAS bmm")
            for label, fn, flops, target, (ref, make) in rows]


def time_case(case: KernelCase, references: bool = True) -> dict:
    dense = case.reference is not None and case.ref_sets is None
    t = cuda_time(case.fn, case.sets, min_reps=10 if dense else 20).median_ms
    row = {"kernel": case.kernel, "machmoe_tflops": case.flops / t / 1e9, "ms": t, "target": case.target}
    if case.reference is not None and (references or dense):
        ref_sets = case.reference_sets()
        t_ref = cuda_time(case.reference, ref_sets, min_reps=10).median_ms
        del ref_sets
        row.update(cublas_tflops=case.flops / t_ref / 1e9, fraction=t_ref / t, reference=case.ref_label)
    return row


def row_filter(text: str | None = None) -> tuple[str, ...]:
    """Substrings of row labels from `text`, by default MACHMOE_KERNEL_ROWS ("dense,down-proj,dX~"):
    an A/B that changes a few kernels times only those rows. Empty: every row."""
    if text is None:
        text = os.environ.get("MACHMOE_KERNEL_ROWS", "")
    return tuple(s.strip() for s in text.split(",") if s.strip())


def row_wanted(label: str, keep: tuple[str, ...]) -> bool:
    return not keep or any(k in label for k in keep)


def cases():
    """Yields every kernel case of the table (those MACHMOE_KERNEL_ROWS names), one config's inputs
    alive at a time."""
    keep = row_filter()
    if row_wanted("dense GEMM", keep):  # (the dense row's label starts so)
        yield dense_case()
    for cfg in table_configs():
        yield from (c for c in expert_cases(*cfg) if row_wanted(c.kernel, keep))


def run(references: bool = True) -> list[dict]:
    """The table's rows; references=False leaves out the expert GEMMs' batched-matmul references
    (A/B runs time the same table many times)."""
    return [time_case(c, references) for c in cases()]


def format_rows(rows: list[dict]) -> str:
    lines = ["| kernel | machmoe TFLOPS | reference | target |", "|---|---|---|---|"]
    for r in rows:
        if "cublas_tflops" not in r:
            ref = f"{r['ms']:.3f} ms"
        elif r.get("reference", "cuBLAS") == "cuBLAS":
            ref = f"cuBLAS {r['cublas_tflops']:.0f} TFLOPS ({r['fraction']:.2f})"
        else:  # the batched matmul at the same per-expert shape
            ref = f"{r['ms']:.3f} ms; {r['reference']} {r['cublas_tflops']:.0f} TFLOPS ({r['fraction']:.2f})"
        lines.append(f"| {r['kernel']} | {r['machmoe_tflops']:.0f} | {ref} | {r['target']} |")
    return "\n".join(lines)
