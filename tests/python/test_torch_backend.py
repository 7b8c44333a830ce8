"""The torch backend on its own: finite-difference gradient checks, exact routing rules, token
rounding against a plain-Python transcription of LAYER.md, and bf16 accuracy against float64.
None of this needs the compiled ops.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from machmoe import torch_backend as tb
from machmoe.enums import ActivationType, GateUpLayout, is_glu

F64 = torch.float64

ACT_LAYOUTS = [(act.value, layout.value) for act in ActivationType
               for layout in (GateUpLayout if is_glu(act) else [GateUpLayout.INTERLEAVED])]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.detach().to(F64) - ref.to(F64)).norm() / ref.to(F64).norm()).item()


def expert_weights(E: int, d: int, n: int, act: str, dtype=F64):
    """w1 [E, N1, d], b1 [E, N1], w2 [E, d, n], b2 [E, d], scaled so H and Y are O(1)."""
    n1 = 2 * n if is_glu(act) else n
    return (torch.randn(E, n1, d, dtype=dtype) / math.sqrt(d),
            0.5 * torch.randn(E, n1, dtype=dtype),
            torch.randn(E, d, n, dtype=dtype) / math.sqrt(n),
            0.5 * torch.randn(E, d, dtype=dtype))


# ---------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("act,layout", ACT_LAYOUTS)
def test_experts_gradcheck(act, layout):
    """Gradients of the experts w.r.t. x, weights, biases and scores, for every activation.
    Expert 3 has no pairs: its gradients must be exactly zero."""
    T, d, n, E = 4, 3, 2, 4
    x = torch.randn(T, d, dtype=F64, requires_grad=True)
    params = [t.requires_grad_() for t in expert_weights(E, d, n, act)]
    token = torch.tensor([0, 0, 1, 2, 2, 3, 3])
    expert = torch.tensor([0, 2, 1, 0, 1, 2, 0])
    score = torch.randn(token.numel(), dtype=F64, requires_grad=True)

    def f(x, w1, b1, w2, b2, score):
        return tb.experts(x, w1, b1, w2, b2, token, expert, score, act, layout)

    assert gradcheck(f, (x, *params, score))
    f(x, *params, score).sum().backward()
    for p in params:
        assert p.grad[3].abs().max().item() == 0.0


@pytest.mark.parametrize("method,renormalize,with_bias", [
    ("softmax_topk", True, False),
    ("topk_softmax", True, False),
    ("topk_softmax", False, False),
    ("sigmoid", True, False),
    ("sigmoid", True, True),
    ("sigmoid", False, True),
])
def test_route_topk_gradcheck(method, renormalize, with_bias):
    logits = torch.randn(5, 6, dtype=F64, requires_grad=True)
    bias = torch.randn(6, dtype=F64) if with_bias else None
    assert gradcheck(lambda lg: tb.route_topk(lg, 3, method, renormalize, bias)[0], (logits,))


@pytest.mark.parametrize("mode", ["nr", "up", "down", "stochastic"])
def test_token_rounding_score_gradcheck(mode):
    """Selected pairs' scores (softmax over the K selected) and padded pairs' (P[t, e]) are
    both differentiated w.r.t. the logits."""
    logits = torch.randn(7, 5, dtype=F64, requires_grad=True)
    if mode == "up":
        assert tb.token_rounding(logits, 2, mode, 4, 0).padded.any()
    assert gradcheck(lambda lg: tb.token_rounding(lg, 2, mode, 4, 123).score, (logits,))


def test_aux_loss_gradcheck():
    logits = torch.randn(6, 5, dtype=F64, requires_grad=True)
    _, experts = tb.route_topk(logits, 2)
    assert gradcheck(lambda lg: tb.aux_loss(lg, experts.reshape(-1)), (logits,))


@pytest.mark.parametrize("T,E,K", [(6, 5, 2), (33, 16, 4), (1, 3, 3)])
def test_aux_loss_from_counts_equals_aux_loss(T, E, K):
    """The one-node aux loss (hand-written backward) against aux_loss's autograd: value and
    gradient, and gradcheck of its own backward. Skewed logits, so that importance and
    frequency differ per expert (a uniform case would hide a wrong term)."""
    logits = (torch.randn(T, E, dtype=F64) * 2 + torch.linspace(-1, 1, E, dtype=F64)).requires_grad_()
    _, experts = tb.route_topk(logits.detach(), K)
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    ref = tb.aux_loss(logits, experts.reshape(-1))
    got = tb.aux_loss_from_counts(logits, counts, experts.numel())
    assert torch.allclose(got, ref, rtol=1e-14, atol=0)
    g = torch.randn((), dtype=F64)
    (d_ref,) = torch.autograd.grad(ref, logits, g)
    (d_got,) = torch.autograd.grad(got, logits, g)
    assert torch.allclose(d_got, d_ref, rtol=1e-12, atol=1e-15)
    assert gradcheck(lambda lg: tb.aux_loss_from_counts(lg, counts, experts.numel()), (logits,))
    assert tb.aux_loss_from_counts(logits[:0], counts, 0).item() == 0.0


@pytest.mark.parametrize("routing,rounding", [("softmax_topk", "none"), ("sigmoid", "none"),
                                              ("topk_softmax", "none"), ("softmax_topk", "up")])
def test_moe_gradcheck(routing, rounding):
    """The whole layer, out and aux, w.r.t. every input (fast mode: random projections of the
    Jacobian, which keeps the ~100 inputs affordable)."""
    T, d, n, E, K = 5, 3, 2, 4, 2
    x = torch.randn(T, d, dtype=F64, requires_grad=True)
    wr = torch.randn(E, d, dtype=F64, requires_grad=True)
    params = [t.requires_grad_() for t in expert_weights(E, d, n, "swiglu")]

    def f(x, wr, w1, b1, w2, b2):
        return tb.moe(x, wr, w1, b1, w2, b2, K, "swiglu", "concatenated", routing, True, None,
                      rounding, 3, 0)

    assert gradcheck(f, (x, wr, *params), fast_mode=True)


# ---------------------------------------------------------------- exact routing rules


def test_topk_ties_go_to_the_lower_expert_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0],
                           [-0.0, 0.0, -1.0, 0.0, -0.0]], dtype=F64)
    for method in ("softmax_topk", "topk_softmax", "sigmoid"):
        _, experts = tb.route_topk(logits, 3, method)
        assert experts.tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 3]], method


def test_topk_nan_is_the_largest_value():
    nan, inf = math.nan, math.inf
    logits = torch.tensor([[0.0, nan, inf, nan, 5.0]], dtype=F64)
    scores, experts = tb.route_topk(logits, 4)
    assert experts.tolist() == [[1, 3, 2, 4]]
    assert scores.isnan().all()


def test_topk_order_is_descending_and_scores_follow_the_method():
    logits = torch.randn(9, 7, dtype=F64)
    bias = torch.randn(7, dtype=F64)
    scores, experts = tb.route_topk(logits, 3)
    assert (logits.gather(1, experts).diff(dim=1) < 0).all()
    torch.testing.assert_close(scores, torch.softmax(logits.gather(1, experts), dim=1))
    scores, experts = tb.route_topk(logits, 3, "topk_softmax", False)
    torch.testing.assert_close(scores, torch.softmax(logits, dim=1).gather(1, experts))
    scores, experts = tb.route_topk(logits, 3, "sigmoid", False, bias)
    assert ((torch.sigmoid(logits) + bias).gather(1, experts).diff(dim=1) < 0).all()
    torch.testing.assert_close(scores, torch.sigmoid(logits.gather(1, experts)))


def test_nan_input_propagates_to_its_token_only():
    """A NaN in x[2] makes token 2's logits NaN: its experts are picked by the NaN rule, its
    output row and the aux loss are NaN, and every other token's output stays finite."""
    T, d, n, E, K = 6, 4, 3, 5, 2
    x = torch.randn(T, d, dtype=F64)
    x[2, 1] = math.nan
    fw = tb.moe_forward(x, torch.randn(E, d, dtype=F64), *expert_weights(E, d, n, "swiglu"), K)
    assert fw.expert.reshape(T, K)[2].tolist() == [0, 1]
    assert fw.out[2].isnan().all() and fw.aux.isnan()
    assert fw.out[torch.arange(T) != 2].isfinite().all()


def test_splitmix64_matches_published_outputs():
    """The first outputs of SplitMix64 seeded with 0 are published test vectors; the uniform
    for (seed 0, expert e) is output e of that sequence."""
    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    for e, z in enumerate(published):
        assert tb.splitmix64((e * 0x9E3779B97F4A7C15) % 2**64) == z
        assert tb.stochastic_uniform(0, e) == (z >> 11) / 2.0**53


def naive_token_rounding(logits: torch.Tensor, K: int, mode: str, M: int, seed: int):
    """LAYER.md's token rounding transcribed literally, in Python loops over float64 values."""
    T, E = logits.shape
    L = logits.tolist()
    P = [[math.exp(v - max(row)) / sum(math.exp(u - max(row)) for u in row) for v in row]
         for row in L]
    selected = {}  # (t, e) -> softmax over the token's K selected logits
    for t in range(T):
        top = sorted(range(E), key=lambda e: (-L[t][e], e))[:K]
        denominator = sum(math.exp(L[t][e] - L[t][top[0]]) for e in top)
        for e in top:
            selected[(t, e)] = math.exp(L[t][e] - L[t][top[0]]) / denominator
    kept = []
    for e in range(E):
        f = sum((t, e) in selected for t in range(T))
        if mode == "nr":
            r = (f + M // 2) // M * M
        elif mode == "up":
            r = -(-f // M) * M
        elif mode == "down":
            r = f // M * M
        else:
            r = -(-f // M) * M if tb.stochastic_uniform(seed, e) < (f % M) / M else f // M * M
        r = min(max(r, 0), T)

        def rank(t):
            if (t, e) in selected:
                return (0, -selected[(t, e)], t)
            return (1, -P[t][e], t)
        kept += [(t, e) for t in sorted(range(T), key=rank)[:r]]
    kept.sort()
    scores = [selected.get((t, e), P[t][e]) for t, e in kept]
    return kept, scores, [(t, e) not in selected for t, e in kept]


@pytest.mark.parametrize("mode", ["nr", "up", "down", "stochastic"])
@pytest.mark.parametrize("tile_m", [1, 2, 3, 5, 8, 50])
def test_token_rounding_follows_layer_md(mode, tile_m):
    T, E, K = 17, 6, 2
    logits = torch.randn(T, E, dtype=F64)
    seed = int(torch.randint(0, 2**62, ()))
    result = tb.token_rounding(logits, K, mode, tile_m, seed)
    pairs, scores, padded = naive_token_rounding(logits, K, mode, tile_m, seed)
    assert list(zip(result.token.tolist(), result.expert.tolist())) == pairs
    assert result.padded.tolist() == padded
    torch.testing.assert_close(result.score, torch.tensor(scores, dtype=F64), rtol=1e-12,
                               atol=0)
    # Each expert moves by less than one tile from its top-K count.
    _, experts = tb.route_topk(logits, K)
    before = torch.bincount(experts.reshape(-1), minlength=E)
    after = torch.bincount(result.expert, minlength=E)
    assert ((after - before).abs() < tile_m).all()


def test_token_rounding_stochastic_depends_on_the_seed():
    logits = torch.randn(40, 16, dtype=F64)
    lists = {tuple(tb.token_rounding(logits, 2, "stochastic", 8, seed).expert.tolist())
             for seed in range(8)}
    assert len(lists) > 1


def test_aux_loss_value():
    """Uniform probabilities and perfectly balanced counts give aux = 1; T = 0 or R = 0 give 0."""
    T, E = 8, 4
    logits = torch.zeros(T, E, dtype=F64)
    experts = torch.arange(T * 2) % E
    assert tb.aux_loss(logits, experts).item() == pytest.approx(1.0, rel=1e-15)
    assert tb.aux_loss(logits, experts[:0]).item() == 0.0
    assert tb.aux_loss(logits[:0], experts).item() == 0.0
    # All pairs on expert 0 with P concentrated there: aux -> E.
    peaked = torch.full((T, E), -50.0, dtype=F64)
    peaked[:, 0] = 50.0
    assert tb.aux_loss(peaked, torch.zeros(T, dtype=torch.int64)).item() == pytest.approx(E)


# ---------------------------------------------------------------- dtypes and accuracy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes(dtype):
    """out keeps the input dtype; routing math (scores, aux) runs in float32, or float64."""
    T, d, n, E, K = 6, 8, 4, 4, 2
    x = torch.randn(T, d, dtype=dtype)
    wr = torch.randn(E, d, dtype=dtype)
    w1, b1, w2, b2 = (t.to(dtype) for t in expert_weights(E, d, n, "swiglu"))
    fw = tb.moe_forward(x, wr, w1, b1, w2, b2, K)
    routing_dtype = F64 if dtype == F64 else torch.float32
    assert fw.out.dtype == dtype and fw.out.shape == (T, d)
    assert fw.score.dtype == routing_dtype and fw.aux.dtype == routing_dtype
    assert fw.out.isfinite().all()


@pytest.mark.parametrize("act", ["swiglu", "relu2", "gelu"])
def test_bf16_accuracy_against_float64(act):
    """bf16 with the same (bf16-representable) inputs lands at the bf16 rounding level: a
    relative error of a few 1e-3 on every tensor, and much less on the fp32 aux loss."""
    T, d, n, E, K = 256, 128, 64, 8, 2
    weights = expert_weights(E, d, n, act, dtype=torch.float32)
    inputs = [t.bfloat16() for t in (torch.randn(T, d), torch.randn(E, d) / math.sqrt(d),
                                     *weights)]
    dout = torch.randn(T, d).bfloat16()
    results = {}
    for dtype in (torch.bfloat16, F64):
        x, wr, w1, b1, w2, b2 = (t.detach().to(dtype).requires_grad_() for t in inputs)
        out, aux = tb.moe(x, wr, w1, b1, w2, b2, K, act)
        torch.autograd.backward([out, aux], [dout.to(dtype), torch.tensor(0.5, dtype=aux.dtype)])
        results[dtype] = {"out": out, "aux": aux, "dx": x.grad, "dwr": wr.grad, "dw1": w1.grad,
                          "db1": b1.grad, "dw2": w2.grad, "db2": b2.grad}
    for name, ref in results[F64].items():
        err = rel_err(results[torch.bfloat16][name], ref)
        if name == "aux":
            assert err < 1e-5, f"aux: {err:.2e}"
        else:
            assert 1e-3 <= err <= 1e-2, f"{name}: relative error {err:.2e} outside [1e-3, 1e-2]"


@pytest.mark.gpu
def test_cuda_matches_cpu():
    """The same layer on the GPU (float32) and on the CPU (float64): same routing, close math."""
    T, d, n, E, K = 64, 32, 16, 8, 2
    cpu = [torch.randn(T, d, dtype=F64), torch.randn(E, d, dtype=F64) / math.sqrt(d),
           *expert_weights(E, d, n, "swiglu")]
    for rounding in ("none", "up", "stochastic"):
        ref = tb.moe_forward(*cpu[:2], *cpu[2:], K, rounding=rounding, tile_m=8, seed=7)
        gpu = tb.moe_forward(*(t.float().cuda() for t in cpu[:2]),
                             *(t.float().cuda() for t in cpu[2:]), K, rounding=rounding,
                             tile_m=8, seed=7)
        assert torch.equal(gpu.token.cpu(), ref.token) and torch.equal(gpu.expert.cpu(),
                                                                      ref.expert)
        assert rel_err(gpu.out.cpu(), ref.out) < 1e-5
        assert rel_err(gpu.aux.cpu(), ref.aux) < 1e-5
