"""GPU tests of the router on its own (torch.ops.machmoe.router_forward / router_backward: what
expert parallelism routes each rank's tokens with), against float64 math on the same bf16 inputs.

The logits are an fp32-accumulated GEMM of bf16 operands: within 1e-5 of float64. The selection
is the top-K kernel's (tested by test_gpu_routing.py and test_gpu_router_options.py): here the op
must give exactly that kernel's scores and experts on its own logits, the expert offsets of those
pairs, and the aux loss of the torch backend's formula (fp32 sums: 1e-5). The backward's d_logits
is the top-K kernel's backward plus the aux loss's float64 gradient, rounded to bf16 for the GEMMs
as in both implementations, so dx and the weight gradients may differ from float64 math on those
bf16 operands by the fp32 accumulation and the bf16 rounding of the result: 2^-8 relative."""

import pytest
import torch

from machmoe import torch_backend

from gpu_test_helpers import ops, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

CASES = [  # T, d, E, K, routing, router bias, (routed_scaling_factor, n_group, topk_group), selection bias
    (37, 128, 8, 2, "softmax_topk", True, (1.0, 1, 1), False),
    (300, 256, 128, 8, "softmax_topk", False, (1.0, 1, 1), False),
    (129, 64, 64, 6, "topk_softmax", True, (1.0, 1, 1), False),
    (200, 128, 256, 8, "sigmoid", True, (2.5, 8, 4), True),
    (1, 8, 1, 1, "softmax_topk", False, (1.0, 1, 1), False),
    (45, 13, 16, 3, "softmax_topk", True, (1.0, 1, 1), False),  # d not a multiple of 8
]


def _inputs(T, d, E, routing, bias, selection):
    x = torch.randn(T, d, device="cuda").bfloat16()
    wr = (torch.randn(E, d, device="cuda") * 0.1).bfloat16()
    rb = (torch.randn(E, device="cuda") * 0.5).bfloat16() if bias else None
    sb = torch.randn(E, device="cuda") * 0.1 if selection else None
    return x, wr, rb, sb


@pytest.mark.parametrize("T,d,E,K,routing,bias,options,selection", CASES)
def test_router_forward_and_backward_match_float64(T, d, E, K, routing, bias, options, selection):
    m = ops()
    x, wr, rb, sb = _inputs(T, d, E, routing, bias, selection)
    logits, scores, experts, offsets, aux = m.router_forward(x, wr, rb, K, routing, True, sb, *options)
    want = x.double() @ wr.double().t() + (0 if rb is None else rb.double())
    assert rel_err(logits, want) <= 1e-5
    kernel_scores, kernel_experts = m.topk_router(logits, K, routing, True, sb, *options)
    assert torch.equal(scores, kernel_scores) and torch.equal(experts, kernel_experts)
    counts = torch.zeros(E + 1, dtype=torch.int64, device="cuda")
    counts[1:] = torch.bincount(experts.flatten().long(), minlength=E).cumsum(0)
    assert torch.equal(offsets.long(), counts)
    logits64 = logits.double().requires_grad_(True)
    aux64 = torch_backend.aux_loss(logits64, experts)
    assert abs(aux.item() - aux64.item()) <= 1e-5 * max(1.0, abs(aux64.item()))

    d_scores, d_aux = torch.randn(T, K, device="cuda"), torch.tensor(0.7, device="cuda")
    dx, dwr, db = m.router_backward(x, wr, logits, scores, experts, offsets, d_scores, d_aux, bias, routing, True,
                                    *options)
    (d_logits_aux,) = torch.autograd.grad(aux64 * d_aux.double(), logits64)
    d_logits = m.topk_router_backward(logits, scores, experts, d_scores, routing, True, *options).double()
    d_logits += d_logits_aux
    g = d_logits.to(torch.bfloat16).double()  # the GEMMs' bf16 operand
    for name, got, ref in (("dx", dx, g @ wr.double()), ("d_router_weight", dwr, g.t() @ x.double())):
        err = rel_err(got, ref)
        print(f"router T={T} E={E} K={K} {routing}: {name} {err:.2e}")
        assert err <= 2.0 ** -8, f"{name} off by {err:.2e}"
    if bias:
        assert rel_err(db, d_logits.sum(0)) <= 2.0 ** -8
    else:
        assert db.numel() == 0
    # Without the scores' gradient, only the aux loss's reaches the logits; without either, nothing.
    dx_aux, _, _ = m.router_backward(x, wr, logits, scores, experts, offsets, None, d_aux, bias, routing, True,
                                     *options)
    want_aux = d_logits_aux.to(torch.bfloat16).double() @ wr.double()
    if want_aux.any():
        assert rel_err(dx_aux, want_aux) <= 2.0 ** -8
    else:  # one expert, or perfectly balanced counts: the aux loss does not depend on the logits
        assert not dx_aux.any()
    dx0, dwr0, _ = m.router_backward(x, wr, logits, scores, experts, offsets, None, None, bias, routing, True, *options)
    assert not dx0.any() and not dwr0.any()


def test_router_is_deterministic_and_handles_no_tokens():
    m = ops()
    x, wr, rb, _ = _inputs(513, 128, 32, "softmax_topk", True, False)
    runs = [m.router_forward(x, wr, rb, 4, "softmax_topk", True, None) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    logits, scores, experts, offsets, _ = runs[0]
    d_scores, d_aux = torch.randn(513, 4, device="cuda"), torch.tensor(1.0, device="cuda")
    grads = [m.router_backward(x, wr, logits, scores, experts, offsets, d_scores, d_aux, True, "softmax_topk", True)
             for _ in range(2)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    empty = x[:0]
    logits, scores, experts, offsets, aux = m.router_forward(empty, wr, rb, 4, "softmax_topk", True, None)
    assert logits.shape == (0, 32) and experts.shape == (0, 4) and not offsets.any() and aux.item() == 0
    dx, dwr, db = m.router_backward(empty, wr, logits, scores, experts, offsets, scores, d_aux, True, "softmax_topk",
                                    True)
    assert dx.shape == (0, 128) and not dwr.any() and not db.any()


def test_router_refuses_bad_arguments_by_name():
    m = ops()
    x, wr, _, _ = _inputs(16, 64, 8, "softmax_topk", False, False)
    with pytest.raises(ValueError, match="x must have dtype"):
        m.router_forward(x.float(), wr, None, 2, "softmax_topk", True, None)
    with pytest.raises(ValueError, match="router_weight must have shape"):
        m.router_forward(x, wr[:, :32].contiguous(), None, 2, "softmax_topk", True, None)
    with pytest.raises(ValueError, match="K"):
        m.router_forward(x, wr, None, 9, "softmax_topk", True, None)
    with pytest.raises(ValueError, match="K"):
        m.router_forward(x, wr, None, 0, "softmax_topk", True, None)
