"""machmoe.MoE under PyTorch distributed (NCCL) on two GPUs: DistributedDataParallel and FSDP2
(`fully_shard`). Skipped with fewer than two GPUs.

Each rank trains on its half of a global batch. The loss reads the output only: the aux loss is
a function of each rank's own tokens, so it would not add up across ranks. The gradients must
then be the average of what one GPU computes on each half. machmoe's kernels are deterministic,
so each rank's local gradient is exactly what the reference computes on that half. The only
difference allowed is the bf16 rounding of the cross-rank reduction, which is at most half an ulp
per element: 2^-8 relative (bf16 keeps 8 significant bits). The norm-wise error is held to
that bound. Measured on two H200s: 1.75e-3 to 1.85e-3.
"""

import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_test_helpers import eager_and_graph_replay, redraw_near_ties, rel_err

pytestmark = pytest.mark.gpu

WORLD = 2
T, D, N, E, K = 256, 256, 128, 16, 4  # tokens per rank, hidden, intermediate, experts, top-K
TOL = 2.0 ** -8


def _model(seed):
    from machmoe import MoE

    torch.manual_seed(seed)
    return MoE(E, K, D, N, add_bias=True).cuda().bfloat16()


def _reference_grads(seed, xs, gs):
    """Average over the ranks' halves of one GPU's gradients (fp32)."""
    model = _model(seed)
    total = None
    for x, g in zip(xs, gs):
        model.zero_grad(set_to_none=True)
        out, _ = model(x)
        (out.float() * g).sum().backward()
        grads = [p.grad.float() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [t / len(xs) for t in total]


def _worker(rank, mode, init_file, seed):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)  # the same global batch on every rank
        xs = [torch.randn(T, D, device="cuda", generator=gen).bfloat16() for _ in range(WORLD)]
        gs = [torch.randn(T, D, device="cuda", generator=gen) for _ in range(WORLD)]
        want = _reference_grads(seed, xs, gs)

        model = _model(seed)
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        else:
            from torch.distributed.fsdp import fully_shard

            wrapped = fully_shard(model)
        out, _ = wrapped(xs[rank])
        (out.float() * gs[rank]).sum().backward()
        for (name, p), ref in zip(model.named_parameters(), want):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            err = ((grad.float() - ref).norm() / ref.norm()).item()
            print(f"{mode} rank {rank}: {name} relative error {err:.2e}")
            assert err <= TOL, f"{mode} rank {rank}: {name} gradient off by {err:.2e} (> {TOL:.2e})"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs (NCCL)")
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_moe_trains_under_torch_distributed(mode, seed):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(mode, os.path.join(tmp, "init"), seed), nprocs=WORLD, join=True)


# ---------------------------------------------------------------- expert parallelism (NCCL)
#
# machmoe.distributed.ExpertParallelMoE on the machmoe backend: experts sharded over the ranks,
# tokens exchanged all-to-all. Compared per tensor with a float64 reference of the whole layer
# (the torch backend), beside the single-GPU machmoe layer on the same batches. The sharded layer
# rounds each rank's partial sum to bf16 before the combine (a token meets at most min(K, W)
# ranks) and sums its weight gradients over rows in another order, so its error may exceed the
# single-GPU layer's by a few bf16 roundings: it must stay within 2x that error plus 2^-8. A
# wrong row, expert, score or missing reduction is off by order 1. World size 1 runs on one GPU.


def _ep_batch(seed, world, model):
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)  # the same global batch everywhere
    xs, gs = [], []
    for q in range(world):
        t = {"x": torch.randn(T + 3 * q, D, device="cuda", generator=gen).bfloat16(),  # odd T too
             "router_weight": model.router.weight.detach()}
        torch.manual_seed(seed + 100 + q)  # redraws the same rows on every rank
        xs.append(redraw_near_ties(t, K)["x"])
        gs.append(torch.randn(T + 3 * q, D, device="cuda", generator=gen))
    return xs, gs


def _mean_grads(model, xs, gs, backend):
    """Outputs per batch, dx per batch and the parameters' mean gradient over the batches."""
    outs, dxs, total = [], [], None
    for x, g in zip(xs, gs):
        model.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        out, _ = model(x, backend=backend)
        (out.double() * g.double()).sum().backward()
        outs.append(out.detach())
        dxs.append(x.grad)
        grads = {name: p.grad.double() for name, p in model.named_parameters()}
        total = grads if total is None else {k: total[k] + grads[k] for k in total}
    return outs, dxs, {k: v / len(xs) for k, v in total.items()}


def EP_EXCHANGES(world):
    """The exchanges each GPU case runs: all-gather with max_tokens (the largest rank's T plus
    5 rows of padding), with a pair capacity, and finding the largest T itself; all-to-all with
    exact rows and with fixed blocks. The pair capacity only from W = 2: on one rank every pair is
    the rank's own, so any factor below 1 overflows."""
    capacity = [dict(exchange="all_gather", max_tokens=T + 3 * (world - 1), capacity_factor=0.9)]
    return ([dict(exchange="all_gather", max_tokens=T + 3 * (world - 1) + 5)] + (capacity if world > 1 else [])
            + [dict(exchange="all_gather"), dict(exchange="all_to_all"),
               dict(exchange="all_to_all", max_tokens=T + 3 * (world - 1) + 5)])


def _check_no_sync_and_graph(model, x, g, max_tokens):
    """The all-gather exchange with max_tokens: forward + backward without a host sync, and the
    same call captured in a CUDA graph replays to bitwise the eager results
    (gpu_test_helpers.eager_and_graph_replay)."""
    from machmoe.distributed import ExpertParallelMoE

    eager, captured = eager_and_graph_replay(lambda: ExpertParallelMoE.from_moe(model, max_tokens=max_tokens), x, g)
    for a, b in zip(eager, captured):
        assert torch.equal(a, b), "expert parallel: the graph's replay differs from the eager call"


def _check_rounding_on_kernels(model, x, g, max_tokens, rank, world):
    """Token rounding over the group on the kernels: the rounded [W·T, E/W] routing through the
    experts' kernels against the same layer on the torch backend. Both take their routing from
    the same router kernels (bf16 x), so only the experts differ; they may differ by what the
    two differ by without rounding (measured here too), doubled, plus bf16's half ulp. The
    rounding must change the output."""
    from machmoe import MoE
    from machmoe.distributed import ExpertParallelMoE

    rounded = MoE(E, K, D, N, add_bias=True, token_rounding="up", tile_m=64).cuda().bfloat16()
    rounded.load_state_dict(model.state_dict())
    runs = {}
    for name, moe in (("rounded", rounded), ("plain", model)):
        for backend in ("machmoe", "torch"):
            layer = ExpertParallelMoE.from_moe(moe, max_tokens=max_tokens)
            layer.backend = functional_backend(backend)
            xi = x.clone().requires_grad_(True)
            out, _ = layer(xi)
            (out.double() * g.double()).sum().backward()
            runs[name, backend] = (out.detach().double(), xi.grad.double())
    assert rel_err(runs["rounded", "machmoe"][0], runs["plain", "machmoe"][0]) > 1e-2, \
        "token rounding changed nothing"
    for i, what in enumerate(("out", "dx")):
        err = rel_err(runs["rounded", "machmoe"][i], runs["rounded", "torch"][i])
        bound = 2 * rel_err(runs["plain", "machmoe"][i], runs["plain", "torch"][i]) + 2 ** -8
        print(f"expert parallel W={world} rank {rank} token rounding: {what} kernels vs torch "
              f"{err:.2e} (bound {bound:.2e})")
        assert err <= bound, f"token rounding on the kernels: {what} {err:.2e} > {bound:.2e}"


def functional_backend(name):
    from machmoe.enums import Backend

    return Backend(name)


def _check_overflow_on_the_gpu(model, x, rank, max_tokens):
    """The fixed-block all-to-all with too small a capacity: nothing is overrun, every rank's output
    of that call is NaN, check_capacity() raises on every rank naming the count and the capacity,
    and the next call with enough capacity is right again (finite, and no error left behind)."""
    from machmoe.distributed import ExpertParallelMoE, check_capacity

    tight = ExpertParallelMoE.from_moe(model, exchange="all_to_all", max_tokens=max_tokens, capacity_factor=0.05)
    out, _ = tight(x)
    assert torch.isnan(out).all(), f"rank {rank}: an overflowing call's output is not all NaN"
    with pytest.raises(RuntimeError, match="capacity of"):
        check_capacity()
    roomy = ExpertParallelMoE.from_moe(model, exchange="all_to_all", max_tokens=max_tokens)
    out, _ = roomy(x)
    check_capacity()
    assert torch.isfinite(out).all(), f"rank {rank}: the call after an overflow is not finite"


def _check_compiled(model, x, g, max_tokens):
    """torch.compile (aot_eager) of the all-gather exchange on the kernels, its transfers overlapped
    and plain: bitwise the eager output and gradients."""
    from machmoe.distributed import ExpertParallelMoE

    for overlap in (False, True):
        _force_transfers_overlapped(overlap)
        layer = ExpertParallelMoE.from_moe(model, max_tokens=max_tokens)
        runs = []
        for fn in (layer, torch.compile(layer, backend="aot_eager")):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out, aux = fn(xi)
            ((out.float() * g).sum() + aux).backward()
            runs.append([out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
        for a, b in zip(*runs):
            assert torch.equal(a, b), f"compiled expert parallel (overlap={overlap}) differs from eager"
    _force_transfers_overlapped(True)


def _force_transfers_overlapped(on: bool) -> None:
    """The all-gather exchange on the kernels with every transfer beside the kernels
    (overlapped_experts, the default), or its plain path."""
    from machmoe import expert_exchange

    expert_exchange._OVERLAP_TRANSFERS = on


def check_ep_layer(layer, rank, world, xs, gs, single, ref, label):
    """An expert-parallel layer on this rank's batch xs[rank] (output gradient gs[rank]), run twice
    (bitwise the same), against the single-GPU layer's (single) and the float64 reference's (ref)
    out, dx and parameter gradients of the ranks' mean loss (_mean_grads): each tensor within 2x
    the single GPU's error against float64, plus 2^-8 (each rank's partial sum is rounded to bf16
    before the combine). Returns the first run's [out, dx, parameter gradients...]."""
    (one_out, one_dx, one_grads), (ref_out, ref_dx, ref_grads) = single, ref
    runs = []
    for _ in range(2):  # twice: bitwise the same
        layer.zero_grad(set_to_none=True)
        x = xs[rank].clone().requires_grad_(True)
        out, _ = layer(x)
        (out.float() * gs[rank]).sum().backward()
        layer.reduce_gradients()
        runs.append([out.detach(), x.grad] + [p.grad.clone() for _, p in layer.named_parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b), f"{label}: two runs differ"
    part = slice(rank * (E // world), (rank + 1) * (E // world))
    checks = [("out", runs[0][0], one_out[rank], ref_out[rank]), ("dx", runs[0][1], one_dx[rank], ref_dx[rank])]
    for (name, _), got in zip(layer.named_parameters(), runs[0][2:]):
        sl = part if name.startswith("c_") else slice(None)
        checks.append((f"d{name}", got, one_grads[name][sl], ref_grads[name][sl]))
    for name, got, one, want in checks:
        err, bound = rel_err(got, want), 2 * rel_err(one, want) + 2 ** -8
        print(f"{label} W={world} rank {rank}: {name} error {err:.2e} "
              f"(single GPU {rel_err(one, want):.2e}, bound {bound:.2e})")
        assert err <= bound, f"{label} W={world} rank {rank}: {name} {err:.2e} > {bound:.2e}"
    return runs[0]


def _check_fp8_on_kernels(rank, world, seed, layout):
    """precision='fp8' on the kernels: the sharded layer (its experts' calls on the gathered rows,
    transfers not overlapped) against the whole FP8 layer on the ranks' batches put end to end
    (test_distributed._check_fp8 says why they agree to bf16 roundings: 2^-7 relative, against
    FP8's ~0.05), with expert biases; and FP8's distance away from the bf16 sharded layer."""
    from machmoe import MoE
    from machmoe.distributed import ExpertParallelMoE

    E, K, d, n, T_rank = 8 * world, 2, 256, 128, 301
    torch.manual_seed(seed)
    full = MoE(E, K, d, n, "swiglu", True, 0.05, gate_up_layout=layout, backend="machmoe", precision="fp8",
               router_bias=True).cuda().bfloat16()
    with torch.no_grad():
        full.c_fc.bias.normal_(0.0, 0.3), full.c_proj.bias.normal_(0.0, 0.1), full.router.bias.normal_(0.0, 0.5)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    xs = [torch.randn(T_rank + q, d, device="cuda", generator=gen).bfloat16() for q in range(world)]
    gs = [torch.randn(T_rank + q, d, device="cuda", generator=gen).bfloat16() for q in range(world)]
    x_all = torch.cat(xs).requires_grad_(True)
    out_all, _ = full(x_all)
    (out_all.float() * torch.cat(gs).float()).sum().backward()
    start = sum(x.shape[0] for x in xs[:rank])
    rows = slice(start, start + xs[rank].shape[0])
    layer = ExpertParallelMoE.from_moe(full, exchange="all_gather", max_tokens=T_rank + world)
    x = xs[rank].clone().requires_grad_(True)
    out, _ = layer(x)
    (out.float() * gs[rank].float()).sum().backward()
    layer.reduce_gradients(average=False)
    part = slice(rank * (E // world), (rank + 1) * (E // world))
    checks = [("out", out, out_all[rows]), ("dx", x.grad, x_all.grad[rows]),
              ("router.weight", layer.router.weight.grad, full.router.weight.grad),
              ("c_fc.weight", layer.c_fc.weight.grad, full.c_fc.weight.grad[part]),
              ("c_fc.bias", layer.c_fc.bias.grad, full.c_fc.bias.grad[part]),
              ("c_proj.weight", layer.c_proj.weight.grad, full.c_proj.weight.grad[part]),
              ("c_proj.bias", layer.c_proj.bias.grad, full.c_proj.bias.grad[part])]
    for what, got, want in checks:
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        print(f"expert parallel fp8 {layout} W={world} rank {rank}: {what} vs the whole FP8 layer {err:.2e}",
              flush=True)
        assert err <= 2.0 ** -7, f"fp8 W={world} rank {rank}: {what} off by {err:.2e}"
    bf16 = ExpertParallelMoE.from_moe(full, exchange="all_gather", max_tokens=T_rank + world)
    bf16.precision, bf16.fp8_cache = type(layer.precision).BF16, None
    with torch.no_grad():
        out_bf16, _ = bf16(xs[rank])
    apart = ((out_bf16.double() - out.double()).norm() / out.double().norm()).item()
    assert apart > 0.01, f"fp8 W={world} rank {rank}: the FP8 result is the bf16 one ({apart:.2e})"


def _ep_worker(rank, world, init_file, seed):
    import copy

    from machmoe.distributed import ExpertParallelMoE

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        model = _model(seed)
        xs, gs = _ep_batch(seed, world, model)
        ref_out, ref_dx, ref_grads = _mean_grads(copy.deepcopy(model).double(),
                                                 [x.double() for x in xs], gs, "torch")
        one_out, one_dx, one_grads = _mean_grads(model, xs, gs, "machmoe")

        for exchange in EP_EXCHANGES(world):
            gathered = exchange["exchange"] == "all_gather"
            results = []
            # The all-gather exchange with its transfers overlapped (the default), then its plain
            # path. out and dx are bitwise the same (each token's sums keep their order); the
            # weight gradients add an expert's rows in another order on ranks > 0 (their rows are
            # rotated), so they are only as close as check_ep_layer asks.
            for overlapped in (True, False) if gathered else (True,):
                _force_transfers_overlapped(overlapped)
                results.append(check_ep_layer(ExpertParallelMoE.from_moe(model, **exchange), rank, world, xs, gs,
                                              (one_out, one_dx, one_grads), (ref_out, ref_dx, ref_grads),
                                              f"expert parallel {exchange} transfers overlapped {overlapped}"))
            for name, a, b in zip(("out", "dx"), results[0], results[-1]):
                assert torch.equal(a, b), f"{exchange}: the overlapped transfers change {name}"
            _force_transfers_overlapped(True)
        if world > 1:
            _check_overflow_on_the_gpu(model, xs[rank], rank, T + 3 * (world - 1))
            _check_compiled(model, xs[rank], gs[rank], T + 3 * (world - 1))
        for overlapped in (True, False):
            _force_transfers_overlapped(overlapped)
            _check_no_sync_and_graph(model, xs[rank], gs[rank], T + 3 * (world - 1))
        _force_transfers_overlapped(True)
        _check_rounding_on_kernels(model, xs[rank], gs[rank], T + 3 * (world - 1), rank, world)
        for layout in ("interleaved", "concatenated"):
            _check_fp8_on_kernels(rank, world, seed, layout)
    finally:
        dist.destroy_process_group()


@pytest.mark.ops
@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_on_the_kernels(world, seed):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (NCCL)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ep_worker, args=(world, os.path.join(tmp, "init"), seed), nprocs=world, join=True)


@pytest.mark.ops
@pytest.mark.parametrize("T,K,E,W", [(1, 2, 8, 2), (1001, 8, 64, 2), (777, 8, 64, 4), (513, 4, 16, 8),
                                     (300, 16, 128, 8), (4099, 8, 128, 1), (50, 3, 9, 3), (6, 128, 128, 128),
                                     (257, 6, 192, 96), (20000, 8, 16384, 64)])
def test_exchange_plan_on_the_kernels_equals_the_torch_plan(T, K, E, W):
    """The exchange_plan op (machmoe::exchange_plan) equals the plan built from torch ops, for
    W > 1 on one GPU (no process group needed): rows, pair grouping, the packed pairs sent, expert
    counts and the row sum. W = 96 and 128 take the kernels' path for more than 64 ranks;
    E = 16384 counts experts in global memory instead of shared memory; K = E = W = 128 puts every
    pair on its own rank."""
    from machmoe.expert_all_to_all import _ExchangePlan

    experts = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()  # [T, K]
    scores = torch.rand(T, K, device="cuda")
    ref = _ExchangePlan(experts.long(), scores, E, W, W - 1, None)
    got = _ExchangePlan(experts, scores, E, W, W - 1, torch.ops.machmoe)
    for name in ("counts", "row_offsets", "pair_row", "order", "inverse", "packed"):
        assert torch.equal(getattr(got, name).long(), getattr(ref, name).long()), name
    assert torch.equal(got.expert_counts.long(), torch.bincount(experts.reshape(-1).long(), minlength=E))
    chunks = ref.send_rows.tolist()
    S = sum(chunks)
    a, b = ref.row_sum(chunks), got.row_sum(chunks)
    assert torch.equal(a.token, b.token.long())
    rows = torch.randn(S, 64, device="cuda").bfloat16()
    # Both add a token's rows in rank order with fp32 accumulation and one rounding: bitwise equal.
    assert torch.equal(a(rows), b(rows))


@pytest.mark.ops
def test_exchange_plan_flags_experts_out_of_range_and_refuses_bad_arguments():
    """An expert id out of [0, E) gets no row and no position; bad arguments raise, naming them."""
    experts = torch.tensor([[0, 5], [3, 9], [7, 1]], dtype=torch.int32, device="cuda")  # 9 >= E
    scores = torch.rand(3, 2, device="cuda")
    counts, row_offsets, *_ = torch.ops.machmoe.exchange_plan(experts, scores, 8, 2, 0)
    # E_local = 4. Valid pairs' ranks: token 0 -> 0, 1; token 1 -> 0 (expert 9 has none); token 2
    # -> 1, 0. So 3 rows and 3 pairs for rank 0, 2 and 2 for rank 1.
    assert counts.tolist() == [[3, 3], [2, 2]]
    assert row_offsets.tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="multiple of W"):
        torch.ops.machmoe.exchange_plan(experts, scores, 9, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        torch.ops.machmoe.exchange_plan(experts, scores, 8, 2, 2)
    with pytest.raises(ValueError, match="scores"):
        torch.ops.machmoe.exchange_plan(experts, scores[:2], 8, 2, 0)


def _symmetric_worker(rank, world, init_file, seed):
    import faulthandler

    from machmoe import symmetric_exchange

    faulthandler.dump_traceback_later(100, exit=True)  # a rank stuck in a collective shows where
    symmetric_exchange.BARRIER_TIMEOUT_MS = 30_000  # a barrier that never completes says which rank
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        name = dist.group.WORLD.group_name
        gen = torch.Generator(device="cuda").manual_seed(seed + rank)
        # Odd rows, three dtypes; the last past the smallest staging buffer (it grows).
        for rows, cols, dtype in ((3, 5, torch.int64), (1001, 257, torch.bfloat16), (4099, 96, torch.float32),
                                  (7, 1, torch.bfloat16), (4501, 1000, torch.bfloat16)):
            t = torch.randn(rows * world, cols, device="cuda", generator=gen).mul(100).to(dtype)
            want = torch.empty(world * t.shape[0], cols, device="cuda", dtype=dtype)
            dist.all_gather_into_tensor(want, t)  # NCCL's, every rank's t in rank order
            print(f"rank {rank}: {dtype} [{rows * world}, {cols}] gathered by NCCL", flush=True)
            (got,) = symmetric_exchange.all_gather_parts_op([t], world, name)
            torch.cuda.synchronize()
            print(f"rank {rank}: {dtype} [{rows * world}, {cols}] gathered from symmetric memory", flush=True)
            assert torch.equal(got, want), f"symmetric all-gather of {dtype} [{rows * world}, {cols}] differs"
            if dtype == torch.int64:
                continue
            blocks = want.view(world, world, rows, cols)[:, rank]  # every rank's block `rank`
            # A copy: for float32, .float() would return blocks[0] itself, and the sum would be
            # written into `want` (rank 0's own block then equals the sum, failing the check below
            # on that rank alone).
            acc = blocks[0].to(torch.float32, copy=True)
            for b in blocks[1:]:
                acc += b.float()
            (scattered,) = symmetric_exchange.reduce_scatter_parts_op([t], world, name)
            assert torch.equal(scattered, acc.to(dtype)), \
                f"symmetric reduce-scatter of {dtype}: not the float32 sum in rank order, rounded once"
            assert not torch.equal(scattered, blocks[rank]), "reduce-scatter returned this rank's own block"
        faulthandler.cancel_dump_traceback_later()
    except BaseException:
        # A failing rank must not wait in destroy_process_group for peers that wait in the next
        # collective for it (that hid this test's failures as hangs): report and leave at once.
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


@pytest.mark.ops
def test_symmetric_memory_collectives_equal_nccls(seed):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs (NCCL)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_symmetric_worker, args=(WORLD, os.path.join(tmp, "init"), seed), nprocs=WORLD, join=True)
