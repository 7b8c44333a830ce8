"""examples/train_moe_lm.py on the CPU: a few steps of the tiny presets, in fp32.

The expert implementations compute the same function, so from the same seed and data their first
loss (a forward pass of identical weights) agrees to fp32 rounding: the losses differ only by the
order of the experts' sums, each term of d = 64 products rounded at 2^-24, so by well under
1e-5 relative after two layers (observed: bit-identical for grouped_mm and eager). Training must
also work: after a few AdamW steps the loss is well below its start (ln 256 = 5.55 for uniform
bytes; these runs fall by more than 0.5 in six steps).
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
pytest.importorskip("transformers")
import moe_lm_support  # noqa: E402
import train_moe_lm  # noqa: E402

# Small enough that a busy 2-core machine runs each case in seconds.
SMALL = ["--device", "cpu", "--seq", "64", "--batch", "4", "--corpus-mib", "2", "--log-every", "1"]
FIRST_LOSS_RTOL = 1e-5   # fp32 reassociation in the experts' sums (module docstring)
MIN_DROP = 0.3           # nats per byte over the run; random weights start near ln 256


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """These tensors are far too small to gain from threads, and on a busy machine OpenMP's
    waiting threads made a step 50x slower (seconds instead of ~0.1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def machmoe_integration_available() -> bool:
    try:
        return importlib.util.find_spec("machmoe.integrations.transformers") is not None
    except ModuleNotFoundError:  # no machmoe.integrations package at all
        return False


def first_losses(preset: str, impls: list[str], device: str, dtype: str, seed: int) -> dict:
    """Step 1's loss (a forward pass, no update) of each implementation on one batch, the same
    weights for all, and "reference": the eager model's same weights run in float64.

    With bf16 compute, an implementation's loss error against the reference is held to at most
    twice eager's own error (the tolerance rule of the project's tests: eager is the plain
    PyTorch path), and never below 2^-9 · loss / sqrt(predicted tokens): the loss is a mean
    over tokens of terms each off by about one bf16 rounding, with independent signs (observed
    on the CPU: errors of 1e-5 to 2e-4 against a floor of 7e-4 for 252 tokens)."""
    args = train_moe_lm.parse_args(["--preset", preset, "--seed", str(seed), "--device", device,
                                    "--dtype", dtype, "--seq", "64", "--batch", "4"])
    dist = train_moe_lm.Distributed(device)
    corpus = moe_lm_support.load_stdlib_corpus(1 << 20)
    input_ids = moe_lm_support.batch_for_step(corpus, 0, args.batch, args.seq, seed).to(dist.device)
    losses = {}
    with torch.no_grad():
        for name in impls:
            model = train_moe_lm.build_model(args, name, dist)
            losses[name] = model(input_ids=input_ids, labels=input_ids).logits.double()
            if name == "eager":
                reference = model.double()
                losses["reference"] = reference(input_ids=input_ids, labels=input_ids).logits
            del model
    # The language-model loss from the logits: the same for every model, in float64.
    result = {name: torch.nn.functional.cross_entropy(
                  logits[:, :-1].reshape(-1, 256), input_ids[:, 1:].reshape(-1)).item()
              for name, logits in losses.items()}
    result["predicted_tokens"] = input_ids[:, 1:].numel()
    return result


def check_first_losses(losses: dict, impls: list[str]):
    ref = losses["reference"]
    eager_err = abs(losses["eager"] - ref)
    bound = max(2 * eager_err, 2**-9 * ref / math.sqrt(losses["predicted_tokens"]))
    for name in impls:
        assert abs(losses[name] - ref) <= bound, (
            f"{name}: first loss {losses[name]} vs float64 reference {ref}: error "
            f"{abs(losses[name] - ref):.3g} > {bound:.3g} (eager's error {eager_err:.3g})")


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3-tiny"])
def test_bf16_first_loss_matches_the_float64_model(preset, seed):
    """The single-device bf16 path (a GPU's default) on the CPU."""
    impls = ["grouped_mm", "eager"]
    check_first_losses(first_losses(preset, impls, "cpu", "bfloat16", seed), impls)


def test_first_loss_check_can_fail(seed):
    losses = {"reference": 5.0, "eager": 5.0001, "grouped_mm": 5.002, "predicted_tokens": 252}
    with pytest.raises(AssertionError, match="grouped_mm"):
        check_first_losses(losses, ["grouped_mm", "eager"])


def check_learns(run: dict):
    losses = run["losses"]
    assert all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(256)) < 0.5, f"first loss {losses[0]} is not near ln 256"
    assert losses[-1] < losses[0] - MIN_DROP, f"loss did not fall: {losses}"


def test_qwen3_tiny_implementations_agree_and_learn(seed, tmp_path):
    impls = ["grouped_mm", "eager"] + (["machmoe", "machmoe-fused"] if machmoe_integration_available() else [])
    runs = train_moe_lm.main(["--preset", "tiny", "--steps", "6", "--seed", str(seed),
                              "--compare", ",".join(impls), "--out", str(tmp_path)] + SMALL)
    assert list(runs) == impls
    for name in impls:
        check_learns(runs[name])
        first, ref = runs[name]["losses"][0], runs["eager"]["losses"][0]
        assert abs(first - ref) <= FIRST_LOSS_RTOL * ref, f"{name} vs eager at step 1: {first} {ref}"
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["peak_memory_bytes"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["implementations"]) == set(impls)
    assert summary["implementations"]["eager"]["final_loss"] == runs["eager"]["losses"][-1]
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000


def test_same_seed_same_run_and_other_seed_other_run(seed):
    """The data order and the initialisation depend only on the seed."""
    args = ["--preset", "tiny", "--steps", "2", "--experts", "grouped_mm"] + SMALL
    a = train_moe_lm.main(args + ["--seed", str(seed)])["grouped_mm"]["losses"]
    b = train_moe_lm.main(args + ["--seed", str(seed)])["grouped_mm"]["losses"]
    c = train_moe_lm.main(args + ["--seed", str(seed + 1)])["grouped_mm"]["losses"]
    assert a == b
    assert a != c


def test_deepseek_v3_tiny_learns_and_profiles(seed, tmp_path):
    runs = train_moe_lm.main(["--preset", "deepseek-v3-tiny", "--steps", "6", "--seed", str(seed),
                              "--experts", "grouped_mm", "--profile", "--profile-steps", "1",
                              "--out", str(tmp_path)] + SMALL)
    run = runs["grouped_mm"]
    check_learns(run)
    share = run["profile"]
    assert share["experts_forward_ms"] > 0 and share["experts_backward_ms"] > 0, share
    assert 0 < share["experts_share"] < 1, share
    assert (tmp_path / "profile_grouped_mm.txt").exists()


@pytest.mark.skipif(not machmoe_integration_available(), reason="machmoe's transformers integration is missing")
def test_deepseek_v3_tiny_fused_block_agrees_with_eager(seed, tmp_path):
    """machmoe-fused: DeepSeek-V3's blocks (sigmoid + selection bias, groups, routed scaling,
    shared expert) as fuse_moe's blocks; the same first loss as eager, and it learns."""
    runs = train_moe_lm.main(["--preset", "deepseek-v3-tiny", "--steps", "6", "--seed", str(seed),
                              "--compare", "eager,machmoe-fused", "--out", str(tmp_path)] + SMALL)
    check_learns(runs["machmoe-fused"])
    first, ref = runs["machmoe-fused"]["losses"][0], runs["eager"]["losses"][0]
    assert abs(first - ref) <= FIRST_LOSS_RTOL * ref, f"machmoe-fused vs eager at step 1: {first} {ref}"


@pytest.mark.skipif(not machmoe_integration_available(), reason="machmoe's transformers integration is missing")
def test_qwen3_tiny_fp8_blocks_agree_and_learn(seed, tmp_path):
    """machmoe-fp8: the fused blocks with precision="fp8" (the FP8 emulation on the CPU, bf16, the
    Hugging Face concatenated gate/up layout): the first loss near the bf16 fused blocks' (at
    random init the logits are near 0 and the loss is ln 256 plus the logits' small spread, which
    FP8's ~5% error on the experts' part moves by far less than 1e-3 of the loss), not equal to
    them all along (FP8 did run), and it learns."""
    runs = train_moe_lm.main(["--preset", "tiny", "--steps", "6", "--seed", str(seed), "--dtype", "bfloat16",
                              "--compare", "machmoe-fused,machmoe-fp8", "--out", str(tmp_path)] + SMALL)
    check_learns(runs["machmoe-fp8"])
    first, ref = runs["machmoe-fp8"]["losses"][0], runs["machmoe-fused"]["losses"][0]
    assert abs(first - ref) <= 1e-3 * ref, f"machmoe-fp8 vs machmoe-fused at step 1: {first} {ref}"
    assert runs["machmoe-fp8"]["losses"] != runs["machmoe-fused"]["losses"]  # FP8 did run


@pytest.mark.skipif(not machmoe_integration_available(), reason="machmoe's transformers integration is missing")
def test_held_out_loss_in_the_other_precision(seed, tmp_path):
    """--eval-other-precision: each held-out loss of a machmoe-fp8 run is also measured with the
    fused blocks' experts in bf16, at the same steps; the switch takes effect (the values differ
    from the FP8 ones) and is undone (training is bitwise that of a run without the option, and
    the blocks are FP8 again afterwards)."""
    args = ["--preset", "tiny", "--steps", "4", "--seed", str(seed), "--dtype", "bfloat16",
            "--experts", "machmoe-fp8", "--eval-batches", "2", "--eval-every", "2", "--out", str(tmp_path)] + SMALL
    plain = train_moe_lm.main(args)["machmoe-fp8"]
    crossed = train_moe_lm.main(args + ["--eval-other-precision"])["machmoe-fp8"]
    assert crossed["losses"] == plain["losses"] and crossed["held_out"] == plain["held_out"]
    other = crossed["held_out_other_precision"]
    assert other["precision"] == "bf16"
    assert [e["step"] for e in other["losses"]] == [e["step"] for e in crossed["held_out"]] == [2, 4]
    assert all(math.isfinite(e["loss"]) for e in other["losses"])
    assert [e["loss"] for e in other["losses"]] != [e["loss"] for e in crossed["held_out"]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["implementations"]["machmoe-fp8"]["held_out_other_precision"] == other
    assert "held_out_other_precision" not in plain


def test_held_out_loss_is_measured_on_the_same_batches(seed, tmp_path):
    """--eval-batches: the held-out loss (the corpus's last 5%, fixed windows) after the given
    steps and the last; the same batches for every implementation, so two runs of one
    implementation from the same seed measure bitwise the same values, and training lowers it."""
    args = ["--preset", "tiny", "--steps", "8", "--seed", str(seed), "--experts", "grouped_mm",
            "--eval-batches", "2", "--eval-every", "4", "--out", str(tmp_path)] + SMALL
    a = train_moe_lm.main(args)["grouped_mm"]
    b = train_moe_lm.main(args)["grouped_mm"]
    assert [e["step"] for e in a["held_out"]] == [4, 8]
    assert a["held_out"] == b["held_out"] and a["final_held_out_loss"] == a["held_out"][-1]["loss"]
    assert all(math.isfinite(e["loss"]) for e in a["held_out"])
    assert a["held_out"][-1]["loss"] < math.log(256), a["held_out"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["implementations"]["grouped_mm"]["held_out"] == a["held_out"]
    train_part, held_out = moe_lm_support.split_held_out(torch.arange(100, dtype=torch.uint8), 0.05)
    assert train_part.numel() == 95 and held_out.numel() == 5 and held_out[0] == 95


def test_routing_bias_moves_against_the_load(seed):
    """DeepSeek-V3's selection bias: overloaded experts down by the rate, underloaded ones up."""
    args = train_moe_lm.parse_args(["--preset", "deepseek-v3-tiny", "--layers", "2",
                                    "--seed", str(seed)])
    model = train_moe_lm.build_model(args, "grouped_mm", train_moe_lm.Distributed("cpu"))
    updater = moe_lm_support.RoutingBiasUpdater(model, rate=0.01)
    assert len(updater.routers) == args.layers - args.first_dense
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 32)))
    counts = {id(r): updater.counts[id(r)].float() for r in updater.routers}
    updater.update()
    for router in updater.routers:
        load = counts[id(router)]
        assert load.sum() == 2 * 32 * args.top_k
        expected = 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(router.e_score_correction_bias, expected)
    assert not updater.counts  # consumed: the next step counts afresh


def test_batches_split_the_global_batch_over_ranks():
    corpus = torch.arange(10_000, dtype=torch.int64) % 256
    whole = moe_lm_support.batch_for_step(corpus, 3, 8, 16, seed=7)
    parts = [moe_lm_support.batch_for_step(corpus, 3, 8, 16, seed=7, rank=r, world=4)
             for r in range(4)]
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(whole, moe_lm_support.batch_for_step(corpus, 4, 8, 16, seed=7))
    with pytest.raises(ValueError, match="multiple of the world size"):
        moe_lm_support.batch_for_step(corpus, 0, 6, 16, seed=7, world=4)


def test_fsdp2_path_runs_in_a_single_process_gloo_group(seed, tmp_path):
    """fully_shard per decoder layer over a one-rank gloo group: the same first loss as without."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}",
                                         rank=0, world_size=1)
    try:
        args = ["--preset", "tiny", "--steps", "3", "--seed", str(seed),
                "--experts", "grouped_mm"] + SMALL
        sharded = train_moe_lm.main(args)["grouped_mm"]
    finally:
        torch.distributed.destroy_process_group()
    args[args.index("--steps") + 1] = "1"
    plain = train_moe_lm.main(args)["grouped_mm"]
    assert all(math.isfinite(x) for x in sharded["losses"])
    assert abs(sharded["losses"][0] - plain["losses"][0]) <= FIRST_LOSS_RTOL * plain["losses"][0]


@pytest.mark.skipif(machmoe_integration_available(),
                    reason="machmoe's transformers integration is importable here")
def test_machmoe_without_its_integration_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_moe_lm.main(["--preset", "tiny", "--experts", "machmoe"] + SMALL)
    assert exit_info.value.code == 2
    assert "machmoe.integrations.transformers" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--compare", "grouped_mm,cutlass"], "--compare"),
    (["--preset", "deepseek-v3-tiny", "--num-experts", "10"], "--n-group"),
    (["--model", "mixtral"], "--model"),
    (["--compare", "eager,eager"], "--compare"),
])
def test_bad_arguments_are_named(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_moe_lm.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_fsdp2_deepseek_routers_in_their_own_fp32_unit(seed, tmp_path):
    """Under FSDP2 the routers are sharded apart from their layer and gathered in fp32."""
    from torch.distributed.fsdp import FSDPModule
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}",
                                         rank=0, world_size=1)
    try:
        args = train_moe_lm.parse_args(["--preset", "deepseek-v3-tiny", "--device", "cpu",
                                        "--dtype", "bfloat16", "--seed", str(seed)])
        model = train_moe_lm.build_model(args, "grouped_mm", train_moe_lm.Distributed("cpu"))
        routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        assert len(routers) == args.layers - args.first_dense
        assert all(isinstance(r, FSDPModule) for r in routers)
        assert all(isinstance(layer, FSDPModule) for layer in model.model.layers)
        input_ids = torch.randint(0, 256, (2, 32))
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        assert math.isfinite(loss.item())
        assert all(p.grad is not None for p in routers[0].parameters())
    finally:
        torch.distributed.destroy_process_group()
