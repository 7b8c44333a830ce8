"""Expert parallelism: the experts of one MoE layer sharded over the ranks of a process group
(docs/LAYER.md, "Expert parallelism"; docs/SCALING.md).

Rank q of W holds experts [q·E/W, (q+1)·E/W) and a replica of the router. Three exchanges:

- "all_gather" (the default; machmoe.expert_exchange): every rank's tokens gathered to every
  rank, each rank's experts run on all of them, the partial sums reduce-scattered back. No host
  synchronisation (with max_tokens given), CUDA-graph capturable; the exchange is not yet
  overlapped with the experts. It sends each token to every other rank, which is what a filtered
  exchange sends too when W is small against K (W = 2 and 4 at K = 8).
- "all_to_all": a token goes only to the ranks that hold one of its experts (at most min(K, W)
  times, not K). With max_tokens given, in blocks of a fixed capacity and without host
  synchronisation (machmoe.expert_capacity_exchange; an overflow poisons the output and is
  raised by check_capacity()); without, exactly the rows needed, with one
  host synchronisation per forward for the row counts (machmoe.expert_all_to_all).
- "all_to_all_device": the all-to-all's rows (a token once per rank holding one of its experts)
  with their counts kept on the device: exactly the rows needed travel, into receive buffers of
  a capacity fixed by max_tokens and capacity_factor, with no host synchronisation and CUDA-graph
  capturable (machmoe.expert_device_exchange; on CUDA it needs torch's symmetric memory and
  machmoe's pull_rows kernel).

This module holds the public layer (`ExpertParallelMoE`, `expert_parallel_moe`): argument checks,
the routing of the rank's own tokens (logits, top-K, aux loss: as `MoE` on those tokens, on
machmoe's kernels or torch ops), shared by both exchanges, and the choice of exchange. Token
rounding runs over the group's whole batch with the all-gather exchange
(machmoe.expert_exchange.rounded_gathered_experts).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import functional, torch_backend
from .enums import (ActivationType, Backend, GateUpLayout, GluClamp, Precision, RoutingMethod, TokenRounding,
                    is_gate_routing, is_glu, parse_enum, resolve_glu_clamp)
from .expert_all_to_all import all_to_all_experts
from .expert_capacity_exchange import capacity_all_to_all_experts, capacity_rows
from .expert_device_exchange import device_all_to_all_experts
from .exchange_overflow import check_capacity  # noqa: F401 (public: machmoe.distributed.check_capacity)
from .expert_exchange import gathered_experts, rounded_gathered_experts
from .moe import ExpertLinear, MoE, _positive_int, layer_settings, rounding_for_call


class _RouteOnKernels(torch.autograd.Function):
    """The layer's router on the kernels as one op and one autograd node (machmoe::router_forward:
    each node and op costs host time that a small layer's GPU time does not hide): logits [T, E]
    fp32 = x [T, d] · Wr [E, d]ᵀ (+ router bias [E]), bf16 operands and fp32 accumulation; the
    top-K router kernel's scores [T, K] fp32 and experts [T, K] int32 (LAYER.md's selection and
    ties, the router options); the aux loss [] fp32 of those pairs, computed as the single-GPU
    layer computes it. The backward (machmoe::router_backward) takes the scores' and the aux loss's
    gradients; a gradient of the logits themselves (token rounding reads them) is added here."""

    @staticmethod
    def forward(ctx, x, router_weight, router_bias, K, routing, renormalize, selection_bias, options):
        logits, scores, experts, offsets, aux = torch.ops.machmoe.router_forward(
            x, router_weight, router_bias, K, routing, renormalize, selection_bias, *options)
        ctx.save_for_backward(x, router_weight, logits, scores, experts, offsets)
        ctx.call = (router_bias is not None, routing, renormalize, *options)
        ctx.mark_non_differentiable(experts)
        ctx.set_materialize_grads(False)
        return logits, scores, experts, aux

    @staticmethod
    def backward(ctx, d_logits, d_scores, _, d_aux):
        x, wr, logits, scores, experts, offsets = ctx.saved_tensors
        dx, dwr, d_bias = torch.ops.machmoe.router_backward(
            x, wr, logits, scores, experts, offsets, None if d_scores is None else d_scores.contiguous(),
            None if d_aux is None else d_aux.float().contiguous(), *ctx.call)
        if d_logits is not None:  # logits = x·Wrᵀ + b: their own gradient, rounded to bf16 as the op's
            g = d_logits.to(x.dtype)
            dx = dx + torch.mm(g, wr)
            dwr = (dwr.float() + torch.mm(g.t(), x, out_dtype=torch.float32)).to(wr.dtype)
            if ctx.call[0]:
                d_bias = (d_bias.float() + d_logits.sum(0)).to(d_bias.dtype)
        return dx, dwr, d_bias if ctx.call[0] else None, None, None, None, None, None


def _on_kernels(x: torch.Tensor) -> bool:
    """Whether the routing and the row sums may run on machmoe's CUDA kernels."""
    from . import _ops

    return x.is_cuda and x.dtype == torch.bfloat16 and _ops.kernels_unavailable_reason(x.device) is None


def _route(x, router_weight, K, routing, renormalize, selection_bias, kernels, router_bias=None,
           options: torch_backend.RouterOptions = torch_backend.RouterOptions()):
    """-> logits [T, E] (routing dtype), scores [T, K], experts [T, K] (int32 from the kernels,
    else int64), aux [] (the load-balancing loss of those pairs): the layer's routing."""
    if kernels:
        bias = None if selection_bias is None else selection_bias.float().contiguous()
        return _RouteOnKernels.apply(x, router_weight.to(x.dtype), router_bias, K, routing.value, renormalize, bias,
                                     tuple(options))
    logits = torch_backend.router_logits(x, router_weight, router_bias)
    scores, experts = torch_backend.route_topk(logits, K, routing, renormalize, selection_bias, options)
    return logits, scores, experts, torch_backend.aux_loss(logits, experts)


EXCHANGES = ("all_gather", "all_to_all", "all_to_all_device")


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _largest_T(T: int, device: torch.device, group) -> int:
    """The group's largest T of this call: an all-reduce the host waits for (the all-gather
    exchange's rows per rank when no max_tokens is given)."""
    largest = torch.tensor([T], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return int(largest.item())


def _device_count_transports(x: torch.Tensor, W: int, group) -> tuple:
    """(to the experts, to the tokens) of the all_to_all_device exchange: the pull_rows kernel
    over symmetric memory on CUDA, the counts through the host elsewhere (gloo), a local copy on
    one rank."""
    from . import device_count_transport as transport

    if W == 1:
        return transport.local_transport, transport.local_transport
    if not x.is_cuda:
        t = transport.host_count_transport(group)
        return t, t
    t = transport.PullTransport.get(_group_name(group), W, x.device)
    return t, t


def _check_max_tokens(T: int, max_tokens: int) -> None:
    """T against max_tokens (already checked by _check_exchange), on the host."""
    if T > max_tokens:
        raise ValueError(f"x has T = {T} tokens, more than max_tokens = {max_tokens}, the rows each "
                         f"rank's exchange buffers were sized for; raise max_tokens or pass fewer tokens")


def pair_capacity(capacity_factor: float, W: int, rows: int, K: int) -> Optional[int]:
    """The all-gather exchange's (token, expert) pairs per rank: None (all W·rows·K gathered
    pairs, which never overflows) for capacity_factor 1, else ceil(capacity_factor · W·rows·K),
    at least 1. A balanced batch gives each rank rows·K of them: a factor of b/W leaves room for
    b times that."""
    if capacity_factor >= 1:
        return None
    return max(1, math.ceil(capacity_factor * W * rows * K))


def _check_exchange(exchange: str, max_tokens: Optional[int], capacity_factor,
                    rounding: TokenRounding, precision: Precision = Precision.BF16) -> None:
    """The exchange's settings, checked alike by the function and the module."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}; got {exchange!r}")
    if precision == Precision.FP8 and exchange != "all_gather":
        raise ValueError(f"precision='fp8' runs with exchange='all_gather' (its experts on the gathered rows); "
                         f"got exchange={exchange!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens must be an int >= 1 or None; got {max_tokens!r}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or \
            not 0 < capacity_factor <= 1:
        raise ValueError(f"capacity_factor must be a number in (0, 1]; got {capacity_factor!r}")
    if exchange == "all_to_all_device" and max_tokens is None:
        raise ValueError("exchange='all_to_all_device' needs max_tokens (the most tokens a rank passes, "
                         "which sizes its exchange buffers); got None")
    if rounding != TokenRounding.NONE and exchange != "all_gather":
        raise ValueError(f"token_rounding={rounding.value!r} needs exchange='all_gather' (the "
                         f"experts' owners see the whole batch's scores there); got {exchange!r}")
    if rounding != TokenRounding.NONE and capacity_factor < 1:
        raise ValueError(f"token_rounding={rounding.value!r} needs capacity_factor=1 (a rounded "
                         f"batch's pairs are not bounded by a capacity); got {capacity_factor!r}")


def expert_parallel_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    num_experts_per_tok: int,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation: Union[ActivationType, str] = ActivationType.SWIGLU,
    layout: Union[GateUpLayout, str] = GateUpLayout.INTERLEAVED,
    routing: Union[RoutingMethod, str] = RoutingMethod.SOFTMAX_TOPK,
    renormalize: bool = True,
    selection_bias: Optional[torch.Tensor] = None,
    group=None,
    backend: Union[Backend, str] = Backend.AUTO,
    glu_clamp: Optional[GluClamp] = None,
    exchange: str = "all_gather",
    max_tokens: Optional[int] = None,
    token_rounding: Union[TokenRounding, str] = TokenRounding.NONE,
    tile_m: int = 128,
    seed: int = 0,
    capacity_factor: float = 1.0,
    router_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    precision: Union[Precision, str] = Precision.BF16,
    fp8_cache=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, d], aux []) of the layer on this rank's tokens x [T, d], with the experts sharded.

    router_weight [E, d] is the same on every rank; w1 [E_local, N1, d], w2 [E_local, d, n], b1
    [E_local, N1], b2 [E_local, d] are this rank's experts (E_local = E / W, rank q holding experts
    q·E_local ...). Every rank of `group` must call this together (it runs collectives).

    Args:
        x: [T, d] this rank's tokens (T may differ between ranks).
        router_weight: [E, d] the router, identical on every rank.
        w1: [E_local, N1, d] this rank's up-projections; N1 = 2n for GLU activations, else n.
        w2: [E_local, d, n] this rank's down-projections.
        num_experts_per_tok: K, experts per token, 1 <= K <= E.
        b1: [E_local, N1] or None (default); given with b2 or not at all.
        b2: [E_local, d] or None (default).
        activation: ActivationType or its name (default "swiglu"); see machmoe.functional.moe.
        layout: "interleaved" (default) or "concatenated" gate/up rows of w1.
        routing: "softmax_topk" (default), "topk_softmax" or "sigmoid".
        renormalize: divide a token's K scores by their sum (topk_softmax, sigmoid; default True).
        selection_bias: [E] sigmoid routing only: added to the scores when choosing experts.
        group: the torch.distributed process group whose ranks share the experts (None: the
            default group).
        backend: "auto" (default), "machmoe" or "torch"; see machmoe.functional.resolve_backend.
        glu_clamp: the parameters of activation "clamped_swiglu"; see machmoe.functional.moe.
        exchange: how tokens travel. "all_gather" (default): every rank's tokens to every rank,
            the partial sums reduce-scattered back (machmoe.expert_exchange); no host
            synchronisation, CUDA-graph capturable. "all_to_all": a token only to the ranks holding one of its experts (fewer
            bytes when W is large), with one host synchronisation per forward for the row counts.
            "all_to_all_device": the same rows with their counts on the device, into receive
            buffers of ceil(capacity_factor · W · max_tokens) rows: no host synchronisation,
            CUDA-graph capturable; needs max_tokens, and on CUDA torch's symmetric memory and
            the compiled ops (machmoe.expert_device_exchange).
        max_tokens: the most tokens any rank of the group passes, the same on every rank; T
            above it is refused on the host, before any exchange. Given, neither exchange waits
            for the host: "all_gather" pads T up to it; "all_to_all" exchanges blocks of
            ceil(capacity_factor · max_tokens) rows per pair of ranks
            (machmoe.expert_capacity_exchange). None: "all_gather" finds the group's largest T
            with an all-reduce the host waits for; "all_to_all" sends exactly the rows needed,
            with one host synchronisation per forward for their counts.
        router_bias, routed_scaling_factor, n_group, topk_group: the router's options, as for
            machmoe.functional.moe (router_bias [E] is a replica, like router_weight).
        precision, fp8_cache: as for machmoe.functional.moe: "fp8" runs this rank's experts in
            FP8 on the gathered rows (exchange "all_gather" only; the transfers are then not
            overlapped with the experts' kernels), with the FP8 copies of this rank's weights
            in fp8_cache (None: machmoe.fp8_layer's process-wide cache).
        capacity_factor: in (0, 1] (default 1: no batch can overflow). "all_to_all" with
            max_tokens: rows per block over max_tokens; smaller sends fewer bytes.
            "all_to_all_device": the rows a rank receives over W·max_tokens; smaller holds less
            memory (the received rows and the experts' buffers), the bytes sent are the same.
            "all_gather": the (token, expert) pairs each rank's experts are sized for, over all
            W·rows·K gathered pairs (rows: max_tokens, or the group's largest T); smaller holds
            less memory (a balanced batch needs 1/W; the saved H shrinks with it). For both, a
            batch that needs more poisons the call's output with NaN on every rank, and
            check_capacity() raises (machmoe.exchange_overflow); on the CPU the call raises.
        token_rounding, tile_m, seed: "all_gather" only, routing "softmax_topk" only: round each
            expert's row count over the whole group's batch (the ranks' batches end to end) to a
            multiple of tile_m, as machmoe.functional.moe does for one batch
            (machmoe.expert_exchange.rounded_gathered_experts). The aux loss still counts this
            rank's top-K pairs, before rounding.
    """
    backend = parse_enum(Backend, backend, "backend")
    activation = parse_enum(ActivationType, activation, "activation")
    glu_clamp = resolve_glu_clamp(activation, glu_clamp)
    layout = parse_enum(GateUpLayout, layout, "layout")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert_parallel_moe needs torch.distributed initialised "
                           "(dist.init_process_group)")
    W = dist.get_world_size(group)
    # The layer's own checks (functional.moe), with this rank's E / W experts in w1, w2, b1, b2.
    T, d, E_local, n = functional._validate_experts(x, w1, w2, b1, b2, activation, None)
    router_weight = functional._float_tensor(router_weight, "router_weight", 2)
    E = router_weight.shape[0]
    functional._shape(router_weight, "router_weight", (E, d), "[E, d] with d = x.shape[1]")
    if E_local * W != E:
        raise ValueError(f"w1 must hold E / W experts: E = router_weight.shape[0] = {E} over W = {W} "
                         f"ranks needs w1.shape[0] = {E // W if E % W == 0 else 'E / W'} "
                         f"(E must be a multiple of W); got {E_local}")
    K, routing, rounding = functional._validate_routing(E, num_experts_per_tok, routing, renormalize,
                                                        selection_bias, token_rounding, tile_m, seed)
    options = functional._validate_router_options(E, K, routing, rounding, routed_scaling_factor,
                                                  n_group, topk_group)
    weights = {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2, "b1": b1, "b2": b2}
    if router_bias is not None:
        weights["router_bias"] = functional._float_tensor(router_bias, "router_bias", 1)
        functional._shape(router_bias, "router_bias", (E,), "[E]")
    functional._same_dtype(weights, "x")
    functional._same_device({**weights, "selection_bias": selection_bias}, "x")
    backend = functional.resolve_backend(backend, x, d, n)
    if backend == Backend.MACHMOE and x.dtype != torch.bfloat16:
        raise NotImplementedError(f"the machmoe backend takes bfloat16 x; got {x.dtype}")

    precision = parse_enum(Precision, precision, "precision")
    _check_exchange(exchange, max_tokens, capacity_factor, rounding, precision)
    fp8 = functional._fp8_setting(precision, fp8_cache, x, activation, layout, d, n)
    if max_tokens is not None:
        _check_max_tokens(T, max_tokens)
    if exchange == "all_gather":  # rows per rank of the exchange
        rows = max_tokens if max_tokens is not None else _largest_T(T, x.device, group)

    # 1. Route this rank's tokens: pairs (token, expert, score) [R = T·K] in (t, k) order.
    # (ep.* ranges name the phases in torch.profiler traces: bench.expert_parallel --profile.)
    phase = torch.profiler.record_function
    kernels = _on_kernels(x)
    with phase("ep.route"):
        logits, scores, experts, aux = _route(x, router_weight, K, routing, renormalize, selection_bias, kernels,
                                              router_bias, options)
    if max_tokens is None and exchange == "all_to_all":
        # 2-4. Exact rows after one host sync (machmoe.expert_all_to_all).
        return all_to_all_experts(x, logits, scores, experts, w1, w2, b1, b2, num_experts=E, group=group,
                                  kernels=kernels, activation=activation, layout=layout, backend=backend,
                                  glu_clamp=glu_clamp, aux=aux)
    if exchange == "all_to_all_device":  # exact rows, counts on the device
        out = device_all_to_all_experts(
            x, scores, experts, w1, w2, b1, b2, num_experts=E, group=group,
            group_name=_group_name(group), max_tokens=max_tokens, capacity_factor=capacity_factor,
            transports=_device_count_transports(x, W, group), activation=activation, layout=layout,
            backend=backend, glu_clamp=glu_clamp)
        return out, aux
    if exchange == "all_to_all":  # fixed blocks, no host synchronisation
        out = capacity_all_to_all_experts(
            x, scores, experts, w1, w2, b1, b2, num_experts=E, group=group,
            group_name=_group_name(group), capacity=capacity_rows(max_tokens, capacity_factor),
            activation=activation, layout=layout, backend=backend, glu_clamp=glu_clamp)
        return out, aux
    if rows == 0:  # no rank has a token
        return x * 0, aux
    with phase("ep.exchange_and_experts"):
        pad = rows - T  # rows of no token: every expert out of range, so nothing computed
        xs, ls, ss, es = x, logits, scores, experts
        if pad:
            xs = torch.cat([x, x.new_zeros(pad, d)])
            ls = torch.cat([logits, logits.new_full((pad, E), float("-inf"))])
            ss = torch.cat([scores, scores.new_zeros(pad, K)])
            es = torch.cat([experts, experts.new_full((pad, K), E)])
        common = dict(world=W, rank=dist.get_rank(group), group_name=_group_name(group),
                      num_experts=E, activation=activation, layout=layout, backend=backend,
                      glu_clamp=glu_clamp, fp8=fp8)
        if rounding == TokenRounding.NONE:
            out = gathered_experts(xs, ss, es, w1, w2, b1, b2, group=group,
                                   pair_capacity=pair_capacity(capacity_factor, W, rows, K), **common)
        else:
            out = rounded_gathered_experts(xs, ls, ss, es, w1, w2, b1, b2, mode=rounding,
                                           tile_m=tile_m, seed=seed, **common)
    return (out[:T] if pad else out), aux


class ExpertParallelMoE(nn.Module):
    """`MoE` with its experts sharded over the ranks of a process group (module docstring).

    Parameters: router.weight [E, hidden] and router.bias [E] with router_bias (replicas: the same
    on every rank); c_fc.weight [E/W, N1, hidden], c_fc.bias, c_proj.weight [E/W, hidden,
    intermediate], c_proj.bias: this rank's experts, rank q holding experts q·E/W ...; with
    sigmoid or sqrt_softplus routing a buffer selection_bias [E] (a replica).

    Initialisation draws the router from `seed` and global expert e from (seed, e), so every rank
    agrees on the router and the layer is the same function for any W. `from_moe` shards an
    existing `MoE` instead.

    Gradients after backward: an expert's is the sum over every rank's tokens (the exchange brings
    them home); the router's covers this rank's tokens only. `reduce_gradients()` makes both the
    gradient of the ranks' mean loss, as DistributedDataParallel would: under DDP, leave the expert
    parameters out of DDP and call it, or call it alone.

    Args: num_experts, num_experts_per_tok, hidden_size, intermediate_size,
    activation_function, add_bias, std, routing, renormalize, gate_up_layout, backend, glu_clamp,
    router_bias, routed_scaling_factor, n_group, topk_group and precision as for `MoE` (num_experts
    must be a multiple of the group's size W; precision "fp8" with exchange "all_gather"
    only, this rank's experts' FP8 copies kept in `fp8_cache`); and
        process_group: the group whose ranks share the experts (None: the default group).
        seed: the initialisation seed, an int >= 0 (default 0), the same on every rank.
        exchange, max_tokens, capacity_factor: as for `expert_parallel_moe`. Give max_tokens
            (the most tokens a rank passes in one call, the same on every rank) for a forward and
            backward without host synchronisation.
        token_rounding, tile_m: as for `MoE` (in training mode only), over the whole group's
            batch; exchange "all_gather" and routing "softmax_topk" only. Stochastic rounding
            draws its seed from torch's generator on every rank: seed them alike.
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
        backend: Union[Backend, str] = Backend.AUTO,
        process_group=None,
        seed: int = 0,
        glu_clamp: Optional[GluClamp] = None,
        exchange: str = "all_gather",
        max_tokens: Optional[int] = None,
        token_rounding: Union[TokenRounding, str] = TokenRounding.NONE,
        tile_m: int = 128,
        capacity_factor: float = 1.0,
        router_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        precision: Union[Precision, str] = Precision.BF16,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs torch.distributed initialised "
                               "(dist.init_process_group)")
        self.process_group = process_group
        W, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        for name, value in layer_settings(num_experts, num_experts_per_tok, hidden_size,
                                          intermediate_size, activation_function, add_bias, std,
                                          routing, renormalize, gate_up_layout).items():
            setattr(self, name, value)
        E = self.num_experts
        if E % W:
            raise ValueError(f"num_experts must be a multiple of the group's size {W}; got {E}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0; got {seed!r}")
        self.world_size, self.rank = W, rank
        self.token_rounding = parse_enum(TokenRounding, token_rounding, "token_rounding")
        self.precision = parse_enum(Precision, precision, "precision")
        _check_exchange(exchange, max_tokens, capacity_factor, self.token_rounding, self.precision)
        self.exchange, self.max_tokens, self.capacity_factor = exchange, max_tokens, capacity_factor
        self.tile_m = _positive_int(tile_m, "tile_m")
        if self.token_rounding != TokenRounding.NONE:
            if self.routing != RoutingMethod.SOFTMAX_TOPK:
                raise ValueError(f"token_rounding={self.token_rounding.value!r} needs "
                                 f"routing='softmax_topk'; got {self.routing.value!r}")
        self.backend = parse_enum(Backend, backend, "backend")
        self.glu_clamp = resolve_glu_clamp(self.activation_function, glu_clamp)

        E_local, d, n = E // W, hidden_size, intermediate_size
        n1 = 2 * n if is_glu(self.activation_function) else n
        options = functional._validate_router_options(E, self.num_experts_per_tok, self.routing,
                                                      self.token_rounding, routed_scaling_factor,
                                                      n_group, topk_group)
        self.routed_scaling_factor, self.n_group, self.topk_group = options
        self.router = nn.Linear(d, E, bias=router_bias)
        if router_bias:
            nn.init.zeros_(self.router.bias)
        self.c_fc = ExpertLinear(E_local, d, n1, add_bias, std)
        self.c_proj = ExpertLinear(E_local, n, d, add_bias, std)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)

            def draw(p: torch.Tensor) -> None:  # on the generator's CPU, whatever device p is on
                p.copy_(torch.empty(p.shape, device="meta" if p.is_meta else "cpu").normal_(0.0, std, generator=gen))

            draw(self.router.weight)
            for i in range(E_local):
                # Global expert e's own stream: the same weights whatever W is.
                gen.manual_seed(torch_backend.splitmix64(seed * 2**32 + rank * E_local + i) % 2**63)
                draw(self.c_fc.weight[i])
                draw(self.c_proj.weight[i])
        if is_gate_routing(self.routing):  # sigmoid, sqrt_softplus: as MoE
            self.register_buffer("selection_bias", torch.zeros(E))
        else:
            self.selection_bias = None
        self.fp8_cache = None  # this rank's experts' FP8 copies (precision "fp8"), remade when they change
        if self.precision == Precision.FP8:
            from . import fp8_layer

            fp8_layer.check_module(self)
            self.fp8_cache = fp8_layer.new_cache()

    @classmethod
    def from_moe(cls, moe: MoE, process_group=None, **exchange) -> "ExpertParallelMoE":
        """This rank's shard of `moe` (same dtype and device, token rounding included, over the
        group's whole batch). `exchange`: exchange, max_tokens, capacity_factor."""
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a machmoe.MoE; got {type(moe).__name__}")
        if moe.num_shared_experts > 0:
            raise ValueError("ExpertParallelMoE does not offer shared experts; this MoE has "
                             f"{moe.num_shared_experts}, so its shard would compute another layer "
                             "(run them beside it: machmoe.shared_experts)")
        # Built on the meta device, then given uninitialised storage where moe lives: every value
        # is copied from moe below, so drawing the constructor's initialisation (on the CPU, one
        # expert at a time: minutes for DeepSeek-V3's 11 GiB per rank) would be wasted.
        with torch.device("meta"):
            layer = cls(moe.num_experts, moe.num_experts_per_tok, moe.hidden_size,
                        moe.intermediate_size, moe.activation_function, moe.c_fc.bias is not None,
                        moe.c_fc.std, routing=moe.routing, renormalize=moe.renormalize,
                        gate_up_layout=moe.gate_up_layout, backend=moe.backend,
                        process_group=process_group, glu_clamp=moe.glu_clamp,
                        token_rounding=moe.token_rounding, tile_m=moe.tile_m,
                        router_bias=moe.router.bias is not None,
                        routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group,
                        topk_group=moe.topk_group, precision=moe.precision, **exchange)
        layer = layer.to_empty(device=moe.router.weight.device).to(dtype=moe.router.weight.dtype)
        part = slice(layer.rank * (moe.num_experts // layer.world_size),
                     (layer.rank + 1) * (moe.num_experts // layer.world_size))
        with torch.no_grad():
            layer.router.weight.copy_(moe.router.weight)
            if moe.router.bias is not None:
                layer.router.bias.copy_(moe.router.bias)
            for mine, full in ((layer.c_fc, moe.c_fc), (layer.c_proj, moe.c_proj)):
                mine.weight.copy_(full.weight[part])
                if full.bias is not None:
                    mine.bias.copy_(full.bias[part])
            if moe.selection_bias is not None:
                layer.selection_bias.copy_(moe.selection_bias)
        return layer

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [..., hidden] (this rank's tokens) -> (output [..., hidden], aux [])."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor; "
                            f"got {type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must have shape [..., hidden_size] with hidden_size "
                             f"= {self.hidden_size}; got {list(hidden_states.shape)}")
        rounding, seed = rounding_for_call(self.token_rounding, self.training)
        # (no reshape of a 2-D input: each view is an autograd node the host pays for)
        x = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, self.hidden_size)
        out, aux = expert_parallel_moe(
            x, self.router.weight, self.c_fc.weight, self.c_proj.weight,
            num_experts_per_tok=self.num_experts_per_tok, b1=self.c_fc.bias, b2=self.c_proj.bias,
            activation=self.activation_function, layout=self.gate_up_layout,
            routing=self.routing, renormalize=self.renormalize,
            selection_bias=self.selection_bias, group=self.process_group, backend=self.backend,
            glu_clamp=self.glu_clamp, exchange=self.exchange, max_tokens=self.max_tokens,
            token_rounding=rounding, tile_m=self.tile_m, seed=seed,
            capacity_factor=self.capacity_factor, router_bias=self.router.bias,
            routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
            topk_group=self.topk_group, precision=self.precision, fp8_cache=self.fp8_cache)
        return (out if hidden_states.dim() == 2 else out.reshape(hidden_states.shape)), aux

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's own (sharded) parameters."""
        return [p for m in (self.c_fc, self.c_proj) for p in (m.weight, m.bias) if p is not None]

    @torch.no_grad()
    def reduce_gradients(self, average: bool = True) -> None:
        """Turn the local gradients into those of the ranks' mean loss (average=True, as DDP) or
        of their sum: all-reduce the router's, and scale the experts' by 1/W for the mean. A
        collective: every rank calls it after its backward.

        Under FSDP2 (the whole layer sharded over a data-parallel mesh dimension, see
        docs/EXPERT_PARALLEL.md) the gradients are DTensors: the router's local shard is
        all-reduced, which is right because every rank of this layer's group holds the same
        shard of it."""
        from torch.distributed.tensor import DTensor

        router = [p for p in (self.router.weight, self.router.bias) if p is not None]
        for p in router:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad,
                            group=self.process_group)
        if average:
            for p in router + self.expert_parameters():
                if p.grad is not None:
                    p.grad.div_(self.world_size)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts} ({self.num_experts // self.world_size} on rank "
                f"{self.rank} of {self.world_size}), num_experts_per_tok={self.num_experts_per_tok}, "
                f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation_function={self.activation_function.value}, "
                f"routing={self.routing.value}, gate_up_layout={self.gate_up_layout.value}, "
                f"backend={self.backend.value}, precision={self.precision.value}")
