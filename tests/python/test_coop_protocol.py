"""A model of the cooperative grouped GEMM's synchronisation (src/kernels/gemm/cooperative.cuh, the
gathered kernel of the up-projection and dH), run on the CPU under random interleavings: one CTA's
loader warpgroup (it publishes each tile into the ring, waits for empty stages, arms the full
barrier, issues the weight boxes by TMA and the gather by cp.async, and between its loads stores
the staged output units by TMA), its two consumer warpgroups (wgmma groups, one in flight; stage
release one K block late; the staged tile handed to the loaders through epi_full / epi_empty; the
previous unit's A computed from the staged rows under the next tile's K blocks), and the loads and
wgmma groups completing in any order.

Options model the session-32 variants (results/session32/*.patch), not on main (measured slower:
a1 flat to 3% slower, c3 and c4 2-10% slower on the H100, sessions 32 and 33):
  halves      the tile staged in two column units through one buffer (a1): the first unit's A is
              computed before the second unit is staged;
  cluster     CTA pairs over 256-row units (c3): each CTA multicasts one of the two weight boxes
              to both, and a stage is free once the consumers of both CTAs released it;
  empty_idle  with `cluster`, a CTA with no rows in its unit only waits for and releases its
              stages (c4) instead of computing and staging an empty tile.

It checks: no deadlock; no stage refilled (in this CTA or, by multicast, the peer) while a wgmma
group reads it; no stage read before all of its fill landed; the staging buffer never written
while the TMA store of the previous unit still reads it; a consumer's A never read from a
buffer restaged under it; every staged unit stored once, in order. Mutated protocols must fail, so
that the model can fail. It mirrors the kernel by hand: change both together.

The mbarrier model and the random scheduler are mbarrier_model.py's."""

import random

import pytest
from mbarrier_model import RING, Mbar, drive, wait


def run(tiles, k_blocks, stages, seed, halves=False, cluster=False, empty_idle=False, mutation=None):
    rnd = random.Random(seed)
    ctas = 2 if cluster else 1
    parts = 2 if halves else 1
    # A pair's unit t: rank 1 has no rows in every third unit (an expert's odd last 128 rows).
    def rows(r, t):
        return 0 if (r == 1 and t % 3 == 2) else 1

    peer_waited = mutation != "peer not waited"
    full = [[Mbar(2) for _ in range(stages)] for _ in range(ctas)]  # the gather's arrival + expect_tx's
    empty = [[Mbar(4 if cluster and peer_waited else 2) for _ in range(stages)] for _ in range(ctas)]
    tile_full = [[Mbar(1) for _ in range(RING)] for _ in range(ctas)]
    tile_empty = [[Mbar(2) for _ in range(RING)] for _ in range(ctas)]  # both consumer warpgroups
    ring = [[None] * RING for _ in range(ctas)]
    epi_full = [Mbar(2) for _ in range(ctas)]  # both consumer warpgroups staged their rows
    epi_empty = [Mbar(1) for _ in range(ctas)]  # the loaders are done with the unit
    epi_tile = [None] * ctas
    buf = [[None, None] for _ in range(ctas)]  # the staged unit in each warpgroup's rows
    store_reading = [None] * ctas  # the unit a TMA store is reading from the buffer
    stored = [[] for _ in range(ctas)]
    landed = [[{} for _ in range(stages)] for _ in range(ctas)]  # stage -> {source: it}
    sources = ("A", "B0", "B1")  # the gathered rows and the weight tile's two boxes
    inflight = []  # (cta, stage, it, source)
    groups = {(r, c): [] for r in range(ctas) for c in (0, 1)}  # wgmma groups in flight: (stage, it)

    def loader(r):
        ep = {"n": 0, "unit": None}

        def epi_step():  # one slice of the staged unit's store: issue it, then (next step) finish it
            if ep["unit"] is None:
                if not epi_full[r].passed(ep["n"] & 1):
                    return False
                unit = epi_tile[r]
                if unit == "stop":
                    return True
                assert buf[r][0] == buf[r][1] == unit, f"CTA {r}: storing {unit}, the buffer holds {buf[r]}"
                ep["unit"] = unit
                store_reading[r] = unit
                stored[r].append(unit)
                return False
            store_reading[r] = None  # bulk_wait_read: the TMA store has read the unit
            ep["unit"] = None
            epi_empty[r].arrive()
            ep["n"] += 1
            return False

        for n in range(tiles + 1):
            slot = n % RING
            yield from wait(lambda: tile_empty[r][slot].passed(((n // RING) & 1) ^ 1))
            ring[r][slot] = n if n < tiles else -1
            tile_full[r][slot].arrive()
            if n == tiles:
                break
            for kb in range(k_blocks):
                it = n * k_blocks + kb
                s = it % stages
                while not empty[r][s].passed(((it // stages) & 1) ^ 1):
                    epi_step()
                    yield
                targets = [r, r ^ 1] if cluster else [r]  # this CTA's weight box lands in both
                for dst in targets:
                    for c in (0, 1):
                        assert all(g[0] != s for g in groups[(dst, c)]), \
                            f"CTA {r} refills stage {s} (it {it}) of CTA {dst} while a wgmma reads it"
                full[r][s].tx += 2  # expect_tx: both weight boxes (the peer's multicast one with a pair)
                full[r][s].arrive()
                if cluster:
                    inflight.append((r, s, it, f"B{r}"))
                    inflight.append((r ^ 1, s, it, f"B{r}"))
                else:
                    inflight.append((r, s, it, "B0"))
                    inflight.append((r, s, it, "B1"))
                inflight.append((r, s, it, "A"))  # the gather (cp.async arrive.noinc when it lands)
                epi_step()
                yield
        while True:  # drain: the staged units until the consumers say stop
            if epi_step():
                return
            yield

    def consumer(r, c):
        staged, it, n = 0, 0, 0
        aw = None  # the staged unit whose A this warpgroup still computes from its rows

        def act_step():
            assert buf[r][c] == aw, f"CTA {r} consumer {c}: computing A of {aw} from a buffer holding {buf[r][c]}"

        def release(s):
            empty[r][s].arrive()
            if cluster and peer_waited:
                empty[r ^ 1][s].arrive()

        while True:
            slot = n % RING
            yield from wait(lambda: tile_full[r][slot].passed((n // RING) & 1))
            tile = ring[r][slot]
            tile_empty[r][slot].arrive()
            n += 1
            if tile < 0:
                break
            if cluster and empty_idle and rows(r, tile) == 0:
                for kb in range(k_blocks):
                    s = it % stages
                    yield from wait(lambda: full[r][s].passed((it // stages) & 1))
                    if mutation != "idle CTA does not release":
                        release(s)
                    if aw is not None:
                        act_step()
                    it += 1
                    yield
                continue
            prev = -1
            for kb in range(k_blocks):
                s = it % stages
                yield from wait(lambda: full[r][s].passed((it // stages) & 1))
                assert landed[r][s] == {src: it for src in sources}, \
                    f"CTA {r} consumer {c} read stage {s} holding {landed[r][s]}, wanted {it}"
                groups[(r, c)].append((s, it))  # commit
                yield
                if mutation == "release the stage in flight":
                    release(s)
                else:
                    yield from wait(lambda: len(groups[(r, c)]) <= 1)  # wgmma_wait<1>
                    if prev >= 0:
                        release(prev)
                prev = s
                if aw is not None:
                    act_step()
                it += 1
            yield from wait(lambda: not groups[(r, c)])  # wgmma_wait<0>
            if mutation != "release the stage in flight":
                release(prev)
            if aw is not None:
                act_step()
                aw = None
            for part in range(parts):
                if not (mutation == "second half without epi_empty" and part == 1):
                    yield from wait(lambda: epi_empty[r].passed((staged & 1) ^ 1))
                assert store_reading[r] is None, \
                    f"CTA {r} consumer {c} stages ({tile}, {part}) while the store of {store_reading[r]} reads the buffer"
                buf[r][c] = (tile, part)
                if c == 0:
                    epi_tile[r] = (tile, part)
                yield
                epi_full[r].arrive()
                staged += 1
                aw = (tile, part)
                if part + 1 < parts:
                    for _ in range(rnd.randint(0, 2)):  # the first half's A, before the second is staged
                        act_step()
                        yield
                    aw = None
        if aw is not None:
            act_step()
        yield from wait(lambda: epi_empty[r].passed((staged & 1) ^ 1))
        if c == 0:
            epi_tile[r] = "stop"
        epi_full[r].arrive()

    def land(event):  # loads land in any order
        r, s, it, src = event
        landed[r][s][src] = it
        if src == "A":
            full[r][s].arrive()  # the gather's cp.async arrival
        else:
            full[r][s].tx -= 1
            full[r][s].check()

    agents = {}
    for r in range(ctas):
        agents[("loader", r)] = loader(r)
        for c in (0, 1):
            agents[(r, c)] = consumer(r, c)
    drive(rnd, agents, inflight, land, groups)
    for r in range(ctas):
        want = [(t, p) for t in range(tiles) for p in range(parts)
                if not (cluster and empty_idle and rows(r, t) == 0)]
        assert stored[r] == want, f"CTA {r} stored {stored[r]}, wanted {want}"


SHAPES = [(tiles, kb, s) for tiles in (0, 1, 2, 3, 5) for kb in (1, 2, 5) for s in (3, 4)]
VARIANTS = {"main": {}, "halves": {"halves": True}, "pair": {"halves": True, "cluster": True},
            "pair, empty CTA idle": {"halves": True, "cluster": True, "empty_idle": True},
            "pair, whole tile": {"cluster": True}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cooperative_protocol_holds_under_random_interleavings(variant):
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(12):
            run(tiles, k_blocks, stages, seed, **VARIANTS[variant])


@pytest.mark.parametrize("mutation,variant", [
    ("peer not waited", "pair"), ("release the stage in flight", "main"),
    ("second half without epi_empty", "halves"), ("idle CTA does not release", "pair, empty CTA idle")])
def test_cooperative_protocol_model_catches_a_broken_protocol(mutation, variant):
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(12):
            try:
                run(tiles, k_blocks, stages, seed, mutation=mutation, **VARIANTS[variant])
            except AssertionError:
                return  # noticed
    pytest.fail(f"the model did not notice '{mutation}'")
