"""machmoe.integrations.torchtitan against torchtitan's own MoE.

Tiny MoE modules configured as torchtitan's Qwen3-MoE (softmax scores, route_norm, no shared
experts) and DeepSeek-V3 (sigmoid scores with the load-balancing expert bias, node-limited
groups, route_scale, shared experts) models configure theirs, built with torchtitan's own config
helpers. The converted module and the original share one router, so both route every token the
same way, bit for bit; what differs is only the experts' arithmetic.

- CPU, float32 (torch backend, expert_dtype="input"): torchtitan's GroupedExperts always computes
  in bfloat16, so the float32 reference is torchtitan's MoE with only the grouped matmuls of its
  experts evaluated in float32 (`_float_experts_forward`, the same three products per expert).
  Outputs and every parameter gradient agree to float32 summation-order differences.
- CPU, bfloat16 experts (the default) against the unmodified torchtitan MoE.
- bf16 experts, CPU (torch backend) and GPU (machmoe's kernels): no less accurate than
  torchtitan's own bf16 path, both measured against the float32 reference.
- bf16 parameters and tokens (FSDP's bf16 mixed precision), CPU and GPU: against torchtitan's
  bf16 MoE directly.
"""

import copy
import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

torchtitan = pytest.importorskip("torchtitan")
config_utils = pytest.importorskip("torchtitan.models.common.config_utils")
tt_moe = pytest.importorskip("torchtitan.models.common.moe")

from machmoe.integrations import torchtitan as mm_tt  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
U_BF16 = 2.0 ** -8  # bfloat16 unit roundoff (8 significand bits)
DIM, HIDDEN, EXPERTS, TOP_K = 32, 16, 8, 2


def _unused_init(param):
    raise AssertionError("build() draws the parameters itself")


def moe_config(kind, *, dim=DIM, hidden=HIDDEN, num_experts=EXPERTS, top_k=TOP_K):
    """A tiny torchtitan MoE.Config shaped like `kind`'s ("qwen3" or "deepseek_v3") MoE layers."""
    init = {"weight": _unused_init}
    experts_init = {name: _unused_init for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    if kind == "qwen3":
        router = dict(score_func="softmax", route_norm=True)
        shared = None
    else:
        router = dict(score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=4,
                      num_limited_groups=2)
        shared = config_utils.make_ffn_config(dim=dim, hidden_dim=2 * hidden, w1_param_init=init,
                                              w2w3_param_init=init)
    return config_utils.make_moe_config(
        num_experts=num_experts,
        router=config_utils.make_router_config(dim=dim, num_experts=num_experts,
                                               gate_param_init=init, top_k=top_k, **router),
        routed_experts=config_utils.make_routed_experts_config(
            dim=dim, hidden_dim=hidden, num_experts=num_experts, top_k=top_k,
            param_init=experts_init, comm_backend="standard"),
        shared_experts=shared,
    )


def build(config, dtype=torch.float32, device="cpu"):
    """Builds `config` and draws every parameter (fan-in scaled) and DeepSeek's expert bias."""
    module = config.build()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        if module.router.score_func == "sigmoid":
            module.expert_bias_E.copy_(torch.randn(module.expert_bias_E.shape) * 0.1)
    return module.to(device=device, dtype=dtype)


def _float_experts_forward(experts, x_RD, num_tokens_per_expert_E):
    """torchtitan's GroupedExperts.forward with its matmuls in x's dtype instead of bfloat16:
    rows of x_RD [R, D] grouped by expert, (silu(x·w1ᵀ) * (x·w3ᵀ))·w2ᵀ per expert
    -> [R, D]."""
    out = []
    for e, rows in enumerate(x_RD.split(num_tokens_per_expert_E.tolist())):
        h = F.silu(rows @ experts.w1_EFD[e].T) * (rows @ experts.w3_EFD[e].T)
        out.append(h @ experts.w2_EDF[e].T)
    return torch.cat(out)


def float_reference(module):
    """A copy of torchtitan's MoE `module` whose experts compute in the input dtype."""
    ref = copy.deepcopy(module)
    experts = ref.routed_experts.inner_experts
    experts.forward = functools.partial(_float_experts_forward, experts)
    return ref


def run(module, x, seed=1234):
    """Forward + backward with a fixed random output gradient -> (out, {name: grad}), x's
    gradient under the name "x"."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = module(x)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(dout)
    grads = {name: p.grad for name, p in module.named_parameters()}
    grads["x"] = x.grad
    return out.detach(), grads


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_close_all(got, want, tol, what):
    """Output and every gradient of `got` within relative error `tol` of `want` (run's pairs)."""
    (out_g, grads_g), (out_w, grads_w) = got, want
    err = rel_err(out_g, out_w)
    assert err <= tol, f"{what}: output rel err {err:.3g} > {tol:.3g}"
    assert grads_g.keys() == grads_w.keys()
    for name, want_grad in grads_w.items():
        assert grads_g[name] is not None and want_grad is not None, \
            f"{what}: no gradient for {name}"
        err = rel_err(grads_g[name], want_grad)
        assert err <= tol, f"{what}: gradient of {name} rel err {err:.3g} > {tol:.3g}"


KINDS = ["qwen3", "deepseek_v3"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["modules", "converter"])
def test_float32_matches_torchtitan(kind, path):
    config = moe_config(kind)
    original = build(config)
    ref = float_reference(original)
    if path == "modules":
        converted = copy.deepcopy(original)
        assert mm_tt.convert_moe_modules(converted, backend="torch", expert_dtype="input") == 1
    else:
        converter = mm_tt.MachMoEConverter.Config(backend="torch", expert_dtype="input").build()
        new_config = converter.convert(copy.deepcopy(config))
        assert type(new_config) is mm_tt.MachMoEMoE.Config
        converted = new_config.build()
        converted.load_state_dict(original.state_dict())
    assert isinstance(converted, mm_tt.MachMoEMoE)
    assert converted.state_dict().keys() == original.state_dict().keys()

    ref.train()
    converted.train()
    x = torch.randn(2, 24, DIM)
    got, want = run(converted, x), run(ref, x)
    # Same routing (the same router on the same input). Each side sums products of length at most
    # n = max(D, 2F, E) in float32 in its own order: a relative difference of about sqrt(n)·eps per
    # product, through three chained products forward and their transposes backward; 8·sqrt(n)·eps
    # (~5e-6; measured ~1e-7) covers that chain, while a wrong gate/up half or score is O(1).
    n = max(DIM, 2 * HIDDEN, EXPERTS)
    assert_close_all(got, want, 8 * math.sqrt(n) * EPS32, f"{kind}/{path} fp32")
    # torchtitan's load-balancing counts, accumulated in training mode: T·K selections.
    assert torch.equal(converted.tokens_per_expert_E, ref.tokens_per_expert_E)
    assert converted.tokens_per_expert_E.sum().item() == 2 * 24 * TOP_K


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_experts_match_torchtitan(kind):
    """The default expert_dtype="bfloat16" against the unmodified torchtitan MoE (float32
    parameters and tokens; both cast them to bf16 for the experts)."""
    original = build(moe_config(kind))
    converted = copy.deepcopy(original)
    mm_tt.convert_moe_modules(converted, backend="torch")
    x = torch.randn(2, 24, DIM)
    got, want = run(converted, x), run(original, x)
    # Both round the same bf16 operands; then each rounds its own intermediates (H, the gated
    # product, Y, score·Y; dY, dH, dX in the backward) to bf16, each a relative error of at most
    # u = 2^-8. Per tensor the differences add up to a few u (measured 1.2u): allow 3u; a wrong
    # gate/up half or score is O(1).
    assert_close_all(got, want, 3 * U_BF16, f"{kind} bf16")


def test_converter_reaches_nested_configs():
    """MoE configs inside a list and in a field of a parent config (as in a model's layers)."""
    from torchtitan.protocols.module import Module

    class Stack(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            layers: list
            last: tt_moe.MoE.Config | None = None

        def __init__(self, config):
            super().__init__()
            self.layers = torch.nn.ModuleList([c.build() for c in config.layers])
            self.last = config.last.build()

    config = Stack.Config(layers=[moe_config("qwen3"), moe_config("deepseek_v3")],
                          last=moe_config("deepseek_v3"))
    plain = copy.deepcopy(config).build()
    converter = mm_tt.MachMoEConverter.Config(backend="torch").build()
    model = converter.convert(config).build()
    moes = [name for name, m in model.named_modules() if isinstance(m, tt_moe.MoE)]
    assert moes == ["layers.0", "layers.1", "last"]
    assert all(isinstance(model.get_submodule(name), mm_tt.MachMoEMoE) for name in moes)
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_parameters_are_shared_not_copied():
    module = build(moe_config("deepseek_v3"))
    before = dict(module.named_parameters())
    mm_tt.convert_moe_modules(module, backend="torch", expert_dtype="input")
    after = dict(module.named_parameters())
    assert before.keys() == after.keys()
    assert all(before[name] is after[name] for name in before)
    # A change to torchtitan's parameters is what the next machmoe forward computes with: with
    # the shared experts' output zeroed and w2 doubled, the output doubles the routed part.
    x = torch.randn(1, 8, DIM)
    with torch.no_grad():
        module.shared_experts.w2.weight.zero_()
        out1 = module(x)
        module.routed_experts.inner_experts.w2_EDF.mul_(2.0)
        out2 = module(x)
    torch.testing.assert_close(out2, 2 * out1)


def test_refusals():
    with pytest.raises(ValueError, match="backend"):
        mm_tt.MachMoEConverter.Config(backend="cuda").build()
    with pytest.raises(ValueError, match="expert_dtype"):
        mm_tt.convert_moe_modules(torch.nn.Linear(2, 2), expert_dtype="fp8")
    with pytest.raises(ValueError, match="no torchtitan MoE"):
        mm_tt.MachMoEConverter.Config().build().convert(config_utils.make_ffn_config(
            dim=8, hidden_dim=8, w1_param_init={}, w2w3_param_init={}))

    class OtherExperts(tt_moe.GroupedExperts):  # as the quantising converters' experts are made
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(tt_moe.GroupedExperts.Config):
            pass

    config = moe_config("qwen3")
    config.routed_experts.inner_experts = OtherExperts.Config(dim=DIM, hidden_dim=HIDDEN,
                                                              num_experts=EXPERTS)
    with pytest.raises(ValueError, match="GroupedExperts"):
        mm_tt.MachMoEConverter.Config().build().convert(config)

    module = build(moe_config("qwen3"))
    mm_tt.convert_moe_modules(module, backend="torch")
    module.routed_experts.token_dispatcher.ep_mesh = object()  # as parallelize() wires it under EP
    with pytest.raises(RuntimeError, match="expert parallelism"):
        module(torch.randn(1, 4, DIM))


def compare_bf16_experts_to_float(kind, device, backend):
    """Float32 parameters and tokens, bf16 experts (torchtitan's default): machmoe on `backend`
    and torchtitan's own bf16 grouped-mm path, both measured against the float32 reference."""
    dim, hidden, E, K = 256, 128, 16, 4  # multiples of 8: the kernels' 16-byte rows
    original = build(moe_config(kind, dim=dim, hidden=hidden, num_experts=E, top_k=K),
                     device=device)
    converted = copy.deepcopy(original)
    mm_tt.convert_moe_modules(converted, backend=backend)  # expert_dtype="bfloat16"
    ref = float_reference(original)
    x = torch.randn(4, 128, dim, device=device)

    # The router runs in float32 in all three (the same module state): one routing.
    truth, mm, tt = run(ref, x), run(converted, x), run(original, x)
    for name in ["out", *truth[1].keys()]:
        def pick(r):
            return r[0] if name == "out" else r[1][name]
        err_mm, err_tt = rel_err(pick(mm), pick(truth)), rel_err(pick(tt), pick(truth))
        # Both round operands and intermediates to bf16 (u = 2^-8 each, a few u per tensor);
        # machmoe keeps more of its chain in fp32, so it must be about as accurate as torchtitan's
        # own path: within 2x its error plus one u, and within 4u absolutely.
        assert err_mm <= 2 * err_tt + U_BF16, \
            f"{kind} {name}: machmoe rel err {err_mm:.3g}, torchtitan {err_tt:.3g}"
        assert err_mm <= 4 * U_BF16, f"{kind} {name}: machmoe rel err {err_mm:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_experts_vs_float_reference_cpu(kind):
    compare_bf16_experts_to_float(kind, "cpu", "torch")


@pytest.mark.gpu
@pytest.mark.ops
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_kernels_vs_torchtitan(kind):
    """machmoe's kernels (backend="machmoe", bf16) against torchtitan's bf16 path on the GPU."""
    compare_bf16_experts_to_float(kind, "cuda", "machmoe")


def compare_bf16_parameters(kind, device, backend):
    """bf16 parameters and tokens throughout (as under FSDP's bf16 mixed precision): machmoe on
    `backend` against the unmodified torchtitan MoE, which routes in bf16 here, the same for
    both (one router, one input)."""
    dim, hidden, E, K = 256, 128, 16, 4  # multiples of 8: the kernels' 16-byte rows
    original = build(moe_config(kind, dim=dim, hidden=hidden, num_experts=E, top_k=K),
                     dtype=torch.bfloat16, device=device)
    converted = copy.deepcopy(original)
    mm_tt.convert_moe_modules(converted, backend=backend)
    x = torch.randn(4, 128, dim, device=device).bfloat16()
    got, want = run(converted, x), run(original, x)
    # The bf16 experts of test_bfloat16_experts_match_torchtitan (measured 1.2u apart), plus the
    # rounding of every gradient to the bf16 parameters (u/2 each side): allow 4u.
    assert_close_all(got, want, 4 * U_BF16, f"{kind} bf16 parameters")


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_parameters_cpu(kind):
    compare_bf16_parameters(kind, "cpu", "torch")


@pytest.mark.gpu
@pytest.mark.ops
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_kernels_bf16_parameters(kind):
    """machmoe's kernels with bf16 parameters against torchtitan's bf16 path on the GPU."""
    compare_bf16_parameters(kind, "cuda", "machmoe")
