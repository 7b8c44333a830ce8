"""Tests of the benchmark (python/machmoe/bench): its configs and formulas, the grouped_mm reference
layer, the report (table, JSON, PNG from made-up results) and the command line. All but the
`gpu` tests run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from machmoe.bench import configs as C
from machmoe.bench import grouped_mm_layer as G
from machmoe.bench import report

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- configs and formulas

def test_config_table_matches_the_published_shapes():
    # The SonicMoE paper's benchmark shapes and H100 TFLOPS, copied by hand: name, T, d, n, E, K,
    # SonicMoE fwd, bwd.
    spec = [
        ("1.4B-a", 40960, 768, 256, 128, 8, 340, 365),
        ("1.4B-c", 40960, 768, 1024, 32, 2, 405, 437),
        ("7B-a", 24576, 1536, 256, 128, 8, 365, 405),
        ("7B-b", 24576, 1536, 512, 64, 4, 433, 440),
        ("7B-c", 24576, 1536, 1024, 32, 2, 467, 468),
        ("30B-a", 32768, 4096, 256, 256, 16, 428, 460),
        ("30B-b", 32768, 4096, 512, 128, 8, 502, 510),
        ("30B-c", 32768, 4096, 1024, 64, 4, 552, 555),
        ("120B-a", 32768, 4096, 512, 256, 16, 518, 525),
        ("120B-b", 32768, 4096, 1024, 128, 8, 560, 567),
        ("120B-c", 32768, 4096, 2048, 64, 4, 597, 585),
        ("DeepSeek-V3", 32768, 7168, 2048, 256, 8, 535, 480),
    ]
    assert len(C.CONFIGS) == 12
    got = [(c.name, c.T, c.d, c.n, c.E, c.K, c.sonic_fwd, c.sonic_bwd) for c in C.CONFIGS]
    assert got == spec
    # Within a family the FLOPs are equal (granularity changes, FLOPs do not).
    for family in ("1.4B", "7B", "30B", "120B"):
        flops = {C.layer_flops(c.T, c.K, c.n, c.d) for c in C.CONFIGS if c.name.startswith(family + "-")}
        assert len(flops) == 1, family


def test_layer_flops_convention():
    T, K, n, d = 24576, 8, 256, 1536
    fwd, bwd = C.layer_flops(T, K, n, d)
    assert fwd == 6 * T * K * n * d
    assert bwd == 12 * T * K * n * d
    fwd, bwd = C.layer_flops(T, K, n, d, glu=False)
    assert (fwd, bwd) == (4 * T * K * n * d, 8 * T * K * n * d)
    # 1 TFLOP in 1 ms is 1000 TFLOPS; missing or zero times give None.
    assert C.tflops(1e12, 1.0) == pytest.approx(1000.0)
    assert C.tflops(1e12, None) is None and C.tflops(1e12, 0.0) is None


def test_activation_memory_formula():
    T, d, K, n = 24576, 1536, 8, 256
    assert C.activation_bytes_formula(T, d, K, n) == 2 * T * d + 4 * T * K * n
    assert C.activation_bytes_formula(T, d, K, n, glu=False) == 2 * T * d + 2 * T * K * n
    # x and H of 7B-a: 0.26 GiB.
    assert C.activation_bytes_formula(T, d, K, n) / C.GIB == pytest.approx(0.26, abs=0.005)


def test_select_configs_and_t_scale():
    chosen = C.select_configs("7B-a, 30B-b")
    assert [c.name for c in chosen] == ["7B-a", "30B-b"]
    assert [c.name for c in C.select_configs(None)] == [c.name for c in C.CONFIGS]
    assert C.select_configs("deepseek-v3")[0].name == "DeepSeek-V3"
    scaled = C.select_configs("7B-a", t_scale=0.25)[0]
    assert scaled.T == 6144 and scaled.d == 1536
    assert C.select_configs("7B-a", t_scale=1e-6)[0].T == 64  # at least 64, multiple of 64
    with pytest.raises(ValueError, match="unknown config"):
        C.select_configs("7B-z")


# ---------------------------------------------------------------- the grouped_mm baseline layer

def _inputs(T=40, d=16, n=8, E=5, K=2, dtype=torch.float64):
    """Fresh random inputs from torch's global generator (conftest seeds it per test)."""
    x = torch.randn(T, d, dtype=dtype)
    wr = torch.randn(E, d, dtype=dtype) * 0.3
    w1 = torch.randn(E, 2 * n, d, dtype=dtype) * 0.3
    w2 = torch.randn(E, d, n, dtype=dtype) * 0.3
    dout = torch.randn(T, d, dtype=dtype)
    return x, wr, w1, w2, dout


def _forward_backward(fn, x, wr, w1, w2, dout, K):
    leaves = [t.clone().requires_grad_(True) for t in (x, wr, w1, w2)]
    out, aux = fn(*leaves, K)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), (aux.detach() if aux is not None else None), grads


def _naive_layer(x, wr, w1, w2, K):
    """Token-by-token float64 version of docs/LAYER.md's default layer (swiglu, interleaved)."""
    logits = x @ wr.t()
    out = []
    for t in range(x.shape[0]):
        top, idx = torch.topk(logits[t], K)
        s = torch.softmax(top, dim=0)
        acc = torch.zeros_like(x[t])
        for k in range(K):
            h = w1[idx[k]] @ x[t]  # [2n]
            a = torch.nn.functional.silu(h[0::2]) * h[1::2]
            acc = acc + s[k] * (w2[idx[k]] @ a)
        out.append(acc)
    return torch.stack(out), None


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_grouped_mm_layer_cpu_loop_matches_naive_layer():
    x, wr, w1, w2, dout = _inputs()
    K = 2
    out, _, grads = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="loop"), x, wr, w1, w2, dout, K)
    ref_out, _, ref_grads = _forward_backward(_naive_layer, x, wr, w1, w2, dout, K)
    assert _rel(out, ref_out) < 1e-12
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 1e-12


def test_grouped_mm_layer_auto_is_loop_on_cpu_and_rejects_bad_shapes():
    assert G.resolve_impl("auto", torch.device("cpu")) == "loop"
    assert G.resolve_impl("auto", torch.device("cuda", 0)) == "grouped_mm"
    x, wr, w1, w2, _ = _inputs()
    with pytest.raises(ValueError, match="shape mismatch"):
        G.grouped_mm_moe(x, wr, w1[:, :-1], w2, 2)
    with pytest.raises(ValueError, match="impl"):
        G.grouped_mm_moe(x, wr, w1, w2, 2, impl="cutlass")


def test_expert_offsets_with_empty_experts():
    sorted_experts = torch.tensor([0, 0, 2, 2, 2, 4])
    offs = G.expert_offsets(sorted_experts, 6)
    assert offs.dtype == torch.int32
    assert offs.tolist() == [2, 2, 5, 5, 6, 6]
    # The loop handles empty groups and gives their weights zero gradient.
    a = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    y = G.grouped_matmul(a, b, offs, "loop")
    ref = torch.cat([a[0:2] @ b[0], a[2:5] @ b[2], a[5:6] @ b[4]])
    assert torch.equal(y, ref)
    (gb,) = torch.autograd.grad(y.sum(), [b])
    assert gb[1].abs().sum() == 0 and gb[3].abs().sum() == 0 and gb[5].abs().sum() == 0


def test_grouped_mm_op_matches_loop_on_cpu_if_supported():
    """torch 2.11 also implements _grouped_mm on the CPU; when it does, both paths must agree."""
    x, wr, w1, w2, dout = _inputs(dtype=torch.float32, d=16, n=8)
    K = 2
    try:
        got = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="grouped_mm"), x, wr, w1, w2, dout, K)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._grouped_mm has no CPU path here: {err}")
    ref = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="loop"), x, wr, w1, w2, dout, K)
    assert _rel(got[0], ref[0]) < 1e-5
    for g, r in zip(got[2], ref[2]):
        assert _rel(g, r) < 1e-5


def test_grouped_mm_layer_matches_torch_backend():
    torch_backend = pytest.importorskip("machmoe.torch_backend")
    x, wr, w1, w2, dout = _inputs(T=64, d=32, n=16, E=6, K=3)
    K = 3

    def backend(x, wr, w1, w2, K):
        return torch_backend.moe(x, wr, w1, None, w2, None, K, "swiglu", "interleaved",
                                 "softmax_topk", False, None, "none", 128, 0)

    out, aux, grads = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="loop"), x, wr, w1, w2, dout, K)
    ref_out, ref_aux, ref_grads = _forward_backward(backend, x, wr, w1, w2, dout, K)
    assert _rel(out, ref_out) < 1e-12
    assert float((aux - ref_aux).abs()) < 1e-12 * max(1.0, float(ref_aux.abs()))
    for name, g, r in zip(("dx", "dWr", "dW1", "dW2"), grads, ref_grads):
        assert _rel(g, r) < 1e-12, name


@pytest.mark.ops
def test_grouped_mm_layer_matches_cpp_reference():
    x, wr, w1, w2, dout = _inputs(T=50, d=24, n=8, E=7, K=3)
    K = 3
    r = torch.ops.machmoe.reference_layer(x, wr, w1, None, w2, None, None, dout, 0.0, K, "swiglu",
                                          "interleaved", "softmax_topk", False, "none", 128, 0)
    out, aux, grads = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="loop"), x, wr, w1, w2, dout, K)
    assert _rel(out, r[0]) < 1e-12
    assert abs(float(aux) - float(r[1])) < 1e-12
    for g, idx in zip(grads, (5, 6, 7, 9)):  # dx, d_router_weight, dw1, dw2
        assert _rel(g, r[idx]) < 1e-12


# ---------------------------------------------------------------- report and command line

def _fake_row(machmoe_status="not built (kernels missing)"):
    cfg = C.CONFIGS_BY_NAME["7B-a"]
    ok = {"status": "ok", "fwd_tflops": 85.0, "bwd_tflops": 169.0, "held_gib": 2.06}
    row = {
        "config": {"name": cfg.name, "T": cfg.T, "d": cfg.d, "n": cfg.n, "E": cfg.E, "K": cfg.K},
        "sonicmoe": {"fwd_tflops": cfg.sonic_fwd, "bwd_tflops": cfg.sonic_bwd},
        "formula_gib": 0.258,
        "grouped_mm": dict(ok),
        "dense": {"status": "ok", "fwd_tflops": 600.0, "bwd_tflops": 620.0},
        "machmoe": {"status": machmoe_status},
    }
    row["ratios"] = report.derived_ratios(row)
    return row


def test_report_marks_unbuilt_machmoe_without_numbers():
    header = {"gpu": "fake", "commit": "abc", "date_utc": "now", "torch": "x", "cuda": "y"}
    text = report.markdown(header, {"matmul_tflops": 750.0, "copy_gbps": 3000.0}, [_fake_row()])
    line = [ln for ln in text.splitlines() if ln.startswith("| 7B-a")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # machmoe, its GiB, the bound (a number, or "—" when the row has none), both ratios, errors
    assert cells[11:13] == ["not built"] * 2 and cells[14:] == ["not built"] * 3
    assert "85 / 169" in line and "600 / 620" in line and "365 / 405" in line
    oom = report.markdown(header, {}, [_fake_row("OOM")])
    assert "OOM" in oom


def test_timing_protocol_is_named_in_the_report():
    from machmoe.bench import timing

    assert timing.protocol() in timing.PROTOCOLS
    before = timing.protocol()
    try:
        timing.set_protocol("flush")
        assert "256 MB zeroed" in report.run_header()["timing"]
        timing.set_protocol("sonic")
        assert "256 MB zeroed" in report.run_header()["timing"] and "idle" in report.run_header()["timing"]
        timing.set_protocol("rotate")
        header = report.run_header()
        assert "back to back" in header["timing"]
        text = report.markdown(header, {"matmul_tflops": 750.0, "copy_gbps": 3000.0}, [_fake_row()])
        assert f"Timing (every figure of this run): {header['timing']}." in text
        with pytest.raises(ValueError, match="rotate"):
            timing.set_protocol("do_bench")
    finally:
        timing.set_protocol(before)


@pytest.mark.parametrize("name", ["flush", "sonic"])
def test_timing_flush_protocols_on_gpu(name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from machmoe.bench import timing

    before = timing.protocol()
    try:
        timing.set_protocol(name)
        x = torch.randn(1 << 20, device="cuda")
        t = timing.cuda_time(lambda: x.mul(2.0), [()], min_reps=20, target_s=0.05)
        assert t.reps >= 20 and 0 < t.median_ms < 5
    finally:
        timing.set_protocol(before)


def test_report_names_a_failed_backward():
    # The backward ran and failed: the forward's numbers stay, the cells say "bwd error" (not "not
    # built") and the problem is listed under the table.
    header = {"gpu": "fake", "commit": "abc", "date_utc": "now", "torch": "x", "cuda": "y"}
    row = _fake_row()
    row["machmoe"] = {"status": "ok", "fwd_tflops": 170.0, "held_gib": 0.3, "err_out": 1e-3,
                      "backward": "error: RuntimeError: layer_backward: boom"}
    row["ratios"] = report.derived_ratios(row)
    text = report.markdown(header, {}, [row])
    line = [ln for ln in text.splitlines() if ln.startswith("| 7B-a")][0]
    assert "bwd error" in line and "not built" not in line
    assert "machmoe backward error: RuntimeError: layer_backward: boom" in text
    row["machmoe"]["backward"] = "not built (no backward kernels)"
    line = [ln for ln in report.markdown(header, {}, [row]).splitlines() if ln.startswith("| 7B-a")][0]
    assert "bwd not built" in line


def test_report_ratios_when_machmoe_runs():
    row = _fake_row()
    row["machmoe"] = {"status": "ok", "fwd_tflops": 170.0, "bwd_tflops": 338.0, "held_gib": 0.3,
                      "err_out": 1e-3, "err_dx": 2e-3}
    r = report.derived_ratios(row)
    assert r["fwd_vs_grouped_mm"] == pytest.approx(2.0)
    assert r["bwd_vs_grouped_mm"] == pytest.approx(2.0)
    assert r["fwd_vs_dense"] == pytest.approx(170 / 600)


def test_list_option(capsys):
    from machmoe.bench.run import main

    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    assert all(c.name in text for c in C.CONFIGS)


def _bench_cli(*args, timeout=180):
    """python -m machmoe.bench ARGS in a child process, as on a machine without a GPU."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    env.pop("MACHMOE_REQUIRE_GPU", None)  # (scripts/test.sh sets it on the GPU machine)
    env["PYTHONPATH"] = str(ROOT / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "machmoe.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_module_without_gpu_runs_cpu_demo_and_writes_to_out(tmp_path):
    out = tmp_path / "new" / "dir"  # created by the demo
    proc = _bench_cli("--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No CUDA GPU found: running a small CPU demo of the layer instead" in proc.stdout
    assert "worst relative error" in proc.stdout
    text = (out / "cpu_demo.md").read_text()
    assert "worst relative error" in text and "CPU demo: MoE layer" in text
    data = json.loads((out / "cpu_demo.json").read_text())
    assert data["verdict"] == "OK" and data["worst"] < 1e-4
    assert set(data["relative_errors"]["torch backend"]) >= {"out", "dx", "dw1", "dw2"}


def test_help_answers_without_importing_torch():
    """--help is argparse's answer, printed before torch (seconds to import) is loaded."""
    code = ("import sys; from machmoe.bench.run import parse_args\n"
            "try:\n    parse_args(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage: python -m machmoe.bench" in proc.stdout and "--out DIR" in proc.stdout
    proc = _bench_cli("--help", timeout=60)
    assert proc.returncode == 0 and "--configs" in proc.stdout


def test_unknown_config_is_an_error_naming_the_valid_ones():
    proc = _bench_cli("--configs", "nonsense", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown config 'nonsense'" in proc.stderr
    assert all(c.name in proc.stderr for c in C.CONFIGS)
    assert "CPU demo" not in proc.stdout  # refused before anything runs
    from machmoe.bench.run import TIMING_PROTOCOLS, parse_args
    from machmoe.bench.timing import PROTOCOLS

    assert TIMING_PROTOCOLS == PROTOCOLS
    with pytest.raises(SystemExit) as exc:
        parse_args(["--configs", "7B-a,7B-q"])
    assert exc.value.code == 2
    assert [c.name for c in parse_args(["--configs", "7b-a, 30B-b"]).config_list] == ["7B-a", "30B-b"]


def test_fp8_bench_rows_option_is_checked_before_anything_runs(capsys):
    from machmoe.bench import fp8_gemm

    for bad in ("bogus", "layer,gemms", ""):
        with pytest.raises(SystemExit) as exc:
            fp8_gemm.main(["--rows", bad])
        assert exc.value.code == 2
        assert "--rows takes a comma-separated subset of gemm,forward,layer" in capsys.readouterr().err


def _ok_row(name, machmoe_fwd, machmoe_bwd, held):
    row = _fake_row()
    cfg = C.CONFIGS_BY_NAME[name]
    row["config"] = {"name": cfg.name, "T": cfg.T, "d": cfg.d, "n": cfg.n, "E": cfg.E, "K": cfg.K}
    row["bound_gib"] = C.held_bound_less_x_bytes(cfg) / C.GIB
    row["machmoe"] = {"status": "ok", "fwd_tflops": machmoe_fwd, "bwd_tflops": machmoe_bwd,
                      "held_gib": held, "err_out": 1e-3, "err_dx": 2e-3}
    row["ratios"] = report.derived_ratios(row)
    return row


def test_outputs_include_a_chart_of_made_up_results(tmp_path):
    """write_outputs on made-up rows: bench.md, bench.json and bench.png (TFLOPS forward and
    backward beside both references, memory beside the bound); a config whose machmoe figures are
    missing still draws."""
    pytest.importorskip("matplotlib")
    header = {"gpu": "fake H100", "commit": "abc", "date_utc": "now", "torch": "x", "cuda": "y",
              "timing": "rotate"}
    rows = [_ok_row("7B-a", 370.0, 410.0, 0.4), _ok_row("30B-b", 480.0, 500.0, 1.1), _fake_row("OOM")]
    paths = report.write_outputs(str(tmp_path), header, {"matmul_tflops": 750.0}, rows, {"configs": "x"})
    assert [os.path.basename(p) for p in paths] == ["bench.json", "bench.md", "bench.png"]
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert json.loads((tmp_path / "bench.json").read_text())["configs"][0]["machmoe"]["fwd_tflops"] == 370.0
    assert "| 30B-b |" in (tmp_path / "bench.md").read_text()


def test_outputs_without_matplotlib_say_so_once(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    header = {"gpu": "fake", "commit": "abc", "date_utc": "now", "torch": "x", "cuda": "y"}
    paths = report.write_outputs(str(tmp_path), header, {}, [_fake_row()], {})
    assert [os.path.basename(p) for p in paths] == ["bench.json", "bench.md"]
    said = capsys.readouterr().out
    assert said.count("matplotlib is not installed") == 1 and not (tmp_path / "bench.png").exists()


def test_expert_parallel_bench_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would run (python -m machmoe.bench.expert_parallel)")
    from machmoe.bench import expert_parallel

    expert_parallel.main(["--configs", "7B-a", "--out", "unused"])
    assert "no CUDA GPU; nothing to measure" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # a bad config is refused first, GPU or not
        expert_parallel.main(["--configs", "7B-z"])
    assert exc.value.code == 2 and "unknown config '7B-z'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # FP8 with another exchange than the all-gather
        expert_parallel.main(["--configs", "7B-a", "--precision", "fp8"])
    assert exc.value.code == 2 and "--precision fp8 runs with --exchange all_gather only" in capsys.readouterr().err
    expert_parallel.main(["--configs", "7B-a", "--precision", "fp8", "--exchange", "all_gather"])
    assert "no CUDA GPU; nothing to measure" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # a graph cannot hold the exact all-to-all's host sync
        expert_parallel.main(["--configs", "7B-a", "--graph", "--exchange", "all_gather,all_to_all"])
    assert exc.value.code == 2 and "--graph needs exchanges without a host sync" in capsys.readouterr().err


def test_variants_bench_refuses_bad_configs_and_tabulates(capsys):
    from machmoe.bench import variants

    with pytest.raises(SystemExit) as exc:  # a bad config is refused first, GPU or not
        variants.main(["--configs", "7B-z"])
    assert exc.value.code == 2 and "unknown config '7B-z'" in capsys.readouterr().err
    rows = [{"config": "7B-a", "variant": "default", "share": 1.0, "fwd_ms": 2.0, "fwdbwd_ms": 6.0,
             "held_gib": 0.2, "fwd_ratio": 1.0, "fwdbwd_ratio": 1.0},
            {"config": "7B-a", "variant": "x", "share": 1.0, "status": "not in this build (y)"}]
    text = variants.table(rows)
    assert "| 7B-a | default | 2.000 | 6.000 | 1.000 | 1.000 | 1.000 | 0.20 |" in text
    assert "| 7B-a | x | not in this build (y) |" in text
    assert [v.share(8) for v in variants.VARIANTS if v.shared] == [1.125, 1.125]


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_grouped_mm_layer_gpu_bf16_matches_loop():
    """The baseline on the GPU (torch._grouped_mm) against its per-expert loop, both bf16.

    Same dtype and device on both sides, so the router logits and the chosen experts are
    identical; what differs is only the GEMM kernels' rounding (bf16 outputs, ~1e-3).
    """
    T, d, n, E, K = 512, 128, 64, 8, 2
    x, wr, w1, w2, dout = (t.cuda().bfloat16() for t in _inputs(T, d, n, E, K, dtype=torch.float32))
    got = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="grouped_mm"), x, wr, w1, w2, dout, K)
    ref = _forward_backward(lambda *a: G.grouped_mm_moe(*a, impl="loop"), x, wr, w1, w2, dout, K)
    assert torch.isfinite(got[0]).all()
    assert _rel(got[0].float(), ref[0].float()) < 1e-2
    for g, r in zip(got[2], ref[2]):
        assert _rel(g.float(), r.float()) < 2e-2


@pytest.mark.gpu
def test_bench_runs_tiny_config_on_gpu():
    from machmoe.bench.run import bench_config

    cfg = C.MoEConfig("tiny", 1024, 256, 128, 8, 2, 1.0, 1.0)
    row = bench_config(cfg, ["grouped_mm", "dense", "machmoe"], min_reps=20, seed=0)
    for k in ("grouped_mm", "dense"):
        assert row[k]["status"] == "ok", row[k]
        assert row[k]["fwd_tflops"] > 0 and row[k]["bwd_tflops"] > 0
    assert row["grouped_mm"]["held_bytes"] > 0
    assert row["machmoe"]["status"] == "ok" or row["machmoe"]["status"].startswith("not built")


def test_kernel_table_configs_from_the_environment(monkeypatch):
    """MACHMOE_KERNEL_CONFIGS names the benchmark configs of the kernel table (default 7B-a, 30B-b);
    an unknown name is refused with the known ones listed."""
    from machmoe.bench import gemm_kernels as g

    monkeypatch.delenv("MACHMOE_KERNEL_CONFIGS", raising=False)
    assert g.table_configs() == g.TABLE_CONFIGS
    monkeypatch.setenv("MACHMOE_KERNEL_CONFIGS", "30B-a, 120B-c")
    assert g.table_configs() == (("30B-a", 32768, 4096, 256, 256, 16), ("120B-c", 32768, 4096, 2048, 64, 4))
    monkeypatch.setenv("MACHMOE_KERNEL_CONFIGS", "7B-z")
    with pytest.raises(ValueError, match="unknown config '7B-z'; known: 1.4B-a"):
        g.table_configs()


def test_kernel_table_rows_from_the_environment(monkeypatch):
    """MACHMOE_KERNEL_ROWS keeps the rows whose label holds one of its substrings; unset: all."""
    from machmoe.bench import gemm_kernels as g

    monkeypatch.delenv("MACHMOE_KERNEL_ROWS", raising=False)
    assert g.row_filter() == () and g.row_wanted("7B-a dH (gather dout·W2 + dSwiGLU, A', dS)", ())
    monkeypatch.setenv("MACHMOE_KERNEL_ROWS", "dense, down-proj,,dX~")
    keep = g.row_filter()
    assert keep == ("dense", "down-proj", "dX~")
    assert g.row_wanted("dense GEMM", keep) and g.row_wanted("30B-a dX~ (dH·W1, contiguous)", keep)
    assert not g.row_wanted("30B-a up-proj (gather + SwiGLU, H and A)", keep)
    assert g.row_filter("7B-a, dense") == ("7B-a", "dense")
