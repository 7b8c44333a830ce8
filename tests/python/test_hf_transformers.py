"""machmoe inside Hugging Face transformers: experts_implementation="machmoe" and fuse_moe.

CPU tests (float32, machmoe's torch backend): for every MoE family of the installed transformers
whose experts module is decorated with use_experts_implementation (found by reading the modeling
files) and that builds from a tiny config, the logits and every parameter gradient of the model
on machmoe against the same model on transformers' "eager" experts; fuse_moe against eager for
the families it fuses; a save/load round trip of a fused model; expert-parallel sentinels.
GPU tests (the kernels, bfloat16): each experts module and each fused block against its fp32
eager reference on the same inputs, with the tolerance derived from the bf16 eager error.

Tolerance on the CPU: both sides compute the same float32 math in another order (ε = 2^-24 per
rounding); the errors seen are ~1e-6 relative per tensor. 1e-4 leaves room for that over two
layers, while a wrong pair, layout, activation or score gives an O(1) error (test_check_can_fail).
"""

from __future__ import annotations

import copy
import logging
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations import moe as hf_moe  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from machmoe import ActivationType, functional  # noqa: E402
from machmoe.integrations import transformers as hf_machmoe  # noqa: E402

CPU_TOL = 1e-4


# ---------------------------------------------------------------- families and tiny models


def _decorated_families() -> list[str]:
    """Causal-LM model types whose modeling file decorates an experts class."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        folder = root / model_type.replace("-", "_")
        if folder.is_dir() and any("@use_experts_implementation" in f.read_text()
                                   for f in folder.glob("modeling_*.py")):
            found.append(model_type)
    return found


FAMILIES = _decorated_families()
# Families every supported transformers release has: a failure to build one is a failure here.
REQUIRED = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v2",
            "deepseek_v3", "glm4_moe", "minimax_m2", "gpt_oss"}
FUSED_FAMILIES = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3",
                  "glm4_moe", "minimax_m2", "gpt_oss"]

# Set on a family's config where it has the attribute: hidden 64, expert intermediate 32,
# 8 experts, K = 2, 2 layers, a small vocabulary, every layer sparse.
_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=16, num_experts=8, num_local_experts=8, n_routed_experts=8,
    moe_num_experts=8, num_experts_per_tok=2, moe_k=2, moe_topk=2, n_group=1, topk_group=1,
    n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=0, mlp_only_layers=[],
    decoder_sparse_step=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64, sliding_window=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_num_value_heads=2,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    tie_word_embeddings=False, router_jitter_noise=0.0, output_router_logits=True,
    router_aux_loss_coef=0.5,
)

# Families whose configs refuse part of _TINY.
_FAMILY_TINY = {"zaya": dict(num_experts_per_tok=1)}


def _causal_lm_class(model_type: str):
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def tiny_config(model_type: str, **extra):
    """The family's causal-LM config with _TINY set where it has the attribute (a multimodal
    family's text config, where its causal LM takes that)."""
    config_class = _causal_lm_class(model_type).config_class
    if getattr(config_class, "sub_configs", None):
        pytest.skip(f"{model_type}: its causal LM takes a composite config (not built tiny here)")
    default = config_class()
    kwargs = {k: v for k, v in _TINY.items() if hasattr(default, k)}
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:  # keep every kind of layer
        kinds = list(dict.fromkeys(layer_types))
        kwargs["layer_types"] = [kinds[i % len(kinds)] for i in range(2)]
    kwargs.update(_FAMILY_TINY.get(model_type, {}))
    kwargs.update(extra)
    return config_class(**kwargs)


def _experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if hf_machmoe._is_experts_module(m)]


def _randomize_moe(model, generator) -> None:
    """Expert weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1²), router weights [E, d] ~ N(0, 1/d):
    routing far from uniform and expert outputs of the size of their inputs (transformers'
    initialisation makes both nearly trivial at this size)."""
    with torch.no_grad():
        for _, experts in _experts_modules(model):
            for name, p in experts.named_parameters(recurse=False):
                fan_in = p.shape[1] if experts.is_transposed else p.shape[-1]
                std = 0.1 if p.dim() == 2 else fan_in ** -0.5
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if name.endswith(".gate") and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * weight.shape[1] ** -0.5)


def build(model_type: str, seed: int, implementation: str = "eager", **extra):
    """A tiny float32 model of the family with randomized MoE weights, or a skip (a fail for
    REQUIRED families) when this release cannot build or run one."""
    try:
        torch.manual_seed(seed)
        config = tiny_config(model_type, **extra)
        with torch.device("meta"):  # count first: a config this table misses could be large
            size = sum(p.numel() for p in _causal_lm_class(model_type)._from_config(config).parameters())
        if size > 4_000_000:
            raise ValueError(f"the tiny config still has {size} parameters")
        model = _causal_lm_class(model_type)._from_config(config, experts_implementation=implementation)
    except pytest.skip.Exception:
        raise
    except Exception as error:  # noqa: BLE001 - configs differ per family; report, do not guess
        if model_type in REQUIRED:
            raise
        pytest.skip(f"{model_type}: no tiny model from its config ({type(error).__name__}: {error})")
    if not _experts_modules(model):
        pytest.skip(f"{model_type}: the tiny model has no decorated experts module")
    _randomize_moe(model, torch.Generator().manual_seed(seed))
    return model.float()


def run(model, input_ids, readout):
    """(logits, aux_loss or None, {name: grad}) of loss = <logits, readout> (+ aux_loss)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids, use_cache=False)
    loss = (out.logits * readout).sum()
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        loss = loss + aux
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    return out.logits.detach(), None if aux is None else aux.detach(), grads


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """‖value − ref‖ / ‖ref‖ in float64, each tensor on its own scale (‖value‖ when ref is 0)."""
    value, ref = value.detach().double(), ref.detach().double()
    scale = ref.norm()
    diff = (value - ref).norm()
    return float(diff / scale) if scale > 0 else float(diff)


def assert_close_run(result, ref, tol, what):
    logits, aux, grads = result
    ref_logits, ref_aux, ref_grads = ref
    assert rel_err(logits, ref_logits) <= tol, f"{what}: logits error {rel_err(logits, ref_logits):.2e}"
    assert (aux is None) == (ref_aux is None), f"{what}: aux loss present in one run only"
    if aux is not None:
        assert rel_err(aux, ref_aux) <= tol, f"{what}: aux loss error {rel_err(aux, ref_aux):.2e}"
    assert grads.keys() == ref_grads.keys()
    worst = max(((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads), default=(0.0, ""))
    assert worst[0] <= tol, f"{what}: gradient of {worst[1]} has error {worst[0]:.2e}"


def assert_within_eager_error(result, eager, exact, what, others=()):
    """Each tensor of `result` (float32) within 2x the float32 eager model's own error to the
    float64 eager model, + CPU_TOL. Some families have gradients that float32 itself computes
    to only ~1e-2 (hy_v4's hyper-connection scalars sum terms that cancel): the eager float32
    model and transformers' grouped_mm disagree that much there too. `others`: more float32 runs
    of transformers' own (grouped_mm): one run's error is a single sample of float32's, which a
    lucky seed makes small on an ill-conditioned tensor (a linear attention's A_log), so the
    largest of the samples sets the bound."""
    def tensors(run):
        return [run[0], run[1]] + [run[2][n] for n in names[2:]]

    names = ["logits", "aux"] + sorted(exact[2])
    samples = [tensors(r) for r in (eager,) + tuple(others)]
    for i, (name, value, exact_value) in enumerate(zip(names, tensors(result), tensors(exact))):
        if exact_value is None:
            assert value is None and all(s[i] is None for s in samples), f"{what}: {name} present in one run only"
            continue
        err = rel_err(value, exact_value)
        err_fp32 = max(rel_err(s[i], exact_value) for s in samples)
        assert err <= 2 * err_fp32 + CPU_TOL, (f"{what}: {name} error {err:.2e} to float64 > 2 x "
                                               f"float32's {err_fp32:.2e} (eager, grouped_mm) + {CPU_TOL}")


def _grouped_mm_runs(model, input_ids, readout) -> list:
    """[run of a copy of `model` with transformers' grouped_mm experts], a second sample of
    float32's error for assert_within_eager_error; [] where the family or release has none."""
    try:
        twin = copy.deepcopy(model)
        twin.set_experts_implementation("grouped_mm")
        return [run(twin, input_ids, readout)]
    except Exception:  # noqa: BLE001 - not every family or release has it on the CPU
        return []


@pytest.fixture
def count_machmoe_calls(monkeypatch):
    """Counts the calls that reach machmoe's experts (not the grouped_mm fallback)."""
    calls = []
    original = functional.experts_topk

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(functional, "experts_topk", counted)
    return calls


# ---------------------------------------------------------------- registration


def test_registered_in_experts_interface():
    assert hf_moe.ALL_EXPERTS_FUNCTIONS["machmoe"] is hf_machmoe.experts_forward
    model = _causal_lm_class("qwen3_moe")._from_config(tiny_config("qwen3_moe"), experts_implementation="machmoe")
    assert model.config._experts_implementation == "machmoe"


def test_fuse_moe_is_exported_from_the_module():
    assert callable(hf_machmoe.fuse_moe) and callable(hf_machmoe.register)


# ---------------------------------------------------------------- every family: machmoe vs eager


# Families whose tiny whole model is too ill-conditioned in float32 for the comparison with
# eager: HY-V4's hyper-connection parameters' gradients carry a 1e-3 float32 error in eager
# itself, and a last-bit change in an expert's output (machmoe sums in another order) moves them
# by 1e-2 on some seeds. Their experts are checked exactly in float64 by
# test_clamped_gate_experts_match_eager_exactly.
_WHOLE_MODEL_ILL_CONDITIONED = {"hy_v4"}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_machmoe_matches_eager(model_type, seed, count_machmoe_calls):
    if model_type in _WHOLE_MODEL_ILL_CONDITIONED:
        pytest.skip(f"{model_type}: the tiny model's float32 gradients are ill-conditioned (see above)")
    model = build(model_type, seed)
    supported = [n for n, m in _experts_modules(model) if not isinstance(hf_machmoe.plan_experts(m), str)]
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    try:
        eager = run(model, input_ids, readout := torch.randn(2, 12, model.config.get_text_config().vocab_size))
    except Exception as error:  # noqa: BLE001
        if model_type in REQUIRED:
            raise
        pytest.skip(f"{model_type}: the tiny eager model does not run ({type(error).__name__}: {error})")
    try:  # the float64 eager model: how well float32 can do on each tensor of this family
        exact = run(copy.deepcopy(model).double(), input_ids, readout.double())
    except Exception:  # noqa: BLE001 - a family without float64 support: plain comparison
        exact = None
    others = _grouped_mm_runs(model, input_ids, readout) if exact is not None else []
    model.set_experts_implementation("machmoe")
    result = run(model, input_ids, readout)
    if exact is None:
        assert_close_run(result, eager, CPU_TOL, f"{model_type} machmoe vs eager")
    else:
        assert_within_eager_error(result, eager, exact, f"{model_type} machmoe", others)
    if supported:
        assert count_machmoe_calls, f"{model_type}: no experts call reached machmoe"


# ---------------------------------------------------------------- fuse_moe


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_fuse_moe_matches_eager(model_type, seed):
    if model_type not in FAMILIES:
        pytest.skip(f"{model_type} is not in this transformers release")
    model = build(model_type, seed)
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    readout = torch.randn(2, 12, model.config.get_text_config().vocab_size)
    eager = run(model, input_ids, readout)

    fused = copy.deepcopy(model)
    before = {n: p for n, p in fused.named_parameters()}
    keys_before = list(fused.state_dict().keys())
    report = hf_machmoe.fuse_moe(fused)
    assert report.fused and not report.unfused, report
    assert all(isinstance(fused.get_submodule(n), hf_machmoe.FusedSparseMoeBlock) for n in report.fused)
    # The same parameter objects under the same names: no copies, checkpoints unchanged.
    after = dict(fused.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert list(fused.state_dict().keys()) == keys_before
    # As the family test: within 2x eager float32's own error against the float64 model (some
    # families' gradients, e.g. Qwen3-Next's linear-attention dt_bias, are ill-conditioned in fp32).
    exact = run(copy.deepcopy(model).double(), input_ids, readout.double())
    assert_within_eager_error(run(fused, input_ids, readout), eager, exact, f"{model_type} fused",
                              _grouped_mm_runs(model, input_ids, readout))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_fuse_moe_grouped_sigmoid_routing_matches_eager(model_type, seed):
    """DeepSeek-V3 / GLM-4.5 blocks with group-limited selection (4 groups of 2 experts, keep 2),
    a non-zero selection bias and routed scaling: the fused block picks and weighs as the model's
    router does."""
    if model_type not in FAMILIES:
        pytest.skip(f"{model_type} is not in this transformers release")
    model = build(model_type, seed, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.1)
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    readout = torch.randn(2, 12, model.config.get_text_config().vocab_size)
    eager = run(model, input_ids, readout)
    fused = copy.deepcopy(model)
    report = hf_machmoe.fuse_moe(fused)
    assert report.fused and not report.unfused, report
    block = fused.get_submodule(report.fused[0])
    assert block.rule.router_options(block)["n_group"] == 4
    assert_close_run(run(fused, input_ids, readout), eager, CPU_TOL, f"{model_type} grouped fused vs eager")


def test_fuse_moe_fp8(seed):
    """fuse_moe(precision="fp8"): Qwen3-MoE's blocks (concatenated gate/up) and gpt-oss's (clamped
    SwiGLU, expert biases) fused with their routed experts in FP8 (the emulation on the CPU, bf16);
    a block's output on the same input within E4M3's error of the bf16 block's (4 quantised
    operands on its path, x, W1, A, W2: sqrt(4)·0.024 rms, bound twice that, and at least a tenth
    of it: FP8 did run; through the whole tiny model the errors compound, as the experts dominate
    its residual stream)."""
    for model_type in ("qwen3_moe", "gpt_oss"):
        if model_type not in FAMILIES:
            pytest.skip(f"{model_type} is not in this transformers release")
    for model_type in ("qwen3_moe", "gpt_oss"):
        model = build(model_type, seed).bfloat16()
        input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
        bf16, fp8 = copy.deepcopy(model), copy.deepcopy(model)
        assert hf_machmoe.fuse_moe(bf16).fused
        report = hf_machmoe.fuse_moe(fp8, precision="fp8")
        assert report.fused and not report.unfused, report
        assert all("precision=fp8" in repr(fp8.get_submodule(n)) for n in report.fused)
        name = report.fused[0]
        x = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16()
        with torch.no_grad():
            want, got = bf16.get_submodule(name)(x), fp8.get_submodule(name)(x)
            want, got = (v[0] if isinstance(v, tuple) else v for v in (want, got))
            assert torch.isfinite(fp8(input_ids).logits).all()
        err, model_err = ((got.float() - want.float()).norm() / want.float().norm()).item(), 4 ** 0.5 * 0.024
        assert 0.1 * model_err <= err <= 2 * model_err, (model_type, err)


def test_fp8_experts_implementation(seed, caplog):
    """experts_implementation="machmoe_fp8": each experts module's GEMMs in FP8 (the emulation on
    the CPU; bf16 models). Qwen3-MoE's experts (concatenated gate/up) and gpt-oss's (transposed,
    biases, clamped SwiGLU): a module's output within E4M3's error of its bf16 machmoe output (x,
    W1, A, W2 quantised: sqrt(4)·0.024 rms, bound twice that, floor a tenth), expert ids outside
    [0, E) dropped; a second call reuses the module's FP8 copies (gpt-oss hands its weights over
    as fresh transposed views); float32 experts fall back to grouped_mm, saying why."""
    assert hf_moe.ALL_EXPERTS_FUNCTIONS["machmoe_fp8"] is hf_machmoe.fp8_experts_forward
    for model_type in ("qwen3_moe", "gpt_oss"):
        if model_type not in FAMILIES:
            pytest.skip(f"{model_type} is not in this transformers release")
    gen = torch.Generator().manual_seed(seed)
    for model_type in ("qwen3_moe", "gpt_oss"):
        model = build(model_type, seed).bfloat16()
        _, experts = _experts_modules(model)[0]
        plan = hf_machmoe.plan_experts(experts)
        E, d = plan.w1.shape[0], plan.w1.shape[2]
        T, K = 40, 2
        x = torch.randn(T, d, generator=gen).bfloat16()
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        in_range = idx.clone()
        idx[::7, 1] = E  # another rank's expert: dropped
        w = torch.rand(T, K, generator=gen)
        want = hf_machmoe.experts_forward(experts, x, idx, w)
        got = hf_machmoe.fp8_experts_forward(experts, x, idx, w)
        err, model_err = ((got.float() - want.float()).norm() / want.float().norm()).item(), 4 ** 0.5 * 0.024
        assert 0.1 * model_err <= err <= 2 * model_err, (model_type, err)
        cache = experts.__dict__["_machmoe_fp8_cache"]
        copies = [id(c) for entry in cache._entries.values() for c in entry[2].values()]
        again = hf_machmoe.fp8_experts_forward(experts, x, idx, w)  # (kept: its graph holds the weights' views)
        assert torch.equal(again, got)
        assert [id(c) for entry in cache._entries.values() for c in entry[2].values()] == copies, model_type
    experts.float()
    with caplog.at_level(logging.WARNING, logger="machmoe"):
        out = hf_machmoe.fp8_experts_forward(experts, x.float(), in_range, w)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert "cannot run in FP8: the weights are torch.float32" in caplog.text


def test_fuse_moe_leaves_other_blocks_and_says_why(seed):
    model = build("dots1", seed)  # DeepSeek-V3-like, but a block class fuse_moe does not know
    report = hf_machmoe.fuse_moe(model)
    assert not report.fused and report.unfused
    assert all("Dots1MoE" in why for why in report.unfused.values()), report.unfused


def test_fuse_moe_refuses_experts_machmoe_cannot_compute(seed):
    model = build("qwen3_moe", seed, hidden_act="gelu")  # the erf GELU: no machmoe activation
    report = hf_machmoe.fuse_moe(model)
    assert not report.fused and len(report.unfused) == 2
    assert all("GELUActivation" in why for why in report.unfused.values()), report.unfused


def test_fused_model_save_load_round_trip(seed, tmp_path):
    model = build("qwen3_moe", seed)
    input_ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(seed))
    hf_machmoe.fuse_moe(model)
    model.eval()
    with torch.no_grad():
        fused_logits = model(input_ids).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").float().eval()
    assert set(loaded.state_dict().keys()) == set(model.state_dict().keys())
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    with torch.no_grad():
        assert rel_err(loaded(input_ids).logits, fused_logits) <= CPU_TOL
        hf_machmoe.fuse_moe(loaded)
        assert rel_err(loaded(input_ids).logits, fused_logits) <= CPU_TOL


# ---------------------------------------------------------------- the experts contract


def _qwen3_experts(seed, **extra):
    model = build("qwen3_moe", seed, **extra)
    return _experts_modules(model)[0][1]


def _routing(T, E, K, generator):
    index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=generator) + 0.1
    return index, weights


def _experts_run(fn, module, x, index, weights, dout):
    """(out, dx, d_weights, {param: grad}) of fn(module, x, index, weights)."""
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(module, x, index, weights)
    out.backward(dout)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), x.grad, weights.grad, grads


def _eager(module, x, index, weights):
    return type(module).forward.__wrapped__(module, x, index, weights)


def test_sentinel_ids_are_dropped(seed):
    experts = _qwen3_experts(seed)
    g = torch.Generator().manual_seed(seed)
    E, T, K = experts.num_experts, 20, 2
    x = torch.randn(T, experts.hidden_dim, generator=g)
    index, weights = _routing(T, E, K, g)
    index[::3, 1] = E  # another rank's expert; weights stay non-zero there
    index[1, :] = E  # a token with no local expert at all
    dout = torch.randn(T, experts.hidden_dim, generator=g)
    sentinel = index >= E
    # The reference: eager on the list with each sentinel pair sent to expert 0 with weight 0
    # (the same output; older transformers' eager refuses ids >= E). Its weight gradient at those
    # pairs is not 0, so d_weights is compared on the real pairs only.
    ref = _experts_run(_eager, experts, x, index.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0.0), dout)
    got = _experts_run(hf_machmoe.experts_forward, experts, x, index, weights, dout)
    for value, expected, name in zip(got[:2], ref[:2], ("out", "dx")):
        assert rel_err(value, expected) <= CPU_TOL, name
    assert rel_err(got[2][~sentinel], ref[2][~sentinel]) <= CPU_TOL, "d_weights"
    assert torch.equal(got[2][sentinel], torch.zeros(int(sentinel.sum()))), "sentinel scores got gradients"
    assert torch.equal(got[0][1], torch.zeros(experts.hidden_dim))
    for name in ref[3]:
        assert rel_err(got[3][name], ref[3][name]) <= CPU_TOL, name


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "relu"])
def test_glu_activations_map_to_machmoe(hidden_act, seed, count_machmoe_calls):
    experts = _qwen3_experts(seed, hidden_act=hidden_act)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, experts.hidden_dim, generator=g)
    index, weights = _routing(16, experts.num_experts, 2, g)
    dout = torch.randn_like(x)
    ref = _experts_run(_eager, experts, x, index, weights, dout)
    got = _experts_run(hf_machmoe.experts_forward, experts, x, index, weights, dout)
    assert count_machmoe_calls, f"{hidden_act} fell back"
    for value, expected in zip(got[:3], ref[:3]):
        assert rel_err(value, expected) <= CPU_TOL
    for name in ref[3]:
        assert rel_err(got[3][name], ref[3][name]) <= CPU_TOL, name


def test_check_can_fail(seed, monkeypatch):
    """The comparison sees a wrong layout (gate and up swapped in meaning)."""
    experts = _qwen3_experts(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, experts.hidden_dim, generator=g)
    index, weights = _routing(16, experts.num_experts, 2, g)
    ref = _eager(experts, x, index, weights)
    monkeypatch.setattr(experts, "is_concatenated", False)
    assert rel_err(hf_machmoe.experts_forward(experts, x, index, weights), ref) > 0.1


class _OddGateMixin:
    def _apply_gate(self, gate_up):  # gate · up, no activation: not one of machmoe's
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * up


def test_unsupported_gate_falls_back_with_one_warning(seed, caplog, count_machmoe_calls):
    experts = _qwen3_experts(seed)
    experts.__class__ = type("OddGateExperts", (_OddGateMixin, type(experts)), {})
    assert "_apply_gate" in hf_machmoe.plan_experts(experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, experts.gate_up_proj.shape[2], generator=g)
    index, weights = _routing(10, experts.num_experts, 2, g)
    hf_machmoe._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="machmoe"):
        out = hf_machmoe.experts_forward(experts, x, index, weights)
        hf_machmoe.experts_forward(experts, x, index, weights)
    warnings = [r for r in caplog.records if "OddGateExperts" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert not count_machmoe_calls
    # (the class's eager forward would not call _apply_gate; transformers' grouped_mm does)
    assert torch.equal(out, hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, index, weights))


# A decorated experts class of our own for the flags no supported family combines:
# transposed weights with biases, in both gate/up layouts.
def _flagged_experts_class(is_concatenated: bool):
    @hf_moe.use_experts_implementation(is_concatenated=is_concatenated, is_transposed=True, has_bias=True)
    class FlaggedExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            E, d, n = config.num_experts, config.hidden_size, config.moe_intermediate_size
            self.num_experts = E
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, d, 2 * n) * d ** -0.5)  # [E, d, 2n]
            self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * n) * 0.1)
            self.down_proj = torch.nn.Parameter(torch.randn(E, n, d) * n ** -0.5)  # [E, n, d]
            self.down_proj_bias = torch.nn.Parameter(torch.randn(E, d) * 0.1)
            self.act_fn = transformers.activations.ACT2FN["silu"]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            # Reference written out per pair: h = x W1 + b1, split per the layout, SwiGLU, down.
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    if e >= self.num_experts:
                        continue
                    h = hidden_states[t] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
                    gate, up = (h.chunk(2) if self.is_concatenated else (h[0::2], h[1::2]))
                    a = self.act_fn(gate) * up
                    out[t] = out[t] + top_k_weights[t, k] * (a @ self.down_proj[e] + self.down_proj_bias[e])
            return out

    return FlaggedExperts


@pytest.mark.parametrize("is_concatenated", [True, False])
def test_transposed_biased_experts_in_both_layouts(is_concatenated, seed, count_machmoe_calls):
    torch.manual_seed(seed)
    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"
    experts = _flagged_experts_class(is_concatenated)(config)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, config.hidden_size, generator=g)
    index, weights = _routing(12, config.num_experts, 2, g)
    index[2, 0] = config.num_experts
    dout = torch.randn_like(x)
    ref = _experts_run(_eager, experts, x, index, weights, dout)
    got = _experts_run(hf_machmoe.experts_forward, experts, x, index, weights, dout)
    assert count_machmoe_calls
    for value, expected in zip(got[:3], ref[:3]):
        assert rel_err(value, expected) <= CPU_TOL
    for name in ref[3]:
        assert rel_err(got[3][name], ref[3][name]) <= CPU_TOL, name


# ---------------------------------------------------------------- clamped SwiGLU gates

CLAMPED_FAMILIES = ["gpt_oss", "hy_v4", "deepseek_v4", "glm5_next", "minimax_m3_vl", "step3p7",
                    "openai_privacy_filter"]


def _clamped_experts(model_type, seed):
    if model_type not in FAMILIES:
        pytest.skip(f"{model_type} is not in this transformers release")
    model = build(model_type, seed)
    experts = _experts_modules(model)[0][1]
    if type(experts).__name__ not in hf_machmoe._CLAMPED_GATES:
        pytest.skip(f"{model_type}: its experts class {type(experts).__name__} is not a known clamped gate")
    return experts.double()


@pytest.mark.parametrize("model_type", CLAMPED_FAMILIES)
def test_clamped_gate_experts_match_eager_exactly(model_type, seed, count_machmoe_calls):
    """The experts module alone in float64, weights large enough that most gate and up values pass
    the clamp bounds: machmoe's clamped_swiglu equals the class's own _apply_gate, in the output and
    every gradient."""
    experts = _clamped_experts(model_type, seed)
    plan = hf_machmoe.plan_experts(experts)
    assert not isinstance(plan, str), plan
    assert plan.activation == ActivationType.CLAMPED_SWIGLU
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (3.0 if p.dim() == 3 else 0.5))
    d = experts.gate_up_proj.shape[1] if experts.is_transposed else experts.gate_up_proj.shape[2]
    x = torch.randn(40, d, generator=g, dtype=torch.float64)
    index, weights = _routing(40, experts.num_experts, 2, g)
    dout = torch.randn(40, d, generator=g, dtype=torch.float64)
    ref = _experts_run(_eager, experts, x, index, weights.double(), dout)
    got = _experts_run(hf_machmoe.experts_forward, experts, x, index, weights.double(), dout)
    assert count_machmoe_calls
    out, dx, dw, grads = got
    ref_out, ref_dx, ref_dw, ref_grads = ref
    # machmoe computes with the gate's parameters rounded to float32, as its kernels do: gpt-oss's
    # alpha = 1.702 moves by ~3e-8 relative, the outputs by less than 1e-8.
    exact = all(float(torch.tensor(v, dtype=torch.float32)) == v
                for v in (plan.glu_clamp.alpha, plan.glu_clamp.limit, plan.glu_clamp.up_offset))
    tol = 1e-12 if exact else 1e-8
    for name, a, b in [("out", out, ref_out), ("dx", dx, ref_dx), ("d weights", dw, ref_dw),
                       *((f"d {n}", grads[n], ref_grads[n]) for n in ref_grads)]:
        assert rel_err(a, b) < tol, f"{model_type} {name}: {rel_err(a, b):.2e}"


def test_changed_clamped_gate_falls_back(seed, monkeypatch, count_machmoe_calls):
    """A known class whose _apply_gate no longer computes what machmoe does (a release that changes
    it) is not computed by machmoe: the numerical check sends it to the fallback."""
    experts = _clamped_experts("gpt_oss", seed)

    def other_gate(self, gate_up):
        return torch.nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2]

    monkeypatch.setattr(type(experts), "_apply_gate", other_gate)
    hf_machmoe._GATE_CHECKED.clear()
    try:
        assert "does not compute machmoe's clamped SwiGLU" in hf_machmoe.plan_experts(experts)
    finally:
        hf_machmoe._GATE_CHECKED.clear()
