"""moka's ``torch.library`` ops, what torch.compile, torch.export, modes and transforms see:
``moka::moe_experts`` (``moka.torch.moe_experts``, for models that route themselves) and
``moka::moe`` (``moka.torch.MoE``'s routing through combine), each with a backward op, fake and
autograd registrations; moka's engines per op arguments; and the test for a plain eager call,
which skips the dispatcher. Layouts and dtypes: see ``moka.torch``.

A forward op returns moka's saved state for its backward op as a tensor (an op passes tensors
only): a one-byte CPU tensor whose storage owns moka's context. Autograd keeps it like any saved
tensor and frees it after the backward, or at once where none will come, and the context goes
with it: nothing runs the forward again, and tracing with FakeTensors needs no moka call."""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor, nn

from . import _moka
from ._allocator import torch_allocator
from ._autograd import (_empty_like, _experts_backward, _experts_forward, _first_order_only, _moe_backward,
                        _moe_forward, _take_state, router_aux_outputs, router_weight_dtype)
from ._distributed import group_named


def _backend(t: Tensor) -> str:
    if t.is_cuda:
        if t.device.index != torch.cuda.current_device():
            raise ValueError(f"moka: x is on {t.device} but the current CUDA device is "
                             f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device first")
        return "cuda"
    if t.device.type != "cpu":
        raise ValueError(f"moka: x is on {t.device}; moka runs on CPU and CUDA tensors")
    if t.dtype not in _CPU_DTYPES:
        raise TypeError(f"moka: x has dtype {str(t.dtype).replace('torch.', '')}; the CPU backend computes in "
                        f"float32 or float64 (bfloat16 is the CUDA backend's)")
    return "cpu"


_CPU_DTYPES = (torch.float32, torch.float64)


# --- moka's saved state as a tensor ---

class _SavedState(bytearray):
    """The buffer of a saved-state tensor (torch.frombuffer keeps it alive with the storage),
    holding the engine of a forward call and the context it saved."""

    __slots__ = ("engine", "context", "__weakref__")


# The live saved states by their buffer's address: the backward op's way from tensor to context.
_saved_states: weakref.WeakValueDictionary[int, _SavedState] = weakref.WeakValueDictionary()


def _saved_tensor(engine, context) -> Tensor:
    state = _SavedState(1)
    state.engine, state.context = engine, context
    tensor = torch.frombuffer(state, dtype=torch.uint8)
    _saved_states[tensor.data_ptr()] = state
    return tensor


def _fake_saved_tensor() -> Tensor:
    return torch.empty(1, dtype=torch.uint8, device="cpu")


def _saved_state(tensor: Tensor) -> _SavedState:
    state = _saved_states.get(tensor.data_ptr())
    if state is None:
        raise RuntimeError("moka: a backward op was given a tensor that is not the saved state a moka forward op "
                           "returned (or a copy of one)")
    return state


def _as_tensors(gradients) -> list[Tensor]:
    """A backward op's gradients: an empty tensor for an absent (None) shared-expert weight's, as an
    op returns tensors only."""
    return [g if g is not None else gradients[0].new_empty(0) for g in gradients]


def _present(gradients, tensors) -> list[Optional[Tensor]]:
    """A backward op's gradients as autograd takes them: None for absent tensors."""
    return [g if t is not None else None for g, t in zip(gradients, tensors)]


# --- moka's engines for the ops: layers (moe_experts) and routers with layers (moe) ---

def _named(enum, kind: str, name: str):
    """The member of one of the extension's enums named ``name``: ValueError naming the choices else."""
    try:
        return enum[name]
    except KeyError:
        raise ValueError(f"moka: unknown {kind} '{name}' ({', '.join(enum.__members__)})") from None


def _layer_options(backend: str, device: Optional[int], allocator: str, path: str = "automatic",
                   tile_rows: Optional[int] = None, max_tokens: int = 0) -> _moka.LayerOptions:
    """The options of a layer and its router on ``device``: torch's CPU threads, the row tile of
    the CUDA GEMMs unless given (the CPU backend needs no padding), and on CUDA the device memory
    of ``allocator`` ("torch": torch's caching allocator, "moka": moka's pool)."""
    if tile_rows is None:
        tile_rows = _moka.LayerOptions().tile_rows if backend == "cuda" else 1
    options = _moka.LayerOptions(num_threads=torch.get_num_threads(), tile_rows=tile_rows,
                                 path=_named(_moka.LayerPath, "path", path), max_tokens=max_tokens)
    if backend == "cuda" and allocator == "torch":
        options.allocator = torch_allocator(device)
    return options


def _make_layer(backend: str, group: Optional[_moka.Group], *, hidden: int, intermediate: int, experts: int,
                top_k: int, shared_intermediate: int, activation: str, clamp_limit: float,
                options: _moka.LayerOptions) -> _moka.Layer:
    shape = _moka.MoeShape(hidden=hidden, intermediate=intermediate, num_experts=experts, top_k=top_k,
                           shared_intermediate=shared_intermediate,
                           activation=_named(_moka.Activation, "activation", activation), clamp_limit=clamp_limit)
    return _moka.Layer(shape, backend, group, options)


def _make_engines(backend: str, device: Optional[int], group: Optional[_moka.Group], *, hidden: int,
                  intermediate: int, experts: int, top_k: int, shared_intermediate: int, score: str,
                  selection_bias: bool, renormalize: bool, route_scale: float, activation: str, clamp_limit: float,
                  path: str, tile_rows: Optional[int], max_tokens: int,
                  allocator: str) -> tuple[_moka.Router, _moka.Layer, _moka.Moe]:
    """moka's router, layer, and the two as one call each way (MoE's engines) on ``device``."""
    options = _layer_options(backend, device, allocator, path, tile_rows, max_tokens)
    config = _moka.RouterConfig(hidden=hidden, num_experts=experts, top_k=top_k,
                                score=_named(_moka.ScoreFunction, "score function", score),
                                use_selection_bias=selection_bias, renormalize=renormalize, route_scale=route_scale)
    router = _moka.Router(config, backend, group, options)
    layer = _make_layer(backend, group, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                        shared_intermediate=shared_intermediate, activation=activation, clamp_limit=clamp_limit,
                        options=options)
    return router, layer, _moka.Moe(router, layer)


_op_layers: dict[tuple, _moka.Layer] = {}


def _op_layer(x, topk_ids, w_gate, ws_gate, activation, clamp_limit, group_name, allocator) -> _moka.Layer:
    group = group_named(group_name)
    world = group.size if group else 1
    backend = _backend(x)
    shared = 0 if ws_gate is None else ws_gate.shape[0]
    key = (backend, x.device.index, x.shape[-1], w_gate.shape[1], w_gate.shape[0] * world, topk_ids.shape[-1],
           shared, activation, clamp_limit, group_name, allocator)
    if key not in _op_layers:
        _op_layers[key] = _make_layer(backend, group, hidden=x.shape[-1], intermediate=w_gate.shape[1],
                                      experts=w_gate.shape[0] * world, top_k=topk_ids.shape[-1],
                                      shared_intermediate=shared, activation=activation, clamp_limit=clamp_limit,
                                      options=_layer_options(backend, x.device.index, allocator))
    return _op_layers[key]


# moe's engines by the MoE module they serve (its engine id: the CUDA all-to-all path keeps its
# latest forward's exchange plan in the layer, so two modules cannot share one), then
# by what they are built from, so that an exported program runs in another process too.
_op_engines: dict[tuple, tuple[_moka.Router, _moka.Layer, _moka.Moe]] = {}
_engine_ids = itertools.count()


def new_engine_id(module: nn.Module) -> int:
    """An id for the op's engines of ``module``; they go when it goes."""
    engine_id = next(_engine_ids)
    weakref.finalize(module, _drop_op_engines, engine_id)
    return engine_id


def _drop_op_engines(engine_id: int) -> None:
    for key in [key for key in _op_engines if key[0] == engine_id]:
        del _op_engines[key]


def op_layers_of(engine_id: int) -> list[_moka.Layer]:
    """The layers of the op's engines of one MoE module (for its check_errors)."""
    return [layer for key, (_, layer, _) in _op_engines.items() if key[0] == engine_id]


def _op_moe(x, w_router, w_gate, ws_gate, selection_bias, top_k, score, renormalize, route_scale, activation,
            clamp_limit, path, tile_rows, max_tokens, group_name, engine_id, allocator) -> _moka.Moe:
    backend = _backend(x)
    shared = 0 if ws_gate is None else ws_gate.shape[0]
    engine = dict(hidden=x.shape[-1], intermediate=w_gate.shape[1], experts=w_router.shape[0], top_k=top_k,
                  shared_intermediate=shared, score=score, selection_bias=selection_bias is not None,
                  renormalize=renormalize, route_scale=route_scale, activation=activation, clamp_limit=clamp_limit,
                  path=path, tile_rows=tile_rows, max_tokens=max_tokens, allocator=allocator)
    key = (engine_id, backend, x.device.index, *engine.values(), group_name)
    if key not in _op_engines:
        _op_engines[key] = _make_engines(backend, x.device.index, group_named(group_name), **engine)
    return _op_engines[key][2]


# --- moka::moe_experts: the routed experts (and shared expert) for tokens routed by the caller ---

@torch.library.custom_op("moka::moe_experts", mutates_args=())
def _moe_experts_op(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                    ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor], activation: str,
                    clamp_limit: float, group_name: str, allocator: str = "torch") -> tuple[Tensor, Tensor]:
    """(out, saved state)."""
    layer = _op_layer(x, topk_ids, w_gate, ws_gate, activation, clamp_limit, group_name, allocator)
    context, out = _experts_forward(layer, x, topk_ids, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))
    return out, _saved_tensor(layer, context)


@_moe_experts_op.register_fake
def _(x, *_arguments):
    return torch.empty_like(x), _fake_saved_tensor()


@torch.library.custom_op("moka::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(d_out: Tensor, saved: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                             w_gate: Tensor, w_up: Tensor, w_down: Tensor, ws_gate: Optional[Tensor],
                             ws_up: Optional[Tensor], ws_down: Optional[Tensor]) -> list[Tensor]:
    """[d_x, d_topk_weights, d_w_gate, ..., d_ws_down] from the forward's saved state; its inputs
    are the tensors that state points into."""
    state = _saved_state(saved)
    expert_weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    d_x, d_topk_weights, d_weights = _experts_backward(state.engine, _take_state(state, "context"), d_out, x,
                                                       topk_weights, expert_weights)
    return _as_tensors([d_x, d_topk_weights, *d_weights])


@_moe_experts_backward_op.register_fake
def _(d_out, saved, x, topk_ids, *differentiable):
    return _as_tensors([_empty_like(t) for t in (x, *differentiable)])


def _setup_experts_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9], output[1])


def _experts_op_backward(ctx, d_out, _d_saved):
    x, topk_ids, topk_weights, *weights, saved = ctx.saved_tensors
    d_x, d_topk_weights, *d_weights = _moe_experts_backward_op(d_out.contiguous(), saved, x, topk_ids, topk_weights,
                                                               *weights)
    return (d_x, None, d_topk_weights, *_present(d_weights, weights), None, None, None, None)


_moe_experts_op.register_autograd(_first_order_only(_experts_op_backward), setup_context=_setup_experts_context)


# --- moka::moe: MoE's routing, experts and combine ---

@torch.library.custom_op("moka::moe", mutates_args=())
def _moe_op(x: Tensor, w_router: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, ws_gate: Optional[Tensor],
            ws_up: Optional[Tensor], ws_down: Optional[Tensor], selection_bias: Optional[Tensor], top_k: int,
            score: str, renormalize: bool, route_scale: float, activation: str, clamp_limit: float, path: str,
            tile_rows: Optional[int], max_tokens: int, group_name: str, engine_id: int,
            allocator: str = "torch") -> tuple[Tensor, Tensor, Tensor]:
    """(out, this call's routes per expert [E] int64, saved state). Functional, unlike moka's call,
    which adds the routes to a running count: an op that mutates cannot have an autograd formula."""
    moe = _op_moe(x, w_router, w_gate, ws_gate, selection_bias, top_k, score, renormalize, route_scale, activation,
                  clamp_limit, path, tile_rows, max_tokens, group_name, engine_id, allocator)
    routes = _routes_per_expert(x, w_router)
    context, out, _ = _moe_forward(x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, selection_bias,
                                   routes, moe, top_k)
    return out, routes, _saved_tensor(moe, context)


def _routes_per_expert(x, w_router) -> Tensor:
    return torch.zeros(w_router.shape[0], dtype=torch.int64, device=x.device)


@_moe_op.register_fake
def _(x, w_router, *_arguments):
    return torch.empty_like(x), _routes_per_expert(x, w_router), _fake_saved_tensor()


@torch.library.custom_op("moka::moe_with_aux", mutates_args=())
def _moe_with_aux_op(x: Tensor, w_router: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                     ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                     selection_bias: Optional[Tensor], top_k: int, score: str, renormalize: bool, route_scale: float,
                     activation: str, clamp_limit: float, path: str, tile_rows: Optional[int], max_tokens: int,
                     group_name: str, engine_id: int,
                     allocator: str = "torch") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """moka::moe with what moka's router call wrote for ``MoE.forward(x, return_aux=True)``: (out,
    routes per expert, router_logits, router_probs, losses [balancing, z], saved state)."""
    moe = _op_moe(x, w_router, w_gate, ws_gate, selection_bias, top_k, score, renormalize, route_scale, activation,
                  clamp_limit, path, tile_rows, max_tokens, group_name, engine_id, allocator)
    routes = _routes_per_expert(x, w_router)
    logits, probs, losses, _ = router_aux_outputs(x, w_router.shape[0])
    context, out, _ = _moe_forward(x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, selection_bias,
                                   routes, moe, top_k, aux=(logits, probs, losses, None))
    return out, routes, logits, probs, losses, _saved_tensor(moe, context)


@_moe_with_aux_op.register_fake
def _(x, w_router, *_arguments):
    logits, probs, losses, _ = router_aux_outputs(x, w_router.shape[0])
    return torch.empty_like(x), _routes_per_expert(x, w_router), logits, probs, losses, _fake_saved_tensor()


@torch.library.custom_op("moka::moe_backward", mutates_args=())
def _moe_backward_op(d_out: Tensor, saved: Tensor, x: Tensor, w_router: Tensor, w_gate: Tensor, w_up: Tensor,
                     w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                     top_k: int, d_router_logits: Optional[Tensor] = None, d_router_probs: Optional[Tensor] = None,
                     d_losses: Optional[Tensor] = None) -> list[Tensor]:
    """[d_x, d_w_router, d_w_gate, ..., d_ws_down] from the forward's saved state (which holds the
    weights and routes it points into; x is the caller's); d_router_logits, d_router_probs,
    d_losses: the gradients of moka::moe_with_aux's router outputs."""
    context = _take_state(_saved_state(saved), "context")
    d_topk_weights = torch.empty(x.shape[0], top_k, dtype=router_weight_dtype(x.dtype), device=x.device)
    aux_grads = (d_router_logits, d_router_probs, d_losses)
    d_x, d_w_router, d_weights = _moe_backward(context, d_out, x, w_router,
                                               (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), d_topk_weights,
                                               aux_grads=None if all(g is None for g in aux_grads) else aux_grads)
    return _as_tensors([d_x, d_w_router, *d_weights])


@_moe_backward_op.register_fake
def _(d_out, saved, x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, top_k, *_aux_grads):
    return _as_tensors([_empty_like(t) for t in (x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)])


def _setup_moe_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], output[2])  # x, w_router, the expert weights, the saved state
    ctx.top_k = inputs[9]


def _moe_op_backward(ctx, d_out, _d_routes, _d_saved):
    x, w_router, *weights, saved = ctx.saved_tensors
    d_x, d_w_router, *d_weights = _moe_backward_op(d_out.contiguous(), saved, x, w_router, *weights, ctx.top_k)
    return (d_x, d_w_router, *_present(d_weights, weights), *[None] * 13)  # selection_bias, the options


_moe_op.register_autograd(_first_order_only(_moe_op_backward), setup_context=_setup_moe_context)


def _setup_moe_with_aux_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], output[5])
    ctx.top_k = inputs[9]


def _moe_with_aux_op_backward(ctx, d_out, _d_routes, d_logits, d_probs, d_losses, _d_saved):
    x, w_router, *weights, saved = ctx.saved_tensors
    d_x, d_w_router, *d_weights = _moe_backward_op(d_out.contiguous(), saved, x, w_router, *weights, ctx.top_k,
                                                   d_logits, d_probs, d_losses)
    return (d_x, d_w_router, *_present(d_weights, weights), *[None] * 13)


_moe_with_aux_op.register_autograd(_first_order_only(_moe_with_aux_op_backward),
                                   setup_context=_setup_moe_with_aux_context)


_PLAIN_TYPES = frozenset((Tensor, nn.Parameter, type(None)))  # None: an absent optional tensor


def _untraced_call(tensors) -> bool:
    """Whether moka can run on the tensors directly: plain tensors (no FakeTensor, FunctionalTensor
    or other subclass), and no compiler or tracer around."""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and _PLAIN_TYPES.issuperset(map(type, tensors)))


def _plain_eager_call(tensors) -> bool:
    """Whether nothing needs to see the op: an untraced call, and no torch function or dispatch
    mode, or functorch transform around."""
    return (_untraced_call(tensors) and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._len_torch_function_stack() == 0 and not torch._C._are_functorch_transforms_active())


def _int32_ids(topk_ids: Tensor) -> Tensor:
    """int64 ids (torch.topk's, Hugging Face's) as the int32 moka takes; an id outside int32 becomes
    -1, which moka reports as out of range instead of wrapping it into one that is not."""
    if topk_ids.dtype != torch.int64:
        return topk_ids
    in_range = (topk_ids >= 0) & (topk_ids <= torch.iinfo(torch.int32).max)
    return torch.where(in_range, topk_ids, -1).to(torch.int32)
