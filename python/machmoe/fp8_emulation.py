"""The FP8 experts in plain PyTorch: machmoe.fp8_experts' recipe, emulated (any device, no op
library), for `precision="fp8"` on the torch backend.

Every operand that the FP8 kernels read in E4M3 is quantised and dequantised here at the same
point, with the same tiles and the same arithmetic (include/machmoe/fp8.hpp, the quantisers in
src/kernels/quant): per tile s = amax / 448 by an fp32 division (amax 0 gives s = 1; a NaN or Inf
in the tile gives s = NaN), the code is E4M3(v · (1/s)) (1/s and the product each rounded to fp32)
rounded to nearest even and saturated, and the
GEMM reads code · s. PyTorch's cast to float8_e4m3fn rounds to nearest even but does not saturate
(|v| >= 464 becomes NaN), so values are clamped to ±448 first, which is the same for every finite
value. The GEMMs run in fp32 on the dequantised operands (the kernels accumulate in fp32 too, in
another order), and the values the kernels store in bf16 (Y, dA', dH, dX~, dx, out, the weight
gradients) are rounded to bf16 here at the same places. So this matches the kernels up to fp32
accumulation order (an E4M3 or bf16 rounding can flip where a value sits that close to a rounding
boundary), not bitwise.

Forward (rows grouped by expert, t the row's token, e its expert; SwiGLU, or the clamped SwiGLU
with glu_clamp (A = act(gate, up) and its derivatives then the clamped ones); interleaved gate/up;
the expert biases b1, b2 optional):
    Xq = rows(x)  [T, d];  W1q, W2q = blocks(w1), blocks(w2) (from the FP8WeightCache)
    H = Xq[t]·W1q[e]ᵀ (+ b1[e])  fp32 [R, 2n];  Hq = rows(H), kept for the backward
    A = silu(gate(H))·up(H) fp32 (from H, not Hq);  Y = rows(A)·W2q[e]ᵀ (+ b2[e]) -> bf16
    out = Σ score·Y -> bf16
Backward (fp8_experts.experts_backward), A recomputed from Hq:
    dA' = rows(dout)[t]·W2q[e] -> bf16;  d_score = dA'·A(Hq) (+ dout[t]·b2[e])
    dH = swiglu'(Hq)·(score·dA') -> bf16
    dX~ = rows(dH)·W1q[e] -> bf16;  dx = Σ_token dX~ (fp32) -> bf16
    dW1[e] = columns(dH)ᵀ·columns(x[t]);  dW2[e] = columns(dout[t])ᵀ·columns(bf16(score·A))
    db1[e] = Σ dH (the bf16 dH, fp32 sums);  db2[e] = Σ score·dout[t]
where columns() quantises each column per 128-row chunk of an expert's rows. Where
machmoe/reference_fp8_layer.hpp differs, this follows the kernels (src/host/layer/fp8_experts.cu):
dW1's dH operand is quantised by columns from dH in bf16, not from the row-quantised dHq.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import torch_backend
from .enums import ActivationType, GateUpLayout
from .fp8_weights import FP8WeightCache, concatenate_gate_up, interleave_gate_up

TILE = 128  # elements per scale: 1x128 along a row, 128x128 weight blocks, 128-row column chunks
E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126  # scales are floored at the smallest normal fp32, so that 1/s is finite
_NAN_CODE = 0x7F  # the quantisers' code for every element of a tile holding NaN or Inf


def tile_scales(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of each tile from its amax: amax / 448 (IEEE fp32 division) floored at 2^-126; 1 for an
    all-zero tile; NaN where amax is not finite (a NaN or Inf in the tile)."""
    amax = amax.float()
    s = (amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device)).clamp_min(MIN_SCALE)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def e4m3_codes(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (float8_e4m3fn) of v · (1/s), s broadcast to v (1/s and the product each rounded
    to fp32, as the kernels), round to nearest even, saturating at ±448; every element of a
    NaN-scaled tile gets the NaN code 0x7f."""
    q = (v.float() * torch.reciprocal(s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    # The select on the codes' bytes: torch.compile's inductor has no type promotion for float8.
    codes = torch.where(torch.isfinite(s).expand_as(q), q.view(torch.uint8), _NAN_CODE)
    return codes.view(torch.float8_e4m3fn)


def _expand(s: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Per-tile scales along `dim` repeated to one per element (the last tile cut to `size`)."""
    return s.repeat_interleave(TILE, dim=dim).narrow(dim, 0, size)


def _tile_amax_last(v: torch.Tensor) -> torch.Tensor:
    """max |v| over 128-wide tiles of the last dimension [..., ceil(N/128)] (a partial last tile:
    its real elements; NaN propagates)."""
    N = v.shape[-1]
    padded = torch.nn.functional.pad(v.float().abs(), (0, (-N) % TILE))
    return padded.reshape(*v.shape[:-1], -1, TILE).amax(-1)


def rows_dequantized(v: torch.Tensor) -> torch.Tensor:
    """v [R, N] quantised in 1x128 tiles along each row and dequantised: fp32 [R, N]."""
    s = _expand(tile_scales(_tile_amax_last(v)), v.shape[1], 1)
    return e4m3_codes(v, s).float() * s


def quantize_weights(w: torch.Tensor, transposed: bool) -> tuple:
    """The expert weights w [E, N, K] in 128x128 blocks, as machmoe::fp8_quantize_weights gives
    them: (q [E, N, K] e4m3, scales [E, ceil(N/128), ceil(K/128)] fp32, and with `transposed` the
    same codes and scales transposed, qt [E, K, N] and [E, ceil(K/128), ceil(N/128)]; else None)."""
    E, N, K = w.shape
    padded = torch.nn.functional.pad(w.detach().float().abs(), (0, (-K) % TILE, 0, (-N) % TILE))
    amax = padded.reshape(E, padded.shape[1] // TILE, TILE, padded.shape[2] // TILE, TILE).amax((2, 4))
    scales = tile_scales(amax)  # [E, nb_n, nb_k]
    q = e4m3_codes(w.detach(), _expand(_expand(scales, N, 1), K, 2))
    if not transposed:
        return q, scales, None, None
    return q, scales, q.transpose(1, 2).contiguous(), scales.transpose(1, 2).contiguous()


def weights_dequantized(cache: FP8WeightCache, w: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """w's cached FP8 copy (codes and block scales, from whichever quantiser filled the cache: the
    kernels' and quantize_weights give the same layout) dequantised: fp32 [E, N, K] (of w's gate/up
    rows interleaved with `interleave`: FP8WeightCache.get)."""
    q, scales = cache.get(w, False, interleave)[:2]
    _, N, K = q.shape
    return q.float() * _expand(_expand(scales.to(q.device), N, 1), K, 2)


def columns_dequantized(v: torch.Tensor, counts: list) -> torch.Tensor:
    """v [R, C] whose rows are grouped by expert (counts[e] rows each, in order) quantised per
    column in 128-row chunks counted from each expert's first row, dequantised: fp32 [R, C]."""
    R, C = v.shape
    if R == 0:
        return v.float()
    device = v.device
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)  # [E]
    starts = torch.cumsum(counts_t, 0) - counts_t  # each expert's first row
    chunks = (counts_t + TILE - 1) // TILE
    chunk_starts = torch.cumsum(chunks, 0) - chunks  # each expert's first chunk
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t)  # [R]
    chunk = chunk_starts[expert] + (torch.arange(R, device=device) - starts[expert]) // TILE  # [R]
    vf = v.float()
    index = chunk[:, None].expand(R, C)
    amax = torch.zeros(int(chunks.sum()), C, device=device).scatter_reduce_(0, index, vf.abs(), "amax")
    bad = torch.zeros_like(amax).scatter_reduce_(0, index, (~torch.isfinite(vf)).float(), "amax")
    s = tile_scales(torch.where(bad > 0, torch.full_like(amax, float("inf")), amax))[chunk]  # [R, C]
    return e4m3_codes(vf, s).float() * s


def _per_expert(rows: torch.Tensor, w: torch.Tensor, counts: list, transpose: bool) -> torch.Tensor:
    """rows [R, K'] grouped by expert times each expert's w[e] [N, K] (transposed: rows·w[e]ᵀ,
    K' = K; else rows·w[e], K' = N), fp32."""
    parts = rows.split(counts)
    out = [p @ (w[e].T if transpose else w[e]) for e, p in enumerate(parts)]
    return torch.cat(out) if out else rows.new_zeros(0, w.shape[1] if transpose else w.shape[2])


def _weight_grads(a: torch.Tensor, b: torch.Tensor, counts: list) -> torch.Tensor:
    """[E, M, N]: per expert Σ over its rows of a[r]ᵀ ⊗ b[r], a [R, M], b [R, N] fp32 (zeros for an
    expert without rows)."""
    return torch.stack([pa.T @ pb for pa, pb in zip(a.split(counts), b.split(counts))])


def _glu(h: torch.Tensor, glu_clamp) -> torch.Tensor:
    """A [R, n] from H [R, 2n] (gate/up interleaved): SwiGLU, or the clamped SwiGLU."""
    act = ActivationType.SWIGLU if glu_clamp is None else ActivationType.CLAMPED_SWIGLU
    return torch_backend.apply_activation(h, act, GateUpLayout.INTERLEAVED, glu_clamp)


def _per_expert_sums(v: torch.Tensor, counts: list) -> torch.Tensor:
    """[E, C]: each expert's sum of its rows of v [R, C] fp32 (rows grouped by expert)."""
    return torch.stack([p.sum(0) for p in v.split(counts)])


class _EmulatedExperts(torch.autograd.Function):
    """The FP8 experts (SwiGLU or the clamped SwiGLU, interleaved, optional biases) on a routing
    list of P pairs (token [P], expert [P], score [P]; a pair whose expert is outside [0, E) gets
    no row, adds nothing and gets a zero score gradient), emulated (module docstring). Rows are
    grouped by expert, in pair order within an expert (the kernels' order, which the column
    chunks of the weight gradients follow). Saves x, the weights, the biases, the scores, the row
    order and Hq (fp32 [R, 2n])."""

    @staticmethod
    def forward(ctx, x, w1, w2, score, token, expert, cache, concatenated, glu_clamp=None, b1=None, b2=None):
        T, E = x.shape[0], w1.shape[0]
        P = expert.numel()
        pair_expert = expert.long()
        valid = (pair_expert >= 0) & (pair_expert < E)
        # rows by expert, then by pair (a stable sort; pairs without a row sorted last, then cut)
        order = torch.sort(torch.where(valid, pair_expert, E), stable=True).indices
        counts = torch.bincount(pair_expert[valid], minlength=E).tolist()  # the torch backend's host sync
        row_pair = order[:sum(counts)]
        row_token = token.long()[row_pair]
        row_expert = pair_expert[row_pair]
        h = _per_expert(rows_dequantized(x)[row_token], weights_dequantized(cache, w1, concatenated), counts, True)
        if b1 is not None:  # in the FP8 copy's interleaved row order
            b1_rows = interleave_gate_up(b1.unsqueeze(-1)).squeeze(-1) if concatenated else b1
            h = h + b1_rows.float()[row_expert]
        hq = rows_dequantized(h)  # [R, 2n], kept for the backward
        a = _glu(h, glu_clamp)  # A [R, n] from the fp32 H
        y = _per_expert(rows_dequantized(a), weights_dequantized(cache, w2), counts, True)
        if b2 is not None:
            y = y + b2.float()[row_expert]
        y = y.bfloat16()
        score_row = score.float()[row_pair]  # [R]
        out = torch.zeros(T, x.shape[1], device=x.device).index_add_(0, row_token, y.float() * score_row[:, None])
        ctx.save_for_backward(x, w1, w2, score, row_pair, row_token, hq, b1, b2)
        ctx.counts, ctx.cache, ctx.concatenated, ctx.glu_clamp, ctx.pairs = counts, cache, concatenated, glu_clamp, P
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, score, row_pair, row_token, hq, b1, b2 = ctx.saved_tensors
        counts, cache = ctx.counts, ctx.cache
        dout = dout.to(torch.bfloat16)
        # dA' = dOq[t]·W2q[e] [R, n], stored in bf16 by the kernels
        da = _per_expert(rows_dequantized(dout)[row_token], weights_dequantized(cache, w2), counts,
                         False).bfloat16().float()
        score_row = score.float()[row_pair]
        if ctx.glu_clamp is None:
            gate, up = hq[:, 0::2], hq[:, 1::2]
            sig = torch.sigmoid(gate)
            act = gate * sig
            a = act * up  # A [R, n] recomputed from Hq (the forward's came from the fp32 H)
            d_rows = (da * a).sum(1)
            da = da * score_row[:, None]
            dh = torch.stack([da * up * sig * (1 + gate * (1 - sig)), da * act], dim=2).reshape(hq.shape)
        else:  # the clamped SwiGLU's derivatives by autograd (torch.clamp's: bounds included)
            with torch.enable_grad():
                gate, up = (hq[:, 0::2].detach().requires_grad_(), hq[:, 1::2].detach().requires_grad_())
                a_graph = _glu(torch.stack([gate, up], dim=2).reshape(hq.shape), ctx.glu_clamp)
                d_rows = (da * a_graph).sum(1)
                d_gate, d_up = torch.autograd.grad(a_graph, (gate, up), da * score_row[:, None])
            a = a_graph.detach()
            dh = torch.stack([d_gate, d_up], dim=2).reshape(hq.shape)
        dh = dh.bfloat16()
        db1 = db2 = None
        if b2 is not None:  # the output bias's d-score term ⟨dout_t, b2_e⟩ (bf16 operands, fp32 sums)
            row_expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                                 torch.tensor(counts, device=x.device))
            d_rows = d_rows + (dout.float()[row_token] * b2.float()[row_expert]).sum(1)
            db2 = _per_expert_sums(dout.float()[row_token] * score_row[:, None], counts).to(b2.dtype)
        if b1 is not None:
            db1 = _per_expert_sums(dh.float(), counts)  # [E, 2n], H's interleaved order
            db1 = (concatenate_gate_up(db1.unsqueeze(-1)).squeeze(-1) if ctx.concatenated else db1).to(b1.dtype)
        d_score = torch.zeros(ctx.pairs, device=x.device).index_copy_(0, row_pair, d_rows)
        dx_rows = _per_expert(rows_dequantized(dh), weights_dequantized(cache, w1, ctx.concatenated), counts,
                              False).bfloat16()
        dx = torch.zeros(x.shape[0], x.shape[1], device=x.device).index_add_(0, row_token, dx_rows.float()).to(x.dtype)
        x_cols = columns_dequantized(x[row_token], counts)  # [R, d]
        dw1 = _weight_grads(columns_dequantized(dh, counts), x_cols, counts).to(w1.dtype)  # [E, 2n, d], H's order
        if ctx.concatenated:
            dw1 = concatenate_gate_up(dw1)
        do_cols = columns_dequantized(dout[row_token], counts)  # [R, d]
        a_cols = columns_dequantized((a * score_row[:, None]).bfloat16(), counts)  # [R, n]
        dw2 = _weight_grads(do_cols, a_cols, counts).to(w2.dtype)  # [E, d, n]
        return dx, dw1, dw2, d_score.to(score.dtype), None, None, None, None, None, db1, db2


def experts_on_list(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                    score: torch.Tensor, cache: Optional[FP8WeightCache] = None, concatenated: bool = False,
                    glu_clamp=None, b1: Optional[torch.Tensor] = None,
                    b2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [T, d] bf16 of the FP8 experts emulated on a routing list of P pairs: token [P] in
    [0, T), expert [P] (a pair whose expert is outside [0, E) is dropped), score [P] float (the
    top-K routing's T·K pairs in (t, k) order, or a token-rounded list). x [T, d] bf16, w1 [E, 2n,
    d] (gate/up interleaved, or concatenated with `concatenated`), w2 [E, d, n] bf16; the expert
    biases b1 [E, 2n] (in w1's row order) and b2 [E, d], or None. Gradients for x, w1, w2, score
    and the biases. cache: the weights' FP8 copies (None: a fresh one per call, the weights
    quantised every time). glu_clamp: a machmoe.GluClamp for the clamped SwiGLU, or None for
    SwiGLU."""
    cache = FP8WeightCache(quantize_weights) if cache is None else cache
    return _EmulatedExperts.apply(x, w1, w2, score, token, expert, cache, concatenated, glu_clamp, b1, b2)

