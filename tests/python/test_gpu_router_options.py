"""GPU tests of the router options (docs/LAYER.md "Routing": sqrt_softplus scores, the routed
scaling factor, group-limited selection, the router bias) on the machmoe kernels: the top-K
router and its backward against the float64 CPU reference and float64 PyTorch math, and the whole
layer forward and backward against the torch backend in float64, for E in {8, 256, 384, 512, 1024}
and K up to 32.

Selection keys of the gate routings are computed in fp32 on the GPU, so a token whose float64
choice (of groups or of experts) is within fp32 rounding of another choice may legitimately go
elsewhere: the router tests leave such tokens (under 5% of them) out of the exact comparison, the
layer tests redraw them (as gpu_test_helpers.redraw_near_ties does for the plain routings).
Tolerances of the layer as tests/python/test_gpu_backward.py: at most 2x the torch backend's
bf16 error, never below 2^-7."""

import pytest
import torch
import torch.nn.functional as F

from machmoe import functional

from gpu_test_helpers import make_layer, ops, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

GATES = ("sigmoid", "sqrt_softplus")
E_VALUES = (8, 256, 384, 512, 1024)


def gate64(logits, routing):
    return torch.sigmoid(logits) if routing == "sigmoid" else F.softplus(logits).sqrt()


def selection_keys(logits64, routing, bias):
    if routing in GATES:
        return gate64(logits64, routing) + (0 if bias is None else bias.double())
    return logits64


def group_mask(keys, n_group, topk_group):
    """[T, E] bool: the experts of each token's kept groups (float64 keys)."""
    T, E = keys.shape
    if n_group == 1:
        return torch.ones_like(keys, dtype=torch.bool)
    g = keys.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)  # [T, G]
    kept = g.topk(topk_group, dim=1).indices
    return torch.zeros(T, n_group, dtype=torch.bool, device=keys.device).scatter(1, kept, True) \
        .repeat_interleave(E // n_group, dim=1)


def near_tie_tokens(keys, K, n_group, topk_group, eps):
    """[T] bool: tokens whose kept groups or set of K experts is within eps (in float64 keys) of
    another choice: the topk_group-th and next group scores, or the K-th and next kept keys, are
    closer than eps. (A group's score, the sum of its two largest keys, is continuous in them.)"""
    T, E = keys.shape
    near = torch.zeros(T, dtype=torch.bool, device=keys.device)
    if n_group > 1 and topk_group < n_group:
        sums = keys.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1).sort(dim=1, descending=True).values
        near |= (sums[:, topk_group - 1] - sums[:, topk_group]) < eps
    if K < E:
        masked = keys.masked_fill(~group_mask(keys, n_group, topk_group), float("-inf"))
        top = masked.topk(K + 1, dim=1).values
        near |= (top[:, K - 1] - top[:, K]) < eps  # -inf next: inf, never near
    return near


def expected_scores(logits64, experts, routing, renorm, scale):
    """float64 scores of the GPU's chosen experts (the score function, independent of selection)."""
    l_sel = logits64.gather(1, experts)
    if routing == "softmax_topk" or (routing == "topk_softmax" and renorm):
        s = torch.softmax(l_sel, dim=1)
    elif routing == "topk_softmax":
        s = torch.softmax(logits64, dim=1).gather(1, experts)
    else:
        s = gate64(l_sel, routing)
        if renorm:
            s = s / s.sum(dim=1, keepdim=True)
    return s * scale


def router_cases():
    for E in E_VALUES:
        for K in sorted({1, min(8, E), min(32, E)}):
            yield E, K, "softmax_topk", True, 1.0, 1, 1
            yield E, K, "topk_softmax", False, 2.5, 1, 1
            for routing in GATES:
                yield E, K, routing, True, 2.5, 1, 1
                yield E, K, routing, False, 1.0, 1, 1
                if E >= 16:
                    G = 8
                    tg = max(1, min(G, -(-K * G // E)))  # enough kept experts for K
                    tg = max(tg, 4) if E // G * 4 >= K else tg
                    yield E, K, routing, True, 2.5, G, tg
                if E == 8 and K <= 4:
                    yield E, K, routing, True, 1.0, 4, 2
    # Group sizes S = E / n_group the sorted kernel handles in registers (S divides 32, or 32
    # divides S: 16 at 7B-a's E = 128, 4, 64 over two slots) and through shared memory (24).
    yield 128, 8, "sigmoid", True, 2.5, 8, 4
    yield 64, 4, "sqrt_softplus", True, 1.0, 16, 8
    yield 256, 8, "sigmoid", False, 1.0, 4, 2
    yield 160, 6, "sigmoid", True, 1.0, 5, 3
    yield 192, 8, "sigmoid", True, 2.5, 8, 4


@pytest.mark.parametrize("E,K,routing,renorm,scale,n_group,topk_group", list(router_cases()))
def test_topk_router_options_match_reference(E, K, routing, renorm, scale, n_group, topk_group):
    T, dev = 300, "cuda"
    logits = torch.randn(T, E, device=dev) * 2
    bias = 0.1 * torch.randn(E, device=dev) if routing in GATES else None
    scores, experts = ops().topk_router(logits, K, routing, renorm, bias, scale, n_group, topk_group)
    ref_s, ref_e = ops().reference_topk(logits.cpu(), K, routing, renorm, None if bias is None else bias.cpu(),
                                        scale, n_group, topk_group)
    l64 = logits.double().cpu()
    keys = selection_keys(l64, routing, None if bias is None else bias.cpu())
    near = near_tie_tokens(keys, K, n_group, topk_group, eps=1e-5)
    assert near.float().mean() < 0.05, "too many near ties for a meaningful test"
    ge = experts.cpu().long()
    assert ((ge >= 0) & (ge < E)).all() and all(len(set(r.tolist())) == K for r in ge)
    ok = ~near
    got_set, got_order = ge.sort(dim=1)
    ref_set, ref_order = ref_e.long().sort(dim=1)
    assert torch.equal(got_set[ok], ref_set[ok]), "selected experts differ from the reference"
    # Listed in descending key, up to the fp32 rounding of the GPU's keys.
    k_sel = keys.gather(1, ge)
    assert bool((k_sel[:, :-1] >= k_sel[:, 1:] - 4e-6).all()), "experts not in descending key order"
    if n_group > 1:
        assert group_mask(keys, n_group, topk_group).gather(1, ge)[ok].all(), "an expert of a dropped group"
        for row in ge // (E // n_group):
            assert len(set(row.tolist())) <= topk_group, "experts from more than topk_group groups"
    assert rel_err(scores.cpu(), expected_scores(l64, ge, routing, renorm, scale)) < 2e-6
    assert rel_err(scores.cpu().gather(1, got_order)[ok], ref_s.gather(1, ref_order)[ok]) < 2e-6


@pytest.mark.parametrize("E,K,routing,renorm,scale,n_group,topk_group",
                         [c for c in router_cases() if c[0] in (8, 256, 1024)])
def test_topk_router_backward_options(E, K, routing, renorm, scale, n_group, topk_group):
    T, dev = 200, "cuda"
    logits = torch.randn(T, E, device=dev) * 2
    bias = 0.1 * torch.randn(E, device=dev) if routing in GATES else None
    scores, experts = ops().topk_router(logits, K, routing, renorm, bias, scale, n_group, topk_group)
    d_scores = torch.randn(T, K, device=dev)
    d_logits = ops().topk_router_backward(logits, scores, experts, d_scores, routing, renorm, scale, n_group,
                                          topk_group)
    l64 = logits.double().cpu().requires_grad_()
    s64 = expected_scores(l64, experts.cpu().long(), routing, renorm, scale)
    (ref,) = torch.autograd.grad((s64 * d_scores.double().cpu()).sum(), l64)
    # Measured on the scale of d_scores: with K = 1 and renormalisation the score is the constant
    # routed_scaling_factor, so the true gradient is 0 and the kernel's is fp32 rounding.
    if K == 1 and renorm and routing in GATES:
        assert (d_logits.cpu().double() - ref).norm().item() < 1e-5 * d_scores.double().norm().item()
    else:
        assert rel_err(d_logits.cpu(), ref) < 1e-5


def test_small_router_options_refused_with_the_field_named():
    logits = torch.randn(4, 16, device="cuda")
    for args, word in [(("sigmoid", True, None, 1.0, 3, 1), "n_group"),
                       (("sigmoid", True, None, 1.0, 4, 5), "topk_group"),
                       (("softmax_topk", True, None, 1.0, 4, 2), "n_group"),
                       (("sigmoid", True, None, 0.0, 1, 1), "routed_scaling_factor"),
                       (("sigmoid", True, None, 1.0, 64, 2), "n_group")]:
        with pytest.raises(Exception, match=word):
            ops().topk_router(logits, 2, *args)


# ---------------------------------------------------------------- the layer

def redraw_router_near_ties(t, K, routing, sel, router_bias, n_group, topk_group, max_rounds=50):
    """Redraws the rows of t["x"] whose float64 selection (groups and experts) is within the GPU's
    rounding of another (window as gpu_test_helpers.redraw_near_ties)."""
    x, wr = t["x"], t["router_weight"].double()
    eps_scale = 2 ** -16 * wr.norm(dim=1).max()
    for _ in range(max_rounds):
        logits = F.linear(x.double(), wr, None if router_bias is None else router_bias.double())
        keys = selection_keys(logits, routing, sel)
        near = near_tie_tokens(keys, K, n_group, topk_group, float(eps_scale * x.double().norm(dim=1).max()))
        if not near.any():
            return t
        x[near] = torch.randn(int(near.sum()), x.shape[1], device=x.device).to(x.dtype)
    raise AssertionError("redraw_router_near_ties: tokens still near a tie")


def layer_grads(t, g, K, backend, dtype, opts):
    names = [k for k in ("x", "router_weight", "router_bias", "w1", "w2", "b1", "b2") if t.get(k) is not None]
    leaves = {k: t[k].detach().to(dtype or t[k].dtype).requires_grad_() for k in names}
    sel = opts.get("selection_bias")
    kw = dict(opts, selection_bias=None if sel is None else sel.to(dtype or torch.float32))
    out, aux = functional.moe(leaves["x"], leaves["router_weight"], leaves["w1"], leaves["w2"],
                              num_experts_per_tok=K, b1=leaves.get("b1"), b2=leaves.get("b2"),
                              router_bias=leaves.get("router_bias"), backend=backend, **kw)
    got = torch.autograd.grad([out, aux], [leaves[k] for k in names], [g.to(out.dtype), torch.full_like(aux, 0.37)])
    return out.detach(), aux.detach(), dict(zip(names, got))


def check_layer(T, d, n, E, K, routing, renorm=True, scale=1.0, n_group=1, topk_group=1, router_bias=False,
                bias=False):
    t = make_layer(T, d, n, E, "swiglu", bias)
    if router_bias:
        t["router_bias"] = (0.05 * torch.randn(E, device="cuda")).bfloat16()
    sel = 0.05 * torch.randn(E, device="cuda") if routing in GATES else None
    redraw_router_near_ties(t, K, routing, sel, t.get("router_bias"), n_group, topk_group)
    opts = dict(routing=routing, renormalize=renorm, selection_bias=sel, routed_scaling_factor=scale,
                n_group=n_group, topk_group=topk_group)
    g = torch.randn(T, d, device="cuda").bfloat16()
    out, aux, got = layer_grads(t, g, K, "machmoe", None, opts)
    out64, aux64, ref = layer_grads(t, g, K, "torch", torch.float64, opts)
    out16, _, base = layer_grads(t, g, K, "torch", None, opts)
    err, err_base = rel_err(out, out64), rel_err(out16, out64)
    assert err <= max(2 * err_base, 2 ** -7), f"out: error {err:.3e} > 2x torch bf16's {err_base:.3e}"
    assert abs(float(aux) - float(aux64)) <= 1e-4 * max(1.0, abs(float(aux64)))
    for k in ref:
        assert got[k].isfinite().all(), f"d{k}: non-finite"
        err, err_base = rel_err(got[k], ref[k]), rel_err(base[k], ref[k])
        assert err <= max(2 * err_base, 2 ** -7), f"d{k}: error {err:.3e} > 2x torch bf16's {err_base:.3e}"


def layer_cases():
    for E in E_VALUES:
        for K in sorted({min(8, E), min(32, E)}):
            yield E, K, "sqrt_softplus", True, 2.5, 1, 1, False
            yield E, K, "sigmoid", True, 2.5, (8 if E >= 16 else 4), (4 if E >= 16 else 2), False
            yield E, K, "softmax_topk", True, 1.0, 1, 1, True
    yield 256, 8, "sqrt_softplus", True, 1.5, 8, 4, True
    yield 384, 8, "topk_softmax", True, 2.0, 1, 1, True
    yield 256, 8, "sigmoid", False, 1.0, 1, 1, True


@pytest.mark.parametrize("E,K,routing,renorm,scale,n_group,topk_group,router_bias", list(layer_cases()))
def test_layer_router_options(E, K, routing, renorm, scale, n_group, topk_group, router_bias):
    if n_group > 1 and K > topk_group * (E // n_group):
        pytest.skip("K exceeds the kept groups' experts")
    check_layer(256, 128, 64, E, K, routing, renorm, scale, n_group, topk_group, router_bias, bias=(E == 8))


def test_small_layer_router_bias_gradient_is_the_column_sum():
    # The router bias's gradient is Σ_t d_logits: with a loss on the aux loss only it must be what
    # the torch backend gives in float64 (small tensors checked on their own scale), T not a
    # multiple of the 64-token chunks.
    check_layer(67, 64, 32, 16, 4, "softmax_topk", router_bias=True)


def test_small_default_routing_is_bitwise_unchanged_by_neutral_options():
    # routed_scaling_factor 1 and n_group 1 must leave the default path exactly as it was.
    T, E, K = 300, 128, 8
    logits = torch.randn(T, E, device="cuda")
    for routing, renorm in [("softmax_topk", True), ("topk_softmax", False), ("sigmoid", True)]:
        a = ops().topk_router(logits, K, routing, renorm, None)
        b = ops().topk_router(logits, K, routing, renorm, None, 1.0, 1, 1)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
