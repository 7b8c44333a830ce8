"""machmoe's routing of recent MoE models against how transformers' model code routes.

For DeepSeek-V3, GLM-4.5, MiniMax-M2, gpt-oss, Qwen3-MoE and DeepSeek-V4, a float64
re-statement of the model's router (written here, step by step as the model code does it) is
checked against the installed transformers router module, and the torch backend
(`machmoe.functional.route` / `moe`) is checked against the re-statement in float64: the chosen
experts exactly, the scores and their gradients (into the router weight, its bias and x) to
rounding. Some transformers routers compute in float32 (DeepSeek-V3 and GLM cast to it, MiniMax-M2's
sigmoid and Qwen3's softmax run in it), so the re-statement is compared with them to float32
rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from machmoe import functional, torch_backend
from machmoe.enums import RoutingMethod

F64 = torch.float64


# ---------------------------------------------------------------- the re-statements (float64)
# Each returns (logits [T, E], weights [T, K], indices [T, K]) as the model's router does.

def deepseek_v3_router(logits, correction_bias, K, n_group, topk_group, norm, scale):
    """DeepSeek-V3 / GLM-4.5 / Kimi, from the logits: sigmoid scores, group-limited selection on
    scores + bias (group score: sum of the top 2), the experts of dropped groups filled with -inf,
    renormalised with + 1e-20, times routed_scaling_factor."""
    scores = logits.sigmoid()
    choice = scores + correction_bias
    T, E = choice.shape
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=K, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, w * scale, idx


def minimax_m2_router(logits, correction_bias, K):
    """MiniMax-M2: sigmoid scores, top-K of scores + bias, renormalised (no epsilon)."""
    scores = logits.sigmoid()
    idx = torch.topk(scores + correction_bias, K, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    return logits, w / w.sum(dim=-1, keepdim=True), idx


def gpt_oss_router(logits, K):
    """gpt-oss (logits carry the router bias): top-K logits, softmax over those K."""
    top, idx = torch.topk(logits, K, dim=-1)
    return logits, torch.softmax(top, dim=1), idx


def qwen3_moe_router(logits, K, norm):
    """Qwen3-MoE: softmax over all E, top-K, optionally renormalised."""
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, K, dim=-1)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def deepseek_v4_router(logits, correction_bias, K, scale):
    """DeepSeek-V4: sqrt(softplus) scores, top-K of scores + bias, renormalised with + 1e-20,
    times routed_scaling_factor."""
    scores = F.softplus(logits).sqrt()
    idx = torch.topk(scores + correction_bias, K, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, w * scale, idx


# ---------------------------------------------------------------- the cases

# name -> (E, K, machmoe route() options)
CASES = {
    "deepseek_v3": (16, 4, dict(routing="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "glm4_moe": (16, 4, dict(routing="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "kimi_k2_like": (16, 6, dict(routing="sigmoid", n_group=1, topk_group=1, routed_scaling_factor=2.827)),
    "minimax_m2": (16, 4, dict(routing="sigmoid")),
    "gpt_oss": (16, 4, dict(routing="softmax_topk")),
    "qwen3_moe": (16, 4, dict(routing="topk_softmax", renormalize=True)),
    "qwen3_moe_no_norm": (16, 4, dict(routing="topk_softmax", renormalize=False)),
    "deepseek_v4": (16, 4, dict(routing="sqrt_softplus", routed_scaling_factor=1.5)),
}


def make_params(T, d, E, negative_bias=False):
    """x [T, d], router weight [E, d], and the model's bias [E] (correction bias or router bias)."""
    x = torch.randn(T, d, dtype=F64)
    weight = torch.randn(E, d, dtype=F64) / d**0.5
    # A bias of the size trained correction biases reach; all negative (negative_bias) makes
    # every selection value negative, where the groups' -inf fill matters.
    bias = torch.rand(E, dtype=F64) * 0.5 - (3.0 if negative_bias else 0.25)
    return x, weight, bias


def model_logits(name, x, weight, bias):
    return F.linear(x, weight, bias if name == "gpt_oss" else None)


def restated(name, x, weight, bias, K, opts):
    logits = model_logits(name, x, weight, bias)
    if name in ("deepseek_v3", "glm4_moe", "kimi_k2_like"):
        return deepseek_v3_router(logits, bias, K, opts["n_group"], opts["topk_group"], True,
                                  opts["routed_scaling_factor"])
    if name == "minimax_m2":
        return minimax_m2_router(logits, bias, K)
    if name == "gpt_oss":
        return gpt_oss_router(logits, K)
    if name.startswith("qwen3_moe"):
        return qwen3_moe_router(logits, K, opts["renormalize"])
    return deepseek_v4_router(logits, bias, K, opts["routed_scaling_factor"])


def machmoe_route(name, x, weight, bias, K, opts):
    """machmoe's routing of the same model: (logits, scores [T, K], experts [T, K])."""
    router_bias = bias if name == "gpt_oss" else None
    selection_bias = bias if opts["routing"] in ("sigmoid", "sqrt_softplus") else None
    logits = torch_backend.router_logits(x, weight, router_bias)
    scores, experts = functional.route(logits, K, selection_bias=selection_bias, **opts)
    return logits, scores, experts


def by_expert(w, idx):
    """(weights, indices) with each row sorted by expert index (the models' top-K is unsorted)."""
    order = idx.argsort(dim=1)
    return w.gather(1, order), idx.gather(1, order)


def dense(w, idx, E):
    return torch.zeros(w.shape[0], E, dtype=w.dtype).scatter(1, idx, w)


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ---------------------------------------------------------------- torch backend vs re-statement

@pytest.mark.parametrize("negative_bias", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_backend_routes_as_the_model(name, negative_bias):
    E, K, opts = CASES[name]
    T, d = 64, 24
    x, weight, bias = make_params(T, d, E, negative_bias)
    x.requires_grad_(True), weight.requires_grad_(True), bias.requires_grad_(name == "gpt_oss")
    l_ref, w_ref, i_ref = restated(name, x, weight, bias, K, opts)
    l_got, w_got, i_got = machmoe_route(name, x, weight, bias, K, opts)
    assert rel(l_got, l_ref) < 1e-15
    w_ref_s, i_ref_s = by_expert(w_ref, i_ref)
    w_got_s, i_got_s = by_expert(w_got, i_got)
    assert torch.equal(i_got_s, i_ref_s), "different experts chosen"
    assert rel(w_got_s, w_ref_s) < 1e-13
    # machmoe lists the K experts in descending selection key: check the order too
    if opts["routing"] in ("sigmoid", "sqrt_softplus"):
        gates = torch_backend.gate(l_got.detach(), RoutingMethod(opts["routing"]))
        key = (gates + bias.detach()).gather(1, i_got)
    else:
        key = l_got.detach().gather(1, i_got)
    assert bool((key[:, :-1] >= key[:, 1:]).all())
    # Gradients of Σ G ⊙ dense(scores) into x, the router weight and the router bias.
    G = torch.randn(T, E, dtype=F64)
    inputs = [x, weight] + ([bias] if name == "gpt_oss" else [])
    g_ref = torch.autograd.grad((G * dense(w_ref, i_ref, E)).sum(), inputs)
    g_got = torch.autograd.grad((G * dense(w_got, i_got, E)).sum(), inputs)
    for which, a, b in zip(("x", "weight", "bias"), g_got, g_ref):
        assert rel(a, b) < 1e-12, which


def test_group_selection_excludes_dropped_groups_with_negative_values():
    # Every selection value negative: the -inf fill still keeps the dropped groups out (a 0.0 fill
    # would choose their experts first).
    E, K, T = 16, 8, 32
    x, weight, bias = make_params(T, 8, E, negative_bias=True)
    logits = F.linear(x, weight)
    scores, experts = functional.route(logits, K, routing="sigmoid", selection_bias=bias, n_group=4, topk_group=2)
    assert bool((logits.sigmoid() + bias < 0).all())
    groups = experts // (E // 4)
    assert all(len(set(row.tolist())) <= 2 for row in groups), "experts from more than topk_group groups"
    _, _, i_ref = deepseek_v3_router(logits, bias, K, 4, 2, True, 1.0)
    assert torch.equal(experts.sort(dim=1).values, i_ref.sort(dim=1).values)


def test_group_selection_can_fail():
    # The check above must see a wrong selection: route without groups picks other experts.
    E, K, T = 16, 8, 32
    x, weight, bias = make_params(T, 8, E, negative_bias=True)
    logits = F.linear(x, weight)
    _, plain = functional.route(logits, K, routing="sigmoid", selection_bias=bias)
    _, _, i_ref = deepseek_v3_router(logits, bias, K, 4, 2, True, 1.0)
    assert not torch.equal(plain.sort(dim=1).values, i_ref.sort(dim=1).values)


def test_layer_with_model_routing_matches_restated_router_and_experts():
    # The whole torch-backend layer (router bias, groups, scaling) equals the re-stated router
    # followed by the experts on its pairs, forward and backward.
    T, d, n, E, K = 40, 16, 8, 16, 4
    x = torch.randn(T, d, dtype=F64, requires_grad=True)
    wr = (torch.randn(E, d, dtype=F64) / d**0.5).requires_grad_()
    br = (torch.randn(E, dtype=F64) * 0.1).requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, dtype=F64) / d**0.5).requires_grad_()
    w2 = (torch.randn(E, d, n, dtype=F64) / n**0.5).requires_grad_()
    sel = torch.rand(E, dtype=F64) * 0.2
    out, _ = functional.moe(x, wr, w1, w2, num_experts_per_tok=K, routing="sigmoid", selection_bias=sel,
                            router_bias=br, routed_scaling_factor=2.5, n_group=4, topk_group=2, backend="torch")
    _, w, idx = deepseek_v3_router(F.linear(x, wr, br), sel, K, 4, 2, True, 2.5)
    token = torch.arange(T).repeat_interleave(K)
    ref = torch_backend.experts(x, w1, None, w2, None, token, idx.reshape(-1), w.reshape(-1), "swiglu")
    assert rel(out, ref) < 1e-13
    dout = torch.randn(T, d, dtype=F64)
    params = [x, wr, br, w1, w2]
    g_got = torch.autograd.grad((out * dout).sum(), params)
    g_ref = torch.autograd.grad((ref * dout).sum(), params)
    for name, a, b in zip(("x", "router_weight", "router_bias", "w1", "w2"), g_got, g_ref):
        assert rel(a, b) < 1e-12, name


def test_route_and_moe_reject_bad_router_options():
    logits = torch.randn(4, 16)
    bad = [
        (dict(routing="sigmoid", n_group=3), "n_group"),
        (dict(routing="sigmoid", n_group=4, topk_group=5), "topk_group"),
        (dict(routing="sigmoid", n_group=4, topk_group=1), "num_experts_per_tok"),  # K = 5 > 4
        (dict(routing="softmax_topk", n_group=4, topk_group=2), "n_group"),
        (dict(routing="sigmoid", n_group=16, topk_group=8), "experts per group"),
        (dict(routing="sigmoid", routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(routing="sigmoid", routed_scaling_factor=1e300), "routed_scaling_factor"),
        # finite as a double, infinite once cast to float32 (the kernels' type)
        (dict(routing="sigmoid", routed_scaling_factor=3.4028236e38), "routed_scaling_factor"),
        (dict(routing="sigmoid", routed_scaling_factor=float("nan")), "routed_scaling_factor"),
        (dict(routing="softmax_topk", selection_bias=torch.zeros(16)), "selection_bias"),
    ]
    for kwargs, word in bad:
        with pytest.raises(ValueError, match=word):
            functional.route(logits, 5, **kwargs)
    functional.route(logits, 5, routing="sigmoid", routed_scaling_factor=3.4028235e38)  # float32's max
    x, wr = torch.randn(4, 8), torch.randn(16, 8)
    w1, w2 = torch.randn(16, 8, 8), torch.randn(16, 8, 4)
    with pytest.raises(ValueError, match="router_bias"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, router_bias=torch.zeros(15), backend="torch")
    with pytest.raises(ValueError, match="token rounding"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, token_rounding="nr", routed_scaling_factor=2.0,
                       backend="torch")


def test_moe_module_router_options():
    from machmoe import MoE

    m = MoE(16, 4, 16, 8, routing="sqrt_softplus", router_bias=True, routed_scaling_factor=1.5, n_group=4,
            topk_group=2, backend="torch").double()
    assert m.router.bias is not None and m.selection_bias is not None
    out, _ = m(torch.randn(2, 5, 16, dtype=F64))
    out.sum().backward()
    assert m.router.bias.grad is not None and float(m.router.bias.grad.abs().sum()) > 0


# ---------------------------------------------------------------- re-statement vs transformers

def _transformers_router(name, E, K, d, opts):
    """The transformers router module of the model with a tiny config, and how it takes its bias."""
    transformers = pytest.importorskip("transformers")
    if name in ("deepseek_v3", "kimi_k2_like"):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        cfg = transformers.DeepseekV3Config(hidden_size=d, n_routed_experts=E, num_experts_per_tok=K,
                                            n_group=opts["n_group"], topk_group=opts["topk_group"],
                                            routed_scaling_factor=opts["routed_scaling_factor"], norm_topk_prob=True)
        return DeepseekV3TopkRouter(cfg), "correction"
    if name == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
        cfg = transformers.Glm4MoeConfig(hidden_size=d, n_routed_experts=E, num_experts_per_tok=K,
                                         n_group=opts["n_group"], topk_group=opts["topk_group"],
                                         routed_scaling_factor=opts["routed_scaling_factor"], norm_topk_prob=True)
        return Glm4MoeTopkRouter(cfg), "correction"
    if name == "minimax_m2":
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
        cfg = transformers.MiniMaxM2Config(hidden_size=d, num_local_experts=E, num_experts_per_tok=K)
        return MiniMaxM2TopKRouter(cfg), "argument"
    if name == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
        cfg = transformers.GptOssConfig(hidden_size=d, num_local_experts=E, num_experts_per_tok=K)
        return GptOssTopKRouter(cfg), "router"
    if name.startswith("qwen3_moe"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
        cfg = transformers.Qwen3MoeConfig(hidden_size=d, num_experts=E, num_experts_per_tok=K,
                                          norm_topk_prob=opts["renormalize"])
        return Qwen3MoeTopKRouter(cfg), None
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = transformers.DeepseekV4Config(hidden_size=d, n_routed_experts=E, num_experts_per_tok=K,
                                        routed_scaling_factor=opts["routed_scaling_factor"])
    return v4.DeepseekV4TopKRouter(cfg), "correction"


@pytest.mark.parametrize("name", list(CASES))
def test_restatement_matches_the_transformers_router(name):
    E, K, opts = CASES[name]
    T, d = 48, 24
    x, weight, bias = make_params(T, d, E)
    router, bias_kind = _transformers_router(name, E, K, d, opts)
    router = router.double()
    with torch.no_grad():
        router.weight.copy_(weight)
        if bias_kind == "correction":
            router.e_score_correction_bias.copy_(bias)
        if bias_kind == "router":
            router.bias.copy_(bias)
        _, w_t, i_t = router(x, bias) if bias_kind == "argument" else router(x)
        _, w_r, i_r = restated(name, x, weight, bias, K, opts)
    w_t, i_t = by_expert(w_t.double(), i_t)
    w_r, i_r = by_expert(w_r, i_r)
    assert torch.equal(i_t, i_r), "different experts chosen"
    # DeepSeek-V3 / GLM cast to float32, MiniMax-M2's sigmoid and Qwen3's softmax run in float32:
    # float32 rounding there.
    float32_inside = name in ("deepseek_v3", "glm4_moe", "kimi_k2_like", "minimax_m2") or name.startswith("qwen3")
    assert rel(w_t, w_r) < (1e-6 if float32_inside else 1e-14)


# ---------------------------------------------------------------- torch backend vs the C++ reference

@pytest.mark.ops
@pytest.mark.parametrize("routing,renorm,scale,n_group,topk_group", [
    ("sqrt_softplus", True, 1.0, 1, 1), ("sqrt_softplus", False, 2.5, 1, 1), ("sigmoid", True, 2.5, 4, 2),
    ("sqrt_softplus", True, 1.5, 4, 1), ("softmax_topk", True, 2.0, 1, 1), ("topk_softmax", False, 0.5, 1, 1),
])
def test_torch_backend_matches_cpp_reference_router_options(routing, renorm, scale, n_group, topk_group):
    from machmoe import reference

    T, d, n, E, K = 37, 16, 8, 16, 4
    x = torch.randn(T, d, dtype=F64)
    wr = torch.randn(E, d, dtype=F64) / d**0.5
    br = torch.randn(E, dtype=F64) * 0.2
    w1 = torch.randn(E, 2 * n, d, dtype=F64) / d**0.5
    w2 = torch.randn(E, d, n, dtype=F64) / n**0.5
    sel = torch.rand(E, dtype=F64) * 0.5 - 1.0 if routing in ("sigmoid", "sqrt_softplus") else None
    dout = torch.randn(T, d, dtype=F64)
    opts = dict(routing=routing, renormalize=renorm, selection_bias=sel, routed_scaling_factor=scale,
                n_group=n_group, topk_group=topk_group)
    logits = F.linear(x, wr, br)
    s_ref, e_ref = reference.topk(logits, K, **opts)
    s_got, e_got = functional.route(logits, K, **opts)
    assert torch.equal(e_got.to(torch.int32), e_ref)
    assert rel(s_got, s_ref) < 1e-14
    ref = reference.layer(x, wr, w1, w2, dout, num_experts_per_tok=K, d_aux=0.3, router_bias=br, **opts)
    leaves = [t.clone().requires_grad_() for t in (x, wr, br, w1, w2)]
    out, aux = functional.moe(leaves[0], leaves[1], leaves[3], leaves[4], num_experts_per_tok=K,
                              router_bias=leaves[2], backend="torch", **opts)
    assert rel(out, ref.out) < 1e-13
    assert abs(float(aux) - float(ref.aux)) < 1e-13
    got = torch.autograd.grad([out, aux], leaves, [dout, torch.tensor(0.3, dtype=F64)])
    for name, g, r in zip(("dx", "d_router_weight", "d_router_bias", "dw1", "dw2"), got,
                          (ref.dx, ref.d_router_weight, ref.d_router_bias, ref.dw1, ref.dw2)):
        assert rel(g, r) < 1e-12, name


@pytest.mark.ops
def test_layer_with_router_options_traces_on_fake_tensors():
    # The machmoe backend's autograd node with a router bias and the router options, on fake
    # tensors (torch.compile's tracing): the router bias gets a gradient of its shape and dtype.
    from torch._subclasses.fake_tensor import FakeTensorMode

    T, d, n, E, K = 77, 128, 64, 16, 4
    with FakeTensorMode():
        def param(*shape):
            return torch.empty(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

        x, wr, br, w1, w2 = param(T, d), param(E, d), param(E), param(E, 2 * n, d), param(E, d, n)
        sel = torch.empty(E, device="cuda")
        out, aux = functional.moe(x, wr, w1, w2, num_experts_per_tok=K, routing="sqrt_softplus", selection_bias=sel,
                                  router_bias=br, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                  backend="machmoe")
        assert out.shape == (T, d) and aux.shape == ()
        grads = out.grad_fn.apply(torch.ones_like(out), torch.ones_like(aux))
        assert grads[7] is not None and grads[7].shape == (E,) and grads[7].dtype == torch.bfloat16
