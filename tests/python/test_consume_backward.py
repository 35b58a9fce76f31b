"""A backward that does not retain its graph hands moka's saved state to the layer
(``MoeLayer::consume_backward``: the saved gate and up become its scratch): the same gradients as
one that retains it, and a saved state consumed once is refused by name if used again."""
import pytest
import torch

from conftest import tiny_moe
from moka import _moka, reference
from moka._autograd import _last_backward


class _Probe(torch.autograd.Function):
    """Records, in its backward, what moka would decide there."""
    seen = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, d):
        _Probe.seen.append(_last_backward())
        return d


def test_the_engine_says_whether_a_backward_is_the_last_through_its_graph():
    _Probe.seen.clear()
    x = torch.randn(3, requires_grad=True)
    _Probe.apply(x).sum().backward(retain_graph=True)
    _Probe.apply(x).sum().backward()
    assert _Probe.seen == [False, True]


def test_gradients_are_the_same_whether_the_graph_is_retained_or_not():
    moe = tiny_moe(shared=5)
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)

    def gradients(retain):
        for p in (x, *moe.parameters()):
            p.grad = None
        moe(x).square().sum().backward(retain_graph=retain)
        return [p.grad.clone() for p in (x, *moe.parameters()) if p.grad is not None]

    for kept, consumed in zip(gradients(True), gradients(False)):
        torch.testing.assert_close(consumed, kept, rtol=0, atol=0)


def test_a_consumed_saved_state_is_refused_by_name():
    moe = tiny_moe()
    layer = _moka.Layer(_moka.MoeShape(hidden=8, intermediate=6, num_experts=4, top_k=2), "cpu", None,
                        _moka.LayerOptions(tile_rows=1, num_threads=1))
    x = torch.randn(5, 8, dtype=torch.float64)
    ids, weights = reference.route(x, moe.w_router.detach(), moe.top_k)
    expert_weights = [w.detach() for w in (moe.w_gate, moe.w_up, moe.w_down)] + [None] * 3
    out, d_x, d_w = torch.empty_like(x), torch.empty_like(x), torch.empty_like(weights)
    saved = layer.forward(x, ids, weights, _moka.Weights(*expert_weights), out, 0)
    grads = _moka.Weights(*[torch.empty_like(w) for w in expert_weights[:3]], None, None, None)
    layer.backward(saved, torch.ones_like(x), _moka.Weights(*expert_weights), d_x, d_w, grads, 0, consume=True)
    with pytest.raises(Exception, match="saved state went to its first backward"):
        layer.backward(saved, torch.ones_like(x), _moka.Weights(*expert_weights), d_x, d_w, grads, 0)
