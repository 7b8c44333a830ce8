"""GPU tests of the shared experts (machmoe.shared_experts) on the machmoe kernels: the output and
the gradients of x, the weights, the biases and the gate against the torch backend in float64 on
the same bf16-valued inputs. The loss is Σ out·g with a random bf16-valued g.

Tolerance (as tests/python/test_gpu_backward_general.py): machmoe's relative error per tensor
within 2x that of the torch backend run in bf16 on the same inputs, never asked below 2^-7."""

import pytest
import torch

import machmoe
from machmoe.shared_experts import shared_experts

from gpu_test_helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

NAMES = ("x", "w1", "w2", "b1", "b2", "gate")


def make_case(T, d, n, S, bias, gate, std=0.02):
    dev = "cuda"
    return {
        "x": torch.randn(T, d, device=dev).bfloat16(),
        "w1": (torch.randn(S, 2 * n, d, device=dev) * std).bfloat16(),
        "w2": (torch.randn(S, d, n, device=dev) * std).bfloat16(),
        "b1": (torch.randn(S, 2 * n, device=dev) * 0.1).bfloat16() if bias else None,
        "b2": (torch.randn(S, d, device=dev) * 0.1).bfloat16() if bias else None,
        "gate": (torch.randn(1, d, device=dev) * 0.05).bfloat16() if gate else None,
    }


def run(t, g, backend, dtype, layout):
    leaves = {k: None if v is None else v.detach().to(dtype).requires_grad_() for k, v in t.items()}
    out = shared_experts(leaves["x"], leaves["w1"], leaves["w2"], gate_weight=leaves["gate"], b1=leaves["b1"],
                         b2=leaves["b2"], layout=layout, backend=backend)
    wanted = [k for k in NAMES if leaves[k] is not None]
    got = torch.autograd.grad([out], [leaves[k] for k in wanted], [g.to(out.dtype)])
    return out.detach(), dict(zip(wanted, got))


@pytest.mark.parametrize("T, d, n, S, bias, gate, layout", [
    (1000, 512, 256, 1, False, False, "concatenated"),   # DeepSeek-style: one shared expert
    (777, 256, 128, 2, True, False, "interleaved"),      # odd T, two shared experts, biases
    (1024, 512, 128, 1, False, True, "concatenated"),    # Qwen's gated shared expert
    (1, 128, 64, 1, False, True, "interleaved"),         # T = 1
    (4096, 256, 128, 2, True, True, "interleaved"),      # token runs: each shared expert as 4 kernel experts
    (8191, 512, 256, 1, False, False, "concatenated"),   # token runs, odd T
])
def test_shared_experts_kernels_match_reference(T, d, n, S, bias, gate, layout):
    t = make_case(T, d, n, S, bias, gate)
    g = torch.randn(T, d, device="cuda").bfloat16()
    out, grads = run(t, g, "machmoe", torch.bfloat16, layout)
    ref_out, ref_grads = run(t, g, "torch", torch.float64, layout)
    bf_out, bf_grads = run(t, g, "torch", torch.bfloat16, layout)
    floor = 2 ** -7
    assert rel_err(out, ref_out) <= max(2 * rel_err(bf_out, ref_out), floor), "out"
    for k in ref_grads:
        err, bf_err = rel_err(grads[k], ref_grads[k]), rel_err(bf_grads[k], ref_grads[k])
        if k == "gate" and err > max(2 * bf_err, floor):
            # dgate = Σ_t c_t·x_t with c_t = ⟨g_t, y_t⟩·σ'(x_t·gate) (y the ungated experts' sum): at
            # small T a few dot products over d that can cancel, so that bf16's error on the same
            # value is no yardstick; measured instead against the size of its terms, Σ_t |c_t|·|x_t|
            # with |c_t| = Σ_j |g_tj·y_tj|·σ'.
            x64 = t["x"].double()
            y = shared_experts(x64, t["w1"].double(), t["w2"].double(), b1=None if t["b1"] is None else
                               t["b1"].double(), b2=None if t["b2"] is None else t["b2"].double(),
                               layout=layout, backend="torch")
            sig = torch.sigmoid(x64 @ t["gate"].double().T)
            terms = ((g.double() * y).abs().sum(1, keepdim=True) * sig * (1 - sig) * x64.abs()).sum(0, keepdim=True)
            err_terms = ((grads[k].double() - ref_grads[k]).norm() / terms.norm()).item()
            assert err_terms <= floor, f"dgate: {err:.3e} vs torch bf16 {bf_err:.3e}, {err_terms:.3e} of its terms"
            continue
        assert err <= max(2 * bf_err, floor), f"d{k}: {err:.3e} vs torch bf16 {bf_err:.3e}"


def test_moe_module_with_shared_expert_on_kernels():
    """The module adds the shared experts' output to the routed experts' (both on the kernels,
    so the sum is bitwise that of the two functional calls)."""
    torch.manual_seed(1)
    layer = machmoe.MoE(64, 8, 512, 128, gate_up_layout="concatenated", num_shared_experts=1,
                        shared_intermediate_size=256, shared_expert_gate=True).cuda().bfloat16()
    x = torch.randn(2, 300, 512, device="cuda").bfloat16()
    out, aux = layer(x)
    xt = x.reshape(-1, 512)
    routed, aux_routed = machmoe.functional.moe(xt, layer.router.weight, layer.c_fc.weight, layer.c_proj.weight,
                                                num_experts_per_tok=8, layout="concatenated")
    shared = shared_experts(xt, layer.shared_c_fc.weight, layer.shared_c_proj.weight,
                            gate_weight=layer.shared_gate.weight, layout="concatenated")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out.reshape(-1, 512), routed + shared)
    assert torch.equal(aux, aux_routed)


# ---------------------------------------------------------------- shared experts in the routed launch

LAYER_NAMES = ("x", "router_weight", "w1", "w2", "b1", "b2", "shared_w1", "shared_w2", "shared_b1", "shared_b2",
               "shared_gate")


def make_layer_case(T, d, n, E, S, bias, gate, packed, std=0.02):
    dev = "cuda"
    t = {
        "x": torch.randn(T, d, device=dev).bfloat16(),
        "router_weight": (torch.randn(E, d, device=dev) * 0.05).bfloat16(),
        "w1": (torch.randn(E + S, 2 * n, d, device=dev) * std).bfloat16(),
        "w2": (torch.randn(E + S, d, n, device=dev) * std).bfloat16(),
        "b1": (torch.randn(E + S, 2 * n, device=dev) * 0.1).bfloat16() if bias else None,
        "b2": (torch.randn(E + S, d, device=dev) * 0.1).bfloat16() if bias else None,
        "shared_gate": (torch.randn(1, d, device=dev) * 0.05).bfloat16() if gate else None,
    }
    # Routed [E, ...] and shared [S, ...] views of one block (packed, as machmoe.MoE keeps them), or
    # separate copies (the op then concatenates them per call).
    for name in ("w1", "w2", "b1", "b2"):
        if t[name] is not None:
            whole = t[name]
            t[name], t["shared_" + name] = whole[:E], whole[E:]
            if not packed:
                t[name], t["shared_" + name] = t[name].clone(), t["shared_" + name].clone()
        else:
            t["shared_" + name] = None
    return t


def run_layer(t, g, K, backend, dtype, layout, **options):
    # Leaves that keep the packed placement: detach() views the same memory.
    leaves = {k: None if v is None else (v.detach() if dtype == torch.bfloat16 else v.detach().to(dtype))
              .requires_grad_() for k, v in t.items()}
    out, aux = machmoe.functional.moe(
        leaves["x"], leaves["router_weight"], leaves["w1"], leaves["w2"], num_experts_per_tok=K, b1=leaves["b1"],
        b2=leaves["b2"], layout=layout, backend=backend, shared_w1=leaves["shared_w1"],
        shared_w2=leaves["shared_w2"], shared_b1=leaves["shared_b1"], shared_b2=leaves["shared_b2"],
        shared_gate=leaves["shared_gate"], **options)
    wanted = [k for k in LAYER_NAMES if leaves[k] is not None]
    got = torch.autograd.grad([out, aux], [leaves[k] for k in wanted], [g.to(out.dtype), torch.ones_like(aux)])
    return out.detach(), aux.detach(), dict(zip(wanted, got))



@pytest.mark.parametrize("T, d, n, E, K, S, bias, gate, layout, packed, options", [
    (2048, 512, 128, 64, 8, 1, False, False, "interleaved", True, {}),                  # DeepSeek-style
    (777, 256, 128, 16, 4, 2, True, False, "concatenated", True, {}),                   # odd T, S = 2, biases
    (1024, 512, 256, 32, 4, 1, False, True, "concatenated", True,                       # Qwen's gated expert
     {"routing": "topk_softmax"}),
    (1, 128, 64, 8, 2, 1, False, True, "interleaved", True, {}),                        # T = 1
    (5000, 256, 128, 32, 4, 2, True, True, "interleaved", True, {}),                    # dW cut in 4 runs
    (300, 256, 64, 320, 4, 1, False, True, "interleaved", True, {}),                    # E > 256: dx by cuBLAS
    (1500, 256, 128, 64, 6, 1, False, False, "interleaved", False,                      # unpacked: a copy
     {"routing": "sigmoid", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}),
])
def test_layer_runs_shared_experts_in_the_routed_launch(T, d, n, E, K, S, bias, gate, layout, packed, options):
    """functional.moe with shared experts of the routed size on the kernels (one launch: the list
    holds K + S pairs per token) against the torch backend in float64 (routed and shared experts
    computed apart): the output, the aux loss and every gradient, within 2x the torch backend's own
    bf16 error (floor 2^-7)."""
    torch.manual_seed(T + S)
    t = make_layer_case(T, d, n, E, S, bias, gate, packed)
    if "routing" in options and options["routing"] == "sigmoid":
        options = {**options, "selection_bias": torch.randn(E, device="cuda") * 0.1}
    g = torch.randn(T, d, device="cuda").bfloat16()
    out, aux, grads = run_layer(t, g, K, "machmoe", torch.bfloat16, layout, **options)
    ref_out, ref_aux, ref_grads = run_layer(t, g, K, "torch", torch.float64, layout, **options)
    bf_out, _, bf_grads = run_layer(t, g, K, "torch", torch.bfloat16, layout, **options)
    floor = 2 ** -7
    assert rel_err(out, ref_out) <= max(2 * rel_err(bf_out, ref_out), floor), "out"
    assert torch.allclose(aux.double(), ref_aux, rtol=1e-4, atol=1e-6), "aux"
    assert set(grads) == set(ref_grads)
    for k in ref_grads:
        err, bf_err = rel_err(grads[k], ref_grads[k]), rel_err(bf_grads[k], ref_grads[k])
        assert err <= max(2 * bf_err, floor), f"d{k}: {err:.3e} vs torch bf16 {bf_err:.3e}"
    # Deterministic: a second run is bitwise the first.
    out2, _, grads2 = run_layer(t, g, K, "machmoe", torch.bfloat16, layout, **options)
    assert torch.equal(out, out2) and all(torch.equal(grads[k], grads2[k]) for k in grads)


def test_module_with_same_size_shared_experts_uses_one_launch():
    """machmoe.MoE with n_s = n keeps its shared experts packed after the routed ones (also after
    .cuda().bfloat16()), and its output is the one-launch functional call's, bitwise."""
    torch.manual_seed(2)
    layer = machmoe.MoE(32, 4, 256, 128, num_shared_experts=1, shared_expert_gate=True).cuda().bfloat16()
    w, ws = layer.c_fc.weight, layer.shared_c_fc.weight
    assert w.data_ptr() + w.numel() * w.element_size() == ws.data_ptr()
    x = torch.randn(3, 333, 256, device="cuda").bfloat16()
    out, aux = layer(x)
    want, want_aux = machmoe.functional.moe(
        x.reshape(-1, 256), layer.router.weight, layer.c_fc.weight, layer.c_proj.weight, num_experts_per_tok=4,
        shared_w1=layer.shared_c_fc.weight, shared_w2=layer.shared_c_proj.weight,
        shared_gate=layer.shared_gate.weight)
    assert torch.equal(out.reshape(-1, 256), want) and torch.equal(aux, want_aux)
    out.float().square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
