"""CPU tests of machmoe.bench.sonic_kernels (SonicMoE's expert GEMMs beside ours in the same loops)."""

import pytest
import torch

from machmoe.bench import sonic_kernels as sk
from machmoe.bench.configs import CONFIGS, layer_flops


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_kernel_flops_add_up_to_the_layer_convention(cfg):
    """The backward's four GEMMs are the layer's backward FLOPs (12·T·K·n·d, SPEC §1), and the
    up-projection two thirds of its forward (6·T·K·n·d, the down-projection the rest)."""
    fwd, bwd = layer_flops(cfg.T, cfg.K, cfg.n, cfg.d)
    f = lambda k: sk.flops(k, cfg.T, cfg.d, cfg.n, cfg.K)  # noqa: E731
    assert f("dH") + f("dW2") + f("dW1") + f("dX~") == pytest.approx(bwd, rel=1e-12)
    assert f("up-proj") == pytest.approx(fwd * 2 / 3, rel=1e-12)


def test_every_grouped_kernel_has_a_flop_count():
    for _, kernels in sk.GROUPS:
        for k in kernels:
            assert sk.flops(k, 8, 64, 32, 2) > 0
    with pytest.raises(KeyError):
        sk.flops("down-proj", 8, 64, 32, 2)  # not timed here: the kernel table has it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_says_so(capsys):
    assert sk.main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_timing_protocols_parse_and_refuse_unknown_ones(capsys):
    assert sk.main(["--timing", "sonic"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sk.main(["--timing", "do_bench"])
