"""Loads libmachmoe_torch.so, which registers the `torch.ops.machmoe.*` ops (docs/OPS.md).

Where it looks: $MACHMOE_LIBRARY_DIR/libmachmoe_torch.so alone when that variable is set (an
explicit choice never falls back to another, possibly stale, build); otherwise, first found wins:
  1. this package's directory (a pip install puts the library beside the Python files);
  2. <checkout>/build/lib, when this package is the python/ folder of a source checkout built
     by scripts/build.sh (so that `import machmoe` works right after the README's setup).
A missing or unloadable library is not an import error: the pure-PyTorch backend works without
it. `ops_available()` says whether it loaded, `require_ops()` raises a RuntimeError saying why
not and how to build it, and `layer_kernels_available()` says whether the GPU kernels can run on
this machine.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import torch

LIBRARY_NAME = "libmachmoe_torch.so"
KERNEL_CAPABILITY = (9, 0)  # the kernels are compiled for sm_90a only (H100, H200)


def _checkout_build_dir() -> Optional[Path]:
    """<checkout>/build/lib when this file lives at <checkout>/python/machmoe/_ops.py."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "CMakeLists.txt").is_file() and (checkout / "python" / "machmoe").is_dir():
        return checkout / "build" / "lib"
    return None


def _candidate_paths() -> list[Path]:
    env_dir = os.environ.get("MACHMOE_LIBRARY_DIR")
    if env_dir:
        return [Path(env_dir) / LIBRARY_NAME]
    paths = [Path(__file__).resolve().parent / LIBRARY_NAME]
    build_dir = _checkout_build_dir()
    if build_dir is not None:
        paths.append(build_dir / LIBRARY_NAME)
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

    # Fake kernels of the CUDA ops: torch.compile and FakeTensorMode trace them. A library older
    # than this package lacks some of its ops: say which, and that the build is stale.
    missing = [name for name in _fake.FAKES if not hasattr(torch.ops.machmoe, name)]
    if missing:
        raise ImportError(f"{_LIBRARY_PATH} has no op {', '.join(missing)}: it was built from an older "
                          f"machmoe than this package; rebuild it (scripts/build.sh)")
    _fake.register()
# Asked once: a plain bool that torch.compile can trace through (the op call itself it cannot).
_KERNELS_COMPILED = _LIBRARY_PATH is not None and bool(torch.ops.machmoe.layer_kernels_available())


def ops_available() -> bool:
    """True when libmachmoe_torch.so is loaded and torch.ops.machmoe.* can be called."""
    return _LIBRARY_PATH is not None


def library_path() -> Optional[Path]:
    """The path libmachmoe_torch.so was loaded from, or None."""
    return _LIBRARY_PATH


def require_ops() -> None:
    """Raises RuntimeError explaining how to get the compiled ops, unless they are loaded."""
    if _LIBRARY_PATH is None:
        raise RuntimeError(
            f"machmoe's compiled ops are not available: {_LOAD_ERROR}. Build them with "
            "scripts/build.sh (a source checkout finds build/lib by itself), or set "
            "MACHMOE_LIBRARY_DIR to the directory holding the library."
        )


def kernels_compiled() -> bool:
    """True when the loaded library was built with the sm_90a layer kernels (a build without
    CUDA kernels still has the CPU reference ops)."""
    return ops_available() and _KERNELS_COMPILED


def kernels_unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """None when the layer kernels can run on `device` (default: any visible GPU), else why not.

    The kernels need the compiled ops, a library built with them, and a CUDA device of compute
    capability 9.0 (sm_90: H100, H200); other GPUs run the torch backend.
    """
    if device is None:
        return _reason_for_device("any", -1)
    return _reason_for_device(device.type, -1 if device.index is None else device.index)


@torch.compiler.assume_constant_result
def _reason_for_device(device_type: str, index: int) -> Optional[str]:
    """kernels_unavailable_reason by device type and index ("any": every visible device; index
    -1: the current one). torch.compile runs it once while tracing and keeps the answer, so that a
    compiled layer has no graph break here."""
    if not ops_available():
        return f"the compiled ops are not loaded ({_LOAD_ERROR})"
    if not kernels_compiled():
        return "the library was built without the GPU layer kernels"
    if device_type not in ("any", "cuda"):
        return f"the tensors are on {device_type}, not on a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if device_type == "cuda":
        capabilities = [torch.cuda.get_device_capability(None if index < 0 else index)]
    else:
        capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if KERNEL_CAPABILITY not in capabilities:
        found = ", ".join(f"{major}.{minor}" for major, minor in capabilities)
        return f"the kernels need compute capability 9.0 (sm_90); the device has {found}"
    return None


def layer_kernels_available() -> bool:
    """True when the layer kernels can run here: the compiled ops are loaded, they were built with
    the kernels, and a CUDA device of compute capability 9.0 is visible."""
    return kernels_unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (asked once per device): what the callers that bound a
    persistent kernel's CTAs, or size work to fill the GPU, read."""
    return torch.cuda.get_device_properties(device).multi_processor_count
