"""MoE.from_hf on synthetic state dicts in the Hugging Face layouts (names and shapes)."""
import pytest
import torch

from moka import reference
from moka.torch import MoE

H, I, E, IS = 8, 6, 4, 5


def synthetic(style: str, layer: int = 3) -> dict:
    """A state dict with the names and shapes of one layer of ``style`` (plus an attention weight)."""
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    block, names = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}[style]
    p = f"model.layers.{layer}.{block}."
    sd = {f"model.layers.{layer}.self_attn.q_proj.weight": rand(H, H), p + "gate.weight": rand(E, H)}
    for e in range(E):
        sd[p + f"experts.{e}.{names[0]}.weight"] = rand(I, H)
        sd[p + f"experts.{e}.{names[1]}.weight"] = rand(I, H)
        sd[p + f"experts.{e}.{names[2]}.weight"] = rand(H, I)
    if style == "deepseek_v3":
        sd[p + "gate.e_score_correction_bias"] = rand(E).float()
        sd[p + "shared_experts.gate_proj.weight"] = rand(IS, H)
        sd[p + "shared_experts.up_proj.weight"] = rand(IS, H)
        sd[p + "shared_experts.down_proj.weight"] = rand(H, IS)
    return sd


def expected(sd: dict, style: str, x: torch.Tensor) -> torch.Tensor:
    """The layer computed straight from the state dict's per-expert tensors."""
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if style == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    p = f"model.layers.3.{block}."
    stack = lambda n: torch.stack([sd[p + f"experts.{e}.{n}.weight"] for e in range(E)])  # noqa: E731
    deepseek = style == "deepseek_v3"
    ids, weights = reference.route(x, sd[p + "gate.weight"], 2, score="sigmoid" if deepseek else "softmax",
                                   renormalize=True, route_scale=2.5 if deepseek else 1.0,
                                   selection_bias=sd.get(p + "gate.e_score_correction_bias"))
    shared = [sd[p + f"shared_experts.{n}.weight"] for n in names] if deepseek else []
    return reference.experts(x, ids, weights, *(stack(n) for n in names), *shared)


@pytest.mark.parametrize("style", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_from_hf_computes_the_layer_of_the_state_dict(style):
    sd = synthetic(style)
    moe = MoE.from_hf(sd, style, layer=3, top_k=2, dtype=torch.float64)
    assert (moe.hidden, moe.intermediate, moe.experts, moe.shared_intermediate) == (
        H, I, E, IS if style == "deepseek_v3" else 0)
    x = torch.randn(10, H, dtype=torch.float64)
    torch.testing.assert_close(moe(x), expected(sd, style, x))


def test_missing_tensors_and_wrong_shapes_are_named():
    sd = synthetic("qwen3_moe")
    with pytest.raises(KeyError, match="qwen3_moe layer 2: no 'model.layers.2.mlp.gate.weight'.*nothing under"):
        MoE.from_hf(sd, "qwen3_moe", layer=2, top_k=2)
    del sd["model.layers.3.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match="experts.2.up_proj.weight"):
        MoE.from_hf(sd, "qwen3_moe", layer=3, top_k=2, dtype=torch.float64)
    sd = synthetic("mixtral")
    sd["model.layers.3.block_sparse_moe.experts.1.w2.weight"] = torch.zeros(H, I + 1)
    with pytest.raises(ValueError, match=r"experts.1.w2.weight is \(8, 7\), expected \(8, 6\)"):
        MoE.from_hf(sd, "mixtral", layer=3, top_k=2, dtype=torch.float64)
    with pytest.raises(ValueError, match="unknown Hugging Face style 'llama'"):
        MoE.from_hf(sd, "llama", layer=3, top_k=2)
