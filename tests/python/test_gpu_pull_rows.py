"""machmoe's pull_rows op (the receive kernel of the device-counted all-to-all) on one GPU, its
"peers" plain device buffers of this GPU laid out as the staging buffers are (send counts [W]
int64 at header_offset, rank-major rows at rows_offset), against the PyTorch reference
(machmoe.device_count_transport.pull_rows_reference) row for row, bitwise:
- W = 1, 2, 3 fake peers, every rank's view, random counts with zeros, one peer sending all its
  rows to one rank, row widths of one vector up to many, out_rows with and without spare rows;
- bad counts (negative, past src_rows, more than out_rows holds) clamped, nothing out of bounds
  read or written (the written rows equal the reference's, which skips the same rows);
- captured in a CUDA graph: new counts and rows written into the same buffers between replays
  give the new rows (the counts are read on the device at every replay);
- bad arguments raise ValueError naming the argument.
"""

import pytest
import torch

from gpu_test_helpers import ops
from machmoe.device_count_transport import pull_rows_reference

pytestmark = [pytest.mark.gpu, pytest.mark.ops]

HEADER = 512  # bytes before the rows, as the transport stages them


def _staging(counts, src_rows, row_bytes, gen):
    """One fake peer's staging buffer [HEADER + src_rows·row_bytes] uint8: counts [W] at 0, random
    rows after (every byte random, so a row read from the wrong place shows)."""
    buf = torch.randint(0, 256, (HEADER + src_rows * row_bytes,), dtype=torch.uint8, device="cuda", generator=gen)
    buf[:8 * len(counts)].view(torch.int64).copy_(torch.tensor(counts, dtype=torch.int64))
    return buf


def _peers(bufs):
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")


def _check(bufs, src_rows, rank, out_rows, row_bytes):
    got = ops().pull_rows(_peers(bufs), 0, HEADER, src_rows, rank, out_rows, row_bytes)
    torch.cuda.synchronize()
    want, written = pull_rows_reference(bufs, 0, HEADER, src_rows, rank, out_rows, row_bytes)
    assert got.shape == (out_rows, row_bytes) and got.dtype == torch.uint8
    bad = (got != want).any(1) & written
    assert not bad.any(), (f"pull_rows W={len(bufs)} rank={rank} row_bytes={row_bytes}: rows "
                           f"{bad.nonzero().flatten()[:8].tolist()} differ from the reference")
    return written


def _random_counts(W, src_rows, gen):
    """[W] counts summing to at most src_rows, about a third of them 0."""
    weights = torch.rand(W, generator=gen, device="cuda") * (torch.rand(W, generator=gen, device="cuda") > 0.33)
    total = int(torch.randint(0, src_rows + 1, (1,), generator=gen, device="cuda"))
    if weights.sum() == 0:
        return [0] * W
    counts = (weights / weights.sum() * total).floor().long().tolist()
    return counts


@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("row_bytes", [16, 48, 1040, 7168 + 64])
def test_pull_rows_matches_the_reference(W, row_bytes, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    src_rows = 300
    cases = [[_random_counts(W, src_rows, gen) for _ in range(W)] for _ in range(3)]
    everything = [[0] * W for _ in range(W)]
    for q in range(W):
        everything[q][(q + 1) % W] = src_rows  # each peer sends all its rows to one rank
    cases.append(everything)
    cases.append([[0] * W for _ in range(W)])  # nothing at all
    for counts in cases:
        bufs = [_staging(c, src_rows, row_bytes, gen) for c in counts]
        for rank in range(W):
            total = sum(c[rank] for c in counts)
            for out_rows in (total, total + 7):
                written = _check(bufs, src_rows, rank, out_rows, row_bytes)
                assert int(written.sum()) == total, "the reference lost rows"


def test_pull_rows_clamps_bad_counts(seed):
    """Counts below 0, past src_rows, and more rows than out_rows: only rows inside every bound
    are copied (the reference skips the same ones)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    src_rows, row_bytes = 50, 32
    counts = [[-5, 40, 30], [10, 1 << 40, 3], [45, 2, 10]]  # peer 0 reads rows 0..39 for rank 1
    bufs = [_staging(c, src_rows, row_bytes, gen) for c in counts]
    for rank in range(3):
        for out_rows in (0, 1, 20, 64):
            _check(bufs, src_rows, rank, out_rows, row_bytes)


def test_pull_rows_reads_the_counts_at_every_graph_replay(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    W, src_rows, row_bytes, out_rows = 3, 64, 64, 3 * 64
    bufs = [_staging([0] * W, src_rows, row_bytes, gen) for _ in range(W)]
    peers = _peers(bufs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops().pull_rows(peers, 0, HEADER, src_rows, 1, out_rows, row_bytes)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = ops().pull_rows(peers, 0, HEADER, src_rows, 1, out_rows, row_bytes)
    torch.cuda.synchronize()
    for _ in range(3):
        for buf in bufs:  # new counts and rows in place
            fresh = _staging(_random_counts(W, src_rows, gen), src_rows, row_bytes, gen)
            buf.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        want, written = pull_rows_reference(bufs, 0, HEADER, src_rows, 1, out_rows, row_bytes)
        assert torch.equal(out[written], want[written]), "a replay did not pull the new counts' rows"


def test_pull_rows_refuses_bad_arguments():
    buf = torch.zeros(HEADER + 64, dtype=torch.uint8, device="cuda")
    peers = _peers([buf, buf])
    m = ops()
    with pytest.raises(ValueError, match="row_bytes must be a positive multiple of 16"):
        m.pull_rows(peers, 0, HEADER, 2, 0, 4, 24)
    with pytest.raises(ValueError, match="rank must be in"):
        m.pull_rows(peers, 0, HEADER, 2, 2, 4, 32)
    with pytest.raises(ValueError, match="rows_offset must be a non-negative multiple of 16"):
        m.pull_rows(peers, 0, 8, 2, 0, 4, 32)
    with pytest.raises(ValueError, match="W must be in"):
        m.pull_rows(torch.zeros(65, dtype=torch.int64, device="cuda"), 0, HEADER, 2, 0, 4, 32)
    with pytest.raises(ValueError, match="peers must have dtype"):
        m.pull_rows(peers.int(), 0, HEADER, 2, 0, 4, 32)
