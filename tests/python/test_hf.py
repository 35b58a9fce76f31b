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


def fused(sd: dict, style: str, layer: int = 3, prefix: str = "model.layers.") -> dict:
    """``sd`` (transformers 4.x names) in transformers 5's names: each layer's experts as
    experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and experts.down_proj [E, H, I],
    Mixtral's block as mlp; the router, the shared expert and the rest keep their names."""
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if style == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    old, new = f"model.layers.{layer}.{block}.", f"{prefix}{layer}.mlp."
    out = {}
    for key, value in sd.items():
        if key.startswith(old + "experts."):
            continue
        key = new + key[len(old):] if key.startswith(old) else prefix + key[len("model.layers."):]
        out[key] = value
    stack = lambda n: torch.stack([sd[old + f"experts.{e}.{n}.weight"] for e in range(E)])  # noqa: E731
    out[new + "experts.gate_up_proj"] = torch.cat([stack(names[0]), stack(names[1])], dim=1)
    out[new + "experts.down_proj"] = stack(names[2])
    return out


@pytest.mark.parametrize("style", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("prefix", ["model.layers.", "model.language_model.layers."])
def test_from_hf_reads_the_transformers_5_fused_experts_bit_for_bit(style, prefix):
    sd = synthetic(style)
    v5 = fused(sd, style, prefix=prefix)
    assert not any(".experts.0." in k for k in v5)
    one = MoE.from_hf(sd, style, layer=3, top_k=2, dtype=torch.float64)
    five = MoE.from_hf(v5, style, layer=3, top_k=2, prefix=prefix, dtype=torch.float64)
    for name, tensor in one.state_dict().items():
        assert torch.equal(tensor, five.state_dict()[name]), name
    x = torch.randn(10, H, dtype=torch.float64, requires_grad=True)
    out_one, out_five = one(x), five(x)
    assert torch.equal(out_one, out_five)
    d_out = torch.randn_like(out_one)
    assert torch.equal(torch.autograd.grad(out_one, x, d_out)[0], torch.autograd.grad(out_five, x, d_out)[0])
    torch.testing.assert_close(out_five, expected(sd, style, x.detach()))


def test_a_fused_tensor_of_the_wrong_shape_is_named():
    v5 = fused(synthetic("qwen3_moe"), "qwen3_moe")
    key = "model.layers.3.mlp.experts.gate_up_proj"
    v5[key] = v5[key][:, :-1]
    with pytest.raises(ValueError, match=r"experts.gate_up_proj is \(4, 11, 8\), expected \(4, 2 \* intermediate, 8\)"):
        MoE.from_hf(v5, "qwen3_moe", layer=3, top_k=2, dtype=torch.float64)
    v5 = fused(synthetic("qwen3_moe"), "qwen3_moe")
    del v5["model.layers.3.mlp.experts.down_proj"]
    with pytest.raises(KeyError, match="no 'model.layers.3.mlp.experts.down_proj'"):
        MoE.from_hf(v5, "qwen3_moe", layer=3, top_k=2, dtype=torch.float64)


def test_prefix_selects_where_the_layers_are():
    sd = {k.replace("model.layers.", "layers."): v for k, v in synthetic("qwen3_moe").items()}
    moe = MoE.from_hf(sd, "qwen3_moe", layer=3, top_k=2, prefix="layers.", dtype=torch.float64)
    assert torch.equal(moe.w_router, sd["layers.3.mlp.gate.weight"])
    with pytest.raises(KeyError, match="no 'model.layers.3.mlp.gate.weight'"):
        MoE.from_hf(sd, "qwen3_moe", layer=3, top_k=2, dtype=torch.float64)
