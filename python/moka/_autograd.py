"""moka's calls under autograd: the DLPack and stream helpers, moka's router and layer calls as
forward/backward functions, and the ``torch.autograd.Function`` nodes of plain eager calls of
``moka.torch.MoE`` and ``moe_experts`` (which keep moka's forward state for their backward).
Layouts and dtypes: see ``moka.torch``."""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack as _dlpack

from . import _moka


def router_weight_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of topk_weights (and their gradient) for activations of ``x_dtype``."""
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def _dl(t: Optional[Tensor]):
    # A capsule without the stream synchronization of Tensor.__dlpack__ (moka runs on the current
    # stream already, and a synchronization would break CUDA graph capture).
    return None if t is None else _dlpack(t)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch.compile's code uses


def _stream(t: Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:  # a few microseconds less per call than current_stream()
        return _raw_stream(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


# --- the autograd functions of MoE (they keep moka's forward state for backward) ---

def _weights(w_gate, w_up, w_down, ws_gate, ws_up, ws_down) -> _moka.Weights:
    return _moka.Weights(_dl(w_gate), _dl(w_up), _dl(w_down), _dl(ws_gate), _dl(ws_up), _dl(ws_down))


def _empty_like(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else torch.empty_like(t)


# moka's router and layer calls, shared by the autograd functions below (moka's saved state
# points into the tensors given, so the functions keep those for backward).

def _routes(x: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Unfilled topk_ids [T, k] and topk_weights [T, k] for x [T, H]."""
    tokens = x.shape[0]
    return (torch.empty(tokens, top_k, dtype=torch.int32, device=x.device),
            torch.empty(tokens, top_k, dtype=router_weight_dtype(x.dtype), device=x.device))


def _route_forward(router, x, w_router, bias, top_k, expert_load):
    """moka's routing of x: (saved state, topk_ids, topk_weights); the routes per expert are added
    to expert_load [E] int64 inside moka's call (no torch launch for the statistics)."""
    ids, weights = _routes(x, top_k)
    saved = router.forward(_dl(x), _dl(w_router), _dl(bias), _dl(ids), _dl(weights), None, _dl(expert_load),
                           _stream(x))
    return saved, ids, weights


def _route_backward(router, saved, x, w_router, d_weights):
    """(d_x, d_w_router) of the routing from the gradient of topk_weights."""
    d_x, d_w_router = torch.empty_like(x), torch.empty_like(w_router)
    router.backward(saved, _dl(d_weights.contiguous()), _dl(d_x), _dl(d_w_router), _stream(x))
    return d_x, d_w_router


def _experts_forward(layer, x, topk_ids, topk_weights, expert_weights):
    """(saved state, out) of the experts; expert_weights: w_gate, w_up, w_down, ws_gate, ws_up, ws_down."""
    out = torch.empty_like(x)
    saved = layer.forward(_dl(x), _dl(topk_ids), _dl(topk_weights), _weights(*expert_weights), _dl(out), _stream(x))
    return saved, out


def _experts_backward(layer, saved, d_out, x, topk_weights, expert_weights, consume=False):
    """(d_x, d_topk_weights, [d_w_gate, ..., d_ws_down]) of the experts; ``consume``: the saved
    state goes to this backward (see ``_last_backward``)."""
    d_x, d_topk_weights = torch.empty_like(x), torch.empty_like(topk_weights)
    d_weights = [_empty_like(w) for w in expert_weights]
    layer.backward(saved, _dl(d_out.contiguous()), _weights(*expert_weights), _dl(d_x), _dl(d_topk_weights),
                   _weights(*d_weights), _stream(x), consume)
    return d_x, d_topk_weights, d_weights


_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _last_backward() -> bool:
    """Whether the backward running now is the last through its graph (no retain_graph), so that
    moka's layer may reuse the saved gate and up products as its scratch (two rows x I buffers
    fewer at the backward's peak) and free them early. Asked of the autograd engine (a private
    query of torch's); where torch cannot answer, the state is kept, as for retain_graph."""
    return _keeps_graph is not None and not _keeps_graph()


def _first_order_only(backward):
    """A Function's backward that is not itself differentiable. Under create_graph=True (grad mode
    on inside the backward) its gradients come out marked so that differentiating them raises,
    instead of silently missing the second-order term (what torch's once_differentiable does,
    but whether or not the incoming gradients require grad)."""

    @functools.wraps(backward)
    def first_order(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        error = torch._C._functions.DelayedError(
            b"moka: the MoE layer has no double backward: its gradients cannot be differentiated again", len(outputs))
        return error(*[None if g is None else g.detach().requires_grad_() for g in outputs])

    return first_order


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_router, bias, router, top_k, expert_load):
        ctx.saved, ids, weights = _route_forward(router, x, w_router, bias, top_k, expert_load)
        ctx.router = router
        ctx.save_for_backward(x, w_router)
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    @_first_order_only
    def backward(ctx, _d_ids, d_weights):
        d_x, d_w_router = _route_backward(ctx.router, ctx.saved, *ctx.saved_tensors, d_weights)
        return d_x, d_w_router, None, None, None, None


def _take_state(ctx, name):
    """moka's saved state of an autograd node for its backward. Inside a CUDA graph capture it is
    released from the node, so that its device memory goes back inside the graph that allocated
    it (a graph must free what it allocates to be replayed); elsewhere the node keeps it, for a
    second backward (retain_graph=True, gradcheck)."""
    state = getattr(ctx, name, None)
    if state is None:
        raise RuntimeError("moka: the saved state of this MoE call was released by a backward captured in a "
                           "CUDA graph; a second backward through it (retain_graph=True) is not supported there")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        setattr(ctx, name, None)
    return state


class _Experts(torch.autograd.Function):
    """The experts on the caller's routes (``MoE.apply_experts``, and ``moe_experts`` without the
    dispatcher)."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer):
        weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        ctx.saved, out = _experts_forward(layer, x, topk_ids, topk_weights, weights)
        ctx.layer = layer
        ctx.save_for_backward(x, topk_ids, topk_weights, *weights)
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, d_out):
        x, _ids, topk_weights, *weights = ctx.saved_tensors
        d_x, d_topk_weights, d_weights = _experts_backward(ctx.layer, _take_state(ctx, "saved"), d_out, x,
                                                           topk_weights, weights, _last_backward())
        return (d_x, None, d_topk_weights, *d_weights, None)


def router_aux_outputs(x: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Unfilled (router_logits [T, E], router_probs [T, E], losses [2], tokens_per_expert [E] int64)
    that moka's router call fills in (moka::RouterAuxOutputs), in its compute dtype."""
    dtype = router_weight_dtype(x.dtype)
    logits = torch.empty(x.shape[0], experts, dtype=dtype, device=x.device)
    return (logits, torch.empty_like(logits), torch.empty(2, dtype=dtype, device=x.device),
            torch.empty(experts, dtype=torch.int64, device=x.device))


def _moe_forward(x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, bias, expert_load, moe, top_k,
                 aux=None):
    """moka's forward of the whole layer: (saved state, out, topk_weights); ``aux``: the tensors of
    ``router_aux_outputs`` for moka's router to fill in, or None."""
    ids, weights = _routes(x, top_k)
    out = torch.empty_like(x)
    args = (_dlpack(x), _dlpack(w_router), _dl(bias), _dlpack(expert_load), _dlpack(w_gate), _dlpack(w_up),
            _dlpack(w_down), _dl(ws_gate), _dl(ws_up), _dl(ws_down), _dlpack(ids), _dlpack(weights), _dlpack(out),
            _stream(x))
    if aux is None:
        return moe.forward(*args), out, weights
    logits, probs, losses, counts = aux  # counts: None where the caller has them (the op's routes)
    state = moe.forward(*args, expert_counts=_dl(counts), router_logits=_dl(logits), router_probs=_dl(probs),
                        losses=_dl(losses))
    return state, out, weights


def _moe_backward(state, d_out, x, w_router, expert_weights, d_topk_weights, consume=False, aux_grads=None):
    """(d_x, d_w_router, [d_w_gate, ..., d_ws_down]) of the whole layer from its forward's state;
    d_topk_weights [T, k]: scratch for the router's part; ``consume``: see ``_experts_backward``;
    ``aux_grads``: the gradients of router_logits, router_probs and losses (each may be None)."""
    # Written out: each helper call costs host time, every backward.
    w_gate, w_up, w_down, ws_gate, ws_up, ws_down = expert_weights
    d_x, d_w_router = torch.empty_like(x), torch.empty_like(w_router)
    d_w_gate, d_w_up, d_w_down = torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)
    d_ws_gate, d_ws_up, d_ws_down = _empty_like(ws_gate), _empty_like(ws_up), _empty_like(ws_down)
    args = (_dlpack(d_out.contiguous()), _dlpack(d_x), _dlpack(d_topk_weights), _dlpack(d_w_router), _dlpack(d_w_gate),
            _dlpack(d_w_up), _dlpack(d_w_down), _dl(d_ws_gate), _dl(d_ws_up), _dl(d_ws_down), consume)
    if aux_grads is None:
        state.backward(*args)
    else:
        d_logits, d_probs, d_losses = (None if g is None else _dl(g.contiguous()) for g in aux_grads)
        state.backward(*args, d_router_logits=d_logits, d_router_probs=d_probs, d_losses=d_losses)
    return d_x, d_w_router, (d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down)


class _MoE(torch.autograd.Function):
    """Routing, experts and combine as one autograd node and one moka call each way (what
    ``MoE.forward`` runs in a plain eager call where autograd records). moka's saved state keeps
    the routes and the weights it points into; autograd saves x (moka points into it too) and the
    weights, for its check that nothing changed them in place and for their gradients' shapes."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.state, out, ctx.topk_weights = _moe_forward(*inputs)  # topk_weights: the router scratch's shape
        ctx.save_for_backward(*inputs[:8])  # x, w_router and the expert weights
        return out

    @staticmethod
    @_first_order_only
    def backward(ctx, d_out):
        x, w_router, *expert_weights = ctx.saved_tensors
        d_x, d_w_router, d_weights = _moe_backward(_take_state(ctx, "state"), d_out, x, w_router, expert_weights,
                                                   torch.empty_like(ctx.topk_weights), _last_backward())
        return d_x, d_w_router, *d_weights, None, None, None, None


class _MoEWithAux(torch.autograd.Function):
    """``_MoE`` that also returns what moka's router call wrote for ``MoE.forward(x, return_aux=True)``:
    (out, router_logits, router_probs, losses [balancing, z], tokens_per_expert), the first four
    differentiable; their gradients go into moka's router backward."""

    @staticmethod
    def forward(ctx, *inputs):
        aux = router_aux_outputs(inputs[0], inputs[1].shape[0])
        ctx.state, out, ctx.topk_weights = _moe_forward(*inputs, aux=aux)
        ctx.save_for_backward(*inputs[:8])
        ctx.mark_non_differentiable(aux[3])
        ctx.set_materialize_grads(False)  # unused outputs' gradients stay None: nothing to read
        return out, *aux

    @staticmethod
    @_first_order_only
    def backward(ctx, d_out, d_logits, d_probs, d_losses, _d_counts):
        x, w_router, *expert_weights = ctx.saved_tensors
        d_out = torch.zeros_like(x) if d_out is None else d_out
        d_x, d_w_router, d_weights = _moe_backward(_take_state(ctx, "state"), d_out, x, w_router, expert_weights,
                                                   torch.empty_like(ctx.topk_weights), _last_backward(),
                                                   (d_logits, d_probs, d_losses))
        return d_x, d_w_router, *d_weights, None, None, None, None
