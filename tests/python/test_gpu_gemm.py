"""GPU tests of the sm_90a grouped GEMM engine (the forward's up- and down-projection GEMMs)
against float64 math.

Tolerance: the engine rounds to bf16 like a plain PyTorch bf16 matmul does, so its relative error
per tensor must stay within 2x the error of torch's bf16 GEMM on the same operands (measured in
the same test). Tests with "small" in their name also run under compute-sanitizer."""

import pytest
import torch

from gpu_test_helpers import ACTS, GLU, ops, rel_err, offsets

pytestmark = [pytest.mark.gpu, pytest.mark.ops]


def make_problem(counts, N, K, gather, T=None):
    R = sum(counts)
    E = len(counts)
    if gather:
        T = T or max(R // 2, 1)
        a = torch.randn(T, K, device="cuda").bfloat16()
        idx = torch.randint(0, T, (R,), device="cuda", dtype=torch.int32)
        rows = a[idx.long()]
    else:
        a = torch.randn(R, K, device="cuda").bfloat16()
        idx = None
        rows = a
    w = (torch.randn(E, N, K, device="cuda") / K ** 0.5).bfloat16()
    return a, idx, rows, w, offsets(counts)


def reference(rows, w, off, bias=None):
    """float64 result and torch's bf16 GEMM result, per expert."""
    ref = torch.empty(rows.shape[0], w.shape[1], dtype=torch.float64, device="cuda")
    base = torch.empty(rows.shape[0], w.shape[1], dtype=torch.bfloat16, device="cuda")
    o = off.tolist()
    for e in range(w.shape[0]):
        r = rows[o[e]:o[e + 1]]
        ref[o[e]:o[e + 1]] = r.double() @ w[e].double().T + (0 if bias is None else bias[e].double())
        base[o[e]:o[e + 1]] = r @ w[e].T + (0 if bias is None else bias[e])
    return ref, base


def check_derived(got, ref, base, what):
    err, err_base = rel_err(got, ref), rel_err(base, ref)
    assert err <= 2 * err_base + 1e-7, f"{what}: error {err:.3e} > 2x torch bf16's {err_base:.3e}"


COUNTS = [[300], [0, 1, 127, 128, 129, 0, 77, 256], [5, 0, 0, 1000, 3]]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("N,K", [(128, 64), (256, 128), (384, 200), (1024, 512)])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_gemm_store(counts, N, K, gather, with_bias):
    a, idx, rows, w, off = make_problem(counts, N, K, gather)
    bias = torch.randn(len(counts), N, device="cuda").bfloat16() if with_bias else None
    c, _ = ops().grouped_gemm(a, idx, off, w, bias, sum(counts), "store", "swiglu", "interleaved")
    ref, base = reference(rows, w, off, bias)
    check_derived(c, ref, base, "C")


@pytest.mark.parametrize("gather,epi", [(True, "store"), (False, "store"), (True, "glu")])
@pytest.mark.parametrize("E", [512, 513, 700])
def test_grouped_gemm_many_experts(E, gather, epi):
    # Up to 512 experts the kernel builds its tile offsets in shared memory; above, a separate
    # kernel writes them to the workspace. Mostly empty experts, the used ones at both ends.
    g = torch.Generator().manual_seed(E)
    counts = [0] * E
    for e in [0, 1, E // 2, E - 2, E - 1] + torch.randint(0, E, (20,), generator=g).tolist():
        counts[e] += int(torch.randint(1, 300, (1,), generator=g).item())
    # (contiguous A reaches the ping-pong kernel at N = 200, a partial 192-wide tile. The
    # gathered GLU at N = 512 is the up-projection's kernel: 256-wide tiles, H by TMA, A from the
    # staged rows.)
    N = 512 if epi == "glu" else 128 if gather else 200
    a, idx, rows, w, off = make_problem(counts, N, 64, gather)
    c, act = ops().grouped_gemm(a, idx, off, w, None, sum(counts), epi, "swiglu", "interleaved")
    ref, base = reference(rows, w, off)
    check_derived(c, ref, base, "H" if epi == "glu" else "C")
    if epi == "glu":  # A from the kernel's own bf16 H, in float64
        h = c.double()
        want = ACTS["swiglu"](h[:, 0::2]) * h[:, 1::2]
        assert rel_err(act, want) < 2 ** -8


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("with_bias", [False, True])
# (n = 64 and 72: 128-wide tiles for the GLU, the second one partial; 128 and 136: 256-wide)
@pytest.mark.parametrize("n", [64, 72, 128, 136, 512])
def test_grouped_gemm_activation_epilogues(act, layout, with_bias, n):
    if act not in GLU and layout == "concatenated":
        pytest.skip("the layout only matters for GLU activations")
    counts = [0, 129, 300, 1, 64]
    N = 2 * n if act in GLU else n
    a, idx, rows, w, off = make_problem(counts, N, 192, gather=True)
    bias = torch.randn(len(counts), N, device="cuda").bfloat16() if with_bias else None
    epi = "glu" if act in GLU else "activation"
    H, A = ops().grouped_gemm(a, idx, off, w, bias, sum(counts), epi, act, layout)
    ref, base = reference(rows, w, off, bias)
    check_derived(H, ref, base, "H")
    # A from the kernel's own bf16 H, in float64: checks the epilogue math on its own scale.
    h = H.double()
    if act in GLU:
        g, u = (h[:, 0::2], h[:, 1::2]) if layout == "interleaved" else (h[:, :n], h[:, n:])
        want = ACTS[act](g) * u
    else:
        want = ACTS[act](h)
    assert rel_err(A, want) < 2 ** -8


def test_small_grouped_gemm_store_contiguous_sanitizer_case():
    # Contiguous A, N = 200 <= 2048: the ping-pong kernel by default (host/gemm/config.hpp,
    # kPingPongWhere), with a partial 192-wide tile, an empty expert and an expert's partial rows.
    counts = [3, 0, 130]
    a, idx, rows, w, off = make_problem(counts, 200, 64, gather=False)
    c, _ = ops().grouped_gemm(a, idx, off, w, None, sum(counts), "store", "swiglu", "interleaved")
    ref, base = reference(rows, w, off)
    check_derived(c, ref, base, "C")


def test_small_grouped_gemm_sanitizer_case():
    counts = [3, 0, 130]
    a, idx, rows, w, off = make_problem(counts, 256, 64, gather=True)
    H, A = ops().grouped_gemm(a, idx, off, w, None, sum(counts), "glu", "swiglu", "interleaved")
    ref, base = reference(rows, w, off)
    check_derived(H, ref, base, "H")


def test_grouped_gemm_is_deterministic():
    a, idx, rows, w, off = make_problem([1000, 37, 512], 512, 256, gather=True)
    c1, _ = ops().grouped_gemm(a, idx, off, w, None, 1549, "store", "swiglu", "interleaved")
    c2, _ = ops().grouped_gemm(a, idx, off, w, None, 1549, "store", "swiglu", "interleaved")
    assert torch.equal(c1, c2)


def test_grouped_gemm_derived_check_can_fail():
    a, idx, rows, w, off = make_problem([200], 128, 64, gather=False)
    c, _ = ops().grouped_gemm(a, idx, off, w, None, 200, "store", "swiglu", "interleaved")
    ref, base = reference(rows, w, off)
    c[7] *= 1.5  # one corrupted row out of 200
    with pytest.raises(AssertionError):
        check_derived(c, ref, base, "C")


def test_grouped_gemm_rejects_bad_shapes():
    a = torch.randn(10, 60, device="cuda").bfloat16()
    w = torch.randn(2, 128, 60, device="cuda").bfloat16()
    off = offsets([5, 5])
    with pytest.raises(ValueError, match="K"):
        ops().grouped_gemm(a, None, off, w, None, 10, "store", "swiglu", "interleaved")
