"""GPU tests of machmoe inside Hugging Face transformers: the kernels in bfloat16 against
transformers' own eager code in float32 on the same inputs.

- Each family's experts module through experts_implementation="machmoe" (the model's routing
  given: random distinct experts per token, with expert-parallel sentinel ids), forward and
  every gradient (tokens, top-K weights, expert weights and biases).
- Each fused sparse block of fuse_moe (machmoe routes itself, from fp32 logits) against the
  block on transformers' eager experts. Tokens whose K-th and (K+1)-th fp32 router logits are
  within 0.05 of each other may legitimately pick another expert in bf16 (transformers rounds
  its logits to bf16): they are left out of the comparison (their rows of the output gradient
  are zero, so they add nothing to any gradient either).
- The kernels' path takes no host synchronisation (torch.cuda sync debug mode "error").

Tolerance: per tensor, machmoe's relative error to the fp32 reference must stay within 2x the
error of the same module run by transformers' eager code in bf16 (bf16 weights and inputs),
plus 2^-8 (half a bf16 ulp relative: the two bf16 paths round at different points, and where
the eager bf16 error is small by chance the floor keeps the test from asking for less than the
roundings machmoe's path has).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from machmoe import functional  # noqa: E402
from machmoe.integrations import transformers as hf_machmoe  # noqa: E402

from test_hf_transformers import _eager, _experts_modules, build, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

FLOOR = 2.0 ** -8
EXPERTS_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "qwen3_next", "deepseek_v3", "glm4_moe",
                    "minimax_m2", "nemotron_h"]
FUSED_FAMILIES = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2", "gpt_oss"]


def _require_kernels(x, d, n):
    why = functional.kernels_unavailable_reason(x, d, n)
    if why is not None:
        pytest.fail(f"the machmoe kernels cannot run this test: {why}")


def _grads(fn, module, x, index, weights, dout):
    """(out, {name: gradient}) of Σ fn(module, x, index, weights)·dout over x, weights and the
    module's parameters."""
    x = x.detach().clone().requires_grad_(True)
    weights = weights.detach().clone().requires_grad_(True)
    params = dict(module.named_parameters())
    out = fn(module, x, index, weights)
    leaves = [x, weights, *params.values()]
    got = torch.autograd.grad([out], leaves, [dout.to(out.dtype)], allow_unused=True)
    names = ["x", "top_k_weights", *params.keys()]
    return out.detach(), {n: (g if g is not None else torch.zeros_like(leaf))
                          for n, g, leaf in zip(names, got, leaves)}


def _compare(got, bf16, ref, what):
    """machmoe (got) and the eager bf16 run against the fp32 reference, tensor by tensor."""
    out, grads = got
    out_bf, grads_bf = bf16
    out_ref, grads_ref = ref
    pairs = [("out", out, out_bf, out_ref)] + [(n, grads[n], grads_bf[n], grads_ref[n]) for n in grads_ref]
    for name, value, eager_bf16, expected in pairs:
        err, err_bf16 = rel_err(value.float(), expected), rel_err(eager_bf16.float(), expected)
        assert err <= 2 * err_bf16 + FLOOR, (f"{what}: {name}: machmoe error {err:.3e} > 2 x eager bf16 "
                                             f"error {err_bf16:.3e} + {FLOOR:.1e}")


def _experts_case(module, T, K, seed, sentinels=True):
    g = torch.Generator().manual_seed(seed)
    E = module.num_experts
    d = module.down_proj.shape[2] if module.is_transposed else module.down_proj.shape[1]
    x = torch.randn(T, d, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if sentinels:
        index[::5, -1] = E  # another rank's expert
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    dout = torch.randn(T, d, generator=g)
    return [t.cuda() for t in (x, index, weights, dout)]


@pytest.mark.parametrize("model_type", EXPERTS_FAMILIES)
def test_gpu_experts_bf16_vs_fp32_eager(model_type, seed):
    model = build(model_type, seed)
    name, module = _experts_modules(model)[0]
    plan = hf_machmoe.plan_experts(module)
    if isinstance(plan, str):
        pytest.skip(f"{model_type}: {plan}")
    ref_module = copy.deepcopy(module).cuda().float()
    bf16_module = copy.deepcopy(module).cuda().bfloat16()
    x, index, weights, dout = _experts_case(module, T=384, K=2, seed=seed)
    _require_kernels(x.bfloat16(), plan.w2.shape[1], plan.w2.shape[2])
    # Not every eager forward knows sentinels: it gets expert 0 with weight 0 there instead
    # (the same output), and that weight's gradient, which machmoe makes 0, is set to 0.
    sentinel = index >= module.num_experts
    eager_index, eager_weights = index.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0)
    ref = _grads(_eager, ref_module, x, eager_index, eager_weights, dout)
    bf16 = _grads(_eager, bf16_module, x.bfloat16(), eager_index, eager_weights.bfloat16(), dout)
    for _, grads in (ref, bf16):
        grads["top_k_weights"] = grads["top_k_weights"].masked_fill(sentinel, 0)
    got = _grads(hf_machmoe.experts_forward, bf16_module, x.bfloat16(), index, weights.bfloat16(), dout)
    _compare(got, bf16, ref, f"{model_type} {name}")
    assert torch.equal(got[1]["top_k_weights"][sentinel].float(), torch.zeros(int(sentinel.sum()), device=x.device))


def _flagged_case(is_concatenated, seed, T):
    """A transposed, biased experts module (test_hf_transformers' flagged class on Qwen3-MoE's tiny
    config, its gate/up rows concatenated or not) and its case (_experts_case, K = 2)."""
    from test_hf_transformers import _flagged_experts_class, tiny_config

    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    module = _flagged_experts_class(is_concatenated)(config)
    case = _experts_case(module, T=T, K=2, seed=seed)
    _require_kernels(case[0].bfloat16(), config.hidden_size, config.moe_intermediate_size)
    return module, case


@pytest.mark.parametrize("is_concatenated", [True, False])
def test_gpu_transposed_biased_experts(is_concatenated, seed):
    module, (x, index, weights, dout) = _flagged_case(is_concatenated, seed, T=48)
    ref = _grads(_eager, copy.deepcopy(module).cuda().float(), x, index, weights, dout)
    bf16_module = copy.deepcopy(module).cuda().bfloat16()
    bf16 = _grads(_eager, bf16_module, x.bfloat16(), index, weights.bfloat16(), dout)
    got = _grads(hf_machmoe.experts_forward, bf16_module, x.bfloat16(), index, weights.bfloat16(), dout)
    _compare(got, bf16, ref, f"transposed, biased, concatenated={is_concatenated}")


def _block_grads(block, x, dout):
    x = x.detach().clone().requires_grad_(True)
    params = dict(block.named_parameters())
    out = block(x)
    if isinstance(out, tuple):  # gpt-oss's block: (output, router scores)
        out = out[0]
    got = torch.autograd.grad([out], [x, *params.values()], [dout.to(out.dtype)], allow_unused=True)
    leaves = [x, *params.values()]
    return out.detach(), {n: (g if g is not None else torch.zeros_like(leaf))
                          for n, g, leaf in zip(["x", *params.keys()], got, leaves)}


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_gpu_fused_block_bf16_vs_fp32_eager(model_type, seed):
    model = build(model_type, seed)
    report = hf_machmoe.fuse_moe(copy.deepcopy(model))
    assert report.fused, report
    block = model.get_submodule(report.fused[0])  # the original (unfused) block of `model`
    rule = hf_machmoe._BLOCK_RULES[type(block).__name__]
    g = torch.Generator().manual_seed(seed)
    T, d = 512, model.config.hidden_size
    x = torch.randn(1, T, d, generator=g).cuda()
    dout = torch.randn(1, T, d, generator=g).cuda()
    # Near ties of the fp32 logits: left out (see the module docstring).
    router = getattr(block, rule.router_attr)
    logits = x[0] @ router.weight.detach().cuda().float().T  # [T, E]
    if getattr(router, "bias", None) is not None:
        logits = logits + router.bias.detach().cuda().float()
    top = logits.topk(router.top_k + 1, dim=1).values
    # A bound on the bf16 logits' error: x and the weight each rounded (2^-9 relative), the
    # products summed in fp32, so |error| <= 2^-8 * Σ|x||w| (doubled for the margin). A gap
    # between the K-th and (K+1)-th logit below it may choose other experts in bf16.
    bound = 2.0 ** -7 * (x[0].abs() @ router.weight.detach().cuda().float().abs().T).amax(dim=1)
    near_tie = (top[:, -2] - top[:, -1]) < bound  # [T]
    assert int(near_tie.sum()) < T // 4, "too many near ties for a meaningful comparison"
    dout[0, near_tie] = 0
    _require_kernels(x[0].bfloat16(), d, hf_machmoe.plan_experts(block.experts).w2.shape[2])

    ref = _block_grads(copy.deepcopy(block).cuda().float(), x, dout)
    bf16_block = copy.deepcopy(block).cuda().bfloat16()
    bf16 = _block_grads(bf16_block, x.bfloat16(), dout)
    fused = hf_machmoe.FusedSparseMoeBlock(bf16_block, rule, hf_machmoe.Backend.AUTO)
    got = _block_grads(fused, x.bfloat16(), dout)
    keep = ~near_tie
    trim = [(r[0][0, keep], r[1]) for r in (got, bf16, ref)]
    _compare(*trim, f"{model_type} fused block")


def test_gpu_experts_take_no_host_sync(seed):
    model = build("qwen3_moe", seed)
    module = copy.deepcopy(_experts_modules(model)[0][1]).cuda().bfloat16()
    x, index, weights, dout = _experts_case(module, T=256, K=2, seed=seed)
    index[3, :] = module.num_experts + 5  # a token with no local expert, an id beyond E
    x = x.bfloat16().requires_grad_(True)
    weights = weights.bfloat16().requires_grad_(True)
    _require_kernels(x, module.hidden_dim, module.intermediate_dim)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = hf_machmoe.experts_forward(module, x, index, weights)
        out.backward(dout.bfloat16())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out[3].float(), torch.zeros_like(out[3].float()))
    assert torch.equal(weights.grad[3].float(), torch.zeros(2, device=x.device))
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("is_concatenated", [True, False])
def test_gpu_fp8_experts_implementation(is_concatenated, seed):
    # experts_implementation="machmoe_fp8" on the kernels (transposed, biased experts, expert-
    # parallel sentinels): forward and every gradient against the same module through the FP8
    # emulation (the torch backend), within 0.35 of FP8's model per tensor
    # (test_gpu_fp8_layer.py's bound for kernels against emulation; model 2·sqrt(6)·0.024).
    module, (x, index, weights, dout) = _flagged_case(is_concatenated, seed, T=300)
    kernels_module = copy.deepcopy(module).cuda().bfloat16()
    emulated_module = copy.deepcopy(kernels_module)
    got = _grads(hf_machmoe.fp8_experts_forward, kernels_module, x.bfloat16(), index, weights.bfloat16(), dout)
    emulated = _grads(hf_machmoe.make_experts_forward("torch", "fp8"), emulated_module, x.bfloat16(), index,
                      weights.bfloat16(), dout)
    bound = 0.35 * 2 * 6 ** 0.5 * 0.024
    for name, a, b in [("out", got[0], emulated[0])] + [(n, got[1][n], emulated[1][n]) for n in got[1]]:
        err = rel_err(a.float(), b.float())
        assert err <= bound, f"{name}: kernels against the emulation {err:.4f} > {bound:.4f}"
    assert "_machmoe_fp8_cache" in kernels_module.__dict__
