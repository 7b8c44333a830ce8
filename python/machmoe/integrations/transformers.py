"""machmoe as an experts implementation of Hugging Face transformers (>= 5.17, < 6).

Importing this module registers "machmoe" in transformers' ExpertsInterface (register() does it
again, under another name if wanted), so that

    import machmoe.integrations.transformers
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="machmoe")
    # or AutoModelForCausalLM.from_pretrained(path, experts_implementation="machmoe"),
    # or model.set_experts_implementation("machmoe")

runs every experts module that transformers decorates with `use_experts_implementation` on
machmoe's experts (`machmoe.functional.experts_topk`): the model's own router picks the experts,
machmoe runs them. "machmoe_fp8" does the same with the experts' GEMMs in FP8 (bfloat16 models;
each experts module keeps its weights' FP8 copies, remade when the weights change). fuse_moe(model) goes further for the sparse MoE blocks whose routing machmoe
computes itself (softmax top-K: Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, OLMoE; gpt-oss's
biased router; the sigmoid routers of DeepSeek-V3, GLM-4.5, MiniMax-M2): router, routing and
experts in one `machmoe.functional.moe` call.

The experts contract (transformers.integrations.moe): fn(module, hidden_states [T, d],
top_k_index [T, K], top_k_weights [T, K]) -> [T, d], reading from the module
  gate_up_proj [E, 2n, d] (has_gate) or up_proj [E, n, d] (has_gate False), down_proj [E, d, n],
  ([E, d, 2n], [E, d, n] and [E, n, d] when is_transposed), gate_up_proj_bias / up_proj_bias and
  down_proj_bias when has_bias, is_concatenated ([gate; up] rows, else interleaved gate/up rows),
  act_fn, and _apply_gate (the GLU: act_fn(gate) * up unless the class overrides it).
Expert ids outside [0, E) are expert-parallel sentinels (another rank's experts): dropped. Under
transformers' own expert parallelism (DistributedConfig(ep_size=W)) the module holds this rank's
E / W experts and gets local ids: E is read from the weights it holds during the call.

Backend "auto": the machmoe kernels for bfloat16 tensors on an sm_90 GPU, machmoe's torch backend
everywhere else. The clamped SwiGLU gates of gpt-oss, DeepSeek-V4 and their kin run as machmoe's
"clamped_swiglu" (after a numerical check of the class's own gate). A module machmoe cannot
compute exactly (another custom _apply_gate, an activation machmoe does not have such as the erf
GELU, a post-expert norm) runs on transformers' own "grouped_mm" implementation instead, after a
one-time warning that names the module's class and the reason: never on an approximation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional
from .. import torch_backend
from ..enums import ActivationType, Backend, GateUpLayout, GluClamp, Precision, RoutingMethod, parse_enum

try:
    from transformers import activations as _hf_activations
    from transformers.integrations import moe as _hf_moe
except ImportError as error:  # pragma: no cover - the module is optional
    raise ImportError("machmoe.integrations.transformers needs transformers >= 5.17, < 6 "
                      "(pip install 'machmoe[hf]')") from error

_LOG = logging.getLogger("machmoe")
IMPLEMENTATION_NAME = "machmoe"
FP8_IMPLEMENTATION_NAME = "machmoe_fp8"  # the experts' GEMMs in FP8 (docs/LAYER.md "FP8")

# ---------------------------------------------------------------- what a module computes


def _activation_kind(act) -> Optional[str]:
    """'silu', 'gelu_tanh', 'relu' or 'relu2' for the activations machmoe computes exactly, else
    None. By type: the module's act_fn is an instance of transformers' ACT2FN classes or of
    torch.nn (the erf GELU, transformers' default "gelu", is not the tanh form machmoe has)."""
    if isinstance(act, (_hf_activations.SiLUActivation, nn.SiLU)) or act is F.silu:
        return "silu"
    if isinstance(act, (_hf_activations.GELUTanh, _hf_activations.NewGELUActivation)):
        return "gelu_tanh"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    if isinstance(act, nn.ReLU) or act is F.relu or act is torch.relu:
        return "relu"
    if isinstance(act, _hf_activations.ReLUSquaredActivation):
        return "relu2"
    return None


_GLU_ACTIVATIONS = {"silu": ActivationType.SWIGLU, "gelu_tanh": ActivationType.GEGLU,
                    "relu": ActivationType.REGLU}
_PLAIN_ACTIVATIONS = {"silu": ActivationType.SILU, "gelu_tanh": ActivationType.GELU,
                      "relu": ActivationType.RELU, "relu2": ActivationType.RELU_SQ}


@dataclass(frozen=True)
class ExpertsPlan:
    """How machmoe computes one experts module: its weights as machmoe's w1 [E, N1, d],
    b1 [E, N1], w2 [E, d, n], b2 [E, d] (views of the module's parameters; the transposed ones
    are transposed views, which the kernels copy to contiguous tensors each call), its
    activation and its gate/up layout."""

    w1: torch.Tensor
    w2: torch.Tensor
    b1: Optional[torch.Tensor]
    b2: Optional[torch.Tensor]
    activation: ActivationType
    layout: GateUpLayout
    glu_clamp: Optional[GluClamp] = None


def _attrs(module, *names) -> list:
    return [float(getattr(module, name)) for name in names]


# The experts classes whose own _apply_gate is a clamped SwiGLU, by class name -> its GluClamp
# (read from the module's attributes). plan_experts also checks the match numerically
# (_gate_matches), so a release that changes one of these gates falls back instead of being
# computed wrongly.
_CLAMPED_GATES: dict[str, Callable[[nn.Module], GluClamp]] = {
    # gpt-oss: min(g, L)·sigmoid(alpha·min(g, L))·(clamp(u, ±L) + 1), interleaved gate/up
    "GptOssExperts": lambda m: GluClamp(*_attrs(m, "alpha", "limit"), up_offset=1.0),
    "OpenAIPrivacyFilterExperts": lambda m: GluClamp(*_attrs(m, "alpha", "limit"), up_offset=1.0),
    "MiniMaxM3VLExperts": lambda m: GluClamp(*_attrs(m, "swiglu_alpha", "swiglu_limit"), up_offset=1.0),
    # DeepSeek-V4 and its kin: silu(min(g, L))·clamp(u, ±L)
    "DeepseekV4Experts": lambda m: GluClamp.deepseek_v4(*_attrs(m, "limit")),
    "HYV4Experts": lambda m: GluClamp.deepseek_v4(*_attrs(m, "swiglu_limit")),
    "Glm5NextTextExperts": lambda m: GluClamp.deepseek_v4(*_attrs(m, "swiglu_limit")),
    # Step 3.7: min(silu(g), L)·clamp(u, ±L)
    "Step3p7Experts": lambda m: GluClamp.post_activation(*_attrs(m, "limit")),
}
_GATE_CHECKED: dict = {}  # (class, GluClamp, layout) -> whether _apply_gate matched, in this process


def _gate_matches(module: nn.Module, clamp: GluClamp, layout: GateUpLayout, n: int) -> bool:
    """Whether the module's own _apply_gate equals machmoe's clamped SwiGLU with `clamp` on a
    float64 probe H [64, 2n] whose values cross every clamp bound (checked once per class and
    parameters)."""
    key = (type(module), clamp, layout)
    if key not in _GATE_CHECKED:
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(64, 2 * n, generator=gen, dtype=torch.float64) * 2 * clamp.limit
        try:
            with torch.no_grad():
                theirs = module._apply_gate(probe)
            ours = torch_backend.apply_activation(probe, ActivationType.CLAMPED_SWIGLU, layout, clamp)
            _GATE_CHECKED[key] = theirs.shape == ours.shape and torch.allclose(theirs, ours, rtol=1e-6, atol=1e-9)
        except Exception:  # noqa: BLE001 - a gate that can't run on the probe is not one we know
            _GATE_CHECKED[key] = False
    return _GATE_CHECKED[key]


def plan_experts(module: nn.Module) -> Union[ExpertsPlan, str]:
    """The ExpertsPlan of a decorated experts module, or a sentence saying why machmoe cannot
    compute it exactly."""
    if getattr(module, "has_post_expert_norm", False):
        return "it applies a norm after each expert (has_post_expert_norm), which machmoe has not"
    has_gate = getattr(module, "has_gate", True)
    glu_clamp = None
    if has_gate and getattr(type(module), "_apply_gate", None) is not _hf_moe._default_apply_gate:
        make_clamp = _CLAMPED_GATES.get(type(module).__name__)
        if make_clamp is None:
            return (f"it has its own gate function ({type(module).__name__}._apply_gate), which is "
                    "not one of machmoe's activations")
        try:
            glu_clamp = make_clamp(module)
        except (AttributeError, TypeError, ValueError) as error:
            return f"its clamped gate's parameters could not be read ({error})"
    kind = _activation_kind(getattr(module, "act_fn", None))
    if glu_clamp is not None:  # the clamped gates apply SiLU themselves (gpt-oss's has no act_fn)
        kind = "silu"
    if kind is None:
        act = getattr(module, "act_fn", None)
        return (f"its activation {type(act).__name__ if act is not None else 'None'} is not one "
                "machmoe computes (SiLU, tanh GELU, ReLU, ReLU² without a gate)")
    activation = (_GLU_ACTIVATIONS if has_gate else _PLAIN_ACTIVATIONS).get(kind)
    if glu_clamp is not None:
        activation = ActivationType.CLAMPED_SWIGLU
    if activation is None:
        return f"machmoe has no gated form of its activation ({kind})"
    w1 = getattr(module, "gate_up_proj" if has_gate else "up_proj", None)
    w2 = getattr(module, "down_proj", None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor) or w1.dim() != 3 or w2.dim() != 3:
        return "it does not hold 3-D expert weights gate_up_proj (or up_proj) and down_proj"
    b1 = b2 = None
    if getattr(module, "has_bias", False):
        b1 = getattr(module, "gate_up_proj_bias" if has_gate else "up_proj_bias", None)
        b2 = getattr(module, "down_proj_bias", None)
    if getattr(module, "is_transposed", False):
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, d, N1] -> [E, N1, d], [E, n, d] -> [E, d, n]
    # machmoe takes both biases or neither: a missing one is a zero one.
    if b1 is not None and b2 is None:
        b2 = b1.new_zeros(w2.shape[0], w2.shape[1])
    if b2 is not None and b1 is None:
        b1 = b2.new_zeros(w1.shape[0], w1.shape[1])
    n1 = w1.shape[1]
    if has_gate and n1 != 2 * w2.shape[2] or not has_gate and n1 != w2.shape[2]:
        return (f"its weights' shapes do not match (up-projection {list(w1.shape)}, "
                f"down-projection {list(w2.shape)})")
    layout = GateUpLayout.CONCATENATED if getattr(module, "is_concatenated", True) else GateUpLayout.INTERLEAVED
    if glu_clamp is not None and not _gate_matches(module, glu_clamp, layout, w2.shape[2]):
        return (f"its gate function ({type(module).__name__}._apply_gate) does not compute machmoe's "
                f"clamped SwiGLU {glu_clamp} on a test input")
    return ExpertsPlan(w1, w2, b1, b2, activation, layout, glu_clamp)


# ---------------------------------------------------------------- the experts implementation

_WARNED: set = set()  # (class name, reason) pairs already warned about, in this process


def _warn_fallback(module: nn.Module, reason: str) -> None:
    key = (type(module).__qualname__, reason)
    if key not in _WARNED and not torch.compiler.is_compiling():
        _WARNED.add(key)
        _LOG.warning("machmoe: %s runs on transformers' grouped_mm experts instead of machmoe: %s "
                     "(said once per class)", type(module).__name__, reason)


def _fallback(module, hidden_states, top_k_index, top_k_weights):
    """transformers' own grouped_mm experts (its batched_mm, then the eager forward, where a
    release lacks it)."""
    interface = _hf_moe.ALL_EXPERTS_FUNCTIONS
    for name in ("grouped_mm", "batched_mm"):
        if name in interface:
            return interface[name](module, hidden_states, top_k_index, top_k_weights)
    eager = type(module).forward.__wrapped__  # the class's own forward, under the decorator
    return eager(module, hidden_states, top_k_index, top_k_weights)


def _fp8_options(module: nn.Module, plan: "ExpertsPlan") -> Union[dict, str]:
    """experts_topk's FP8 arguments for the module (its weights' FP8 copies cached on it, remade
    when they change), or why its experts cannot run in FP8."""
    from .. import fp8_layer

    try:
        fp8_layer.check_options(_FP8_NAMES, plan.activation, plan.w2.shape[1], plan.w2.shape[2])
    except ValueError as error:
        return f"its experts cannot run in FP8: {error}"
    if plan.w1.dtype != torch.bfloat16:
        return f"its experts cannot run in FP8: the weights are {plan.w1.dtype}, not bfloat16"
    cache = module.__dict__.get("_machmoe_fp8_cache")
    if cache is None:
        cache = module.__dict__["_machmoe_fp8_cache"] = fp8_layer.new_cache()
    return {"precision": "fp8", "fp8_cache": cache}


def make_experts_forward(backend: Union[Backend, str] = Backend.AUTO,
                         precision: Union[Precision, str] = Precision.BF16) -> Callable:
    """An ExpertsInterface function running the experts on machmoe with `backend`; precision
    "fp8": their GEMMs in FP8, each module's weights' FP8 copies cached on it (a module whose
    experts FP8 does not compute runs on transformers' grouped_mm, after a warning)."""
    backend = parse_enum(Backend, backend, "backend")
    precision = parse_enum(Precision, precision, "precision")

    def machmoe_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """out [T, d] = Σ_k top_k_weights[t, k] · expert_{top_k_index[t, k]}(hidden_states[t]),
        ids outside [0, E) dropped; in hidden_states' dtype."""
        plan = plan_experts(module)
        options = _fp8_options(module, plan) if precision == Precision.FP8 and not isinstance(plan, str) else {}
        if isinstance(options, str):
            plan = options
        if isinstance(plan, str):
            _warn_fallback(module, plan)
            return _fallback(module, hidden_states, top_k_index, top_k_weights)
        # Under autocast the tokens may come in float32 while the weights are bfloat16.
        x = hidden_states.to(plan.w1.dtype)
        out = functional.experts_topk(x, plan.w1, plan.w2, top_k_weights, top_k_index, b1=plan.b1,
                                      b2=plan.b2, activation=plan.activation, layout=plan.layout,
                                      backend=backend, glu_clamp=plan.glu_clamp, **options)
        return out.to(hidden_states.dtype)

    return machmoe_experts_forward


experts_forward = make_experts_forward(Backend.AUTO)
fp8_experts_forward = make_experts_forward(Backend.AUTO, Precision.FP8)


def register(name: str = IMPLEMENTATION_NAME, backend: Union[Backend, str] = Backend.AUTO,
             precision: Union[Precision, str] = Precision.BF16) -> None:
    """Registers machmoe's experts under `name` in transformers' ExpertsInterface (for every
    model, as transformers' own implementations are); importing this module has already
    registered "machmoe" (bf16) and "machmoe_fp8" (FP8), with backend "auto"."""
    precision = parse_enum(Precision, precision, "precision")
    if parse_enum(Backend, backend, "backend") == Backend.AUTO:
        function = fp8_experts_forward if precision == Precision.FP8 else experts_forward
    else:
        function = make_experts_forward(backend, precision)
    _hf_moe.ExpertsInterface.register(name, function)


register()
register(FP8_IMPLEMENTATION_NAME, precision=Precision.FP8)

# ---------------------------------------------------------------- fused sparse MoE blocks


@dataclass(frozen=True)
class _BlockRule:
    """A sparse MoE block machmoe computes whole: its router's class, machmoe's routing for it,
    whether the router divides the K selected scores by their sum (a function of the router), the
    router's other options as machmoe.functional.moe arguments (a function of the block), and its
    shared expert: "gated" (Qwen2-MoE style: shared_expert, shared_expert_gate), "plain"
    (DeepSeek style: shared_experts) or None; the router's attribute name in the block, and
    whether the block returns (output, router scores) rather than the output alone."""

    router_class: str
    renormalize: Callable[[nn.Module], bool]
    shared: Optional[str] = None
    routing: RoutingMethod = RoutingMethod.TOPK_SOFTMAX
    router_options: Callable[[nn.Module], dict] = lambda block: {}
    router_attr: str = "gate"
    returns_pair: bool = False
    # How the block calls its router on tokens [T, d] (only to let transformers record the logits).
    call_router: Callable[[nn.Module, torch.Tensor], object] = lambda block, tokens: block.gate(tokens)


def _norm_topk_prob(router: nn.Module) -> bool:
    return bool(router.norm_topk_prob)


def _grouped_sigmoid_options(block: nn.Module) -> dict:
    """DeepSeek-V3 / GLM-4.5's router: sigmoid scores, e_score_correction_bias for the choice only,
    group-limited top-K, renormalisation, routed scaling."""
    gate = block.gate
    return {"selection_bias": gate.e_score_correction_bias, "routed_scaling_factor": float(gate.routed_scaling_factor),
            "n_group": int(gate.num_group), "topk_group": int(gate.topk_group)}


# Block class -> rule. The softmax routers compute logits = x · Wᵀ (no bias), P = softmax over all
# E in float32, the K largest P, optionally divided by their sum: machmoe's "topk_softmax". The
# sigmoid routers: machmoe's "sigmoid" with the selection bias (and groups and scaling).
_BLOCK_RULES = {
    "MixtralSparseMoeBlock": _BlockRule("MixtralTopKRouter", lambda router: True),
    "Qwen3MoeSparseMoeBlock": _BlockRule("Qwen3MoeTopKRouter", _norm_topk_prob),
    "OlmoeSparseMoeBlock": _BlockRule("OlmoeTopKRouter", _norm_topk_prob),
    "Qwen2MoeSparseMoeBlock": _BlockRule("Qwen2MoeTopKRouter", _norm_topk_prob, shared="gated"),
    "Qwen3NextSparseMoeBlock": _BlockRule("Qwen3NextTopKRouter", _norm_topk_prob, shared="gated"),
    "Qwen3_5MoeSparseMoeBlock": _BlockRule("Qwen3_5MoeTopKRouter", lambda router: True, shared="gated"),
    "DeepseekV3MoE": _BlockRule("DeepseekV3TopkRouter", _norm_topk_prob, shared="plain",
                                routing=RoutingMethod.SIGMOID, router_options=_grouped_sigmoid_options),
    "Glm4MoeMoE": _BlockRule("Glm4MoeTopkRouter", _norm_topk_prob, shared="plain",
                             routing=RoutingMethod.SIGMOID, router_options=_grouped_sigmoid_options),
    "MiniMaxM2SparseMoeBlock": _BlockRule(
        "MiniMaxM2TopKRouter", lambda router: True, routing=RoutingMethod.SIGMOID,
        router_options=lambda block: {"selection_bias": block.e_score_correction_bias},
        call_router=lambda block, tokens: block.gate(tokens, block.e_score_correction_bias)),
    # gpt-oss: logits = x·Wᵀ + b, the K largest, softmax over them: "softmax_topk" with a router
    # bias. The block returns (output, router scores); its decoder layer discards the scores.
    "GptOssMLP": _BlockRule(
        "GptOssTopKRouter", lambda router: True, routing=RoutingMethod.SOFTMAX_TOPK, router_attr="router",
        returns_pair=True, router_options=lambda block: {"router_bias": block.router.bias},
        call_router=lambda block, tokens: block.router(tokens)),
}


def _router_logits_recorded(router: nn.Module) -> bool:
    """Whether this forward records the router's logits (output_router_logits: transformers
    hooks the router module and collects its first output, for the load-balancing loss)."""
    if not router._forward_hooks:
        return False  # the recording hooks are installed on the first forward that asks
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another release: record whenever hooks are present
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class FusedSparseMoeBlock(nn.Module):
    """A transformers sparse MoE block computed by `machmoe.functional.moe` (router, top-K
    softmax routing, experts and weighted sum in one call) on the block's own parameters: it
    holds the original `gate` (router), `experts` and, where present, `shared_expert` and
    `shared_expert_gate` modules under the same names, so state_dict keys, checkpoints and
    optimisers see the same tensors.

    Forward: hidden_states [B, S, d] -> [B, S, d], as the original block. When the model records
    router logits (output_router_logits, for its auxiliary loss), the router module is also
    called, so that its hooks record them as before; the layer's own routing is machmoe's (the
    same softmax top-K, with fp32 logits). machmoe's own aux loss is not used: the model
    computes its own from the recorded logits."""

    def __init__(self, block: nn.Module, rule: _BlockRule, backend: Backend, precision: Precision = Precision.BF16):
        super().__init__()
        # Every child of the block, in its order (state_dict's key order follows it).
        for child_name, child in block.named_children():
            self.add_module(child_name, child)
        # ... and the block's own tensors (MiniMax-M2 keeps its selection bias on the block).
        for name, param in block.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in block.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in block._non_persistent_buffers_set)
        self.shared = rule.shared
        self.rule = rule
        router = getattr(block, rule.router_attr)
        self.top_k = int(getattr(block, "top_k", None) or router.top_k)
        self.routing = rule.routing
        self.renormalize = rule.renormalize(router)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.backend = backend
        # precision="fp8": the routed experts' GEMMs in FP8 (docs/LAYER.md "FP8"), with this
        # block's cache of the weights' FP8 copies (remade when a weight changes).
        self.precision = precision
        if precision == Precision.FP8:
            from .. import fp8_layer

            self.fp8_cache = fp8_layer.new_cache()
        self.original_class = type(block).__name__

    def extra_repr(self) -> str:
        return (f"fused {self.original_class}: top_k={self.top_k}, routing={self.routing.value}, "
                f"renormalize={self.renormalize}, backend={self.backend.value}, precision={self.precision.value}")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative router jitter
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        tokens = hidden_states.reshape(-1, hidden_dim)  # [T, d]
        router = getattr(self, self.rule.router_attr)
        if _router_logits_recorded(router):
            self.rule.call_router(self, tokens)
        plan = plan_experts(self.experts)
        reason = plan if isinstance(plan, str) else _sharded(self.experts)
        if reason is not None:  # fuse_moe checked it; the module changed since
            raise RuntimeError(f"machmoe: the fused {self.original_class} can no longer run on "
                               f"machmoe: {reason}")
        x = tokens.to(plan.w1.dtype)
        out, _ = functional.moe(
            x, router.weight.to(x.dtype), plan.w1, plan.w2, num_experts_per_tok=self.top_k,
            activation=plan.activation, b1=plan.b1, b2=plan.b2, layout=plan.layout,
            routing=self.routing, renormalize=self.renormalize, backend=self.backend,
            glu_clamp=plan.glu_clamp, **self._precision_options(), **self.rule.router_options(self))
        out = out.to(hidden_states.dtype)
        if self.shared == "gated":
            shared = self.shared_expert(tokens)
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        elif self.shared == "plain":
            out = out + self.shared_experts(tokens)
        out = out.reshape(batch_size, sequence_length, hidden_dim)
        # gpt-oss's block also returns its router scores, which its decoder layer discards: not
        # computed here (None).
        return (out, None) if self.rule.returns_pair else out


    def _precision_options(self) -> dict:
        if self.precision == Precision.FP8:
            return {"precision": "fp8", "fp8_cache": self.fp8_cache}
        return {}


class FuseReport(NamedTuple):
    """What fuse_moe did: the qualified names of the blocks it replaced, and for every MoE block
    it left as it was, why."""

    fused: list
    unfused: dict


def _is_experts_module(module: nn.Module) -> bool:
    # What use_experts_implementation adds to every decorated experts class.
    return hasattr(module, "has_gate") and hasattr(module, "is_concatenated")


def _sharded(experts: nn.Module) -> Optional[str]:
    """Why a fused block cannot compute these experts when transformers has sharded them (its
    expert parallelism, or DTensor weights from its tensor parallelism), else None: a fused block
    reads the weights whole and routes over all E experts, while only transformers' own experts
    forward exchanges the tokens. Their experts_implementation="machmoe" runs under it instead."""
    if getattr(experts, "_is_expert_parallel", False):
        return "its experts are sharded by transformers' expert parallelism"
    if any(hasattr(p, "device_mesh") and hasattr(p, "placements") for p in experts.parameters(recurse=False)):
        return "its experts' weights are sharded (DTensor) by transformers' parallelism"
    return None


# The FP8 layer's rules, named as a transformers experts module holds them.
_FP8_NAMES = {"activation": "the activation", "d": "the hidden size", "n": "the intermediate size"}


def fuse_moe(model: nn.Module, backend: Union[Backend, str] = Backend.AUTO,
             precision: Union[Precision, str] = Precision.BF16) -> FuseReport:
    """Replaces, in place, every sparse MoE block of `model` that machmoe computes whole (see
    _BLOCK_RULES: Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, OLMoE, DeepSeek-V3,
    GLM-4.5, MiniMax-M2, gpt-oss) by a FusedSparseMoeBlock on the same parameter tensors. Any
    other module that holds a decorated experts module as `experts` (other routings, experts
    machmoe cannot compute, or experts sharded by transformers' expert or tensor parallelism) is
    left as it is and listed with the reason; its experts still run on machmoe with
    experts_implementation="machmoe".

    precision="fp8" runs the fused blocks' routed experts in FP8 (docs/LAYER.md "FP8"); a block
    whose experts the FP8 layer does not compute (activations other than the SwiGLU, clamped or
    not, sizes not multiples of 16) is left unfused, with the reason.

    Returns FuseReport(fused=[names], unfused={name: reason}).
    """
    backend = parse_enum(Backend, backend, "backend")
    precision = parse_enum(Precision, precision, "precision")
    fused, unfused = [], {}
    for name, block in list(model.named_modules()):
        experts = getattr(block, "experts", None)
        if isinstance(block, FusedSparseMoeBlock) or not isinstance(experts, nn.Module) \
                or not _is_experts_module(experts):
            continue
        rule = _BLOCK_RULES.get(type(block).__name__)
        router = getattr(block, rule.router_attr if rule is not None else "gate", None)
        if rule is None:
            unfused[name] = f"machmoe has no fused form of {type(block).__name__} (its routing)"
            continue
        if type(router).__name__ != rule.router_class:
            unfused[name] = (f"its router is a {type(router).__name__}, not the "
                             f"{rule.router_class} whose routing machmoe computes")
            continue
        plan = plan_experts(experts)
        if isinstance(plan, str):
            unfused[name] = f"its experts ({type(experts).__name__}) cannot run on machmoe: {plan}"
            continue
        sharded = _sharded(experts)
        if sharded is not None:
            unfused[name] = sharded + ' (experts_implementation="machmoe" runs them under it)'
            continue
        if precision == Precision.FP8:
            from .. import fp8_layer

            try:
                fp8_layer.check_options(_FP8_NAMES, plan.activation, plan.w2.shape[1], plan.w2.shape[2])
            except ValueError as error:
                unfused[name] = f"its experts cannot run in FP8: {error}"
                continue
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else None
        if parent is None:
            unfused[name] = "it is the model itself"
            continue
        setattr(parent, child_name, FusedSparseMoeBlock(block, rule, backend, precision))
        fused.append(name)
    return FuseReport(fused, unfused)


__all__ = ["ExpertsPlan", "FuseReport", "FusedSparseMoeBlock", "FP8_IMPLEMENTATION_NAME", "IMPLEMENTATION_NAME",
           "experts_forward", "fp8_experts_forward",
           "fuse_moe", "make_experts_forward", "plan_experts", "register"]
