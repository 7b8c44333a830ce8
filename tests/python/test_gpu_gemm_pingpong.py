"""The ping-pong grouped GEMM (kernels/sm90_grouped_gemm_pingpong.cuh, opt-in by
MACHMOE_GEMM_PINGPONG=1): the plain store with contiguous A, i.e. the down-projection and dX~.

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

# (file, -k expression): the plain-store GEMMs with K-major and N-major weights (partial tiles,
# N not a multiple of the 192-wide tile, biases, > 512 experts), and the layer forward and
# backward at SPEC shapes and awkward ones, whose down-projection and dX~ take the ping-pong path.
CASES = [
    ("test_gpu_gemm.py", "store or many_experts or deterministic or can_fail"),
    ("test_gpu_gemm_backward.py", "nmajor_store"),
    ("test_gpu_layer.py", "spec_shapes or awkward or deterministic"),
    ("test_gpu_backward.py", "spec_shapes or awkward or empty_experts or deterministic"),
]


# A hang (a deadlock in the kernel) costs one child's timeout, not one per case: the gpu_check
# test step has a few minutes for the whole suite.
_HUNG = []


@pytest.mark.parametrize("file,expr", CASES, ids=[c[0] for c in CASES])
def test_pingpong_passes_the_store_gemm_and_layer_tests(file, expr):
    if _HUNG:
        pytest.fail(f"not run: the ping-pong child for {_HUNG[0]} did not finish in 60 s")
    env = dict(os.environ, MACHMOE_GEMM_PINGPONG="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               str(HERE / file), "-k", expr], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        _HUNG.append(file)
        raise
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    assert proc.returncode == 0, f"with MACHMOE_GEMM_PINGPONG=1, {file} -k '{expr}' failed:\n{tail}"
    assert " passed" in proc.stdout, f"no test ran:\n{tail}"
