"""Pure-PyTorch MoE with moka's semantics: the reference the tests compare against, and the
block the example swaps in (``TorchMoE``: the same parameters as ``moka.torch.MoE``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .torch import MoE, router_weight_dtype


def _float32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


GPT_OSS_ALPHA = _float32(1.702)  # moka keeps it, and the clamp limit, in float32


def activate(g: Tensor, u: Tensor, activation: str = "swiglu", clamp_limit: float = 7.0) -> Tensor:
    if activation == "swiglu":
        return F.silu(g) * u
    if activation == "swiglu_clamped":  # GPT-OSS
        limit = _float32(clamp_limit)
        g = g.clamp(max=limit)
        return g * torch.sigmoid(GPT_OSS_ALPHA * g) * (u.clamp(-limit, limit) + 1)
    raise ValueError(f"unknown activation '{activation}' (swiglu, swiglu_clamped)")


def route(x: Tensor, w_router: Tensor, top_k: int, *, score: str = "softmax", selection_bias: Optional[Tensor] = None,
          renormalize: bool = False, route_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """topk_ids [T, k] int32 and topk_weights [T, k] for x [T, H], as moka's router computes them."""
    logits = x @ w_router.t()
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    keys = scores if selection_bias is None else scores + selection_bias.to(scores.dtype)
    ids = torch.topk(keys.detach(), top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), (weights * route_scale).to(router_weight_dtype(x.dtype))


def experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
            ws_gate: Optional[Tensor] = None, ws_up: Optional[Tensor] = None, ws_down: Optional[Tensor] = None,
            *, activation: str = "swiglu", clamp_limit: float = 7.0) -> Tensor:
    """out [T, H] = shared(x) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x), all experts local."""
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        rows = x[tokens]
        y = activate(rows @ w_gate[e].t(), rows @ w_up[e].t(), activation, clamp_limit) @ w_down[e].t()
        out = out.index_add(0, tokens, y * topk_weights[tokens, slots, None].to(x.dtype))
    if ws_gate is not None:
        out = out + activate(x @ ws_gate.t(), x @ ws_up.t(), activation, clamp_limit) @ ws_down.t()
    return out


class TorchMoE(MoE):
    """``moka.torch.MoE``'s parameters and arguments, computed in plain PyTorch on one rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.group is not None:
            raise ValueError("TorchMoE runs every expert on its own rank: pass group=None")

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        ids, weights = route(x, self.w_router, self.top_k, score=self.score, selection_bias=self.selection_bias,
                             renormalize=self.renormalize, route_scale=self.route_scale)
        self.expert_load += torch.bincount(ids.flatten().long(), minlength=self.experts)
        return ids, weights

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, self.hidden)
        ids, weights = self.route(tokens)
        out = experts(tokens, ids, weights, self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up,
                      self.ws_down, activation=self.activation, clamp_limit=self.clamp_limit)
        return out.reshape(x.shape)
