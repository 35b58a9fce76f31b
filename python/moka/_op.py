"""The functional op ``moka::moe_experts`` (``moka.torch.moe_experts``), for models that route
themselves: moka's layers per shape, the ``torch.library`` op with its fake and autograd
registrations, and the eager path that skips the dispatcher. Layouts and dtypes: see ``moka.torch``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import _moka
from ._autograd import _experts_backward, _experts_forward, _first_order_only


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

# moka's process groups by torch.distributed group name: moka.torch.moka_group makes them, the op
# (whose arguments can only name its group) finds them here.
_groups: dict[str, _moka.Group] = {}


# --- the functional op, for models that route themselves (traceable by torch.compile) ---

_op_layers: dict[tuple, _moka.Layer] = {}


def _op_layer(x, topk_ids, w_gate, ws_gate, activation, clamp_limit, group_name) -> _moka.Layer:
    group = _groups[group_name] if group_name else None
    world = group.size if group else 1
    backend = _backend(x)
    shared = 0 if ws_gate is None else ws_gate.shape[0]
    key = (backend, x.device.index, x.shape[-1], w_gate.shape[1], w_gate.shape[0] * world, topk_ids.shape[-1],
           shared, activation, clamp_limit, group_name)
    if key not in _op_layers:
        _op_layers[key] = _make_layer(backend, group, *key[2:8], clamp_limit, "automatic", None, 0)
    return _op_layers[key]


def _make_layer(backend, group, hidden, intermediate, experts, top_k, shared, activation, clamp_limit, path,
                tile_rows, max_tokens) -> _moka.Layer:
    if tile_rows is None:  # the CUDA GEMMs' row tile; the CPU backend needs no padding
        tile_rows = _moka.DEFAULT_TILE_ROWS if backend == "cuda" else 1
    return _moka.Layer(hidden, intermediate, experts, top_k, shared, activation, clamp_limit, backend, group,
                       torch.get_num_threads(), tile_rows, path, max_tokens)


# What the op computes, as plain functions: the op wraps them for the dispatcher (torch.compile,
# modes, transforms), _EagerExperts calls them directly in plain eager calls.

def _recomputing_experts_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                                 ws_down: Optional[Tensor], activation: str, clamp_limit: float,
                                 group_name: str) -> Tensor:
    layer = _op_layer(x, topk_ids, w_gate, ws_gate, activation, clamp_limit, group_name)
    return _experts_forward(layer, x, topk_ids, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))[1]


def _recomputing_experts_backward(d_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                  activation, clamp_limit, group_name):
    """(d_x, d_topk_weights, [d_w_gate, ..., d_ws_down], None for absent shared-expert weights).
    Nothing is kept between forward and backward (a graph holds tensors only), so backward runs
    moka's forward again for the state it needs, like activation checkpointing."""
    layer = _op_layer(x, topk_ids, w_gate, ws_gate, activation, clamp_limit, group_name)
    expert_weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    saved, _ = _experts_forward(layer, x, topk_ids, topk_weights, expert_weights)
    return _experts_backward(layer, saved, d_out, x, topk_weights, expert_weights)


_moe_experts_op = torch.library.custom_op("moka::moe_experts", _recomputing_experts_forward, mutates_args=())


@_moe_experts_op.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, activation, clamp_limit,
      group_name):
    return torch.empty_like(x)


@torch.library.custom_op("moka::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(d_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor,
                             w_up: Tensor, w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                             ws_down: Optional[Tensor], activation: str, clamp_limit: float,
                             group_name: str) -> list[Tensor]:
    d_x, d_topk_weights, d_weights = _recomputing_experts_backward(
        d_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, activation, clamp_limit,
        group_name)
    # Absent shared-expert weights get empty gradients (an op returns tensors only).
    return [d_x, d_topk_weights, *(g if g is not None else x.new_empty(0) for g in d_weights)]


def _experts_grad_buffers(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down) -> list[Tensor]:
    # Absent shared-expert weights get empty gradients (an op returns tensors only, none aliased).
    return [torch.empty_like(t) if t is not None else x.new_empty(0)
            for t in (x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)]


@_moe_experts_backward_op.register_fake
def _(d_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, activation, clamp_limit,
      group_name):
    return _experts_grad_buffers(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9])
    ctx.attributes = inputs[9:]


def _moe_experts_backward(ctx, d_out):
    saved = ctx.saved_tensors
    d_x, d_topk_weights, *d_weights = _moe_experts_backward_op(d_out.contiguous(), *saved, *ctx.attributes)
    if saved[6] is None:
        d_weights[3:] = [None, None, None]
    return (d_x, None, d_topk_weights, *d_weights, None, None, None)


_moe_experts_op.register_autograd(_moe_experts_backward, setup_context=_setup_context)


class _EagerExperts(torch.autograd.Function):
    """The op's forward and backward for a plain eager call, without torch.library's dispatch
    (about 15 us of Python a call on top of moka's own)."""

    @staticmethod
    def forward(ctx, *inputs):
        _setup_context(ctx, inputs, None)
        return _recomputing_experts_forward(*inputs)

    @staticmethod
    @_first_order_only
    def backward(ctx, d_out):
        d_x, d_topk_weights, d_weights = _recomputing_experts_backward(d_out.contiguous(), *ctx.saved_tensors,
                                                                       *ctx.attributes)
        return (d_x, None, d_topk_weights, *d_weights, None, None, None)


_PLAIN_TENSORS = (Tensor, nn.Parameter)


def _plain_eager_call(tensors) -> bool:
    """Whether nothing needs to see the op: plain tensors, and no compiler, tracer, torch function
    or dispatch mode, or functorch transform around."""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) in _PLAIN_TENSORS for t in tensors))


def _int32_ids(topk_ids: Tensor) -> Tensor:
    """int64 ids (torch.topk's, Hugging Face's) as the int32 moka takes; an id outside int32 becomes
    -1, which moka reports as out of range instead of wrapping it into one that is not."""
    if topk_ids.dtype != torch.int64:
        return topk_ids
    in_range = (topk_ids >= 0) & (topk_ids <= torch.iinfo(torch.int32).max)
    return torch.where(in_range, topk_ids, -1).to(torch.int32)
