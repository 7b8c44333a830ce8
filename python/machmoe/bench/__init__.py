"""machmoe.bench: the layer benchmark (SPEC §4/§5), run as `python -m machmoe.bench`.

Modules:
  configs           the 12 SPEC §5 configs, FLOP and activation-memory formulas (SPEC §1)
  grouped_mm_layer  the torch._grouped_mm baseline layer "what users would write today"
  dense_bound       the dense cuBLAS bound (same FLOPs as balanced batched GEMMs)
  timing            CUDA-event timing with rotated inputs, held memory, device ceilings
  layer_bench       timing/memory of one layer implementation on one config
  report            Markdown table and JSON output
  cpu_demo          what runs without a GPU
  run               the command line (`main`)
"""

from .configs import (CONFIGS, CONFIGS_BY_NAME, MoEConfig, activation_bytes_formula, layer_flops,
                      select_configs, tflops)
from .grouped_mm_layer import GroupedMMMoE, grouped_mm_moe

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
