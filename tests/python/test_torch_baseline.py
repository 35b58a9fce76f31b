"""bench/torch_baseline.py's layer stack and memory measurements, on tiny sizes (CPU; on a GPU
where torch sees one)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "torch_baseline.py"
T, H, I, E, K, IS = 16, 8, 4, 4, 2, 4  # tokens, hidden, intermediate, experts, top_k, shared


def load():
    spec = importlib.util.spec_from_file_location("torch_baseline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tb = load()


def stack(depth, device="cpu", dtype=torch.float32, shared=IS, tokens=T, hidden=H, intermediate=I):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    layers = [tb.make_layer(tokens, hidden, intermediate, E, K, shared, 1, device, dtype) for _ in range(depth)]
    d_out = torch.randn(tokens, hidden, device=device, dtype=dtype)
    return x, layers, d_out


@pytest.mark.parametrize("shared", [0, IS])
def test_depth_3_stack_gives_every_layer_gradients(shared):
    x, layers, d_out = stack(3, shared=shared)
    leaves = [x] + [t for layer in layers for t in tb.layer_leaves(layer)]
    assert len({id(t) for t in leaves}) == len(leaves)  # each layer its own weights
    for t in leaves:
        t.grad = torch.ones_like(t)  # stale: stack_peak_memory must clear it first
    peak, grads = tb.stack_peak_memory(x, layers, d_out, clamped=False)
    assert peak is None  # no CUDA tensors
    assert grads == sum(t.numel() * t.element_size() for t in leaves)
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()
    for layer in layers:  # the backward reached every layer's experts
        _, w, w_gu, w_d, _ = layer
        assert w.grad.abs().sum() > 0 and w_gu.grad.abs().sum() > 0 and w_d.grad.abs().sum() > 0
    assert x.grad.abs().sum() > 0


def test_stack_chains_layers_in_order():
    x, layers, _ = stack(3)
    expected = x
    for layer in layers:
        expected = tb.moe(expected, *layer, False)
    torch.testing.assert_close(tb.stack_forward(x, layers, False), expected, rtol=0, atol=0)
    # the first layer's gradient depends on the layers after it
    d_out = torch.randn(T, H)
    grad_alone = torch.autograd.grad(tb.moe(x, *layers[0], False), layers[0][2], d_out)[0]
    grad_in_stack = torch.autograd.grad(tb.stack_forward(x, layers, False), layers[0][2], d_out)[0]
    assert not torch.allclose(grad_alone, grad_in_stack)


def test_depth_1_stack_is_the_single_layer_step():
    x, layers, d_out = stack(1, shared=0)
    (layer,) = layers
    leaves = [x] + tb.layer_leaves(layer)
    single = tb.peak_memory(lambda: tb.moe(x, *layer, True).backward(d_out), leaves)
    single_grads = [t.grad.clone() for t in leaves]
    assert tb.stack_peak_memory(x, layers, d_out, clamped=True) == single
    for t, g in zip(leaves, single_grads):
        torch.testing.assert_close(t.grad, g, rtol=0, atol=0)


def test_memory_functions_are_none_on_cpu():
    x, (layer,), _ = stack(1)
    assert tb.saved_bytes(lambda: tb.moe(x, *layer, False)) is None
    assert tb.max_bytes_over_ranks(None) is None
    assert tb.max_bytes_over_ranks(12.0) == 12


def test_depth_option(capsys):
    assert tb.parser().parse_args([]).depth == 1
    assert tb.parser().parse_args(["--depth", "3"]).depth == 3
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as e:
            tb.parser().parse_args(["--depth", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--depth" in err and "must be at least 1" in err, err


def test_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--help"])
    with pytest.raises(SystemExit) as e:
        tb.main()
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("--depth", "saved_bytes_per_layer", "stack_peak_memory_bytes"):
        assert word in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_memory_of_a_stack():
    x, layers, d_out = stack(2, "cuda", torch.bfloat16, tokens=256, hidden=256, intermediate=128)
    one_peak, one_grads = tb.peak_memory(lambda: tb.moe(x, *layers[0], False).backward(d_out),
                                         [x] + tb.layer_leaves(layers[0]))
    assert tb.stack_peak_memory(x, layers[:1], d_out, False) == (one_peak, one_grads)
    two_peak, two_grads = tb.stack_peak_memory(x, layers, d_out, False)
    # The first layer's saved activations are alive through the second's backward: a deeper peak.
    assert two_peak > one_peak and two_grads == one_grads + sum(t.numel() * t.element_size()
                                                                for t in tb.layer_leaves(layers[1]))
    assert tb.saved_bytes(lambda: tb.moe(x, *layers[0], False)) > 0
