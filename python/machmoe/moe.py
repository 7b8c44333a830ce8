"""`MoE`: the layer as an nn.Module, with SonicMoE's constructor and parameter names."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import nn

from . import functional
from .enums import (
    ActivationType,
    Backend,
    GateUpLayout,
    RoutingMethod,
    TokenRounding,
    is_glu,
    parse_enum,
)


def _positive_int(value, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int; got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{arg} must be >= 1; got {value}")
    return value


def layer_settings(num_experts, num_experts_per_tok, hidden_size, intermediate_size,
                   activation_function, add_bias, std, routing, renormalize,
                   gate_up_layout) -> dict:
    """The constructor arguments every MoE layer class shares, checked and parsed (attribute name
    -> value); a bad one raises an error naming it."""
    settings = {"num_experts": _positive_int(num_experts, "num_experts"),
                "num_experts_per_tok": _positive_int(num_experts_per_tok, "num_experts_per_tok")}
    if num_experts_per_tok > num_experts:
        raise ValueError(f"num_experts_per_tok must be <= num_experts ({num_experts}); "
                         f"got {num_experts_per_tok}")
    settings["hidden_size"] = _positive_int(hidden_size, "hidden_size")
    settings["intermediate_size"] = _positive_int(intermediate_size, "intermediate_size")
    settings["activation_function"] = parse_enum(ActivationType, activation_function,
                                                 "activation_function")
    if not isinstance(add_bias, bool):
        raise TypeError(f"add_bias must be a bool; got {type(add_bias).__name__}")
    if isinstance(std, bool) or not isinstance(std, (int, float)):
        raise TypeError(f"std must be a float; got {type(std).__name__}")
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std must be finite and >= 0; got {std}")
    settings["routing"] = parse_enum(RoutingMethod, routing, "routing")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool; got {type(renormalize).__name__}")
    settings["renormalize"] = renormalize
    settings["gate_up_layout"] = parse_enum(GateUpLayout, gate_up_layout, "gate_up_layout")
    return settings


class ExpertLinear(nn.Module):
    """E stacked nn.Linear layers: weight [E, out_features, in_features], bias [E, out_features]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool,
                 std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None
        self.std = std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        E, out_features, in_features = self.weight.shape
        return (f"num_experts={E}, in_features={in_features}, out_features={out_features}, "
                f"bias={self.bias is not None}")


class MoE(nn.Module):
    """A token-choice Mixture-of-Experts layer (docs/LAYER.md).

    Parameters: router.weight [E, hidden]; c_fc.weight [E, N1, hidden] (N1 = 2·intermediate for
    GLU activations, gate/up rows in `gate_up_layout`), c_fc.bias [E, N1]; c_proj.weight
    [E, hidden, intermediate], c_proj.bias [E, hidden]; with sigmoid routing a buffer
    selection_bias [E] (zeros; it changes which experts are selected, never the scores).

    forward(hidden_states [..., hidden]) -> (output [..., hidden], aux_loss []). Token rounding
    is a training-time routing: in eval mode the layer uses plain top-K.
    """

    def __init__(
        self,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        intermediate_size: int,
        activation_function: Union[ActivationType, str] = ActivationType.SWIGLU,
        add_bias: bool = False,
        std: float = 0.02,
        *,
        routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
        renormalize: bool = True,
        gate_up_layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
        token_rounding: Union[TokenRounding, str] = TokenRounding.NONE,
        tile_m: int = 128,
        backend: Union[Backend, str] = Backend.MACHMOE,
    ):
        super().__init__()
        for name, value in layer_settings(num_experts, num_experts_per_tok, hidden_size,
                                          intermediate_size, activation_function, add_bias, std,
                                          routing, renormalize, gate_up_layout).items():
            setattr(self, name, value)
        self.token_rounding = parse_enum(TokenRounding, token_rounding, "token_rounding")
        if self.token_rounding != TokenRounding.NONE and \
                self.routing != RoutingMethod.SOFTMAX_TOPK:
            raise ValueError(f"token_rounding={self.token_rounding.value!r} needs "
                             f"routing='softmax_topk'; got routing={self.routing.value!r}")
        self.tile_m = _positive_int(tile_m, "tile_m")
        self.backend = parse_enum(Backend, backend, "backend")

        E, d, n = num_experts, hidden_size, intermediate_size
        n1 = 2 * n if is_glu(self.activation_function) else n
        self.router = nn.Linear(d, E, bias=False)
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.c_fc = ExpertLinear(E, d, n1, add_bias, std)
        self.c_proj = ExpertLinear(E, n, d, add_bias, std)
        if self.routing == RoutingMethod.SIGMOID:
            self.register_buffer("selection_bias", torch.zeros(E))
        else:
            self.selection_bias = None

    def forward(self, hidden_states: torch.Tensor,
                backend: Optional[Union[Backend, str]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [..., hidden] -> (output [..., hidden], aux_loss []).
        `backend` overrides the constructor's choice for this call."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor; "
                            f"got {type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must have shape [..., hidden_size] with hidden_size "
                             f"= {self.hidden_size}; got {list(hidden_states.shape)}")
        rounding = self.token_rounding if self.training else TokenRounding.NONE
        # Stochastic rounding draws a fresh seed per call from torch's generator, so that
        # torch.manual_seed makes a training run reproducible.
        seed = 0
        if rounding == TokenRounding.STOCHASTIC:
            seed = int(torch.randint(0, 2**62, ()).item())
        x = hidden_states.reshape(-1, self.hidden_size)  # [T, hidden]
        out, aux = functional.moe(
            x, self.router.weight, self.c_fc.weight, self.c_proj.weight,
            num_experts_per_tok=self.num_experts_per_tok,
            activation=self.activation_function,
            b1=self.c_fc.bias, b2=self.c_proj.bias,
            layout=self.gate_up_layout,
            routing=self.routing, renormalize=self.renormalize,
            selection_bias=self.selection_bias,
            token_rounding=rounding, tile_m=self.tile_m, seed=seed,
            backend=self.backend if backend is None else backend,
        )
        return out.reshape(hidden_states.shape), aux

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}, "
                f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation_function={self.activation_function.value}, "
                f"routing={self.routing.value}, gate_up_layout={self.gate_up_layout.value}, "
                f"token_rounding={self.token_rounding.value}, tile_m={self.tile_m}, "
                f"backend={self.backend.value}")
