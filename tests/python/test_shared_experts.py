"""Shared experts (machmoe.shared_experts and MoE(num_shared_experts=...)) on the torch backend,
against the formula written out here in float64: out_t = g_t · Σ_s W2_s·act(W1_s·x_t + b1_s) + b2_s,
g_t = sigmoid(x_t·gᵀ) or 1; every gradient by autograd through that formula. The GPU kernels run
the same list in tests/python/test_gpu_shared_experts.py."""

import pytest
import torch
import torch.nn.functional as F

import machmoe
from machmoe.shared_experts import shared_expert_routing, shared_experts


def glu(h, layout):
    """SwiGLU of H [T, 2n] in the given gate/up layout -> [T, n]."""
    if layout == "interleaved":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def formula(x, w1, w2, b1, b2, gate, layout):
    out = torch.zeros_like(x)
    for s in range(w1.shape[0]):
        h = x @ w1[s].T + (0 if b1 is None else b1[s])
        out = out + glu(h, layout) @ w2[s].T + (0 if b2 is None else b2[s])
    if gate is not None:
        out = out * torch.sigmoid(x @ gate.T)
    return out


def random_case(T, d, n, S, bias, gate, seed):
    g = torch.Generator().manual_seed(seed)
    t = {
        "x": torch.randn(T, d, generator=g, dtype=torch.float64),
        "w1": torch.randn(S, 2 * n, d, generator=g, dtype=torch.float64) * 0.3,
        "w2": torch.randn(S, d, n, generator=g, dtype=torch.float64) * 0.3,
        "b1": torch.randn(S, 2 * n, generator=g, dtype=torch.float64) if bias else None,
        "b2": torch.randn(S, d, generator=g, dtype=torch.float64) if bias else None,
        "gate": torch.randn(1, d, generator=g, dtype=torch.float64) if gate else None,
    }
    return {k: None if v is None else v.requires_grad_() for k, v in t.items()}


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_shared_experts_match_formula(S, bias, gate, layout):
    t = random_case(T=13, d=16, n=8, S=S, bias=bias, gate=gate, seed=S * 8 + bias * 4 + gate * 2 + (layout == "interleaved"))
    out = shared_experts(t["x"], t["w1"], t["w2"], gate_weight=t["gate"], b1=t["b1"], b2=t["b2"],
                         layout=layout, backend="torch")
    ref = formula(t["x"], t["w1"], t["w2"], t["b1"], t["b2"], t["gate"], layout)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    leaves = [v for v in t.values() if v is not None]
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_routing_list_visits_every_shared_expert_in_token_order():
    token, expert = shared_expert_routing(3, 2, torch.device("cpu"))
    assert token.tolist() == [0, 0, 1, 1, 2, 2]
    assert expert.tolist() == [0, 1, 0, 1, 0, 1]
    token, expert = shared_expert_routing(0, 2, torch.device("cpu"))
    assert token.numel() == 0 and expert.numel() == 0


def test_routing_list_in_token_runs():
    token, expert = shared_expert_routing(6, 2, torch.device("cpu"), chunks=3)
    assert token.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert expert.tolist() == [0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5]  # shared expert s, run j -> s*3 + j


@pytest.mark.parametrize("T, N1, d, n, S, sms, m", [
    (24576, 512, 1536, 256, 1, 132, 11),   # 7B-a-sized shared expert: 24 dW2 tiles -> 11 runs
    (32768, 1024, 4096, 512, 1, 132, 3),   # 30B-b-sized: 128 dW2 tiles
    (32768, 4096, 7168, 2048, 1, 132, 1),  # DeepSeek-V3-sized: 896 tiles fill the GPU already
    (3000, 512, 1536, 256, 1, 132, 2),     # few tokens: runs of at least 1024 rows
    (1, 512, 1536, 256, 2, 132, 1),
])
def test_token_chunks(T, N1, d, n, S, sms, m):
    from machmoe.shared_experts import token_chunks

    assert token_chunks(T, N1, d, n, S, sms) == m


def test_moe_with_shared_experts_adds_their_output():
    torch.manual_seed(0)
    layer = machmoe.MoE(num_experts=4, num_experts_per_tok=2, hidden_size=16, intermediate_size=8,
                        gate_up_layout="concatenated", num_shared_experts=2, shared_intermediate_size=24,
                        shared_expert_gate=True, std=0.2, backend="torch").double()
    assert layer.shared_c_fc.weight.shape == (2, 48, 16)
    assert layer.shared_c_proj.weight.shape == (2, 16, 24)
    assert layer.shared_gate.weight.shape == (1, 16)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out, aux = layer(x)
    routed, aux_routed = machmoe.functional.moe(
        x.reshape(-1, 16), layer.router.weight, layer.c_fc.weight, layer.c_proj.weight,
        num_experts_per_tok=2, layout="concatenated", backend="torch")
    shared = formula(x.reshape(-1, 16), layer.shared_c_fc.weight, layer.shared_c_proj.weight, None, None,
                     layer.shared_gate.weight, "concatenated")
    torch.testing.assert_close(out.reshape(-1, 16), routed + shared, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux, aux_routed)
    out.sum().backward()
    for name in ("shared_c_fc.weight", "shared_c_proj.weight", "shared_gate.weight", "c_fc.weight"):
        p = dict(layer.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "num_shared_experts=2" in repr(layer)


def test_moe_without_shared_experts_has_no_shared_parameters():
    layer = machmoe.MoE(4, 2, 16, 8, backend="torch")
    assert not any("shared" in name for name, _ in layer.named_parameters())


@pytest.mark.parametrize("kwargs, match", [
    ({"num_shared_experts": -1}, "num_shared_experts must be an int >= 0"),
    ({"num_shared_experts": 1, "shared_intermediate_size": 0}, "shared_intermediate_size must be >= 1"),
    ({"shared_expert_gate": True}, "shared_expert_gate=True needs num_shared_experts >= 1"),
])
def test_moe_refuses_bad_shared_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        machmoe.MoE(4, 2, 16, 8, **kwargs)


def test_shared_experts_refuse_a_bad_gate_shape():
    t = random_case(T=4, d=16, n=8, S=1, bias=False, gate=False, seed=0)
    with pytest.raises(ValueError, match=r"gate_weight must have shape \[1, 16\]"):
        shared_experts(t["x"], t["w1"], t["w2"], gate_weight=torch.zeros(2, 16, dtype=torch.float64))


def test_moe_packs_shared_experts_after_the_routed_ones():
    """The module places shared_c_fc.weight right after c_fc.weight in memory (and so on), also
    after .to(): the kernels then read [E+S, ...] without a copy. Values, parameters and the
    state_dict are unchanged by it."""
    torch.manual_seed(0)
    layer = machmoe.MoE(4, 2, 16, 8, num_shared_experts=2, add_bias=True, backend="torch")

    def adjacent(a, b):
        return a.is_contiguous() and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()

    for routed, shared in ((layer.c_fc, layer.shared_c_fc), (layer.c_proj, layer.shared_c_proj)):
        assert adjacent(routed.weight, shared.weight) and adjacent(routed.bias, shared.bias)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    params = dict(layer.named_parameters())
    layer = layer.double()
    assert all(params[k] is p for k, p in layer.named_parameters())  # the same Parameter objects
    for routed, shared in ((layer.c_fc, layer.shared_c_fc), (layer.c_proj, layer.shared_c_proj)):
        assert routed.weight.dtype == torch.float64
        assert adjacent(routed.weight, shared.weight) and adjacent(routed.bias, shared.bias)
    after = layer.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k].to(after[k].dtype), rtol=0, atol=0)
    # A state_dict loads into the packed parameters in place.
    other = machmoe.MoE(4, 2, 16, 8, num_shared_experts=2, add_bias=True, backend="torch").double()
    other.load_state_dict(after)
    assert adjacent(other.c_fc.weight, other.shared_c_fc.weight)
    torch.testing.assert_close(other.shared_c_fc.weight, layer.shared_c_fc.weight, rtol=0, atol=0)


def test_functional_moe_with_shared_experts_is_routed_plus_shared():
    t = random_case(T=7, d=16, n=8, S=2, bias=True, gate=True, seed=3)
    E, K = 4, 2
    g = torch.Generator().manual_seed(4)
    wr = torch.randn(E, 16, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, 16, 16, generator=g, dtype=torch.float64) * 0.2
    w2 = torch.randn(E, 16, 8, generator=g, dtype=torch.float64) * 0.2
    out, aux = machmoe.functional.moe(t["x"], wr, w1, w2, num_experts_per_tok=K, backend="torch",
                                      shared_w1=t["w1"], shared_w2=t["w2"], shared_b1=t["b1"], shared_b2=t["b2"],
                                      shared_gate=t["gate"])
    routed, aux_routed = machmoe.functional.moe(t["x"], wr, w1, w2, num_experts_per_tok=K, backend="torch")
    shared = formula(t["x"], t["w1"], t["w2"], t["b1"], t["b2"], t["gate"], "interleaved")
    torch.testing.assert_close(out, routed + shared, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux, aux_routed)


@pytest.mark.parametrize("change, match", [
    ({"shared_w2": None}, "shared_w1 and shared_w2 must both be given"),
    ({"shared_w1": None, "shared_w2": None, "shared_gate": "keep"}, "shared_w1 and shared_w2 must both be given"),
    ({"shared_w1": "bad"}, r"shared experts \(shared_w1.*w1 must have shape"),
    ({"shared_gate": "bad"}, r"shared experts \(shared_w1.*gate_weight must have shape \[1, 16\]"),
])
def test_functional_moe_names_bad_shared_arguments(change, match):
    t = random_case(T=5, d=16, n=8, S=1, bias=False, gate=True, seed=5)
    wr = torch.randn(4, 16, dtype=torch.float64)
    w1 = torch.randn(4, 16, 16, dtype=torch.float64)
    w2 = torch.randn(4, 16, 8, dtype=torch.float64)
    kwargs = {"shared_w1": t["w1"], "shared_w2": t["w2"], "shared_gate": t["gate"]}
    bad = {"shared_w1": torch.zeros(1, 15, 16, dtype=torch.float64),
           "shared_gate": torch.zeros(2, 16, dtype=torch.float64)}
    for k, v in change.items():
        kwargs[k] = bad[k] if v == "bad" else (kwargs[k] if v == "keep" else v)
    with pytest.raises(ValueError, match=match):
        machmoe.functional.moe(t["x"], wr, w1, w2, num_experts_per_tok=2, backend="torch", **kwargs)
