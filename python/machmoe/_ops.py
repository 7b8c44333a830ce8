"""Loads libmachmoe_torch.so, which registers the `torch.ops.machmoe.*` ops (docs/OPS.md).

Search order: $MACHMOE_LIBRARY_DIR (the development build sets it to build/lib), then this
package's directory (pip install). A missing or unloadable library is not an import error: the
pure-PyTorch backend works without it. `ops_available()` says whether it loaded, and
`require_ops()` raises a RuntimeError that says why not and how to build it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

LIBRARY_NAME = "libmachmoe_torch.so"


def _candidate_paths() -> list[Path]:
    paths = []
    env_dir = os.environ.get("MACHMOE_LIBRARY_DIR")
    if env_dir:
        paths.append(Path(env_dir) / LIBRARY_NAME)
    paths.append(Path(__file__).resolve().parent / LIBRARY_NAME)
    return paths


def _load() -> tuple[Optional[Path], Optional[str]]:
    """(path loaded, None) on success, (None, reason) otherwise."""
    tried = []
    for path in _candidate_paths():
        if not path.is_file():
            tried.append(str(path))
            continue
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as err:
            # The file is there but does not load (missing CUDA runtime, ABI mismatch, ...):
            # report that rather than silently trying the next candidate.
            return None, f"{path} exists but failed to load: {err}"
        return path, None
    return None, f"{LIBRARY_NAME} not found (looked at: {', '.join(tried)})"


_LIBRARY_PATH, _LOAD_ERROR = _load()
if _LIBRARY_PATH is not None:
    from . import _fake

    _fake.register()  # fake kernels of the CUDA ops: torch.compile and FakeTensorMode trace them


def ops_available() -> bool:
    """True when libmachmoe_torch.so is loaded and torch.ops.machmoe.* can be called."""
    return _LIBRARY_PATH is not None


def library_path() -> Optional[Path]:
    return _LIBRARY_PATH


def require_ops() -> None:
    """Raises RuntimeError explaining how to get the compiled ops, unless they are loaded."""
    if _LIBRARY_PATH is None:
        raise RuntimeError(
            f"machmoe's compiled ops are not available: {_LOAD_ERROR}. Build them with "
            "scripts/build.sh and set MACHMOE_LIBRARY_DIR to the build's lib directory "
            "(e.g. build/lib), or `pip install` the machmoe package."
        )


def layer_kernels_available() -> bool:
    """True when the compiled ops are loaded and report that the GPU layer kernels exist."""
    return ops_available() and bool(torch.ops.machmoe.layer_kernels_available())
