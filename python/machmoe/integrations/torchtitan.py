"""Run torchtitan's Mixture-of-Experts layers on machmoe.

torchtitan (0.3) builds its models from config trees and changes them before the build with
*model config converters* (`torchtitan.protocols.model.ModelConfigConverter`: a `Config`
dataclass whose `build()` gives an object with `convert(model_config) -> model_config`). This
module offers one, `MachMoEConverter`, plus `convert_moe_modules` for a model that is already
built:

    from machmoe.integrations.torchtitan import MachMoEConverter
    spec = torchtitan.models.qwen3.model_registry("30B-A3B",
                                                  converters=[MachMoEConverter.Config()])

Either way each torchtitan `MoE` (torchtitan.models.common.moe) becomes a `MachMoEMoE`, a
subclass with the same submodules, parameters, buffers and state-dict names, whose forward

1. calls torchtitan's own router (`self.router(x, self.expert_bias_E)`: score function, expert
   bias for selection only, node-limited groups, route_norm and route_scale are torchtitan's);
2. keeps torchtitan's bookkeeping: `tokens_per_expert_E` (the load-balancing hook's counts) is
   accumulated in training mode exactly as before;
3. runs the routed experts with `machmoe.functional.experts_topk` on the router's top-K
   (scores, experts) [T, K];
4. adds torchtitan's shared experts (`self.shared_experts`, unchanged).

The expert weights are the module's own parameters, read at every call; no copy is kept.
torchtitan stores the gate and up projections apart (w1_EFD, w3_EFD [E, F, D]); machmoe's GLU
takes them as one [E, 2F, D] tensor, so every forward concatenates them (gate rows first: the
"concatenated" layout). That concatenation is a per-call temporary of the expert weights' size
(in the compute dtype) and its backward splits the gradient back onto w1_EFD and w3_EFD.
w2_EDF [E, D, F] is machmoe's w2 as it is.

Precision: torchtitan's GroupedExperts casts tokens and expert weights to bfloat16 whatever the
parameters' dtype, and returns its output in the tokens' dtype. `expert_dtype="bfloat16"` (the
default) does the same, so on an H100/H200 `backend="auto"` runs machmoe's kernels;
`expert_dtype="input"` computes the experts in the tokens' dtype instead (e.g. float32 through
the torch backend). The routing scores stay in the router's float32.

Not covered (refused with an error that says so): expert parallelism (a token dispatcher with
an EP mesh; machmoe.distributed has its own expert parallelism), expert weights sharded as
DTensors (tensor or expert parallel), and experts other than torchtitan's SwiGLU
`GroupedExperts` (e.g. gpt-oss's experts with biases and a clamped activation).

The routed experts always go through `experts_topk`, never the fused `machmoe.functional.moe`
(machmoe's own router): torchtitan's routing is the reference here, and the fused layer matches it
only in a corner of its options (no expert bias with softmax scores, no node-limited groups,
route_scale 1), picks its experts from logits of bf16 operands on the GPU (so near-ties may go
elsewhere), and does not return the selection that `tokens_per_expert_E` counts.

`experts_topk` takes the top-K result as it is (ordered by token and free of repeated pairs by
construction), so the kernels' path does not synchronise with the host.

Tested with torchtitan 0.3.0 (its `models.common.moe` module; 0.3.0's model packages themselves
need a PyTorch newer than 2.11 for their FSDP imports). torchtitan releases before 0.3 keep the
MoE in another module (`torchtitan.models.moe`) and have no config converters: not supported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

from machmoe import functional

try:
    from torchtitan.models.common.moe import GroupedExperts, MoE
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as err:  # torchtitan missing, or a release without models.common.moe
    raise ImportError(
        "machmoe.integrations.torchtitan needs torchtitan >= 0.3 (torchtitan.models.common.moe "
        f"and torchtitan.protocols.model.ModelConfigConverter); importing them failed: {err}"
    ) from err

_EXPERT_DTYPES = ("bfloat16", "input")
_BACKENDS = ("auto", "machmoe", "torch")


def _check_options(backend: str, expert_dtype: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}; got {backend!r}")
    if expert_dtype not in _EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be one of {_EXPERT_DTYPES}; got {expert_dtype!r}")


def _check_experts_class(experts_cls: type, where: str) -> None:
    # Subclasses of GroupedExperts (the float8/MXFP8 converters' quantised experts, gpt-oss's)
    # compute something else than the bf16 SwiGLU this module reproduces.
    if experts_cls is not GroupedExperts:
        raise ValueError(
            f"{where}: the routed experts must be torchtitan's GroupedExperts (SwiGLU, no biases) "
            f"to run on machmoe; got {experts_cls.__name__}")


def _check_moe_class(moe_cls: type, where: str) -> None:
    # A subclass of MoE (gpt-oss's) has its own forward and fields, which a swap would drop.
    if moe_cls is not MoE and not issubclass(moe_cls, MachMoEMoE):
        raise ValueError(f"{where}: only torchtitan's own MoE can run on machmoe; got the "
                         f"subclass {moe_cls.__name__}")


class MachMoEMoE(MoE):
    """torchtitan's MoE with the routed experts computed by machmoe (module docstring).

    Same constructor, parameters and buffers as `MoE`; the Config adds `backend` (machmoe's:
    "auto", "machmoe" or "torch") and `expert_dtype` ("bfloat16" like torchtitan, or "input").
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        backend: str = "auto"
        expert_dtype: Literal["bfloat16", "input"] = "bfloat16"

    def __init__(self, config: Config):
        _check_options(config.backend, config.expert_dtype)
        super().__init__(config)
        _check_experts_class(type(self.routed_experts.inner_experts), "MachMoEMoE")
        self.machmoe_backend = config.backend
        self.machmoe_expert_dtype = config.expert_dtype

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """x_BLD [B, L, D] -> [B, L, D]: torchtitan's router and shared experts, machmoe's
        routed experts."""
        # topk_scores_BLK float32 [B, L, K], topk_expert_ids_BLK int64 [B, L, K],
        # scores_BLE [B, L, E] (unused here: torchtitan needs it only for its routing map).
        topk_scores_BLK, topk_expert_ids_BLK, _ = self.router(x_BLD, self.expert_bias_E)

        if self.training:
            # torchtitan counts, per expert, the tokens that selected it (its routing map's column
            # sums); a token's K experts are distinct, so a bincount of the ids is the same count.
            with torch.no_grad():
                counts_E = torch.bincount(topk_expert_ids_BLK.reshape(-1),
                                          minlength=self.tokens_per_expert_E.shape[0])
                self.tokens_per_expert_E.add_(counts_E)

        out_BLD = self._routed_experts_output(x_BLD, topk_scores_BLK, topk_expert_ids_BLK)
        if self.shared_experts is not None:
            out_BLD = out_BLD + self.shared_experts(x_BLD)
        return out_BLD

    def _routed_experts_output(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                               topk_expert_ids_BLK: torch.Tensor) -> torch.Tensor:
        dispatcher = self.routed_experts.token_dispatcher
        if getattr(dispatcher, "ep_mesh", None) is not None:
            raise RuntimeError(
                "MachMoEMoE: expert parallelism (a token dispatcher with an EP mesh) is not "
                "supported; run torchtitan without EP (machmoe.distributed has its own)")
        experts = self.routed_experts.inner_experts
        w1_EFD, w2_EDF, w3_EFD = experts.w1_EFD, experts.w2_EDF, experts.w3_EFD
        if any(isinstance(w, DTensor) for w in (w1_EFD, w2_EDF, w3_EFD)):
            raise RuntimeError(
                "MachMoEMoE: expert weights sharded as DTensors (tensor or expert parallelism) are "
                "not supported; the experts must be plain tensors in the forward (FSDP is fine)")

        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        T = B * L
        dtype = torch.bfloat16 if self.machmoe_expert_dtype == "bfloat16" else x_BLD.dtype
        x_TD = x_BLD.reshape(T, D).to(dtype)
        # machmoe's GLU weight, "concatenated" layout: rows [0, F) gate (w1, through SiLU),
        # rows [F, 2F) up (w3). [E, 2F, D], a per-call temporary (module docstring).
        w13_E2FD = torch.cat([w1_EFD.to(dtype), w3_EFD.to(dtype)], dim=1)
        # The router's top-K [T, K]: a token's K experts are distinct.
        out_TD = functional.experts_topk(
            x_TD, w13_E2FD, w2_EDF.to(dtype), topk_scores_BLK.reshape(T, K),
            topk_expert_ids_BLK.reshape(T, K), activation="swiglu", layout="concatenated",
            backend=self.machmoe_backend)
        return out_TD.to(x_BLD.dtype).view(B, L, D)


class MachMoEConverter(ModelConfigConverter):
    """A torchtitan model config converter: every `MoE.Config` in the tree becomes a
    `MachMoEMoE.Config` with the same fields (so the same modules and parameter names) and this
    converter's `backend` and `expert_dtype`. Pass `MachMoEConverter.Config()` in a model
    registry's `converters` list. It refuses MoE configs whose routed experts are not
    torchtitan's `GroupedExperts` (apply it before, or instead of, converters that replace them).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        backend: str = "auto"
        """machmoe backend of the routed experts: "auto", "machmoe" or "torch"."""
        expert_dtype: Literal["bfloat16", "input"] = "bfloat16"
        """The experts' compute dtype: "bfloat16" (as torchtitan's GroupedExperts) or "input"."""

    def __init__(self, config: Config):
        _check_options(config.backend, config.expert_dtype)
        self.config = config

    def convert(self, model_config):
        converted = 0
        for fqn, moe_config, parent, attr in model_config.traverse(MoE.Config):
            where = f"MachMoEConverter ({fqn or 'the root'})"
            _check_moe_class(type(moe_config)._owner, where)
            _check_experts_class(type(moe_config.routed_experts.inner_experts)._owner, where)
            fields = {f.name: getattr(moe_config, f.name) for f in dataclasses.fields(MoE.Config)}
            new_config = MachMoEMoE.Config(**fields, backend=self.config.backend,
                                           expert_dtype=self.config.expert_dtype)
            if parent is None:
                model_config = new_config
            elif isinstance(parent, list):
                parent[attr] = new_config
            else:
                setattr(parent, attr, new_config)
            converted += 1
        if converted == 0:
            raise ValueError("MachMoEConverter: the model config has no torchtitan MoE.Config to "
                             "convert")
        return model_config


def convert_moe_modules(model: torch.nn.Module, *, backend: str = "auto",
                        expert_dtype: str = "bfloat16") -> int:
    """Turns every torchtitan `MoE` module of a built `model` into a `MachMoEMoE` in place (its
    class changes; its parameters, buffers and hooks stay the same objects). Returns how many it
    converted. Raises ValueError for a MoE whose routed experts are not `GroupedExperts`."""
    _check_options(backend, expert_dtype)
    converted = 0
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            where = f"convert_moe_modules ({name or 'the root'})"
            _check_moe_class(type(module), where)
            _check_experts_class(type(module.routed_experts.inner_experts), where)
            if not isinstance(module, MachMoEMoE):
                module.__class__ = MachMoEMoE
            module.machmoe_backend = backend
            module.machmoe_expert_dtype = expert_dtype
            converted += 1
    return converted
