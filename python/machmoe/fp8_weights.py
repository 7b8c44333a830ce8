"""FP8 copies of the expert weights, made once per change of the weights.

FP8 training quantises each weight [E, N, K] into E4M3 codes with one fp32 scale per 128×128
block (and, for the GEMMs that read a weight transposed, a transposed copy with the same codes).
Doing that in every forward and backward would cost a pass over every weight per GEMM; the
weights change only at an optimizer step, so the copies are kept and made again only when their
weight has changed. A stale copy would be a silent wrong answer, so a copy is reused only while
all of these still hold for its weight:

- no `torch.optim` optimizer has taken a step since the copy was made (a process-wide count kept by
  torch.optim's global step hook). The version counter alone misses fused optimizers:
  `AdamW(fused=True)` writes the parameters in one kernel without moving their version counters,
  and with it the copies would stay those of the first step while the weights train;
- the same tensor object (held weakly: the copy dies with its weight), or for a view the same
  base tensor and the same view of it (shape, strides, offset): a module that hands its weight
  over as a fresh view on every call (`weight.transpose(1, 2)`, as transformers' transposed
  experts) still finds its copies;
- the same version counter: every in-place write through the tensor itself or a view of it bumps
  it (foreach and single-tensor optimizer steps, `copy_` / `load_state_dict` under `no_grad`);
- the same storage pointer, shape, strides, dtype and device (`param.data = other` changes these).

Not seen: writes that are neither an optimizer step nor an in-place op on the tensor or a view of
it: through `param.data` (a tensor with a version counter of its own), by a collective or a
kernel outside PyTorch's in-place ops, or by an optimizer that is not a `torch.optim.Optimizer`.
Call `invalidate()` after such writes. Quantised on every call, never cached: inference tensors
(no version counter), fake tensors (a trace: FakeTensorMode, torch.compile; no data), and any weight
while a CUDA graph is being captured on the current stream (a cached copy would be frozen into the
graph and replayed stale after the next optimizer step; made inside the capture, each replay
quantises the weights it reads).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.optim.optimizer import register_optimizer_step_post_hook

Quantized = tuple  # (q [E, N, K] e4m3, scales [E, ceil(N/128), ceil(K/128)] f32, qt or None, qt_scales or None)

# torch.optim steps taken in this process since the first cache was made (module docstring).
_optimizer_steps = 0
_step_hook = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _capturing(w: torch.Tensor) -> bool:
    """Whether w's device is recording a CUDA graph on the current stream: a copy kept from before
    the capture would be baked into the graph and replayed after the weights change, so under
    capture the copies are made inside the graph (each replay quantises the weights as they are)."""
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def _watch_optimizer_steps() -> None:
    """Registers the global post-step hook once (the first cache made does it)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_optimizer_step)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """w [E, 2n, K] with the gate rows [0, n) and the up rows [n, 2n) (the concatenated layout)
    -> a copy with gate row j and up row j at rows 2j and 2j + 1 (the interleaved layout the FP8
    experts compute in)."""
    E, N, K = w.shape
    return w.reshape(E, 2, N // 2, K).transpose(1, 2).reshape(E, N, K)


def concatenate_gate_up(w: torch.Tensor) -> torch.Tensor:
    """The inverse of interleave_gate_up: interleaved rows [E, 2n, K] -> concatenated."""
    E, N, K = w.shape
    return w.reshape(E, N // 2, 2, K).transpose(1, 2).reshape(E, N, K)


def _quantize_on_kernels(w: torch.Tensor, transposed: bool) -> Quantized:
    return tuple(torch.ops.machmoe.fp8_quantize_weights(w.contiguous(), transposed))


class FP8WeightCache:
    """weight -> its FP8 copies, remade when the weight changes (module docstring).

    quantize(w, transposed) -> (q, scales, qt, qt_scales): the quantiser, by default the
    machmoe::fp8_quantize_weights kernels (CUDA bfloat16 weights)."""

    def __init__(self, quantize: Optional[Callable[[torch.Tensor, bool], Quantized]] = None):
        self._quantize = quantize or _quantize_on_kernels
        _watch_optimizer_steps()
        # id(weight) -> (weakref to it, what it looked like, transposed -> copies)
        self._entries: dict[int, tuple] = {}

    @staticmethod
    def _signature(w: torch.Tensor) -> tuple:
        return (_optimizer_steps, w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device)

    def get(self, w: torch.Tensor, transposed: bool = False, interleave: bool = False) -> Quantized:
        """The FP8 copies of w (with the transposed copy when `transposed`, and whenever it was
        made already: the plain copy comes with it), made now if w has changed since they were
        made (or never was). interleave: w [E, 2n, K] holds concatenated gate/up rows, and the
        copies are of its rows interleaved (interleave_gate_up), kept beside the plain ones."""
        rows = (lambda t: interleave_gate_up(t)) if interleave else (lambda t: t)
        if w.is_inference() or is_fake(w) or _capturing(w):
            return self._quantize(rows(w.detach()), transposed)
        # A view is held through its base, the copies keyed by the view's geometry as well.
        base = w._base if w._base is not None else w
        view = (tuple(w.shape), w.stride(), w.storage_offset())
        key = id(base)
        entry = self._entries.get(key)
        signature = self._signature(base)
        if entry is None or entry[0]() is not base or entry[1] != signature:
            entry = (weakref.ref(base, self._forget(key)), signature, {})
            self._entries[key] = entry
        copies = entry[2]  # (view, transposed, interleave) -> copies
        if (view, True, interleave) in copies:  # the transposed quantisation holds the plain copy as well
            return copies[(view, True, interleave)]
        if (view, transposed, interleave) not in copies:
            copies[(view, transposed, interleave)] = self._quantize(rows(w.detach()), transposed)
        return copies[(view, transposed, interleave)]

    def _forget(self, key: int):
        """A weakref callback that drops key's entry once its weight is gone (if the entry is
        still that weight's: the id may have been reused)."""
        cache = weakref.ref(self)

        def drop(ref):
            owner = cache()
            if owner is not None and key in owner._entries and owner._entries[key][0] is ref:
                del owner._entries[key]

        return drop

    def invalidate(self, w: Optional[torch.Tensor] = None) -> None:
        """Forgets w's copies (those of w's base and every view of it, for a view; every weight's
        with None): after writes the cache cannot see."""
        if w is None:
            self._entries.clear()
        else:
            self._entries.pop(id(w._base if w._base is not None else w), None)

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy, pickling a module that holds the cache) starts empty: its
        entries hold weak references, and a copy's weights are other tensors anyway."""
        return {"_quantize": self._quantize, "_entries": {}}
