"""Both kernels of every grouped GEMM that has two, at the same shapes: the cooperative kernel
(kernels/gemm/cooperative.cuh) and the ping-pong ones (kernels/gemm/pingpong.cuh for the plain
store with contiguous A, kernels/gemm/dact_pingpong.cuh for the dH epilogue), and the weight
gradients with and without CTA pairs. By default the shape rules of host/gemm/config.cpp choose
one; the ops' `kernel` argument forces each here, so that both stay covered at the shapes the rule
gives to the other, against the same float64 references and derived tolerances as the other GEMM
tests. A forced kernel that cannot run the problem is refused."""

import pytest
import torch

from gpu_test_helpers import ops, offsets
from test_gpu_gemm import check_derived, make_problem, reference
from test_gpu_gemm_backward import check_dact, gathered

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

KERNELS = ["cooperative", "pingpong"]
# Partial tiles, empty experts, one expert of 1000 rows.
COUNTS = [[0, 1, 127, 128, 129, 0, 77, 256], [5, 0, 0, 1000, 3]]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("counts", COUNTS)
# N = 768: the ping-pong kernel by default; 200: a partial 192-wide tile; N = 4096 with K = 1024:
# the cooperative kernel by default.
@pytest.mark.parametrize("N,K", [(768, 256), (200, 64), (4096, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_store_both_kernels(kernel, counts, N, K, with_bias):
    a, _, rows, w, off = make_problem(counts, N, K, gather=False)
    bias = torch.randn(len(counts), N, device="cuda").bfloat16() if with_bias else None
    c, _ = ops().grouped_gemm(a, None, off, w, bias, sum(counts), "store", "swiglu", "interleaved", kernel)
    ref, base = reference(rows, w, off, bias)
    check_derived(c, ref, base, f"C ({kernel})")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("N,K", [(768, 512), (200, 136), (4096, 1024)])
def test_nmajor_store_both_kernels(kernel, N, K):
    counts = COUNTS[0]
    a, _, rows = gathered(counts, K, gather=False)
    w = (torch.randn(len(counts), K, N, device="cuda") / K ** 0.5).bfloat16()  # [E, K, N]
    off = offsets(counts)
    c, _, _ = ops().grouped_gemm_nmajor(a, None, off, w, sum(counts), None, None, None, "swiglu", "interleaved",
                                        kernel)
    o = off.tolist()
    ref = torch.cat([rows[o[e]:o[e + 1]].double() @ w[e].double() for e in range(len(counts))])
    base = torch.cat([rows[o[e]:o[e + 1]] @ w[e] for e in range(len(counts))])
    check_derived(c, ref, base, f"C ({kernel})")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("E", [512, 513])  # the kernel's own tile-offset table, the launcher's
def test_store_many_experts_both_kernels(kernel, E):
    g = torch.Generator().manual_seed(E)
    counts = [0] * E
    for e in [0, 1, E // 2, E - 2, E - 1] + torch.randint(0, E, (20,), generator=g).tolist():
        counts[e] += int(torch.randint(1, 300, (1,), generator=g).item())
    a, _, rows, w, off = make_problem(counts, 200, 64, gather=False)
    c, _ = ops().grouped_gemm(a, None, off, w, None, sum(counts), "store", "swiglu", "interleaved", kernel)
    ref, base = reference(rows, w, off)
    check_derived(c, ref, base, f"C ({kernel})")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("act,layout", [("swiglu", "interleaved"), ("geglu", "concatenated"), ("gelu", "interleaved")])
# d = 256: the dH ping-pong kernel by default; d = 2112: the cooperative one.
@pytest.mark.parametrize("n,d", [(256, 256), (136, 200), (256, 2112)])
def test_dact_both_kernels(kernel, act, layout, n, d):
    check_dact([0, 129, 300, 1, 64], act, layout, n, d, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("E", [384, 385])  # the dH ping-pong kernel's shared-memory table, then the launcher's
def test_dact_many_experts_both_kernels(kernel, E):
    counts = [0] * E
    for e in [0, 1, E // 2, E - 2, E - 1]:
        counts[e] += 100 + e % 50
    check_dact(counts, "swiglu", "interleaved", 256, 256, kernel=kernel)


def test_store_kernels_agree():
    # Same operands through both kernels: each within the tolerance, and both close to each other.
    counts = COUNTS[0]
    a, _, rows, w, off = make_problem(counts, 768, 256, gather=False)
    outs = [ops().grouped_gemm(a, None, off, w, None, sum(counts), "store", "swiglu", "interleaved", k)[0]
            for k in KERNELS + ["auto"]]
    ref, base = reference(rows, w, off)
    for k, c in zip(KERNELS + ["auto"], outs):
        check_derived(c, ref, base, f"C ({k})")
    assert torch.equal(outs[2], outs[1]), "auto must run the ping-pong kernel at N = 768"


def test_forced_pingpong_refused_where_it_cannot_run():
    counts = [3, 130]
    a, idx, _, w, off = make_problem(counts, 256, 64, gather=True)
    with pytest.raises(ValueError, match="PingPong"):  # a gathered store
        ops().grouped_gemm(a, idx, off, w, None, sum(counts), "store", "swiglu", "interleaved", "pingpong")
    with pytest.raises(ValueError, match="PingPong"):  # the GLU epilogue
        ops().grouped_gemm(a, idx, off, w, None, sum(counts), "glu", "swiglu", "interleaved", "pingpong")
    with pytest.raises(ValueError, match="kernel"):
        ops().grouped_gemm(a, idx, off, w, None, sum(counts), "store", "swiglu", "interleaved", "fastest")


_WGRAD_COUNTS = [700, 0, 129, 64]


@pytest.mark.parametrize("transpose,fp32", [(True, True), (False, False)])
def test_wgrad_pairs_match_single_ctas(transpose, fp32):
    # CTA pairs change who gathers the rows, not the summation order: bitwise the same C. N = 768:
    # three column tiles, so the last pair's second CTA has none.
    torch.manual_seed(5)
    T = 500
    a = torch.randn(T, 384, device="cuda").bfloat16()
    idx = torch.randint(0, T, (sum(_WGRAD_COUNTS),), device="cuda", dtype=torch.int32)
    b = torch.randn(sum(_WGRAD_COUNTS), 768, device="cuda").bfloat16()
    off = offsets(_WGRAD_COUNTS)
    outs = [ops().grouped_gemm_wgrad(a, idx, b, off, transpose, fp32, k) for k in ("pairs", "single", "auto")]
    assert torch.count_nonzero(outs[0]) > 0 and torch.count_nonzero(outs[0][1]) == 0
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[2], outs[0])


def test_wgrad_pairs_refused_with_one_column_tile():
    a = torch.randn(64, 128, device="cuda").bfloat16()
    b = torch.randn(64, 256, device="cuda").bfloat16()
    off = offsets([64])
    with pytest.raises(ValueError, match="CtaPairs"):
        ops().grouped_gemm_wgrad(a, None, b, off, False, True, "pairs")
