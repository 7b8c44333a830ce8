"""GPU tests of the clamped SwiGLU ("clamped_swiglu", machmoe.GluClamp) on the machmoe kernels:
the layer (functional.moe) and the experts on a general list (functional.moe_general), forward
and every gradient, both gate/up layouts, the three variants (gpt-oss, DeepSeek-V4, the
post-activation clamp), against the torch backend run in float64 on the same bf16-valued inputs.
w1 is scaled so that H's standard deviation is about the limit: roughly a third of the gates and
ups lie beyond a clamp, so both sides of every clamp (and the zero gradients past it) are checked.

Tolerance (as tests/python/test_gpu_backward.py and test_gpu_layer.py): machmoe's relative error
per tensor stays within 2x the error of the torch backend run in bf16 on the same inputs, and is
never asked to be below 2^-7 (four bf16 roundings of 2^-9 each)."""

import math

import pytest
import torch

from machmoe import GluClamp, functional

from gpu_test_helpers import make_layer, redraw_near_ties, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

ACT = "clamped_swiglu"
VARIANTS = {
    "gpt_oss": GluClamp.gpt_oss(),  # alpha 1.702, limit 7, up + 1
    "deepseek_v4": GluClamp.deepseek_v4(10.0),
    "post_activation": GluClamp.post_activation(7.0),
}
LAYER_NAMES = ("x", "router_weight", "w1", "w2", "b1", "b2")
GENERAL_NAMES = ("x", "w1", "w2", "b1", "b2", "scores")


def clamped_layer(T, d, n, E, c, bias):
    """make_layer's tensors with w1 rescaled so that std(H) ~ limit (x ~ N(0, 1): std(H) =
    std(w1)·sqrt(d))."""
    t = make_layer(T, d, n, E, "swiglu", bias)  # GLU shapes: w1 [E, 2n, d]
    t["w1"] = (t["w1"].float() * (c.limit / (0.02 * math.sqrt(d)))).bfloat16()
    return t


def layer_grads(t, g, K, backend, c, layout, dtype=None):
    leaves = {k: None if v is None else v.detach().to(dtype or v.dtype).requires_grad_() for k, v in t.items()}
    out, aux = functional.moe(leaves["x"], leaves["router_weight"], leaves["w1"], leaves["w2"],
                              num_experts_per_tok=K, b1=leaves["b1"], b2=leaves["b2"], activation=ACT,
                              layout=layout, glu_clamp=c, backend=backend)
    wanted = [k for k in LAYER_NAMES if leaves[k] is not None]
    got = torch.autograd.grad([out, aux], [leaves[k] for k in wanted], [g.to(out.dtype), torch.full_like(aux, 0.37)])
    return out.detach(), dict(zip(wanted, got))


def check_close(got, ref, base, name):
    assert got.isfinite().all(), f"{name}: non-finite values"
    err, err_base = rel_err(got, ref), rel_err(base, ref)
    assert err <= max(2 * err_base, 2 ** -7), f"{name}: error {err:.3e} > 2x torch bf16's {err_base:.3e}"


def fraction_clamped(t, c, layout):
    """The share of H's gates above the limit and of ups outside [-L, L] (float64)."""
    h = torch.einsum("td,end->etn", t["x"].double(), t["w1"].double())
    n = h.shape[-1] // 2
    gate, up = (h[..., 0::2], h[..., 1::2]) if layout == "interleaved" else (h[..., :n], h[..., n:])
    return (gate > c.limit).double().mean().item(), (up.abs() > c.limit).double().mean().item()


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_forward_and_backward(variant, bias, layout):
    c = VARIANTS[variant]
    T, d, n, E, K = 257, 128, 64, 8, 2  # odd T, partial tiles
    t = redraw_near_ties(clamped_layer(T, d, n, E, c, bias), K)
    gate_out, up_out = fraction_clamped(t, c, layout)
    assert gate_out > 0.1 and up_out > 0.2, (gate_out, up_out)  # both sides of the clamps are exercised
    g = torch.randn(T, d, device="cuda").bfloat16()
    out, got = layer_grads(t, g, K, "machmoe", c, layout)
    ref_out, ref = layer_grads(t, g, K, "torch", c, layout, dtype=torch.float64)
    base_out, base = layer_grads(t, g, K, "torch", c, layout)
    check_close(out, ref_out, base_out, "out")
    assert set(got) == set(ref)
    for k in got:
        assert got[k].dtype == torch.bfloat16 and got[k].shape == t[k].shape, k
        check_close(got[k], ref[k], base[k], f"d{k}")


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_inference_matches_training_forward(variant, layout):
    """The inference path (no H written) computes the same output as the training forward."""
    c = VARIANTS[variant]
    t = clamped_layer(200, 256, 128, 16, c, True)  # (no near-tie redraw needed: both runs route alike)
    with torch.no_grad():
        inf, _ = functional.moe(t["x"], t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=4, b1=t["b1"],
                                b2=t["b2"], activation=ACT, layout=layout, glu_clamp=c, backend="machmoe")
    x = t["x"].clone().requires_grad_()
    train, _ = functional.moe(x, t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=4, b1=t["b1"],
                              b2=t["b2"], activation=ACT, layout=layout, glu_clamp=c, backend="machmoe")
    assert torch.equal(inf, train.detach())


def routing_list(T, E, max_per_token=3):
    counts = torch.randint(0, min(max_per_token, E) + 1, (T,))
    order = torch.argsort(torch.rand(T, E), dim=1)
    keep = torch.arange(E)[None, :] < counts[:, None]
    token = torch.arange(T)[:, None].expand(T, E)[keep]
    expert = order[keep]
    scores = torch.randn(token.numel()).bfloat16().float()
    return token.cuda(), expert.cuda(), scores.cuda()


def general_grads(t, lst, g, backend, c, layout, dtype=None):
    token, expert, scores = lst
    leaves = {k: None if v is None else v.detach().to(dtype or v.dtype).requires_grad_() for k, v in t.items()}
    leaves["scores"] = scores.detach().to(dtype or scores.dtype).requires_grad_()
    out = functional.moe_general(leaves["x"], leaves["w1"], leaves["w2"], leaves["scores"], token, expert,
                                 b1=leaves["b1"], b2=leaves["b2"], activation=ACT, layout=layout, glu_clamp=c,
                                 backend=backend)
    wanted = [k for k in GENERAL_NAMES if leaves.get(k) is not None]
    got = torch.autograd.grad([out], [leaves[k] for k in wanted], [g.to(out.dtype)])
    return out.detach(), dict(zip(wanted, got))


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_general_forward_and_backward(variant, bias, layout):
    c = VARIANTS[variant]
    T, d, n, E = 257, 128, 72, 8  # n = 72: a partial second column tile
    t = clamped_layer(T, d, n, E, c, bias)
    del t["router_weight"]
    lst = routing_list(T, E)
    g = torch.randn(T, d, device="cuda").bfloat16()
    out, got = general_grads(t, lst, g, "machmoe", c, layout)
    ref_out, ref = general_grads(t, lst, g, "torch", c, layout, dtype=torch.float64)
    base_out, base = general_grads(t, lst, g, "torch", c, layout)
    check_close(out, ref_out, base_out, "out")
    assert set(got) == set(ref)
    for k in got:
        check_close(got[k], ref[k], base[k], f"d{k}")


def test_the_parameters_reach_the_kernels():
    """Another limit changes the GPU output (the parameters are not compile-time constants), and
    each variant agrees with the float64 reference of its own parameters only."""
    c1, c2 = GluClamp.gpt_oss(7.0), GluClamp.gpt_oss(3.0)
    t = redraw_near_ties(clamped_layer(128, 128, 64, 8, c1, False), 2)
    with torch.no_grad():
        o1, _ = functional.moe(t["x"], t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=2,
                               activation=ACT, glu_clamp=c1, backend="machmoe")
        o2, _ = functional.moe(t["x"], t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=2,
                               activation=ACT, glu_clamp=c2, backend="machmoe")
        r2, _ = functional.moe(*(t[k].double() for k in ("x", "router_weight", "w1", "w2")), num_experts_per_tok=2,
                               activation=ACT, glu_clamp=c2, backend="torch")
    assert rel_err(o1, r2) > 0.05
    assert rel_err(o2, r2) < 2 ** -6


# ---------------------------------------------------------------- the GEMM kernels' epilogues
# The layer tests above run the kernels the shape rule picks; these run the GLU epilogue (at 128-
# and 256-wide tiles, partial ones included) and both dH kernels (ping-pong at d <= 2048, the
# cooperative one at d = 2112) through the GEMM ops, with H past the limit.


def glu_of(h, layout, c):
    """A of H [R, 2n] by the torch backend's formula, in h's dtype."""
    from machmoe import torch_backend

    return torch_backend.apply_activation(h, ACT, layout, c)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("n", [64, 72, 136])
def test_glu_epilogue(variant, layout, n):
    from gpu_test_helpers import ops, offsets

    c = VARIANTS[variant]
    counts = [0, 129, 300, 1, 64]
    E, R, d = len(counts), sum(counts), 192
    x = torch.randn(R // 2, d, device="cuda").bfloat16()
    idx = torch.randint(0, R // 2, (R,), device="cuda", dtype=torch.int32)
    w = (torch.randn(E, 2 * n, d, device="cuda") * (c.limit / d ** 0.5)).bfloat16()  # std(H) ~ limit
    H, A = ops().grouped_gemm(x, idx, offsets(counts), w, None, R, "glu", ACT, layout, "auto", c.as_list())
    # A from the kernel's own bf16 H, in float64: the epilogue's math on its own scale.
    want = glu_of(H.double(), layout, c)
    assert rel_err(A, want) < 2 ** -8
    gate = H.double()[:, 0::2] if layout == "interleaved" else H.double()[:, :n]
    assert (gate > c.limit).double().mean() > 0.1  # the clamp binds for many entries


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("n,d", [(256, 192), (136, 200), (256, 2112)])
def test_dact_epilogue(variant, layout, n, d):
    from gpu_test_helpers import ops, offsets

    c = VARIANTS[variant]
    counts = [0, 129, 300, 1, 64]
    E, R = len(counts), sum(counts)
    dout = torch.randn(R // 2 + 1, d, device="cuda").bfloat16()
    idx = torch.randint(0, R // 2 + 1, (R,), device="cuda", dtype=torch.int32)
    rows = dout[idx.long()]
    w2 = (torch.randn(E, d, n, device="cuda") / d ** 0.5).bfloat16()
    h = (torch.randn(R, 2 * n, device="cuda") * c.limit).bfloat16()  # about a third past a clamp
    pair_scores = torch.rand(R, device="cuda") + 0.1
    row_pair = torch.randperm(R, device="cuda").to(torch.int32)
    off = offsets(counts)
    dh, ap, ds = ops().grouped_gemm_nmajor(dout, idx, off, w2, R, h, pair_scores, row_pair, ACT, layout, "auto",
                                           c.as_list())
    s = pair_scores[row_pair.long()]
    o = off.tolist()

    def reference(da, hh, s):
        with torch.enable_grad():
            hh = hh.detach().clone().requires_grad_(True)
            a = glu_of(hh, layout, c)
            (g,) = torch.autograd.grad(a, hh, grad_outputs=s[:, None] * da)
        a = a.detach()
        return g, s[:, None] * a, (da * a).sum(1)

    da64 = torch.cat([rows[o[e]:o[e + 1]].double() @ w2[e].double() for e in range(E)])
    ref = reference(da64, h.double(), s.double())
    da16 = torch.cat([rows[o[e]:o[e + 1]] @ w2[e] for e in range(E)])
    base = [t.bfloat16() for t in reference(da16.float(), h.float(), s)]
    for got, want, b, name in zip((dh, ap, ds.sum(1)), ref, (base[0], base[1], base[2].float()), ("dH", "A'", "dS")):
        err, err_base = rel_err(got, want), rel_err(b, want)
        assert err <= max(2 * err_base, 2 ** -8) + 1e-7, f"{name}: error {err:.3e} > 2x torch bf16's {err_base:.3e}"
    # Past a clamp the gradient is exactly zero (the bf16 H is the one both sides see).
    up = h[:, 1::2] if layout == "interleaved" else h[:, n:]
    d_up = dh[:, 1::2] if layout == "interleaved" else dh[:, n:]
    assert (d_up[up.float().abs() > c.limit] == 0).all()
