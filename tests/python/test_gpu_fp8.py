"""The FP8 ops (src/bindings/fp8_ops.cpp over machmoe/fp8.hpp) against a pure-PyTorch statement of
the recipe, at real model shapes: 30B-b (d = 4096, n = 512, the up-projection's N = 2n = 1024),
7B-a (d = 1536, n = 256) and gpt-oss (d = n = 2880: partial 128-tiles everywhere).

The quantisers are compared bitwise: the recipe (fp8.hpp) is exact arithmetic, s = amax / 448 by
an IEEE fp32 division, q = E4M3(x · (1/s)) (1/s and the product each rounded to fp32) rounded to
nearest even with saturation to ±448. PyTorch's
cast to float8_e4m3fn rounds to nearest even but does not saturate (|v| >= 464 become NaN), so the
reference clamps to ±448 first, which is the same thing for every finite v. The reference runs on
the CPU. The GEMM (contiguous, and gathered: x quantised once, its rows read through gather) is
compared with a float64 matmul of the dequantised operands (the op's own quantised inputs), per
element, with the C++ test's derived tolerance (tests/cpp/
test_gpu_fp8_gemm.cpp): |got - c| <= 2·(2^-9·|c| + 2^-11·Σ|a·b|).

Without a GPU, the reference itself (hand-checked codes), the GEMM check's ability to fail, and
the fakes' shapes (on fake CUDA tensors) still run."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gpu_test_helpers import offsets, ops
from machmoe import _fake

E4M3_MAX = 448.0
TILE = 128
NAN_SCALE_BITS = 0x7fc00000
NAN_CODE = 0x7f


def on_gpu(test):
    """A test that needs a GPU and the op library (skipped without them; conftest.py)."""
    return pytest.mark.ops(pytest.mark.gpu(test))

# (name, d, n): the layer shapes; the up-projection is N = 2n, K = d, the down-projection N = d, K = n.
SHAPES = (("7B-a", 1536, 256), ("30B-b", 4096, 512), ("gpt-oss", 2880, 2880))
COUNTS = (300, 0, 129, 1, 517, 64)  # rows per expert: an empty expert, one row, partial 128-row tiles


# ---------------------------------------------------------------- the recipe in PyTorch (CPU)
def nan_scale() -> torch.Tensor:
    return torch.tensor(NAN_SCALE_BITS, dtype=torch.int32).view(torch.float32)


def ref_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp8_scale: amax / 448 (fp32, IEEE division) floored at 2^-126; 1 for amax = 0; NaN (0x7fc00000)
    if not finite."""
    amax = amax.float()
    s = (amax / torch.tensor(E4M3_MAX, dtype=torch.float32)).clamp_min(2.0 ** -126)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, nan_scale().expand_as(s))


def ref_codes(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) of x · (1/s), s broadcast to x: RNE, saturating; a NaN scale gives 0x7f."""
    v = (x.float() * torch.reciprocal(s)).clamp(-E4M3_MAX, E4M3_MAX)
    q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isfinite(s), q, torch.full_like(q, NAN_CODE))


def tile_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over 128-wide tiles of the last dimension (a partial last tile: its real elements)."""
    n = x.shape[-1]
    a = torch.nn.functional.pad(x.float().abs(), (0, (-n) % TILE))
    return a.reshape(*x.shape[:-1], -1, TILE).amax(-1)


def expand(s: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    return s.repeat_interleave(TILE, dim=dim).narrow(dim, 0, n)


def gathered(x: torch.Tensor, gather) -> torch.Tensor:
    """x's rows through gather (None: x), fp32; an index outside [0, T) gives a NaN row."""
    xf = x.float()
    if gather is None:
        return xf
    g = gather.long()
    rows = xf[g.clamp(0, xf.shape[0] - 1)]
    rows[(g < 0) | (g >= xf.shape[0])] = float("nan")
    return rows


def ref_quantize_rows(x, gather):
    rows = gathered(x, gather)
    s = ref_scales(tile_amax(rows))
    return ref_codes(rows, expand(s, rows.shape[1])), s


def ref_quantize_weights(w):
    E, N, K = w.shape
    wf = w.float()
    padded = torch.nn.functional.pad(wf.abs(), (0, (-K) % TILE, 0, (-N) % TILE))
    amax = padded.reshape(E, padded.shape[1] // TILE, TILE, padded.shape[2] // TILE, TILE).amax((2, 4))
    s = ref_scales(amax)  # [E, nb_n, nb_k]
    return ref_codes(wf, expand(expand(s, N, 1), K, 2)), s


def ref_quantize_columns(x, gather, counts):
    """(qt [max_chunks, d, 128] uint8, scales [max_chunks, d], chunk_offsets [E+1]) with zero codes
    past an expert's last row in its last chunk; chunks past chunk_offsets[E] are zero (the op's
    are unset)."""
    rows = gathered(x, gather)
    R, d = rows.shape
    E = len(counts)
    max_chunks = _fake.fp8_max_chunks(R, E)
    qt = torch.zeros(max_chunks, d, TILE, dtype=torch.uint8)
    scales = torch.zeros(max_chunks, d)
    chunk_offsets, c, start = [0], 0, 0
    for rows_e in counts:
        for j in range(0, rows_e, TILE):
            blk = rows[start + j:start + min(j + TILE, rows_e)]  # [m, d]
            s = ref_scales(blk.abs().amax(0))  # [d]
            qt[c, :, :blk.shape[0]] = ref_codes(blk, s[None, :]).T
            scales[c] = s
            c += 1
        start += rows_e
        chunk_offsets.append(c)
    return qt, scales, torch.tensor(chunk_offsets, dtype=torch.int32)


def assert_codes_equal(got, want, label):
    got = got.cpu().view(torch.uint8)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{label}: {bad.shape[0]} codes differ, first at {bad[0].tolist()}: " \
        f"{got[tuple(bad[0])].item():#04x} vs {want[tuple(bad[0])].item():#04x}"


def assert_scales_equal(got, want, label):
    got, want = got.cpu().view(torch.int32), want.view(torch.int32)  # bitwise: NaN's bits too
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{label}: {bad.shape[0]} scales differ, first at {bad[0].tolist()}: " \
        f"{got.view(torch.float32)[tuple(bad[0])].item()} vs {want.view(torch.float32)[tuple(bad[0])].item()}"


def structured(*shape, device="cuda"):
    """bf16 data with a power-of-two magnitude per row and per column (2^-8 .. 2^7 overall), so
    that a scale applied to the wrong tile shows, and an all-zero 128-tile (scale 1) at [0, :128]."""
    rows = 2.0 ** torch.randint(-5, 5, (*shape[:-1], 1), device=device)
    cols = 2.0 ** torch.randint(-3, 3, (shape[-1],), device=device)
    x = (torch.randn(*shape, device=device) * rows * cols).bfloat16()
    x.view(-1, shape[-1])[0, :TILE] = 0
    return x


# ---------------------------------------------------------------- the GEMM's check
def dequantise_rows(q, s, K):
    return q.double() * expand(s.double(), K)


def dequantise_weights(q, s, N, K):
    return q.double() * expand(expand(s.double(), N, 1), K, 2)


def gemm_reference(a, w, counts):
    """float64 C [R, N] and Σ|a·b| [R, N] per expert (a [R, K], w [E, N, K] dequantised)."""
    c = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    absum = torch.zeros_like(c)
    start = 0
    for e, rows_e in enumerate(counts):
        rows = slice(start, start + rows_e)
        c[rows] = a[rows] @ w[e].T
        absum[rows] = a[rows].abs() @ w[e].abs().T
        start += rows_e
    return c, absum


def gemm_failures(got, c, absum, label):
    """The C++ test's tolerance, per element and normwise; returns the failures' descriptions."""
    got = got.double()
    err = (got - c).abs()
    tol = 2 * (2.0 ** -9 * c.abs() + 2.0 ** -11 * absum)
    bad = ~(err <= tol)  # NaN fails too
    failures = []
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        failures.append(f"{label}: {int(bad.sum())} elements outside the tolerance, first {list(i)}: got "
                        f"{got[i].item()}, want {c[i].item()} (Σ|a·b| {absum[i].item()}, tol {tol[i].item()})")
    cn = c.norm().item()
    if cn > 0:
        rel = err.norm().item() / cn
        rel_tol = 2 * (2.0 ** -9 + 2.0 ** -11 * absum.norm().item() / cn)
        if not rel <= rel_tol:
            failures.append(f"{label}: normwise error {rel:.3e} above {rel_tol:.3e}")
        print(f"{label}: normwise error {rel:.3e} (tolerance {rel_tol:.3e}), worst |err|/Σ|a·b| "
              f"{(err / absum.clamp_min(1e-300)).max().item():.3e}")
    return failures


# ---------------------------------------------------------------- CPU: the reference and the check
def test_reference_codes_by_hand():
    s = torch.ones(1)
    x = torch.tensor([448., 449., 470., 1e6, -1e6, 1.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, -1e-9, 0.])
    want = [0x7e, 0x7e, 0x7e, 0x7e, 0xfe, 0x38, 0x38, 0x3a, 0x00, 0x02, 0x80, 0x00]
    assert ref_codes(x, s.expand_as(x)).tolist() == want
    # scales: amax / 448, 1 for an all-zero tile, NaN bits for Inf / NaN
    amax = torch.tensor([448., 0., float("inf"), float("nan"), 1.0])
    got = ref_scales(amax).view(torch.int32).tolist()
    assert got[:4] == [torch.tensor(1.0).view(torch.int32).item(), torch.tensor(1.0).view(torch.int32).item(),
                       NAN_SCALE_BITS, NAN_SCALE_BITS]
    # a non-finite tile: every code 0x7f; a partial last tile uses its real elements only
    x = torch.zeros(1, 130)
    x[0, 5], x[0, 129] = float("inf"), -3.0
    q, sc = ref_quantize_rows(x, None)
    assert (q[0, :128] == NAN_CODE).all() and q[0, 129].item() == 0xfe and sc[0, 1] == torch.tensor(3.0) / E4M3_MAX


def test_reference_columns_layout_by_hand():
    x = torch.arange(1, 17, dtype=torch.float32).repeat(300, 1).bfloat16()  # [300, 16]
    qt, scales, chunks = ref_quantize_columns(x, None, [130, 0, 1, 169])
    assert chunks.tolist() == [0, 2, 2, 3, 5]
    chunks_bound = _fake.fp8_max_chunks(300, 4)
    assert qt.shape == (chunks_bound, 16, TILE) and scales.shape == (chunks_bound, 16)
    # Every column constant: each element is its chunk's amax. Chunk 1 holds expert 0's last 2 rows,
    # chunk 2 expert 2's one row; the rest of both is zero padding.
    assert (qt[0] == 0x7e).all() and (qt[1, :, :2] == 0x7e).all() and (qt[1, :, 2:] == 0).all()
    assert (qt[2, :, :1] == 0x7e).all() and (qt[2, :, 1:] == 0).all()


def test_gemm_check_catches_a_wrong_element():
    a = torch.randn(40, 256, dtype=torch.float64)
    w = torch.randn(2, 24, 256, dtype=torch.float64)
    c, absum = gemm_reference(a, w, [25, 15])
    assert not gemm_failures(c.bfloat16(), c, absum, "bf16 of the reference")
    off = c.clone()
    off[3, 7] += 0.05 * absum[3, 7]  # above 2·(2^-9 + 2^-11)·Σ|a·b| at most
    assert gemm_failures(off, c, absum, "one element off")
    off = c.clone()
    off[30, 0] = float("nan")
    assert gemm_failures(off, c, absum, "a NaN")
    # a misapplied weight scale (expert 1's for expert 0): far outside
    assert gemm_failures(torch.cat([a[:25] @ (2 * w[0]).T, c[25:]]), c, absum, "scale")


def _brute_max_chunks(R, E):
    """The most 128-row chunks E experts with at most R rows in all can have (dynamic programming)."""
    best = [0] * (R + 1)  # best[r]: with at most r rows, over the experts so far
    for _ in range(E):
        best = [max(best[r - c] + (c + TILE - 1) // TILE for c in range(r + 1)) for r in range(R + 1)]
    return best[R]


def test_columns_layout_bound_is_tight():
    for E in (1, 2, 3):
        for R in (0, 1, 2, 3, 127, 128, 129, 255, 256, 257, 300, 385):
            assert _fake.fp8_max_chunks(R, E) == _brute_max_chunks(R, E), (R, E)


@pytest.mark.ops
def test_fp8_fakes_follow_the_op_docs():
    T, R, E, d, N, K = 50, 333, 5, 2880, 5760, 2880
    i32 = dict(device="cuda", dtype=torch.int32)
    with FakeTensorMode():
        x = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
        q, s = torch.ops.machmoe.fp8_quantize_rows(x, torch.empty(R, **i32))
        assert (q.shape, q.dtype, s.shape, s.dtype) == ((R, d), torch.float8_e4m3fn, (R, 23), torch.float32)
        assert torch.ops.machmoe.fp8_quantize_rows(x, None)[1].shape == (T, 23)
        w = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
        wq, ws, wqt, wst = torch.ops.machmoe.fp8_quantize_weights(w, True)
        assert (wq.shape, ws.shape, wqt.shape, wst.shape) == ((E, N, K), (E, 45, 23), (E, K, N), (E, 23, 45))
        assert wq.dtype == wqt.dtype == torch.float8_e4m3fn
        assert torch.ops.machmoe.fp8_quantize_weights(w, False)[2:] == (None, None)
        qt, cs, co = torch.ops.machmoe.fp8_quantize_columns(x, torch.empty(R, **i32), torch.empty(E + 1, **i32))
        chunks = 5 + (R - 5) // 128
        assert (qt.shape, cs.shape, co.shape, co.dtype) == ((chunks, d, 128), (chunks, d), (E + 1,), torch.int32)
        c = torch.ops.machmoe.grouped_gemm_fp8(q, s, wq, ws, torch.empty(E + 1, **i32))
        assert (c.shape, c.dtype) == ((R, N), torch.bfloat16)
        xq, xs = torch.ops.machmoe.fp8_quantize_rows(x, None)  # [T, d]: gathered by the GEMM
        c = torch.ops.machmoe.grouped_gemm_fp8(xq, xs, wq, ws, torch.empty(E + 1, **i32), 0, torch.empty(R, **i32))
        assert (c.shape, c.dtype) == ((R, N), torch.bfloat16)
        hq, hs, aq, as_ = torch.ops.machmoe.grouped_gemm_fp8_glu(xq, xs, wq, ws, torch.empty(E + 1, **i32), "swiglu",
                                                                 [], None, 0, torch.empty(R, **i32))
        assert (hq.shape, hs.shape, aq.shape, as_.shape) == ((R, N), (R, 45), (R, N // 2), (R, 23))
        assert hq.dtype == aq.dtype == torch.float8_e4m3fn and hs.dtype == as_.dtype == torch.float32
        ht, hts, co = torch.ops.machmoe.fp8_quantize_columns(torch.empty(R, 64, device="cuda", dtype=torch.bfloat16),
                                                             None, torch.empty(E + 1, **i32))
        c = torch.ops.machmoe.grouped_wgrad_fp8(qt, cs, ht, hts, co, torch.float32, False)
        assert (c.shape, c.dtype) == ((E, d, 64), torch.float32)
        c = torch.ops.machmoe.grouped_wgrad_fp8(qt, cs, ht, hts, co, torch.bfloat16, True)
        assert (c.shape, c.dtype) == ((E, 64, d), torch.bfloat16)


# ---------------------------------------------------------------- GPU: the quantisers
@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
@pytest.mark.parametrize("gathered_rows", [True, False])
def test_quantize_rows_bitwise(name, d, n, gathered_rows):
    T = 300
    x = structured(T, d)
    gather = torch.randint(0, T, (517,), device="cuda", dtype=torch.int32) if gathered_rows else None
    q, s = ops().fp8_quantize_rows(x, gather)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    want_q, want_s = ref_quantize_rows(x.cpu(), None if gather is None else gather.cpu())
    assert_scales_equal(s, want_s, f"{name} rows scales")
    assert_codes_equal(q, want_q, f"{name} rows codes")


@on_gpu
def test_quantize_rows_non_finite_and_bad_indices():
    T, d = 40, 2880
    x = structured(T, d)
    x[3, 200], x[7, 2879], x[9, 0] = float("nan"), float("inf"), -float("inf")
    gather = torch.randint(0, T, (64,), dtype=torch.int32)
    gather[:4] = torch.tensor([3, 7, 9, 3], dtype=torch.int32)
    gather[10], gather[11] = -1, T  # outside [0, T): NaN rows, no out-of-bounds read
    q, s = ops().fp8_quantize_rows(x, gather.cuda())
    want_q, want_s = ref_quantize_rows(x.cpu(), gather)
    assert_scales_equal(s, want_s, "non-finite rows scales")
    assert_codes_equal(q, want_q, "non-finite rows codes")
    assert (s[10:12].cpu().view(torch.int32) == NAN_SCALE_BITS).all()


@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
@pytest.mark.parametrize("up", [True, False])
def test_quantize_weights_bitwise(name, d, n, up):
    E = 2
    N, K = (2 * n, d) if up else (d, n)
    w = structured(E, N, K) * 0.02
    q, s, qt, st = ops().fp8_quantize_weights(w, up)  # the transposed copy on the up-projection's cases
    want_q, want_s = ref_quantize_weights(w.cpu())
    assert (q.shape, s.shape) == (want_q.shape, want_s.shape)
    assert_scales_equal(s, want_s, f"{name} weights scales")
    assert_codes_equal(q, want_q, f"{name} weights codes")
    if up:
        assert_scales_equal(st, want_s.transpose(1, 2).contiguous(), f"{name} transposed scales")
        assert_codes_equal(qt, want_q.transpose(1, 2).contiguous(), f"{name} transposed codes")
    else:
        assert qt is None and st is None


@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
@pytest.mark.parametrize("gathered_rows", [True, False])
def test_quantize_columns_bitwise(name, d, n, gathered_rows):
    R = sum(COUNTS)
    T = 700 if gathered_rows else R
    x = structured(T, d)
    gather = torch.randint(0, T, (R,), dtype=torch.int32) if gathered_rows else None
    qt, s, chunk_offsets = ops().fp8_quantize_columns(x, None if gather is None else gather.cuda(), offsets(COUNTS))
    want_qt, want_s, want_chunks = ref_quantize_columns(x.cpu(), gather, COUNTS)
    assert (qt.shape, s.shape) == (want_qt.shape, want_s.shape)
    assert torch.equal(chunk_offsets.cpu(), want_chunks)
    c = int(want_chunks[-1])  # the chunks past chunk_offsets[E] are not written
    assert_scales_equal(s[:c], want_s[:c], f"{name} columns scales")
    assert_codes_equal(qt[:c], want_qt[:c], f"{name} columns codes")


# ---------------------------------------------------------------- GPU: the grouped GEMM
GEMM_CASES = [(f"{name} {'up' if up else 'down'}", *((2 * n, d) if up else (d, n)))
              for name, d, n in SHAPES for up in (True, False)]


@on_gpu
@pytest.mark.parametrize("label,N,K", GEMM_CASES)
def test_grouped_gemm_fp8_against_float64(label, N, K):
    m = ops()
    E, R, T = len(COUNTS), sum(COUNTS), 600
    x = structured(T, K)
    gather = torch.randint(0, T, (R,), device="cuda", dtype=torch.int32)
    a_q, a_s = m.fp8_quantize_rows(x, gather)
    w_q, w_s, _, _ = m.fp8_quantize_weights(structured(E, N, K) * 0.02, False)
    c = m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offsets(COUNTS))
    assert (c.shape, c.dtype) == ((R, N), torch.bfloat16)
    want, absum = gemm_reference(dequantise_rows(a_q, a_s, K), dequantise_weights(w_q, w_s, N, K), COUNTS)
    failures = gemm_failures(c, want, absum, label)
    assert not failures, "\n".join(failures)


@on_gpu
@pytest.mark.parametrize("label,N,K", [case for case in GEMM_CASES if " up" in case[0]])
def test_grouped_gemm_fp8_gathered_against_float64(label, N, K):
    # The up-projection as the layer would run it: x [T, K] quantised once without a gather, row r
    # of the GEMM reading x_q[gather[r]] and its scales (T = 600 != R = 1011, indices repeated).
    m = ops()
    E, R, T = len(COUNTS), sum(COUNTS), 600
    x = structured(T, K)
    gather = torch.randint(0, T, (R,), device="cuda", dtype=torch.int32)
    x_q, x_s = m.fp8_quantize_rows(x, None)
    w_q, w_s, _, _ = m.fp8_quantize_weights(structured(E, N, K) * 0.02, False)
    w = dequantise_weights(w_q, w_s, N, K)
    c = m.grouped_gemm_fp8(x_q, x_s, w_q, w_s, offsets(COUNTS), 0, gather)
    assert (c.shape, c.dtype) == ((R, N), torch.bfloat16)
    x_deq = dequantise_rows(x_q, x_s, K)
    want, absum = gemm_reference(x_deq[gather.long()], w, COUNTS)
    failures = gemm_failures(c, want, absum, f"{label}, gathered")
    assert not failures, "\n".join(failures)
    # The check tells the gathered rows from others: against the rows of the gather shifted by one
    # (what a kernel reading row r + 1's index would compute) it fails.
    wrong, wrong_abs = gemm_reference(x_deq[gather.roll(1).long()], w, COUNTS)
    assert gemm_failures(c, wrong, wrong_abs, f"{label}, rows shifted"), "a misplaced gather went unnoticed"


@on_gpu
@pytest.mark.parametrize("label,N,K", [case for case in GEMM_CASES if " down" in case[0]])
def test_grouped_gemm_fp8_bias_against_float64(label, N, K):
    # The down-projection's staged store adds bias[e] [N] in fp32 before the rounding (expert
    # biases, gpt-oss); biases on the output's scale, so that a missing or misplaced one fails.
    m = ops()
    E, R = len(COUNTS), sum(COUNTS)
    a_q, a_s = m.fp8_quantize_rows(structured(R, K), None)
    w_q, w_s, _, _ = m.fp8_quantize_weights(structured(E, N, K) * 0.02, False)
    want, absum = gemm_reference(dequantise_rows(a_q, a_s, K), dequantise_weights(w_q, w_s, N, K), COUNTS)
    bias = (torch.randn(E, N, device="cuda") * want.abs().mean().item()).bfloat16()
    c = m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offsets(COUNTS), 0, None, bias)
    row_expert = torch.repeat_interleave(torch.arange(E, device="cuda"), torch.tensor(COUNTS, device="cuda"))
    b = bias.double()[row_expert]
    failures = gemm_failures(c, want + b, absum + b.abs(), f"{label} + bias")
    assert not failures, "\n".join(failures)
    # Each expert's own bias: the biases rolled by one expert fail.
    wrong = bias.double().roll(1, 0)[row_expert]
    assert gemm_failures(c, want + wrong, absum + wrong.abs(), "bias rolled"), "a misplaced bias went unnoticed"
    # A gathered A (the plain store from registers) refuses a bias, naming it.
    gather = torch.zeros(R, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="bias must be null with a gather"):
        m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offsets(COUNTS), 0, gather, bias)


@on_gpu
def test_grouped_gemm_fp8_few_ctas_many_experts_and_rerun():
    # E = 600 > 512 (the op allocates the tile table), 3 CTAs, zero-row experts; bitwise on a rerun.
    m = ops()
    N, K, E = 256, 384, 600
    counts = [int(v) for v in torch.randint(0, 4, (E,))]
    counts[0], counts[-1] = 0, 130
    R = sum(counts)
    a_q, a_s = m.fp8_quantize_rows(structured(R, K), None)
    w_q, w_s, _, _ = m.fp8_quantize_weights(structured(E, N, K) * 0.02, False)
    off = offsets(counts)
    c = m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, off, 3)
    want, absum = gemm_reference(dequantise_rows(a_q, a_s, K), dequantise_weights(w_q, w_s, N, K), counts)
    failures = gemm_failures(c, want, absum, "E = 600, 3 CTAs")
    assert not failures, "\n".join(failures)
    assert torch.equal(m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, off, 3), c)


@on_gpu
def test_fp8_ops_name_the_bad_argument():
    m = ops()
    x = structured(8, 256)
    a_q, a_s = m.fp8_quantize_rows(x, None)
    w_q, w_s, _, _ = m.fp8_quantize_weights(structured(2, 64, 256), False)
    off = offsets([5, 3])
    with pytest.raises(ValueError, match="a_q must have dtype"):
        m.grouped_gemm_fp8(x, a_s, w_q, w_s, off)
    with pytest.raises(ValueError, match="w_scales must have shape"):
        m.grouped_gemm_fp8(a_q, a_s, w_q, w_s[:, :, :1].contiguous(), off)
    with pytest.raises(ValueError, match="expert_offsets must have shape"):
        m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offsets([5, 3, 0]))
    with pytest.raises(ValueError, match="gather must have dtype"):
        m.grouped_gemm_fp8(a_q, a_s, w_q, w_s, off, 0, torch.zeros(8, device="cuda", dtype=torch.int64))
    with pytest.raises(ValueError, match="gather must have dtype"):
        m.fp8_quantize_rows(x, torch.zeros(4, device="cuda", dtype=torch.int64))
    with pytest.raises(ValueError, match="x must have dtype"):
        m.fp8_quantize_rows(x.float(), None)
    with pytest.raises(ValueError, match="d must be a positive multiple of 16"):  # the C++ rule
        m.fp8_quantize_columns(structured(8, 40), None, off)
    with pytest.raises(ValueError, match="w must be 3-D"):
        m.fp8_quantize_weights(structured(64, 256), False)


@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
@pytest.mark.parametrize("activation,glu_clamp", [("swiglu", []), ("clamped_swiglu", [1.702, 7.0, 1.0, 0.0])])
def test_grouped_gemm_fp8_glu_against_float64(name, d, n, activation, glu_clamp):
    # The up-projection with the GLU epilogue, gathered and with a bias: H's scales and codes
    # against the float64 GEMM + bias, A's against the activation of that float64 H (the C++ test
    # GpuFp8Glu derives the tolerances).
    m = ops()
    E, R, T, N, K = len(COUNTS), sum(COUNTS), 600, 2 * n, d
    x_q, x_s = m.fp8_quantize_rows(structured(T, K), None)
    w_q, w_s, _, _ = m.fp8_quantize_weights(structured(E, N, K) * 0.02, False)
    bias = (torch.rand(E, N, device="cuda") - 0.5).bfloat16()
    gather = torch.randint(0, T, (R,), device="cuda", dtype=torch.int32)
    hq, hs, aq, as_ = m.grouped_gemm_fp8_glu(x_q, x_s, w_q, w_s, offsets(COUNTS), activation, glu_clamp, bias, 0,
                                             gather)
    assert (hq.shape, hq.dtype, aq.shape, hs.shape, as_.shape) == (
        (R, N), torch.float8_e4m3fn, (R, n), (R, -(-N // TILE)), (R, -(-n // TILE)))
    expert = torch.repeat_interleave(torch.arange(E, device="cuda"), torch.tensor(COUNTS, device="cuda"))
    c, absum = gemm_reference(dequantise_rows(x_q, x_s, K)[gather.long()], dequantise_weights(w_q, w_s, N, K), COUNTS)
    h = c + bias.double()[expert]
    g = 2.0 ** -10 * absum  # the accumulation bound
    hd = dequantise_rows(hq, hs, N)
    gmax = torch.nn.functional.pad(g, (0, (-N) % TILE)).reshape(R, -1, TILE).amax(-1)
    assert ((448 * hs.double() - tile_amax(h).double()).abs() <= gmax + 2.0 ** -22 * tile_amax(h)).all(), "H scales"
    tol = 2.0 ** -4 * (h.abs() + g) + 2.0 ** -10 * expand(hs.double(), N) + g
    assert ((hd - h).abs() <= tol).all(), f"H codes: worst excess {((hd - h).abs() - tol).max().item():.3e}"
    def act(gate, up):
        if activation == "swiglu":
            return torch.nn.functional.silu(gate) * up
        alpha, limit, offset, _ = glu_clamp
        gc = gate.clamp(max=limit)
        return gc * torch.sigmoid(alpha * gc) * (up.clamp(-limit, limit) + offset)

    # A from the float64 H (the kernel's comes from its fp32 H, within g of it per element): ea
    # bounds what that moves A, the largest change of act over the corners of the (gate, up) box
    # of half-width g, twice over.
    a = act(h[:, 0::2], h[:, 1::2])
    ea = torch.stack([(act(h[:, 0::2] + sg * g[:, 0::2], h[:, 1::2] + su * g[:, 1::2]) - a).abs()
                      for sg in (-1, 1) for su in (-1, 1)]).amax(0) * 2
    amax = tile_amax(a).double()
    emax = tile_amax(ea).double()
    assert ((448 * as_.double() - amax).abs() <= emax + 2.0 ** -16 * amax).all(), "A scales"
    ad = dequantise_rows(aq, as_, n)
    tol_a = (2.0 ** -4 * (a.abs() + ea) + 2.0 ** -10 * expand(as_.double(), n) + 2.0 ** -15 * expand(amax, n)
             + ea)
    assert ((ad - a).abs() <= tol_a).all(), f"A codes: worst excess {((ad - a).abs() - tol_a).max().item():.3e}"


@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
def test_fp8_experts_forward_within_e4m3s_error(name, d, n):
    # The composed FP8 forward against the float64 experts on the same routing. Its path crosses
    # four quantised operands (x, W1, A, W2; A comes from the unquantised H): E4M3's rounding (rms
    # ~0.024 relative per operand) makes ~sqrt(4)·0.024 = 0.048 normwise, as the CPU reference's
    # FP8 experts measure it (tests/cpp/test_reference_fp8_layer.cpp); bound twice that, floor a
    # tenth (not FP8 at all).
    from machmoe.fp8_experts import experts_forward

    E, T, K = 8, 300, 3
    x = torch.randn(T, d, device="cuda").bfloat16()
    w1 = (torch.randn(E, 2 * n, d, device="cuda") / d ** 0.5).bfloat16()
    w2 = (torch.randn(E, d, n, device="cuda") / n ** 0.5).bfloat16()
    experts = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()
    scores = torch.rand(T, K, device="cuda")
    out, (saved, *_) = experts_forward(x, w1, w2, scores, experts)
    assert (out.shape, out.dtype) == ((T, d), torch.bfloat16)
    # H kept in E4M3 with its 1x128 scales: the saved block holds less than H in bf16 alone.
    assert saved.dtype == torch.uint8 and saved.numel() < T * K * 2 * n * 2
    xd, w1d, w2d = x.double(), w1.double(), w2.double()
    want = torch.zeros(T, d, dtype=torch.float64, device="cuda")
    for e in range(E):
        t, k = (experts == e).nonzero(as_tuple=True)
        h = xd[t] @ w1d[e].T
        a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
        want.index_add_(0, t, scores[t, k, None].double() * (a @ w2d[e].T))
    err = ((out.double() - want).norm() / want.norm()).item()
    print(f"{name}: FP8 experts forward, normwise error {err:.4f} against float64")
    assert 0.1 * 0.048 <= err <= 2 * 0.048, f"normwise error {err:.4f} outside [0.0048, 0.096]"


@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
@pytest.mark.parametrize("out_dtype,transpose_c", [(torch.float32, False), (torch.bfloat16, True)])
def test_grouped_wgrad_fp8_against_float64(name, d, n, out_dtype, transpose_c):
    # dW1ᵀ = xᵀ·dH as the FP8 backward would run it: x's rows gathered by token and dH, both
    # quantised along each expert's 128-row chunks (fp8_quantize_columns, the same offsets), then
    # the weight-gradient GEMM; against float64 on the dequantised operands with the worst-case
    # accumulation bound of tests/cpp/test_gpu_fp8_wgrad.cpp: 2^-8·Σ|a·b| per element (truncated
    # k32 steps; measured up to 1.3e-3·Σ|a·b| on these operands), plus bf16 output rounding.
    m = ops()
    E, R, T = len(COUNTS), sum(COUNTS), 600
    x, dh = structured(T, d), structured(R, 2 * n) * 0.1
    gather = torch.randint(0, T, (R,), device="cuda", dtype=torch.int32)
    xt, xs, co = m.fp8_quantize_columns(x, gather, offsets(COUNTS))
    ht, hs, co_h = m.fp8_quantize_columns(dh, None, offsets(COUNTS))
    assert torch.equal(co, co_h)
    c = m.grouped_wgrad_fp8(xt, xs, ht, hs, co, out_dtype, transpose_c)
    # Dequantised and laid out [width, 128·chunks]: each column's rows in order.
    xd = (xt.double() * xs.double()[..., None]).permute(1, 0, 2).reshape(d, -1)
    hd = (ht.double() * hs.double()[..., None]).permute(1, 0, 2).reshape(2 * n, -1)
    got = c.double().transpose(1, 2) if transpose_c else c.double()
    cl = co.tolist()
    for e in range(E):
        cols = slice(TILE * cl[e], TILE * cl[e + 1])
        want, absum = xd[:, cols] @ hd[:, cols].T, xd[:, cols].abs() @ hd[:, cols].abs().T
        rounding = 2.0 ** -9 * want.abs() if out_dtype == torch.bfloat16 else 0
        bad = ~((got[e] - want).abs() <= 2 * rounding + 2.0 ** -8 * absum)
        assert not bad.any(), f"{name} expert {e}: {int(bad.sum())} elements outside the tolerance"


@on_gpu
@pytest.mark.parametrize("name,d,n", SHAPES)
def test_fp8_experts_gradients_within_e4m3s_error(name, d, n):
    # Every gradient of the composed FP8 experts against float64 autograd on the same inputs. The
    # bound per tensor as the CPU reference's FP8 experts test derives it: 2·sqrt(m)·0.024 for a
    # path through m quantised operands (dx, dw1: 6; dw2: 5; d_scores: 5, twice the slack: one
    # dot product per pair, whose terms cancel), and a floor a tenth of the model.
    from machmoe.fp8_experts import experts

    E, T, K = 8, 300, 3
    x = torch.randn(T, d, device="cuda").bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * n, d, device="cuda") / d ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, d, n, device="cuda") / n ** 0.5).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()
    scores = torch.rand(T, K, device="cuda").requires_grad_()
    dout = torch.randn(T, d, device="cuda").bfloat16()
    experts(x, w1, w2, scores, idx).backward(dout)
    ref = [t.detach().double().requires_grad_() for t in (x, w1, w2, scores)]
    xd, w1d, w2d, sd = ref
    out = torch.zeros(T, d, dtype=torch.float64, device="cuda")
    for e in range(E):
        t, k = (idx == e).nonzero(as_tuple=True)
        h = xd[t] @ w1d[e].T
        a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
        out = out.index_add(0, t, sd[t, k, None] * (a @ w2d[e].T))
    out.backward(dout.double())
    for label, got, want, m, slack in (("dx", x.grad, xd.grad, 6, 1), ("dw1", w1.grad, w1d.grad, 6, 1),
                                       ("dw2", w2.grad, w2d.grad, 5, 1), ("d_scores", scores.grad, sd.grad, 5, 2)):
        err = ((got.double() - want).norm() / want.norm()).item()
        model = m ** 0.5 * 0.024
        print(f"{name} {label}: normwise error {err:.4f} (model {model:.4f})")
        assert 0.1 * model <= err <= 2 * slack * model, f"{label}: normwise error {err:.4f}"


@on_gpu
@pytest.mark.parametrize("R, n", [(1000, 256), (777, 512), (64, 2880), (1, 8)])  # 2n >= 16: quantisable
def test_fp8_swiglu_backward_against_float64(R, n):
    # The FP8 experts' SwiGLU backward op on the dequantised H (1x128 scales along 2n) and a
    # permuted row -> pair map: dH and A' against float64 within bf16's rounding (2^-8 relative,
    # with an absolute floor for the sigmoid's fp32 evaluation), d_scores at their pairs within
    # fp32 summation error; a NaN tile of H reaches only its own row.
    m = ops()
    h = structured(R, 2 * n)
    hq, hs = m.fp8_quantize_rows(h, None)
    hs[R // 2, 0] = float("nan") if R > 1 else hs[R // 2, 0]
    da = torch.randn(R, n, device="cuda").bfloat16()
    pairs = R + 5
    row_pair = torch.randperm(pairs, device="cuda")[:R].int()
    scores = torch.rand(pairs, device="cuda")
    dh, a_prime, d_scores = m.fp8_swiglu_backward(da, hq, hs, scores, row_pair)
    hd = hq.double() * hs.double().repeat_interleave(TILE, dim=1)[:, : 2 * n]
    g, u = hd[:, 0::2], hd[:, 1::2]
    sig = torch.sigmoid(g)
    act = g * sig
    a = act * u
    s = scores.double()[row_pair.long()][:, None]
    dad = da.double()
    want_dh = torch.stack([s * dad * u * sig * (1 + g * (1 - sig)), s * dad * act], dim=2).reshape(R, 2 * n)
    want_ds = torch.zeros(pairs, dtype=torch.float64, device="cuda")
    want_ds[row_pair.long()] = (dad * a).sum(1)
    bad_row = R // 2 if R > 1 else -1
    ok = torch.ones(R, dtype=torch.bool, device="cuda")
    if bad_row >= 0:
        ok[bad_row] = False
        assert torch.isnan(dh[bad_row, :128]).all() and torch.isnan(d_scores[row_pair[bad_row].long()])
    for name, got, want in (("dh", dh, want_dh), ("a_prime", a_prime, s * a)):
        err = (got.double()[ok] - want[ok]).abs()
        tol = 2.0 ** -8 * want[ok].abs() + 1e-6 * want[ok].abs().max()
        assert (err <= tol).all(), f"{name}: {int((err > tol).sum())} elements outside bf16 rounding"
    absdot = (dad.abs() * a.abs()).sum(1)
    err = (d_scores.double()[row_pair.long()] - want_ds[row_pair.long()]).abs()
    assert (err[ok] <= 1e-4 * absdot[ok] + 1e-30).all(), "d_scores"
    unused = torch.ones(pairs, dtype=torch.bool, device="cuda")
    unused[row_pair.long()] = False
    assert (d_scores[unused] == 0).all(), "pairs without a row keep d_score 0"


@on_gpu
@pytest.mark.parametrize("R, n", [(1000, 256), (64, 2880)])
@pytest.mark.parametrize("alpha, limit, up_offset, after", [(1.702, 1.0, 1.0, 0), (1.0, 0.75, 0.0, 0),
                                                             (1.702, 1.5, 1.0, 1)])
def test_fp8_swiglu_backward_clamped_against_float64(R, n, alpha, limit, up_offset, after):
    # The clamped SwiGLU (glu_clamp: gpt-oss's form, DeepSeek-V4's, the clamp after the
    # activation) on the dequantised H with limits near H's rms, so that the clamps bind on a large
    # share of the elements. The clamps are decided on the same fp32 values of H in both, so dH and
    # A' are within bf16's rounding, as the plain kernel's; d_scores within fp32
    # summation error. Only where gc·σ lies within 1e-5 (relative) of the limit (clamp after) may
    # the kernel's approximate fp32 sigmoid and float64's decide differently: such elements are
    # left out, and there are few.
    m = ops()
    torch.manual_seed(R + n)
    h = (torch.randn(R, 2 * n, device="cuda") * 1.5).bfloat16()
    hq, hs = m.fp8_quantize_rows(h, None)
    da = torch.randn(R, n, device="cuda").bfloat16()
    pairs = R + 5
    row_pair = torch.randperm(pairs, device="cuda")[:R].int()
    scores = torch.rand(pairs, device="cuda")
    dh, a_prime, d_scores = m.fp8_swiglu_backward(da, hq, hs, scores, row_pair, [alpha, limit, up_offset, after])
    # H as the kernel (and the emulation) dequantises it: code·scale rounded to fp32. The exact
    # product can lie just past a limit that its fp32 value meets (a bf16 value of 1.0 comes back
    # as 1.0000000447 at some scales): the clamps are decided on the fp32 value.
    hd = (hq.float() * hs.repeat_interleave(TILE, dim=1)[:, : 2 * n]).double()
    g, u = hd[:, 0::2], hd[:, 1::2]
    inf = float("inf")
    gate_limit, act_limit = (inf, limit) if after else (limit, inf)
    gc = g.clamp(max=gate_limit)
    sig = torch.sigmoid(alpha * gc)
    f = (gc * sig).clamp(max=act_limit)
    uc = u.clamp(-limit, limit) + up_offset
    a = f * uc
    s = scores.double()[row_pair.long()][:, None]
    sda = s * da.double()
    gate_passes = (g <= gate_limit) & (gc * sig <= act_limit)
    up_passes = u.abs() <= limit
    assert 0.1 < 1 - up_passes.double().mean().item() < 0.9, "the clamp binds on a large share"
    d_gate = torch.where(gate_passes, sda * sig * (1 + alpha * gc * (1 - sig)) * uc, 0.0)
    d_up = torch.where(up_passes, sda * f, 0.0)
    want_dh = torch.stack([d_gate, d_up], dim=2).reshape(R, 2 * n)
    near = ((gc * sig - act_limit).abs() <= 1e-5 * act_limit) if after else torch.zeros_like(g, dtype=torch.bool)
    assert near.double().mean().item() < 1e-3
    keep_dh = ~torch.stack([near, torch.zeros_like(near)], dim=2).reshape(R, 2 * n)
    for name, got, want, keep in (("dh", dh, want_dh, keep_dh), ("a_prime", a_prime, s * a, ~near)):
        err = (got.double()[keep] - want[keep]).abs()
        tol = 2.0 ** -8 * want[keep].abs() + 1e-6 * want[keep].abs().max()
        assert (err <= tol).all(), f"{name}: {int((err > tol).sum())} elements outside bf16 rounding"
    want_ds = (da.double() * a).sum(1)
    absdot = (da.double().abs() * a.abs()).sum(1)
    err = (d_scores.double()[row_pair.long()] - want_ds).abs()
    rows = ~near.any(1)
    assert (err[rows] <= 1e-4 * absdot[rows] + 1e-30).all(), "d_scores"
