"""The experts in FP8 (E4M3, DeepSeek-V3's recipe) on the kernels, on a top-K routing the caller
made: the experts ops (experts_forward / experts_backward) given the weights' FP8 copies, one per
direction over the C++ API's experts call with precision FP8 (src/host/layer/fp8_experts.cu). The layer with `precision="fp8"` (machmoe.fp8_layer) runs the
same expert code inside the layer call, with its own router and routing.

    out, saved = experts_forward(x, w1, w2, scores, experts)
    dx, dw1, dw2, d_scores = experts_backward(x, w1, w2, scores, experts, saved, dout)
    out = experts(x, w1, w2, scores, experts, cache=None)  # differentiable (SwiGLU, no biases)

Forward (machmoe/reference_fp8_layer.hpp states the same in double): the routing metadata of the
top-K list; x [T, d] quantised once, 1x128 along d; the up-projection gathers x's rows by token and
its GLU epilogue writes H and A in E4M3 with their 1x128 scales (A from the fp32 H); the
down-projection on A writes Y [T·K, d] bf16; out[t] = Σ_k scores[t, k] · Y[row of (t, k)] in fp32,
rounded once. Backward: dout quantised once; dA' = dout[t]·W2 (W2's transposed copy); one kernel
recomputes A from the saved H and writes d_scores, dH = swiglu'(H)·(score·dA') and A' = score·A;
dX~ = dH·W1 (dH quantised by rows, W1's transposed copy) and dx the sum per token; dW2 and dW1
from the columns of dout, A', x and dH quantised along each expert's 128-row chunks (the column
pass reads dH in bf16, not dH's quantised rows: the one difference from the reference).
The weights are quantised in 128x128 blocks once per change (machmoe.fp8_weights.FP8WeightCache).
`saved` is (the call's saved block: H in E4M3 with its scales and the routing metadata; the list's
token and expert ids).
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8_weights import FP8WeightCache, concatenate_gate_up

_DEFAULT_CACHE = FP8WeightCache()


def _copies(cache: FP8WeightCache, w1: torch.Tensor, w2: torch.Tensor, concatenated: bool) -> list:
    """The weights' FP8 copies as the ops take them: w1's (rows interleaved) and w2's, each plain
    and transposed (one quantisation per weight and change makes both: the forward asks for the
    backward's transposed copies too)."""
    return [*cache.get(w1, True, concatenated), *cache.get(w2, True)]


def _pair_list(experts: torch.Tensor) -> tuple:
    """The top-K list experts [T, K] as the ops' general list, ordered by token: (token [T·K],
    expert [T·K]) int32."""
    T, K = experts.shape
    token = torch.arange(T, device=experts.device, dtype=torch.int32).repeat_interleave(K)
    return token, experts.to(torch.int32).reshape(-1).contiguous()


def experts_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                    experts: torch.Tensor, *, cache: Optional[FP8WeightCache] = None, concatenated: bool = False):
    """out [T, d] in x's dtype: the experts w1 [E, 2n, d] (gate/up interleaved, or concatenated:
    its FP8 copy is then made of the rows interleaved), w2 [E, d, n] on the top-K routing (scores
    [T, K] float, experts [T, K] int, K distinct experts per token) of x [T, d] bf16, in FP8; and
    the tensors its backward reads. CUDA bf16 tensors only."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        raise ValueError(f"x must be a CUDA bfloat16 [T, d] tensor; got {x.dtype} {list(x.shape)} on {x.device}")
    if experts.dim() != 2 or scores.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"scores and experts must both be [T, K] with T = x.shape[0] = {x.shape[0]}; got "
                         f"{list(scores.shape)} and {list(experts.shape)}")
    cache = _DEFAULT_CACHE if cache is None else cache
    token, expert = _pair_list(experts)
    # (w1 and w2 are checked by the op, not read: the FP8 copies stand for them)
    out, saved = torch.ops.machmoe.experts_forward(x.contiguous(), w1, None, w2, None,
                                                   scores.to(torch.float32).reshape(-1).contiguous(), token, expert,
                                                   "swiglu", "interleaved", [],
                                                   fp8_weights=_copies(cache, w1, w2, concatenated))
    return out, (saved, token, expert)


def experts_backward(x, w1, w2, scores, experts, saved, dout, *, cache: Optional[FP8WeightCache] = None,
                     concatenated: bool = False):
    """(dx [T, d], dw1 [E, 2n, d], dw2 [E, d, n], d_scores [T, K]) of experts_forward from its
    `saved` and dout [T, d] (module docstring). concatenated: as experts_forward; dw1 is returned
    in w1's (concatenated) row order."""
    block, token, expert = saved
    cache = _DEFAULT_CACHE if cache is None else cache
    T, K = scores.shape
    dx, dw1, _, dw2, _, d_scores = torch.ops.machmoe.experts_backward(
        x.contiguous(), w1, None, w2, None, token, expert, block, dout.to(torch.bfloat16).contiguous(), "swiglu",
        "interleaved", [], fp8_weights=_copies(cache, w1, w2, concatenated))
    if concatenated:
        dw1 = concatenate_gate_up(dw1)
    return dx, dw1, dw2, d_scores.reshape(T, K).to(scores.dtype)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, scores, experts, cache, concatenated):
        out, saved = experts_forward(x, w1, w2, scores, experts, cache=cache, concatenated=concatenated)
        ctx.save_for_backward(x, w1, w2, scores, experts, *saved)
        ctx.cache, ctx.concatenated = cache, concatenated
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, scores, experts, *saved = ctx.saved_tensors
        dx, dw1, dw2, d_scores = experts_backward(x, w1, w2, scores, experts, tuple(saved), dout, cache=ctx.cache,
                                                  concatenated=ctx.concatenated)
        return dx, dw1, dw2, d_scores, None, None, None


def experts(x, w1, w2, scores, experts_idx, *, cache: Optional[FP8WeightCache] = None, concatenated: bool = False):
    """The FP8 experts (SwiGLU, no biases) as a differentiable function: out [T, d]; gradients for
    x, w1, w2 and scores (experts_idx [T, K] gets none). cache: the weights' FP8 copies (None: this
    module's default cache). concatenated: w1's gate/up rows in the concatenated layout."""
    return _Experts.apply(x, w1, w2, scores, experts_idx, cache, concatenated)
