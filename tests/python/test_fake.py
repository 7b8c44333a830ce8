"""The fake kernels (machmoe/_fake.py) without a GPU: every CUDA op has one, the whole layer,
forward and backward, traces on fake CUDA tensors with the shapes the C++ ops allocate, and the
saved block's size, which the fakes take from the C++ layout, is the C++ planner's, also on
symbolic sizes. Their agreement with the kernels themselves is checked on the GPU
(test_gpu_compile.py)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from machmoe import _fake, functional

pytestmark = pytest.mark.ops


def _cuda_ops() -> set:
    """The machmoe ops with a CUDA kernel, from the dispatcher."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("machmoe::")]
    return {n.split("::")[1] for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")}


def test_every_cuda_op_has_a_fake():
    cuda_ops = _cuda_ops()
    assert "layer_forward" in cuda_ops and "grouped_gemm" in cuda_ops  # the query itself works
    assert cuda_ops == set(_fake.FAKES), "CUDA ops without a fake (or fakes without an op): " + \
        str(cuda_ops ^ set(_fake.FAKES))


@pytest.mark.parametrize("act,bias,rounding", [("swiglu", False, "none"), ("relu", True, "none"),
                                               ("geglu", True, "nr")])
def test_layer_traces_forward_and_backward_on_fake_tensors(act, bias, rounding):
    T, d, n, E, K = 77, 128, 64, 8, 2
    n1 = 2 * n if act in ("swiglu", "geglu") else n
    with FakeTensorMode():
        def param(*shape):
            return torch.empty(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

        x, wr, w1, w2 = param(T, d), param(E, d), param(E, n1, d), param(E, d, n)
        b1, b2 = (param(E, n1), param(E, d)) if bias else (None, None)
        out, aux = functional.moe(x, wr, w1, w2, num_experts_per_tok=K, activation=act, b1=b1, b2=b2,
                                  token_rounding=rounding, backend="machmoe")
        assert out.shape == (T, d) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        assert aux.shape == () and aux.dtype == torch.float32
        # The saved block the autograd node keeps is the planner's size for this problem.
        saved = out.grad_fn.saved_tensors[-1]
        plan = torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, K, act, rounding, 128)
        assert saved.dtype == torch.uint8 and saved.numel() == plan[0]
        # The node's backward, called directly: the autograd engine would want a CUDA device.
        grads = out.grad_fn.apply(torch.ones_like(out), torch.ones_like(aux))
        for p, grad in zip((x, wr, w1, b1, w2, b2), grads):
            if p is None:
                assert grad is None
            else:
                assert grad.shape == p.shape and grad.dtype == p.dtype and grad.device == p.device


def test_fp8_layer_traces_forward_and_backward_on_fake_tensors():
    # precision="fp8" on the kernels: the weights' FP8 copies (made on the fakes, never cached: a
    # trace has no data) go into the layer ops, whose saved block is the FP8 planner's size.
    from machmoe.fp8_layer import new_cache

    T, d, n, E, K = 77, 128, 64, 8, 2
    cache = new_cache()
    with FakeTensorMode():
        def param(*shape):
            return torch.empty(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

        x, wr, w1, w2 = param(T, d), param(E, d), param(E, 2 * n, d), param(E, d, n)
        for layout in ("interleaved", "concatenated"):
            out, aux = functional.moe(x, wr, w1, w2, num_experts_per_tok=K, layout=layout, backend="machmoe",
                                      precision="fp8", fp8_cache=cache)
            assert out.shape == (T, d) and out.dtype == torch.bfloat16 and aux.shape == ()
            saved = out.grad_fn.saved_tensors[-1]
            plan = torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, K, "swiglu", "none", 128, fp8=True)
            assert saved.dtype == torch.uint8 and saved.numel() == plan[0]
            grads = out.grad_fn.apply(torch.ones_like(out), torch.ones_like(aux))
            for p, grad in zip((x, wr, w1, None, w2), grads):
                if p is not None:
                    assert grad.shape == p.shape and grad.dtype == p.dtype and grad.device == p.device
    assert len(cache) == 0


def test_inference_forward_fake_saves_no_h():
    T, d, n, E, K = 33, 64, 64, 4, 1
    plan = torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, K, "swiglu", "none", 128)
    with FakeTensorMode():
        def t(*shape):
            return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)

        args = (t(T, d), t(E, d), t(E, 2 * n, d), None, t(E, d, n), None, None, K, "swiglu", "interleaved",
                "softmax_topk", True, "none", 128, 0)
        _, _, saved = torch.ops.machmoe.layer_forward(*args, True)
        _, _, saved_inference = torch.ops.machmoe.layer_forward(*args, False)
    assert (saved.numel(), saved_inference.numel()) == (plan[0], plan[3])
    assert plan[3] < plan[0]


def test_gemm_and_routing_fakes_follow_the_op_docs():
    # docs/OPS.md: the shapes each op returns, including the per-128-column dS partials and the
    # transposed weight gradient.
    R, T, E, K, d, n = 40, 20, 4, 2, 96, 320
    with FakeTensorMode():
        i32 = dict(device="cuda", dtype=torch.int32)
        a = torch.empty(R, d, device="cuda", dtype=torch.bfloat16)
        offs = torch.empty(E + 1, **i32)
        w1 = torch.empty(E, 2 * n, d, device="cuda", dtype=torch.bfloat16)
        h, a_, ds = torch.ops.machmoe.grouped_gemm_nmajor(
            a, None, offs, torch.empty(E, d, n, device="cuda", dtype=torch.bfloat16), R,
            torch.empty(R, 2 * n, device="cuda", dtype=torch.bfloat16), torch.empty(R, device="cuda"),
            torch.empty(R, **i32), "swiglu", "interleaved")
        # one dS partial per 128 columns of n = 320, whichever kernel runs
        assert (h.shape, a_.shape, ds.shape, ds.dtype) == ((R, 2 * n), (R, n), (R, 3), torch.float32)
        c, c2 = torch.ops.machmoe.grouped_gemm(a, None, offs, w1, None, R, "glu", "swiglu", "interleaved")
        assert (c.shape, c2.shape) == ((R, 2 * n), (R, n))
        dw1 = torch.ops.machmoe.grouped_gemm_wgrad(a, None, h, offs, True, True)
        assert dw1.shape == (E, 2 * n, d) and dw1.dtype == torch.float32
        meta = torch.ops.machmoe.routing_metadata(torch.empty(T, K, **i32), None, T, E)
        assert [m.shape for m in meta] == [(E + 1,), (T * K,), (T * K,), (T * K,), (T + 1,), (1,)]
        rounded = torch.ops.machmoe.token_rounding(torch.empty(T, E, device="cuda"), K, "nr", 8, 0)
        assert rounded[0].shape == (min(T * K + E * 7, T * E),) and rounded[3].dtype == torch.bool


def test_saved_block_sizes_are_the_planners():
    # The fakes size the saved block from the C++ layout (layer_saved_layout / experts_saved_layout);
    # evaluated at a concrete T it must give the planner's bytes (*_workspace_bytes) for every problem.
    checked = 0
    for T in (0, 1, 7, 64, 300, 4097):
        for E in (1, 8, 130):
            for K in sorted({1, 2, min(E, 8)}):
                if K > E:
                    continue
                for n, act in ((64, "swiglu"), (200, "relu")):
                    for rounding, tile_m in (("none", 128), ("nr", 1), ("up", 64), ("stochastic", 128)):
                        plan = torch.ops.machmoe.layer_workspace_bytes(T, 96, n, E, K, act, rounding, tile_m)
                        assert _fake.layer_saved_bytes(T, n, E, K, act, rounding, tile_m) == plan[0], \
                            (T, E, K, n, act, rounding, tile_m)
                        assert _fake.layer_saved_bytes(T, n, E, K, act, rounding, tile_m, False) == plan[3]
                        if rounding != "none":  # the token_rounding fake's list length is the layout's rows
                            layout = _fake.layer_saved_layout(n, E, K, act, rounding, tile_m)
                            assert _fake.rounding_capacity(T, E, K, tile_m) == layout.rows(T)
                        checked += 1
                    if act == "swiglu":  # precision FP8 (swiglu, no rounding; d a multiple of 16)
                        plan = torch.ops.machmoe.layer_workspace_bytes(T, 96, n, E, K, act, "none", 128, fp8=True)
                        assert _fake.layer_saved_bytes(T, n, E, K, act, "none", 128, fp8=True) == plan[0]
                        bf16 = torch.ops.machmoe.layer_workspace_bytes(T, 96, n, E, K, act, "none", 128)
                        # H in E4M3 with its scales (equal when the parts' 256-byte alignment hides it)
                        assert plan[0] <= bf16[0] and (T < 64 or plan[0] < bf16[0])
                    for R in sorted({0, min(5, T * E), min(T * K + 3, T * E)}):
                        for bias in (False, True):
                            plan = torch.ops.machmoe.experts_workspace_bytes(T, 96, n, E, R, act, bias)
                            assert _fake.experts_saved_bytes(T, R, n, E, act) == plan[0], (T, E, R, n, act, bias)
    assert checked > 100


def test_saved_layout_ops_validate_their_arguments():
    with pytest.raises(ValueError, match="K"):
        torch.ops.machmoe.layer_saved_layout(64, 4, 5, "swiglu", "none", 128)
    with pytest.raises(ValueError, match="activation"):
        torch.ops.machmoe.experts_saved_layout(64, 4, "swish")


def _symbolic_trace(fn, *tensors):
    """make_fx with symbolic sizes: every size of `tensors` becomes a symbol. Returns the shape
    environment and what fn returned while tracing (sizes as SymInts)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = {}

    def traced(*args):
        seen["result"] = fn(*args)
        return [t for t in args]

    graph = make_fx(traced, tracing_mode="symbolic")(*tensors)
    shape_env = next(n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder").fake_mode.shape_env
    return shape_env, seen["result"]


def _backed_values(shape_env):
    """Each symbol's value in the trace (the sizes the traced tensors had)."""
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


@pytest.mark.parametrize("act,rounding,write_h", [("swiglu", "none", True), ("relu", "up", True),
                                                  ("geglu", "nr", False)])
def test_layer_fake_keeps_the_token_count_symbolic(act, rounding, write_h):
    # The fake's saved block under symbolic T: no guard on T (one compiled graph serves every
    # token count), and the expression gives the planner's bytes at every T.
    d, n, E, K, tile_m = 64, 48, 8, 2, 16
    n1 = 2 * n if act in ("swiglu", "geglu") else n

    def forward(x, wr, w1, w2):
        _, _, saved = torch.ops.machmoe.layer_forward(x, wr, w1, None, w2, None, None, K, act, "interleaved",
                                                      "softmax_topk", True, rounding, tile_m, 0, write_h)
        return x.shape[0], saved.shape[0]

    bf16 = dict(dtype=torch.bfloat16)
    shape_env, (T_sym, saved_sym) = _symbolic_trace(
        forward, torch.empty(77, d, **bf16), torch.empty(E, d, **bf16), torch.empty(E, n1, d, **bf16),
        torch.empty(E, d, n, **bf16))
    T_expr = T_sym.node.expr
    assert isinstance(saved_sym, torch.SymInt) and T_expr.free_symbols <= saved_sym.node.expr.free_symbols
    assert not any(T_expr.free_symbols & g.expr.free_symbols for g in shape_env.guards), \
        "the fake guarded on the token count"
    for T in (1, 77, 128, 1000, 4097):
        hints = dict(_backed_values(shape_env))
        hints.update({s: T for s in T_expr.free_symbols})
        bytes_at_T = int(saved_sym.node.expr.xreplace(hints))
        plan = torch.ops.machmoe.layer_workspace_bytes(T, d, n, E, K, act, rounding, tile_m)
        assert bytes_at_T == plan[0 if write_h else 3], T


def test_experts_fake_keeps_tokens_and_list_length_symbolic():
    d, n, E = 64, 40, 6

    def forward(x, w1, w2, scores, token_idx, expert_idx):
        _, saved = torch.ops.machmoe.experts_forward(x, w1, None, w2, None, scores, token_idx, expert_idx,
                                                     "relu", "interleaved")
        return x.shape[0], scores.shape[0], saved.shape[0]

    bf16, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    R0 = 50
    shape_env, (T_sym, R_sym, saved_sym) = _symbolic_trace(
        forward, torch.empty(33, d, **bf16), torch.empty(E, n, d, **bf16), torch.empty(E, d, n, **bf16),
        torch.empty(R0), torch.empty(R0, **i32), torch.empty(R0, **i32))
    free = T_sym.node.expr.free_symbols | R_sym.node.expr.free_symbols
    assert not any(free & g.expr.free_symbols for g in shape_env.guards), "the fake guarded on T or R"
    for T, R in ((1, 3), (33, 50), (500, 2999)):
        hints = dict(_backed_values(shape_env))
        hints.update({s: T for s in T_sym.node.expr.free_symbols})
        hints.update({s: R for s in R_sym.node.expr.free_symbols})
        plan = torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, R, "relu", False)
        assert int(saved_sym.node.expr.xreplace(hints)) == plan[0], (T, R)
