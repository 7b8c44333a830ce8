"""GPU tests of the shared experts (machmoe.shared_experts) on the machmoe kernels: the output and
the gradients of x, the weights, the biases and the gate against the torch backend in float64 on
the same bf16-valued inputs. The loss is Σ out·g with a random bf16-valued g.

Tolerance (as tests/python/test_gpu_backward_general.py): machmoe's relative error per tensor
within 2x that of the torch backend run in bf16 on the same inputs, never asked below 2^-7."""

import pytest
import torch

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
        assert err <= max(2 * bf_err, floor), f"d{k}: {err:.3e} vs torch bf16 {bf_err:.3e}"


def test_moe_module_with_shared_expert_on_kernels():
    """The module adds the shared experts' output to the routed experts' (both on the kernels,
    so the sum is bitwise that of the two functional calls)."""
    import machmoe

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
