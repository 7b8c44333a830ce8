"""machmoe.bench: the layer benchmark, run as `python -m machmoe.bench` (--help for its options).

Modules:
  configs           the benchmark configs, the FLOP and activation-memory formulas (no torch)
  grouped_mm_layer  the reference layer written with torch._grouped_mm, as users would today
  dense_bound       the dense cuBLAS bound (the same FLOPs as balanced batched GEMMs)
  timing            CUDA-event timing with rotated inputs, held memory, device ceilings
  layer_bench       timing and memory of one layer implementation on one config
  report            the Markdown table, the JSON file and the PNG chart
  cpu_demo          what runs without a GPU
  run               the command line (`main`)
  gemm_kernels      the grouped GEMM kernels beside cuBLAS (a table of the benchmark)
  routing_kernels   the routing and aggregation kernels beside PyTorch (a table of the benchmark)
  expert_parallel   expert parallelism over the GPUs of one host (python -m machmoe.bench.expert_parallel)
  token_rounding_bench  the layer forward with and without token rounding
  variants          the routing, activation and shared-expert variants beside the default layer
                    (python -m machmoe.bench.variants)
  exchange_transports  NCCL against copy-engine pulls between the GPUs of one host
                    (python -m machmoe.bench.exchange_transports)
  fp8_gemm          the FP8 grouped GEMM beside the bf16 ones and torch's scaled grouped GEMM
                    (python -m machmoe.bench.fp8_gemm)
"""

from __future__ import annotations

import importlib

from .configs import (CONFIGS, CONFIGS_BY_NAME, MoEConfig, activation_bytes_formula, layer_flops,
                      select_configs, tflops)

_LAZY = {"GroupedMMMoE": "grouped_mm_layer", "grouped_mm_moe": "grouped_mm_layer"}  # these need torch

__all__ = [
    "CONFIGS",
    "CONFIGS_BY_NAME",
    "MoEConfig",
    "activation_bytes_formula",
    "layer_flops",
    "select_configs",
    "tflops",
    "GroupedMMMoE",
    "grouped_mm_moe",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'machmoe.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
