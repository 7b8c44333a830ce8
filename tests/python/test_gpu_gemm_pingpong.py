"""The ping-pong grouped GEMM (kernels/gemm/pingpong.cuh): the plain store with
contiguous A, i.e. the down-projection and dX~. By default it runs where the shape rule of
host/gemm/grouped_gemm.cu (kPingPongWhere) says it wins; MACHMOE_GEMM_PINGPONG=0 turns it off, 1 (2: CTA
pairs multicasting the weights; 5/6: the same with the ring epilogue) forces it wherever it applies.

The switch is read once per process, so the GEMM and layer tests that reach that path run again
in a child process for each setting (0 keeps the cooperative kernel covered at the shapes the rule
gives to the ping-pong one), against the same float64 references and derived tolerances (SPEC §4). `scripts/gpu_ab.sh @MACHMOE_GEMM_PINGPONG=1` runs every GPU test that way
and times the kernels beside the default."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

HERE = Path(__file__).parent

# The plain-store GEMMs with K-major and N-major weights (partial tiles, N not a multiple of the
# 192-wide tile, biases, > 512 experts), and the layer forward and backward at SPEC shapes and
# awkward ones, whose down-projection and dX~ take the ping-pong path: one child per mode, so
# that torch and the op library load once.
FILES = ["test_gpu_gemm.py", "test_gpu_gemm_backward.py", "test_gpu_layer.py", "test_gpu_backward.py"]
EXPR = "store or many_experts or can_fail or spec_shapes or awkward or empty_experts or deterministic"


# A hang (a deadlock in the kernel) costs one child's timeout, not two: gpu_check's test step has a
# few minutes for the whole suite.
_HUNG = []


@pytest.mark.parametrize("mode", ["0", "1", "2", "5", "6"])
def test_pingpong_passes_the_store_gemm_and_layer_tests(mode):
    if _HUNG:
        pytest.fail(f"not run: the child with MACHMOE_GEMM_PINGPONG={_HUNG[0]} did not finish in 90 s")
    env = dict(os.environ, MACHMOE_GEMM_PINGPONG=mode)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               *[str(HERE / f) for f in FILES], "-k", EXPR],
                              env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        _HUNG.append(mode)
        raise
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    assert proc.returncode == 0, f"with MACHMOE_GEMM_PINGPONG={mode} the tests failed:\n{tail}"
    assert " passed" in proc.stdout, f"no test ran:\n{tail}"


_STORE_CALL = ("a = torch.randn(130, 64, device='cuda').bfloat16(); "
               "w = torch.randn(1, 256, 64, device='cuda').bfloat16(); "
               "off = torch.tensor([0, 130], dtype=torch.int32, device='cuda'); "
               "torch.ops.machmoe.grouped_gemm(a, None, off, w, None, 130, 'store', 'swiglu', 'interleaved')")
_DH_CALL = ("dout = torch.randn(130, 64, device='cuda').bfloat16(); "
            "idx = torch.arange(130, dtype=torch.int32, device='cuda'); "
            "off = torch.tensor([0, 130], dtype=torch.int32, device='cuda'); "
            "w2 = torch.randn(1, 64, 128, device='cuda').bfloat16(); "
            "h = torch.randn(130, 256, device='cuda').bfloat16(); "
            "torch.ops.machmoe.grouped_gemm_nmajor(dout, idx, off, w2, 130, h, torch.rand(130, device='cuda'), "
            "idx, 'swiglu', 'interleaved')")


@pytest.mark.parametrize("var,value,call", [("MACHMOE_GEMM_PINGPONG", "3", _STORE_CALL),
                                            ("MACHMOE_DH_PINGPONG", "2", _DH_CALL)])
def test_pingpong_switch_refuses_an_unknown_value(var, value, call):
    # A typo must not silently fall back to some kernel: the first GEMM that reads it says why.
    code = "import torch, machmoe._ops as o; o.require_ops(); " + call + "; torch.cuda.synchronize()"
    env = dict(os.environ, **{var: value})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0, f"{var}={value} was accepted"
    assert f"{var}='{value}'" in proc.stderr and "must be 0" in proc.stderr, proc.stderr[-2000:]
    # and the same call runs with the switch unset (the failure above was the switch's)
    env.pop(var)
    ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.parametrize("mode", ["0", "1"])
def test_dh_pingpong_passes_the_dh_and_backward_tests(mode):
    # The dH kernel as a ping-pong GEMM (kernels/gemm/dact_pingpong.cuh; by default
    # where d <= 2048): forced off (0: the cooperative kernel at every shape) and forced on (1),
    # over the dH epilogue tests (every activation, both layouts, n not a multiple of 128, partial
    # tiles) and the layer backward (SPEC shapes, awkward shapes, determinism), in a child process
    # with the switch set.
    if _HUNG:
        pytest.fail(f"not run: the child with MACHMOE_GEMM_PINGPONG={_HUNG[0]} did not finish in 90 s")
    env = dict(os.environ, MACHMOE_DH_PINGPONG=mode)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(HERE / "test_gpu_gemm_backward.py"), str(HERE / "test_gpu_backward.py"),
                           "-k", "dact or layer_backward"],
                          env=env, capture_output=True, text=True, timeout=120)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    assert proc.returncode == 0, f"with MACHMOE_DH_PINGPONG={mode} the tests failed:\n{tail}"
    assert " passed" in proc.stdout, f"no test ran:\n{tail}"
