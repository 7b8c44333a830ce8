"""The benchmark configurations and the counting conventions (FLOPs, activation memory).

Everything here is plain arithmetic, so it is tested on the CPU (tests/python/test_bench.py).
"""

from __future__ import annotations

import dataclasses
import math

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer shape plus the published SonicMoE H100 figures for it (TFLOPS)."""

    name: str
    T: int  # tokens
    d: int  # hidden size
    n: int  # expert intermediate size (the up-projection produces 2n columns for GLU)
    E: int  # experts
    K: int  # experts per token
    sonic_fwd: float  # SonicMoE forward TFLOPS on an H100 (paper)
    sonic_bwd: float  # SonicMoE backward TFLOPS on an H100 (paper)

    def scaled(self, t_scale: float) -> "MoEConfig":
        """Same layer with T multiplied by t_scale (rounded to a multiple of 64, at least 64)."""
        if t_scale == 1.0:
            return self
        T = max(64, int(round(self.T * t_scale / 64.0)) * 64)
        return dataclasses.replace(self, T=T)

    @property
    def TK(self) -> int:
        return self.T * self.K


# The layer shapes of the SonicMoE paper's benchmark, with its H100 TFLOPS. The paper does not
# state DeepSeek-V3's T; 32768 is used, as for the other large configs.
CONFIGS: tuple[MoEConfig, ...] = (
    MoEConfig("1.4B-a", 40960, 768, 256, 128, 8, 340, 365),
    MoEConfig("1.4B-c", 40960, 768, 1024, 32, 2, 405, 437),
    MoEConfig("7B-a", 24576, 1536, 256, 128, 8, 365, 405),
    MoEConfig("7B-b", 24576, 1536, 512, 64, 4, 433, 440),
    MoEConfig("7B-c", 24576, 1536, 1024, 32, 2, 467, 468),
    MoEConfig("30B-a", 32768, 4096, 256, 256, 16, 428, 460),
    MoEConfig("30B-b", 32768, 4096, 512, 128, 8, 502, 510),
    MoEConfig("30B-c", 32768, 4096, 1024, 64, 4, 552, 555),
    MoEConfig("120B-a", 32768, 4096, 512, 256, 16, 518, 525),
    MoEConfig("120B-b", 32768, 4096, 1024, 128, 8, 560, 567),
    MoEConfig("120B-c", 32768, 4096, 2048, 64, 4, 597, 585),
    MoEConfig("DeepSeek-V3", 32768, 7168, 2048, 256, 8, 535, 480),
)

CONFIGS_BY_NAME = {c.name: c for c in CONFIGS}


def select_configs(names: str | None, t_scale: float = 1.0) -> list[MoEConfig]:
    """`names` is a comma-separated list ("7B-a,30B-b") or None/"all" for every config."""
    if names is None or names.strip().lower() in ("", "all"):
        chosen = list(CONFIGS)
    else:
        chosen = []
        for raw in names.split(","):
            name = raw.strip()
            if not name:
                continue
            # Case-insensitive match so "deepseek-v3" works too.
            match = [c for c in CONFIGS if c.name.lower() == name.lower()]
            if not match:
                known = ", ".join(c.name for c in CONFIGS)
                raise ValueError(f"unknown config {name!r}; known: {known}")
            chosen.append(match[0])
    return [c.scaled(t_scale) for c in chosen]


def layer_flops(T: int, K: int, n: int, d: int, glu: bool = True) -> tuple[int, int]:
    """(forward, backward) FLOPs of the expert part of the layer.

    GLU: up-projection 2·TK·d·2n + down-projection 2·TK·n·d = 6·TK·n·d forward; the backward does a
    data-gradient and a weight-gradient GEMM for each, twice the forward. Router GEMM not counted.
    """
    per = 6 if glu else 4
    fwd = per * T * K * n * d
    return fwd, 2 * fwd


def tflops(flop: float, ms: float | None) -> float | None:
    """FLOPs over milliseconds as TFLOPS (None when the time is missing or not positive)."""
    if ms is None or not (ms > 0) or math.isnan(ms):
        return None
    return flop / (ms * 1e-3) / 1e12


def activation_bytes_formula(T: int, d: int, K: int, n: int, glu: bool = True) -> int:
    """Bytes a memory-minimal layer keeps between forward and backward, bf16.

    X [T, d] (2 bytes each) + H [TK, N1] with N1 = 2n for GLU (2 bytes each) = 2·T·d + 4·T·K·n.
    The O(T·K + T·E) routing metadata is left out (held_bound_bytes counts it).
    """
    n1 = 2 * n if glu else n
    return 2 * T * d + 2 * T * K * n1


def held_bound_bytes(T: int, d: int, K: int, n: int, E: int) -> int:
    """The bound on the bytes the layer holds between forward and backward, output excluded:
    2·T·d (x) + 4·T·K·n (H) + 16·T·K (scores and int32 metadata per routed pair) + 4·T·E (fp32
    logits)."""
    return 2 * T * d + 4 * T * K * n + 16 * T * K + 4 * T * E


def held_bound_less_x_bytes(cfg: MoEConfig) -> int:
    """held_bound_bytes less x's 2·T·d: x is the caller's tensor, allocated before the forward, so
    the benchmark's held-bytes measurement (timing.held_bytes) does not count it."""
    return held_bound_bytes(cfg.T, cfg.d, cfg.K, cfg.n, cfg.E) - 2 * cfg.T * cfg.d


def weight_bytes(cfg: MoEConfig, glu: bool = True, itemsize: int = 2) -> int:
    """Bytes of W1 [E, N1, d] + W2 [E, d, n] + router [E, d]."""
    n1 = 2 * cfg.n if glu else cfg.n
    return itemsize * (cfg.E * n1 * cfg.d + cfg.E * cfg.d * cfg.n + cfg.E * cfg.d)
