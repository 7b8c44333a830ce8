"""Shared test setup.

Markers:
  gpu  needs a CUDA GPU: skipped without one, failed instead when MACHMOE_REQUIRE_GPU=1.
  ops  needs libmachmoe_torch.so (torch.ops.machmoe): skipped without it, failed instead when
       MACHMOE_REQUIRE_OPS=1. A source checkout finds build/lib by itself; MACHMOE_LIBRARY_DIR
       points at another build.

Every test starts from a fresh random seed, printed (and so shown when the test fails);
MACHMOE_TEST_SEED=<seed> replays one.
"""

import os
import random
import sys
from pathlib import Path

import pytest
import torch

try:
    import machmoe  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:  # a source checkout run without PYTHONPATH=python
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from machmoe import _ops  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (skips without one unless MACHMOE_REQUIRE_GPU=1)")
    config.addinivalue_line(
        "markers", "ops: needs the compiled ops library (skips without it unless "
                   "MACHMOE_REQUIRE_OPS=1)")


def _required(env_var: str) -> bool:
    return os.environ.get(env_var) == "1"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        reason = "needs a CUDA GPU (torch.cuda.is_available() is False)"
        if _required("MACHMOE_REQUIRE_GPU"):
            pytest.fail(f"MACHMOE_REQUIRE_GPU=1 but this test {reason}", pytrace=False)
        pytest.skip(reason)
    if item.get_closest_marker("ops") is not None and not _ops.ops_available():
        reason = ("needs libmachmoe_torch.so, which did not load (build it with "
                  "scripts/build.sh, or set MACHMOE_LIBRARY_DIR to another build's lib directory)")
        if _required("MACHMOE_REQUIRE_OPS"):
            pytest.fail(f"MACHMOE_REQUIRE_OPS=1 but this test {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def seed() -> int:
    """A fresh seed per test for torch's generator; printed so a failure shows how to replay it."""
    value = int(os.environ.get("MACHMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(value)
    print(f"torch.manual_seed({value})  [replay: MACHMOE_TEST_SEED={value}]")
    return value
