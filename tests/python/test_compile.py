"""torch.compile(fullgraph=True) traces a model that uses moka's op, forward and backward."""
import torch
from torch import nn

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
