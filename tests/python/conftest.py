"""Shared helpers of the moka Python tests (CPU backend unless marked cuda)."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moka._op
from moka.torch import MoE


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a GPU and moka built with CUDA (skipped otherwise)")


def pytest_collection_modifyitems(config, items):
    import moka
    skip = pytest.mark.skip(reason="no GPU, or moka built without CUDA")
    for item in items:
        if "cuda" in item.keywords and not moka.cuda_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: the tests compile MoE.forward for many modules, dtypes and
    devices, more than dynamo's recompile limit for one code object in one process."""
    torch._dynamo.reset()
    yield


def tiny_moe(dtype=torch.float64, shared=0, **kwargs) -> MoE:
    """H=8, I=6, E=4, k=2: small enough for gradcheck."""
    torch.manual_seed(0)
    return MoE(8, 6, 4, 2, shared, dtype=dtype, **kwargs)


def reference_of(moe: MoE) -> MoE:
    """The pure-PyTorch block with moe's arguments and weights."""
    from moka.reference import TorchMoE
    ref = TorchMoE(moe.hidden, moe.intermediate, moe.experts, moe.top_k, moe.shared_intermediate,
                   score=moe.score, renormalize=moe.renormalize, route_scale=moe.route_scale,
                   selection_bias=moe.selection_bias is not None, activation=moe.activation,
                   clamp_limit=moe.clamp_limit, dtype=moe.w_gate.dtype, device=moe.w_gate.device)
    ref.load_state_dict(moe.state_dict())
    return ref


def run_ep_worker(*args: str) -> str:
    """Runs ep_worker.py on two ranks under torchrun on 127.0.0.1; returns its output (asserts rc 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOKA_COMM_TIMEOUT_S": "30"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), str(Path(__file__).with_name("ep_worker.py")), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    return log


class MokaCalls:
    """Counts moka's forward and backward calls behind the ops (the module's and moe_experts')."""

    def __init__(self, monkeypatch):
        self.forwards = self.backwards = 0
        for name in ("_moe_forward", "_experts_forward"):
            monkeypatch.setattr(moka._op, name, self._counting(getattr(moka._op, name), "forwards"))
        for name in ("_moe_backward", "_experts_backward"):
            monkeypatch.setattr(moka._op, name, self._counting(getattr(moka._op, name), "backwards"))

    def _counting(self, call, counter):
        def counted(*args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            return call(*args, **kwargs)
        return counted


def module_results(module, moe, x, return_aux=False):
    """out (and the aux outputs), x's and every parameter's gradient, and the routes counted in
    expert_load, of one forward and backward of module (moe or a compiled moe)."""
    moe.zero_grad()
    moe.expert_load.zero_()
    x = x.detach().clone().requires_grad_()
    if return_aux:
        out, aux = module(x, return_aux=True)
        (out.square().sum() + aux.load_balancing_loss + aux.z_loss).backward()
    else:
        out, aux = module(x), ()
        out.square().sum().backward()
    return [out, *aux, x.grad, *(p.grad for p in moe.parameters()), moe.expert_load.clone()]


def assert_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
