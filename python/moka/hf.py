"""Loading an MoE layer from a Hugging Face state dict (checkpoint names and shapes): Qwen3-MoE,
Mixtral and DeepSeek-V3, in the names of transformers 4.x (one tensor per expert) and of
transformers 5 (the experts fused into two tensors per layer).

  style         router             expert e: gate / up / down            shared expert
  qwen3_moe     mlp.gate           mlp.experts.e.{gate,up,down}_proj     -
  mixtral       block_sparse_moe.gate  block_sparse_moe.experts.e.{w1,w3,w2}  -
  deepseek_v3   mlp.gate (+ .e_score_correction_bias)  mlp.experts.e.{gate,up,down}_proj
                                                              mlp.shared_experts.{gate,up,down}_proj
all under ``<prefix><layer>.`` (``prefix`` defaults to ``model.layers.``), every weight ``.weight``
in nn.Linear's [out, in] layout, so gate/up are [I, H] and down [H, I], as moka's per-expert
slices.

transformers 5 fuses the experts of a layer: ``experts.gate_up_proj`` [E, 2I, H] (no ``.weight``),
expert e's gate projection in rows [0, I) and its up projection in rows [I, 2I) (transformers
computes ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``), and ``experts.down_proj``
[E, H, I]; Mixtral's block is ``mlp`` there instead of ``block_sparse_moe``. The router
(``gate.weight``, DeepSeek-V3's ``gate.e_score_correction_bias``) and the shared expert keep their
names. ``load_moe`` reads whichever layout the state dict has.

Routing defaults follow each model's config: softmax with renormalized top-k for Qwen3-MoE
(norm_topk_prob) and Mixtral; sigmoid, selection bias, renormalized, scaled by
routed_scaling_factor for DeepSeek-V3 (whose group-limited top-k, n_group/topk_group, moka does
not do: it picks the top-k over all experts).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Style:
    block: str                          # the MoE block's prefix under model.layers.<layer>.
    expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
    routing: dict = field(default_factory=dict)
    shared: str = ""                    # the shared expert's prefix under the block, if any
    selection_bias: str = ""            # the router's selection bias under the block, if any
    fused_block: str = ""               # the block's name in transformers 5, where it differs


STYLES = {
    "qwen3_moe": Style("mlp", ("gate_proj", "up_proj", "down_proj"), {"score": "softmax", "renormalize": True}),
    "mixtral": Style("block_sparse_moe", ("w1", "w3", "w2"), {"score": "softmax", "renormalize": True},
                     fused_block="mlp"),
    "deepseek_v3": Style("mlp", ("gate_proj", "up_proj", "down_proj"),
                         {"score": "sigmoid", "renormalize": True, "route_scale": 2.5},
                         shared="shared_experts", selection_bias="gate.e_score_correction_bias"),
}


def load_moe(cls, state_dict: dict, style: str, layer: int, top_k: int, *, prefix: str = "model.layers.",
             group=None, **kwargs):
    """``cls`` (moka.torch.MoE) holding layer ``layer`` of ``state_dict``, in either layout of the
    module docstring; ``prefix``: what comes before the layer index in the names (``model.layers.``;
    e.g. ``model.language_model.layers.`` for a multimodal checkpoint, ``layers.`` for a bare
    decoder). With a ``group``, only this rank's experts are read. ``kwargs`` override the style's
    routing and reach MoE's constructor (device, dtype, ...)."""
    if style not in STYLES:
        raise ValueError(f"moka: unknown Hugging Face style '{style}' ({', '.join(STYLES)})")
    s = STYLES[style]
    block = f"{prefix}{layer}.{s.block}."
    if s.fused_block and block + "gate.weight" not in state_dict:
        fused = f"{prefix}{layer}.{s.fused_block}."
        if fused + "gate.weight" in state_dict:
            block = fused

    def get(name: str) -> torch.Tensor:
        key = block + name
        if key not in state_dict:
            near = sorted(k for k in state_dict if k.startswith(block))[:5]
            raise KeyError(f"moka: {style} layer {layer}: no '{key}' in the state dict"
                           + (f" (it has {', '.join(near)}, ...)" if near else f" (nothing under '{block}')"))
        return state_dict[key]

    router = get("gate.weight")
    experts, hidden = router.shape
    fused = block + "experts.gate_up_proj" in state_dict  # transformers 5
    if fused:
        gate_up = get("experts.gate_up_proj")
        if gate_up.dim() != 3 or gate_up.shape[0] != experts or gate_up.shape[1] % 2 or gate_up.shape[2] != hidden:
            raise ValueError(f"moka: {style} layer {layer}: {block}experts.gate_up_proj is {tuple(gate_up.shape)}, "
                             f"expected ({experts}, 2 * intermediate, {hidden})")
        intermediate = gate_up.shape[1] // 2
        down = get("experts.down_proj")
    else:
        intermediate = get(f"experts.0.{s.expert_names[0]}.weight").shape[0]
    shared = get(f"{s.shared}.{s.expert_names[0]}.weight").shape[0] if s.shared else 0
    options = {**s.routing, "selection_bias": bool(s.selection_bias), **kwargs}
    moe = cls(hidden, intermediate, experts, top_k, shared, group=group, **options)

    def copy(param: torch.Tensor, value: torch.Tensor, key: str):
        if value.shape != param.shape:
            raise ValueError(f"moka: {style} layer {layer}: {block}{key} is {tuple(value.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(value)

    with torch.no_grad():
        copy(moe.w_router, router, "gate.weight")
        if s.selection_bias:
            copy(moe.selection_bias, get(s.selection_bias), s.selection_bias)
        local = slice(moe.first_local_expert, moe.first_local_expert + moe.local_experts)
        if fused:
            copy(moe.w_gate, gate_up[local, :intermediate], "experts.gate_up_proj[:, :I]")
            copy(moe.w_up, gate_up[local, intermediate:], "experts.gate_up_proj[:, I:]")
            copy(moe.w_down, down[local], "experts.down_proj")
        else:
            for i in range(moe.local_experts):
                e = moe.first_local_expert + i
                for param, name in zip((moe.w_gate, moe.w_up, moe.w_down), s.expert_names):
                    key = f"experts.{e}.{name}.weight"
                    copy(param[i], get(key), key)
        if shared:
            for param, name in zip((moe.ws_gate, moe.ws_up, moe.ws_down), s.expert_names):
                key = f"{s.shared}.{name}.weight"
                copy(param, get(key), key)
    return moe
