"""The FP8 weight cache (machmoe.fp8_weights): a weight's copies are reused while it is unchanged
and made again after every kind of change the cache can see. CPU only: the quantiser is a
counting stand-in, since what is tested is when it runs."""

import gc

import torch

from machmoe.fp8_weights import FP8WeightCache


class CountingQuantizer:
    """Stands in for the kernels: returns a fresh tuple whose first item records the weight's
    values at the call, and counts the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, w, transposed):
        self.calls += 1
        return (w.clone(), torch.tensor(self.calls), w.transpose(1, 2).clone() if transposed else None, None)


def weight():
    return torch.nn.Parameter(torch.randn(4, 16, 8))


def test_copies_are_reused_while_the_weight_is_unchanged():
    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    w = weight()
    first = cache.get(w)
    assert cache.get(w) is first and q.calls == 1
    # forward-only reads do not count as changes
    (w * 2).sum().backward()
    assert cache.get(w) is first and q.calls == 1
    # the transposed copy is made once, beside the plain one
    t = cache.get(w, transposed=True)
    assert t[2] is not None and cache.get(w, transposed=True) is t and q.calls == 2


def test_every_visible_change_makes_new_copies():
    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    w = weight()
    opt = torch.optim.SGD([w], lr=0.1)
    cache.get(w)
    w.grad = torch.randn_like(w)
    opt.step()  # in place under no_grad: the version counter moves
    got = cache.get(w)
    assert q.calls == 2 and torch.equal(got[0], w.detach())
    with torch.no_grad():
        w.copy_(torch.randn_like(w))  # as load_state_dict does
    assert torch.equal(cache.get(w)[0], w.detach()) and q.calls == 3
    with torch.no_grad():
        w[1].zero_()  # through a view: the same version counter
    assert torch.equal(cache.get(w)[0], w.detach()) and q.calls == 4
    w.data = torch.randn(4, 16, 8)  # new storage
    assert torch.equal(cache.get(w)[0], w.detach()) and q.calls == 5
    w.data = torch.randn(4, 8, 16)  # new shape
    assert cache.get(w)[0].shape == (4, 8, 16) and q.calls == 6


def test_every_optimizer_step_makes_new_copies_fused_ones_included():
    # AdamW(fused=True) writes the parameters without moving their version counters; the cache
    # counts torch.optim's steps instead (a copy kept across one would train stale weights).
    for options in ({"fused": True}, {"foreach": True}, {"foreach": False}):
        q = CountingQuantizer()
        cache = FP8WeightCache(q)
        w, other = weight(), weight()
        opt = torch.optim.AdamW([w], lr=0.1, **options)
        for step in range(1, 4):
            got = cache.get(w)
            assert q.calls == step and torch.equal(got[0], w.detach()), options
            assert cache.get(w) is got  # reused until the next step
            w.grad = torch.randn_like(w)
            version = w._version
            opt.step()
            if options.get("fused"):
                assert w._version == version  # what the version counter alone would miss
        # A step of any optimizer in the process counts, whichever weights it updates.
        kept = cache.get(w)
        calls = q.calls
        other.grad = torch.randn_like(other)
        torch.optim.SGD([other], lr=0.1).step()
        assert cache.get(w) is not kept and q.calls == calls + 1


def test_under_cuda_graph_capture_the_copies_are_made_every_call(monkeypatch):
    # A copy taken from the cache during a capture would be replayed after the weights changed: the
    # cache makes them anew (inside the graph) and keeps nothing. CPU: the capture state is faked.
    import machmoe.fp8_weights as fw

    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    w = weight()
    kept = cache.get(w)
    monkeypatch.setattr(fw, "_capturing", lambda t: True)
    a, b = cache.get(w), cache.get(w)
    assert a is not kept and b is not a and q.calls == 3
    monkeypatch.setattr(fw, "_capturing", lambda t: False)
    assert cache.get(w) is kept and q.calls == 3  # what was cached before the capture is untouched


def test_writes_through_data_are_not_seen_until_invalidated():
    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    w = weight()
    stale = cache.get(w)
    w.data.mul_(2)  # .data has a version counter of its own: the documented blind spot
    assert cache.get(w) is stale
    cache.invalidate(w)
    assert torch.equal(cache.get(w)[0], w.detach()) and q.calls == 2
    cache.invalidate()
    assert len(cache) == 0


def test_weights_are_kept_apart_and_forgotten_when_gone():
    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    a, b = weight(), weight()
    qa, qb = cache.get(a), cache.get(b)
    assert qa is not qb and torch.equal(qa[0], a.detach()) and torch.equal(qb[0], b.detach())
    assert len(cache) == 2
    del a
    gc.collect()
    assert len(cache) == 1  # the weight is gone, and its copies with it
    assert cache.get(b) is qb


def test_inference_tensors_are_quantised_every_time():
    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    with torch.inference_mode():
        w = torch.randn(2, 8, 8)
    cache.get(w)
    cache.get(w)
    assert q.calls == 2 and len(cache) == 0


def test_a_fresh_view_of_a_weight_finds_its_copies():
    # transformers' transposed experts hand their weight over as weight.transpose(1, 2), a new
    # tensor object on every call: the copies are kept on the base, keyed by the view's geometry.
    q = CountingQuantizer()
    cache = FP8WeightCache(q)
    w = weight()  # [4, 16, 8], read as [4, 8, 16]
    first = cache.get(w.transpose(1, 2))
    assert cache.get(w.transpose(1, 2)) is first and q.calls == 1
    assert torch.equal(first[0], w.detach().transpose(1, 2))
    # another view of the same base is another copy; the base itself too
    assert torch.equal(cache.get(w[1:])[0], w.detach()[1:]) and q.calls == 2
    assert torch.equal(cache.get(w)[0], w.detach()) and q.calls == 3
    assert len(cache) == 1
    # a change to the base makes the view's copies again
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(cache.get(w.transpose(1, 2))[0], w.detach().transpose(1, 2)) and q.calls == 4
    cache.invalidate(w.transpose(1, 2))  # through a view: the base's entry
    assert len(cache) == 0
