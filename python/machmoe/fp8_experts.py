"""The experts' forward in FP8 (E4M3, DeepSeek-V3's recipe) on the kernels, composed from the FP8
ops. Forward only and not differentiable: the FP8 layer's first piece, for measuring and testing
it; `precision="fp8"` in the layer is not there yet.

    out, saved = experts_forward(x, w1, w2, scores, experts)

Steps, where the FP8 layer quantises (machmoe/reference_fp8_layer.hpp states the same in double):
  1. the routing metadata of the top-K list (rows grouped by expert, row -> token);
  2. x [T, d] quantised once, 1x128 along d (fp8_quantize_rows, no gather);
  3. the up-projection gathers x's rows by token; its GLU epilogue writes H and A in E4M3 with
     their 1x128 scales (grouped_gemm_fp8_glu); A comes from the dequantised H;
  4. the down-projection on A (grouped_gemm_fp8): Y [T·K, d] in bf16;
  5. out[t] = Σ_k scores[t, k] · Y[row of (t, k)] in fp32, rounded once to x's dtype (aggregate).
The weights are quantised in 128x128 blocks once per change (machmoe.fp8_weights.FP8WeightCache).
`saved` is (hq [T·K, 2n] e4m3, h_scales, routing metadata): what a backward would keep, H in FP8.
"""

from __future__ import annotations

from typing import Optional

import torch

from .enums import glu_clamp_list
from .fp8_weights import FP8WeightCache

_DEFAULT_CACHE = FP8WeightCache()


def experts_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, scores: torch.Tensor,
                    experts: torch.Tensor, *, b1: Optional[torch.Tensor] = None, activation: str = "swiglu",
                    glu_clamp=None, cache: Optional[FP8WeightCache] = None):
    """out [T, d] in x's dtype: the experts w1 [E, 2n, d] (gate/up interleaved), w2 [E, d, n] on
    the top-K routing (scores [T, K] float, experts [T, K] int) of x [T, d] bf16, in FP8; and the
    tensors a backward would keep. b1: [E, 2n] bf16 or None. CUDA bf16 tensors only."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        raise ValueError(f"x must be a CUDA bfloat16 [T, d] tensor; got {x.dtype} {list(x.shape)} on {x.device}")
    if experts.dim() != 2 or scores.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"scores and experts must both be [T, K] with T = x.shape[0] = {x.shape[0]}; got "
                         f"{list(scores.shape)} and {list(experts.shape)}")
    T, E = x.shape[0], w1.shape[0]
    ops = torch.ops.machmoe
    cache = _DEFAULT_CACHE if cache is None else cache
    offs, row_token, _, pair_row, token_offsets, _ = ops.routing_metadata(experts.to(torch.int32).contiguous(),
                                                                          None, T, E)
    x_q, x_s = ops.fp8_quantize_rows(x.contiguous(), None)
    w1_q, w1_s, _, _ = cache.get(w1, False)
    w2_q, w2_s, _, _ = cache.get(w2, False)
    hq, h_scales, act_q, act_scales = ops.grouped_gemm_fp8_glu(x_q, x_s, w1_q, w1_s, offs, activation,
                                                               glu_clamp_list(glu_clamp), b1, 0, row_token)
    y = ops.grouped_gemm_fp8(act_q, act_scales, w2_q, w2_s, offs)  # [T·K, d] bf16, rows by expert
    out = ops.aggregate(y, pair_row, token_offsets, scores.to(torch.float32).reshape(-1).contiguous(), x.dtype)
    return out, (hq, h_scales, offs, row_token, pair_row, token_offsets)
