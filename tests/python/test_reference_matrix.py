"""The C++ CPU reference (torch.ops.machmoe.reference_*) against the torch backend, both float64.

The torch backend is written from docs/LAYER.md independently of the C++ and differentiated by
autograd, so agreement to 1e-9 relative checks both the forward semantics and the hand-written
backward of the reference. Integer outputs (routing lists, metadata) must match exactly.
Sizes are tiny on purpose: the whole matrix runs in seconds on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from machmoe import reference
from machmoe import torch_backend as tb
from machmoe.enums import ActivationType, GateUpLayout, is_glu

pytestmark = pytest.mark.ops

F64 = torch.float64
TOL = 1e-9  # both sides are float64: real differences are ~1e-15

# ---------------------------------------------------------------- comparison


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ (0 when both are exactly zero, inf when only ref is)."""
    diff = (got.detach().to(F64) - ref.to(F64)).norm().item()
    scale = ref.to(F64).norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert tuple(got.shape) == tuple(ref.shape), \
        f"{name}: shape {list(got.shape)} vs reference {list(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"  # NaN fails too


def assert_same_ints(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(got.long(), ref.long()), \
        f"{name}:\n  got {got.tolist()}\n  ref {ref.tolist()}"


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Shape:
    T: int
    d: int
    n: int
    E: int
    K: int


# T·K = 26 is no multiple of tile_m = 4, so token rounding always moves some expert.
BASE = Shape(T=13, d=8, n=6, E=6, K=2)
TILE_M = 4

# name -> (routing, renormalize, with selection bias, token rounding)
ROUTINGS = {
    "softmax_topk": ("softmax_topk", True, False, "none"),
    "topk_softmax": ("topk_softmax", True, False, "none"),
    "topk_softmax_raw": ("topk_softmax", False, False, "none"),
    "sigmoid": ("sigmoid", True, False, "none"),
    "sigmoid_bias": ("sigmoid", True, True, "none"),
    "sigmoid_raw_bias": ("sigmoid", False, True, "none"),
    "round_nr": ("softmax_topk", True, False, "nr"),
    "round_up": ("softmax_topk", True, False, "up"),
    "round_down": ("softmax_topk", True, False, "down"),
    "round_stochastic": ("softmax_topk", True, False, "stochastic"),
}

# The layout only matters for GLU activations.
ACT_LAYOUTS = [(act.value, layout.value) for act in ActivationType
               for layout in (GateUpLayout if is_glu(act) else [GateUpLayout.INTERLEAVED])]
ACT_LAYOUT_IDS = [f"{a}-{l}" if is_glu(a) else a for a, l in ACT_LAYOUTS]


@dataclass
class LayerInputs:
    x: torch.Tensor  # [T, d]
    wr: torch.Tensor  # [E, d]
    w1: torch.Tensor  # [E, N1, d]
    b1: Optional[torch.Tensor]  # [E, N1]
    w2: torch.Tensor  # [E, d, n]
    b2: Optional[torch.Tensor]  # [E, d]
    selection_bias: Optional[torch.Tensor]  # [E]
    dout: torch.Tensor  # [T, d]
    d_aux: float


def make_inputs(s: Shape, act: str, bias: bool, selection_bias: bool = False) -> LayerInputs:
    """Random float64 inputs scaled so H, logits and out are O(1)."""
    n1 = 2 * s.n if is_glu(act) else s.n
    return LayerInputs(
        x=torch.randn(s.T, s.d, dtype=F64),
        wr=torch.randn(s.E, s.d, dtype=F64) / math.sqrt(s.d),
        w1=torch.randn(s.E, n1, s.d, dtype=F64) / math.sqrt(s.d),
        b1=0.5 * torch.randn(s.E, n1, dtype=F64) if bias else None,
        w2=torch.randn(s.E, s.d, s.n, dtype=F64) / math.sqrt(s.n),
        b2=0.5 * torch.randn(s.E, s.d, dtype=F64) if bias else None,
        selection_bias=0.5 * torch.randn(s.E, dtype=F64) if selection_bias else None,
        dout=torch.randn(s.T, s.d, dtype=F64),
        d_aux=torch.randn(()).item(),
    )


def random_seed() -> int:
    """A stochastic-rounding seed drawn from torch's (per-test seeded) generator."""
    return int(torch.randint(0, 2**62, ()).item())


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """autograd leaves .grad unset when nothing reached a tensor (e.g. no routed pairs)."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def torch_layer(inp: LayerInputs, K: int, act: str, layout: str, routing: str,
                renormalize: bool, rounding: str, tile_m: int, seed: int) -> dict:
    """Forward of the torch backend, backward by autograd with (dout, d_aux)."""
    leaves = {name: None if t is None else t.clone().requires_grad_()
              for name, t in (("x", inp.x), ("wr", inp.wr), ("w1", inp.w1), ("b1", inp.b1),
                              ("w2", inp.w2), ("b2", inp.b2))}
    fw = tb.moe_forward(leaves["x"], leaves["wr"], leaves["w1"], leaves["b1"], leaves["w2"],
                        leaves["b2"], K, act, layout, routing, renormalize, inp.selection_bias,
                        rounding, tile_m, seed)
    fw.logits.retain_grad()
    pairs = [(fw.out, inp.dout), (fw.aux, torch.tensor(inp.d_aux, dtype=F64))]
    pairs = [(t, g) for t, g in pairs if t.requires_grad]  # aux is a constant 0 when R = 0
    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    result = {"out": fw.out, "aux": fw.aux, "token": fw.token, "expert": fw.expert,
              "score": fw.score, "d_logits": grad_or_zeros(fw.logits)}
    for name, t in leaves.items():
        if t is not None:
            result["d" + name] = grad_or_zeros(t)
    return result


def check_layer(s: Shape, inp: LayerInputs, act: str, layout: str, routing_name: str,
                tile_m: int = TILE_M) -> reference.LayerResult:
    """Runs both implementations on one case and compares every output; returns the reference."""
    routing, renormalize, _, rounding = ROUTINGS[routing_name]
    seed = random_seed() if rounding == "stochastic" else 0
    ref = reference.layer(
        inp.x, inp.wr, inp.w1, inp.w2, inp.dout, num_experts_per_tok=s.K, b1=inp.b1, b2=inp.b2,
        selection_bias=inp.selection_bias, d_aux=inp.d_aux, activation=act, layout=layout,
        routing=routing, renormalize=renormalize, token_rounding=rounding, tile_m=tile_m,
        seed=seed)
    mine = torch_layer(inp, s.K, act, layout, routing, renormalize, rounding, tile_m, seed)

    assert_same_ints("token", mine["token"], ref.token)
    assert_same_ints("expert", mine["expert"], ref.expert)
    for name, ref_t in (("out", ref.out), ("aux", ref.aux), ("score", ref.score),
                        ("dx", ref.dx), ("d_router_weight", ref.d_router_weight),
                        ("dw1", ref.dw1), ("dw2", ref.dw2), ("d_logits", ref.d_logits)):
        key = {"d_router_weight": "dwr"}.get(name, name)
        assert_close(name, mine[key], ref_t)
    if inp.b1 is not None:
        assert_close("db1", mine["db1"], ref.db1)
        assert_close("db2", mine["db2"], ref.db2)
    else:
        assert ref.db1.numel() == 0 and ref.db2.numel() == 0, "bias grads without biases"
    return ref


# ---------------------------------------------------------------- the layer matrix


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act,layout", ACT_LAYOUTS, ids=ACT_LAYOUT_IDS)
@pytest.mark.parametrize("routing_name", list(ROUTINGS))
def test_layer_matches_reference(routing_name, act, layout, bias):
    inp = make_inputs(BASE, act, bias, selection_bias=ROUTINGS[routing_name][2])
    ref = check_layer(BASE, inp, act, layout, routing_name)
    if ROUTINGS[routing_name][3] != "none":
        plain = tb.route_pairs(tb.router_logits(inp.x, inp.wr), BASE.K)
        moved = (ref.token.numel() != plain[0].numel()
                 or not torch.equal(torch.bincount(ref.expert.long(), minlength=BASE.E),
                                    torch.bincount(plain[1], minlength=BASE.E)))
        assert moved, "token rounding left every expert count unchanged: the case tests nothing"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act,layout", ACT_LAYOUTS, ids=ACT_LAYOUT_IDS)
def test_general_matches_reference(act, layout, bias):
    s = BASE
    inp = make_inputs(s, act, bias)
    token, expert = random_routing_list(s.T, s.E, max_per_token=4)
    check_general(inp, token, expert, act, layout)


def random_routing_list(T: int, E: int, max_per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A list ordered by token, 0..max_per_token distinct experts per token in random order;
    token 0 always gets none (an empty output row)."""
    tokens, experts = [], []
    for t in range(1, T):
        count = int(torch.randint(0, max_per_token + 1, ()))
        chosen = torch.randperm(E)[:count]
        tokens += [t] * count
        experts += chosen.tolist()
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(experts, dtype=torch.int64)


def check_general(inp: LayerInputs, token: torch.Tensor, expert: torch.Tensor, act: str,
                  layout: str) -> reference.GeneralResult:
    score = torch.randn(token.numel(), dtype=F64)
    ref = reference.general(inp.x, inp.w1, inp.w2, token.to(torch.int32),
                            expert.to(torch.int32), score, inp.dout, b1=inp.b1, b2=inp.b2,
                            activation=act, layout=layout)
    leaves = [None if t is None else t.clone().requires_grad_()
              for t in (inp.x, inp.w1, inp.b1, inp.w2, inp.b2, score)]
    x, w1, b1, w2, b2, score_leaf = leaves
    out = tb.experts(x, w1, b1, w2, b2, token, expert, score_leaf, act, layout)
    out.backward(inp.dout)
    assert_close("out", out, ref.out)
    for name, t, ref_t in (("dx", x, ref.dx), ("dw1", w1, ref.dw1), ("dw2", w2, ref.dw2),
                           ("d_score", score_leaf, ref.d_score)):
        assert_close(name, grad_or_zeros(t), ref_t)
    if b1 is not None:
        assert_close("db1", b1.grad, ref.db1)
        assert_close("db2", b2.grad, ref.db2)
    return ref


def test_general_with_duplicate_pairs_and_empty_list():
    """LAYER.md orders rows by (expert, token, pair): a (token, expert) pair may repeat."""
    inp = make_inputs(BASE, "swiglu", bias=True)
    token = torch.tensor([0, 0, 0, 3, 3, 12])
    expert = torch.tensor([2, 2, 5, 0, 0, 5])
    check_general(inp, token, expert, "swiglu", "interleaved")
    empty = torch.zeros(0, dtype=torch.int64)
    ref = check_general(inp, empty, empty, "swiglu", "interleaved")
    assert ref.out.abs().max().item() == 0.0


# ---------------------------------------------------------------- awkward shapes

SHAPES = {
    "T0": Shape(T=0, d=8, n=6, E=4, K=2),
    "T1": Shape(T=1, d=8, n=6, E=4, K=2),
    "T13_E5": Shape(T=13, d=7, n=5, E=5, K=3),
    "K1": Shape(T=12, d=8, n=6, E=5, K=1),
    "K_eq_E": Shape(T=12, d=8, n=6, E=4, K=4),
    "T24_E8": Shape(T=24, d=16, n=12, E=8, K=2),
}


@pytest.mark.parametrize("act,layout", [("swiglu", "concatenated"), ("relu2", "interleaved")])
@pytest.mark.parametrize("routing_name", list(ROUTINGS))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_awkward_shapes(shape_name, routing_name, act, layout):
    s = SHAPES[shape_name]
    inp = make_inputs(s, act, bias=True, selection_bias=ROUTINGS[routing_name][2])
    check_layer(s, inp, act, layout, routing_name)


@pytest.mark.parametrize("routing_name", list(ROUTINGS))
def test_expert_without_tokens(routing_name):
    """Expert E-1's logit is hugely negative for every token: top-K never picks it (rounding
    'up' may still pad it), and without rows its weight gradients are exactly zero."""
    s = BASE
    inp = make_inputs(s, "geglu", bias=True, selection_bias=ROUTINGS[routing_name][2])
    inp.x[:, 0] = 1.0 + inp.x[:, 0].abs()
    inp.wr[-1, 0] = -60.0
    if inp.selection_bias is not None:
        inp.selection_bias[-1] = -2.0  # sigmoid keys lie in (0, 1) + bias
    ref = check_layer(s, inp, "geglu", "interleaved", routing_name)
    if not (ref.expert == s.E - 1).any():
        for name in ("dw1", "db1", "dw2", "db2"):
            assert getattr(ref, name)[-1].abs().max().item() == 0.0, name
    if ROUTINGS[routing_name][3] in ("none", "down", "nr"):
        assert not (ref.expert == s.E - 1).any(), "the empty-expert construction failed"


def test_token_rounding_down_to_nothing():
    """T < tile_m/2: 'nr' and 'down' drop every pair; out, aux and all gradients but the
    router's are zero, and the lists are empty."""
    s = Shape(T=3, d=8, n=6, E=4, K=2)
    for rounding in ("round_nr", "round_down"):
        inp = make_inputs(s, "silu", bias=True)
        ref = check_layer(s, inp, "silu", "interleaved", rounding, tile_m=16)
        assert ref.token.numel() == 0 and ref.out.abs().max().item() == 0.0


# ---------------------------------------------------------------- routing pieces


@pytest.mark.parametrize("routing_name", [n for n, r in ROUTINGS.items() if r[3] == "none"])
def test_topk_matches_reference_with_ties_and_nan(routing_name):
    """Integer logits make many exact ties (lower expert index wins); a NaN logit is the largest."""
    routing, renormalize, with_bias, _ = ROUTINGS[routing_name]
    T, E, K = 24, 8, 3
    logits = torch.randint(-2, 3, (T, E)).to(F64)
    logits[5, 6] = math.nan
    logits[7, :] = 1.0
    bias = torch.randint(-1, 2, (E,)).to(F64) * 0.25 if with_bias else None
    ref_scores, ref_experts = reference.topk(logits, K, routing=routing, renormalize=renormalize,
                                             selection_bias=bias)
    scores, experts = tb.route_topk(logits, K, routing, renormalize, bias)
    assert_same_ints("experts", experts, ref_experts)
    # Row 7 ties on the logit: only the selection bias (itself with ties) and the index decide.
    tied_row_bias = [0.0] * E if bias is None else bias.tolist()
    expected = sorted(range(E), key=lambda e: (-tied_row_bias[e], e))[:K]
    assert experts[7].tolist() == expected, "a tied row must pick by (bias desc, index asc)"
    assert experts[5, 0].item() == 6, "a NaN logit is selected first"
    # The NaN propagates into the NaN expert's score, and into its row's others where they
    # share a normalisation; everything else is a number.
    assert torch.equal(scores.isnan(), ref_scores.isnan()) and scores[5, 0].isnan()
    assert_close("scores", scores[~scores.isnan()], ref_scores[~ref_scores.isnan()])


@pytest.mark.parametrize("mode", ["nr", "up", "down", "stochastic"])
@pytest.mark.parametrize("tile_m", [1, 3, 4, 8, 64])
def test_token_rounding_matches_reference(mode, tile_m):
    T, E, K = 21, 6, 2
    logits = torch.randn(T, E, dtype=F64)
    seed = random_seed()
    ref = reference.token_rounding(logits, K, mode=mode, tile_m=tile_m, seed=seed)
    mine = tb.token_rounding(logits, K, mode, tile_m, seed)
    assert_same_ints("token", mine.token, ref.token)
    assert_same_ints("expert", mine.expert, ref.expert)
    assert_same_ints("padded", mine.padded, ref.padded)
    assert_close("score", mine.score, ref.score)


@pytest.mark.parametrize("mode", ["nr", "up", "down"])
def test_token_rounding_with_nan_logits_matches_reference(mode):
    """LAYER.md states the NaN-is-largest rule for top-K only; the torch backend applies it to
    the ranking inside an expert too. The lists must agree with the reference exactly."""
    logits = torch.randn(9, 5, dtype=F64)
    logits[2, 3] = math.nan
    logits[6, 0] = math.nan
    ref = reference.token_rounding(logits, 2, mode=mode, tile_m=3)
    mine = tb.token_rounding(logits, 2, mode, 3, 0)
    assert_same_ints("token", mine.token, ref.token)
    assert_same_ints("expert", mine.expert, ref.expert)
    assert_same_ints("padded", mine.padded, ref.padded)
    assert torch.equal(mine.score.isnan(), ref.score.isnan())


@pytest.mark.parametrize("mode", ["nr", "up", "down"])
def test_token_rounding_ties_match_reference(mode):
    """Two logit patterns alternate over the tokens, so inside an expert whole groups of tokens
    tie on score (selected) and on P (padded): the lower token index must win, exactly."""
    E, K, T = 5, 2, 14
    patterns = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 2.0, 1.5, -1.0, 0.5]], dtype=F64)
    logits = patterns[torch.arange(T) % 2]
    for tile_m in (3, 4, 5):
        ref = reference.token_rounding(logits, K, mode=mode, tile_m=tile_m, seed=0)
        mine = tb.token_rounding(logits, K, mode, tile_m, 0)
        assert_same_ints(f"token (tile_m={tile_m})", mine.token, ref.token)
        assert_same_ints(f"expert (tile_m={tile_m})", mine.expert, ref.expert)
        assert_same_ints(f"padded (tile_m={tile_m})", mine.padded, ref.padded)
        assert_close(f"score (tile_m={tile_m})", mine.score, ref.score)


def test_metadata_matches_layer_row_order():
    """Rows grouped by expert (ascending), then token, then pair; offsets are prefix sums."""
    T, E = 9, 5
    token, expert = random_routing_list(T, E, max_per_token=3)
    token = torch.cat([token, torch.tensor([T - 1, T - 1])])  # a repeated (token, expert) pair
    expert = torch.cat([expert, torch.tensor([1, 1])])
    md = reference.metadata(token.to(torch.int32), expert.to(torch.int32), T, E)
    row_pair = torch.sort(expert, stable=True).indices
    assert_same_ints("row_pair", md.row_pair, row_pair)
    assert_same_ints("row_token", md.row_token, token[row_pair])
    assert_same_ints("pair_row", md.pair_row, torch.argsort(row_pair))
    zero = torch.zeros(1, dtype=torch.int64)
    assert_same_ints("expert_offsets", md.expert_offsets,
                     torch.cat([zero, torch.bincount(expert, minlength=E).cumsum(0)]))
    assert_same_ints("token_offsets", md.token_offsets,
                     torch.cat([zero, torch.bincount(token, minlength=T).cumsum(0)]))


# ---------------------------------------------------------------- the comparison itself


def test_comparison_rejects_small_corruptions():
    """The checks above would notice a slightly wrong reference: one output element off by
    1e-6 relative, a 1e-5 corruption of a small-magnitude tensor, or a swapped expert."""
    inp = make_inputs(BASE, "swiglu", bias=True)
    ref = check_layer(BASE, inp, "swiglu", "interleaved", "softmax_topk")

    # The largest element, so that 1e-6 of it is always visible in the tensor's norm (a random
    # element near zero made this check itself flaky: seed 461431679).
    out = ref.out.clone()
    out.view(-1)[out.abs().argmax()] *= 1 + 1e-6
    with pytest.raises(AssertionError, match="out: relative error"):
        assert_close("out", out, ref.out)

    small = ref.db1 * 1e-6  # a tensor of size ~1e-6
    corrupted = small.clone()
    corrupted[0, 0] += 1e-5 * small.abs().max()
    with pytest.raises(AssertionError, match="relative error"):
        assert_close("small", corrupted, small)

    experts = ref.expert.clone()
    experts[0], experts[1] = experts[1].item(), experts[0].item()
    with pytest.raises(AssertionError, match="expert"):
        assert_same_ints("expert", experts, ref.expert)

    nan_out = ref.out.clone()
    nan_out[0, 0] = math.nan
    with pytest.raises(AssertionError):
        assert_close("out", nan_out, ref.out)
