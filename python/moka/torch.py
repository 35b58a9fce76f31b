"""moka for PyTorch: the MoE layer as an ``nn.Module`` and the experts as a functional op.

Layouts (row-major, contiguous), E experts over W expert-parallel ranks, E_local = E / W:
  w_router [E, H]; w_gate, w_up [E_local, I, H]; w_down [E_local, H, I];
  shared expert (optional): ws_gate, ws_up [Is, H]; ws_down [H, Is].
  expert_e(v) = w_down[e] @ act(w_gate[e] @ v, w_up[e] @ v), act = SwiGLU: silu(g) * u.
  out[t] = shared(x[t]) + sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).
Rank r holds experts [r * E_local, (r + 1) * E_local). Tokens stay on their rank; moka moves rows to
the experts' ranks and back. The router and the shared expert are replicated: their gradients are
this rank's share, to be all-reduced like any data-parallel parameter (DDP/FSDP do that).

Dtypes: the CPU backend computes in float32 or float64, the CUDA backend in bfloat16; router
weights (topk_weights) are float32, or float64 with float64 activations. Calls run on
``torch.cuda.current_stream()``; outputs and gradients are allocated by torch's caching allocator,
and so, by default (``allocator="torch"``), are each call's scratch and what a forward saves for its
backward: moka's memory is shared with the rest of the model and counts in
``torch.cuda.memory_allocated()``, ``max_memory_allocated()`` and torch's memory snapshots.
``allocator="moka"`` takes those from moka's own stream-ordered pool instead, which torch does not
see. A backward captured in a CUDA graph frees its forward's saved state inside the graph, so a
forward and backward captured together replay; a first, uncaptured call with the same token count
builds the GEMMs, which capture cannot.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _moka
from ._allocator import ALLOCATORS
from ._autograd import _Experts, _MoE, _moe_forward, _MoEWithAux, _Route, router_aux_outputs, router_weight_dtype
from ._distributed import moka_group
from ._op import (_backend, _int32_ids, _make_engines, _moe_experts_op, _moe_op, _moe_with_aux_op, _op_layer,
                  _plain_eager_call, _untraced_call, new_engine_id, op_layers_of)

# Reached through moka.torch by bench/python_overhead.py, which times moka's calls one by one and
# swaps the op's layers.
from ._autograd import (_dl, _empty_like, _experts_backward, _experts_forward, _route_forward,  # noqa: F401
                        _routes, _stream, _weights)
from ._op import _op_layers  # noqa: F401

__all__ = ["MoE", "MoEAux", "moe_experts", "moka_group", "router_weight_dtype"]


# --- the functional op, for models that route themselves (traceable by torch.compile; moka._op
# registers it with torch.library) ---

def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None, ws_down: Optional[Tensor] = None,
                *, activation: str = "swiglu", clamp_limit: float = 7.0,
                group: Optional[dist.ProcessGroup] = None, allocator: str = "torch") -> Tensor:
    """The routed experts (and shared expert) of an MoE layer for tokens routed by the caller.

    Args:
        x (Tensor): [T, H], contiguous; float32/float64 on the CPU, bfloat16 on CUDA.
        topk_ids (Tensor): [T, k] int32 or int64 global expert ids, distinct within a token.
        topk_weights (Tensor): [T, k] float32 (float64 for float64 x).
        w_gate, w_up (Tensor): [E_local, I, H], x's dtype (this rank's experts with a ``group``).
        w_down (Tensor): [E_local, H, I].
        ws_gate, ws_up (Tensor | None): the shared expert's [Is, H], or None (no shared expert).
        ws_down (Tensor | None): the shared expert's [H, Is], or None.
        activation (str, keyword-only): "swiglu" or "swiglu_clamped".
        clamp_limit (float, keyword-only): the clamp of "swiglu_clamped" (> 0).
        group (torch.distributed.ProcessGroup | None, keyword-only): the expert-parallel group.
        allocator (str, keyword-only): where moka's device memory (each call's scratch, what the
            forward saves for the backward) comes from on CUDA: "torch" (the default; torch's
            caching allocator) or "moka" (moka's own pool, which torch's statistics do not see).

    Returns:
        Tensor: out [T, H], differentiable in x, topk_weights and every weight.

    Raises:
        TypeError, ValueError: inputs of a dtype, device or shape moka does not take.
        moka.Error: what moka finds in the inputs (an expert id out of range, mismatched shapes).

    A ``torch.library`` op (``torch.ops.moka.moe_experts``, which returns out and moka's saved
    state for ``torch.ops.moka.moe_experts_backward``): ``torch.compile(fullgraph=True)`` and
    ``torch.export`` trace it as one node each way, modes and transforms see it; a plain eager call
    runs the same moka calls without the dispatcher. The backward reuses the forward's state.
    """
    _choice_arg("allocator", allocator, ALLOCATORS)
    group_name = ""
    if moka_group(group) is not None:
        group_name = group.group_name
    inputs = (x, _int32_ids(topk_ids), topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, activation,
              clamp_limit, group_name, allocator)
    if _plain_eager_call(inputs[:9]):
        layer = _op_layer(x, topk_ids, w_gate, ws_gate, activation, clamp_limit, group_name, allocator)
        return _Experts.apply(*inputs[:9], layer)
    try:
        return _moe_experts_op(*inputs)[0]
    except RuntimeError as e:  # vmap runs (one call per row); grad, jvp, jacrev do not
        if "functorch transforms" in str(e):
            raise RuntimeError(_FUNC_TRANSFORMS) from e
        raise


# --- the layer ---

_FUNC_TRANSFORMS = ("moka: torch.func's differentiating transforms (grad, jvp, jacrev, ...) do not run through moka's "
                    "MoE layer: use torch.autograd (loss.backward(), torch.autograd.grad); moe_experts runs under vmap")


class MoEAux(NamedTuple):
    """What ``MoE.forward(x, return_aux=True)`` returns beside the output, for trainers that balance
    the load with an auxiliary loss (Switch Transformer, GShard, Mixtral) instead of, or besides,
    ``selection_bias``. moka's router call computes them all (its kernels write them, no torch op
    runs) and its backward takes their gradients: every one but tokens_per_expert is
    differentiable in x and the router weight. Add the losses to the training loss with a
    coefficient of your choice (Switch: 1e-2 for the load-balancing loss, ST-MoE: 1e-3 for the
    z-loss).

    Attributes:
        router_logits (Tensor): [T, E] x @ w_router^T, float32 for bfloat16 x (else x's dtype).
        router_probs (Tensor): [T, E] the scores the load-balancing loss uses: softmax of the logits
            (``score="softmax"``), or the sigmoid scores normalized to sum to 1 over the experts
            (``score="sigmoid"``, as DeepSeek-V3's sequence-wise auxiliary loss does).
        tokens_per_expert (Tensor): [E] int64, the routes moka's router gave each expert in this
            call (this rank's tokens).
        load_balancing_loss (Tensor): E * sum_e f_e * P_e, with f_e = tokens_per_expert / (T * k)
            (not differentiable) and P_e the mean of router_probs over the tokens: 1 when the
            load is uniform.
        z_loss (Tensor): the mean over tokens of logsumexp(router_logits)^2 (ST-MoE).
    """

    router_logits: Tensor
    router_probs: Tensor
    tokens_per_expert: Tensor
    load_balancing_loss: Tensor
    z_loss: Tensor


def _int_arg(name: str, value, least: int) -> int:
    """value as an int >= least: TypeError for a non-integer (bool included), ValueError below."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"moka: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value.__index__())
    if value < least:
        raise ValueError(f"moka: {name} must be >= {least}, got {value}")
    return value


def _choice_arg(name: str, value, choices) -> None:
    if not isinstance(value, str):
        raise TypeError(f"moka: {name} must be a str, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"moka: {name} '{value}' is not one of {', '.join(choices)}")


def _float_arg(name: str, value, positive: bool) -> float:
    """value as a finite float (> 0 if positive): TypeError for a non-number, ValueError else."""
    if isinstance(value, (bool, str)) or not hasattr(value, "__float__"):
        raise TypeError(f"moka: {name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"moka: {name} must be a {'positive ' if positive else ''}finite number, got {value}")
    return value


def _selection_bias(bias: Optional[Tensor], x: Tensor) -> Optional[Tensor]:
    """The bias in the dtype moka reads for x (the module keeps it so: a copy only if changed)."""
    return None if bias is None else bias.to(torch.float32 if x.is_cuda else x.dtype)


class MoE(nn.Module):
    """A Mixture-of-Experts layer: router, routed SwiGLU experts, optional shared expert.

    ``forward(x)`` takes x [..., H] and returns the layer's output of the same shape; backward gives
    the gradients of x, the router and every expert.
    Routing: ``score`` "softmax" or "sigmoid" over the router logits, top-k (by score plus
    ``selection_bias`` when it is on), weights optionally renormalized over the k and scaled by
    ``route_scale``. On the GPU, errors the kernels find (a bad expert id) surface at the
    next call or at ``check_errors()`` after synchronizing.
    Any number of forwards may be in flight, their backwards in any order (pipeline schedules,
    gradient accumulation), except on the CUDA backend's "all_to_all" path, which keeps the
    exchange plan of its latest forward only: there run a forward's backward before the layer's
    next forward (activation checkpointing fits; a backward of an older forward raises
    moka.Error). Load balancing: ``selection_bias`` (DeepSeek-V3's auxiliary-loss-free bias), or
    the auxiliary losses of ``forward(x, return_aux=True)`` (``MoEAux``), or both.

    Args:
        hidden (int): H, the width of x and of the output (> 0).
        intermediate (int): I, each routed expert's intermediate width (> 0).
        experts (int): E, the number of routed experts over all ranks (> 0, a multiple of the
            group's size).
        top_k (int): k, the experts each token is routed to (1 <= k <= E).
        shared_intermediate (int): Is, the shared expert's intermediate width; 0 (the default):
            no shared expert.
        group (torch.distributed.ProcessGroup | None, keyword-only): the ranks over which the
            experts are split (expert parallelism; each rank passes its own tokens, the same number
            on every rank, and holds E / world experts), or None (the default): all experts here.
        path (str, keyword-only): the CUDA backend's path: "automatic" (the default; moka picks),
            "single_gpu", "all_to_all" or "megakernel" (which holds ``max_tokens`` tokens per rank;
            automatic uses it only over several ranks and when ``max_tokens`` is set).
        score (str): "softmax" (the default) or "sigmoid".
        renormalize (bool): renormalize the k weights of a token to sum to 1 (default False).
        route_scale (float): a factor on the routing weights (default 1.0).
        selection_bias (bool): keep a bias [E] added to the scores for the top-k selection only,
            updated by ``update_selection_bias`` (default False).
        activation (str): "swiglu" (the default; silu(g) * u) or "swiglu_clamped" (g and u
            clamped to ``clamp_limit`` first).
        clamp_limit (float): the clamp of "swiglu_clamped" (> 0; default 7.0).
        init_std (float): the standard deviation of the initial normal weights (default 0.02).
        tile_rows (int | None): the CUDA GEMMs' row tile (None: moka's default).
        max_tokens (int): tokens per rank the megakernel's buffers hold (0, the default: none).
        allocator (str, keyword-only): where moka's device memory (each call's scratch, what a
            forward saves for its backward) comes from on CUDA: "torch" (the default; torch's
            caching allocator, so that it counts in ``torch.cuda.memory_allocated()``) or "moka"
            (moka's own stream-ordered pool). The CPU backend takes no device memory.
        device (torch.device | str | None): where the weights are made.
        dtype (torch.dtype | None): the weights' dtype: float32 or float64 for the CPU backend,
            bfloat16 for the CUDA backend.

    Raises:
        TypeError: an argument of the wrong type (a float for ``experts``, a number for
            ``score``), here; at a call, a tensor of a dtype the backend does not compute in.
        ValueError: an argument out of range or unknown (``top_k`` > ``experts``, ``top_k`` = 0,
            an unknown ``score``, ``activation`` or ``path``, ``experts`` not divisible by the
            group's size), here; at a call, an input of the wrong width or on the wrong device.
        moka.Error: what moka's kernels find in the inputs (an expert id out of range, a
            duplicate expert, non-finite logits, mismatched shapes), with a ``code`` and the rank.
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, shared_intermediate: int = 0,
                 *, group: Optional[dist.ProcessGroup] = None, path: str = "automatic", score: str = "softmax",
                 renormalize: bool = False, route_scale: float = 1.0, selection_bias: bool = False,
                 activation: str = "swiglu", clamp_limit: float = 7.0, init_std: float = 0.02,
                 tile_rows: Optional[int] = None, max_tokens: int = 0, allocator: str = "torch", device=None,
                 dtype=None):
        super().__init__()
        hidden, intermediate, experts, top_k = (_int_arg(name, value, 1) for name, value in (
            ("hidden", hidden), ("intermediate", intermediate), ("experts", experts), ("top_k", top_k)))
        shared_intermediate = _int_arg("shared_intermediate", shared_intermediate, 0)
        max_tokens = _int_arg("max_tokens", max_tokens, 0)
        if tile_rows is not None:
            tile_rows = _int_arg("tile_rows", tile_rows, 1)
        if top_k > experts:
            raise ValueError(f"moka: top_k = {top_k} exceeds experts = {experts}")
        # The names of the extension's enums (moka._moka.LayerPath, ...), which the engines are built with.
        _choice_arg("path", path, _moka.LayerPath.__members__)
        _choice_arg("score", score, _moka.ScoreFunction.__members__)
        _choice_arg("activation", activation, _moka.Activation.__members__)
        _choice_arg("allocator", allocator, ALLOCATORS)
        clamp_limit = _float_arg("clamp_limit", clamp_limit, positive=True)
        route_scale = _float_arg("route_scale", route_scale, positive=False)
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if experts % world:
            raise ValueError(f"moka: {experts} experts cannot be split evenly over {world} ranks")
        self.hidden, self.intermediate, self.experts, self.top_k = hidden, intermediate, experts, top_k
        self.shared_intermediate = shared_intermediate
        self.group, self.path = group, path
        self._group_name = group.group_name if world > 1 else ""  # what moka's op takes for the group
        self.score, self.renormalize, self.route_scale = score, renormalize, route_scale
        self.activation, self.clamp_limit, self.tile_rows = activation, clamp_limit, tile_rows
        self.max_tokens, self.allocator = max_tokens, allocator
        self.local_experts = experts // world
        self.first_local_expert = rank * self.local_experts
        factory = {"device": device, "dtype": dtype}
        self.w_router = nn.Parameter(torch.empty(experts, hidden, **factory))
        self.w_gate = nn.Parameter(torch.empty(self.local_experts, intermediate, hidden, **factory))
        self.w_up = nn.Parameter(torch.empty(self.local_experts, intermediate, hidden, **factory))
        self.w_down = nn.Parameter(torch.empty(self.local_experts, hidden, intermediate, **factory))
        for name, shape in (("ws_gate", (shared_intermediate, hidden)), ("ws_up", (shared_intermediate, hidden)),
                            ("ws_down", (hidden, shared_intermediate))):
            self.register_parameter(name, nn.Parameter(torch.empty(shape, **factory)) if shared_intermediate else None)
        # In the dtype of the router weights (what moka reads), so that no call converts it.
        bias_dtype = router_weight_dtype(dtype or torch.get_default_dtype())
        self.register_buffer("selection_bias", torch.zeros(experts, device=device, dtype=bias_dtype) if selection_bias
                             else None)
        # Routes per expert since the last update_selection_bias (this rank's tokens).
        self.register_buffer("expert_load", torch.zeros(experts, dtype=torch.int64, device=device), persistent=False)
        self.reset_parameters(init_std)
        self._engines: dict[tuple, tuple[_moka.Router, _moka.Layer, _moka.Moe]] = {}
        self._engine_id = new_engine_id(self)  # names the engines of its calls through moka's op

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        """Normal(0, std) weights, drawn on the weights' device (meta tensors stay as they are).
        Expert e's weights depend on the seed, e and the device type only, not on how the experts
        are split over ranks, so an expert-parallel layer equals a one-rank layer."""
        seed = int(torch.randint(0, 2**62, (1,)).item())
        device = self.w_router.device
        if device.type == "meta":
            return
        generator = torch.Generator(device=device)

        def normal(shape):
            return torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std

        generator.manual_seed(seed)
        self.w_router.copy_(normal(self.w_router.shape))
        for name in ("ws_gate", "ws_up", "ws_down"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(normal(getattr(self, name).shape))
        for local in range(self.local_experts):
            generator.manual_seed(seed + 1 + self.first_local_expert + local)
            for w in (self.w_gate, self.w_up, self.w_down):
                w[local].copy_(normal(w.shape[1:]))

    def __getstate__(self):
        # moka's engines hold device state and are no Python objects: a copy (copy.deepcopy,
        # pickle, torch.save of the module) builds its own at its first call.
        state = self.__dict__.copy()
        state["_engines"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._engine_id = new_engine_id(self)  # not the original's: engines are not shared

    def _engine(self, x: Tensor) -> tuple[_moka.Router, _moka.Layer, _moka.Moe]:
        """moka's router, layer, and the two as one call each way, for x's device."""
        backend = _backend(x)
        key = (backend, x.device.index)
        engines = self._engines.get(key)
        if engines is None:
            engines = self._engines[key] = _make_engines(
                backend, x.device.index, moka_group(self.group), hidden=self.hidden, intermediate=self.intermediate,
                experts=self.experts, top_k=self.top_k, shared_intermediate=self.shared_intermediate,
                score=self.score, selection_bias=self.selection_bias is not None, renormalize=self.renormalize,
                route_scale=self.route_scale, activation=self.activation, clamp_limit=self.clamp_limit,
                path=self.path, tile_rows=self.tile_rows, max_tokens=self.max_tokens, allocator=self.allocator)
        return engines

    def _tensors(self) -> tuple:
        """(w_router, selection_bias, expert_load), (w_gate, w_up, w_down, ws_gate, ws_up, ws_down),
        from the module's dicts: nn.Module's attribute lookup costs about 1 us a name, every call.
        Through the attributes where something moved a tensor out of them (nn.utils.parametrize)."""
        try:
            p, b = self._parameters, self._buffers
            routing = (p["w_router"], b["selection_bias"], b["expert_load"])
            experts = (p["w_gate"], p["w_up"], p["w_down"], p["ws_gate"], p["ws_up"], p["ws_down"])
        except KeyError:
            routing = (self.w_router, self.selection_bias, self.expert_load)
            experts = (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down)
        return routing, experts

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's routing alone.

        Args:
            x (Tensor): [T, H], contiguous, in the weights' dtype, on the CPU or the current CUDA
                device.

        Returns:
            tuple[Tensor, Tensor]: topk_ids [T, k] int32 (global expert ids) and topk_weights
            [T, k] (float32; float64 for float64 x), differentiable in x and the router weight
            through topk_weights. The routes are counted in ``expert_load``.
        """
        router, _, _ = self._engine(x)
        (w_router, bias, load), _ = self._tensors()
        return _Route.apply(x, w_router, _selection_bias(bias, x), router, self.top_k, load)

    def apply_experts(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The routed experts and the shared expert for tokens routed by the caller (``route`` or
        your own router), on this layer's engines (``moe_experts`` shares one per shape).

        Args:
            x (Tensor): [T, H], contiguous, in the weights' dtype.
            topk_ids (Tensor): [T, k] int32 or int64 global expert ids, distinct within a token.
            topk_weights (Tensor): [T, k] float32 (float64 for float64 x).

        Returns:
            Tensor: out [T, H], differentiable in x, topk_weights and every expert weight.
        """
        _, layer, _ = self._engine(x)
        _, experts = self._tensors()
        return _Experts.apply(x, _int32_ids(topk_ids), topk_weights, *experts, layer)

    def forward(self, x: Tensor, return_aux: bool = False):
        """Routing, experts and combine.

        Args:
            x (Tensor): [..., H] in the weights' dtype (float32/float64 on the CPU, bfloat16 on the
                current CUDA device); with a ``group``, every rank passes the same number of tokens.
            return_aux (bool): also return the routing's auxiliary outputs and losses (``MoEAux``),
                written by moka's router call itself and differentiated by its backward (no torch op
                runs for them); off (the default), the router computes none of them.

        Returns:
            Tensor: the layer's output, x's shape and dtype, differentiable in x, the router and
            every expert weight; with ``return_aux``, the tuple (output, ``MoEAux``).
        """
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError("moka: MoE does not run under torch.func transforms (grad, vmap, jvp, ...): use "
                               "torch.autograd for its gradients (moka.torch.moe_experts runs under vmap)")
        if x.dim() == 0 or x.shape[-1] != self.hidden:
            raise ValueError(f"moka: MoE(hidden={self.hidden}) takes x [..., {self.hidden}], got {list(x.shape)}")
        # [T, H] input goes in as it is: a reshape would add a view and its autograd node each way.
        tokens = (x if x.dim() == 2 else x.reshape(-1, self.hidden)).contiguous()
        (w_router, bias, load), experts = self._tensors()
        inputs = (tokens, w_router, *experts, _selection_bias(bias, tokens), load)
        if _untraced_call(inputs):  # moka's call directly (a mode sees its allocations, as in any eager call)
            inputs += (self._engine(tokens)[2], self.top_k)
            if return_aux:
                out, *aux = self._forward_with_aux(inputs)
            else:  # with autograd off (evaluation, inference mode) the call skips Function.apply
                out = _MoE.apply(*inputs) if torch.is_grad_enabled() else _moe_forward(*inputs)[1]
        elif return_aux:  # a compiler or an exporter traces moka's op, which returns the routes
            out, routes, logits, probs, losses, _ = _moe_with_aux_op(*inputs[:-1], *self._op_options())
            load.add_(routes)
            aux = (logits, probs, losses, routes)
        else:
            out, routes, _ = _moe_op(*inputs[:-1], *self._op_options())
            load.add_(routes)
        out = out if x.dim() == 2 else out.reshape(x.shape)
        if not return_aux:
            return out
        logits, probs, losses, routes = aux
        return out, MoEAux(logits, probs, routes, losses[0], losses[1])

    def _forward_with_aux(self, inputs) -> tuple:
        """(out, router_logits, router_probs, losses, tokens_per_expert), all written by moka's call."""
        if torch.is_grad_enabled():
            return _MoEWithAux.apply(*inputs)
        aux = router_aux_outputs(inputs[0], self.experts)
        return (_moe_forward(*inputs, aux=aux)[1], *aux)

    def _op_options(self) -> tuple:
        """moka::moe's arguments after the tensors: what its engines are built from, and their id."""
        return (self.top_k, self.score, self.renormalize, self.route_scale, self.activation, self.clamp_limit,
                self.path, self.tile_rows, self.max_tokens, self._group_name, self._engine_id, self.allocator)

    def check_errors(self):
        """Raises (as moka.Error) what the GPU kernels of finished calls found; synchronize first."""
        for layer in [layer for _, layer, _ in self._engines.values()] + op_layers_of(self._engine_id):
            layer.check_errors()

    @torch.no_grad()
    def update_selection_bias(self, rate: float = 1e-3) -> Tensor:
        """Auxiliary-loss-free load balancing (DeepSeek-V3): bias_e += rate * sign(mean - load_e),
        the load summed over the group's ranks since the last update. Returns that load."""
        if self.selection_bias is None:
            raise ValueError("moka: this MoE was built without selection_bias=True")
        load = self.expert_load.clone()
        if self.group is not None:
            dist.all_reduce(load, group=self.group)
        load = load.to(torch.float64)
        self.selection_bias += (rate * torch.sign(load.mean() - load)).to(self.selection_bias.dtype)
        self.expert_load.zero_()
        return load

    @classmethod
    def from_hf(cls, state_dict: dict, style: str, layer: int, top_k: int, **kwargs) -> "MoE":
        """An MoE holding layer ``layer``'s router and experts from a Hugging Face state dict.

        Args:
            state_dict (dict[str, Tensor]): the checkpoint's tensors, in the names of transformers
                4.x (one tensor per expert, ``experts.<e>.gate_proj.weight``, ...) or of
                transformers 5 (``experts.gate_up_proj`` [E, 2I, H], gate rows first, and
                ``experts.down_proj`` [E, H, I]); see moka.hf.
            style (str): "qwen3_moe", "mixtral" or "deepseek_v3".
            layer (int): the decoder layer's index.
            top_k (int): the model's num_experts_per_tok.
            prefix (str, keyword-only): what comes before the layer index in the names (default
                "model.layers."; e.g. "model.language_model.layers." or "layers.").
            **kwargs: the constructor's keyword arguments (group, device, dtype, ...), which
                override the style's routing defaults.
        """
        from .hf import load_moe
        return load_moe(cls, state_dict, style, layer, top_k, **kwargs)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, experts={self.experts}, "
                f"top_k={self.top_k}, shared_intermediate={self.shared_intermediate}, "
                f"local_experts={self.local_experts}, score={self.score}")
