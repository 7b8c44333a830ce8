"""The ping-pong grouped GEMM (kernels/sm90_grouped_gemm_pingpong.cuh, opt-in by
MACHMOE_GEMM_PINGPONG=1, or =2 for clusters of two CTAs multicasting the weights): the plain store
with contiguous A, i.e. the down-projection and dX~.

The switch is read once per process, so the GEMM and layer tests that reach that path run again
in a child process with it set, against the same float64 references and derived tolerances as
without it (SPEC §4). `scripts/gpu_ab.sh @MACHMOE_GEMM_PINGPONG=1` runs every GPU test that way
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


@pytest.mark.parametrize("mode", ["1", "2", "5", "6"])
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
