"""The experts in FP8 (E4M3, DeepSeek-V3's recipe) on the kernels, composed from the FP8 ops: what
the layer runs with `precision="fp8"` on the kernels (machmoe.fp8_layer).

    out, saved = experts_forward(x, w1, w2, scores, experts)
    dx, dw1, dw2, d_scores = experts_backward(x, w1, w2, scores, experts, saved, dout)
    out = experts(x, w1, w2, scores, experts, cache=None)  # differentiable (SwiGLU, no biases)

Steps, where the FP8 layer quantises (machmoe/reference_fp8_layer.hpp states the same in double):
  1. the routing metadata of the top-K list (rows grouped by expert, row -> token);
  2. x [T, d] quantised once, 1x128 along d (fp8_quantize_rows, no gather);
  3. the up-projection gathers x's rows by token; its GLU epilogue writes H and A in E4M3 with
     their 1x128 scales (grouped_gemm_fp8_glu); A comes from the fp32 H;
  4. the down-projection on A (grouped_gemm_fp8): Y [T·K, d] in bf16;
  5. out[t] = Σ_k scores[t, k] · Y[row of (t, k)] in fp32, rounded once to x's dtype (aggregate).
The weights are quantised in 128x128 blocks once per change (machmoe.fp8_weights.FP8WeightCache).
`saved` is (hq [T·K, 2n] e4m3, h_scales, routing metadata): what a backward would keep, H in FP8.
"""

from __future__ import annotations

from typing import Optional

import torch

from .enums import glu_clamp_list
from .fp8_weights import FP8WeightCache, concatenate_gate_up

_DEFAULT_CACHE = FP8WeightCache()


def experts_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                    experts: torch.Tensor, *, b1: Optional[torch.Tensor] = None, activation: str = "swiglu",
                    glu_clamp=None, cache: Optional[FP8WeightCache] = None, concatenated: bool = False):
    """out [T, d] in x's dtype: the experts w1 [E, 2n, d] (gate/up interleaved, or concatenated:
    its FP8 copy is then made of the rows interleaved, and H's columns are in that order), w2
    [E, d, n] on the top-K routing (scores [T, K] float, experts [T, K] int) of x [T, d] bf16, in
    FP8; and the tensors a backward would keep. b1: [E, 2n] bf16 (interleaved) or None. CUDA bf16
    tensors only."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        raise ValueError(f"x must be a CUDA bfloat16 [T, d] tensor; got {x.dtype} {list(x.shape)} on {x.device}")
    if experts.dim() != 2 or scores.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"scores and experts must both be [T, K] with T = x.shape[0] = {x.shape[0]}; got "
                         f"{list(scores.shape)} and {list(experts.shape)}")
    T, E = x.shape[0], w1.shape[0]
    ops = torch.ops.machmoe
    cache = _DEFAULT_CACHE if cache is None else cache
    offs, row_token, row_pair, pair_row, token_offsets, _ = ops.routing_metadata(experts.to(torch.int32).contiguous(),
                                                                          None, T, E)
    x_q, x_s = ops.fp8_quantize_rows(x.contiguous(), None)
    w1_q, w1_s, _, _ = cache.get(w1, False, concatenated)
    w2_q, w2_s, _, _ = cache.get(w2, False)
    hq, h_scales, act_q, act_scales = ops.grouped_gemm_fp8_glu(x_q, x_s, w1_q, w1_s, offs, activation,
                                                               glu_clamp_list(glu_clamp), b1, 0, row_token)
    y = ops.grouped_gemm_fp8(act_q, act_scales, w2_q, w2_s, offs)  # [T·K, d] bf16, rows by expert
    out = ops.aggregate(y, pair_row, token_offsets, scores.to(torch.float32).reshape(-1).contiguous(), x.dtype)
    return out, (hq, h_scales, offs, row_token, row_pair, pair_row, token_offsets)


def experts_backward(x, w1, w2, scores, experts, saved, dout, *, cache: Optional[FP8WeightCache] = None,
                     concatenated: bool = False):
    """(dx [T, d], dw1 [E, 2n, d], dw2 [E, d, n], d_scores [T, K]) of experts_forward (SwiGLU, no
    biases) from its `saved` and dout [T, d] bf16, in FP8 (machmoe/reference_fp8_layer.hpp's
    backward; the elementwise step one kernel, fp8_swiglu_backward):
      dA' = dout[t]·W2 (dout quantised once, W2's transposed copy), d_score = dA'·A with A
      recomputed from the saved Hq; dH = swiglu'(Hq)·(score·dA'), quantised by rows for
      dX~ = dH·W1 (W1's transposed copy) and dx the sum per token; dW1 and dW2 from the columns
      of x, dH, dout and score·A quantised along each expert's rows.
    One difference from the reference: the column pass reads dH in bf16, not dH's quantised rows.
    concatenated: as experts_forward; dw1 is returned in w1's (concatenated) row order."""
    hq, h_scales, offs, row_token, row_pair, pair_row, token_offsets = saved
    ops = torch.ops.machmoe
    cache = _DEFAULT_CACHE if cache is None else cache
    T, K = scores.shape
    _, _, w1_qt, w1_st = cache.get(w1, True, concatenated)   # [E, d, 2n], H's column order
    _, _, w2_qt, w2_st = cache.get(w2, True)   # [E, n, d]
    dout = dout.to(torch.bfloat16).contiguous()
    # Ordered and freed so that few [R, ·] intermediates live at once (R = T·K rows): dW2's operands,
    # then dX~'s, then dW1's; each dropped as soon as its GEMM has read it.
    do_q, do_s = ops.fp8_quantize_rows(dout, None)
    da = ops.grouped_gemm_fp8(do_q, do_s, w2_qt, w2_st, offs, 0, row_token)  # dA' [R, n] bf16
    del do_q, do_s
    # One pass (machmoe/fp8_swiglu.hpp): A recomputed from the saved Hq (the forward's came from the
    # fp32 H), d_scores, dH = swiglu'(Hq)·(score·dA') [R, 2n] and A' = score·A [R, n], both bf16.
    dh, a_prime, d_scores = ops.fp8_swiglu_backward(da, hq, h_scales, scores.reshape(-1).float().contiguous(),
                                                    row_pair)
    del da
    dot, dos, chunks = ops.fp8_quantize_columns(dout, row_token, offs)
    at, as_, _ = ops.fp8_quantize_columns(a_prime, None, offs)
    del a_prime
    dw2 = ops.grouped_wgrad_fp8(dot, dos, at, as_, chunks, w2.dtype, False)  # [E, d, n]
    del dot, dos, at, as_
    dh_q, dh_s = ops.fp8_quantize_rows(dh, None)
    dx_rows = ops.grouped_gemm_fp8(dh_q, dh_s, w1_qt, w1_st, offs)      # dX~ [R, d]
    del dh_q, dh_s
    dx = ops.aggregate(dx_rows, pair_row, token_offsets, None, x.dtype)
    del dx_rows
    ht, hs, _ = ops.fp8_quantize_columns(dh, None, offs)
    del dh
    xt, xs, _ = ops.fp8_quantize_columns(x.contiguous(), row_token, offs)
    dw1 = ops.grouped_wgrad_fp8(xt, xs, ht, hs, chunks, w1.dtype, True)  # [E, 2n, d] in H's column order
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
