"""The reduce-scatter's W-way sum on the GPU (torch.ops.machmoe.sum_blocks, machmoe/sum_blocks.hpp)
against PyTorch's (symmetric_exchange.sum_blocks_torch, float32 in list order, rounded once):
bitwise, signed zeros included, for 1 to 64 parts of bf16 and float32, sizes that leave a tail past
the 16-byte units, and parts at odd addresses (the one-element path)."""

import pytest
import torch

from machmoe import symmetric_exchange


def on_gpu(test):
    """A test that needs a GPU and the op library (skipped without them; conftest.py)."""
    return pytest.mark.ops(pytest.mark.gpu(test))


def parts_of(count, elems, dtype, offset=0):
    """count blocks of elems elements, magnitudes 10^-3 .. 10^3 (sums that round), with exact zeros
    of both signs at the first elements; each block a view `offset` elements into its storage."""
    out = []
    for q in range(count):
        n = elems + offset
        base = torch.randn(n, device="cuda") * 10.0 ** torch.randint(-3, 4, (n,), device="cuda")
        base[offset:offset + 4] = torch.tensor([0.0, -0.0, -0.0, 0.0]) * (1 if q % 2 else -1)
        out.append(base.to(dtype)[offset:])
    return out


def bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 8, 64])
@pytest.mark.parametrize("elems,offset", [(1 << 20, 0), (1000003, 0), (4099, 1), (7, 0)])
def test_sum_blocks_matches_pytorch_bitwise(dtype, count, elems, offset):
    torch.manual_seed(count * 7 + elems % 97)
    parts = parts_of(count, elems, dtype, offset)
    got = torch.ops.machmoe.sum_blocks(parts)
    want = symmetric_exchange.sum_blocks_torch(parts)
    assert got.dtype == dtype and got.shape == (elems,)
    assert torch.equal(bits(got), bits(want)), (got - want).abs().max()
    assert torch.equal(bits(symmetric_exchange.sum_blocks(parts)), bits(want)), "the dispatcher"


@on_gpu
def test_sum_blocks_keeps_the_parts_shape():
    # 2-D parts [rows, d] as the exchange has them (bitwise equality with the reference also
    # shows that every element was written).
    rows, d = 3001, 1536
    parts = [torch.randn(rows, d, device="cuda").bfloat16() for _ in range(4)]
    got = torch.ops.machmoe.sum_blocks(parts)
    assert got.shape == (rows, d)
    assert torch.equal(bits(got), bits(symmetric_exchange.sum_blocks_torch(parts)))


@on_gpu
def test_sum_blocks_refuses_mismatched_parts():
    a = torch.randn(10, 8, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="parts\\[1\\]"):
        torch.ops.machmoe.sum_blocks([a, a.float()])
    with pytest.raises(ValueError, match="parts\\[1\\]"):
        torch.ops.machmoe.sum_blocks([a, a[:5]])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        torch.ops.machmoe.sum_blocks([a.half()])
    with pytest.raises(ValueError, match="count"):
        torch.ops.machmoe.sum_blocks([a] * 65)
