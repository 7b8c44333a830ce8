"""machmoe: Mixture-of-Experts layers trained on Hopper GPUs (the SonicMoE design), with a
PyTorch front end.

    from machmoe import MoE
    layer = MoE(num_experts=64, num_experts_per_tok=4, hidden_size=1536, intermediate_size=512)
    out, aux_loss = layer(hidden_states)

`machmoe.functional` has the functional forms; `backend="torch"` runs a pure-PyTorch
implementation of the same math on any device.
"""

from . import functional
from ._ops import layer_kernels_available, ops_available
from .enums import ActivationType, Backend, GateUpLayout, RoutingMethod, TokenRounding, is_glu
from .moe import MoE

__version__ = "0.1.0"

__all__ = [
    "MoE",
    "ActivationType",
    "Backend",
    "GateUpLayout",
    "RoutingMethod",
    "TokenRounding",
    "is_glu",
    "functional",
    "layer_kernels_available",
    "ops_available",
    "__version__",
]
