"""The fake kernels (machmoe/_fake.py) without a GPU: every CUDA op has one, and the whole layer,
forward and backward, traces on fake CUDA tensors with the shapes the C++ ops allocate. Their
agreement with the kernels themselves is checked on the GPU (test_gpu_compile.py)."""

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
    # The fakes restate the C++ planner's saved-block size in arithmetic that also runs on symbolic
    # sizes (torch.compile(dynamic=True)); it must give the planner's bytes for every problem.
    checked = 0
    for T in (1, 7, 64, 300, 4097):
        for E in (1, 8, 130):
            for K in sorted({1, 2, min(E, 8)}):
                if K > E:
                    continue
                for n, act in ((64, "swiglu"), (200, "relu")):
                    n1 = 2 * n if act == "swiglu" else n
                    for rounding, tile_m in (("none", 128), ("nr", 1), ("up", 64), ("stochastic", 128)):
                        plan = torch.ops.machmoe.layer_workspace_bytes(T, 96, n, E, K, act, rounding, tile_m)
                        assert _fake.layer_saved_bytes(T, E, K, n1, rounding, tile_m) == plan[0], \
                            (T, E, K, n, act, rounding, tile_m)
                        assert _fake.layer_saved_bytes(T, E, K, n1, rounding, tile_m, False) == plan[3]
                        checked += 1
                    for R in sorted({0, min(5, T * E), min(T * K + 3, T * E)}):
                        for bias in (False, True):
                            plan = torch.ops.machmoe.experts_workspace_bytes(T, 96, n, E, R, act, bias)
                            assert _fake.experts_saved_bytes(T, E, R, n1) == plan[0], (T, E, R, n, act, bias)
    assert checked > 100
