"""machmoe's experts under transformers' own expert parallelism (DistributedConfig(ep_size=...)).

transformers shards a MoE model's experts by its expert-parallel plan ("grouped_gemm" on the
experts' weights: dim 0 split, module.num_experts set to the local count; "ep_dispatch_experts" on
the experts module: its forward replaced by an EPImplementation that calls the experts' own,
decorated forward on this rank's experts with local ids). With experts_implementation="machmoe"
that inner call is machmoe's: it must read E as the local count from the local weights, take the
ids the implementation hands it ("all_to_all": the received rows, local ids, K = 1; "all_reduce":
the whole batch with off-rank pairs marked by the sentinel id E_local and weight 0) and give
transformers the outputs and gradients its collectives expect.

CPU, gloo, 2 processes, float32, the torch backend: a tiny Qwen3-MoE and a tiny DeepSeek-V3
(every layer sparse, 8 experts, 4 per rank), sharded by transformers' own code
(prepare_distribute_model + maybe_distribute_model, which from_pretrained(distributed_config=...)
calls after building the model; from_pretrained itself is not used because on a CPU it needs the
`accelerate` package, which the development set does not have), in these layouts:
  tp_size=2, ep_size=2: one batch on both ranks, the dense layers tensor-parallel; training runs
      "all_to_all" (each rank sends half the batch's pairs), inference "all_reduce";
  the same with ep_implementation="all_reduce" in training too (sentinel ids, gradients);
  fsdp_size=2, ep_size=2: a batch per rank, FSDP2 on the dense layers, "all_to_all";
  and, for comparison, tp_size=2 alone: the experts tensor-parallel (transformers' TP plan).
Each against the single-process model with the same weights on transformers' "eager" experts:
the logits, the aux loss and every parameter's gradient (sharded ones gathered with
full_tensor(); under FSDP the mean over the ranks' batches, as FSDP2 reduces), each within 2x the
float32 eager model's own error to the float64 eager model + CPU_TOL (as test_hf_transformers;
the errors seen are ~5e-7, and a 0.1% error in machmoe's experts output fails). Every experts call
is checked to reach machmoe with E / W = 4 experts, ids < 4 under "all_to_all", the sentinel 4
under "all_reduce". fuse_moe leaves sharded experts' blocks unfused, and a block fused before the
sharding refuses to run.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
from spawn_helpers import reporting_failures, spawn_workers

pytest.importorskip("transformers")

WORLD = 2
E = 8  # experts in the tiny models (test_hf_transformers._TINY)

CASES = [
    dict(name="qwen3_moe tp=2 ep=2", model_type="qwen3_moe", dist=dict(tp_size=2, ep_size=2),
         fuse="sharded by transformers' expert parallelism"),
    dict(name="qwen3_moe tp=2 ep=2 all_reduce", model_type="qwen3_moe",
         dist=dict(tp_size=2, ep_size=2, ep_implementation="all_reduce"), sentinels=True),
    dict(name="qwen3_moe fsdp=2 ep=2", model_type="qwen3_moe", dist=dict(fsdp_size=2, ep_size=2)),
    dict(name="deepseek_v3 tp=2 ep=2", model_type="deepseek_v3", dist=dict(tp_size=2, ep_size=2)),
    dict(name="deepseek_v3 fsdp=2 ep=2 all_to_all", model_type="deepseek_v3",
         dist=dict(fsdp_size=2, ep_size=2, ep_implementation="all_to_all")),
    # Not expert parallelism: the experts tensor-parallel (transformers' "moe_tp_experts" plan:
    # every rank holds all E experts' halves of n, the partial outputs all-reduced).
    dict(name="qwen3_moe tp=2 (experts tensor-parallel)", model_type="qwen3_moe", dist=dict(tp_size=2),
         fuse="sharded (DTensor)"),
]


def _full(tensor):
    """A DTensor gathered to the whole tensor on every rank (a collective), a tensor as it is.
    A packed weight sharded alone on a 1-D mesh (transformers' "packed_colwise": each rank holds
    its slice of the gate rows and of the up rows, _StridedShard, which full_tensor() does not
    gather in torch 2.11) is gathered by hand: slice j of every rank, for each of the packed parts."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    placements = tensor.placements
    if len(placements) == 1 and type(placements[0]).__name__ == "_StridedShard":
        dim, parts = placements[0].dim, placements[0].split_factor
        local = tensor.to_local().contiguous()
        group = tensor.device_mesh.get_group()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        pieces = [piece.chunk(parts, dim=dim) for piece in pieces]
        return torch.cat([piece[j] for j in range(parts) for piece in pieces], dim=dim)
    return tensor.full_tensor()


def _run_sharded(model, input_ids, readout):
    """As test_hf_transformers.run, on the sharded model: (logits, aux, {name: whole gradient})."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids, use_cache=False)
    logits = _full(out.logits)
    loss = (logits * readout).sum()
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        aux = _full(aux)
        loss = loss + aux
    loss.backward()
    grads = {n: _full(p.grad) if p.grad is not None else torch.zeros_like(_full(p.detach()))
             for n, p in model.named_parameters()}
    return logits.detach(), None if aux is None else aux.detach(), grads


def _mean_grads(runs):
    return {n: sum(r[2][n] for r in runs) / len(runs) for n in runs[0][2]}


def _check_case(rank, seed, case, calls):
    import test_hf_transformers as hf_tests
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(**case["dist"])
    reference = hf_tests.build(case["model_type"], seed)  # float32, eager experts
    with torch.no_grad():  # the same weights on every rank, whatever each process drew
        for tensor in list(reference.parameters()) + list(reference.buffers()):
            dist.broadcast(tensor, 0)
    vocab = reference.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(3, vocab, (2, 10), generator=gen), torch.randn(2, 10, vocab, generator=gen))
               for _ in range(config.dp_size)]  # a batch per data-parallel rank (one under TP)
    mine = rank % config.dp_size

    eager = [hf_tests.run(reference, ids, readout) for ids, readout in batches]
    exact_model = copy.deepcopy(reference).double()
    exact = [hf_tests.run(exact_model, ids, readout.double()) for ids, readout in batches]

    model = copy.deepcopy(reference)
    model.set_experts_implementation("machmoe")
    config, _, mesh = type(model).prepare_distribute_model(config)
    model = type(model).maybe_distribute_model(model, config, mesh)
    experts = hf_tests._experts_modules(model)
    e_local = E // config.ep_size
    assert experts and all(m._is_expert_parallel == (config.ep_size > 1) and m.num_experts == e_local
                           and type(m.gate_up_proj).__name__ == "DTensor" for _, m in experts), \
        f"{case['name']}: transformers did not shard the experts"

    calls.clear()
    result = _run_sharded(model, *batches[mine])
    name = f"{case['name']} (rank {rank})"
    # FSDP2 averages the gradients over the ranks' batches; under TP every rank has the one batch.
    want_eager = (eager[mine][0], eager[mine][1], _mean_grads(eager))
    want_exact = (exact[mine][0], exact[mine][1], _mean_grads(exact))
    hf_tests.assert_within_eager_error(result, want_eager, want_exact, name)
    _check_calls(calls, case, e_local, name)

    calls.clear()
    with torch.no_grad():  # inference: "auto" picks "all_reduce" when the ranks share the batch
        logits = _full(model(batches[mine][0], use_cache=False).logits)
    err = hf_tests.rel_err(logits, exact[mine][0])
    err_eager = hf_tests.rel_err(eager[mine][0], exact[mine][0])
    assert err <= 2 * err_eager + hf_tests.CPU_TOL, f"{name}: inference logits error {err:.2e}"
    all_reduce = config.ep_size > 1 and (case.get("sentinels") or config.dp_size == 1)
    _check_calls(calls, dict(case, sentinels=all_reduce), e_local, name + " inference")
    if case.get("fuse"):
        _check_fuse_refused(model, reference, case, name)


def _check_fuse_refused(model, reference, case, name):
    """fuse_moe leaves blocks whose experts transformers has sharded (a fused block reads all E
    experts' weights itself), and a block fused before the sharding refuses to run."""
    from machmoe.integrations import transformers as hf_machmoe

    report = hf_machmoe.fuse_moe(model)
    assert not report.fused and len(report.unfused) == 2, f"{name}: {report}"
    assert all(case["fuse"] in why for why in report.unfused.values()), f"{name}: {report}"
    fused = copy.deepcopy(reference)
    assert len(hf_machmoe.fuse_moe(fused).fused) == 2
    from transformers.distributed import DistributedConfig

    config, _, mesh = type(fused).prepare_distribute_model(DistributedConfig(**case["dist"]))
    fused = type(fused).maybe_distribute_model(fused, config, mesh)
    with pytest.raises(RuntimeError, match=re.escape(case["fuse"])):
        fused(torch.tensor([[3, 4, 5]]), use_cache=False)


def _check_calls(calls, case, e_local, name):
    """Every experts call of the sharded model reached machmoe with this rank's E / W experts;
    under "all_reduce" some pairs carried the sentinel id E / W (another rank's expert)."""
    layers = 2
    assert len(calls) >= layers, f"{name}: {len(calls)} calls reached machmoe, not one per layer"
    assert all(e == e_local for e, _ in calls), f"{name}: machmoe saw E = {calls}, not {e_local}"
    largest = max(top for _, top in calls)
    if case.get("sentinels"):
        assert largest == e_local, f"{name}: no sentinel id reached machmoe (largest id {largest})"
    else:
        assert largest < e_local, f"{name}: an id >= E / W reached machmoe ({largest})"


def _worker(rank, world, init_file, seed, errors):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting_failures(rank, errors):
        import machmoe.integrations.transformers  # noqa: F401  (registers "machmoe")
        from machmoe import functional

        calls = []
        original = functional.experts_topk

        def recorded(x, w1, w2, scores, ids, **kwargs):
            calls.append((w1.shape[0], int(ids.max()) if ids.numel() else -1))
            return original(x, w1, w2, scores, ids, **kwargs)

        functional.experts_topk = recorded
        for i, case in enumerate(CASES):
            _check_case(rank, seed + 11 * i, case, calls)


def test_machmoe_experts_under_transformers_expert_parallelism(seed):
    from transformers.modeling_utils import PreTrainedModel

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        pytest.skip("this transformers release has no transformers.distributed")
    if "ep_size" not in DistributedConfig.__dataclass_fields__ \
            or not hasattr(PreTrainedModel, "maybe_distribute_model"):
        pytest.skip("this transformers release shards experts otherwise (no DistributedConfig.ep_size)")
    spawn_workers(_worker, WORLD, seed)
