"""Bad inputs raise a Python exception that names the problem (and the rank, for moka's own)."""
import pytest
import torch

import moka
from moka import ErrorCode
from conftest import tiny_moe
from moka import reference
from moka.torch import MoE, moe_experts


def routed(tokens=4, dtype=torch.float32):
    moe = tiny_moe(dtype=dtype)
    x = torch.randn(tokens, 8, dtype=dtype)
    ids, weights = reference.route(x, moe.w_router.detach(), moe.top_k)
    return moe, x, ids, weights


def call(moe, x, ids, weights):
    return moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down)


def test_float16_is_a_type_error_naming_the_tensor():
    moe = tiny_moe(dtype=torch.float16)
    with pytest.raises(TypeError, match="x has dtype float16; moka takes bfloat16, float32 or float64"):
        moe(torch.randn(4, 8, dtype=torch.float16))


def test_bfloat16_on_the_cpu_backend_says_which_dtypes_it_computes_in():
    moe = tiny_moe(dtype=torch.bfloat16)
    with pytest.raises(moka.Error, match="rank 0 of 1: .*CPU router computes in f32 or f64") as e:
        moe(torch.randn(4, 8, dtype=torch.bfloat16))
    assert e.value.code == ErrorCode.invalid_argument


def test_expert_id_out_of_range_names_rank_token_and_value():
    moe, x, ids, weights = routed()
    ids[2, 1] = 9
    with pytest.raises(moka.Error, match=r"rank 0 of 1: .*topk_ids\[2, 1\] = 9 is outside \[0, 4\)") as e:
        call(moe, x, ids, weights)
    assert e.value.code == ErrorCode.expert_out_of_range


def test_an_expert_twice_in_a_token_is_refused():
    moe, x, ids, weights = routed()
    ids[1, 1] = ids[1, 0]
    with pytest.raises(moka.Error, match="token 1 selects expert .* twice") as e:
        call(moe, x, ids, weights)
    assert e.value.code == ErrorCode.duplicate_expert


def test_topk_ids_must_be_int32_or_int64():
    moe, x, ids, weights = routed()
    with pytest.raises(TypeError, match="topk_ids has dtype int16"):
        call(moe, x, ids.short(), weights)


def test_int64_topk_ids_give_the_int32_results_and_are_range_checked():
    moe, x, ids, weights = routed()
    assert torch.equal(call(moe, x, ids.long(), weights), call(moe, x, ids, weights))
    assert torch.equal(moe.apply_experts(x, ids.long(), weights), moe.apply_experts(x, ids, weights))
    wrapped = ids.long()
    wrapped[1, 0] = 2**32 + int(ids[1, 1] ^ 1)  # as int32 it would wrap to a valid expert
    with pytest.raises(moka.Error, match="out of range"):
        call(moe, x, wrapped, weights)


@pytest.mark.parametrize("shape", [(2, 3, 16), (4, 4), (8, 7), ()])
def test_an_input_of_the_wrong_width_is_refused_not_reshaped(shape):
    moe = tiny_moe()
    with pytest.raises(ValueError, match=r"hidden=8.*x \[\.\.\., 8\]"):
        moe(torch.randn(shape, dtype=torch.float64))


def test_mismatched_shapes_name_the_tensor():
    moe, x, ids, weights = routed()
    with pytest.raises(moka.Error, match="w_up") as e:
        moe_experts(x, ids, weights, moe.w_gate, moe.w_up[:, :5].contiguous(), moe.w_down)
    assert e.value.code == ErrorCode.shape_mismatch


def test_mixed_dtypes_name_the_tensor():
    moe, x, ids, weights = routed()
    with pytest.raises(moka.Error, match="w_down"):
        moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down.double())


def test_a_non_contiguous_tensor_is_refused_not_copied():
    moe, x, ids, weights = routed()
    with pytest.raises(ValueError, match="w_gate is not contiguous"):
        moe_experts(x, ids, weights, moe.w_gate.transpose(1, 2).contiguous().transpose(1, 2), moe.w_up,
                    moe.w_down)


def test_non_finite_router_logits_are_reported():
    moe = tiny_moe()
    x = torch.randn(4, 8, dtype=torch.float64)
    x[1, 3] = float("nan")
    with pytest.raises(moka.Error, match="not finite") as e:
        moe(x)
    assert e.value.code == ErrorCode.non_finite


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="path 'sideways'"):
        MoE(8, 6, 4, 2, path="sideways")
    with pytest.raises(moka.Error, match="router top_k exceeds num_experts"):
        MoE(8, 6, 4, 5, dtype=torch.float64)(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown score function 'max'"):
        MoE(8, 6, 4, 2, score="max", dtype=torch.float64)(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="without selection_bias"):
        MoE(8, 6, 4, 2).update_selection_bias()
