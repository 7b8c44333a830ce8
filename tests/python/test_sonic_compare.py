"""CPU tests of machmoe.bench.sonic_compare: reading SonicMoE's benchmark logs beside ours."""

import json
import random

import pytest

from machmoe.bench import sonic_compare as sc
from machmoe.bench.configs import CONFIGS_BY_NAME


def _log(fwd_ms, inf_ms, both_ms, cfg):
    """The four result lines moe-cute.py prints, with its own FLOP counts (18 / 6 / 12 · T·K·n·d)."""
    F = cfg.T * cfg.K * cfg.n * cfg.d
    bwd_ms = both_ms - fwd_ms
    tf = lambda mult, ms: mult * F / (ms * 1e9)  # noqa: E731
    return (f"T {cfg.T}, I {cfg.n}, H {cfg.d}, E {cfg.E}, K {cfg.K}\n"
            f" Cute-DSL Fwd Average time: {fwd_ms:.3f} ms, TFLOPS: {tf(6, fwd_ms):.1f}\n"
            f" Cute-DSL Fwd, inference mode, Average time: {inf_ms:.3f} ms, TFLOPS: {tf(6, inf_ms):.1f}\n"
            f" Cute-DSL Fwd + Bwd Average time: {both_ms:.3f} ms, TFLOPS: {tf(18, both_ms):.1f}\n"
            f" Cute-DSL Bwd Average time: {bwd_ms:.3f} ms, TFLOPS: {tf(12, bwd_ms):.1f}\nPASS\n")


def _consistent_times(cfg, rng):
    """Times that match the published figures within a few per cent (a self-consistent run)."""
    F = cfg.T * cfg.K * cfg.n * cfg.d
    fwd = 6 * F / (cfg.sonic_fwd * 1e9) * rng.uniform(0.97, 1.03)
    bwd = 12 * F / (cfg.sonic_bwd * 1e9) * rng.uniform(0.97, 1.03)
    return fwd, fwd * rng.uniform(0.9, 0.99), fwd + bwd


def test_parse_reads_all_four_lines():
    rng = random.Random()
    cfg = CONFIGS_BY_NAME["7B-a"]
    fwd, inf, both = _consistent_times(cfg, rng)
    s = sc.parse_sonic_log("noise before\n" + _log(fwd, inf, both, cfg))
    assert set(s) == {"fwd", "infer", "fwdbwd", "bwd"}
    assert abs(s["fwd"][0] - fwd) < 1e-3 and abs(s["infer"][0] - inf) < 1e-3
    assert abs(s["fwdbwd"][0] - both) < 1e-3 and abs(s["bwd"][0] - (both - fwd)) < 2e-3
    assert sc.parse_sonic_log("TypeError: something\nrc 1\n") == {}


def test_fwdbwd_tflops_is_the_flops_over_the_summed_times():
    rng = random.Random()
    for _ in range(20):
        f, b = rng.uniform(100, 800), rng.uniform(100, 800)
        F = rng.uniform(1e12, 1e14)
        t = 6 * F / (f * 1e12) + 12 * F / (b * 1e12)
        assert abs(sc.fwdbwd_tflops(f, b) - 18 * F / t / 1e12) < 1e-9 * f
    assert abs(sc.fwdbwd_tflops(400.0, 400.0) - 400.0) < 1e-9


def test_forward_doubts_flag_what_cannot_be_a_forward():
    rng = random.Random()
    cfg = CONFIGS_BY_NAME["30B-b"]
    fwd, inf, both = _consistent_times(cfg, rng)
    assert sc.forward_doubts(sc.parse_sonic_log(_log(fwd, inf, both, cfg)), cfg) == []
    slower = sc.forward_doubts(sc.parse_sonic_log(_log(fwd, fwd * 1.10, both, cfg)), cfg)
    assert len(slower) == 1 and "slower" in slower[0]
    apart = sc.forward_doubts(sc.parse_sonic_log(_log(fwd, fwd * 0.6, both, cfg)), cfg)
    assert len(apart) == 1 and "differ" in apart[0]
    low = sc.forward_doubts(sc.parse_sonic_log(_log(fwd * 1.5, fwd * 1.45, both, cfg)), cfg)
    assert len(low) == 1 and "published" in low[0]
    assert sc.forward_doubts({}, cfg) == ["forward not timed"]


def test_table_gives_split_ratios_only_for_a_consistent_forward(tmp_path, capsys):
    rng = random.Random()
    good, bad = CONFIGS_BY_NAME["120B-b"], CONFIGS_BY_NAME["7B-c"]
    fwd, inf, both = _consistent_times(good, rng)
    logs = {good.name: _log(fwd, inf, both, good)}
    bf, _, bboth = _consistent_times(bad, rng)
    logs[bad.name] = _log(bf * 1.6, bf * 1.0, bboth * 1.1, bad)
    ours = {good.name: {"fwd_tflops": rng.uniform(400, 600), "bwd_tflops": rng.uniform(400, 600)},
            bad.name: {"fwd_tflops": rng.uniform(400, 600), "bwd_tflops": rng.uniform(400, 600)}}
    text = sc.table([good.name, bad.name, "30B-c"], logs, ours)
    lines = text.splitlines()
    assert len(lines) == 5
    row_good = lines[2].split("|")
    s = sc.parse_sonic_log(logs[good.name])
    want = ours[good.name]["fwd_tflops"] / s["fwd"][1]
    assert f"{want:.3f}" in row_good[5] and "consistent" in row_good[6]
    row_bad = lines[3].split("|")
    assert "(—)" in row_bad[5] and "consistent" not in row_bad[6]
    both_ratio = sc.fwdbwd_tflops(ours[bad.name]["fwd_tflops"], ours[bad.name]["bwd_tflops"]) / \
        sc.parse_sonic_log(logs[bad.name])["fwdbwd"][1]
    assert f"{both_ratio:.3f}" in row_bad[5]
    assert "not run" in lines[4]

    # main(): the files the script leaves under OUT
    (tmp_path / "ours").mkdir()
    for name, text_ in logs.items():
        (tmp_path / f"sonic_{name}.log").write_text(text_)
    bench = {"configs": [{"config": {"name": n}, "machmoe": v} for n, v in ours.items()]}
    (tmp_path / "ours" / "bench.json").write_text(json.dumps(bench))
    assert sc.main([str(tmp_path), f"{good.name},{bad.name}"]) == 0
    assert f"{want:.3f}" in capsys.readouterr().out
    assert sc.main([str(tmp_path), "nope"]) == 2
    assert sc.main([str(tmp_path)]) == 2


def test_profile_sonicmoe_without_sonicmoe_says_where_to_get_it(monkeypatch):
    import builtins

    from machmoe.bench import profile

    real_import = builtins.__import__

    def no_sonicmoe(name, *args, **kwargs):
        if name.startswith("sonicmoe"):
            raise ImportError("No module named 'sonicmoe'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sonicmoe)
    with pytest.raises(SystemExit, match="sonicmoe_prepare.sh"):
        profile.sonicmoe_call(None)


def _ncu_csv(times_us):
    """A file shaped like `ncu --page raw --csv`: program output, header, units, one row per kernel."""
    head = ['"ID"', '"Kernel Name"', '"gpu__time_duration.sum"', '"dram__bytes_read.sum"',
            '"lts__t_sector_hit_rate.pct"', '"launch__grid_size"',
            '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"',
            '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"']
    # the units ncu 2025.x writes (seen on the H100 machine): "us", "Mbyte", "inst"
    units = ['""', '""', '"us"', '"Mbyte"', '"%"', '""', '"inst"', '"inst"']
    rows = [",".join(f'"{v}"' for v in (i, f"kernel_{i}", t, "1,234.5", 71.5, 132, 2.5, 0.5))
            for i, t in enumerate(times_us)]
    return "\n".join(["some program output", ",".join(head), ",".join(units), *rows]) + "\n"


def test_ncu_compare_reads_raw_csv_and_prints_one_row_per_kernel_and_layer(tmp_path):
    from machmoe.bench import ncu_compare
    from machmoe.bench.configs import CONFIGS_BY_NAME

    recs = ncu_compare.read_raw_csv(_ncu_csv([500.0, 300.0]))
    assert len(recs) == 2
    assert recs[0]["Kernel Name"] == "kernel_0"
    assert abs(recs[0]["gpu__time_duration.sum"] - 500e-6) < 1e-12
    assert abs(recs[1]["dram__bytes_read.sum"] - 1234.5e6) < 1e-3  # thousands separator, Mbyte
    assert ncu_compare.stalls(recs[0]) == "long_scoreboard 2.5, barrier 0.5"
    # a number under a unit the table does not know is kept as text (printed "—"), never scaled wrongly
    odd = _ncu_csv([500.0]).replace('"us"', '"furlong"')
    assert ncu_compare.read_raw_csv(odd)[0]["gpu__time_duration.sum"] == "500.0"
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_compare.read_raw_csv("no header here\n")

    (tmp_path / "s.csv").write_text(_ncu_csv([500.0, 300.0, 400.0, 300.0, 500.0, 500.0]))
    (tmp_path / "m.csv").write_text(_ncu_csv([600.0]))
    cfg = CONFIGS_BY_NAME["7B-a"]
    text = ncu_compare.table("7B-a", {"sonicmoe": ncu_compare.read_raw_csv((tmp_path / "s.csv").read_text()),
                                      "machmoe": ncu_compare.read_raw_csv((tmp_path / "m.csv").read_text())})
    rows = [line for line in text.splitlines() if line.startswith("| up-proj")]
    assert len(rows) == 2
    # up-projection: 2 · (2·T·K·n·d) FLOPs in 500 µs
    want = 2 * 2.0 * cfg.T * cfg.K * cfg.n * cfg.d / 500e-6 / 1e12
    assert f"| {want:.0f} |" in rows[0]
    assert rows[0].count("|") == rows[1].count("|") == text.splitlines()[2].count("|")  # columns line up
    assert "| dX~ | machmoe | (not profiled)" in text


def _profile_section(impl, config, rows, kernels_ms, wall_ms, gaps):
    """One section as scripts/sonicmoe_compare.sh writes it (python -m machmoe.bench.profile --gaps)."""
    body = [f"######## profile {impl} {config}",
            f"== {config} {impl} memory: 0.2 GiB held between forward and backward",
            f"== {config} T=24576 {impl} forward+backward, per call over 5: kernels {kernels_ms} ms -> 400 TFLOPS "
            f"if launch gaps were zero; wall {wall_ms} ms -> 380 TFLOPS; gaps {gaps}% of the wall time",
            "  #        us  gap us  activity (one call, in order; mean of 5)"]
    body += [f"{i:>3} {us:>9.1f} {1.5:>7.1f}  {name}" for i, (us, name) in enumerate(rows)]
    body.append("    sum of gaps inside a call: 12.0 us; before the call: 1.8 us")
    return "\n".join(body) + "\n"


def test_profile_compare_maps_kernels_to_roles_by_name_and_order():
    from machmoe.bench import profile_compare as pc

    ours = [(35.0, "nvjet_router"), (26.0, "topk_router_sorted"), (650.0, "sm90_grouped_gemm<256, 1, true, false>"),
            (350.0, "sm90_grouped_gemm<256, 0, false, false>"), (241.0, "aggregate_rows_vec<bf16>"),
            (569.0, "sm90_grouped_gemm<256, 4, true, true>"), (367.0, "sm90_grouped_wgrad<256, false>"),
            (589.0, "sm90_grouped_wgrad<256, true>"), (592.0, "sm90_grouped_gemm<256, 0, false, true>"),
            (269.0, "aggregate_rows_router<true>")]
    sonic = [(38.0, "nvjet_router"), (560.0, "kernel_cutlass_HopperWgmma_up"), (320.0, "kernel_cutlass_HopperWgmma_down"),
             (230.0, "token_gather_sum_kernel"), (480.0, "kernel_cutlass_HopperWgmma_dh"),
             (280.0, "kernel_cutlass_HopperWgmma_dw2"), (520.0, "kernel_cutlass_HopperWgmma_dw1"),
             (500.0, "kernel_cutlass_HopperWgmma_dx"), (231.0, "token_gather_sum_kernel"), (75.0, "add")]
    text = ("program output\n" + _profile_section("sonicmoe", "7B-a", sonic, 3.254, 5.1, 32.9)
            + _profile_section("machmoe", "7B-a", ours, 3.688, 3.9, 3.7))
    profs = pc.parse(text)
    assert [(p.impl, p.phase, len(p.rows)) for p in profs] == [("sonicmoe", "fwdbwd", 10), ("machmoe", "fwdbwd", 10)]
    roles = pc.by_role(profs[1])
    assert roles["up-proj"] == 650.0 and roles["dW2"] == 367.0 and roles["dX~"] == 592.0
    assert roles["aggregation (forward)"] == 241.0 and roles["dx aggregation"] == 269.0
    assert roles["other"] == 35.0 + 26.0
    sonic_roles = pc.by_role(profs[0])
    assert sonic_roles["dH"] == 480.0 and sonic_roles["other"] == 38.0 + 75.0
    out = pc.table(profs)
    assert "| dW2 | 280.0 | 367.0 | 1.311 |" in out
    assert "| launch gaps, % of the wall | 32.9% | 3.7% | |" in out
    # a seventh expert GEMM means a name pattern matches more than the six GEMMs: refuse, do not mislabel
    extra = _profile_section("machmoe", "7B-a", ours + [(10.0, "sm90_grouped_gemm<128, 0, false, false>")], 3.7, 3.9, 3.7)
    with pytest.raises(ValueError, match="more expert GEMMs"):
        pc.by_role(pc.parse(extra)[0])
    assert "sonicmoe not profiled" in pc.table(pc.parse(_profile_section("machmoe", "30B-b", ours, 19.6, 19.8, 0.8)))


def test_ncu_compare_launches_prints_every_launch_of_every_file(tmp_path, capsys):
    from machmoe.bench import ncu_compare

    (tmp_path / "a.csv").write_text(_ncu_csv([500.0]))
    (tmp_path / "b.csv").write_text(_ncu_csv([450.0, 470.0]))
    assert ncu_compare.main(["--launches", f"A={tmp_path / 'a.csv'}", f"@K=1={tmp_path / 'b.csv'}",
                             f"C={tmp_path / 'missing.csv'}"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| A ", "| @K=1 ", "| C "))]
    assert [r.split("|")[1].strip() for r in rows] == ["A", "@K=1", "@K=1", "C"]
    assert "| 500.0 |" in rows[0] and "| 470.0 |" in rows[2]
    assert "(nothing profiled)" in rows[3]
    header = out.splitlines()[out.splitlines().index(next(l for l in out.splitlines() if l.startswith("| variant")))]
    assert all(r.count("|") == header.count("|") for r in rows[:3])  # columns line up
