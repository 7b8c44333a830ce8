"""precision="fp8" of the layer on the torch backend (machmoe.fp8_emulation under machmoe.fp8_layer),
on the CPU: the emulation's quantisers against the recipe as tests/python/test_gpu_fp8.py states it
(bitwise), the layer's output and every gradient against float64 within FP8's derived error and
measurably away from the bf16 layer, the argument rules, and the module's FP8 weight cache.

The error model (test_gpu_fp8.py, tests/cpp/test_reference_fp8_layer.cpp): E4M3 rounds each
quantised operand with an rms relative error of ~0.024, so a result whose path crosses m quantised
operands is off by ~sqrt(m)·0.024 normwise; bound 2·sqrt(m)·0.024 (twice that for the scores'
gradients, dot products whose terms cancel, and for the router's, which come from them), and a floor
of a tenth of the model. The bf16 layer on the same inputs is far below the model (a few bf16
roundings of 2^-9), so each FP8 error must also be at least 3x the bf16 layer's: a layer that ran in
bf16 under precision="fp8" fails both."""

import copy

import pytest
import torch

from machmoe import GluClamp, MoE
from machmoe import fp8_emulation as emu
from machmoe import functional, torch_backend
from machmoe.fp8_weights import FP8WeightCache
from test_gpu_fp8 import expand, ref_quantize_columns, ref_quantize_rows, ref_quantize_weights

RMS = 0.024  # E4M3's rms relative rounding error per quantised operand, measured (module docstring)
# tensor -> (quantised operands on its path, slack), as test_gpu_fp8.py counts them: forward x, W1,
# A, W2 (A from the unquantised H); dx and dw1 6, dw2 5 (the backward recomputes A and dH from the
# kept E4M3 H); the router's gradients come from the scores' (5, slack 2; the router bias's error
# measured on the scale of the per-token terms it sums, dlogits_norm).
PATHS = {"out": (4, 1), "dx": (6, 1), "dw1": (6, 1), "dw2": (5, 1), "d_router_weight": (5, 2),
         "d_router_bias": (5, 2)}


def model(name):
    m, slack = PATHS[name]
    return m ** 0.5 * RMS, slack


# ---------------------------------------------------------------- the quantisers, bitwise
def test_quantisers_match_the_recipe_bitwise():
    # rows (1x128, partial last tile), 128x128 weight blocks (partial edges), transposed copies and
    # per-expert 128-row column chunks (an empty expert, a 1-row chunk), against test_gpu_fp8's
    # statement of the recipe, which the GPU quantisers match bitwise. Magnitudes spread over 2^-8..2^7
    # per row so that a scale applied to the wrong tile shows; an all-zero tile (scale 1).
    x = (torch.randn(7, 300) * 2.0 ** torch.randint(-8, 8, (7, 1))).bfloat16()
    x[0, :128] = 0
    codes, s = ref_quantize_rows(x, None)
    want = codes.view(torch.float8_e4m3fn).float() * expand(s, 300)
    assert torch.equal(emu.rows_dequantized(x), want)

    w = (torch.randn(3, 200, 272) * 2.0 ** torch.randint(-8, 8, (3, 200, 1))).bfloat16()
    q, scales, qt, qt_scales = emu.quantize_weights(w, True)
    want_q, want_s = ref_quantize_weights(w)
    assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(scales, want_s)
    assert torch.equal(qt.view(torch.uint8), want_q.transpose(1, 2)) and torch.equal(qt_scales, want_s.transpose(1, 2))
    assert emu.quantize_weights(w, False)[2:] == (None, None)

    counts = [130, 0, 1, 129]
    rows = (torch.randn(sum(counts), 48) * 2.0 ** torch.randint(-8, 8, (sum(counts), 1))).bfloat16()
    qt, cs, chunk_offsets = ref_quantize_columns(rows, None, counts)
    got = emu.columns_dequantized(rows, counts)
    start, c = 0, 0
    for rows_e in counts:  # the reference's chunks in order: chunk c holds rows [start + 128 j, ...)
        for j in range(0, rows_e, 128):
            m = min(128, rows_e - j)
            want = qt[c, :, :m].view(torch.float8_e4m3fn).float().T * cs[c]
            assert torch.equal(got[start + j:start + j + m], want), f"chunk {c}"
            c += 1
        start += rows_e


def test_quantisers_by_hand():
    # E4M3 has 3 mantissa bits: on [1, 2) a step of 1/8, ties to even; beyond 448 it saturates
    # (torch's cast alone would give NaN); an all-zero tile has scale 1; a NaN poisons its tile only.
    one = torch.ones(())
    assert emu.e4m3_codes(torch.tensor([1.0625, 1.1875, 500.0, -1e9]), one).float().tolist() == \
        [1.0, 1.25, 448.0, -448.0]
    row = torch.zeros(1, 256)
    row[0, :3] = torch.tensor([448.0, 1.0625, 1.1875])  # tile 0: amax 448, scale 1
    row[0, 128] = float("nan")
    got = emu.rows_dequantized(row)
    assert got[0, :3].tolist() == [448.0, 1.0, 1.25] and torch.equal(got[0, 3:128], torch.zeros(125))
    assert got[0, 128:].isnan().all()
    scales = emu.tile_scales(torch.tensor([0.0, 448.0, 1.0, float("inf")]))
    assert scales[:3].tolist() == [1.0, 1.0, torch.tensor(1 / 448, dtype=torch.float32).item()]
    assert scales[3].isnan()


# ---------------------------------------------------------------- the layer against float64
def layer_inputs(T, d, n, E, K, routing, device="cpu", biases=False):
    """(bf16 inputs, dout) with the last expert never chosen (router bias -30: an expert with no
    rows) and no token near a top-K tie (the fp32 router could choose differently from float64's:
    keys within 1e-4, ~100x the fp32 router's error at d = 4096, are redrawn). biases: the expert
    biases b1, b2 too, half the scale of the H and Y they are added to (so that a missing or
    misplaced one fails, and the GEMMs' FP8 error still shows)."""
    def randn(*shape):
        return torch.randn(*shape, device=device)

    t = {"x": randn(T, d).bfloat16(), "router_weight": (randn(E, d) * 0.05).bfloat16(),
         "router_bias": (randn(E) * 0.1).bfloat16(),
         "w1": (randn(E, 2 * n, d) / d ** 0.5).bfloat16(), "w2": (randn(E, d, n) / n ** 0.5).bfloat16()}
    if biases:
        t["b1"], t["b2"] = (randn(E, 2 * n) * 0.5).bfloat16(), (randn(E, d) * 0.3).bfloat16()
    t["router_bias"][-1] = -30
    for _ in range(50):
        logits = torch_backend.router_logits(t["x"].double(), t["router_weight"].double(), t["router_bias"].double())
        keys = torch.sigmoid(logits) if routing == "sigmoid" else logits
        top = keys.topk(K + 1, dim=1).values
        near = (top[:, K - 1] - top[:, K]) < 1e-4 * top[:, 0].abs().clamp_min(1)
        if not near.any():
            return t, randn(T, d).bfloat16()
        t["x"][near] = randn(int(near.sum()), d).bfloat16()
    raise AssertionError("near ties remain")


def run_layer(t, dout, K, routing, dtype, precision, backend="torch", glu_clamp=None, **options):
    """(out, aux and every gradient) of functional.moe, t's tensors in dtype; glu_clamp: the
    clamped SwiGLU's parameters (None: SwiGLU); options: more of functional.moe's arguments."""
    leaves = {k: v.detach().to(dtype).clone().requires_grad_() for k, v in t.items()}
    act = {} if glu_clamp is None else {"activation": "clamped_swiglu", "glu_clamp": glu_clamp}
    act.update(options)
    out, aux = functional.moe(leaves["x"], leaves["router_weight"], leaves["w1"], leaves["w2"], num_experts_per_tok=K,
                              routing=routing, router_bias=leaves["router_bias"], backend=backend,
                              precision=precision, b1=leaves.get("b1"), b2=leaves.get("b2"), **act)
    (out.double() * dout.double()).sum().add(aux.double() * 3.0).backward()
    got = {"out": out.detach(), "aux": aux.detach(), "dx": leaves["x"].grad, "dw1": leaves["w1"].grad,
           "dw2": leaves["w2"].grad, "d_router_weight": leaves["router_weight"].grad,
           "d_router_bias": leaves["router_bias"].grad}
    if "b1" in leaves:
        got["db1"], got["db2"] = leaves["b1"].grad, leaves["b2"].grad
    return got


def rel(a, b, scale=None):
    """‖a − b‖ / ‖b‖ (or / scale)."""
    return ((a.double() - b.double()).norm() / (b.double().norm() if scale is None else scale)).item()


def dlogits_norm(t, dout, K, routing, glu_clamp=None):
    """‖dlogits‖ [T, E] of run_layer's loss in float64: the scale of the router bias's gradient,
    Σ_t dlogits_t, whose T terms can cancel to far below their own size (each term's FP8 error
    does not cancel with them)."""
    x, wr, b, w1, w2 = (t[k].double() for k in ("x", "router_weight", "router_bias", "w1", "w2"))
    b1, b2 = (t[k].double() if k in t else None for k in ("b1", "b2"))
    logits = torch_backend.router_logits(x, wr, b).requires_grad_()
    scores, experts = torch_backend.route_topk(logits, K, routing)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(K)
    act = "swiglu" if glu_clamp is None else "clamped_swiglu"
    out = torch_backend.experts(x, w1, b1, w2, b2, token, experts.reshape(-1), scores.reshape(-1), act,
                                glu_clamp=glu_clamp)
    ((out * dout.double()).sum() + 3.0 * torch_backend.aux_loss(logits, experts)).backward()
    return logits.grad.norm().item()


# (T, d, n, E, K): d, n multiples of 128; odd T; d = 144, n = 80: partial 128-tiles everywhere
@pytest.mark.parametrize("T,d,n,E,K", [(37, 128, 128, 4, 2), (51, 256, 128, 6, 3), (33, 144, 80, 5, 2)])
@pytest.mark.parametrize("routing", ["softmax_topk", "sigmoid"])
def test_fp8_layer_against_float64_and_away_from_bf16(T, d, n, E, K, routing):
    t, dout = layer_inputs(T, d, n, E, K, routing)
    fp8 = run_layer(t, dout, K, routing, torch.bfloat16, "fp8")
    bf16 = run_layer(t, dout, K, routing, torch.bfloat16, "bf16")
    ref = run_layer(t, dout, K, routing, torch.float64, "bf16")
    assert fp8["out"].dtype == torch.bfloat16 and fp8["dw1"].dtype == torch.bfloat16
    # The same routing: the aux loss is the bf16 layer's, and the never-chosen expert has exactly
    # zero weight gradients.
    assert abs(fp8["aux"].item() - ref["aux"].item()) <= 1e-5 * ref["aux"].item()
    assert not fp8["dw1"][-1].any() and not fp8["dw2"][-1].any()
    failures = []
    for name in PATHS:
        m, slack = model(name)
        scale = dlogits_norm(t, dout, K, routing) if name == "d_router_bias" else None
        err, err_bf16 = rel(fp8[name], ref[name], scale), rel(bf16[name], ref[name], scale)
        print(f"{name}: fp8 {err:.4f} (model {m:.4f}), bf16 {err_bf16:.5f}")
        if not 0.1 * m <= err <= 2 * slack * m:
            failures.append(f"{name}: fp8 error {err:.4f} outside [{0.1 * m:.4f}, {2 * slack * m:.4f}]")
        if err < 3 * err_bf16 and name != "d_router_bias":  # a sum of few cancelling terms: too noisy
            failures.append(f"{name}: fp8 error {err:.4f} not 3x the bf16 layer's {err_bf16:.5f}")
    assert not failures, "\n".join(failures)


# The clamped SwiGLU (gpt-oss's form, DeepSeek-V4's, and the clamp after the activation) at a
# limit of 3 where H ~ N(0, 1): the clamps bind on a few tenths of a percent of the elements. The
# backward decides them again on the E4M3 H, so an element within E4M3's rounding (2^-4 relative)
# of a limit can fall on the other side: its gradient then is 0 instead of whole, or the reverse.
# That error grows with the density of H at the limits (measured: limit 2 puts dx and dw1 at
# 0.13-0.14 against the model's 0.118, clamp_after at limit 1 at 0.17-0.23); at 3 it stays inside
# the model (0.066-0.074). The clamps' arithmetic on equal H is checked tightly by
# test_gpu_fp8.py's test of the SwiGLU backward kernel. The bf16 layer re-decides the clamps on its
# bf16 H too (a window of 2^-9 instead of 2^-4): at this small size a few flipped elements can put
# its error near a third of FP8's (dw1 0.029 against 0.081, seed 1850213024), so that FP8 ran at
# all is checked as the FP8 result's distance from the bf16 layer's, at least the model's floor.
CLAMPS = {"gpt-oss": GluClamp.gpt_oss(limit=3.0), "deepseek-v4": GluClamp.deepseek_v4(limit=3.0),
          "clamp-after": GluClamp(alpha=1.702, limit=3.0, up_offset=1.0, clamp_after=True)}


@pytest.mark.parametrize("clamp", list(CLAMPS))
def test_fp8_clamped_swiglu_layer_against_float64(clamp):
    T, d, n, E, K, routing = 51, 256, 128, 6, 3, "softmax_topk"
    glu_clamp = CLAMPS[clamp]
    t, dout = layer_inputs(T, d, n, E, K, routing)
    fp8 = run_layer(t, dout, K, routing, torch.bfloat16, "fp8", glu_clamp=glu_clamp)
    bf16 = run_layer(t, dout, K, routing, torch.bfloat16, "bf16", glu_clamp=glu_clamp)
    ref = run_layer(t, dout, K, routing, torch.float64, "bf16", glu_clamp=glu_clamp)
    plain = run_layer(t, dout, K, routing, torch.float64, "bf16")
    assert rel(ref["dx"], plain["dx"]) > 1e-3, "the clamps never bound: the test would not see them"
    failures = []
    for name in PATHS:
        m, slack = model(name)
        scale = dlogits_norm(t, dout, K, routing, glu_clamp) if name == "d_router_bias" else None
        err, apart = rel(fp8[name], ref[name], scale), rel(fp8[name], bf16[name], scale)
        print(f"{clamp} {name}: fp8 {err:.4f} (model {m:.4f}), fp8 vs the bf16 layer {apart:.4f}")
        if not 0.1 * m <= err <= 2 * slack * m:
            failures.append(f"{name}: fp8 error {err:.4f} outside [{0.1 * m:.4f}, {2 * slack * m:.4f}]")
        if apart < 0.1 * m:
            failures.append(f"{name}: fp8 result within {apart:.4f} of the bf16 layer's (floor {0.1 * m:.4f})")
    assert not failures, "\n".join(failures)


# The expert biases (gpt-oss): db1 = Σ dH crosses the operands of dH (dout, W2 and the kept H:
# 5, as dW2); db2 = Σ score·dout is not quantised at all, so it must match the bf16 layer's (the
# same sums in another chunk order). Checked with SwiGLU and with gpt-oss's clamped SwiGLU.
BIAS_PATHS = {**PATHS, "db1": (5, 1)}


def check_fp8_biases(fp8, bf16, ref, t, dout, K, routing, glu_clamp, label, emulated=None, spread=1.0):
    """The failures of an FP8 run with expert biases against float64 (test docstrings above); with
    `emulated`, also the kernels against the emulation (test_gpu_fp8_layer.py's bound)."""
    failures = []
    for name in (*BIAS_PATHS, "db2"):
        scale = dlogits_norm(t, dout, K, routing, glu_clamp) if name == "d_router_bias" else None
        err, err_bf16 = rel(fp8[name], ref[name], scale), rel(bf16[name], ref[name], scale)
        apart = rel(fp8[name], bf16[name], scale)
        err_emu = None if emulated is None else rel(fp8[name], emulated[name], scale)
        print(f"{label} {name}: fp8 {err:.4f}, bf16 {err_bf16:.5f}, fp8 vs bf16 {apart:.4f}"
              + ("" if err_emu is None else f", vs emulation {err_emu:.5f}"))
        if name == "db2":  # unquantised: the bf16 layer's error, up to a bf16 rounding of the result
            if err > 2 * err_bf16 + 2.0 ** -9:
                failures.append(f"db2: fp8 error {err:.5f} not the bf16 layer's {err_bf16:.5f}")
            continue
        m, slack = BIAS_PATHS[name][0] ** 0.5 * RMS, BIAS_PATHS[name][1] * spread
        if not 0.1 * m <= err <= 2 * slack * m:
            failures.append(f"{name}: fp8 error {err:.4f} outside [{0.1 * m:.4f}, {2 * slack * m:.4f}]")
        if apart < 0.1 * m:
            failures.append(f"{name}: fp8 result within {apart:.4f} of the bf16 layer's (floor {0.1 * m:.4f})")
        if err_emu is not None and err_emu > 0.35 * slack * m:
            failures.append(f"{name}: kernels vs emulation {err_emu:.5f} above {0.35 * slack * m:.4f}")
    return failures


@pytest.mark.parametrize("clamp", [None, "gpt-oss"])
def test_fp8_layer_expert_biases_against_float64(clamp):
    T, d, n, E, K, routing = 51, 256, 128, 6, 3, "softmax_topk"
    glu_clamp = None if clamp is None else CLAMPS[clamp]
    t, dout = layer_inputs(T, d, n, E, K, routing, biases=True)
    fp8 = run_layer(t, dout, K, routing, torch.bfloat16, "fp8", glu_clamp=glu_clamp)
    bf16 = run_layer(t, dout, K, routing, torch.bfloat16, "bf16", glu_clamp=glu_clamp)
    ref = run_layer(t, dout, K, routing, torch.float64, "bf16", glu_clamp=glu_clamp)
    unbiased = {k: v for k, v in t.items() if k not in ("b1", "b2")}
    without = run_layer(unbiased, dout, K, routing, torch.float64, "bf16", glu_clamp=glu_clamp)
    assert rel(without["out"], ref["out"]) > 0.2, "the biases barely change the output: the test would not see them"
    assert not fp8["db1"][-1].any() and not fp8["db2"][-1].any()  # the never-chosen expert
    failures = check_fp8_biases(fp8, bf16, ref, t, dout, K, routing, glu_clamp, f"biases {clamp}")
    assert not failures, "\n".join(failures)


# Token rounding: the FP8 experts on the rounded list. A float64 layer would round on float64
# logits, and where two pairs' scores lie within the fp32 router's error of each other it can keep
# or pad another pair; so the reference is the bf16 layer on the same fp32 routing (the same
# list), whose own error (~0.004) is a tenth of FP8's model: FP8's distance from it must lie in the
# model's band. (The router bias's gradient, a sum over tokens, is left out: see dlogits_norm.)
ROUNDING_PATHS = ("out", "dx", "dw1", "dw2", "d_router_weight")


def check_fp8_rounding(fp8, bf16, label, emulated=None, spread=1.0):
    """The failures of an FP8 run with token rounding against the bf16 layer (above); with
    `emulated`, also against the FP8 emulation (test_gpu_fp8_layer.py's bound)."""
    failures = []
    assert torch.equal(fp8["aux"], bf16["aux"]), "not the same routing"
    for name in ROUNDING_PATHS:
        m, slack = model(name)
        slack *= spread
        err = rel(fp8[name], bf16[name])
        err_emu = None if emulated is None else rel(fp8[name], emulated[name])
        print(f"{label} {name}: fp8 vs the bf16 layer {err:.4f} (model {m:.4f})"
              + ("" if err_emu is None else f", vs emulation {err_emu:.5f}"))
        if not 0.1 * m <= err <= 2 * slack * m:
            failures.append(f"{name}: fp8 vs bf16 {err:.4f} outside [{0.1 * m:.4f}, {2 * slack * m:.4f}]")
        if err_emu is not None and err_emu > 0.35 * slack * m:
            failures.append(f"{name}: kernels vs emulation {err_emu:.5f} above {0.35 * slack * m:.4f}")
    return failures


@pytest.mark.parametrize("mode", ["nr", "up", "down"])
def test_fp8_layer_token_rounding_against_the_bf16_layer(mode):
    T, d, n, E, K, tile_m = 301, 128, 64, 8, 2, 16
    t, dout = layer_inputs(T, d, n, E, K, "softmax_topk", biases=True)
    logits = torch_backend.router_logits(t["x"], t["router_weight"], t["router_bias"])
    rounded = torch_backend.token_rounding(logits, K, mode, tile_m)
    assert rounded.token.numel() != T * K or rounded.padded.any(), "the rounding changed nothing"
    options = {"token_rounding": mode, "tile_m": tile_m}
    fp8 = run_layer(t, dout, K, "softmax_topk", torch.bfloat16, "fp8", **options)
    bf16 = run_layer(t, dout, K, "softmax_topk", torch.bfloat16, "bf16", **options)
    failures = check_fp8_rounding(fp8, bf16, f"rounding {mode}")
    assert not failures, "\n".join(failures)


def test_fp8_layer_one_token_and_auto_backend():
    # T = 1 (K rows, most experts empty); on the CPU "auto" runs the same emulation. One token is
    # one scale tile per quantised operand row, so its error is a few tiles' rather than an average
    # over many: its spread is wider than the model's rms (over 300 seeds the output reached 2.03x
    # the model, dx 1.94x), hence 3x here.
    t, dout = layer_inputs(1, 128, 128, 4, 2, "softmax_topk")
    fp8 = run_layer(t, dout, 2, "softmax_topk", torch.bfloat16, "fp8")
    ref = run_layer(t, dout, 2, "softmax_topk", torch.float64, "bf16")
    for name in ("out", "dx", "dw1", "dw2"):
        assert 0.1 * model(name)[0] <= rel(fp8[name], ref[name]) <= 3 * model(name)[0], name
    out, _ = functional.moe(t["x"], t["router_weight"], t["w1"], t["w2"], num_experts_per_tok=2,
                            router_bias=t["router_bias"], precision="fp8")
    assert torch.equal(out, fp8["out"])


# ---------------------------------------------------------------- the concatenated gate/up layout
def test_concatenated_layout_is_the_interleaved_layer_on_permuted_rows():
    """precision='fp8' with w1's gate/up rows concatenated (Hugging Face's layout) computes through
    an FP8 copy of the rows interleaved: it must equal the interleaved layer on w1 permuted that
    way, bitwise (the same codes, scales and GEMMs), output and every gradient, with dw1 (and db1
    of the expert biases, permuted alike) handed back in the concatenated order; and the copies are
    cached per layout (a second call with the same cache makes none)."""
    torch.manual_seed(5)
    T, d, n, E, K = 40, 128, 64, 4, 2
    x = torch.randn(T, d).bfloat16()
    wr = (torch.randn(E, d) * 0.1).bfloat16()
    w1c = (torch.randn(E, 2 * n, d) * 0.05).bfloat16()  # rows [0, n) gate, [n, 2n) up
    w2 = (torch.randn(E, d, n) * 0.05).bfloat16()
    w1i = w1c.reshape(E, 2, n, d).transpose(1, 2).reshape(E, 2 * n, d).contiguous()  # gate j, up j at 2j, 2j + 1
    b1c, b2 = (torch.randn(E, 2 * n) * 0.5).bfloat16(), (torch.randn(E, d) * 0.3).bfloat16()
    b1i = b1c.reshape(E, 2, n).transpose(1, 2).reshape(E, 2 * n).contiguous()
    g = torch.randn(T, d).bfloat16()

    def run(w1, layout, cache, b1=None):
        tensors = (x, wr, w1, w2) if b1 is None else (x, wr, w1, w2, b1, b2)
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        biases = {} if b1 is None else {"b1": leaves[4], "b2": leaves[5]}
        out, aux = functional.moe(*leaves[:4], num_experts_per_tok=K, layout=layout, backend="torch",
                                  precision="fp8", fp8_cache=cache, **biases)
        grads = torch.autograd.grad([out, aux], leaves, [g, torch.ones_like(aux)])
        return out, dict(zip(("x", "router_weight", "w1", "w2", "b1", "b2"), grads))

    out_c, grads_c = run(w1c, "concatenated", FP8WeightCache(emu.quantize_weights), b1c)
    out_i, grads_i = run(w1i, "interleaved", FP8WeightCache(emu.quantize_weights), b1i)
    assert torch.equal(out_c, out_i)
    for k in ("x", "router_weight", "w2", "b2"):
        assert torch.equal(grads_c[k], grads_i[k]), k
    assert torch.equal(grads_c["b1"].reshape(E, 2, n).transpose(1, 2).reshape(E, 2 * n), grads_i["b1"])

    calls = []

    def counting(w, transposed):
        calls.append(transposed)
        return emu.quantize_weights(w, transposed)

    cache = FP8WeightCache(counting)
    out_c, grads_c = run(w1c, "concatenated", cache)
    out_i, grads_i = run(w1i, "interleaved", FP8WeightCache(emu.quantize_weights))
    assert torch.equal(out_c, out_i)
    for k in ("x", "router_weight", "w2"):
        assert torch.equal(grads_c[k], grads_i[k]), k
    assert torch.equal(grads_c["w1"].reshape(E, 2, n, d).transpose(1, 2).reshape(E, 2 * n, d), grads_i["w1"])
    assert not torch.equal(grads_c["w1"], grads_i["w1"])  # the orders differ: the permutation was applied
    made = len(calls)
    run(w1c, "concatenated", cache)  # the same weights (new leaves: new tensor objects) ...
    assert len(calls) == 2 * made    # ... are new cache entries; the same tensor below is not
    cached = FP8WeightCache(counting)
    calls.clear()
    w1_leaf = w1c.clone()
    for _ in range(2):
        cached.get(w1_leaf, False, True)
    assert len(calls) == 1
    q_cat = cached.get(w1_leaf, False, True)[0]
    q_int = FP8WeightCache(emu.quantize_weights).get(w1i, False)[0]
    assert torch.equal(q_cat.view(torch.uint8), q_int.view(torch.uint8))
    assert cached.get(w1_leaf, False, False)[0].view(torch.uint8).shape == q_int.shape  # the plain copy: its own entry
    assert len(calls) == 2


# ---------------------------------------------------------------- argument rules
def small(d=128, n=128, E=4, dtype=torch.bfloat16, glu=True):
    return (torch.randn(9, d).to(dtype), torch.randn(E, d).to(dtype), torch.randn(E, (2 if glu else 1) * n, d).to(dtype),
            torch.randn(E, d, n).to(dtype))


@pytest.mark.parametrize("kwargs,args,match", [
    ({"activation": "geglu"}, {}, "activation must be 'swiglu' or 'clamped_swiglu' with precision='fp8'"),
    ({"activation": "relu"}, {"glu": False}, "activation must be 'swiglu' or 'clamped_swiglu' with precision='fp8'"),
    ({}, {"dtype": torch.float32}, "x must be bfloat16 with precision='fp8'"),
    ({}, {"d": 136}, r"x.shape\[1\] \(d\) must be a multiple of 16 with precision='fp8'.*got 136"),
    ({}, {"n": 72}, r"w2.shape\[2\] \(n\) must be a multiple of 16 with precision='fp8'.*got 72"),
])
def test_functional_refuses_what_fp8_lacks(kwargs, args, match):
    x, wr, w1, w2 = small(**args)
    with pytest.raises(ValueError, match=match):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, backend="torch", precision="fp8", **kwargs)


def test_functional_fp8_argument_errors():
    x, wr, w1, w2 = small()
    with pytest.raises(ValueError, match="precision must be one of 'bf16', 'fp8'"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, precision="fp16")
    with pytest.raises(ValueError, match="fp8_cache is only used with precision='fp8'"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, fp8_cache=FP8WeightCache())
    with pytest.raises(TypeError, match="fp8_cache must be a machmoe.fp8_weights.FP8WeightCache"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, precision="fp8", fp8_cache={})
    # backend="machmoe" never falls back to the emulation
    with pytest.raises(ValueError, match="the machmoe backend runs on CUDA tensors"):
        functional.moe(x, wr, w1, w2, num_experts_per_tok=2, precision="fp8", backend="machmoe")
    # experts_topk with precision="fp8": the same rules, by name
    scores, idx = torch.rand(9, 2), torch.randint(0, 4, (9, 2))
    with pytest.raises(ValueError, match="fp8_cache is only used with precision='fp8'"):
        functional.experts_topk(x, w1, w2, scores, idx, fp8_cache=FP8WeightCache())
    with pytest.raises(ValueError, match="x must be bfloat16 with precision='fp8'"):
        functional.experts_topk(x.float(), w1.float(), w2.float(), scores, idx, precision="fp8")
    with pytest.raises(ValueError, match=r"w2.shape\[2\] \(n\) must be a multiple of 16"):
        functional.experts_topk(*small(n=72)[:1], small(n=72)[2], small(n=72)[3], scores, idx, precision="fp8")


@pytest.mark.parametrize("kwargs,match", [
    ({"activation_function": "geglu"}, "activation_function must be 'swiglu' or 'clamped_swiglu' with precision='fp8'"),
    ({"hidden_size": 136}, "hidden_size must be a multiple of 16 with precision='fp8'"),
    ({"intermediate_size": 72}, "intermediate_size must be a multiple of 16 with precision='fp8'"),
    ({"precision": "int8"}, "precision must be one of 'bf16', 'fp8'"),
])
def test_module_refuses_what_fp8_lacks(kwargs, match):
    args = {"num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 128, "intermediate_size": 128,
            "precision": "fp8", **kwargs}
    with pytest.raises(ValueError, match=match):
        MoE(**args)


def test_module_fp8_dtype_checked_per_call():
    layer = MoE(4, 2, 128, 128, precision="fp8")  # float32 parameters until cast
    with pytest.raises(ValueError, match="x must be bfloat16 with precision='fp8'"):
        layer(torch.randn(5, 128))
    out, _ = layer.bfloat16()(torch.randn(5, 128).bfloat16())
    assert out.dtype == torch.bfloat16


def test_module_fp8_with_expert_biases_is_the_functional_layer():
    # MoE(add_bias=True, precision="fp8", gpt-oss's layout and activation): the functional layer on
    # the module's parameters, output and the biases' gradients (non-zero biases: zeros at init).
    torch.manual_seed(3)
    layer = MoE(4, 2, 128, 64, add_bias=True, precision="fp8", activation_function="clamped_swiglu",
                glu_clamp=CLAMPS["gpt-oss"]).bfloat16()
    with torch.no_grad():
        layer.c_fc.bias.normal_(0, 0.5), layer.c_proj.bias.normal_(0, 0.3)
    x = torch.randn(9, 128).bfloat16()
    out, aux = layer(x)
    out.float().square().sum().backward()
    leaves = [p.detach().clone().requires_grad_() for p in (layer.c_fc.bias, layer.c_proj.bias)]
    want, _ = functional.moe(x, layer.router.weight, layer.c_fc.weight, layer.c_proj.weight, num_experts_per_tok=2,
                             b1=leaves[0], b2=leaves[1], activation="clamped_swiglu", glu_clamp=CLAMPS["gpt-oss"],
                             backend="torch", precision="fp8")
    want.float().square().sum().backward()
    assert torch.equal(out, want)
    assert torch.equal(layer.c_fc.bias.grad, leaves[0].grad) and torch.equal(layer.c_proj.bias.grad, leaves[1].grad)
    assert layer.c_fc.bias.grad.any() and layer.c_proj.bias.grad.any()


# ---------------------------------------------------------------- the module's cache
def counting_cache():
    calls = []

    def quantize(w, transposed):
        calls.append(tuple(w.shape))
        return emu.quantize_weights(w, transposed)

    return FP8WeightCache(quantize), calls


# AdamW(fused=True) writes the parameters without moving their version counters: the cache must
# see its steps all the same (machmoe.fp8_weights).
@pytest.mark.parametrize("optimizer", [
    lambda p: torch.optim.SGD(p, lr=1.0),
    lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
    lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
], ids=["sgd", "adamw_fused", "adamw_foreach"])
def test_module_requantises_after_an_optimizer_step_only(optimizer):
    torch.manual_seed(torch.initial_seed())
    layer = MoE(4, 2, 128, 128, precision="fp8", std=0.05).bfloat16()
    layer.fp8_cache, calls = counting_cache()
    x = torch.randn(21, 128).bfloat16()
    opt = optimizer(layer.parameters())

    def step():
        out, aux = layer(x)
        (out.float().square().sum() + aux).backward()
        return out.detach()

    first = step()
    assert len(calls) == 2  # w1 and w2, once each for the forward and the backward
    assert torch.equal(step(), first) and len(calls) == 2  # unchanged weights: the copies reused
    opt.step()
    opt.zero_grad()
    after = step()
    assert len(calls) == 4, "the step's new weights were not quantised again"
    # The new weights' result, not the old copies': a fresh module (an empty cache) agrees bitwise.
    fresh = copy.deepcopy(layer)  # its cache starts empty (and shares the counting quantiser)
    assert len(fresh.fp8_cache) == 0
    assert torch.equal(fresh(x)[0], after) and rel(after, first) > 0.05
    assert len(calls) == 6
    with torch.no_grad():  # inference reuses the copies too
        assert torch.equal(layer(x)[0], after) and len(calls) == 6


def test_cache_serves_the_plain_copy_from_the_transposed_quantisation():
    # The kernels' path asks for the transposed copies first when a backward will follow, so that
    # each weight is quantised once per change; a later plain request is served from them.
    cache, calls = counting_cache()
    w = torch.randn(2, 128, 256).bfloat16()
    q, s, qt, st = cache.get(w, True)
    assert qt is not None and cache.get(w, False)[0] is q and len(calls) == 1
    plain, _ = counting_cache()
    assert plain.get(w, False)[2] is None  # a plain request alone makes no transposed copy


def test_functional_default_cache_follows_in_place_writes():
    x, wr, w1, w2 = small()
    w1, w2 = w1 / 11, w2 / 11
    first, _ = functional.moe(x, wr, w1, w2, num_experts_per_tok=2, precision="fp8")
    with torch.no_grad():
        w2.mul_(2)  # bumps the version counter: the copy is remade
    second, _ = functional.moe(x, wr, w1, w2, num_experts_per_tok=2, precision="fp8")
    fresh, _ = functional.moe(x, wr, w1, w2.clone(), num_experts_per_tok=2, precision="fp8")
    assert torch.equal(second, fresh) and not torch.equal(second, first)


def test_module_shared_experts_run_in_bf16_beside():
    from machmoe.shared_experts import shared_experts

    layer = MoE(4, 2, 128, 128, precision="fp8", num_shared_experts=1, shared_intermediate_size=64).bfloat16()
    x = torch.randn(13, 128).bfloat16()
    out, _ = layer(x)
    routed, _ = functional.moe(x, layer.router.weight, layer.c_fc.weight, layer.c_proj.weight, num_experts_per_tok=2,
                               precision="fp8", fp8_cache=layer.fp8_cache)
    shared = shared_experts(x, layer.shared_c_fc.weight, layer.shared_c_proj.weight, backend="torch")
    assert torch.equal(out, routed + shared)


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fp8_module_follows_optimizer_steps(backend):
    # The weight cache runs between the compiled graphs (it graph-breaks), so a compiled module
    # still quantises each step's weights; aot_eager runs the same ATen ops (bitwise), inductor
    # fuses the emulation's arithmetic (its float8 selects work on the codes' bytes), within FP8's
    # rounding of eager.
    torch.manual_seed(torch.initial_seed())
    layer = MoE(8, 2, 128, 128, precision="fp8", backend="torch", std=0.05).bfloat16()
    x = torch.randn(33, 128).bfloat16()
    opt = torch.optim.AdamW(layer.parameters(), lr=0.05, fused=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend)
    for _ in range(2 if backend == "aot_eager" else 1):  # the second call after a fused AdamW step
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, aux = compiled(xc)
        want, want_aux = layer(xe)
        (out.float().square().mean() + aux).backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        opt.zero_grad()
        (want.float().square().mean() + want_aux).backward()
        if backend == "aot_eager":
            assert torch.equal(out, want) and torch.equal(xc.grad, xe.grad)
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, layer.parameters()))
        else:
            assert rel(out, want) < 0.01 and rel(xc.grad, xe.grad) < 0.02
            assert all(rel(g, p.grad) < 0.02 for g, p in zip(grads, layer.parameters()))
        opt.step()
        opt.zero_grad()


def test_experts_topk_fp8_is_the_emulation_on_the_list():
    # functional.experts_topk(precision="fp8") on the torch backend: the emulation on the T·K
    # pairs with those of experts outside [0, E) dropped, bitwise; gradients for x, the weights,
    # the biases and the scores (the dropped pairs' zero).
    torch.manual_seed(7)
    T, d, n, E, K = 30, 128, 64, 4, 2
    x, w1, w2 = (torch.randn(T, d) * 1.0).bfloat16(), (torch.randn(E, 2 * n, d) * 0.1).bfloat16(), \
        (torch.randn(E, d, n) * 0.1).bfloat16()
    b1, b2 = (torch.randn(E, 2 * n) * 0.3).bfloat16(), (torch.randn(E, d) * 0.1).bfloat16()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    idx[::5, 0] = E  # another rank's expert
    scores = torch.rand(T, K)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, b1, b2, scores)]
        out = fn(*leaves)
        return [out] + list(torch.autograd.grad(out.float().square().sum(), leaves))

    cache = FP8WeightCache(emu.quantize_weights)
    got = run(lambda x, w1, w2, b1, b2, s: functional.experts_topk(x, w1, w2, s, idx, b1=b1, b2=b2, backend="torch",
                                                                   precision="fp8", fp8_cache=cache))
    keep = (idx < E).reshape(-1)
    token = torch.arange(T).repeat_interleave(K)[keep]

    def emulated(x, w1, w2, b1, b2, s):
        return emu.experts_on_list(x, w1, w2, token, idx.reshape(-1)[keep], s.reshape(-1)[keep], cache, False,
                                   None, b1, b2)

    want = run(emulated)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not got[-1][::5, 0].any()  # the dropped pairs' score gradient
