"""GPU tests of the layer backward on the machmoe kernels: the gradients of x, the router
weight, w1, w2, b1 and b2 through backend="machmoe" (torch.autograd over machmoe::layer_forward /
layer_backward), against the torch backend run in float64 on the same bf16-valued inputs. The loss
has the aux loss in it: loss = Σ out·g + 0.37·aux with a random bf16-valued g.

Tolerance (as tests/python/test_gpu_layer.py): machmoe's relative error per tensor must
stay within 2x the error of the torch backend run in bf16 on the same inputs, and is never asked to
be below 2^-7 (four bf16 roundings of 2^-9 each: H, dH, dX~ or A', the output; on small tensors
both errors are a handful of rounding events and their ratio is noise)."""

import pytest
import torch

from machmoe import MoE, functional

from gpu_test_helpers import GLU, make_layer, redraw_near_ties, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

AUX_WEIGHT = 0.37
NAMES = ("x", "router_weight", "w1", "w2", "b1", "b2")


def grads(t, g, K, backend, dtype=None, aux_weight=AUX_WEIGHT, **opts):
    """(out, aux, {name: gradient}) of loss = Σ out·g + aux_weight·aux, on `backend` in `dtype`
    (None: the tensors' own bf16)."""
    leaves = {k: None if v is None else v.detach().to(dtype or v.dtype).requires_grad_() for k, v in t.items()}
    sel = opts.pop("selection_bias", None)
    if sel is not None and dtype is not None:
        sel = sel.to(dtype)
    out, aux = functional.moe(leaves["x"], leaves["router_weight"], leaves["w1"], leaves["w2"],
                              num_experts_per_tok=K, b1=leaves["b1"], b2=leaves["b2"], selection_bias=sel,
                              backend=backend, **opts)
    wanted = [k for k in NAMES if leaves[k] is not None]
    outputs, grad_outputs = [out], [g.to(out.dtype)]
    if aux_weight:
        outputs.append(aux)
        grad_outputs.append(torch.full_like(aux, aux_weight))
    got = torch.autograd.grad(outputs, [leaves[k] for k in wanted], grad_outputs)
    return out.detach(), aux.detach(), dict(zip(wanted, got))


def check_backward(T, d, n, E, K, act="swiglu", layout="interleaved", routing="softmax_topk", renorm=True,
                   bias=False, selection_bias=None, **rounding):
    t = redraw_near_ties(make_layer(T, d, n, E, act, bias), K, routing, selection_bias)
    g = torch.randn(T, d, device="cuda").bfloat16()
    opts = dict(activation=act, layout=layout, routing=routing, renormalize=renorm, **rounding)
    _, _, got = grads(t, g, K, "machmoe", selection_bias=selection_bias, **opts)
    _, _, ref = grads(t, g, K, "torch", dtype=torch.float64, selection_bias=selection_bias, **opts)
    _, _, base = grads(t, g, K, "torch", selection_bias=selection_bias, **opts)
    assert set(got) == set(ref)
    for k in got:
        assert got[k].dtype == torch.bfloat16 and got[k].shape == t[k].shape, k
        assert got[k].isfinite().all(), f"{k}: non-finite gradient"
        err, err_base = rel_err(got[k], ref[k]), rel_err(base[k], ref[k])
        assert err <= max(2 * err_base, 2 ** -7), f"d{k}: error {err:.3e} > 2x torch bf16's {err_base:.3e}"
    return t, got, ref


@pytest.mark.parametrize("act", ["swiglu", "geglu", "reglu", "relu2", "relu", "gelu", "silu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_layer_backward_activations(act, bias, layout):
    if act not in GLU and layout == "concatenated":
        pytest.skip("the layout only matters for GLU activations")
    check_backward(257, 128, 64, 8, 2, act=act, layout=layout, bias=bias)


@pytest.mark.parametrize("routing,renorm", [("softmax_topk", True), ("topk_softmax", False),
                                            ("topk_softmax", True), ("sigmoid", True), ("sigmoid", False)])
def test_layer_backward_routing_variants(routing, renorm):
    sel = 0.01 * torch.randn(16, device="cuda") if routing == "sigmoid" else None
    check_backward(300, 256, 128, 16, 4, routing=routing, renorm=renorm, selection_bias=sel, bias=True)


@pytest.mark.parametrize("mode", ["nr", "up", "down", "stochastic"])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_backward_token_rounding(mode, bias):
    # Small tiles so that rounding moves most experts (padded pairs get P[t, e] as score, which has
    # a gradient of its own); the float64 torch backend rounds the same way.
    check_backward(300, 128, 64, 16, 2, bias=bias, token_rounding=mode, tile_m=8, seed=1234)


@pytest.mark.parametrize("name,T,d,n,E,K", [("7B-a", 1024, 1536, 256, 128, 8), ("30B-b", 512, 4096, 512, 128, 8),
                                            ("1.4B-c", 777, 768, 1024, 32, 2)])
def test_layer_backward_spec_shapes_reduced_T(name, T, d, n, E, K):
    check_backward(T, d, n, E, K)


def test_layer_backward_d_n_not_multiples_of_64():
    check_backward(100, 200, 72, 8, 2, bias=True)


@pytest.mark.parametrize("T,E,K,bias", [(1, 8, 2, False), (13, 64, 1, True), (5, 4, 4, False), (3, 1, 1, True),
                                         (31, 8, 3, True)])
def test_small_layer_backward_awkward_shapes(T, E, K, bias):
    # T = 1, odd T, most experts empty (T*K << E), K = E, E = 1; biases on half of them (these run
    # under compute-sanitizer too: kept few).
    check_backward(T, 64, 32, E, K, bias=bias)


def test_small_layer_backward_empty_experts_get_exact_zeros():
    # 13 tokens, one expert each: at least 51 of the 64 experts receive no rows. The float64
    # torch backend's gradients say which (they are exactly zero there too).
    t, got, ref = check_backward(13, 64, 32, 64, 1, bias=True)
    empty = (ref["w1"].flatten(1).abs().amax(1) == 0) & (ref["w2"].flatten(1).abs().amax(1) == 0)
    assert int(empty.sum()) >= 64 - 13
    for k in ("w1", "w2", "b1", "b2"):
        assert (got[k][empty] == 0).all(), f"d{k} of an expert without rows is not exactly zero"
        assert (got[k][~empty].flatten(1).abs().amax(1) > 0).all(), f"d{k} of a used expert is zero"


def test_layer_backward_no_tokens():
    t = make_layer(0, 64, 32, 8, "swiglu", True)
    g = torch.zeros(0, 64, device="cuda").bfloat16()
    _, _, got = grads(t, g, 2, "machmoe")
    for k, v in got.items():
        assert v.shape == t[k].shape and (v == 0).all(), k


@pytest.mark.parametrize("T,d,E,K", [(200, 128, 16, 2), (77, 72, 13, 3), (130, 392, 136, 4), (65, 200, 8, 2)])
def test_layer_backward_aux_gradient_reaches_the_router(T, d, E, K):
    # Only the aux loss in the loss: its gradient goes to the router weight and x alone, and dx is
    # the router's part d_logits·Wr by itself (dX~ = 0), so this checks that part on its own scale:
    # the dx aggregation adds it on the tensor cores when d % 8 == 0 (E % 8 != 0: d_logits read
    # element by element; d and T not multiples of the 128-column / 64-token block; E = 136: three
    # 64-expert chunks), and cuBLAS adds it otherwise (d = 200).
    n = 64
    t = make_layer(T, d, n, E, "swiglu", False)
    g = torch.zeros(T, d, device="cuda").bfloat16()
    _, _, got = grads(t, g, K, "machmoe")
    _, _, ref = grads(t, g, K, "torch", dtype=torch.float64)
    assert got["router_weight"].abs().max() > 0 and got["x"].abs().max() > 0
    # bf16 d_logits and bf16 outputs: a few roundings of 2^-9.
    assert rel_err(got["router_weight"], ref["router_weight"]) <= 2 ** -7
    assert rel_err(got["x"], ref["x"]) <= 2 ** -7
    assert (got["w1"] == 0).all() and (got["w2"] == 0).all()


def test_layer_backward_is_deterministic():
    T, d, n, E, K = 1024, 256, 128, 32, 4
    t = make_layer(T, d, n, E, "swiglu", True)
    g = torch.randn(T, d, device="cuda").bfloat16()
    _, _, first = grads(t, g, K, "machmoe")
    _, _, second = grads(t, g, K, "machmoe")
    for k in first:
        assert torch.equal(first[k], second[k]), f"d{k} differs between two runs"


def test_layer_backward_op_is_graph_capturable():
    # No host synchronisation: layer_forward + layer_backward captured in a CUDA graph, replayed on
    # new inputs, give what eager calls give (d_aux passed as a device scalar).
    T, d, n, E, K = 256, 128, 64, 16, 4
    t = make_layer(T, d, n, E, "swiglu", True)
    ops = torch.ops.machmoe
    args = ("swiglu", "interleaved", "softmax_topk", True, "none", 8)

    def step(x, dout, d_aux):
        _, _, saved = ops.layer_forward(x, t["router_weight"], t["w1"], t["b1"], t["w2"], t["b2"], None, K, *args, 0)
        return ops.layer_backward(x, t["router_weight"], t["w1"], t["b1"], t["w2"], t["b2"], saved, dout, d_aux, K,
                                  *args)

    x, dout = t["x"].clone(), torch.randn(T, d, device="cuda").bfloat16()
    d_aux = torch.tensor(AUX_WEIGHT, device="cuda")
    step(x, dout, d_aux)  # warm-up outside capture (cuBLAS handle, kernel attributes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(x, dout, d_aux)
    x.copy_(torch.randn(T, d, device="cuda").bfloat16())
    dout.copy_(torch.randn(T, d, device="cuda").bfloat16())
    d_aux.fill_(-1.5)
    graph.replay()
    want = step(x, dout, d_aux)
    for name, a, b in zip(("dx", "d_router_weight", "dw1", "db1", "dw2", "db2"), captured, want):
        assert torch.equal(a, b), f"{name}: graph replay differs from eager"


def test_small_moe_module_trains_with_the_machmoe_backend():
    layer = MoE(8, 2, 64, 32, "swiglu", add_bias=True, routing="sigmoid", backend="machmoe").cuda().bfloat16()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(4, 9, 64, device="cuda").bfloat16().requires_grad_()
    out, aux = layer(x)
    # A sum against random weights, not a mean: the gradients must be large enough for a bf16 SGD
    # step to move the weights (a mean over 2304 outputs of a near-zero layer does not).
    (out.float() * torch.randn_like(out, dtype=torch.float32)).sum().add(0.01 * aux).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all(), name
        assert torch.count_nonzero(p.grad) > 0, f"{name}: gradient is all zeros"
    assert x.grad is not None and x.grad.shape == x.shape
    assert layer.selection_bias.grad is None  # a buffer: it steers selection, it gets no gradient
    before = layer.c_fc.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, layer.c_fc.weight)
