"""torch.compile on the GPU: every fake kernel agrees with its CUDA kernel (torch.library.opcheck),
and a compiled layer, forward and backward, gives bitwise the eager layer's results (the kernels
are deterministic, so any difference is the compiled graph's)."""

import contextlib

import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters

from gpu_test_helpers import make_layer, ops
from machmoe import MoE, functional

pytestmark = pytest.mark.gpu

# opcheck's tests that compare metadata and check for mutation; the outputs' values are the other
# GPU tests' subject (and some outputs, e.g. the saved block's alignment padding, are unspecified).
CHECKS = ("test_schema", "test_faketensor")
_PULL_BUFFERS = []  # the fake peers of pull_rows's case


def _op_cases():
    """(op name, args) for every op with a CUDA kernel, at small awkward shapes."""
    m = ops()
    T, d, n, E, K = 37, 128, 192, 6, 2
    t = make_layer(T, d, n, E, "swiglu", True)
    logits = torch.randn(T, E, device="cuda")
    scores, experts = m.topk_router(logits, K, "softmax_topk", True, None)
    offs, row_token, row_pair, pair_row, token_offsets, _ = m.routing_metadata(experts, None, T, E)
    R = T * K
    h = torch.randn(R, 2 * n, device="cuda").bfloat16()
    row_scores = torch.rand(R, device="cuda")
    layer = (t["x"], t["router_weight"], t["w1"], t["b1"], t["w2"], t["b2"], None, K, "swiglu", "interleaved",
             "softmax_topk", True, "none", 128, 0)
    _, _, saved = m.layer_forward(*layer)
    # Two shared experts in the routed launch (separate tensors: the op concatenates them), gated.
    shared = (torch.randn(2, 2 * n, d, device="cuda").bfloat16(), torch.randn(2, 2 * n, device="cuda").bfloat16(),
              torch.randn(2, d, n, device="cuda").bfloat16(), torch.randn(2, d, device="cuda").bfloat16())
    layer_shared = layer + (True, None, 1.0, 1, 1, []) + shared + (torch.rand(T, device="cuda"),)
    _, _, saved_shared = m.layer_forward(*layer_shared)
    # The same with Qwen's gate [1, d], which the op computes (and differentiates) itself.
    gate = torch.randn(1, d, device="cuda").bfloat16()
    layer_gated = layer + (True, None, 1.0, 1, 1, []) + shared + (None, gate)
    _, _, saved_gated = m.layer_forward(*layer_gated)
    dout = torch.randn(T, d, device="cuda").bfloat16()
    tok = torch.arange(T, device="cuda", dtype=torch.int32).repeat_interleave(K)
    exp = experts.flatten().contiguous()
    pair_scores = scores.flatten().contiguous()
    general = (t["x"], t["w1"], t["b1"], t["w2"], t["b2"])
    _, g_saved = m.experts_forward(*general, pair_scores, tok, exp, "swiglu", "interleaved")
    g_workspace = m.experts_backward_data(*general, tok, exp, g_saved, dout, "swiglu", "interleaved")[2]
    # A split call's buffers (written by the part ops in place).
    saved_bytes, fwd_bytes, _ = m.experts_workspace_bytes(T, t["x"].shape[1], t["w2"].shape[2], t["w1"].shape[0],
                                                          tok.numel(), "swiglu", True)
    split_fwd = (torch.empty_like(t["x"]), torch.empty(saved_bytes, dtype=torch.uint8, device="cuda"),
                 torch.empty(fwd_bytes, dtype=torch.uint8, device="cuda"))
    split_bwd = (torch.empty_like(t["x"]), torch.empty_like(pair_scores), g_workspace.clone())
    rounded = m.token_rounding(logits, K, "nr", 16, 0)
    router_bias = torch.randn(E, device="cuda").bfloat16()
    router = (t["x"], t["router_weight"], router_bias, K, "softmax_topk", True, None)
    r_logits, r_scores, r_experts, r_offsets, _ = m.router_forward(*router)
    # FP8: x's rows gathered and quantised, w1 [E, 2n, d] in 128x128 blocks (N = 384: a partial block)
    a_q, a_scales = m.fp8_quantize_rows(t["x"], row_token)
    w_q, w_scales, _, _ = m.fp8_quantize_weights(t["w1"], False)
    x_q, x_scales = m.fp8_quantize_rows(t["x"], None)  # [T, d], gathered by the GEMM (R = T·K rows)
    xt_q, xt_scales, chunks = m.fp8_quantize_columns(t["x"], row_token, offs)  # the weight gradients' operands
    ht_q, ht_scales, _ = m.fp8_quantize_columns(h, None, offs)
    # The FP8 experts on the top-K list: the weights' copies, plain and transposed.
    fp8_weights = [*m.fp8_quantize_weights(t["w1"], True), *m.fp8_quantize_weights(t["w2"], True)]
    # The layer with those copies (precision FP8: no biases; every optional argument up to fp8_weights).
    layer_fp8 = (t["x"], t["router_weight"], t["w1"], None, t["w2"], None) + layer[6:] + (True, None, 1.0, 1, 1, [],
                                                                                         None, None, None, None, None,
                                                                                         None, fp8_weights)
    _, _, saved_fp8 = m.layer_forward(*layer_fp8)
    # The experts on the general list in FP8, with the biases: the same op given the copies.
    g_fp8 = ("swiglu", "interleaved", [], fp8_weights)
    _, g_saved_fp8 = m.experts_forward(*general, pair_scores, tok, exp, *g_fp8)
    # pull_rows: three "peers" that are plain buffers of this GPU, send counts [3] int64 at byte 0
    # and rows of 32 bytes at byte 512 (kept alive here: the op reads them by address).
    _PULL_BUFFERS[:] = [torch.randint(0, 256, (512 + 10 * 32,), dtype=torch.uint8, device="cuda") for _ in range(3)]
    for buf in _PULL_BUFFERS:
        buf[:24].view(torch.int64).copy_(torch.tensor([2, 3, 4]))
    peers = torch.tensor([b.data_ptr() for b in _PULL_BUFFERS], dtype=torch.int64, device="cuda")
    return [
        ("pull_rows", (peers, 0, 512, 10, 1, 12, 32)),
        ("sum_blocks", ([torch.randn(R, d, device="cuda").bfloat16() for _ in range(3)],)),
        ("topk_router", (logits, K, "softmax_topk", True, None)),
        ("topk_router_backward", (logits, scores, experts, torch.randn(T, K, device="cuda"), "softmax_topk", True)),
        ("router_forward", router),
        ("router_forward", (t["x"], t["router_weight"], None, K, "sigmoid", True, torch.randn(E, device="cuda"))),
        ("router_backward", (t["x"], t["router_weight"], r_logits, r_scores, r_experts, r_offsets,
                             torch.randn(T, K, device="cuda"), torch.ones((), device="cuda"), True, "softmax_topk",
                             True)),
        ("router_backward", (t["x"], t["router_weight"], r_logits, r_scores, r_experts, r_offsets, None, None, False,
                             "softmax_topk", True)),
        ("routing_metadata", (experts, None, T, E)),
        ("exchange_plan", (experts, scores, E, 3, 1)),
        ("aggregate", (h, pair_row, token_offsets, row_scores, torch.float32)),
        ("token_rounding", (logits, K, "nr", 16, 0)),
        ("token_rounding_backward", (logits, rounded[5], rounded[6], rounded[4], rounded[1], rounded[3],
                                     torch.randn_like(rounded[2]))),
        ("layer_forward", layer),
        ("layer_forward", layer + (False,)),
        ("layer_backward", layer[:6] + (saved, dout, torch.ones((), device="cuda")) + layer[7:14]),
        ("layer_forward", layer_shared),
        ("layer_backward", layer[:6] + (saved_shared, dout, torch.ones((), device="cuda")) + layer[7:14]
         + (None, 1.0, 1, 1, []) + shared + (True,)),
        ("layer_forward", layer_gated),
        ("layer_backward", layer[:6] + (saved_gated, dout, torch.ones((), device="cuda")) + layer[7:14]
         + (None, 1.0, 1, 1, []) + shared + (False, gate)),
        ("experts_forward", general + (pair_scores, tok, exp, "swiglu", "interleaved")),
        ("experts_backward", general + (tok, exp, g_saved, dout, "swiglu", "interleaved")),
        ("experts_forward", general + (pair_scores, tok, exp) + g_fp8),
        ("experts_backward", general + (tok, exp, g_saved_fp8, dout) + g_fp8),
        ("experts_backward_data", general + (tok, exp, g_saved, dout, "swiglu", "interleaved")),
        ("experts_backward_weights", general + (tok, exp, g_saved, dout, g_workspace, "swiglu", "interleaved", [],
                                                100)),
        ("experts_forward_part", general + (pair_scores, tok, exp) + split_fwd + ("early_rows", T // 2, "swiglu",
                                                                                  "interleaved")),
        ("experts_backward_data_part", general + (tok, exp, g_saved, dout) + split_bwd + ("early_rows", T // 2,
                                                                                        "swiglu", "interleaved")),
        ("grouped_gemm", (t["x"], row_token, offs, t["w1"], t["b1"], R, "glu", "swiglu", "interleaved")),
        ("grouped_gemm", (h[:, :n].contiguous(), None, offs, t["w2"], t["b2"], R, "store", "swiglu", "interleaved")),
        ("grouped_gemm_nmajor", (dout, row_token, offs, t["w2"], R, h, row_scores, row_pair, "swiglu",
                                 "interleaved")),
        ("grouped_gemm_nmajor", (h, None, offs, t["w1"], R, None, None, None, "swiglu", "interleaved")),
        ("grouped_gemm_wgrad", (t["x"], row_token, h, offs, True, False)),
        ("grouped_gemm_wgrad", (dout, row_token, h[:, :n].contiguous(), offs, False, True)),
        ("fp8_quantize_rows", (t["x"], row_token)),
        ("fp8_quantize_rows", (h, None)),
        ("fp8_swiglu_backward", (h[:, :n].contiguous(), *m.fp8_quantize_rows(h, None), row_scores, row_pair)),
        ("fp8_quantize_weights", (t["w1"], False)),
        ("fp8_quantize_weights", (t["w2"], True)),
        ("fp8_quantize_columns", (t["x"], row_token, offs)),
        ("fp8_quantize_columns", (h, None, offs)),
        ("grouped_gemm_fp8", (a_q, a_scales, w_q, w_scales, offs)),
        ("grouped_gemm_fp8", (a_q, a_scales, w_q, w_scales, offs, 2)),
        ("grouped_gemm_fp8", (x_q, x_scales, w_q, w_scales, offs, 0, row_token)),
        ("grouped_gemm_fp8", (a_q, a_scales, w_q, w_scales, offs, 0, None, t["b1"])),
        ("grouped_gemm_fp8_glu", (a_q, a_scales, w_q, w_scales, offs, "swiglu", [])),
        ("grouped_gemm_fp8_glu", (x_q, x_scales, w_q, w_scales, offs, "clamped_swiglu", [1.702, 7.0, 1.0, 0.0],
                                  t["b1"], 0, row_token)),
        ("grouped_wgrad_fp8", (xt_q, xt_scales, ht_q, ht_scales, chunks, torch.float32, False)),
        ("grouped_wgrad_fp8", (xt_q, xt_scales, ht_q, ht_scales, chunks, torch.bfloat16, True, 2)),
        ("layer_forward", layer_fp8),
        ("layer_backward", layer_fp8[:6] + (saved_fp8, dout, torch.ones((), device="cuda")) + layer[7:14]
         + (None, 1.0, 1, 1, [], None, None, None, None, False, None, fp8_weights)),
    ]


def test_every_fake_agrees_with_its_kernel():
    cases = _op_cases()
    from machmoe import _fake

    assert {name for name, _ in cases} == set(_fake.FAKES), "a CUDA op without an opcheck case"
    failures = []
    for name, args in cases:
        try:
            # opcheck's schema test does arithmetic on the inputs, which float8 tensors lack.
            flat = [v for a in args for v in (a if isinstance(a, (list, tuple)) else [a])]
            fp8_inputs = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in flat)
            checks = tuple(c for c in CHECKS if c != "test_schema") if fp8_inputs else CHECKS
            torch.library.opcheck(getattr(ops(), name).default, args, test_utils=checks)
        except Exception as err:  # collect them all: one failing op should not hide the others
            failures.append(f"{name}: {type(err).__name__}: {str(err)[:400]}")
    assert not failures, "\n".join(failures)


def _train_step(layer, x, g):
    out, aux = layer(x)
    ((out.float() * g).sum() + aux).backward()
    return out, aux, [p.grad for p in layer.parameters()] + [x.grad]


def _twins(*args, **kwargs):
    """Two MoE layers with the same weights: one stays eager, the other gets compiled."""
    eager = MoE(*args, **kwargs).cuda().bfloat16()
    twin = MoE(*args, **kwargs).cuda().bfloat16()
    if eager.selection_bias is not None:  # a selection bias that changes which experts are picked
        eager.selection_bias.copy_(torch.randn_like(eager.selection_bias) * 0.05)
    twin.load_state_dict(eager.state_dict())
    return eager, twin


def _assert_step_matches(eager, twin, compiled, x, g, label, seed):
    """One training step of the eager layer and of the compiled twin on the same x and output
    gradient g: outputs, aux loss and every gradient bitwise equal. Both steps start from
    torch.manual_seed(seed), which also seeds whatever the caller draws next."""
    for layer in (eager, twin):
        layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same stochastic-rounding seed for both
    want = _train_step(eager, x.clone().requires_grad_(), g)
    torch.manual_seed(seed)
    got = _train_step(compiled, x.clone().requires_grad_(), g)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{label}: forward differs"
    for a, b in zip(got[2], want[2]):
        assert a is not None and torch.equal(a, b), f"{label}: gradients differ"


@pytest.mark.parametrize("bias,act,options", [
    (False, "swiglu", {}),
    (True, "relu", {}),
    (False, "geglu", {"token_rounding": "nr", "tile_m": 64}),
    (True, "swiglu", {"routing": "sigmoid"}),
    (False, "swiglu", {"token_rounding": "stochastic"}),
])
def test_compiled_layer_is_bitwise_the_eager_layer(bias, act, options):
    T, d, n, E, K = 300, 256, 128, 16, 4
    eager, twin = _twins(E, K, d, n, activation_function=act, add_bias=bias, std=0.02, **options)
    # Stochastic rounding draws its seed on the host (.item()): a graph break, so not fullgraph.
    # Inductor draws random numbers its own way unless told to fall back to eager's generator.
    stochastic = options.get("token_rounding") == "stochastic"
    compiled = torch.compile(twin, fullgraph=not stochastic)
    rng = torch._inductor.config.patch(fallback_random=True) if stochastic else contextlib.nullcontext()
    x = torch.randn(T, d, device="cuda").bfloat16()
    g = torch.randn(T, d, device="cuda")
    with rng:
        for step in range(2):  # the second call runs the cached graph
            _assert_step_matches(eager, twin, compiled, x, g, f"step {step}", seed=step)


def test_compiled_inference_and_general_routing():
    T, d, n, E, K = 129, 128, 64, 8, 2
    t = make_layer(T, d, n, E, "swiglu", False)
    layer = MoE(E, K, d, n).cuda().bfloat16().eval()
    with torch.no_grad():
        want = layer(t["x"])
        got = torch.compile(layer, fullgraph=True)(t["x"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # A general routing list (no router): the experts' forward and backward ops. Not fullgraph:
    # moe_general checks the list on the host (range, order, repeats), a graph break.
    scores = torch.rand(T * K, device="cuda")
    tok = torch.arange(T, device="cuda").repeat_interleave(K)
    exp = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).flatten()

    def general(x, w1, w2, s):
        return functional.moe_general(x, w1, w2, s, tok, exp)

    args = [t["x"], t["w1"], t["w2"], scores]
    leaves = [[a.clone().requires_grad_() for a in args] for _ in range(2)]
    outs = [general(*leaves[0]), torch.compile(general)(*leaves[1])]
    dout = torch.randn_like(outs[0])
    for out in outs:
        out.backward(dout)
    assert torch.equal(outs[1], outs[0])
    for a, b in zip(leaves[1], leaves[0]):
        assert torch.equal(a.grad, b.grad)


def test_compiled_layer_with_changing_token_counts():
    # dynamic=True: the fakes size everything, the saved block included, symbolically in T, so
    # one graph serves every token count; each result is the eager layer's, bitwise.
    d, n, E, K = 128, 64, 8, 2
    eager, twin = _twins(E, K, d, n)
    compiled = torch.compile(twin, dynamic=True, fullgraph=True)
    torch.compiler.reset()
    counters.clear()
    graphs = None
    for T in (64, 65, 200, 65, 1000):
        x = torch.randn(T, d, device="cuda").bfloat16()
        _assert_step_matches(eager, twin, compiled, x, torch.randn(T, d, device="cuda"), f"T={T}", seed=T)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs, \
        f"compiled again for a new T: {counters['stats']['unique_graphs']} graphs, {graphs} after the first call"


def test_automatic_dynamic_shapes_compile_twice_at_most():
    # Without dynamic=True, torch compiles for the first T, and on the first change again with T
    # symbolic; that second graph then serves every T.
    d, n, E, K = 128, 64, 8, 2
    layer = MoE(E, K, d, n).cuda().bfloat16().eval()
    compiled = torch.compile(layer, fullgraph=True)
    torch.compiler.reset()
    counters.clear()
    seen = []
    with torch.no_grad():
        for T in (64, 65, 200, 1000, 33):
            x = torch.randn(T, d, device="cuda").bfloat16()
            want, got = layer(x), compiled(x)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"T={T}"
            seen.append(counters["stats"]["unique_graphs"])
    assert seen[1] == seen[-1] <= 2, f"graphs after each call: {seen}"


def test_reduce_overhead_training_steps_match_eager():
    # mode="reduce-overhead": the compiled forward and backward replay as CUDA graphs (no host
    # synchronisation inside the layer is what makes them capturable).
    T, d, n, E, K = 256, 128, 128, 16, 4
    eager, twin = _twins(E, K, d, n, add_bias=True)
    graphed = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    for step in range(4):  # the first calls record, the later ones replay
        x = torch.randn(T, d, device="cuda").bfloat16()
        # (a new seed each step: the next step's inputs must differ, or a replay that returned the
        # last step's buffers would pass)
        _assert_step_matches(eager, twin, graphed, x, torch.randn(T, d, device="cuda"), f"step {step}", seed=step)
    # Inductor falls back to plain launches, with a warning only, when a graph cannot be captured.
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled layer was not CUDA-graphed"
