"""A model of the H / dH / A' sub-tile pipeline of the dH ping-pong kernel's MACHMOE_DH_PINGPONG=2
variant (src/kernels/sm90_grouped_gemm_dact_pingpong.cuh, sm90_grouped_gemm_dact_pingpong_tma_h),
run on the CPU under random interleavings: one consumer warpgroup's threads (a few stand for
128), its issuing thread 0, the TMA loads landing and the TMA stores reading their shared-memory
source in any order.

The protocol (session 29). Per full tile, thread 0 issues H sub-tiles 0..AHEAD-1 into H buffers
(issued % B). For k = 0..7 every thread waits on H buffer (used % B)'s barrier for parity
(used / B) & 1, reads its H there and writes its dH back in place, and writes its A' into A'
buffer (used % A); then thread 0 waits until every store it issued has read its source
(bulk_wait_read<0>), every thread fences and meets at the warpgroup barrier; thread 0 issues the
TMA stores of both buffers and, for k + AHEAD < 8, the H load of sub-tile k + AHEAD into H buffer
(issued % B). At the end thread 0 waits for its stores (bulk_wait_all). A partial tile touches no
buffer. The model checks what a GPU run can miss by luck: every H read sees its sub-tile fully
landed; no buffer is reloaded or rewritten while a store still has to read it; every store reads
the dH and A' of all threads for its own sub-tile; no deadlock; nothing left in flight. Mutated
protocols must fail, so the model can fail. It mirrors the kernel by hand: change both together.

mbarrier model as in test_pingpong_protocol.py: a wait for parity P passes once the number of
completed phases has the other parity."""

import random

import pytest

B = 3         # Smem::kHBufs
A = 2         # Smem::kABufs
AHEAD = 2     # kHAhead = kHBufs - 1
SUBTILES = 8  # two 64-row chains x four 32-column sub-tiles


def run(tiles, threads, seed, mutation=None):
    rnd = random.Random(seed)
    ahead = AHEAD + 1 if mutation == "three ahead" else AHEAD
    full = [rnd.random() < 0.8 for _ in range(tiles)]  # a partial tile (False) touches no buffer
    h_content = [None] * B    # ("H", tile, k) landed, or ("dH", tile, k, writers)
    a_content = [None] * A    # ("A'", tile, k, writers)
    phases = [0] * B          # completed phases of each H buffer's barrier
    loads = []                # (buffer, (tile, k)) issued, not landed
    stores = []               # (h buffer, a buffer, (tile, k)) issued, source not yet read
    reading = [set() for _ in range(B)]  # threads between their wait and their dH write
    issued = [0]
    sync = {"arrived": 0, "generation": 0}

    def load(tile, k):
        b = issued[0] % B
        if mutation == "wrong buffer":
            b = (issued[0] + 1) % B
        assert not any(lb == b for lb, _ in loads), f"H buffer {b} reloaded while a load into it is in flight"
        assert not any(hb == b for hb, _, _ in stores), f"H buffer {b} reloaded before its store read it"
        assert not reading[b], f"H buffer {b} reloaded while threads {sorted(reading[b])} read it"
        loads.append((b, (tile, k)))
        h_content[b] = None
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
        for tile in range(tiles):
            if not full[tile]:
                for _ in range(rnd.randint(0, 2)):
                    yield
                continue
            if t == 0:
                for k in range(ahead):
                    load(tile, k)
            for k in range(SUBTILES):
                b, a = used % B, used % A
                parity = (used // B) & 1
                if mutation == "wrong parity":
                    parity ^= 1
                while (phases[b] & 1) == parity:
                    yield
                assert h_content[b] is not None and h_content[b][1:3] == (tile, k), \
                    f"thread {t} read {h_content[b]} in H buffer {b}, wanted {(tile, k)}"
                reading[b].add(t)
                for _ in range(rnd.randint(0, 2)):
                    yield
                    assert h_content[b] is not None and h_content[b][1:3] == (tile, k), \
                        f"H buffer {b} changed under thread {t}'s read"
                # dH in place, A' into its buffer (this thread's bytes only)
                writers = h_content[b][3] if h_content[b][0] == "dH" else frozenset()
                h_content[b] = ("dH", tile, k, writers | {t})
                reading[b].discard(t)
                assert not any(ab == a for _, ab, _ in stores), f"A' buffer {a} rewritten before its store read it"
                a_writers = a_content[a][3] if a_content[a] and a_content[a][1:3] == (tile, k) else frozenset()
                a_content[a] = ("A'", tile, k, a_writers | {t})
                if t == 0 and mutation != "no read wait":
                    while stores:  # bulk_wait_read<0>
                        yield
                if mutation == "store before the barrier" and t == 0:
                    stores.append((b, a, (tile, k)))
                yield from barrier()
                if t == 0:
                    if mutation != "store before the barrier":
                        stores.append((b, a, (tile, k)))
                    if k + ahead < SUBTILES:
                        load(tile, k + ahead)
                used += 1
        if t == 0:
            while stores:  # bulk_wait_all
                yield

    def store_reads(i):
        hb, ab, (tile, k) = stores.pop(i)
        everyone = frozenset(range(threads))
        assert h_content[hb] == ("dH", tile, k, everyone), f"store of {(tile, k)} read H buffer {hb}: {h_content[hb]}"
        assert a_content[ab] == ("A'", tile, k, everyone), f"store of {(tile, k)} read A' buffer {ab}: {a_content[ab]}"

    agents = {t: thread(t) for t in range(threads)}
    for _ in range(400000):
        if not agents and not loads and not stores:
            break
        choices = list(agents) + (["tma load"] if loads else []) + (["tma store"] if stores else [])
        pick = choices[rnd.randrange(len(choices))]
        if pick == "tma load":
            b, (tile, k) = loads.pop(rnd.randrange(len(loads)))  # loads land in any order
            h_content[b] = ("H", tile, k)
            phases[b] += 1
            continue
        if pick == "tma store":
            store_reads(rnd.randrange(len(stores)))
            continue
        try:
            next(agents[pick])
        except StopIteration:
            del agents[pick]
    else:
        raise AssertionError("deadlock: no progress in 400000 steps")
    assert not agents, "deadlock"
    assert not loads and not stores, "a load or store left in flight"


def test_dh_tma_h_pipeline_holds_under_random_interleavings():
    for tiles, threads in [(1, 2), (3, 3), (6, 4)]:
        for seed in range(60):
            run(tiles, threads, seed)


@pytest.mark.parametrize("mutation", ["no read wait", "store before the barrier", "three ahead", "wrong buffer",
                                      "wrong parity"])
def test_dh_tma_h_model_catches_a_broken_protocol(mutation):
    for tiles, threads in [(1, 2), (3, 3), (6, 4)]:
        for seed in range(60):
            try:
                run(tiles, threads, seed, mutation)
            except AssertionError:
                return  # noticed
    pytest.fail(f"the model did not notice '{mutation}'")
