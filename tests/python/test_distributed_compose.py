"""Expert parallelism composed with the rest of PyTorch's training stack, on the CPU (gloo, the
torch backend in float64): FSDP2 over a data-parallel × expert-parallel mesh, and torch.compile.

- FSDP2 × EP: 4 processes on a 2×2 DeviceMesh ("dp", "ep"). A tiny model, Linear ->
  ExpertParallelMoE (experts over this rank's "ep" group) -> Linear, trained for one step with
  `fully_shard`, against one process running the same model with the whole `MoE` on all 4 ranks'
  batches, its loss the mean of the ranks' losses. The recipe is docs/EXPERT_PARALLEL.md's.
- torch.compile: 2 processes; the compiled layer (all-gather exchange, max_tokens given) against
  the eager one, forward and backward, bitwise (aot_eager). Inductor compiles for minutes on a
  2-core machine: MACHMOE_TEST_INDUCTOR=1 runs it too (to ~1e-12: it fuses and reorders float
  operations).

In float64 the sharded model and the whole one differ only by the order of additions, so every
gradient must agree to ~1e-13 relative; TOL leaves room for that and nothing else (a gradient
scaled by the wrong factor is off by 0.5 or more).
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from spawn_helpers import reporting_failures, spawn_workers
from torch import nn

TOL = 1e-10
D, N, E, K = 16, 8, 8, 2  # hidden size, expert intermediate size, experts, experts per token
AUX_WEIGHT = 0.1


def _rel(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def _run_worker(check, rank, world, init_file, errors, *args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting_failures(rank, errors):
        check(rank, world, *args)


# ------------------------------------------------------------------ FSDP2 over a dp × ep mesh


class _Tiny(nn.Module):
    """Linear -> MoE layer -> Linear; forward -> (y, aux)."""

    def __init__(self, moe):
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(D, D), moe, nn.Linear(D, D)

    def forward(self, x):
        h, aux = self.moe(self.inp(x))
        return self.out(h), aux


def _check_fsdp2_dp_ep(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from machmoe import MoE
    from machmoe.distributed import ExpertParallelMoE

    assert world == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    everyone = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_ep",))
    W_ep, ep_rank = mesh["ep"].size(), mesh["ep"].get_local_rank()

    torch.manual_seed(seed)  # the same reference model on every rank
    ref = _Tiny(MoE(E, K, D, N, "swiglu", True, 0.3, backend="torch")).double()
    model = copy.deepcopy(ref)
    max_tokens = 8
    model.moe = ExpertParallelMoE.from_moe(ref.moe, process_group=mesh["ep"].get_group(),
                                           max_tokens=max_tokens)
    # The recipe: the MoE layer (router and this rank's experts) sharded over "dp"; the rest of
    # the model over every rank.
    fully_shard(model.moe, mesh=mesh["dp"])
    fully_shard(model, mesh=everyone)

    gen = torch.Generator().manual_seed(seed + 1)
    sizes = [5 + q for q in range(world)]  # a different T on every rank, all <= max_tokens
    xs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in sizes]
    gs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in sizes]

    def loss_of(y, aux, g):
        return (y * g).sum() + AUX_WEIGHT * aux

    # Reference: one process, the whole layer on every rank's batch; loss = the mean of the ranks'
    # losses (the token-wise part on the concatenation, each rank's aux loss on its own tokens, as
    # the layer defines it).
    y_all, _ = ref(torch.cat(xs))
    aux_mean = torch.stack([ref.moe(ref.inp(x))[1] for x in xs]).mean()
    ((y_all * torch.cat(gs)).sum() / world + AUX_WEIGHT * aux_mean).backward()

    y, aux = model(xs[rank])
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    assert _rel(y, y_all[mine]) <= TOL, f"output off by {_rel(y, y_all[mine]):.2e}"
    loss_of(y, aux, gs[rank]).backward()
    model.moe.reduce_gradients()  # router: mean over ep (DTensor shards); experts: / W_ep

    part = slice(ep_rank * (E // W_ep), (ep_rank + 1) * (E // W_ep))  # this rank's experts
    ref_params = dict(ref.named_parameters())

    def want_of(name, full):
        return full[part] if name.startswith(("moe.c_fc.", "moe.c_proj.")) else full

    names = [name for name, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params), names
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), f"{name} is not sharded by FSDP2"
        got, want = p.grad.full_tensor(), want_of(name, ref_params[name].grad)
        assert _rel(got, want) <= TOL, f"d{name} off by {_rel(got, want):.2e}"

    # The step: every rank's shard moves as the reference's parameter does, and the next forward
    # agrees.
    lr = 0.5
    for opt in (torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)):
        opt.step()
    for name, p in model.named_parameters():
        got, want = p.detach().full_tensor(), want_of(name, ref_params[name].detach())
        assert _rel(got, want) <= TOL, f"{name} after the step off by {_rel(got, want):.2e}"
    with torch.no_grad():
        y2, aux2 = model(xs[rank])
        ref_y2, ref_aux2 = ref(xs[rank])
    assert _rel(y2, ref_y2) <= TOL, f"output after the step off by {_rel(y2, ref_y2):.2e}"
    assert abs(aux2.item() - ref_aux2.item()) <= TOL * max(1.0, abs(ref_aux2.item()))


def _fsdp2_worker(rank, world, init_file, seed, errors):
    _run_worker(_check_fsdp2_dp_ep, rank, world, init_file, errors, seed)


def test_fsdp2_over_a_dp_ep_mesh_matches_one_process(seed):
    spawn_workers(_fsdp2_worker, 4, seed)


# ------------------------------------------------------------------ torch.compile


def _check_compile(rank, world, seed, backend):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from machmoe.distributed import ExpertParallelMoE

    # E = 4: the torch backend's per-expert loop is traced per local expert, so fewer experts
    # compile faster.
    layer = ExpertParallelMoE(4, 2, D, N, "swiglu", True, 0.3, backend="torch", seed=seed % 1000,
                              exchange="all_gather", max_tokens=12).double()
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(9 + rank, D, generator=gen, dtype=torch.float64)  # padded up to max_tokens
    g = torch.randn(9 + rank, D, generator=gen, dtype=torch.float64)

    def run(f):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, aux = f(xi)
        ((out * g).sum() + AUX_WEIGHT * aux).backward()
        return {"out": out.detach(), "aux": aux.detach(), "dx": xi.grad,
                **{f"d{name}": p.grad for name, p in layer.named_parameters()}}

    eager = run(layer)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend=backend)
    for call in range(2):  # the second call runs the cached graphs
        got = run(compiled)
        for what, want in eager.items():
            if backend == "aot_eager":  # the same ATen ops in the same order: bitwise
                assert torch.equal(got[what], want), f"{backend}, call {call}: {what} differs from eager"
            else:
                err = _rel(got[what], want)
                assert err <= 1e-12, f"{backend}, call {call}: {what} off by {err:.2e}"
    # The graph breaks are the torch backend's host synchronisations only (boolean indexing and
    # bincount(...).tolist() in its expert loop: data-dependent shapes), never the exchange.
    breaks = counters["graph_break"]
    assert breaks, "expected graph breaks at the torch backend's data-dependent shapes"
    for reason in breaks:
        assert "Dynamic shape operator" in reason or "Data dependent operator" in reason, reason
    assert counters["stats"]["unique_graphs"] >= 2


def _compile_worker(rank, world, init_file, seed, errors, backend):
    _run_worker(_check_compile, rank, world, init_file, errors, seed, backend)


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        os.environ.get("MACHMOE_TEST_INDUCTOR") != "1",
        reason="inductor compiles for minutes on a small CPU machine; MACHMOE_TEST_INDUCTOR=1 runs it")),
])
def test_compiled_all_gather_exchange_matches_eager(backend, seed):
    spawn_workers(_compile_worker, 2, seed, (backend,))
