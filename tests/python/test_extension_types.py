"""The extension's configuration types (moka._moka.LayerOptions, MegakernelConfig, MoeShape,
RouterConfig): built with keyword arguments, C++ defaults for the rest, mistakes named."""
import pytest
import torch

from conftest import tiny_moe
from moka import _moka, reference
from moka.torch import moe_experts


def test_options_take_keywords_and_keep_the_cpp_defaults_for_the_rest():
    defaults = _moka.LayerOptions()
    options = _moka.LayerOptions(path=_moka.LayerPath.megakernel, max_tokens=4096,
                                 megakernel=_moka.MegakernelConfig(num_comm_sms=8))
    assert options.path == _moka.LayerPath.megakernel and options.max_tokens == 4096
    assert options.megakernel.num_comm_sms == 8
    # moka::LayerOptions{} and moka::MegakernelConfig{} (include/moka/layer.hpp, megakernel.hpp).
    assert (defaults.tile_rows, defaults.num_threads, defaults.fused_swiglu) == (128, 0, False)
    assert (defaults.path, defaults.row_order, defaults.save, defaults.max_tokens) == (
        _moka.LayerPath.automatic, _moka.RowOrder.rate_based, _moka.SaveMode.gate_up, 0)
    assert options.tile_rows == defaults.tile_rows
    assert options.megakernel.minibatch_size == defaults.megakernel.minibatch_size == 4096
    assert options.megakernel.spin_timeout_seconds == 30.0


def test_a_nested_config_is_edited_in_place():
    options = _moka.LayerOptions()
    options.megakernel.band_row_tiles = 4
    assert options.megakernel.band_row_tiles == 4
    assert _moka.LayerOptions().megakernel.band_row_tiles == 16  # another instance keeps the default


@pytest.mark.parametrize("arguments, message", [
    ({"pth": _moka.LayerPath.megakernel}, "unexpected keyword argument 'pth'"),
    ({"__init__": None}, "unexpected keyword argument '__init__'"),  # attributes that are no fields
    ({"path": "megakernel"}, "path='megakernel' is not a moka._moka.LayerPath"),
    ({"max_tokens": 1.5}, "max_tokens=1.5 is not a int"),
])
def test_a_wrong_keyword_or_type_is_a_type_error_naming_the_field(arguments, message):
    with pytest.raises(TypeError, match=message):
        _moka.LayerOptions(**arguments)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        _moka.MegakernelConfig(16)


def test_a_layer_from_bound_types_computes_the_reference():
    moe = tiny_moe(shared=5)
    shape = _moka.MoeShape(hidden=8, intermediate=6, num_experts=4, top_k=2, shared_intermediate=5)
    layer = _moka.Layer(shape, "cpu", None, _moka.LayerOptions(tile_rows=1, num_threads=2))
    assert (layer.backend, layer.num_local_experts, layer.world_size) == ("cpu", 4, 1)
    x = torch.randn(5, 8, dtype=torch.float64)
    ids, weights = reference.route(x, moe.w_router.detach(), moe.top_k)
    out = torch.empty_like(x)
    expert_weights = [w.detach() for w in (moe.w_gate, moe.w_up, moe.w_down, moe.ws_gate, moe.ws_up, moe.ws_down)]
    layer.forward(x, ids, weights, _moka.Weights(*expert_weights), out, 0)
    torch.testing.assert_close(out, reference.experts(x, ids, weights, *expert_weights), rtol=1e-12, atol=1e-12)


def test_an_unknown_activation_of_the_op_names_the_choices():
    moe = tiny_moe()
    x = torch.randn(3, 8, dtype=torch.float64)
    ids, weights = reference.route(x, moe.w_router.detach(), moe.top_k)
    with pytest.raises(ValueError, match=r"unknown activation 'gelu' \(swiglu, swiglu_clamped\)"):
        moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down, activation="gelu")
