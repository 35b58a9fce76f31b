"""moka's device memory from Python (moka._moka.PythonAllocator, LayerOptions.allocator) and from
torch's caching allocator, moka.torch's default on CUDA: the binding's checks and lifetimes (on the
CPU), and on the GPU torch's statistics, equal results, a backward on another stream, failures."""
import gc
import sys
import weakref

import pytest
import torch

import moka
from conftest import tiny_moe
from moka import _moka
from moka._allocator import TorchMemory, torch_allocator
from moka._autograd import _experts_backward, _experts_forward
from moka._op import _layer_options
from moka.torch import MoE, moe_experts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 512, 8, 2


def never_called(*_arguments):
    raise AssertionError("the CPU backend takes no device memory")


def test_a_python_allocator_takes_two_callables_and_names_what_is_not_one():
    allocator = _moka.PythonAllocator(never_called, print)
    assert (allocator.alloc, allocator.free) == (never_called, print)
    with pytest.raises(TypeError, match="alloc must be callable, got int"):
        _moka.PythonAllocator(1, print)
    with pytest.raises(TypeError, match="free must be callable, got str"):
        _moka.PythonAllocator(never_called, "free")


def test_layer_options_hold_an_allocator_or_none():
    assert _moka.LayerOptions().allocator is None
    options = _moka.LayerOptions(allocator=_moka.PythonAllocator(never_called, print), max_tokens=8)
    assert options.allocator.alloc is never_called and options.max_tokens == 8
    options.allocator = None
    assert options.allocator is None
    message = "LayerOptions.allocator must be a moka._moka.PythonAllocator or None, got function"
    with pytest.raises(TypeError, match=message):
        _moka.LayerOptions(allocator=never_called)
    with pytest.raises(TypeError, match=message):
        options.allocator = never_called


@pytest.mark.parametrize("engine", ["layer", "router"])
def test_a_layer_or_router_keeps_its_allocator_alive(engine):
    def alloc(_nbytes, _stream):
        raise AssertionError("the CPU backend takes no device memory")

    alive = weakref.ref(alloc)
    options = _moka.LayerOptions(allocator=_moka.PythonAllocator(alloc, print), tile_rows=1, num_threads=1)
    if engine == "layer":
        made = _moka.Layer(_moka.MoeShape(hidden=8, intermediate=6, num_experts=4, top_k=2), "cpu", None, options)
    else:
        made = _moka.Router(_moka.RouterConfig(hidden=8, num_experts=4, top_k=2), "cpu", None, options)
    options.allocator = None  # the options no longer hold it: only the layer does
    del alloc, options
    gc.collect()
    assert alive() is not None
    del made
    gc.collect()
    assert alive() is None


def test_cpu_layers_take_no_allocator_and_moka_torch_names_a_wrong_choice():
    assert _layer_options("cpu", None, "torch").allocator is None
    moe = tiny_moe()
    x = torch.randn(5, 8, dtype=torch.float64)
    ids, weights = moe.route(x)
    torch.testing.assert_close(moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down, allocator="moka"),
                               moe.apply_experts(x, ids, weights), rtol=0, atol=0)
    with pytest.raises(ValueError, match="allocator 'cuda' is not one of torch, moka"):
        tiny_moe(allocator="cuda")
    with pytest.raises(TypeError, match="allocator must be a str"):
        tiny_moe(allocator=None)
    with pytest.raises(ValueError, match="allocator 'pool' is not one of torch, moka"):
        moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down, allocator="pool")


def test_a_block_freed_on_another_stream_goes_back_once_its_stream_waits_for_the_last_use(monkeypatch):
    # torch's side stood in for: what TorchMemory asks of it, in order.
    calls = []

    class Stream:
        def __init__(self, handle):
            self.handle = handle

        def wait_event(self, event):
            calls.append(("wait", self.handle, event.recorded_on))

    class Event:
        def record(self, stream):
            self.recorded_on = stream.handle

    def caching_allocator_alloc(nbytes, device, stream):
        calls.append(("alloc", nbytes, device, stream))
        return 4096 * len(calls)

    monkeypatch.setattr("moka._allocator._raw_alloc", None)  # the public function, which takes the device
    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc", caching_allocator_alloc)
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", lambda pointer: calls.append(("delete", pointer)))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: Stream(handle))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device: Stream(0))
    memory = TorchMemory(3)
    same, other = memory.alloc(512, 7), memory.alloc(1024, 0)
    assert memory.live_blocks() == 2
    memory.free(same, 512, 7)
    memory.free(other, 1024, 9)
    assert calls == [("alloc", 512, 3, 7), ("alloc", 1024, 3, 0), ("delete", same), ("wait", 0, 9), ("delete", other)]
    assert memory.live_blocks() == 0


# --- on the GPU ---

def bf16_moe(**kwargs) -> MoE:
    torch.manual_seed(0)
    return MoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, device="cuda", dtype=torch.bfloat16, **kwargs)


def torch_memory() -> TorchMemory:
    """The bookkeeping of moka.torch's allocator on the current device."""
    return torch_allocator(torch.cuda.current_device()).alloc.__self__


def gradients(moe, x, d_out):
    """out and every gradient (x's first) of one forward and backward."""
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    out = moe(leaf)
    out.backward(d_out)
    return [out, leaf.grad] + [p.grad for p in moe.parameters()]


def step_memory(allocator):
    """torch.cuda.memory_allocated() beyond its start value after a forward (its graph alive), at
    the peak of the forward and backward, and once the graph and the gradients are dropped; and the
    blocks moka.torch's allocator holds then beyond those it held at the start."""
    moe = bf16_moe(allocator=allocator)
    x = torch.randn(256, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_out = torch.randn_like(x)
    gradients(moe, x, d_out)  # moka's engines and workspaces for this token count
    moe.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start, blocks = torch.cuda.memory_allocated(), torch_memory().live_blocks()
    torch.cuda.reset_peak_memory_stats()
    out = moe(x)
    after_forward = torch.cuda.memory_allocated() - start
    out.backward(d_out)
    peak = torch.cuda.max_memory_allocated() - start
    del out
    x.grad = None
    moe.zero_grad(set_to_none=True)
    return after_forward, peak, torch.cuda.memory_allocated() - start, torch_memory().live_blocks() - blocks


@pytest.mark.cuda
def test_torch_counts_the_saved_context_until_the_graph_goes():
    torch_forward, torch_peak, torch_end, torch_blocks = step_memory("torch")
    moka_forward, moka_peak, moka_end, moka_blocks = step_memory("moka")
    saved_gate = 256 * TOP_K * INTERMEDIATE * 2  # bytes of one of the saved bf16 products
    assert torch_forward >= moka_forward + saved_gate
    assert torch_peak > moka_peak
    assert torch_end == moka_end == 0
    assert torch_blocks == moka_blocks == 0


@pytest.mark.cuda
def test_results_are_the_same_bits_from_either_allocator():
    x = torch.randn(512, HIDDEN, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn_like(x)
    from_torch = gradients(bf16_moe(allocator="torch"), x, d_out)
    from_moka = gradients(bf16_moe(allocator="moka"), x, d_out)
    for got, want in zip(from_torch, from_moka, strict=True):
        assert torch.equal(got, want)


def cuda_layer(alloc, free) -> _moka.Layer:
    shape = _moka.MoeShape(hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=EXPERTS, top_k=TOP_K)
    return _moka.Layer(shape, "cuda", None, _moka.LayerOptions(allocator=_moka.PythonAllocator(alloc, free)))


def routed(moe, tokens):
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ids, weights = moe.route(x)
    return x, ids, weights, [w.detach() for w in (moe.w_gate, moe.w_up, moe.w_down)] + [None] * 3


@pytest.mark.cuda
def test_a_backward_on_another_stream_keeps_the_saved_context_until_it_has_read_it():
    moe = bf16_moe()
    x, ids, weights, expert_weights = routed(moe, 2048)
    d_out = torch.randn_like(x)
    memory, streams, crossed = TorchMemory(torch.cuda.current_device()), {}, []

    def alloc(nbytes, stream):
        pointer = memory.alloc(nbytes, stream)
        streams[pointer] = stream
        return pointer

    def free(pointer, nbytes, stream):
        if streams.pop(pointer) != stream:
            crossed.append(nbytes)
        memory.free(pointer, nbytes, stream)

    layer = cuda_layer(alloc, free)
    saved, want_out = _experts_forward(layer, x, ids, weights, expert_weights)
    want = _experts_backward(layer, saved, d_out, x, weights, expert_weights, consume=True)
    del saved
    side = torch.cuda.Stream()
    saved, out = _experts_forward(layer, x, ids, weights, expert_weights)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the backward reads the saved context late
        got = _experts_backward(layer, saved, d_out, x, weights, expert_weights, consume=True)
    del saved
    # The blocks the backward gave back, offered again on the forward's stream and overwritten.
    garbage = [torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda") for nbytes in crossed]
    torch.cuda.current_stream().wait_stream(side)
    assert crossed and garbage
    assert torch.equal(out, want_out)
    for g, w in zip([got[0], got[1], *got[2][:3]], [want[0], want[1], *want[2][:3]], strict=True):
        assert torch.equal(g, w)
    torch.cuda.synchronize()
    assert memory.live_blocks() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("failing", ["first", "last"])
def test_an_alloc_that_raises_fails_the_call_with_moka_error(failing):
    moe = bf16_moe()
    x, ids, weights, expert_weights = routed(moe, 256)
    memory, calls, fail_at = TorchMemory(torch.cuda.current_device()), [], []

    def alloc(nbytes, stream):
        calls.append(nbytes)
        if len(calls) in fail_at:
            raise RuntimeError("no memory for you")
        return memory.alloc(nbytes, stream)

    layer = cuda_layer(alloc, memory.free)
    for _ in range(2):  # the second counts the allocations of a forward after the first
        calls.clear()
        _experts_forward(layer, x, ids, weights, expert_weights)
    fail_at.append(1 if failing == "first" else len(calls))
    calls.clear()
    with pytest.raises(moka.Error, match=r"alloc\([0-9]+ bytes\) raised RuntimeError: no memory for you"):
        _experts_forward(layer, x, ids, weights, expert_weights)
    assert memory.live_blocks() == 0  # what the call had taken went back
    _, out = _experts_forward(layer, x, ids, weights, expert_weights)  # the layer still works
    torch.testing.assert_close(out, moe.apply_experts(x, ids, weights), rtol=0, atol=0)


@pytest.mark.cuda
def test_an_alloc_without_memory_is_out_of_memory_and_a_free_that_raises_is_unraisable(monkeypatch):
    moe = bf16_moe()
    x, ids, weights, expert_weights = routed(moe, 256)
    with pytest.raises(moka.Error, match="out of device memory"):
        _experts_forward(cuda_layer(lambda nbytes, stream: 0, never_called), x, ids, weights, expert_weights)
    memory, unraisable = TorchMemory(torch.cuda.current_device()), []
    # The exception's type only: its traceback's frames would keep the saved context alive.
    monkeypatch.setattr(sys, "unraisablehook", lambda hook_args: unraisable.append(type(hook_args.exc_value)))

    def free(pointer, nbytes, stream):
        memory.free(pointer, nbytes, stream)
        raise ValueError("free failed")

    saved, out = _experts_forward(cuda_layer(memory.alloc, free), x, ids, weights, expert_weights)
    del saved
    gc.collect()
    assert unraisable and all(kind is ValueError for kind in unraisable)
    assert memory.live_blocks() == 0
    torch.testing.assert_close(out, moe.apply_experts(x, ids, weights), rtol=0, atol=0)


@pytest.mark.cuda
def test_many_steps_do_not_grow_memory():
    moe = bf16_moe()
    x = torch.randn(1024, HIDDEN, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn_like(x)
    allocated, reserved, blocks = [], [], []
    for _ in range(20):
        gradients(moe, x, d_out)
        moe.zero_grad(set_to_none=True)
        allocated.append(torch.cuda.memory_allocated())
        reserved.append(torch.cuda.memory_reserved())
        blocks.append(torch_memory().live_blocks())
    for measure in (allocated, reserved, blocks):
        assert measure[2:] == [measure[2]] * 18
