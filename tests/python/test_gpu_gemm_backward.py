"""GPU tests of the backward's GEMM kernels against float64 math: N-major weights (dX~ = dH·W1),
the dH epilogue (dA' = dout·W2 -> dH, A', dS partials) and the varlen-K weight-gradient GEMM
(dW2 = doutᵀ·A', dW1ᵀ = xᵀ·dH).

Tolerance: the relative error per tensor stays within 2x the error of the same math in plain
PyTorch bf16 (bf16 matmul, bf16-rounded outputs) measured in the same test. Tests with "small" in
their name also run under compute-sanitizer. Both kernels of the GEMMs that have two are forced in
test_gpu_gemm_pingpong.py."""

import pytest
import torch

from gpu_test_helpers import ACTS, GLU, ops, rel_err, offsets

pytestmark = [pytest.mark.gpu, pytest.mark.ops]


def check(got, ref, base, what, floor=0.0):
    err, err_base = rel_err(got, ref), rel_err(base, ref)
    assert err <= max(2 * err_base, floor) + 1e-7, f"{what}: error {err:.3e} > 2x torch bf16's {err_base:.3e}"


COUNTS = [[300], [0, 1, 127, 128, 129, 0, 77, 256], [5, 0, 0, 1000, 3]]


def gathered(counts, K, gather):
    R = sum(counts)
    if gather:
        T = max(R // 2, 1)
        a = torch.randn(T, K, device="cuda").bfloat16()
        idx = torch.randint(0, T, (R,), device="cuda", dtype=torch.int32)
        return a, idx, a[idx.long()]
    a = torch.randn(R, K, device="cuda").bfloat16()
    return a, None, a


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("N,K", [(128, 64), (256, 128), (200, 136), (1536, 512)])
@pytest.mark.parametrize("gather", [False, True])
def test_nmajor_store(counts, N, K, gather):
    a, idx, rows, = gathered(counts, K, gather)
    w = (torch.randn(len(counts), K, N, device="cuda") / K ** 0.5).bfloat16()  # [E, K, N]
    off = offsets(counts)
    c, _, _ = ops().grouped_gemm_nmajor(a, idx, off, w, sum(counts), None, None, None, "swiglu", "interleaved")
    o = off.tolist()
    ref = torch.cat([rows[o[e]:o[e + 1]].double() @ w[e].double() for e in range(len(counts))])
    base = torch.cat([rows[o[e]:o[e + 1]] @ w[e] for e in range(len(counts))])
    check(c, ref, base, "C")


def dact_reference(da, h, s, act, layout, n):
    """dH, A', dS from dA' [R, n], H [R, n1], s [R] (all float64 or all float32)."""
    f = ACTS[act]
    with torch.enable_grad():
        hh = h.detach().clone().requires_grad_(True)
        if act in GLU:
            g, u = (hh[:, 0::2], hh[:, 1::2]) if layout == "interleaved" else (hh[:, :n], hh[:, n:])
            a = f(g) * u
        else:
            a = f(hh)
        (dh,) = torch.autograd.grad(a, hh, grad_outputs=s[:, None] * da)
    a = a.detach()
    return dh, s[:, None] * a, (da * a).sum(1)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
# d = K <= 2048 takes the ping-pong dH kernel by default (host/gemm/config.hpp, kDactPingPongWhere),
# d = 2112 the cooperative one, whose 256-wide tile writes its dS partial and a zero.
@pytest.mark.parametrize("n,d", [(256, 192), (128, 64), (136, 200), (512, 256), (256, 2112)])
def test_dact_epilogue(act, layout, n, d):
    if act not in GLU and layout == "concatenated":
        pytest.skip("the layout only matters for GLU activations")
    check_dact([0, 129, 300, 1, 64], act, layout, n, d)


@pytest.mark.parametrize("d", [256, 2112])  # the ping-pong dH kernel, the cooperative one
@pytest.mark.parametrize("E", [384, 385, 512, 600])
def test_dact_epilogue_many_experts(E, d):
    # Up to 512 experts the kernels build their tile offsets in shared memory (the ping-pong dH
    # kernel up to 384, kDactPPSmemTileE); above, a separate kernel writes them (with the ping-pong
    # kernel's 128-wide column tiles). Mostly empty experts, the used ones at both ends.
    g = torch.Generator().manual_seed(E + d)
    counts = [0] * E
    for e in [0, 1, E // 2, E - 2, E - 1] + torch.randint(0, E, (12,), generator=g).tolist():
        counts[e] += int(torch.randint(1, 150, (1,), generator=g).item())
    check_dact(counts, "swiglu", "interleaved", 256, d)


def check_dact(counts, act, layout, n, d, kernel="auto"):
    E, R = len(counts), sum(counts)
    n1 = 2 * n if act in GLU else n
    dout, idx, rows = gathered(counts, d, True)
    w2 = (torch.randn(E, d, n, device="cuda") / d ** 0.5).bfloat16()  # [E, d, n] = [E, K, N]
    h = torch.randn(R, n1, device="cuda").bfloat16()
    pair_scores = torch.rand(R, device="cuda") + 0.1
    row_pair = torch.randperm(R, device="cuda").to(torch.int32)
    off = offsets(counts)
    dh, ap, ds = ops().grouped_gemm_nmajor(dout, idx, off, w2, R, h, pair_scores, row_pair, act, layout, kernel)
    s = pair_scores[row_pair.long()]
    o = off.tolist()
    da64 = torch.cat([rows[o[e]:o[e + 1]].double() @ w2[e].double() for e in range(E)])
    ref = dact_reference(da64, h.double(), s.double(), act, layout, n)
    da16 = torch.cat([rows[o[e]:o[e + 1]] @ w2[e] for e in range(E)])
    base = [t.bfloat16() for t in dact_reference(da16.float(), h.float(), s, act, layout, n)]
    check(dh, ref[0], base[0], "dH", floor=2 ** -8)
    check(ap, ref[1], base[1], "A'", floor=2 ** -8)
    assert ds.shape == (R, (n + 127) // 128)  # one partial per 128 columns, whichever kernel ran
    check(ds.sum(1), ref[2], base[2].float(), "dS", floor=2 ** -8)


@pytest.mark.parametrize("d,n", [(64, 128), (2112, 256)])  # the ping-pong kernel, the cooperative one
def test_small_dact_sanitizer_case(d, n):
    counts = [3, 0, 130]
    R = sum(counts)
    dout, idx, rows = gathered(counts, d, True)
    w2 = (torch.randn(3, d, n, device="cuda") / d ** 0.5).bfloat16()
    h = torch.randn(R, 2 * n, device="cuda").bfloat16()
    sc = torch.rand(R, device="cuda")
    rp = torch.arange(R, device="cuda", dtype=torch.int32)
    dh, ap, ds = ops().grouped_gemm_nmajor(dout, idx, offsets(counts), w2, R, h, sc, rp, "swiglu", "interleaved")
    o = offsets(counts).tolist()
    da = torch.cat([rows[o[e]:o[e + 1]].double() @ w2[e].double() for e in range(3)])
    ref = dact_reference(da, h.double(), sc.double(), "swiglu", "interleaved", n)
    assert rel_err(dh, ref[0]) < 2 ** -6 and rel_err(ds.sum(1), ref[2]) < 2 ** -6


def wgrad_reference(rows, b, off, dtype):
    o = off.tolist()
    return torch.stack([rows[o[e]:o[e + 1]].to(dtype).T @ b[o[e]:o[e + 1]].to(dtype) for e in range(len(o) - 1)])


@pytest.mark.parametrize("counts", COUNTS + [[64, 0, 65, 1]])
# N >= 2 column tiles runs the paired kernel (two CTAs share the gathered A tile): (200, 136) with
# 128-wide tiles and a partial M tile, (1536, 512), and (72, 768): three column tiles, so the last
# pair's second CTA only gathers and relays, and half of A's M columns lie past M.
@pytest.mark.parametrize("M,N", [(128, 256), (192, 128), (200, 136), (1536, 512), (72, 768)])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("transpose,fp32", [(False, True), (True, True), (False, False), (True, False)])
def test_wgrad(counts, M, N, gather, transpose, fp32):
    a, idx, rows = gathered(counts, M, gather)
    b = torch.randn(sum(counts), N, device="cuda").bfloat16()
    off = offsets(counts)
    c = ops().grouped_gemm_wgrad(a, idx, b, off, transpose, fp32)
    ref = wgrad_reference(rows, b, off, torch.float64)
    base = wgrad_reference(rows, b, off, torch.bfloat16)
    if transpose:
        ref, base = ref.transpose(1, 2), base.transpose(1, 2)
    assert c.dtype == (torch.float32 if fp32 else torch.bfloat16) and c.shape == ref.shape
    check(c, ref, base, "C")
    for e, cnt in enumerate(counts):
        if cnt == 0:
            assert torch.count_nonzero(c[e]) == 0, f"expert {e} has no rows: its gradient must be exactly 0"


@pytest.mark.parametrize("transpose,fp32", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("N", [256, 768])
def test_small_wgrad_sanitizer_case(transpose, fp32, N):
    """Small enough for compute-sanitizer; M = 256 is two full row tiles per expert, so bf16 C
    takes the staged TMA store (both layouts) and fp32 C the direct path. N = 256 is one column
    tile (unpaired); N = 768 three, i.e. the paired kernel with one pair and one CTA of a second
    pair without columns. An empty expert and partial K blocks."""
    counts = [3, 0, 130, 64]
    a, idx, rows = gathered(counts, 256, True)
    b = torch.randn(sum(counts), N, device="cuda").bfloat16()
    off = offsets(counts)
    c = ops().grouped_gemm_wgrad(a, idx, b, off, transpose, fp32)
    ref = wgrad_reference(rows, b, off, torch.float64)
    if transpose:
        ref = ref.transpose(1, 2)
    assert rel_err(c, ref) < (1e-5 if fp32 else 2 ** -8)
    assert torch.count_nonzero(c[1]) == 0


def test_wgrad_is_deterministic():
    counts = [1000, 37, 0, 512]
    a, idx, rows = gathered(counts, 256, True)
    b = torch.randn(sum(counts), 512, device="cuda").bfloat16()
    off = offsets(counts)
    c1 = ops().grouped_gemm_wgrad(a, idx, b, off, False, True)
    c2 = ops().grouped_gemm_wgrad(a, idx, b, off, False, True)
    assert torch.equal(c1, c2)


def test_wgrad_check_can_fail():
    counts = [100, 50]
    a, idx, rows = gathered(counts, 128, True)
    b = torch.randn(150, 128, device="cuda").bfloat16()
    off = offsets(counts)
    c = ops().grouped_gemm_wgrad(a, idx, b, off, False, True)
    c[1, 3] *= 1.5
    with pytest.raises(AssertionError):
        check(c, wgrad_reference(rows, b, off, torch.float64), wgrad_reference(rows, b, off, torch.bfloat16), "C")
