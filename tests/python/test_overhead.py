"""What the Python layer costs per call: the torch ops MoE runs beside moka's own calls (each one
a CUDA launch or an allocation on the GPU, ~20 us per launch from Python on the GPU machines), and
the statistics and gradient sums moka now does inside its calls, against the torch-side versions."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moka.torch
from conftest import tiny_moe
from moka import reference
from moka.torch import MoE, moe_experts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# What a call may ask of torch: outputs and gradients from the caching allocator (no fill), and
# autograd's AccumulateGrad taking the parameters' gradients (a detach each, no copy).
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default"}


class TorchOps(TorchDispatchMode):
    """Counts the aten ops that reach torch's backends, by name."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def moe_on(device, **kwargs):
    """fp64 on the CPU; on the GPU bf16 in a shape its kernels take (as test_gpu.py)."""
    if device == "cpu":
        return tiny_moe(**kwargs)
    torch.manual_seed(0)
    return MoE(256, 512, 8, 2, device="cuda", dtype=torch.bfloat16, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("selection_bias", [False, True])
def test_a_forward_and_backward_run_no_torch_op_but_allocations(device, selection_bias):
    moe = moe_on(device, selection_bias=selection_bias)
    x = torch.randn(16, moe.hidden, dtype=moe.w_gate.dtype, device=device, requires_grad=True)
    moe(x).sum().backward()  # first call: moka's engines and workspaces
    moe.zero_grad()
    x.grad = None
    d_out = torch.randn_like(x)
    with TorchOps() as forward:
        out = moe(x)
    with TorchOps() as backward:
        out.backward(d_out)
    # routing + experts: topk_ids, topk_weights, out; the selection bias is passed as it is.
    assert forward.ops == {"aten.empty.memory_format": 2, "aten.empty_like.default": 1}
    # d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_w_router; one detach per gradient taken.
    assert set(backward.ops) <= ALLOCATIONS | {"aten.detach.default"}, backward.ops
    assert sum(backward.ops.get(op, 0) for op in ALLOCATIONS) == 6, backward.ops
    assert backward.ops.get("aten.detach.default", 0) <= 5  # x and the four weights


@pytest.mark.parametrize("device", DEVICES)
def test_expert_load_equals_the_torch_side_count_of_every_route(device):
    moe = moe_on(device, selection_bias=True)
    moe.expert_load.copy_(torch.arange(moe.experts) + 2**40)  # a running total beyond int32
    want = moe.expert_load.clone()
    for tokens in (5, 16, 1):
        x = torch.randn(tokens, moe.hidden, dtype=moe.w_gate.dtype, device=device)
        ids, _ = moe.route(x)
        moe(x)  # routes x again: the same ids
        want += 2 * torch.bincount(ids.flatten().long(), minlength=moe.experts)
    assert moe.expert_load.dtype == torch.int64
    assert torch.equal(moe.expert_load, want)
    load = moe.update_selection_bias(rate=0.1)
    assert torch.equal(load, want.double()) and not moe.expert_load.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [0, 5])
def test_x_gradient_equals_the_sum_of_the_routers_and_the_experts_parts(dtype, shared):
    moe = tiny_moe(dtype=dtype, shared=shared)
    x = torch.randn(9, 8, dtype=dtype)
    d_out = torch.randn(9, 8, dtype=dtype)
    one_node = x.clone().requires_grad_()
    moe(one_node).backward(d_out)
    two_nodes = x.clone().requires_grad_()  # autograd sums the two parts of x's gradient
    ids, weights = moe.route(two_nodes)
    moe.apply_experts(two_nodes, ids, weights).backward(d_out)
    assert torch.equal(one_node.grad, two_nodes.grad)


class Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrized_weight_is_used_as_its_attribute_gives_it():
    # The layer reads its tensors from nn.Module's dicts; parametrize moves a weight out of them.
    moe, doubled = tiny_moe(), tiny_moe()
    with torch.no_grad():
        doubled.w_up.mul_(2)
    torch.nn.utils.parametrize.register_parametrization(moe, "w_up", Doubled())
    x = torch.randn(6, 8, dtype=torch.float64)
    assert torch.equal(moe(x), doubled(x))


@pytest.mark.parametrize("shared", [0, 5])
def test_an_eager_call_of_moe_experts_skips_the_dispatcher_with_the_ops_results(shared, monkeypatch):
    moe = tiny_moe(shared=shared)
    x = torch.randn(7, 8, dtype=torch.float64)
    ids, weights = reference.route(x, moe.w_router.detach(), moe.top_k)
    weights = weights.requires_grad_()
    d_out = torch.randn_like(x)
    expert_weights = (moe.w_gate, moe.w_up, moe.w_down, moe.ws_gate, moe.ws_up, moe.ws_down)

    def results(call):
        moe.zero_grad()
        weights.grad = None
        out = call()
        out.backward(d_out)
        return [out, weights.grad, *(p.grad for p in expert_weights if p is not None)]

    # The op returns out and moka's saved state for its backward op.
    want = results(lambda: torch.ops.moka.moe_experts(x, ids, weights, *expert_weights, "swiglu", 7.0, "")[0])
    with monkeypatch.context() as patched:
        patched.setattr(moka.torch, "_moe_experts_op", None)  # an eager call must not reach it
        got = results(lambda: moe_experts(x, ids, weights, *expert_weights))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with TorchOps() as mode:  # what a mode (or a compiler, a transform) sees: the op
        moe_experts(x, ids, weights, *expert_weights)
    assert mode.ops == {"moka.moe_experts.default": 1}
