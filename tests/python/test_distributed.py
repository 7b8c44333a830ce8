"""Expert parallelism (machmoe.distributed) on the CPU: W processes over gloo, the torch backend
in float64, against one process running the whole `MoE` on every rank's batch.

In float64 the sharded layer and the whole one differ only by the order of additions, so outputs,
aux losses and gradients must agree to ~1e-13 relative; TOL leaves room for that and nothing
else (a wrong row, expert or score is off by order 1). Each test spawns one group and runs all
its cases in it, to keep CI fast.
"""


import pytest
import torch
import torch.distributed as dist
from spawn_helpers import reporting_failures, spawn_workers

TOL = 1e-10


def _rel(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def _case_inputs(seed, world, T, d, dtype, empty_rank):
    gen = torch.Generator().manual_seed(seed)
    sizes = [0 if q == empty_rank else T + q for q in range(world)]  # odd T, and one empty rank
    xs = [torch.randn(t, d, generator=gen, dtype=dtype) for t in sizes]
    gs = [torch.randn(t, d, generator=gen, dtype=dtype) for t in sizes]
    return xs, gs


def _reference(full, xs, gs, aux_weight):
    """Per-rank outputs and aux losses of the whole layer, and the gradients of the ranks' mean
    loss (out·g summed, plus aux_weight·aux) for x of every rank and every parameter."""
    full.zero_grad(set_to_none=True)
    outs, auxs, dxs = [], [], []
    total = 0
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_(True)
        out, aux = full(x)
        loss = (out * g).sum() + aux_weight * aux
        loss.backward()
        outs.append(out.detach())
        auxs.append(aux.detach())
        dxs.append(x.grad)
        total += 1
    grads = {name: p.grad / total for name, p in full.named_parameters()}
    return outs, auxs, dxs, grads


# The exchanges and their settings each case runs with: the all-gather one with the group's
# largest T found by the layer and with max_tokens above it, the all-to-all one (exact rows,
# fixed blocks) and the one with its counts on the device (receive rows below W·max_tokens too:
# 0.9 · W · 13 holds every case's rows).
EXCHANGES = [dict(exchange="all_gather"), dict(exchange="all_gather", max_tokens=14),
             dict(exchange="all_to_all"), dict(exchange="all_to_all", max_tokens=14),
             dict(exchange="all_to_all", max_tokens=13, capacity_factor=0.9),
             dict(exchange="all_to_all_device", max_tokens=14),
             dict(exchange="all_to_all_device", max_tokens=13, capacity_factor=0.9)]


def _check_case(rank, world, seed, case, exchange):
    from machmoe import MoE
    from machmoe.distributed import ExpertParallelMoE

    E, K, d, n = case["E"], case["K"], 16, 8
    torch.manual_seed(seed)
    full = MoE(E, K, d, n, case["act"], case["bias"], 0.3, routing=case["routing"],
               gate_up_layout=case["layout"], backend="torch", **case.get("router", {})).double()
    if full.router.bias is not None:
        with torch.no_grad():
            full.router.bias.normal_(0.0, 0.5)
    if full.selection_bias is not None:
        # Experts of the last rank are never selected: that rank receives no rows at all.
        full.selection_bias[(world - 1) * (E // world):] = -10.0
    xs, gs = _case_inputs(seed + 1, world, 9, d, torch.float64, case["empty_rank"])
    outs, auxs, dxs, grads = _reference(full, xs, gs, 0.1)

    layer = ExpertParallelMoE.from_moe(full, **exchange)
    x = xs[rank].clone().requires_grad_(True)
    out, aux = layer(x)
    name = f"{case['name']}, {exchange}"
    if out.numel():
        assert _rel(out, outs[rank]) <= TOL, f"{name}: out off by {_rel(out, outs[rank]):.2e}"
    assert out.shape == outs[rank].shape
    assert abs(aux.item() - auxs[rank].item()) <= TOL * max(1.0, abs(auxs[rank].item())), name
    ((out * gs[rank]).sum() + 0.1 * aux).backward()
    layer.reduce_gradients(average=True)
    if x.numel():
        assert _rel(x.grad, dxs[rank]) <= TOL, f"{name}: dx off by {_rel(x.grad, dxs[rank]):.2e}"
    part = slice(rank * (E // world), (rank + 1) * (E // world))
    checks = [("router.weight", layer.router.weight.grad, grads["router.weight"])]
    if layer.router.bias is not None:
        checks.append(("router.bias", layer.router.bias.grad, grads["router.bias"]))
    for local, whole in ((layer.c_fc, "c_fc"), (layer.c_proj, "c_proj")):
        checks.append((f"{whole}.weight", local.weight.grad, grads[f"{whole}.weight"][part]))
        if local.bias is not None:
            checks.append((f"{whole}.bias", local.bias.grad, grads[f"{whole}.bias"][part]))
    for what, got, want in checks:
        if want.abs().max() == 0:  # this rank's experts got no rows anywhere: exact zeros
            assert (got == 0).all(), f"{name}: d{what} of experts without rows is not zero"
        else:
            assert _rel(got, want) <= TOL, f"{name}: d{what} off by {_rel(got, want):.2e}"
    if case.get("expect_idle") and rank == world - 1:
        assert (layer.c_fc.weight.grad == 0).all(), f"{name}: idle rank's experts got a gradient"


CASES = [
    dict(name="softmax_topk swiglu bias", E=8, K=3, act="swiglu", bias=True,
         routing="softmax_topk", layout="interleaved", empty_rank=None),
    dict(name="sigmoid geglu concatenated, last rank's experts unused, rank 0 without tokens",
         E=8, K=2, act="geglu", bias=False, routing="sigmoid", layout="concatenated",
         empty_rank=0, expect_idle=True),
    dict(name="topk_softmax relu bias, every expert per token", E=8, K=8, act="relu", bias=True,
         routing="topk_softmax", layout="interleaved", empty_rank=None),
    dict(name="DeepSeek-V3's router: sigmoid + selection bias, 4 groups keep 2, scaling 2.5, a "
         "router bias", E=8, K=3, act="swiglu", bias=False, routing="sigmoid", layout="concatenated",
         empty_rank=None, router=dict(router_bias=True, routed_scaling_factor=2.5, n_group=4, topk_group=2)),
]


def _check_fp8(rank, world, seed, layout, activation, rounding="none"):
    """precision='fp8' (the emulation on the torch backend): the sharded layer against the whole
    FP8 layer on the ranks' batches put end to end, in one call. An expert's rows are then the
    same rows in the same order (rank by rank), so every operand is quantised alike (x, dout and
    H by row, the weight gradients' operands in the same 128-row chunks) and the results differ
    only where the sharded layer rounds a token's partial sums to bf16 per rank before adding
    them (out, dx) and in fp32 summation order: 2^-7 relative, against FP8's ~0.05 (a path
    quantised differently fails). The aux loss is per rank in the sharded layer, so it is left
    out of the loss here (aux_weight 0). With token rounding the sharded layer rounds over the
    group's whole batch, as the whole layer does over the batches end to end."""
    from machmoe import GluClamp, MoE
    from machmoe.distributed import ExpertParallelMoE

    E, K, d, n = 4 * world, 2, 128, 64
    torch.manual_seed(seed)
    extra = {"glu_clamp": GluClamp.gpt_oss(limit=3.0)} if activation == "clamped_swiglu" else {}
    if rounding != "none":
        extra.update(token_rounding=rounding, tile_m=16)
    full = MoE(E, K, d, n, activation, True, 0.05, gate_up_layout=layout, backend="torch", precision="fp8",
               router_bias=rounding == "none", **extra).bfloat16()
    with torch.no_grad():
        full.c_fc.bias.normal_(0.0, 0.3), full.c_proj.bias.normal_(0.0, 0.1)
        if full.router.bias is not None:
            full.router.bias.normal_(0.0, 0.5)
    xs, gs = _case_inputs(seed + 1, world, 150, d, torch.bfloat16, None)
    x_all = torch.cat(xs).requires_grad_(True)
    out_all, _ = full(x_all)
    (out_all.float() * torch.cat(gs).float()).sum().backward()
    start = sum(x.shape[0] for x in xs[:rank])
    rows = slice(start, start + xs[rank].shape[0])

    layer = ExpertParallelMoE.from_moe(full, exchange="all_gather")
    assert layer.precision.value == "fp8" and layer.fp8_cache is not None
    x = xs[rank].clone().requires_grad_(True)
    out, _ = layer(x)
    (out.float() * gs[rank].float()).sum().backward()
    layer.reduce_gradients(average=False)
    name = f"fp8 {layout} {activation} rounding {rounding} W={world} rank {rank}"
    part = slice(rank * (E // world), (rank + 1) * (E // world))
    checks = [("out", out, out_all[rows]), ("dx", x.grad, x_all.grad[rows]),
              ("router.weight", layer.router.weight.grad, full.router.weight.grad)]
    if full.router.bias is not None:
        checks.append(("router.bias", layer.router.bias.grad, full.router.bias.grad))
    for local, whole in ((layer.c_fc, full.c_fc), (layer.c_proj, full.c_proj)):
        checks += [(f"{type(local).__name__}.weight", local.weight.grad, whole.weight.grad[part]),
                   (f"{type(local).__name__}.bias", local.bias.grad, whole.bias.grad[part])]
    for what, got, want in checks:
        err = _rel(got, want)
        assert err <= 2.0 ** -7, f"{name}: {what} off by {err:.2e} from the whole FP8 layer"
    # Not the bf16 layer: the sharded FP8 layer is FP8's distance away from it.
    bf16 = ExpertParallelMoE.from_moe(full, exchange="all_gather")
    bf16.precision, bf16.fp8_cache = type(layer.precision).BF16, None
    out_bf16, _ = bf16(xs[rank])
    assert _rel(out_bf16, out) > 0.01, f"{name}: the FP8 result is the bf16 one"


def _worker(rank, world, init_file, seed, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting_failures(rank, errors):
        for i, case in enumerate(CASES):
            for exchange in EXCHANGES:
                _check_case(rank, world, seed + 7 * i, case, exchange)
        _check_deterministic(rank, world, seed)
        _check_overflow(rank, world)
        _check_pair_capacity(rank, world, seed)
        for mode in ("nr", "up", "down", "stochastic"):
            _check_rounding(rank, world, seed, mode)
        _check_init_independent_of_world(rank, world)
        _check_fp8(rank, world, seed, "interleaved", "swiglu")
        _check_fp8(rank, world, seed, "concatenated", "clamped_swiglu")
        _check_fp8(rank, world, seed, "interleaved", "swiglu", rounding="nr")
        _check_errors(world)


def _check_init_independent_of_world(rank, world):
    """`seed` gives the same router and the same expert e on any number of ranks."""
    from machmoe.distributed import ExpertParallelMoE

    sharded = ExpertParallelMoE(8, 2, 16, 8, seed=11, backend="torch")
    groups = [dist.new_group([q]) for q in range(world)]  # every rank creates every group
    alone = ExpertParallelMoE(8, 2, 16, 8, seed=11, backend="torch", process_group=groups[rank])
    assert torch.equal(sharded.router.weight, alone.router.weight)
    part = slice(rank * (8 // world), (rank + 1) * (8 // world))
    assert torch.equal(sharded.c_fc.weight, alone.c_fc.weight[part])
    assert torch.equal(sharded.c_proj.weight, alone.c_proj.weight[part])
    assert not torch.equal(sharded.c_fc.weight[0], sharded.c_fc.weight[-1]) or world == 8


def _check_rounding(rank, world, seed, mode):
    """Token rounding over the group: the whole layer with the same rounding on the ranks'
    batches put end to end gives every rank's output, dx and (summed) gradients; the aux loss is
    the rank's own top-K one."""
    from machmoe import MoE, torch_backend
    from machmoe.distributed import ExpertParallelMoE

    E, K, d, n = 8, 2, 16, 8
    torch.manual_seed(seed)
    full = MoE(E, K, d, n, "swiglu", True, 0.3, token_rounding=mode, tile_m=4, backend="torch").double()
    xs, gs = _case_inputs(seed + 1, world, 9, d, torch.float64, None)
    x_all = torch.cat(xs).requires_grad_(True)
    torch.manual_seed(seed + 2)  # the stochastic mode's seed, drawn alike below
    out_all, _ = full(x_all)
    (out_all * torch.cat(gs)).sum().backward()
    start = sum(x.shape[0] for x in xs[:rank])
    rows = slice(start, start + xs[rank].shape[0])

    layer = ExpertParallelMoE.from_moe(full, max_tokens=16)
    x = xs[rank].clone().requires_grad_(True)
    torch.manual_seed(seed + 2)
    out, aux = layer(x)
    (out * gs[rank]).sum().backward()
    layer.reduce_gradients(average=False)
    name = f"token rounding {mode!r}"
    assert _rel(out, out_all[rows]) <= TOL, f"{name}: out off by {_rel(out, out_all[rows]):.2e}"
    assert _rel(x.grad, x_all.grad[rows]) <= TOL, f"{name}: dx off by {_rel(x.grad, x_all.grad[rows]):.2e}"
    part = slice(rank * (E // world), (rank + 1) * (E // world))
    checks = [("router.weight", layer.router.weight.grad, full.router.weight.grad)]
    for local, whole in ((layer.c_fc, full.c_fc), (layer.c_proj, full.c_proj)):
        checks += [("weight", local.weight.grad, whole.weight.grad[part]),
                   ("bias", local.bias.grad, whole.bias.grad[part])]
    for what, got, want in checks:
        assert _rel(got, want) <= TOL, f"{name}: d{what} off by {_rel(got, want):.2e}"
    logits = x.detach() @ full.router.weight.detach().T
    _, top = torch_backend.route_topk(logits, K, "softmax_topk")
    assert abs(aux.item() - torch_backend.aux_loss(logits, top).item()) <= TOL, name


def _check_deterministic(rank, world, seed):
    """Two calls on the same inputs: bitwise the same output and gradients."""
    from machmoe.distributed import ExpertParallelMoE

    layer = ExpertParallelMoE(8, 3, 16, 8, seed=seed % 1000, backend="torch", max_tokens=16)
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(seed + rank))
    runs = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, aux = layer(xi)
        (out.square().sum() + aux).backward()
        runs.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b), "two runs differ"


def _check_pair_capacity(rank, world, seed):
    """The all-gather exchange with its experts sized for fewer pairs than the gathered ones: with
    room enough, bitwise the layer without a capacity (output, input and parameter gradients);
    with too little, every rank raises on the CPU, and a call with room works afterwards."""
    from machmoe.distributed import ExpertParallelMoE, pair_capacity

    assert pair_capacity(0.9, world, 16, 2) < world * 16 * 2  # the pairs really are compacted
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(seed + rank))
    runs = []
    for factor in (1.0, 0.9):
        layer = ExpertParallelMoE(8, 2, 16, 8, seed=seed % 1000, backend="torch", max_tokens=16,
                                  capacity_factor=factor)
        xi = x.clone().requires_grad_(True)
        out, aux = layer(xi)
        (out.square().sum() + aux).backward()
        runs.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b), "a pair capacity with room changed the result"
    tight = ExpertParallelMoE(8, 2, 16, 8, backend="torch", max_tokens=16, capacity_factor=0.01)
    cap = pair_capacity(0.01, world, 16, 2)
    with pytest.raises(RuntimeError, match=rf"\(token, expert\) pairs for its experts, more than its capacity of {cap} "):
        tight(x)
    out, _ = ExpertParallelMoE(8, 2, 16, 8, backend="torch", max_tokens=16)(x)
    assert torch.isfinite(out).all()


def test_compact_pairs_keeps_this_ranks_pairs_in_order():
    from machmoe.expert_exchange import compact_pairs

    E_local = 3
    token = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3], dtype=torch.int32)
    expert = torch.tensor([0, 3, 3, 2, 1, 0, 3, 3], dtype=torch.int32)  # 3: another rank's
    score = torch.arange(8, dtype=torch.float64).add(1).requires_grad_(True)
    s, t, e, count = compact_pairs(score, token, expert, E_local, capacity=6, tokens=4)
    assert int(count) == 4
    # kept (token, expert): (0, 0) (1, 2) (2, 1) (2, 0); two padding pairs on tokens 0 and 2
    assert t.tolist() == [0, 0, 1, 2, 2, 2] and e.tolist() == [0, 3, 2, 1, 0, 3]
    assert s.tolist() == [1, 0, 4, 5, 6, 0]
    s.sum().backward()
    assert score.grad.tolist() == [1, 0, 0, 1, 1, 1, 0, 0]
    s, t, e, count = compact_pairs(score.detach(), token, expert, E_local, capacity=2, tokens=4)  # too few
    assert int(count) == 4 and t.tolist() == [0, 1] and e.tolist() == [0, 2] and s.tolist() == [1, 4]
    s, t, e, count = compact_pairs(score.detach()[:0], token[:0], expert[:0], E_local, capacity=2, tokens=0)
    assert int(count) == 0 and e.tolist() == [3, 3] and t.tolist() == [0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_compact_pairs_spreads_its_padding_over_the_tokens(seed):
    # Random routings at realistic fill: the kept pairs are the in-range ones in order, the list
    # stays ordered by token, and no token carries more than ceil(P / tokens) padding pairs.
    from machmoe.expert_exchange import compact_pairs

    gen = torch.Generator().manual_seed(seed)
    tokens, K, E_local = 97, 4, 5
    token = torch.arange(tokens, dtype=torch.int32).repeat_interleave(K)
    expert = torch.randint(0, 4 * E_local, (tokens * K,), generator=gen, dtype=torch.int32)
    score = torch.rand(tokens * K, generator=gen, dtype=torch.float64)
    mine = expert < E_local
    capacity = int(mine.sum()) + int(torch.randint(0, 300, (1,), generator=gen))
    s, t, e, count = compact_pairs(score, token, expert, E_local, capacity, tokens)
    assert int(count) == int(mine.sum()) and len(t) == capacity
    assert bool((t[1:] >= t[:-1]).all()), "not ordered by token"
    real = e < E_local
    assert torch.equal(t[real], token[mine]) and torch.equal(e[real], expert[mine]) and torch.equal(s[real], score[mine])
    assert bool((s[~real] == 0).all()) and bool((e[~real] == E_local).all())
    pads = capacity - int(mine.sum())
    assert torch.bincount(t[~real].long(), minlength=tokens).max() <= -(-pads // tokens)


def _check_overflow(rank, world):
    """A capacity-bounded all-to-all whose blocks are too small: every rank raises (on the CPU
    before exchanging), and a call that fits afterwards works."""
    from machmoe.distributed import ExpertParallelMoE

    layer = ExpertParallelMoE(8, 8, 16, 8, backend="torch", exchange="all_to_all", max_tokens=10,
                              capacity_factor=0.5)  # K = E: every token needs every rank
    x = torch.randn(10, 16, dtype=layer.router.weight.dtype)
    with pytest.raises(RuntimeError, match="had 10 rows to send to one peer, more than its "
                                           "capacity of 5 "):
        layer(x)
    out, _ = layer(x[:5])
    assert torch.isfinite(out).all()


def _check_errors(world):
    from machmoe.distributed import ExpertParallelMoE, expert_parallel_moe

    with pytest.raises(ValueError, match="num_experts must be a multiple"):
        ExpertParallelMoE(world * 2 + 1, 1, 16, 8, backend="torch")
    with pytest.raises(ValueError, match="num_experts_per_tok must be <= num_experts"):
        ExpertParallelMoE(world, world + 1, 16, 8, backend="torch")
    with pytest.raises(ValueError, match="exchange must be one of all_gather, all_to_all, all_to_all_device"):
        ExpertParallelMoE(world, 1, 16, 8, backend="torch", exchange="ring")
    with pytest.raises(ValueError, match="token_rounding='up' needs exchange='all_gather'"):
        ExpertParallelMoE(world, 1, 16, 8, backend="torch", exchange="all_to_all", token_rounding="up")
    from machmoe import MoE

    with pytest.raises(ValueError, match="ExpertParallelMoE does not offer shared experts"):
        ExpertParallelMoE.from_moe(MoE(2 * world, 2, 16, 8, num_shared_experts=1, backend="torch"))
    with pytest.raises(ValueError, match="precision='fp8' runs with exchange='all_gather'"):
        ExpertParallelMoE.from_moe(MoE(2 * world, 2, 16, 16, backend="torch", precision="fp8"), exchange="all_to_all")
    with pytest.raises(ValueError, match="intermediate_size must be a multiple of 16 with precision='fp8'"):
        ExpertParallelMoE(2 * world, 2, 16, 8, backend="torch", precision="fp8")
    with pytest.raises(ValueError, match="group-limited selection .n_group > 1. needs routing='sigmoid'"):
        ExpertParallelMoE(2 * world, 2, 16, 8, backend="torch", n_group=2, topk_group=1)
    with pytest.raises(ValueError, match=r"capacity_factor must be a number in \(0, 1\]"):
        ExpertParallelMoE(world, 1, 16, 8, backend="torch", capacity_factor=0)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1 or None"):
        ExpertParallelMoE(world, 1, 16, 8, backend="torch", max_tokens=0)
    x = torch.randn(4, 16)
    # Refused on the host before any collective: T above the buffers' rows.
    with pytest.raises(ValueError, match="x has T = 4 tokens, more than max_tokens = 3"):
        ExpertParallelMoE(world, 1, 16, 8, backend="torch", max_tokens=3)(x)
    with pytest.raises(ValueError, match="w1 must hold E / W experts"):
        expert_parallel_moe(x, torch.randn(2 * world, 16), torch.randn(1, 16, 16),
                            torch.randn(1, 16, 8), num_experts_per_tok=1, backend="torch")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_the_whole_layer(world, seed):
    spawn_workers(_worker, world, seed)


def test_expert_parallel_needs_an_initialised_group():
    from machmoe.distributed import ExpertParallelMoE

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(8, 2, 16, 8, backend="torch")


class _FakeKernelOps:
    """machmoe's exchange_plan and aggregate ops as their docs define them (docs/OPS.md), on the
    CPU, so that the exchange's kernel path (which runs on CUDA) is wired and checked in CI; the
    GPU test checks the real op against the torch path. exchange_plan: rows = the distinct (owning
    rank, token) pairs in rank-major order, pairs grouped by rank stably, each pair packed as (row
    in its rank's chunk, local expert, sender, score bits); aggregate: Σ over each token's rows."""

    @staticmethod
    def exchange_plan(experts, scores, E, W, rank):
        T, K = experts.shape
        E_local, R = E // W, T * K
        flat = [int(e) for e in experts.reshape(-1)]
        dest = [e // E_local for e in flat]
        keys = sorted({(dest[p], p // K) for p in range(R)})  # (rank, token): one row each
        row_of = {k: r for r, k in enumerate(keys)}
        row_offsets = [sum(1 for q, _ in keys if q < r) for r in range(W + 1)]
        pair_row = [row_of[(dest[p], p // K)] for p in range(R)]
        order = sorted(range(R), key=lambda p: (dest[p], p))
        inverse = [0] * R
        for i, p in enumerate(order):
            inverse[p] = i
        bits = scores.reshape(-1).view(torch.int32)
        packed = [[pair_row[p] - row_offsets[dest[p]], flat[p] - dest[p] * E_local, rank, int(bits[p])]
                  for p in order]
        token_rows = [sorted({pair_row[p] for p in range(t * K, t * K + K)}) for t in range(T)]
        token_offsets = [sum(len(r) for r in token_rows[:t]) for t in range(T + 1)]
        counts = [[row_offsets[q + 1] - row_offsets[q], dest.count(q)] for q in range(W)]

        def i32(v, pad=0):
            return torch.tensor(v + [-1] * pad, dtype=torch.int32)

        return (i32(counts), i32(row_offsets), i32([t for _, t in keys], R - len(keys)), i32(pair_row),
                i32(order), i32(inverse), i32(packed), i32(token_offsets),
                i32([r for rows in token_rows for r in rows], R - len(keys)),
                torch.bincount(experts.reshape(-1).long(), minlength=E).int())

    @staticmethod
    def aggregate(rows, pair_row, token_offsets, scores, dtype):
        T = token_offsets.numel() - 1
        out = torch.zeros(T, rows.shape[1], dtype=torch.float64)
        for t in range(T):
            for p in range(int(token_offsets[t]), int(token_offsets[t + 1])):
                out[t] += rows[int(pair_row[p])].double()
        return out.to(dtype)


@pytest.mark.parametrize("T,K,E,W", [(37, 4, 12, 3), (5, 6, 6, 2), (64, 8, 16, 4), (1, 2, 4, 4),
                                     (50, 3, 9, 1), (9, 2, 16, 8)])
def test_exchange_plan_on_the_kernels_matches_its_definition(T, K, E, W):
    """The plan on the kernel path (exchange_plan faked from its definition) and the one built
    from torch ops both equal the exchange written out by hand: rows = the distinct (rank, token)
    pairs in rank-major order, pairs grouped by rank stably, each pair's metadata and score
    packed at its grouped position, each token's partial sums added."""
    from machmoe.expert_all_to_all import _ExchangePlan

    gen = torch.Generator().manual_seed(T * 1000 + K * 100 + E + W)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # [T, K]
    scores = torch.rand(T, K, generator=gen)  # fp32, as the router kernel gives them
    E_local = E // W
    dest = (experts // E_local).reshape(-1)
    token = torch.arange(T).repeat_interleave(K)
    rows = sorted({(int(q), int(t)) for q, t in zip(dest, token)})  # the definition
    row_of = {k: r for r, k in enumerate(rows)}
    want_rows = torch.tensor([sum(1 for q, _ in rows if q == r) for r in range(W)])
    want_pair_row = torch.tensor([row_of[(int(q), int(t))] for q, t in zip(dest, token)])
    want_order = torch.tensor(sorted(range(T * K), key=lambda p: (int(dest[p]), p)))
    want_offsets = torch.cat([torch.zeros(1, dtype=torch.long), want_rows.cumsum(0)])
    want_meta = torch.stack([want_pair_row - want_offsets[dest], experts.reshape(-1) % E_local,
                             torch.full((T * K,), W - 1)], 1)[want_order]
    partial = torch.randn(len(rows), 5, dtype=torch.float64, generator=gen)  # a partial sum per row
    want_sum = torch.zeros(T, 5, dtype=torch.float64)
    for r, (_, t) in enumerate(rows):
        want_sum[t] += partial[r]
    for ops in (None, _FakeKernelOps):
        plan = _ExchangePlan(experts, scores, E, W, W - 1, ops)
        assert torch.equal(plan.send_rows.long(), want_rows)
        assert torch.equal(plan.send_pairs.long(), torch.bincount(dest, minlength=W))
        assert torch.equal(plan.pair_row.long(), want_pair_row)
        assert torch.equal(plan.order.long(), want_order)
        assert torch.equal(plan.order.long()[plan.inverse.long()], torch.arange(T * K))
        counts = plan.expert_counts  # from the op on the kernel path; None on the torch path
        assert (counts is None) == (ops is None)
        if counts is not None:
            assert torch.equal(counts.long(), torch.bincount(experts.reshape(-1), minlength=E))
        assert plan.packed.dtype == torch.int32 and plan.packed.shape == (T * K, 4)
        assert torch.equal(plan.packed[:, :3].long(), want_meta)  # grouped by rank: plan.order
        assert torch.equal(plan.packed[:, 3].contiguous().view(torch.float32), scores.reshape(-1)[want_order])
        row_sum = plan.row_sum(want_rows.tolist())
        assert torch.equal(row_sum.token.long(), torch.tensor([t for _, t in rows]))
        assert torch.allclose(row_sum(partial), want_sum, rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_sum_blocks_adds_in_rank_order_into_a_fresh_tensor(W, dtype):
    # The reduce-scatter's sum: rank order, float32, one rounding; parts[0] can be a view of the
    # caller's input (the rank's own block), which must stay untouched and unaliased.
    from machmoe.symmetric_exchange import sum_blocks

    own = torch.randn(W * 6, 5).mul(1e3).to(dtype)
    parts = [own.chunk(W)[0]] + [torch.randn(6, 5).mul(10.0 ** q).to(dtype) for q in range(1, W)]
    before = own.clone()
    got = sum_blocks(parts)
    want = parts[0].double()
    for p in parts[1:]:
        want = (want + p.double()).float().double()  # float32 steps
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    assert torch.equal(own, before), "sum_blocks wrote into its first part"
    assert got.untyped_storage().data_ptr() != own.untyped_storage().data_ptr()
