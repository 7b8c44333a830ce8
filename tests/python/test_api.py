"""The public API: the MoE module, machmoe.functional, the enums, the backend switch, and one
test per validation rule that the error names the argument it is about."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import pytest
import torch

import machmoe
from machmoe import MoE, _ops, functional, reference, torch_backend
from machmoe.enums import (
    ActivationType,
    Backend,
    GateUpLayout,
    RoutingMethod,
    TokenRounding,
    is_glu,
    parse_enum,
)

T, D, N, E, K = 10, 16, 12, 6, 2


def layer_tensors(act="swiglu", bias=True, dtype=torch.float32):
    """Valid functional.moe arguments: x [T, D], router_weight [E, D], w1, w2, b1, b2."""
    n1 = 2 * N if is_glu(act) else N
    return dict(
        x=torch.randn(T, D, dtype=dtype),
        router_weight=torch.randn(E, D, dtype=dtype) / math.sqrt(D),
        w1=torch.randn(E, n1, D, dtype=dtype) / math.sqrt(D),
        w2=torch.randn(E, D, N, dtype=dtype) / math.sqrt(N),
        b1=torch.randn(E, n1, dtype=dtype) if bias else None,
        b2=torch.randn(E, D, dtype=dtype) if bias else None,
    )


def call_moe(**overrides):
    args = dict(layer_tensors(), num_experts_per_tok=K, backend="torch")
    args.update(overrides)
    x, wr, w1, w2 = (args.pop(k) for k in ("x", "router_weight", "w1", "w2"))
    return functional.moe(x, wr, w1, w2, **args)


def general_args():
    t = layer_tensors()
    return dict(x=t["x"], w1=t["w1"], w2=t["w2"], b1=t["b1"], b2=t["b2"],
                scores=torch.rand(4), token_idx=torch.tensor([0, 0, 3, 9]),
                expert_idx=torch.tensor([1, 5, 0, 2]), backend="torch")


def call_general(**overrides):
    args = general_args()
    args.update(overrides)
    positional = [args.pop(k) for k in ("x", "w1", "w2", "scores", "token_idx", "expert_idx")]
    return functional.moe_general(*positional, **args)


# ---------------------------------------------------------------- package and enums


def test_package_exports():
    assert machmoe.__version__ == "0.1.0"
    for name in ("MoE", "ActivationType", "GateUpLayout", "RoutingMethod", "TokenRounding",
                 "Backend", "is_glu", "functional", "layer_kernels_available"):
        assert hasattr(machmoe, name), name
    assert isinstance(machmoe.layer_kernels_available(), bool)


def test_enums_accept_values_and_names_in_any_case():
    assert parse_enum(ActivationType, "SwiGLU", "activation") is ActivationType.SWIGLU
    assert parse_enum(ActivationType, "relu2", "activation") is ActivationType.RELU_SQ
    assert parse_enum(ActivationType, "RELU_SQ", "activation") is ActivationType.RELU_SQ
    assert parse_enum(TokenRounding, "nearest", "token_rounding") is TokenRounding.NEAREST
    assert parse_enum(TokenRounding, "NR", "token_rounding") is TokenRounding.NEAREST
    assert parse_enum(GateUpLayout, GateUpLayout.CONCATENATED, "layout") is \
        GateUpLayout.CONCATENATED
    assert parse_enum(RoutingMethod, "Sigmoid", "routing") is RoutingMethod.SIGMOID
    assert parse_enum(Backend, "TORCH", "backend") is Backend.TORCH
    assert str(ActivationType.GELU) == "gelu" and ActivationType.SILU == "silu"
    assert [a.value for a in ActivationType if is_glu(a)] == ["swiglu", "geglu", "reglu", "clamped_swiglu"]


def test_enum_errors_name_the_argument_and_list_the_choices():
    with pytest.raises(ValueError, match=r"activation_function must be one of 'swiglu', "
                                         r"'geglu', 'reglu', 'relu2', 'relu', 'gelu', 'silu'"):
        parse_enum(ActivationType, "swish", "activation_function")
    with pytest.raises(ValueError, match="routing must be one of"):
        parse_enum(RoutingMethod, 3, "routing")


# ---------------------------------------------------------------- the compiled ops


def test_missing_ops_raise_a_build_hint(monkeypatch):
    monkeypatch.setattr(_ops, "_LIBRARY_PATH", None)
    monkeypatch.setattr(_ops, "_LOAD_ERROR", "libmachmoe_torch.so not found")
    assert not _ops.ops_available() and not machmoe.layer_kernels_available()
    with pytest.raises(RuntimeError, match="scripts/build.sh"):
        _ops.require_ops()
    with pytest.raises(RuntimeError, match="not found"):
        reference.topk(torch.randn(3, 4), 2)


@pytest.mark.ops
def test_kernel_availability_means_they_can_run_here():
    """layer_kernels_available() is True only where the kernels can run: the library built with
    them AND a visible device of compute capability 9.0, not merely a library built with them."""
    assert _ops.library_path() is not None
    compiled = bool(torch.ops.machmoe.layer_kernels_available())
    assert _ops.kernels_compiled() == compiled
    sm90 = torch.cuda.is_available() and any(
        torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count()))
    assert machmoe.layer_kernels_available() == (compiled and sm90)
    if not sm90:
        assert _ops.kernels_unavailable_reason() is not None


def test_loader_finds_the_checkout_build(monkeypatch):
    """Without MACHMOE_LIBRARY_DIR a source checkout looks in <checkout>/build/lib, where
    scripts/build.sh puts the library; with it, only there (never a stale default build)."""
    monkeypatch.delenv("MACHMOE_LIBRARY_DIR", raising=False)
    checkout = Path(_ops.__file__).resolve().parents[2]
    paths = _ops._candidate_paths()
    assert paths[-1] == checkout / "build" / "lib" / _ops.LIBRARY_NAME
    monkeypatch.setenv("MACHMOE_LIBRARY_DIR", "/somewhere")
    assert _ops._candidate_paths() == [Path("/somewhere") / _ops.LIBRARY_NAME]


# ---------------------------------------------------------------- functional API


def test_functional_moe_returns_out_and_aux():
    out, aux = call_moe()
    assert out.shape == (T, D) and out.dtype == torch.float32
    assert aux.dim() == 0 and aux.dtype == torch.float32 and aux.item() > 0


def test_moe_general_equals_moe_on_its_routing():
    t = layer_tensors()
    out, _ = call_moe(**t)
    scores, experts = functional.route(t["x"] @ t["router_weight"].T, K)
    assert scores.shape == (T, K) and experts.dtype == torch.int64
    general = functional.moe_general(
        t["x"], t["w1"], t["w2"], scores.reshape(-1), torch.arange(T).repeat_interleave(K),
        experts.reshape(-1), b1=t["b1"], b2=t["b2"], backend="torch")
    torch.testing.assert_close(general, out)


def test_experts_topk_drops_out_of_range_experts():
    """experts_topk on a [T, K] list with ids >= E and < 0 equals moe_general on the list
    without those pairs, and gives their scores a zero gradient."""
    t = layer_tensors()
    E = t["w1"].shape[0]
    scores, experts = functional.route(t["x"] @ t["router_weight"].T, K)
    experts = experts.clone()
    experts[::3, 0] = E
    experts[1, :] = E + 4
    experts[2, -1] = -1
    scores = scores.detach().requires_grad_(True)
    out = functional.experts_topk(t["x"], t["w1"], t["w2"], scores, experts, b1=t["b1"],
                                  b2=t["b2"], backend="torch")
    keep = ((experts >= 0) & (experts < E)).reshape(-1)
    general = functional.moe_general(
        t["x"], t["w1"], t["w2"], scores.detach().reshape(-1)[keep],
        torch.arange(T).repeat_interleave(K)[keep], experts.reshape(-1)[keep], b1=t["b1"],
        b2=t["b2"], backend="torch")
    torch.testing.assert_close(out, general)
    out.sum().backward()
    assert torch.equal(scores.grad.reshape(-1)[~keep], torch.zeros(int((~keep).sum())))
    assert scores.grad.reshape(-1)[keep].abs().sum() > 0


def test_experts_topk_errors_name_the_argument():
    t = layer_tensors()
    scores, experts = functional.route(t["x"] @ t["router_weight"].T, K)
    with pytest.raises(ValueError, match="topk_experts must have shape"):
        functional.experts_topk(t["x"], t["w1"], t["w2"], scores[1:], experts[1:], backend="torch")
    with pytest.raises(ValueError, match="topk_scores must have shape"):
        functional.experts_topk(t["x"], t["w1"], t["w2"], scores[:, :1], experts, backend="torch")
    with pytest.raises(ValueError, match="topk_experts must have an integer dtype"):
        functional.experts_topk(t["x"], t["w1"], t["w2"], scores, experts.float(), backend="torch")


def test_functional_token_rounding_feeds_moe_general():
    t = layer_tensors()
    logits = t["x"] @ t["router_weight"].T
    token, expert, score = functional.token_rounding(logits, K, mode="up", tile_m=4)
    assert token.shape == expert.shape == score.shape
    assert (token.diff() >= 0).all()
    out = functional.moe_general(t["x"], t["w1"], t["w2"], score, token, expert, b1=t["b1"],
                                 b2=t["b2"], backend="torch")
    rounded, _ = call_moe(**t, token_rounding="up", tile_m=4)
    torch.testing.assert_close(out, rounded)


def test_machmoe_backend_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="machmoe backend runs on CUDA tensors; use "
                                         "backend='torch' or 'auto' on the CPU"):
        call_moe(backend="machmoe")
    with pytest.raises(ValueError, match="CUDA tensors"):
        call_general(backend=Backend.MACHMOE)


@pytest.mark.gpu
@pytest.mark.ops
def test_machmoe_backend_on_cuda_refuses_what_it_cannot_do():
    cuda = {k: None if v is None else v.cuda() for k, v in layer_tensors().items()}
    with pytest.raises(NotImplementedError, match="bfloat16"):  # float32 inputs
        call_moe(**cuda, backend="machmoe")
    bf16 = {k: None if v is None else v.bfloat16().requires_grad_() for k, v in cuda.items()}
    general = {k: v.cuda() for k, v in general_args().items() if isinstance(v, torch.Tensor)}
    general.update({k: bf16[k] for k in ("x", "w1", "w2", "b1", "b2")})
    with pytest.raises(NotImplementedError, match="multiples of 8"):  # n = 12: refused with gradients
        call_general(**general, backend="machmoe")
    with pytest.raises(NotImplementedError, match="multiples of 8"):  # and without
        with torch.no_grad():
            call_general(**general, backend="machmoe")
    out, _ = call_moe(**cuda, backend="torch")
    assert out.is_cuda


# One row per validation rule: (what is wrong, call, exception, the message must match).
V = ValueError
RULES = [
    ("x not a tensor", lambda: call_moe(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    ("x 3-D", lambda: call_moe(x=torch.randn(2, T, D)), V, "x must be 2-D"),
    ("x integer", lambda: call_moe(x=torch.ones(T, D, dtype=torch.int32)), V,
     "x must be float16, bfloat16, float32 or float64"),
    ("router 1-D", lambda: call_moe(router_weight=torch.randn(E)), V, "router_weight must be 2-D"),
    ("router wrong d", lambda: call_moe(router_weight=torch.randn(E, D + 1)), V,
     r"router_weight must have shape \[6, 16\]"),
    ("w1 not GLU-sized", lambda: call_moe(w1=torch.randn(E, N, D)), V,
     r"w1 must have shape \[6, 24, 16\].*N1 = 2n"),
    ("w1 GLU-sized for relu", lambda: call_moe(activation="relu", w1=torch.randn(E, 2 * N, D),
                                               b1=torch.randn(E, N)), V, "w1 must have shape"),
    ("w1 wrong E", lambda: call_moe(w1=torch.randn(E + 1, 2 * N, D)), V, "w1 must have shape"),
    ("w2 wrong d", lambda: call_moe(w2=torch.randn(E, D + 1, N)), V, "w2 must have shape"),
    ("w2 wrong E", lambda: call_moe(w2=torch.randn(E - 1, D, N)), V,
     r"w2 must have shape \[E, d, n\] with E = router_weight.shape\[0\]"),
    ("b1 shape", lambda: call_moe(b1=torch.randn(E, N)), V, "b1 must have shape"),
    ("b2 shape", lambda: call_moe(b2=torch.randn(E, N)), V, "b2 must have shape"),
    ("b1 without b2", lambda: call_moe(b2=None), V, "b2 must be given when b1 is"),
    ("b2 without b1", lambda: call_moe(b1=None), V, "b1 must be given when b2 is"),
    ("dtype mix", lambda: call_moe(w2=torch.randn(E, D, N, dtype=torch.float64)), V,
     "w2 must have the same dtype as x"),
    ("device mix", lambda: call_moe(w1=torch.randn(E, 2 * N, D, device="meta")), V,
     "w1 must be on the same device as x"),
    ("K zero", lambda: call_moe(num_experts_per_tok=0), V,
     r"num_experts_per_tok must be in \[1, 6\]"),
    ("K above E", lambda: call_moe(num_experts_per_tok=E + 1), V, "num_experts_per_tok"),
    ("K float", lambda: call_moe(num_experts_per_tok=2.0), TypeError,
     "num_experts_per_tok must be an int"),
    ("K bool", lambda: call_moe(num_experts_per_tok=True), TypeError, "num_experts_per_tok"),
    ("tile_m zero", lambda: call_moe(tile_m=0), V, "tile_m must be >= 1"),
    ("seed negative", lambda: call_moe(seed=-1), V, "seed must be"),
    ("renormalize str", lambda: call_moe(renormalize="yes"), TypeError,
     "renormalize must be a bool"),
    ("activation", lambda: call_moe(activation="swish"), V, "activation must be one of"),
    ("layout", lambda: call_moe(layout="split"), V, "layout must be one of"),
    ("routing", lambda: call_moe(routing="expert_choice"), V, "routing must be one of"),
    ("token_rounding", lambda: call_moe(token_rounding="ceil"), V,
     "token_rounding must be one of"),
    ("backend", lambda: call_moe(backend="cuda"), V, "backend must be one of 'auto', 'machmoe', 'torch'"),
    ("selection_bias without sigmoid", lambda: call_moe(selection_bias=torch.zeros(E)), V,
     "selection_bias is only used with routing='sigmoid'"),
    ("selection_bias shape", lambda: call_moe(routing="sigmoid", selection_bias=torch.zeros(E + 1)),
     V, r"selection_bias must have shape \[6\]"),
    ("rounding needs softmax_topk", lambda: call_moe(routing="sigmoid", token_rounding="nr"), V,
     "token_rounding='nr' needs routing='softmax_topk'"),
    ("scores 2-D", lambda: call_general(scores=torch.rand(4, 1)), V, "scores must be 1-D"),
    ("token_idx float", lambda: call_general(token_idx=torch.tensor([0.0, 0, 3, 9])), V,
     "token_idx must have an integer dtype"),
    ("expert_idx length", lambda: call_general(expert_idx=torch.tensor([1, 5, 0])), V,
     "expert_idx must have the same length as scores"),
    ("token_idx range", lambda: call_general(token_idx=torch.tensor([0, 0, 3, T])), V,
     r"token_idx must be in \[0, T\)"),
    ("token_idx negative", lambda: call_general(token_idx=torch.tensor([-1, 0, 3, 9])), V,
     "token_idx must be in"),
    ("expert_idx range", lambda: call_general(expert_idx=torch.tensor([1, 5, 0, E])), V,
     r"expert_idx must be in \[0, E\)"),
    ("tokens unordered", lambda: call_general(token_idx=torch.tensor([0, 3, 0, 9])), V,
     "token_idx must be ordered by token"),
    ("pair repeated", lambda: call_general(token_idx=torch.tensor([0, 3, 3, 9]),
                                           expert_idx=torch.tensor([1, 5, 5, 2])), V,
     r"must not repeat a \(token, expert\) pair; token 3 is sent to expert 5 more than once"),
    ("pair repeated, not adjacent", lambda: call_general(token_idx=torch.tensor([0, 3, 3, 3]),
                                                         expert_idx=torch.tensor([1, 5, 0, 5])), V,
     "token 3 is sent to expert 5 more than once"),
    ("general device mix", lambda: call_general(scores=torch.rand(4, device="meta")), V,
     "scores must be on the same device as x"),
    ("route logits 1-D", lambda: functional.route(torch.randn(E), 2), V, "logits must be 2-D"),
    ("route K above E", lambda: functional.route(torch.randn(T, E), E + 1), V,
     "num_experts_per_tok"),
    ("route bias needs sigmoid",
     lambda: functional.route(torch.randn(T, E), 2, selection_bias=torch.zeros(E)), V,
     "selection_bias"),
    ("rounding mode none", lambda: functional.token_rounding(torch.randn(T, E), 2, mode="none"),
     V, "mode must be"),
    ("rounding mode bogus", lambda: functional.token_rounding(torch.randn(T, E), 2, mode="x"),
     V, "mode must be one of"),
    ("rounding tile_m", lambda: functional.token_rounding(torch.randn(T, E), 2, tile_m=0), V,
     "tile_m"),
]


@pytest.mark.parametrize("call,error,match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_functional_validation_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- the MoE module


def test_module_parameters_follow_sonicmoe():
    layer = MoE(E, K, D, N, ActivationType.SWIGLU, add_bias=True, std=0.02, backend="torch")
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {"router.weight": (E, D), "c_fc.weight": (E, 2 * N, D),
                      "c_fc.bias": (E, 2 * N), "c_proj.weight": (E, D, N),
                      "c_proj.bias": (E, D)}
    assert layer.c_fc.bias.abs().max().item() == 0.0 and layer.c_proj.bias.abs().max() == 0.0
    for weight in (layer.router.weight, layer.c_fc.weight, layer.c_proj.weight):
        # N(0, 0.02²) samples: the sample mean's standard error is 0.02/√n and the sample std's
        # relative one ≈ 1/√(2n); 5 of them bound a correct init (a miss ~1e-6), while nn.Linear's
        # default U(±1/√D) (std 0.144 here) or a unit std fail by far.
        n = weight.numel()
        assert abs(weight.std().item() / 0.02 - 1) < 5 / (2 * n) ** 0.5
        assert abs(weight.mean().item()) < 5 * 0.02 / n ** 0.5
    assert layer.selection_bias is None and not list(layer.buffers())

    relu = MoE(E, K, D, N, "relu", routing="sigmoid")
    assert tuple(relu.c_fc.weight.shape) == (E, N, D) and relu.c_fc.bias is None
    assert torch.equal(relu.selection_bias, torch.zeros(E))
    assert "selection_bias" in relu.state_dict()


def test_module_forward_shapes_and_functional_equivalence():
    layer = MoE(E, K, D, N, "geglu", add_bias=True, gate_up_layout="concatenated",
                backend="torch")
    hidden = torch.randn(2, 5, D)
    out, aux = layer(hidden)
    assert out.shape == hidden.shape and aux.dim() == 0
    expected, expected_aux = functional.moe(
        hidden.reshape(-1, D), layer.router.weight, layer.c_fc.weight, layer.c_proj.weight,
        num_experts_per_tok=K, activation="geglu", b1=layer.c_fc.bias, b2=layer.c_proj.bias,
        layout="concatenated", backend="torch")
    torch.testing.assert_close(out, expected.reshape(hidden.shape))
    torch.testing.assert_close(aux, expected_aux)


def test_module_default_backend_is_auto_and_can_be_overridden():
    layer = MoE(E, K, D, N)
    assert layer.backend is Backend.AUTO
    hidden = torch.randn(3, D)
    out, _ = layer(hidden)  # CPU tensors: auto runs the torch backend
    torch.testing.assert_close(out, layer(hidden, backend="torch")[0])
    with pytest.raises(ValueError, match="use backend='torch' or 'auto' on the CPU"):
        layer(hidden, backend="machmoe")


def test_auto_backend_picks_torch_where_kernels_cannot_run_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(functional, "_AUTO_ANNOUNCED", set())
    x = torch.randn(T, D)
    assert functional.resolve_backend("auto", x, D, N) is Backend.TORCH
    assert functional.resolve_backend("torch", x, D, N) is Backend.TORCH
    assert functional.resolve_backend(Backend.MACHMOE, x, D, N) is Backend.MACHMOE
    monkeypatch.setattr(functional, "_AUTO_ANNOUNCED", set())
    tensors = layer_tensors()
    with caplog.at_level(logging.INFO, logger="machmoe"):
        first, _ = call_moe(**tensors, backend="auto")
        call_moe(backend="auto")
        call_general(backend="auto")
    said = [r for r in caplog.records if r.name == "machmoe"]
    assert len(said) == 1 and "torch backend" in said[0].getMessage()
    torch.testing.assert_close(first, call_moe(**tensors, backend="torch")[0])
    # Where everything else fits, the dtype alone decides (the kernels take bfloat16 only).
    monkeypatch.setattr(_ops, "kernels_unavailable_reason", lambda device=None: None)
    assert functional.kernels_unavailable_reason(x.bfloat16(), 16, 16) is None
    assert "bfloat16" in functional.kernels_unavailable_reason(x, 16, 16)
    assert "multiples of 8" in functional.kernels_unavailable_reason(x.bfloat16(), 16, 12)


def test_token_rounding_that_drops_every_row_warns():
    logits = torch.randn(10, E)
    with pytest.warns(RuntimeWarning, match="rounded every expert's token count down to zero"):
        token, _, _ = functional.token_rounding(logits, K, mode="down", tile_m=128)
    assert token.numel() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        functional.token_rounding(logits, K, mode="up", tile_m=128)  # keeps rows: no warning


def test_every_argument_is_documented():
    """help(machmoe.MoE) and the functional entry points name every argument they take."""
    import inspect

    for fn, doc in ((MoE.__init__, MoE.__doc__), (MoE.forward, MoE.forward.__doc__),
                    (functional.moe, None), (functional.moe_general, None),
                    (functional.route, None), (functional.token_rounding, None)):
        text = doc or fn.__doc__
        for name in inspect.signature(fn).parameters:
            if name != "self":
                assert f"{name}:" in text, f"{fn.__qualname__}: {name} undocumented"


def test_token_rounding_only_in_training():
    layer = MoE(E, K, D, N, std=0.5, token_rounding="up", tile_m=4, backend="torch")
    # Redraw until some expert's top-K count is no multiple of 4, so that 'up' must pad (T·K = 20
    # is a multiple of 4, so counts such as 4, 4, 4, 4, 0, 4 happen: seed 1945140516).
    for _ in range(100):
        hidden = torch.randn(T, D)
        _, chosen = torch_backend.route_topk(torch_backend.router_logits(hidden, layer.router.weight), K)
        if (torch.bincount(chosen.reshape(-1), minlength=E) % 4).any():
            break
    args = dict(num_experts_per_tok=K, b1=None, b2=None, backend="torch")
    weights = (layer.router.weight, layer.c_fc.weight, layer.c_proj.weight)
    train_out, _ = layer.train()(hidden)
    rounded, _ = functional.moe(hidden, *weights, token_rounding="up", tile_m=4, **args)
    torch.testing.assert_close(train_out, rounded)
    eval_out, _ = layer.eval()(hidden)
    plain, _ = functional.moe(hidden, *weights, **args)
    torch.testing.assert_close(eval_out, plain)
    assert not torch.allclose(train_out, eval_out), "an expert's count is no multiple of 4: 'up' pads"


def test_stochastic_rounding_is_reproducible_under_manual_seed():
    layer = MoE(E, K, D, N, std=0.5, token_rounding="stochastic", tile_m=4, backend="torch")
    hidden = torch.randn(T, D)
    torch.manual_seed(3)
    first, _ = layer(hidden)
    torch.manual_seed(3)
    second, _ = layer(hidden)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax", "sigmoid"])
def test_module_trains(routing):
    """One SGD step with the torch backend: every gradient finite and non-zero, every
    parameter changes."""
    layer = MoE(E, K, D, N, "swiglu", add_bias=True, std=0.1, routing=routing, backend="torch")
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    hidden = torch.randn(4, 8, D)
    out, aux = layer(hidden)
    loss = (out - hidden).square().mean() + 0.01 * aux
    loss.backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
        assert p.grad.abs().max().item() > 0, name
    optimizer.step()
    for name, p in layer.named_parameters():
        assert not torch.equal(p.detach(), before[name]), name


MODULE_RULES = [
    ("num_experts 0", lambda: MoE(0, 1, D, N), V, "num_experts must be >= 1"),
    ("num_experts float", lambda: MoE(4.0, 1, D, N), TypeError, "num_experts must be an int"),
    ("K 0", lambda: MoE(E, 0, D, N), V, "num_experts_per_tok must be >= 1"),
    ("K above E", lambda: MoE(E, E + 1, D, N), V, "num_experts_per_tok must be <= num_experts"),
    ("hidden_size", lambda: MoE(E, K, 0, N), V, "hidden_size must be >= 1"),
    ("intermediate_size", lambda: MoE(E, K, D, -3), V, "intermediate_size must be >= 1"),
    ("activation", lambda: MoE(E, K, D, N, "swish"), V, "activation_function must be one of"),
    ("add_bias", lambda: MoE(E, K, D, N, add_bias=1), TypeError, "add_bias must be a bool"),
    ("std negative", lambda: MoE(E, K, D, N, std=-0.1), V, "std must be finite and >= 0"),
    ("std nan", lambda: MoE(E, K, D, N, std=math.nan), V, "std must be finite"),
    ("std str", lambda: MoE(E, K, D, N, std="0.02"), TypeError, "std must be a float"),
    ("routing", lambda: MoE(E, K, D, N, routing="hash"), V, "routing must be one of"),
    ("renormalize", lambda: MoE(E, K, D, N, renormalize=None), TypeError, "renormalize"),
    ("layout", lambda: MoE(E, K, D, N, gate_up_layout="x"), V, "gate_up_layout must be one of"),
    ("token_rounding", lambda: MoE(E, K, D, N, token_rounding="x"), V,
     "token_rounding must be one of"),
    ("rounding with sigmoid", lambda: MoE(E, K, D, N, routing="sigmoid", token_rounding="up"),
     V, "token_rounding='up' needs routing='softmax_topk'"),
    ("tile_m", lambda: MoE(E, K, D, N, tile_m=0), V, "tile_m must be >= 1"),
    ("backend", lambda: MoE(E, K, D, N, backend="triton"), V, "backend must be one of"),
    ("hidden_states size", lambda: MoE(E, K, D, N, backend="torch")(torch.randn(3, D + 1)), V,
     r"hidden_states must have shape \[..., hidden_size\]"),
    ("hidden_states type", lambda: MoE(E, K, D, N, backend="torch")([1.0]), TypeError,
     "hidden_states must be a torch.Tensor"),
    ("forward backend", lambda: MoE(E, K, D, N)(torch.randn(3, D), backend="jax"), V,
     "backend must be one of"),
]


@pytest.mark.parametrize("call,error,match", [r[1:] for r in MODULE_RULES],
                         ids=[r[0] for r in MODULE_RULES])
def test_module_validation_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.ops
def test_layer_workspace_bytes_is_the_memory_minimum():
    # The saved block of a layer call: H (bf16) + 12 bytes per routed pair + fp32 logits + the
    # expert offsets, within sub-buffer alignment (the same rule as the C++ plan test), and with x
    # within the bound 2·T·d + 4·T·K·n + 16·T·K + 4·T·E.
    T, d, n, E, K = 24576, 1536, 256, 128, 8
    saved, fwd, bwd, inference = torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, K, "swiglu", "none", 128)
    minimum = T * K * 4 * n + 12 * T * K + 4 * T * E
    assert minimum <= saved <= minimum + 4 * (E + 1) + 6 * 256
    assert 2 * T * d + saved <= 2 * T * d + 4 * T * K * n + 16 * T * K + 4 * T * E
    assert fwd > 0 and bwd > 0
    # Inference (write_h = false) returns the block without H: H [T*K, 2n] bf16 is carved last.
    assert inference <= saved - T * K * 2 * n * 2 < inference + 256
    # Token rounding adds the rounded list and the top-K it started from.
    saved_r, _, _, _ = torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, K, "swiglu", "nr", 128)
    assert saved_r > saved
    with pytest.raises(ValueError, match="K"):
        torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, E + 1, "swiglu", "none", 128)


@pytest.mark.ops
def test_experts_workspace_bytes_is_exact():
    # The saved block of experts_forward on a general list of R pairs: H (bf16, 4n bytes a pair for
    # a GLU), the fp32 scores, row -> pair and pair -> row (12 bytes a pair), the expert offsets and
    # the per-token offsets, within sub-buffer alignment; nothing of size R·d.
    T, d, n, E, R = 4096, 1536, 256, 128, 4096 * 3 + 17
    saved, fwd, bwd = torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, R, "swiglu", False)
    minimum = R * 4 * n + 12 * R + 4 * (E + 1) + 4 * (T + 1)
    assert minimum <= saved <= minimum + 6 * 256
    # The forward's scratch holds A [R, n] and Y [R, d] in bf16; the backward's dH, A', dX~.
    assert fwd >= R * 2 * (n + d)
    assert bwd >= R * 2 * (2 * n + n + d)
    # Biases add the backward's partial sums only.
    saved_b, fwd_b, bwd_b = torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, R, "swiglu", True)
    assert (saved_b, fwd_b) == (saved, fwd) and bwd_b > bwd
    # An empty list still has its offsets; relu halves H.
    empty, _, _ = torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, 0, "swiglu", False)
    assert 0 < empty < saved
    relu, _, _ = torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, R, "relu", False)
    assert relu < saved
    # A list longer than T·E is a valid size (its extra pairs are out of range: expert
    # parallelism's gathered lists), sized by R like any other; with no token it must be empty.
    longer, _, _ = torch.ops.machmoe.experts_workspace_bytes(2, d, n, 3, 7, "swiglu", False)
    shorter, _, _ = torch.ops.machmoe.experts_workspace_bytes(2, d, n, 3, 6, "swiglu", False)
    assert longer > shorter
    with pytest.raises(ValueError, match=r"ExpertsProblem.R: must be 0 when T = 0"):
        torch.ops.machmoe.experts_workspace_bytes(0, d, n, 3, 7, "swiglu", False)
    with pytest.raises(ValueError, match="ExpertsProblem.n"):
        torch.ops.machmoe.experts_workspace_bytes(T, d, 0, E, R, "swiglu", False)
