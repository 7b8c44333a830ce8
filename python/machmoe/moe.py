"""`MoE`: the layer as an nn.Module. Its constructor and parameter names (router, c_fc, c_proj)
are those of SonicMoE's MoE module."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import nn

from . import fp8_layer, functional
from .enums import (
    ActivationType,
    Backend,
    GateUpLayout,
    GluClamp,
    Precision,
    RoutingMethod,
    TokenRounding,
    is_gate_routing,
    is_glu,
    resolve_glu_clamp,
    parse_enum,
)


def _positive_int(value, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int; got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{arg} must be >= 1; got {value}")
    return value


def rounding_for_call(token_rounding: TokenRounding, training: bool) -> tuple[TokenRounding, int]:
    """(rounding, seed) of one call of a layer: token rounding in training mode only; stochastic
    rounding draws a fresh seed per call from torch's generator, so that torch.manual_seed makes
    a training run reproducible."""
    rounding = token_rounding if training else TokenRounding.NONE
    seed = int(torch.randint(0, 2**62, ()).item()) if rounding == TokenRounding.STOCHASTIC else 0
    return rounding, seed


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
    """A token-choice Mixture-of-Experts layer (docs/LAYER.md): a router picks K of E expert MLPs
    per token, and the output is the score-weighted sum of their outputs.

    Args:
        num_experts: E, the number of experts (>= 1).
        num_experts_per_tok: K, experts per token (1 <= K <= E).
        hidden_size: d, the size of a token (the last dimension of hidden_states).
        intermediate_size: n, each expert's hidden size; GLU activations have 2n up-projection
            rows (gate and up).
        activation_function: ActivationType or its name: "swiglu" (default), "geglu",
            "reglu", "relu2", "relu", "gelu" (tanh approximation), "silu", "clamped_swiglu"
            (gpt-oss's and DeepSeek-V4's clamped SwiGLU, a GLU; parameters in glu_clamp).
        add_bias: give both expert projections a bias, c_fc.bias and c_proj.bias (default
            False; initialised to zeros).
        std: standard deviation of the normal initialisation of every weight (default 0.02).
        routing: "softmax_topk" (default; top-K logits, softmax over those K), "topk_softmax"
            (softmax over all E, then top-K), "sigmoid" (sigmoid scores) or "sqrt_softplus"
            (sqrt(softplus(logit)) scores); the last two add the selection_bias buffer.
        renormalize: for topk_softmax, sigmoid and sqrt_softplus routing, divide a token's K
            scores by their sum (default True).
        gate_up_layout: where gate and up rows sit in c_fc.weight for GLU activations:
            "interleaved" (default; row 2j gate j, row 2j+1 up j) or "concatenated" (gate rows
            [0, n), up rows [n, 2n): the Hugging Face layout).
        token_rounding: "none" (default), or "nr", "up", "down", "stochastic": in training mode,
            round each expert's token count to a multiple of tile_m so that no expert GEMM tile
            is partly empty (softmax_topk routing only; eval mode uses plain top-K). A batch in
            which every expert rounds down to zero tokens gives a zero output; the torch backend
            warns then (the kernels keep the row counts on the GPU and do not check).
        tile_m: the token-rounding multiple (default 128, the kernels' tile height; >= 1).
        router_bias: give the router a bias, router.bias [E] (gpt-oss; default False; zeros).
        routed_scaling_factor: scores × this after renormalisation (default 1.0).
        n_group: group-limited selection (sigmoid / sqrt_softplus): the experts form n_group
            groups (default 1: none); see machmoe.functional.moe.
        topk_group: the groups kept per token with n_group > 1 (default 1).
        backend: "auto" (default: the kernels for bfloat16 tensors on an sm_90 GPU, the torch
            backend otherwise), "machmoe" (the kernels, an error where they cannot run) or
            "torch" (pure PyTorch, any device and float dtype).
        num_shared_experts: S, always-on experts that every token visits, their outputs added
            to the routed experts' (default 0; machmoe.shared_experts.shared_experts).
        shared_intermediate_size: each shared expert's hidden size n_s (default: n).
        shared_expert_gate: weight the shared experts' sum per token by sigmoid(x · g), g a
            [1, d] weight (Qwen's shared-expert gate; default False).
        glu_clamp: the parameters of "clamped_swiglu", a machmoe.GluClamp (None: gpt-oss's,
            GluClamp(); GluClamp.deepseek_v4(limit), GluClamp.post_activation(limit)); other
            activations take none.
        precision: "bf16" (default) or "fp8": the routed experts' GEMMs in E4M3 (DeepSeek-V3's
            tile scaling), the router in fp32; the weights' FP8 copies are kept in
            `fp8_cache`, remade after every torch.optim step and every in-place write of a
            weight (machmoe.fp8_weights; machmoe.fp8_layer: swiglu or clamped_swiglu, sizes
            multiples of 16, bfloat16 tensors). Shared experts run beside in bf16.

    Parameters: router.weight [E, d]; c_fc.weight [E, N1, d] (N1 = 2n for GLU activations, n
    otherwise), c_fc.bias [E, N1]; c_proj.weight [E, d, n], c_proj.bias [E, d]; router.bias [E]
    with router_bias; with sigmoid or sqrt_softplus routing a buffer selection_bias [E] (zeros;
    it changes which experts are selected, never the scores); with shared experts
    shared_c_fc.weight [S, N1s, d], shared_c_proj.weight [S, d, n_s] (and their biases with
    add_bias) and, with the gate, shared_gate.weight [1, d].

    forward(hidden_states, backend=None) -> (output, aux_loss):
        hidden_states: [..., d] tokens, any leading shape; bfloat16 on an H100/H200 runs the
            kernels under backend="auto".
        backend: overrides the constructor's backend for this call (None: keep it).
        output: [..., d] in hidden_states' dtype; aux_loss: [] the load-balancing loss.
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
        backend: Union[Backend, str] = Backend.AUTO,
        router_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        num_shared_experts: int = 0,
        shared_intermediate_size: Optional[int] = None,
        shared_expert_gate: bool = False,
        glu_clamp: Optional[GluClamp] = None,
        precision: Union[Precision, str] = Precision.BF16,
    ):
        """Checks and stores the options and creates the parameters; the class docstring
        documents every argument. A bad argument raises TypeError or ValueError naming it."""
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
        # activation_function "clamped_swiglu": its parameters (None: gpt-oss's); None otherwise
        self.glu_clamp = resolve_glu_clamp(self.activation_function, glu_clamp)
        if not isinstance(router_bias, bool):
            raise TypeError(f"router_bias must be a bool; got {type(router_bias).__name__}")
        options = functional._validate_router_options(num_experts, num_experts_per_tok, self.routing,
                                                      self.token_rounding, routed_scaling_factor, n_group,
                                                      topk_group)
        self.routed_scaling_factor, self.n_group, self.topk_group = options

        E, d, n = num_experts, hidden_size, intermediate_size
        n1 = 2 * n if is_glu(self.activation_function) else n
        self.router = nn.Linear(d, E, bias=router_bias)
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        if router_bias:
            nn.init.zeros_(self.router.bias)
        self.c_fc = ExpertLinear(E, d, n1, add_bias, std)
        self.c_proj = ExpertLinear(E, n, d, add_bias, std)
        if is_gate_routing(self.routing):
            self.register_buffer("selection_bias", torch.zeros(E))
        else:
            self.selection_bias = None
        self._init_shared_experts(num_shared_experts, shared_intermediate_size, shared_expert_gate,
                                  add_bias, std)
        self.precision = parse_enum(Precision, precision, "precision")
        self.fp8_cache = fp8_layer.new_cache() if self.precision == Precision.FP8 else None
        if self.fp8_cache is not None:
            fp8_layer.check_module(self)

    def _init_shared_experts(self, S, n_s, gate: bool, add_bias: bool, std: float) -> None:
        if isinstance(S, bool) or not isinstance(S, int) or S < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0; got {S!r}")
        self.num_shared_experts = S
        self.shared_intermediate_size = (self.intermediate_size if n_s is None else
                                         _positive_int(n_s, "shared_intermediate_size"))
        if not isinstance(gate, bool):
            raise TypeError(f"shared_expert_gate must be a bool; got {type(gate).__name__}")
        if gate and S == 0:
            raise ValueError("shared_expert_gate=True needs num_shared_experts >= 1")
        self.shared_c_fc = self.shared_c_proj = self.shared_gate = None
        if S == 0:
            return
        d, n_s = self.hidden_size, self.shared_intermediate_size
        n1 = 2 * n_s if is_glu(self.activation_function) else n_s
        self.shared_c_fc = ExpertLinear(S, d, n1, add_bias, std)
        self.shared_c_proj = ExpertLinear(S, n_s, d, add_bias, std)
        if gate:
            self.shared_gate = nn.Linear(d, 1, bias=False)
            nn.init.normal_(self.shared_gate.weight, mean=0.0, std=std)
        self._pack_shared_experts()

    def _pack_shared_experts(self) -> None:
        """Place each shared-expert parameter right after its routed counterpart in one allocation
        (c_fc.weight [E, ...] then shared_c_fc.weight [S, ...], and so on), so that the kernels read
        the [E+S, ...] weights of the one launch without copying them. Only where both are plain
        tensors of one dtype and device; the values, the Parameter objects and the state_dict are
        unchanged, and any other placement computes the same (with a copy per call)."""
        if not getattr(self, "num_shared_experts", 0):  # _apply may run before __init__ sets it
            return
        with torch.no_grad():
            for routed, shared in ((self.c_fc, self.shared_c_fc), (self.c_proj, self.shared_c_proj)):
                for name in ("weight", "bias"):
                    a, b = getattr(routed, name), getattr(shared, name)
                    if (a is None or b is None or type(a.data) is not torch.Tensor or type(b.data) is not torch.Tensor
                            or a.dtype != b.dtype or a.device != b.device or a.device.type == "meta"
                            or a.shape[1:] != b.shape[1:]):
                        continue
                    if (a.is_contiguous() and b.is_contiguous()
                            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()):
                        continue
                    block = torch.cat([a.detach(), b.detach()])  # [E+S, ...]
                    a.data, b.data = block[: a.shape[0]], block[a.shape[0]:]

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .bfloat16() ... give every parameter its own new tensor: pack them again.
        module = super()._apply(fn, *args, **kwargs)
        self._pack_shared_experts()
        return module

    def forward(self, hidden_states: torch.Tensor,
                backend: Optional[Union[Backend, str]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [..., hidden_size] -> (output [..., hidden_size] in hidden_states'
        dtype, aux_loss [] float32, float64 for float64 input).

        Args:
            hidden_states: [..., hidden_size] tokens; the leading dimensions are flattened into
                T tokens and restored on the output.
            backend: "auto", "machmoe" or "torch" for this call only; None (default) uses the
                constructor's backend.
        """
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor; "
                            f"got {type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must have shape [..., hidden_size] with hidden_size "
                             f"= {self.hidden_size}; got {list(hidden_states.shape)}")
        rounding, seed = rounding_for_call(self.token_rounding, self.training)
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
            router_bias=self.router.bias, routed_scaling_factor=self.routed_scaling_factor,
            n_group=self.n_group, topk_group=self.topk_group, glu_clamp=self.glu_clamp,
            precision=self.precision, fp8_cache=self.fp8_cache,
            **self._shared_expert_args(),
        )
        return out.reshape(hidden_states.shape), aux

    def _shared_expert_args(self) -> dict:
        """functional.moe's shared-expert arguments for this layer (none without shared experts)."""
        if not self.num_shared_experts:
            return {}
        return {"shared_w1": self.shared_c_fc.weight, "shared_w2": self.shared_c_proj.weight,
                "shared_b1": self.shared_c_fc.bias, "shared_b2": self.shared_c_proj.bias,
                "shared_gate": None if self.shared_gate is None else self.shared_gate.weight}

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}, "
                f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation_function={self.activation_function.value}, "
                + (f"glu_clamp={self.glu_clamp}, " if self.glu_clamp is not None else "") +
                f"routing={self.routing.value}, gate_up_layout={self.gate_up_layout.value}, "
                f"token_rounding={self.token_rounding.value}, tile_m={self.tile_m}, "
                f"backend={self.backend.value}"
                + (f", num_shared_experts={self.num_shared_experts}, shared_intermediate_size="
                   f"{self.shared_intermediate_size}, shared_expert_gate={self.shared_gate is not None}"
                   if self.num_shared_experts else ""))
