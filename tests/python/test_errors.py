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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_dtype_the_cpu_does_not_compute_in_is_a_type_error_naming_the_cpus_dtypes(dtype):
    name = str(dtype).replace("torch.", "")
    moe = tiny_moe(dtype=dtype)
    x = torch.randn(4, 8, dtype=dtype)
    match = f"x has dtype {name}; the CPU backend computes in float32 or float64"
    with pytest.raises(TypeError, match=match):
        moe(x)
    with pytest.raises(TypeError, match=match):
        moe.route(x)
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    weights = torch.full((4, 2), 0.5)
    with pytest.raises(TypeError, match=match):
        moe.apply_experts(x, ids, weights)
    with pytest.raises(TypeError, match=match):
        moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down)


def test_the_module_dtype_reaches_moka_and_is_named_when_x_differs():
    moe = tiny_moe(dtype=torch.float64)
    with pytest.raises(moka.Error, match="rank 0 of 1: "):
        moe(torch.randn(4, 8, dtype=torch.float32))


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
    with pytest.raises(ValueError, match="without selection_bias"):
        MoE(8, 6, 4, 2).update_selection_bias()


@pytest.mark.parametrize("args, kwargs, match", [
    ((8, 6, 4, 5), {}, "top_k = 5 exceeds experts = 4"),
    ((8, 6, 4, 0), {}, "top_k must be >= 1, got 0"),
    ((0, 6, 4, 2), {}, "hidden must be >= 1, got 0"),
    ((8, -1, 4, 2), {}, "intermediate must be >= 1, got -1"),
    ((8, 6, 0, 1), {}, "experts must be >= 1, got 0"),
    ((8, 6, 4, 2, -3), {}, "shared_intermediate must be >= 0, got -3"),
    ((8, 6, 4, 2), {"score": "max"}, "score 'max' is not one of softmax, sigmoid"),
    ((8, 6, 4, 2), {"activation": "gelu"}, "activation 'gelu' is not one of swiglu, swiglu_clamped"),
    ((8, 6, 4, 2), {"clamp_limit": 0.0}, "clamp_limit must be a positive finite number, got 0.0"),
    ((8, 6, 4, 2), {"clamp_limit": float("inf")}, "clamp_limit must be a positive finite number"),
    ((8, 6, 4, 2), {"max_tokens": -1}, "max_tokens must be >= 0"),
])
def test_bad_shape_arguments_are_value_errors_in_the_constructor(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoE(*args, dtype=torch.float64, **kwargs)


@pytest.mark.parametrize("args, kwargs, match", [
    ((8.0, 6, 4, 2), {}, "hidden must be an int, got float 8.0"),
    ((8, 6, "4", 2), {}, "experts must be an int, got str '4'"),
    ((8, 6, 4, True), {}, "top_k must be an int, got bool True"),
    ((8, 6, 4, 2), {"score": None}, "score must be a str, got NoneType"),
    ((8, 6, 4, 2), {"path": 1}, "path must be a str"),
    ((8, 6, 4, 2), {"clamp_limit": "7"}, "clamp_limit must be a float"),
])
def test_arguments_of_the_wrong_type_are_type_errors_in_the_constructor(args, kwargs, match):
    with pytest.raises(TypeError, match=match):
        MoE(*args, dtype=torch.float64, **kwargs)


def test_integer_like_shape_arguments_are_taken():
    moe = MoE(torch.tensor(8), 6, 4, 2, dtype=torch.float64)
    assert type(moe.hidden) is int and moe.hidden == 8
    moe(torch.randn(3, 8, dtype=torch.float64))


def test_experts_that_do_not_split_over_the_group_are_refused_in_the_constructor(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3 ranks"):
        MoE(8, 6, 4, 2, group=object())


def test_group_and_path_are_keyword_only():
    with pytest.raises(TypeError):
        MoE(8, 6, 4, 2, 0, None)
    with pytest.raises(TypeError):
        MoE(8, 6, 4, 2, 0, None, "automatic")
    assert MoE(8, 6, 4, 2, 0, group=None, path="automatic").path == "automatic"


def test_a_second_backward_through_one_call_gives_the_same_gradients():
    # moka's saved state stays with the autograd node outside CUDA graph capture (retain_graph).
    moe = tiny_moe(dtype=torch.float32)
    x = torch.randn(5, 8, requires_grad=True)
    out = moe(x)
    first = torch.autograd.grad(out.sum(), [x, moe.w_gate], retain_graph=True)
    second = torch.autograd.grad(out.sum(), [x, moe.w_gate])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_double_backward_raises_instead_of_dropping_the_second_order_term():
    moe, x, ids, weights = routed(dtype=torch.float64)
    x.requires_grad_()
    plain, = torch.autograd.grad(moe(x).sum(), x)
    for out in (moe(x), call(moe, x, ids, weights)):
        first, = torch.autograd.grad(out.sum(), x, create_graph=True)
        if out.grad_fn.name().startswith("_MoE"):
            assert torch.equal(first.detach(), plain)  # the first-order gradient is still right
        with pytest.raises(RuntimeError, match="no double backward"):
            first.pow(2).sum().backward()


def test_torch_func_transforms_raise_a_clear_error_or_run():
    moe, x, ids, weights = routed(dtype=torch.float64)
    with pytest.raises(RuntimeError, match="MoE does not run under torch.func"):
        torch.func.grad(lambda t: moe(t).sum())(x)
    with pytest.raises(RuntimeError, match="MoE does not run under torch.func"):
        torch.func.vmap(lambda r: moe(r.unsqueeze(0)).squeeze(0))(x)
    experts = [w.detach() for w in (moe.w_gate, moe.w_up, moe.w_down)]
    with pytest.raises(RuntimeError, match="use torch.autograd"):
        torch.func.grad(lambda t: moe_experts(t, ids, weights, *experts).sum())(x)
    # vmap of the op runs it row by row: the rows of one batched call.
    rows = torch.func.vmap(lambda r, i, w: moe_experts(r[None], i[None], w[None], *experts)[0])(x, ids, weights)
    assert torch.allclose(rows, moe_experts(x, ids, weights, *experts))
