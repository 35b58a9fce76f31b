"""torch.compile(fullgraph=True) traces a model that uses moka's op, and moka's MoE module, forward
and backward, and torch.export exports the module: one moka call each way, the eager results."""
import io

import pytest
import torch
from torch import nn

import moka._op
from conftest import MokaCalls, assert_equal, module_results, tiny_moe
from moka import reference
from moka.torch import moe_experts


class RoutedBlock(nn.Module):
    """A block that routes itself (softmax top-2) and runs the experts through moka's op."""

    def __init__(self, hidden=8, intermediate=6, experts=4, top_k=2, shared=5):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.LayerNorm(hidden, dtype=torch.float64)
        self.router = nn.Linear(hidden, experts, bias=False, dtype=torch.float64)
        init = lambda *shape: nn.Parameter(torch.randn(*shape, dtype=torch.float64) * 0.3)  # noqa: E731
        self.w_gate, self.w_up = init(experts, intermediate, hidden), init(experts, intermediate, hidden)
        self.w_down = init(experts, hidden, intermediate)
        self.ws_gate, self.ws_up, self.ws_down = init(shared, hidden), init(shared, hidden), init(hidden, shared)

    def forward(self, x, experts=moe_experts):
        h = self.norm(x)
        scores = torch.softmax(self.router(h), dim=-1)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        return x + experts(h, ids.int(), weights, self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up,
                           self.ws_down)


def test_torch_compile_fullgraph_traces_the_op_forward_and_backward():
    torch.manual_seed(0)
    block = RoutedBlock()
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    got = [x.grad] + [p.grad for p in block.parameters()]

    x.grad = None
    block.zero_grad()
    want_out = block(x, experts=reference.experts)
    want_out.square().sum().backward()
    want = [x.grad] + [p.grad for p in block.parameters()]
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_opcheck_of_the_op():
    torch.manual_seed(1)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(6)]).int()
    weights = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    w = [torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True),
         torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True),
         torch.randn(4, 8, 6, dtype=torch.float64, requires_grad=True)]
    args = (x, ids, weights, *w, None, None, None, "swiglu", 7.0, "")
    torch.library.opcheck(torch.ops.moka.moe_experts.default, args)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_the_compiled_module_computes_the_eager_results_bit_for_bit_with_one_moka_call_each_way(backend, monkeypatch):
    moe = tiny_moe(shared=5, selection_bias=True)
    x = torch.randn(2, 6, 8, dtype=torch.float64)  # [B, S, H]
    want = module_results(moe, moe, x)
    calls = MokaCalls(monkeypatch)
    got = module_results(torch.compile(moe, fullgraph=True, backend=backend), moe, x)
    assert_equal(got, want)
    assert (calls.forwards, calls.backwards) == (1, 1)  # the backward reuses the forward's state


def test_the_compiled_module_returns_the_aux_outputs_and_takes_other_token_counts():
    moe = tiny_moe(score="sigmoid", renormalize=True)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    for tokens in (5, 9, 12):  # the second count recompiles for any count
        x = torch.randn(tokens, 8, dtype=torch.float64)
        assert_equal(module_results(compiled, moe, x, return_aux=True), module_results(moe, moe, x, return_aux=True))


def test_the_compiled_ops_backward_reuses_the_forwards_state(monkeypatch):
    block = RoutedBlock()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    calls = MokaCalls(monkeypatch)
    compiled(x).square().sum().backward()
    assert (calls.forwards, calls.backwards) == (1, 1)


def test_the_exported_module_computes_the_eager_forward_and_survives_save_and_load():
    moe = tiny_moe(shared=5, selection_bias=True)
    program = torch.export.export(moe, (torch.randn(2, 6, 8, dtype=torch.float64),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    x = torch.randn(3, 6, 8, dtype=torch.float64)  # another batch than the one exported with
    want = moe(x)
    routes = moe.expert_load.clone()
    for exported in (program, program.run_decompositions(), torch.export.load(buffer)):
        module = exported.module()
        load_before = module.expert_load.clone()  # (an exported program shares the module's tensors)
        assert torch.equal(module(x), want)
        assert torch.equal(module.expert_load - load_before, routes)  # the routes are counted as in eager


def test_the_saved_state_lives_until_the_backward_and_no_longer():
    moe = tiny_moe()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    live = len(moka._op._saved_states)  # other tests' graphs may still hold some
    out = compiled(x)
    assert len(moka._op._saved_states) == live + 1
    out.sum().backward()
    del out
    assert len(moka._op._saved_states) == live
    with torch.no_grad():
        compiled(x)
    assert len(moka._op._saved_states) == live


# moka's error where autograd runs the op's backward (at the second backward); AOTAutograd's
# compiled backward refuses create_graph itself, in words that depend on what it compiled.
@pytest.mark.parametrize("backend, error", [("eager", "no double backward"), ("aot_eager", None)])
def test_double_backward_through_the_compiled_module_raises(backend, error):
    moe = tiny_moe()
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    out = torch.compile(moe, fullgraph=True, backend=backend)(x)
    with pytest.raises(RuntimeError, match=error):
        first, = torch.autograd.grad(out.sum(), x, create_graph=True)
        first.square().sum().backward()


@pytest.mark.parametrize("shared", [0, 5])
def test_opcheck_of_the_modules_op(shared):
    moe = tiny_moe(shared=shared, selection_bias=bool(shared))
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    args = (x, *(getattr(moe, name) for name in ("w_router", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                                                  "ws_down", "selection_bias")), *moe._op_options())
    torch.library.opcheck(torch.ops.moka.moe.default, args)
