"""GPU tests of the layer forward on the machmoe kernels, against the torch backend run
in float64 on the same bf16-valued inputs. Tolerance: machmoe's relative error per
tensor must stay within 2x the error of the torch backend run in bf16 on the same inputs. On tiny
outputs (a few hundred values) both errors are a handful of rounding events and their ratio is
noise, so the bound is never below 2^-7: four bf16 roundings (H, A, Y, out) of 2^-9 each."""

import pytest
import torch

from machmoe import functional, torch_backend
from machmoe.enums import ActivationType, GateUpLayout, RoutingMethod, TokenRounding

from gpu_test_helpers import GLU, make_layer, redraw_near_ties, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.ops]


def run(t, K, act, layout, routing, renorm, backend, dtype=None, selection_bias=None, **rounding):
    args = {k: (None if v is None else (v if dtype is None else v.to(dtype))) for k, v in t.items()}
    with torch.no_grad():
        return functional.moe(args["x"], args["router_weight"], args["w1"], args["w2"], num_experts_per_tok=K,
                              activation=act, b1=args["b1"], b2=args["b2"], layout=layout, routing=routing,
                              renormalize=renorm, selection_bias=selection_bias, backend=backend, **rounding)


def check_layer(T, d, n, E, K, act="swiglu", layout="interleaved", routing="softmax_topk", renorm=True,
                bias=False, selection_bias=None, **rounding):
    t = redraw_near_ties(make_layer(T, d, n, E, act, bias), K, routing, selection_bias)
    out, aux = run(t, K, act, layout, routing, renorm, "machmoe", selection_bias=selection_bias, **rounding)
    ref, ref_aux = run(t, K, act, layout, routing, renorm, "torch", dtype=torch.float64,
                       selection_bias=None if selection_bias is None else selection_bias.double(), **rounding)
    base, _ = run(t, K, act, layout, routing, renorm, "torch", selection_bias=selection_bias, **rounding)
    assert out.dtype == torch.bfloat16 and out.shape == (T, d)
    err, err_base = rel_err(out, ref), rel_err(base, ref)
    assert err <= max(2 * err_base, 2 ** -7), f"out: error {err:.3e} > 2x torch bf16's {err_base:.3e}"
    assert abs(aux.item() - ref_aux.item()) <= 1e-4 * abs(ref_aux.item()) + 1e-6


@pytest.mark.parametrize("act", ["swiglu", "geglu", "reglu", "relu2", "relu", "gelu", "silu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_layer_forward_activations(act, bias, layout):
    if act not in GLU and layout == "concatenated":
        pytest.skip("the layout only matters for GLU activations")
    check_layer(257, 128, 64, 8, 2, act=act, layout=layout, bias=bias)


@pytest.mark.parametrize("routing,renorm", [("softmax_topk", True), ("topk_softmax", False),
                                            ("topk_softmax", True), ("sigmoid", True), ("sigmoid", False)])
def test_layer_forward_routing_variants(routing, renorm):
    sel = 0.01 * torch.randn(16, device="cuda") if routing == "sigmoid" else None
    check_layer(300, 256, 128, 16, 4, routing=routing, renorm=renorm, selection_bias=sel)


@pytest.mark.parametrize("mode", ["nr", "up", "down", "stochastic"])
def test_layer_forward_token_rounding(mode):
    # Small tiles so that rounding moves most experts; the float64 torch backend rounds the same way.
    check_layer(300, 128, 64, 16, 2, token_rounding=mode, tile_m=8, seed=1234)


def test_layer_forward_d_n_not_multiples_of_64():
    check_layer(100, 200, 72, 8, 2)


@pytest.mark.parametrize("name,T,d,n,E,K", [("7B-a", 1024, 1536, 256, 128, 8), ("30B-b", 512, 4096, 512, 128, 8),
                                            ("1.4B-c", 777, 768, 1024, 32, 2)])
def test_layer_forward_spec_shapes_reduced_T(name, T, d, n, E, K):
    check_layer(T, d, n, E, K)


@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (13, 64, 1), (5, 4, 4), (3, 1, 1), (130, 256, 16), (70, 300, 3)])
def test_small_layer_forward_awkward_shapes(T, E, K):
    # T = 1, odd T, most experts empty (T*K << E), K = E, E = 1; E = 256 (the router kernel's
    # largest E that also writes the aux partial sums, two 64-token blocks + 2 tokens) and E = 300
    # (the aux loss's own partial-sum kernel).
    check_layer(T, 64, 32, E, K)


def test_layer_forward_general_routing_list():
    T, d, n, E = 50, 128, 64, 8
    t = make_layer(T, d, n, E, "swiglu", True)
    tok = torch.arange(T, device="cuda").repeat_interleave(3)
    exp = torch.stack([torch.randperm(E, device="cuda")[:3] for _ in range(T)]).reshape(-1)
    keep = torch.rand(tok.numel(), device="cuda") > 0.3  # tokens with 0..3 experts
    tok, exp = tok[keep], exp[keep]
    scores = torch.rand(tok.numel(), device="cuda")
    with torch.no_grad():
        out = functional.moe_general(t["x"], t["w1"], t["w2"], scores, tok, exp, b1=t["b1"], b2=t["b2"],
                                     backend="machmoe")
        ref = functional.moe_general(*(t[k].double() for k in ("x", "w1", "w2")), scores.double(), tok, exp,
                                     b1=t["b1"].double(), b2=t["b2"].double(), backend="torch")
        base = functional.moe_general(t["x"], t["w1"], t["w2"], scores, tok, exp, b1=t["b1"], b2=t["b2"],
                                      backend="torch")
    assert rel_err(out, ref) <= max(2 * rel_err(base, ref), 2 ** -7)


def test_layer_forward_is_deterministic_and_graph_capturable():
    T, d, n, E, K = 1024, 256, 128, 32, 4
    t = make_layer(T, d, n, E, "swiglu", False)

    def fwd(x):
        with torch.no_grad():
            return functional.moe(x, t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=K, backend="machmoe")

    out1, aux1 = fwd(t["x"])
    out2, aux2 = fwd(t["x"])
    assert torch.equal(out1, out2) and torch.equal(aux1, aux2), "two runs differ"
    static_x = t["x"].clone()
    fwd(static_x)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out, g_aux = fwd(static_x)
    new_x = torch.randn(T, d, device="cuda").bfloat16()
    static_x.copy_(new_x)
    g.replay()
    want, want_aux = fwd(new_x)
    assert torch.equal(g_out, want) and torch.equal(g_aux, want_aux), "graph replay differs from eager"


@pytest.mark.parametrize("act,layout", [("swiglu", "interleaved"), ("geglu", "concatenated"), ("relu2", "interleaved")])
def test_layer_forward_inference_skips_h_and_matches(act, layout):
    # write_h=False (inference: the up-projection skips H) must give bitwise the same output and
    # aux loss as the training-mode call, which does write H.
    T, d, n, E, K = 300, 256, 136, 16, 4
    t = make_layer(T, d, n, E, act, True)
    ops = torch.ops.machmoe
    args = (t["x"], t["router_weight"], t["w1"], t["b1"], t["w2"], t["b2"], None, K, act, layout, "softmax_topk",
            True, "none", 128, 0)
    out_t, aux_t, saved_t = ops.layer_forward(*args)
    out_i, aux_i, saved_i = ops.layer_forward(*args, False)
    assert torch.equal(out_t, out_i) and torch.equal(aux_t, aux_i)
    # The backend takes the inference path under no_grad and the autograd path otherwise.
    with torch.no_grad():
        out_b, _ = functional.moe(t["x"], t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=K,
                                  activation=act, b1=t["b1"], b2=t["b2"], layout=layout, backend="machmoe")
    assert torch.equal(out_b, out_t)
    # H is the last sub-buffer of `saved` (src/host/layer/layer_layout.hpp): written in training mode,
    # and the inference block stops where it would begin.
    n1 = 2 * n if act in GLU else n
    h_bytes = T * K * n1 * 2
    h_slot = (h_bytes + 255) // 256 * 256
    assert saved_i.numel() == saved_t.numel() - h_slot
    h_train = saved_t[saved_i.numel():saved_i.numel() + h_bytes].view(torch.bfloat16).view(T * K, n1)
    assert torch.count_nonzero(h_train) > 0.99 * h_train.numel()
