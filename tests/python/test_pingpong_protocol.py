"""A model of the ping-pong grouped GEMM's synchronisation (src/kernels/gemm/pingpong.cuh),
run on the CPU under random interleavings: one CTA's scheduler and loading threads, its two consumer warpgroups,
the TMA completions (in any order) and the wgmma groups in flight; or the two CTAs of a cluster
(MACHMOE_GEMM_PINGPONG=2), whose stages also fill from the peer's multicast; with `ring_epi`
(MACHMOE_GEMM_PINGPONG=5/6) the consumers also take the one staging ring in turn (named barriers 6, 7).
With `self_publish` it is the dH kernel's (src/kernels/gemm/dact_pingpong.cuh): no
scheduler thread; the loading thread decodes and publishes each tile itself before loading it, then
both stop signals, and only the consumers read the ring.

It checks what a GPU run can miss by luck: no deadlock; no stage overwritten while a wgmma group
still reads it; no stage read before the fill it waited for (a parity wait two phases ahead);
both consumers see one stop signal each; no named-barrier arrival left over at exit; never two
consumers in the staging ring at once. Mutated
protocols (a turn skipped, the turns removed, two wgmma groups kept in flight, a CTA refilling a
stage without waiting for the peer's consumer) must fail, so the model can fail. It mirrors the
kernel by hand: change both together.

The mbarrier model and the random scheduler are mbarrier_model.py's."""

import random

import pytest
from mbarrier_model import RING, Mbar, drive, wait


class NamedBarrier:  # bar.sync / bar.arrive with count 256: two warpgroups
    def __init__(self):
        self.arrived, self.generation = 0, 0


def run(tiles, k_blocks, stages, seed, mutation=None, cluster=False, ring_epi=False, self_publish=False):
    """One CTA, or with `cluster` the two CTAs of MACHMOE_GEMM_PINGPONG=2: each stage then fills
    from the CTA's own loads and from the peer's multicast, and is free once both CTAs' consumers
    released it."""
    rnd = random.Random(seed)
    ctas = 2 if cluster else 1
    sources = 2 if cluster else 1  # loads that land in a stage: own (A + own weight boxes), peer's multicast
    empty_count = 2 if cluster and mutation != "peer not waited" else 1
    full = [[Mbar(1) for _ in range(stages)] for _ in range(ctas)]
    empty = [[Mbar(empty_count) for _ in range(stages)] for _ in range(ctas)]
    tile_full = [[Mbar(1) for _ in range(RING)] for _ in range(ctas)]
    # the consumer (128 arrivals in the kernel) and the loading thread
    loader_waited = mutation != "loader not waited" and not self_publish
    tile_empty = [[Mbar(2 if loader_waited else 1) for _ in range(RING)] for _ in range(ctas)]
    ring = [[None] * RING for _ in range(ctas)]
    landed = [[[None] * sources for _ in range(stages)] for _ in range(ctas)]  # fill `it` per source
    turn = [{i: NamedBarrier() for i in (4, 5, 6, 7)} for _ in range(ctas)]
    ring_owner = [None] * ctas  # the consumer staging into the ring (ring_epi)
    epi_turns = ring_epi and mutation != "no epilogue turns"
    tma = []  # (cta, stage, it, source) in flight
    groups = {(r, c): [] for r in range(ctas) for c in (0, 1)}  # wgmma groups in flight: (stage, it)

    def nb_arrive(r, i):
        b = turn[r][i]
        b.arrived += 1
        if b.arrived == 2:
            b.arrived, b.generation = 0, b.generation + 1

    def nb_sync(r, i):
        b = turn[r][i]
        gen = b.generation
        nb_arrive(r, i)
        yield from wait(lambda: b.generation != gen)

    def scheduler(r):  # warp 1: decodes the tiles into the ring, ahead of everyone
        stops, n = 0, 0
        while True:
            done = n >= tiles
            tile = -1 - stops if done else n
            slot = n % RING
            yield from wait(lambda: tile_empty[r][slot].passed(((n // RING) & 1) ^ 1))
            ring[r][slot] = tile
            tile_full[r][slot].arrive()
            n += 1
            if done:
                stops += 1
                if stops == 2:
                    return
            yield

    def producer(r):  # warp 0: the loads, every tile up to the first stop signal
        n = 0
        while True:
            slot = n % RING
            yield from wait(lambda: tile_full[r][slot].passed((n // RING) & 1))
            tile = ring[r][slot]
            if loader_waited:
                tile_empty[r][slot].arrive()
            n += 1
            if tile < 0:
                return
            assert tile == n - 1, f"CTA {r}: the loader read tile {tile} for tile {n - 1} (a slot overwritten)"
            for kb in range(k_blocks):
                it = (n - 1) * k_blocks + kb
                s = it % stages
                yield from wait(lambda: empty[r][s].passed(((it // stages) & 1) ^ 1))
                for dst in range(ctas):  # the multicast writes the peer's stage too
                    for c in (0, 1):
                        assert all(g[0] != s for g in groups[(dst, c)]), \
                            f"CTA {r} refills stage {s} (it {it}) of CTA {dst} while a wgmma reads it"
                full[r][s].tx += sources  # expect_tx: every byte that lands in this CTA's stage
                full[r][s].arrive()
                tma.append((r, s, it, 0))
                if cluster:
                    tma.append((r ^ 1, s, it, 1))
                yield

    def loads(r, n):  # tile n's K blocks into the stages (with `cluster`, also the peer's by multicast)
        for kb in range(k_blocks):
            it = n * k_blocks + kb
            s = it % stages
            yield from wait(lambda: empty[r][s].passed(((it // stages) & 1) ^ 1))
            for dst in range(ctas):
                for c in (0, 1):
                    assert all(g[0] != s for g in groups[(dst, c)]), \
                        f"CTA {r} refills stage {s} (it {it}) of CTA {dst} while a wgmma reads it"
            full[r][s].tx += sources
            full[r][s].arrive()
            tma.append((r, s, it, 0))
            if cluster:
                tma.append((r ^ 1, s, it, 1))
            yield

    def publishing_loader(r):  # the dH kernel's loader thread 0: publish tile n, then load it
        n = 0
        while True:
            done = n >= tiles
            slot = n % RING
            yield from wait(lambda: tile_empty[r][slot].passed(((n // RING) & 1) ^ 1))
            ring[r][slot] = -1 if done else n
            tile_full[r][slot].arrive()
            if done:
                if mutation == "one stop signal":
                    return
                slot2 = (n + 1) % RING
                yield from wait(lambda: tile_empty[r][slot2].passed((((n + 1) // RING) & 1) ^ 1))
                ring[r][slot2] = -2
                tile_full[r][slot2].arrive()
                return
            yield from loads(r, n)
            n += 1

    def consumer(r, c):
        if c == 1 and mutation != "no turns":
            nb_arrive(r, 4)  # consumer 0 goes first
        if c == 1 and epi_turns:
            nb_arrive(r, 6)  # and has the ring first
        n = c
        while True:
            slot = n % RING
            yield from wait(lambda: tile_full[r][slot].passed((n // RING) & 1))
            tile = ring[r][slot]
            tile_empty[r][slot].arrive()
            take_turn = tile >= 0 if mutation == "skip the first stop's turn" else tile != -2
            if take_turn and mutation != "no turns":
                yield from nb_sync(r, 4 + c)
            if epi_turns and tile == -1 and mutation != "skip the first stop's ring turn":
                yield from nb_sync(r, 6 + c)
            if tile < 0:
                return tile
            assert tile == n
            prev = -1

            def release(s):
                empty[r][s].arrive()
                if cluster and mutation != "peer not waited":
                    empty[r ^ 1][s].arrive()

            for kb in range(k_blocks):
                it = n * k_blocks + kb
                s = it % stages
                yield from wait(lambda: full[r][s].passed((it // stages) & 1))
                assert landed[r][s] == [it] * sources, f"CTA {r} consumer {c} read stage {s} holding {landed[r][s]}, wanted {it}"
                groups[(r, c)].append((s, it))  # commit
                yield
                in_flight = 2 if mutation == "two groups in flight" else 1
                yield from wait(lambda: len(groups[(r, c)]) <= in_flight)  # wgmma_wait<1>
                if prev >= 0:
                    release(prev)
                prev = s
            if mutation != "no turns":
                nb_arrive(r, 4 + (c ^ 1))  # hand over the turn before the drain
            yield from wait(lambda: not groups[(r, c)])  # wgmma_wait<0>
            release(prev)
            if epi_turns:
                yield from nb_sync(r, 6 + c)
            if ring_epi:
                assert ring_owner[r] is None, f"CTA {r}: consumers {ring_owner[r]} and {c} both in the staging ring"
                ring_owner[r] = c
            for _ in range(rnd.randint(1 if ring_epi else 0, 3)):  # the epilogue
                yield
            if ring_epi:
                ring_owner[r] = None
            if epi_turns:
                nb_arrive(r, 6 + (c ^ 1))
            n += 2

    def land(event):  # loads land in any order
        r, s, it, src = event
        landed[r][s][src] = it
        full[r][s].tx -= 1
        full[r][s].check()

    agents = {}
    for r in range(ctas):
        if self_publish:
            agents[("producer", r)] = publishing_loader(r)
        else:
            agents[("producer", r)] = producer(r)
            agents[("scheduler", r)] = scheduler(r)
        for c in (0, 1):
            agents[(r, c)] = consumer(r, c)
    results = drive(rnd, agents, tma, land, groups)
    stops = {k: v for k, v in results.items() if k[0] not in ("producer", "scheduler")}
    for r in range(ctas):
        assert all(b.arrived == 0 for b in turn[r].values()), "a named-barrier arrival left at exit"
        assert sorted(v for (rr, _), v in stops.items() if rr == r) == [-2, -1], f"stop signals seen: {stops}"


SHAPES = [(tiles, kb, s) for tiles in (0, 1, 2, 3, 5, 8) for kb in (1, 2, 4, 7) for s in (3, 4)]


@pytest.mark.parametrize("cluster,ring_epi", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["one CTA", "CTA pair", "one CTA, ring", "CTA pair, ring"])
def test_pingpong_protocol_holds_under_random_interleavings(cluster, ring_epi):
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(40 if not cluster else 15):
            run(tiles, k_blocks, stages, seed, cluster=cluster, ring_epi=ring_epi)


@pytest.mark.parametrize("mutation,cluster,ring_epi", [
    ("skip the first stop's turn", False, False), ("no turns", False, False), ("two groups in flight", False, False),
    ("peer not waited", True, False), ("no epilogue turns", False, True), ("skip the first stop's ring turn", False, True),
    ("loader not waited", False, False)])
def test_pingpong_protocol_model_catches_a_broken_protocol(mutation, cluster, ring_epi):
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(40 if not cluster else 15):
            try:
                run(tiles, k_blocks, stages, seed, mutation, cluster, ring_epi)
            except AssertionError:
                return  # noticed
    pytest.fail(f"the model did not notice '{mutation}'")


def test_dh_pingpong_protocol_holds_under_random_interleavings():
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(40):
            run(tiles, k_blocks, stages, seed, self_publish=True)


@pytest.mark.parametrize("mutation", ["one stop signal", "skip the first stop's turn", "two groups in flight"])
def test_dh_pingpong_protocol_model_catches_a_broken_protocol(mutation):
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(40):
            try:
                run(tiles, k_blocks, stages, seed, mutation, self_publish=True)
            except AssertionError:
                return  # noticed
    pytest.fail(f"the model did not notice '{mutation}'")
