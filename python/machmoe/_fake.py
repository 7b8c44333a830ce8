"""Fake (meta) implementations of the CUDA ops, so that torch.compile, FakeTensorMode and meta
tensors can trace them: the schemas live in C++, the fake kernels here.

Each fake returns empty tensors of the shapes and dtypes its C++ op allocates (src/bindings/*.cpp;
docs/OPS.md) and does no work. The `saved` block's size is not restated here: the C++ library
defines its layout once (src/host/layer/saved_layout.hpp) and hands it out through the tensor-free
ops `layer_saved_layout` / `experts_saved_layout`, as part sizes linear in the block's rows R and
tokens T. The fakes evaluate those in integer arithmetic that also works on symbolic sizes, so
that `torch.compile(dynamic=True)` keeps T (and the list length R) symbolic instead of compiling
again for each value; the weights' sizes (n, E) are read as plain integers. `tests/python/
test_fake.py` checks the fakes' sizes against the C++ planner (`*_workspace_bytes`), also on
symbolic T; `tests/python/test_gpu_compile.py` checks every fake against its kernel with
torch.library.opcheck.

Registered by `machmoe._ops` once the op library has loaded (the schemas come from it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Tuple

import torch

from .enums import is_glu

_LIB = "machmoe::"


def _n1(n, activation: str):
    """Columns of H for an expert intermediate size n: 2n for the GLU kinds."""
    return 2 * n if is_glu(activation) else n


def column_tiles(N) -> int:
    """grouped_gemm_column_tiles (src/host/gemm/grouped_gemm.cu): the dH kernel writes one partial dS
    per row and 128 columns, whichever kernel (tile width) runs."""
    return (N + 127) // 128


def rounding_capacity(T, E, K, tile_m):
    """token_rounding_capacity (src/host/routing/token_rounding.cu): each expert moves by less than one tile,
    and a token appears at most once per expert. (sym_min: T may be symbolic.)"""
    return torch.sym_min(T * K + E * (tile_m - 1), T * E)


class SavedLayout(NamedTuple):
    """A saved block as the C++ library describes it (saved_layout_ints in
    src/host/layer/saved_layout.hpp): every part starts at a multiple of `alignment` bytes and has
    per_row·R + per_token·T + fixed bytes; a layer call's rows are
    min(rows_per_token·T + rows_extra, rows_cap_per_token·T) (no min when the cap is 0)."""
    alignment: int
    rows_per_token: int
    rows_extra: int
    rows_cap_per_token: int
    parts: Tuple[Tuple[int, int, int], ...]

    @staticmethod
    def decode(ints) -> "SavedLayout":
        head, flat = list(ints[:4]), list(ints[4:])
        assert len(flat) % 3 == 0, f"saved layout of {len(ints)} integers"
        return SavedLayout(*head, tuple(tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)))

    def rows(self, T):
        """A layer call's rows for T tokens (T may be symbolic)."""
        rows = self.rows_per_token * T + self.rows_extra
        return torch.sym_min(rows, self.rows_cap_per_token * T) if self.rows_cap_per_token else rows

    def nbytes(self, R, T):
        """The block's bytes for R rows and T tokens (either may be symbolic)."""
        a = self.alignment
        return sum((per_row * R + per_token * T + fixed + a - 1) // a * a for per_row, per_token, fixed in self.parts)


@functools.lru_cache(maxsize=None)
def layer_saved_layout(n: int, E: int, K: int, activation: str, rounding: str, tile_m: int,
                       write_h: bool = True, num_shared: int = 0, fp8: bool = False) -> SavedLayout:
    return SavedLayout.decode(torch.ops.machmoe.layer_saved_layout(n, E, K, activation, rounding, tile_m, write_h,
                                                                   num_shared, fp8))


@functools.lru_cache(maxsize=None)
def experts_saved_layout(n: int, E: int, activation: str) -> SavedLayout:
    return SavedLayout.decode(torch.ops.machmoe.experts_saved_layout(n, E, activation))


def layer_saved_bytes(T, n, E, K, activation: str, rounding: str, tile_m, write_h: bool = True, num_shared: int = 0,
                      fp8: bool = False):
    """Bytes of layer_forward's saved block (without H for inference; fp8: H in E4M3 with its
    scales); T may be symbolic."""
    layout = layer_saved_layout(int(n), int(E), int(K), activation, rounding, int(tile_m), bool(write_h),
                                int(num_shared), bool(fp8))
    return layout.nbytes(layout.rows(T), T)


def experts_saved_bytes(T, R, n, E, activation: str):
    """Bytes of experts_forward's saved block for a list of R pairs; T and R may be symbolic."""
    return experts_saved_layout(int(n), int(E), activation).nbytes(R, T)


def _topk_router(logits, K, routing, renormalize, selection_bias, routed_scaling_factor=1.0, n_group=1,
                 topk_group=1):
    T = logits.shape[0]
    return logits.new_empty(T, K), logits.new_empty(T, K, dtype=torch.int32)


def _topk_router_backward(logits, scores, experts, d_scores, routing, renormalize, routed_scaling_factor=1.0,
                          n_group=1, topk_group=1):
    return logits.new_empty(logits.shape)


def _router_forward(x, router_weight, router_bias, K, routing, renormalize, selection_bias, routed_scaling_factor=1.0,
                    n_group=1, topk_group=1):
    T, E = x.shape[0], router_weight.shape[0]
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    return (x.new_empty(T, E, **f32), x.new_empty(T, K, **f32), x.new_empty(T, K, **i32), x.new_empty(E + 1, **i32),
            x.new_empty((), **f32))


def _router_backward(x, router_weight, logits, scores, experts, expert_offsets, d_scores, d_aux, has_router_bias,
                     routing, renormalize, routed_scaling_factor=1.0, n_group=1, topk_group=1):
    E = router_weight.shape[0]
    return x.new_empty(x.shape), router_weight.new_empty(router_weight.shape), router_weight.new_empty(
        E if has_router_bias else 0)


def _routing_metadata(pair_expert, pair_token, T, E):
    R = pair_expert.numel()
    i32 = dict(dtype=torch.int32)
    return (pair_expert.new_empty(E + 1, **i32), pair_expert.new_empty(R, **i32), pair_expert.new_empty(R, **i32),
            pair_expert.new_empty(R, **i32), pair_expert.new_empty(T + 1, **i32), pair_expert.new_empty(1, **i32))


def _exchange_plan(experts, scores, E, W, rank):
    T, K = experts.shape
    R = T * K
    i32 = dict(dtype=torch.int32)
    flat = [experts.new_empty(R, **i32) for _ in range(4)]  # row_token, pair_row, order, inverse
    return (experts.new_empty(W, 2, **i32), experts.new_empty(W + 1, **i32), *flat,
            experts.new_empty(R, 4, **i32), experts.new_empty(T + 1, **i32), experts.new_empty(R, **i32),
            experts.new_empty(E, **i32))


def _aggregate(rows, pair_row, token_offsets, scores, out_dtype):
    return rows.new_empty(token_offsets.shape[0] - 1, rows.shape[1], dtype=out_dtype or rows.dtype)


def _token_rounding(logits, K, mode, tile_m, seed):
    T, E = logits.shape
    cap = rounding_capacity(T, E, K, tile_m)
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty(cap, **i32), logits.new_empty(cap, **i32), logits.new_empty(cap),
            logits.new_empty(cap, dtype=torch.bool), logits.new_empty(T + 1, **i32), logits.new_empty(T, K),
            logits.new_empty(T, K, **i32), logits.new_empty(E + 1, **i32), logits.new_empty(E, **i32))


def _token_rounding_backward(logits, topk_scores, topk_experts, token_offsets, expert, padded, d_score):
    return logits.new_empty(logits.shape)


def _layer_forward(x, router_weight, w1, b1, w2, b2, selection_bias, K, activation, layout, routing,
                   renormalize, rounding, tile_m, seed, write_h=True, router_bias=None, routed_scaling_factor=1.0,
                   n_group=1, topk_group=1, glu_clamp=(), w1_shared=None, b1_shared=None, w2_shared=None,
                   b2_shared=None, shared_scores=None, shared_gate=None, fp8_weights=None):
    T, d = x.shape
    E, n = w1.shape[0], w2.shape[2]
    S = 0 if w1_shared is None else w1_shared.shape[0]
    saved = layer_saved_bytes(T, n, E, K, activation, rounding, tile_m, write_h, S, fp8_weights is not None)
    return x.new_empty(T, d), x.new_empty((), dtype=torch.float32), x.new_empty(saved, dtype=torch.uint8)


def _weight_grads(x, w1, b1, w2):
    """dw1 [E, n1, d], db1 [E, n1] (with biases), dw2 [E, d, n], db2 [E, d] (with biases)."""
    E, n1, d = w1.shape
    has_bias = b1 is not None
    return (w1.new_empty(E, n1, d), w1.new_empty(E, n1) if has_bias else None, w2.new_empty(w2.shape),
            w2.new_empty(E, d) if has_bias else None)


def _layer_backward(x, router_weight, w1, b1, w2, b2, saved, dout, d_aux, K, activation, layout, routing,
                    renormalize, rounding, tile_m, router_bias=None, routed_scaling_factor=1.0, n_group=1,
                    topk_group=1, glu_clamp=(), w1_shared=None, b1_shared=None, w2_shared=None, b2_shared=None,
                    has_shared_scores=False, shared_gate=None, fp8_weights=None):
    # With shared experts the weight gradients cover the routed and the shared experts: [E+S, ...].
    S = 0 if w1_shared is None else w1_shared.shape[0]
    E, n1, d = w1.shape
    dw1, db1, dw2, db2 = _weight_grads(x, w1.new_empty(E + S, n1, d), b1 if S == 0 or b1 is None else
                                       b1.new_empty(E + S, n1), w2.new_empty(E + S, *w2.shape[1:]))
    dbr = None if router_bias is None else router_bias.new_empty(router_bias.shape)
    d_shared = x.new_empty(x.shape[0], dtype=torch.float32) if has_shared_scores else None
    d_gate = None if shared_gate is None else shared_gate.new_empty(shared_gate.shape)
    return (x.new_empty(x.shape), router_weight.new_empty(router_weight.shape), dw1, db1, dw2, db2, dbr, d_shared,
            d_gate)


def _experts_forward(x, w1, b1, w2, b2, scores, token_idx, expert_idx, activation, layout, glu_clamp=(),
                     fp8_weights=None):
    T, d = x.shape
    E, n = w1.shape[0], w2.shape[2]
    if fp8_weights is not None:  # H in E4M3 with its scales
        saved = experts_fp8_saved_layout(int(n), int(E)).nbytes(scores.numel(), T)
    else:
        saved = experts_saved_bytes(T, scores.numel(), n, E, activation)
    return x.new_empty(T, d), x.new_empty(saved, dtype=torch.uint8)


def _experts_backward(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, activation, layout, glu_clamp=(),
                      fp8_weights=None):
    dw1, db1, dw2, db2 = _weight_grads(x, w1, b1, w2)
    return x.new_empty(x.shape), dw1, db1, dw2, db2, x.new_empty(token_idx.numel(), dtype=torch.float32)


def _experts_backward_data(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, activation, layout,
                           glu_clamp=()):
    T, d = x.shape
    E, n, R = w1.shape[0], w2.shape[2], token_idx.numel()
    if all(isinstance(v, int) for v in (T, R)):
        ws = torch.ops.machmoe.experts_workspace_bytes(T, d, n, E, R, activation, b1 is not None)[2]
    else:  # symbolic T or R: the workspace's size is the C++ plan's, unknown here
        ws = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(x.shape), x.new_empty(R, dtype=torch.float32), x.new_empty(ws, dtype=torch.uint8))


def _experts_forward_part(x, w1, b1, w2, b2, scores, token_idx, expert_idx, out, saved, workspace, part,
                          early_tokens, activation, layout, glu_clamp=(), max_ctas=0, x_early=None):
    return None  # writes into out, saved and workspace


def _experts_backward_data_part(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, dx, d_scores, workspace,
                                part, early_tokens, activation, layout, glu_clamp=(), dout_early=None):
    return None  # writes into dx, d_scores and workspace


def _experts_backward_weights(x, w1, b1, w2, b2, token_idx, expert_idx, saved, dout, workspace, activation,
                              layout, glu_clamp=(), max_ctas=0):
    return _weight_grads(x, w1, b1, w2)


def _grouped_gemm(a, gather, expert_offsets, w, bias, num_rows, epilogue, activation, layout, kernel="auto",
                  glu_clamp=()):
    N = w.shape[1]
    c2 = a.new_empty(0) if epilogue == "store" else a.new_empty(num_rows, N // 2 if epilogue == "glu" else N)
    return a.new_empty(num_rows, N), c2


def _grouped_gemm_nmajor(a, gather, expert_offsets, w_kn, num_rows, h, row_scores, row_pair, activation, layout,
                         kernel="auto", glu_clamp=()):
    N = w_kn.shape[2]
    if h is None:  # dX~ = dH · W1: a plain store
        return a.new_empty(num_rows, N), a.new_empty(0), a.new_empty(0, dtype=torch.float32)
    # dH [rows, n1], A' [rows, n], per-row partial dS per 128 columns
    return (a.new_empty(num_rows, _n1(N, activation)), a.new_empty(num_rows, N),
            a.new_empty(num_rows, column_tiles(N), dtype=torch.float32))


def _grouped_gemm_wgrad(a, a_gather, b, expert_offsets, transpose_c, fp32, kernel="auto"):
    E, M, N = expert_offsets.numel() - 1, a.shape[1], b.shape[1]
    shape = (E, N, M) if transpose_c else (E, M, N)
    return a.new_empty(shape, dtype=torch.float32 if fp32 else torch.bfloat16)



# ---- FP8 (src/bindings/fp8_ops.cpp; machmoe/fp8.hpp): E4M3 codes as float8_e4m3fn, scales float32.
FP8_TILE = 128  # elements per scale along a dimension (kFp8Tile)


def fp8_tiles(n):
    """Scales along a dimension of n elements (fp8_tiles): ceil(n / 128)."""
    return (n + FP8_TILE - 1) // FP8_TILE


def fp8_max_chunks(R, E):
    """fp8_columns_layout's max_chunks: the most 128-row chunks any expert offsets within R give
    (each nonempty expert adds at most one partial chunk). R may be symbolic."""
    m = torch.sym_min(E, R)
    return m + (R - m) // FP8_TILE


def _fp8_quantize_rows(x, gather):
    d = x.shape[1]
    R = x.shape[0] if gather is None else gather.shape[0]
    return x.new_empty(R, d, dtype=torch.float8_e4m3fn), x.new_empty(R, fp8_tiles(d), dtype=torch.float32)


def _fp8_quantize_weights(w, transposed):
    E, N, K = w.shape
    q = w.new_empty(E, N, K, dtype=torch.float8_e4m3fn)
    scales = w.new_empty(E, fp8_tiles(N), fp8_tiles(K), dtype=torch.float32)
    if not transposed:
        return q, scales, None, None
    return (q, scales, w.new_empty(E, K, N, dtype=torch.float8_e4m3fn),
            w.new_empty(E, fp8_tiles(K), fp8_tiles(N), dtype=torch.float32))


def _fp8_swiglu_backward(da, hq, h_scales, scores, row_pair, glu_clamp=()):
    R, n = da.shape
    return da.new_empty(R, 2 * n), da.new_empty(R, n), scores.new_empty(scores.shape)


def _fp8_quantize_columns(x, gather, expert_offsets):
    d = x.shape[1]
    R = x.shape[0] if gather is None else gather.shape[0]
    E = expert_offsets.shape[0] - 1
    chunks = fp8_max_chunks(R, E)
    return (x.new_empty(chunks, d, FP8_TILE, dtype=torch.float8_e4m3fn),
            x.new_empty(chunks, d, dtype=torch.float32), x.new_empty(E + 1, dtype=torch.int32))


def _grouped_gemm_fp8(a_q, a_scales, w_q, w_scales, expert_offsets, max_ctas=0, gather=None, bias=None):
    R = a_q.shape[0] if gather is None else gather.shape[0]  # C's rows: one per gathered row
    return a_q.new_empty(R, w_q.shape[1], dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def experts_fp8_saved_layout(n: int, E: int) -> SavedLayout:
    return SavedLayout.decode(torch.ops.machmoe.experts_fp8_saved_layout(n, E))


def _grouped_gemm_fp8_glu(a_q, a_scales, w_q, w_scales, expert_offsets, activation, glu_clamp, bias=None,
                          max_ctas=0, gather=None):
    R = a_q.shape[0] if gather is None else gather.shape[0]
    N = w_q.shape[1]
    n = N // 2
    return (a_q.new_empty(R, N), a_q.new_empty(R, -(-N // 128), dtype=torch.float32),
            a_q.new_empty(R, n), a_q.new_empty(R, -(-n // 128), dtype=torch.float32))


def _grouped_wgrad_fp8(a_qt, a_scales, b_qt, b_scales, chunk_offsets, out_dtype, transpose_c, max_ctas=0):
    E, M, N = chunk_offsets.shape[0] - 1, a_qt.shape[1], b_qt.shape[1]
    return a_scales.new_empty((E, N, M) if transpose_c else (E, M, N), dtype=out_dtype)


def _pull_rows(peers, header_offset, rows_offset, src_rows, rank, out_rows, row_bytes):
    return peers.new_empty(out_rows, row_bytes, dtype=torch.uint8)


def _sum_blocks(parts):
    return torch.empty_like(parts[0], memory_format=torch.contiguous_format)


# Every op with a CUDA kernel (the tensor-free ops and the CPU reference ops need no fake).
FAKES = {
    "topk_router": _topk_router,
    "topk_router_backward": _topk_router_backward,
    "router_forward": _router_forward,
    "router_backward": _router_backward,
    "routing_metadata": _routing_metadata,
    "exchange_plan": _exchange_plan,
    "aggregate": _aggregate,
    "token_rounding": _token_rounding,
    "token_rounding_backward": _token_rounding_backward,
    "layer_forward": _layer_forward,
    "layer_backward": _layer_backward,
    "experts_forward": _experts_forward,
    "experts_backward": _experts_backward,
    "experts_backward_data": _experts_backward_data,
    "experts_backward_weights": _experts_backward_weights,
    "experts_forward_part": _experts_forward_part,
    "experts_backward_data_part": _experts_backward_data_part,
    "grouped_gemm": _grouped_gemm,
    "grouped_gemm_nmajor": _grouped_gemm_nmajor,
    "grouped_gemm_wgrad": _grouped_gemm_wgrad,
    "fp8_quantize_rows": _fp8_quantize_rows,
    "fp8_swiglu_backward": _fp8_swiglu_backward,
    "fp8_quantize_weights": _fp8_quantize_weights,
    "fp8_quantize_columns": _fp8_quantize_columns,
    "grouped_gemm_fp8": _grouped_gemm_fp8,
    "grouped_gemm_fp8_glu": _grouped_gemm_fp8_glu,
    "grouped_wgrad_fp8": _grouped_wgrad_fp8,
    "pull_rows": _pull_rows,
    "sum_blocks": _sum_blocks,
}


def register() -> None:
    for name, fn in FAKES.items():
        torch.library.register_fake(_LIB + name, fn)
