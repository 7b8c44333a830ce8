"""The clamped SwiGLU ("clamped_swiglu", machmoe.GluClamp) on the CPU: the torch backend against
float64 transcriptions of gpt-oss's, DeepSeek-V4's and the post-activation clamp's definitions
(and against the installed transformers' own gate functions where it has them), values and
gradients, at points on both sides of every clamp and on the bounds themselves; the argument
rules; and the CPU reference op against the torch backend when the op library is built.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import machmoe
from machmoe import GluClamp, functional
from machmoe import torch_backend as tb
from machmoe.enums import resolve_glu_clamp

F64 = torch.float64

VARIANTS = {
    "gpt_oss": GluClamp.gpt_oss(),
    "deepseek_v4": GluClamp.deepseek_v4(),
    "post_activation": GluClamp.post_activation(7.0),
}


def split(h: torch.Tensor, layout: str):
    n = h.shape[-1] // 2
    return (h[..., 0::2], h[..., 1::2]) if layout == "interleaved" else (h[..., :n], h[..., n:])


def model_formula(gate: torch.Tensor, up: torch.Tensor, variant: str, c: GluClamp) -> torch.Tensor:
    """The models' definitions, transcribed (transformers: gpt_oss GptOssExperts._apply_gate,
    deepseek_v4 DeepseekV4Experts._apply_gate, step3p7 Step3p7Experts._apply_gate)."""
    L = c.limit
    if variant == "gpt_oss":
        gate = gate.clamp(min=None, max=L)
        up = up.clamp(min=-L, max=L)
        return (up + 1) * (gate * torch.sigmoid(gate * c.alpha))
    if variant == "deepseek_v4":
        return F.silu(gate.clamp(max=L)) * up.clamp(min=-L, max=L)
    return F.silu(gate).clamp(max=L) * up.clamp(min=-L, max=L)


def h_over_the_limit(rows: int, n: int, limit: float, layout: str) -> torch.Tensor:
    """H [rows, 2n] float64 with |H| up to 3·limit (about half the entries beyond a clamp), plus
    gates and ups exactly on the bounds (L and ±L), where the gradient must pass."""
    h = (torch.rand(rows, 2 * n, dtype=F64) * 6 - 3) * limit
    gate, up = split(h, layout)
    gate[0, :] = limit
    up[1, :] = limit
    up[2, :] = -limit
    return h


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_backend_matches_the_models_definition(variant, layout):
    c = resolve_glu_clamp("clamped_swiglu", VARIANTS[variant])  # float32-rounded, as every backend uses them
    h = h_over_the_limit(16, 24, c.limit, layout).requires_grad_()
    a = tb.apply_activation(h, "clamped_swiglu", layout, c)
    g = torch.randn_like(a)
    (dh,) = torch.autograd.grad(a, h, g)

    h_ref = h.detach().clone().requires_grad_()
    gate, up = split(h_ref, layout)
    a_ref = model_formula(gate, up, variant, c)
    (dh_ref,) = torch.autograd.grad(a_ref, h_ref, g)
    # The same Python float parameters on both sides; F.silu's backward rounds differently from
    # the product rule's (a few ulp).
    torch.testing.assert_close(a, a_ref, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-13, atol=1e-14)
    # Many entries are clamped (zero gradient) and many are not: the test exercises both sides.
    gate_d, up_d = split(dh, layout)
    assert (up_d == 0).float().mean() > 0.3 and (up_d != 0).float().mean() > 0.3
    if not c.clamp_after:
        assert (gate_d == 0).float().mean() > 0.2
        assert (gate_d[0] != 0).all()  # g == L passes the gradient
    assert (up_d[1] != 0).all() and (up_d[2] != 0).all()  # u == ±L passes the gradient


def test_derivatives_written_out():
    """The derivatives docs/LAYER.md gives, against autograd, for every variant (float64)."""
    for name, c in VARIANTS.items():
        g = torch.linspace(-3 * c.limit, 3 * c.limit, 241, dtype=F64)
        u = torch.linspace(-2.5 * c.limit, 2.5 * c.limit, 241, dtype=F64).flip(0)
        gate, up = g.clone().requires_grad_(), u.clone().requires_grad_()
        a = model_formula(gate, up, name, c)
        dg, du = torch.autograd.grad(a.sum(), (gate, up))
        L = c.limit
        gc = g if c.clamp_after else g.clamp(max=L)
        sig = torch.sigmoid(c.alpha * gc)
        silu = gc * sig
        f = silu.clamp(max=L) if c.clamp_after else silu
        uc = u.clamp(-L, L) + c.up_offset
        gate_passes = silu <= L if c.clamp_after else g <= L
        dg_doc = torch.where(gate_passes, sig * (1 + c.alpha * gc * (1 - sig)) * uc, 0.0)
        du_doc = torch.where((u >= -L) & (u <= L), f, 0.0)
        torch.testing.assert_close(dg, dg_doc, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(du, du_doc, rtol=1e-12, atol=1e-12, msg=name)


def test_transformers_gate_functions():
    """The installed transformers' own gate functions on the same H (float64)."""
    pytest.importorskip("transformers")
    alpha = resolve_glu_clamp("clamped_swiglu", GluClamp()).alpha  # 1.702 rounded to float32
    cfg = types.SimpleNamespace(intermediate_size=8, moe_intermediate_size=8, num_local_experts=1, hidden_size=4,
                                swiglu_alpha=alpha,
                                swiglu_limit=7.0, hidden_act="silu")
    checks = []
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
        checks.append((GptOssExperts(cfg), "interleaved", GluClamp.gpt_oss(7.0, alpha)))
    except ImportError:
        pass
    try:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
        checks.append((DeepseekV4Experts(cfg), "concatenated", GluClamp.deepseek_v4(7.0)))
    except ImportError:
        pass
    try:
        from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts
        checks.append((Step3p7Experts(cfg, swiglu_limit=7.0), "concatenated", GluClamp.post_activation(7.0)))
    except (ImportError, AttributeError, TypeError):
        pass
    if not checks:
        pytest.skip("this transformers has none of the clamped models")
    for module, layout, c in checks:
        # Releases whose gpt-oss keeps alpha = 1.702 itself (not from the config) use the value
        # machmoe rounds to float32: the outputs then differ by that rounding (~3e-8 relative).
        own_alpha = getattr(module, "alpha", alpha)
        tol = 1e-13 if float(torch.tensor(own_alpha, dtype=torch.float32)) == own_alpha else 1e-7
        h = h_over_the_limit(8, 8, c.limit, layout).requires_grad_()
        a = tb.apply_activation(h, "clamped_swiglu", layout, c)
        g = torch.randn_like(a)
        (dh,) = torch.autograd.grad(a, h, g)
        h_ref = h.detach().clone().requires_grad_()
        a_ref = module._apply_gate(h_ref)
        (dh_ref,) = torch.autograd.grad(a_ref, h_ref, g)
        torch.testing.assert_close(a, a_ref, rtol=tol, atol=tol, msg=type(module).__name__)
        torch.testing.assert_close(dh, dh_ref, rtol=tol, atol=tol, msg=type(module).__name__)


def test_a_wrong_clamp_fails_the_comparison():
    """The comparison above can fail: another limit changes the values."""
    h = h_over_the_limit(8, 8, 7.0, "interleaved")
    a = tb.apply_activation(h, "clamped_swiglu", "interleaved", GluClamp(limit=7.5))
    gate, up = split(h, "interleaved")
    assert not torch.allclose(a, model_formula(gate, up, "gpt_oss", GluClamp()))


def test_parameter_rules():
    assert resolve_glu_clamp("clamped_swiglu", None) == GluClamp(alpha=1.7020000219345093)  # float32(1.702)
    assert resolve_glu_clamp("swiglu", None) is None
    with pytest.raises(ValueError, match="clamped_swiglu"):
        resolve_glu_clamp("swiglu", GluClamp())
    for bad in (GluClamp(alpha=0.0), GluClamp(limit=-1.0), GluClamp(limit=float("nan")),
                GluClamp(up_offset=float("inf"))):
        with pytest.raises(ValueError, match="glu_clamp"):
            resolve_glu_clamp("clamped_swiglu", bad)
    with pytest.raises(ValueError, match="glu_clamp"):
        resolve_glu_clamp("clamped_swiglu", (1.702, 7.0, 1.0, False))
    assert GluClamp.deepseek_v4().as_list() == [1.0, 10.0, 0.0, 0.0]
    assert GluClamp.post_activation(3.0).as_list() == [1.0, 3.0, 0.0, 1.0]


def test_functional_and_module_take_the_parameters():
    torch.manual_seed(0)
    T, d, n, E, K = 6, 8, 4, 3, 2
    x = torch.randn(T, d, dtype=F64)
    wr = torch.randn(E, d, dtype=F64)
    w1 = torch.randn(E, 2 * n, d, dtype=F64) * 4  # H beyond the limit
    w2 = torch.randn(E, d, n, dtype=F64)
    c = GluClamp.deepseek_v4(2.0)
    out, _ = functional.moe(x, wr, w1, w2, num_experts_per_tok=K, activation="clamped_swiglu", glu_clamp=c,
                            backend="torch")
    out_default, _ = functional.moe(x, wr, w1, w2, num_experts_per_tok=K, activation="clamped_swiglu",
                                    backend="torch")
    assert not torch.allclose(out, out_default)
    with pytest.raises(ValueError, match="glu_clamp"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=K, glu_clamp=c, backend="torch")
    m = machmoe.MoE(E, K, d, n, "clamped_swiglu", backend="torch", glu_clamp=c).double()
    assert m.c_fc.weight.shape == (E, 2 * n, d) and m.glu_clamp == c
    with pytest.raises(ValueError, match="glu_clamp"):
        machmoe.MoE(E, K, d, n, "swiglu", glu_clamp=c)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_op_matches_torch_backend(variant, layout):
    """The CPU reference (float64, C++) against the torch backend's float64 experts, forward and
    every gradient, with H beyond the limit."""
    from machmoe import _ops

    if not _ops.ops_available():
        pytest.skip("the op library is not built")
    from machmoe import reference

    torch.manual_seed(1)
    c = GluClamp(alpha=VARIANTS[variant].alpha, limit=2.0, up_offset=VARIANTS[variant].up_offset,
                 clamp_after=VARIANTS[variant].clamp_after)
    T, d, n, E = 7, 8, 4, 3
    x = torch.randn(T, d, dtype=F64, requires_grad=True)
    w1 = (torch.randn(E, 2 * n, d, dtype=F64) * 2).requires_grad_()
    w2 = torch.randn(E, d, n, dtype=F64, requires_grad=True)
    token = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 6])
    expert = torch.tensor([0, 1, 2, 0, 1, 2, 1, 0, 0, 2])
    score = torch.rand(token.numel(), dtype=F64, requires_grad=True)
    dout = torch.randn(T, d, dtype=F64)
    out = tb.experts(x, w1, None, w2, None, token, expert, score, "clamped_swiglu", layout, c)
    grads = torch.autograd.grad(out, (x, w1, w2, score), dout)
    r = reference.general(x.detach(), w1.detach(), w2.detach(), token.int(), expert.int(), score.detach(), dout,
                          activation="clamped_swiglu", layout=layout, glu_clamp=c)
    # Both use the float32-rounded parameters: float64 arithmetic on the same values.
    torch.testing.assert_close(r[0], out.detach(), rtol=1e-10, atol=1e-12)
    for got, want in zip((r[1], r[2], r[4], r[6]), grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
