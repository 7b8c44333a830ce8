"""A model of the ping-pong grouped GEMM's synchronisation (src/kernels/sm90_grouped_gemm_pingpong.cuh),
run on the CPU under random interleavings: one CTA's producer thread, its two consumer warpgroups,
the TMA completions and the wgmma groups in flight.

It checks what a GPU run can miss by luck: no deadlock; no stage overwritten while a wgmma group
still reads it; no stage read before the fill it waited for (a parity wait two phases ahead);
both consumers see one stop signal each; no named-barrier arrival left over at exit. Mutated
protocols (a turn skipped, the turns removed, two wgmma groups kept in flight) must fail, so
the model can fail. It mirrors the kernel by hand: change both together.

mbarrier model: a barrier completes a phase when its pending arrivals and transaction bytes reach
zero; a parity wait for P passes once the phase count's parity differs from P (the hardware rule
for waits at most one phase ahead, which is what the kernel relies on)."""

import random

import pytest

RING = 8  # kTileRing


class Mbar:
    def __init__(self, count):
        self.count, self.pending, self.phases, self.tx = count, count, 0, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count"
        self.check()

    def check(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def passed(self, parity):
        return (self.phases & 1) != parity


class NamedBarrier:  # bar.sync / bar.arrive with count 256: two warpgroups
    def __init__(self):
        self.arrived, self.generation = 0, 0


def run(tiles, k_blocks, stages, seed, mutation=None):
    rnd = random.Random(seed)
    full = [Mbar(1) for _ in range(stages)]
    empty = [Mbar(1) for _ in range(stages)]
    tile_full = [Mbar(1) for _ in range(RING)]
    tile_empty = [Mbar(1) for _ in range(RING)]  # (128 arrivals in the kernel: one warpgroup, as one here)
    ring = [None] * RING
    landed = [None] * stages  # which fill `it` the stage holds
    turn = {4: NamedBarrier(), 5: NamedBarrier()}
    tma = []                  # (stage, it) in flight
    groups = {0: [], 1: []}   # wgmma groups in flight per consumer: (stage, it)

    def wait(cond):
        while not cond():
            yield

    def nb_arrive(i):
        b = turn[i]
        b.arrived += 1
        if b.arrived == 2:
            b.arrived, b.generation = 0, b.generation + 1

    def nb_sync(i):
        b = turn[i]
        gen = b.generation
        nb_arrive(i)
        yield from wait(lambda: b.generation != gen)

    def producer():
        stops, n = 0, 0
        while True:
            done = n >= tiles
            tile = -1 - stops if done else n
            slot = n % RING
            yield from wait(lambda: tile_empty[slot].passed(((n // RING) & 1) ^ 1))
            ring[slot] = tile
            tile_full[slot].arrive()
            n += 1
            if done:
                stops += 1
                if stops == 2:
                    return
                continue
            for kb in range(k_blocks):
                it = (n - 1) * k_blocks + kb
                s = it % stages
                yield from wait(lambda: empty[s].passed(((it // stages) & 1) ^ 1))
                for c in (0, 1):
                    assert all(g[0] != s for g in groups[c]), f"stage {s} refilled (it {it}) while a wgmma reads it"
                full[s].tx += 1  # expect_tx
                full[s].arrive()
                tma.append((s, it))
                yield

    def consumer(c):
        if c == 1 and mutation != "no turns":
            nb_arrive(4)  # consumer 0 goes first
        n = c
        while True:
            slot = n % RING
            yield from wait(lambda: tile_full[slot].passed((n // RING) & 1))
            tile = ring[slot]
            tile_empty[slot].arrive()
            take_turn = tile >= 0 if mutation == "skip the first stop's turn" else tile != -2
            if take_turn and mutation != "no turns":
                yield from nb_sync(4 + c)
            if tile < 0:
                return tile
            assert tile == n
            prev = -1
            for kb in range(k_blocks):
                it = n * k_blocks + kb
                s = it % stages
                yield from wait(lambda: full[s].passed((it // stages) & 1))
                assert landed[s] == it, f"consumer {c} read stage {s} holding fill {landed[s]}, wanted {it}"
                groups[c].append((s, it))  # commit
                yield
                in_flight = 2 if mutation == "two groups in flight" else 1
                yield from wait(lambda: len(groups[c]) <= in_flight)  # wgmma_wait<1>
                if prev >= 0:
                    empty[prev].arrive()
                prev = s
            if mutation != "no turns":
                nb_arrive(4 + (c ^ 1))  # hand over the turn before the drain
            yield from wait(lambda: not groups[c])  # wgmma_wait<0>
            empty[prev].arrive()
            for _ in range(rnd.randint(0, 3)):  # the epilogue
                yield
            n += 2

    agents = {"producer": producer(), 0: consumer(0), 1: consumer(1)}
    stops = {}
    for _ in range(200000):
        if not agents:
            break
        choices = list(agents) + (["tma"] if tma else []) + [f"wgmma{c}" for c in (0, 1) if groups[c]]
        pick = rnd.choice(choices)
        if pick == "tma":
            s, it = tma.pop(0)
            landed[s] = it
            full[s].tx -= 1
            full[s].check()
        elif isinstance(pick, str) and pick.startswith("wgmma"):
            groups[int(pick[-1])].pop(0)
        else:
            try:
                next(agents[pick])
            except StopIteration as stop:
                if pick != "producer":
                    stops[pick] = stop.value
                del agents[pick]
    else:
        raise AssertionError("deadlock")
    assert turn[4].arrived == 0 and turn[5].arrived == 0, "a named-barrier arrival left at exit"
    assert sorted(stops.values()) == [-2, -1], f"stop signals seen: {stops}"


SHAPES = [(tiles, kb, s) for tiles in (0, 1, 2, 3, 5, 8) for kb in (1, 2, 4, 7) for s in (3, 4)]


def test_pingpong_protocol_holds_under_random_interleavings():
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(40):
            run(tiles, k_blocks, stages, seed)


@pytest.mark.parametrize("mutation", ["skip the first stop's turn", "no turns", "two groups in flight"])
def test_pingpong_protocol_model_catches_a_broken_protocol(mutation):
    failures = 0
    for tiles, k_blocks, stages in SHAPES:
        for seed in range(40):
            try:
                run(tiles, k_blocks, stages, seed, mutation)
            except AssertionError:
                failures += 1
    assert failures > 0, f"the model did not notice '{mutation}'"
