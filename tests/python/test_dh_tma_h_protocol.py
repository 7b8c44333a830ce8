"""A model of the H sub-tile pipeline of the dH ping-pong kernel's MACHMOE_DH_PINGPONG=2 variant
(src/kernels/sm90_grouped_gemm_dact_pingpong.cuh, sm90_grouped_gemm_dact_pingpong_tma_h), run on the
CPU under random interleavings: one consumer warpgroup's threads (a few stand for 128), its
issuing thread, and the TMA loads landing in any order.

Per full tile the consumer syncs its warpgroup, its thread 0 issues sub-tiles 0..B-1 into buffers
(issued % B); for k = 0..7 every thread waits on buffer (used % B)'s barrier for parity
(used / B) & 1, reads it, and for k + B < 8 syncs the warpgroup and thread 0 issues sub-tile k + B
into the buffer just read. A partial tile loads no H. The model checks what a GPU run can miss by
luck: every read sees the sub-tile it expects, fully landed, never one being overwritten; no
deadlock; no load left in flight at the end. Mutated protocols (no sync before a reissue, the
wrong buffer, the wrong parity) must fail, so the model can fail. It mirrors the kernel by hand:
change both together.

mbarrier model as in test_pingpong_protocol.py: a wait for parity P passes once the number of
completed phases has the other parity."""

import random

import pytest

B = 3         # Smem::kHBufs
SUBTILES = 8  # two 64-row chains x four 32-column sub-tiles


def run(tiles, threads, seed, mutation=None):
    rnd = random.Random(seed)
    full = [rnd.random() < 0.8 for _ in range(tiles)]  # a partial tile (False) loads no H
    content = [None] * B   # (tile, k) landed in each buffer
    phases = [0] * B       # completed phases of each buffer's barrier
    in_flight = []         # (buffer, (tile, k)) issued, not landed
    reading = [None] * B   # set of threads between their wait and the end of their read
    issued = [0]           # thread 0's count, shared (every thread keeps the same count)
    sync = {"arrived": 0, "generation": 0}

    def issue(tile, k):
        b = issued[0] % B
        if mutation == "wrong buffer":
            b = (issued[0] + 1) % B
        assert not any(fb == b for fb, _ in in_flight), f"buffer {b} reissued while a load into it is in flight"
        assert not reading[b], f"buffer {b} overwritten while threads {sorted(reading[b])} read it"
        in_flight.append((b, (tile, k)))
        content[b] = None
        issued[0] += 1

    def barrier():  # named_barrier_sync(2 + c, 128): every thread of the warpgroup
        gen = sync["generation"]
        sync["arrived"] += 1
        if sync["arrived"] == threads:
            sync["arrived"] = 0
            sync["generation"] += 1
        while sync["generation"] == gen:
            yield

    def thread(t):
        used = 0
        counted = 0  # this thread's copy of `issued` (thread 0 also does the issuing)
        for tile in range(tiles):
            if not full[tile]:
                for _ in range(rnd.randint(0, 2)):
                    yield
                continue
            yield from barrier()
            for k in range(B):
                if t == 0:
                    issue(tile, k)
                counted += 1
            for k in range(SUBTILES):
                b = used % B
                parity = (used // B) & 1
                if mutation == "wrong parity":
                    parity ^= 1
                while (phases[b] & 1) == parity:
                    yield
                assert content[b] == (tile, k), f"thread {t} read {content[b]} in buffer {b}, wanted {(tile, k)}"
                reading[b] = (reading[b] or set()) | {t}
                for _ in range(rnd.randint(0, 2)):
                    yield
                    assert content[b] == (tile, k), f"buffer {b} changed under thread {t}'s read"
                reading[b].discard(t)
                used += 1
                if k + B < SUBTILES:
                    if mutation != "no sync before a reissue":
                        yield from barrier()
                    if t == 0:
                        issue(tile, k + B)
                    counted += 1
        assert counted == issued[0] or t != 0

    agents = {t: thread(t) for t in range(threads)}
    for _ in range(200000):
        if not agents and not in_flight:
            break
        choices = list(agents) + (["tma"] if in_flight else [])
        pick = choices[rnd.randrange(len(choices))]
        if pick == "tma":
            b, tag = in_flight.pop(rnd.randrange(len(in_flight)))  # loads land in any order
            content[b] = tag
            phases[b] += 1
            continue
        try:
            next(agents[pick])
        except StopIteration:
            del agents[pick]
    else:
        raise AssertionError("deadlock: no progress in 200000 steps")
    assert not agents, "deadlock"
    assert not in_flight, "a load left in flight"


def test_dh_tma_h_pipeline_holds_under_random_interleavings():
    for tiles, threads in [(1, 2), (3, 3), (6, 4)]:
        for seed in range(60):
            run(tiles, threads, seed)


@pytest.mark.parametrize("mutation", ["no sync before a reissue", "wrong buffer", "wrong parity"])
def test_dh_tma_h_model_catches_a_broken_protocol(mutation):
    for tiles, threads in [(1, 2), (3, 3), (6, 4)]:
        for seed in range(60):
            try:
                run(tiles, threads, seed, mutation)
            except AssertionError:
                return  # noticed
    pytest.fail(f"the model did not notice '{mutation}'")
