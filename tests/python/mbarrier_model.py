"""Shared pieces of the CPU models of the GEMM kernels' synchronisation (test_pingpong_protocol.py,
test_coop_protocol.py): an mbarrier, a waiting generator, and the random scheduler that runs the
agents (generators) and completes the asynchronous loads and wgmma groups in any order.

mbarrier model: a barrier completes a phase when its pending arrivals and transaction count reach
zero; a parity wait for P passes once the phase count's parity differs from P (the hardware rule
for waits at most one phase ahead, which is what the kernels rely on)."""

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


def wait(cond):
    while not cond():
        yield


def drive(rnd, agents, inflight, land, groups, steps=400000):
    """Runs `agents` (name -> generator) to the end under a random interleaving with the loads in
    `inflight` (each landed by `land(event)`, in any order) and the wgmma groups in `groups` (key ->
    list, oldest retired first). Returns the agents' return values by name; a run that does not
    finish within `steps` is a deadlock."""
    results = {}
    for _ in range(steps):
        if not agents:
            return results
        choices = list(agents) + (["load"] if inflight else []) + [("wgmma", k) for k in groups if groups[k]]
        pick = choices[rnd.randrange(len(choices))]
        if pick == "load":
            land(inflight.pop(rnd.randrange(len(inflight))))
        elif isinstance(pick, tuple) and pick[0] == "wgmma":
            groups[pick[1]].pop(0)
        else:
            try:
                next(agents[pick])
            except StopIteration as stop:
                results[pick] = stop.value
                del agents[pick]
    raise AssertionError("deadlock")
