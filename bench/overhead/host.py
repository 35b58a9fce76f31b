"""Host time per call of moka.torch (bench/python_overhead.py, measurements 2 to 4): what the
Python process spends in MoE's calls beside moka's own, one layer alone and as a layer of a stack,
and a profiled step's timeline."""
import queue
import statistics
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

import moka.torch
from moka.torch import (_dl, _empty_like, _experts_backward, _experts_forward, _route_forward, _routes,
                        _selection_bias, _stream, _weights, moe_experts)

from .common import make_layer, make_stack

LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync",
                "cudaMemcpyAsync", "cuMemsetD8Async", "cuMemsetD32Async", "cuMemcpyAsync", "cudaGraphLaunch"}



def fused_call_args(moe, x, d_out, stream):
    """(forward, backward) DLPack arguments of the module's one moka call each way (a layer with
    no shared expert nor selection bias) for input x, with fresh routes, output and gradients."""
    (w_router, _, load), (w_gate, w_up, w_down, *_) = moe._tensors()
    ids, weights = _routes(x, moe.top_k)
    forward_args = (_dl(x), _dl(w_router), None, _dl(load), _dl(w_gate), _dl(w_up), _dl(w_down), None, None, None,
                    _dl(ids), _dl(weights), _dl(torch.empty_like(x)), stream)
    backward_args = (_dl(d_out), _dl(torch.empty_like(x)), _dl(torch.empty_like(weights)),
                     _dl(torch.empty_like(w_router)), *(_dl(torch.empty_like(w)) for w in (w_gate, w_up, w_down)),
                     None, None, None)
    return forward_args, backward_args



def host_us(step, calls, device):
    """Median host microseconds of each phase of `step` (a generator yielding after each phase),
    with the GPU kept busy (a long sleep kernel queued first) so that no launch waits for room in
    the queue or for the device: a host synchronization would show as a phase of ~1 s."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU time at H200 clocks: longer than the calls below
    phases = []
    for _ in range(calls):
        times, start = [], time.perf_counter()
        for _ in step():
            now = time.perf_counter()
            times.append((now - start) * 1e6)
            start = now
        phases.append(times)
    if cuda:
        torch.cuda.synchronize()
    return [statistics.median(column) for column in zip(*phases)]


def _has_ancestor(event, prefix):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def torch_work(step, device):
    """What torch does in each phase of one call of `step`, from the profiler: the top-level aten
    ops by name (those the Python layer or autograd call, not the ones inside another op), the
    autograd nodes run, and on the GPU the launches inside aten ops and in all."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    phases, phase = [], step()
    while True:
        with profile(activities=activities) as prof:
            done = next(phase, StopIteration) is StopIteration
        if done:
            return phases
        events = prof.events()
        ops: dict[str, int] = {}
        for e in events:
            if e.name.startswith("aten::") and not _has_ancestor(e, "aten::"):
                ops[e.name] = ops.get(e.name, 0) + 1
        work = {"torch_ops": dict(sorted(ops.items())),
                "autograd_nodes": sum(e.name.startswith("autograd::engine::evaluate_function") for e in events)}
        if device == "cuda":
            launches = [e for e in events if e.name in LAUNCH_CALLS]
            work["torch_launches"] = sum(_has_ancestor(e, "aten::") for e in launches)
            work["launch_calls"] = len(launches)
            work["device_activities"] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
        phases.append(work)


class NoMoka:
    """Stands in for moka's router, layer and the two as one call, and for what a forward saved:
    calls that do nothing, so that what is timed is the Python layer alone (outputs stay
    unwritten; only times are read)."""

    def forward(self, *args):
        return self

    def backward(self, *args):
        return None


class OtherThread:
    """Runs calls on one other thread, the caller waiting for each: as autograd's engine runs a
    CUDA backward on its device thread while the thread that called backward waits."""

    def __init__(self):
        self.jobs, self.results = queue.SimpleQueue(), queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            self.results.put(self.jobs.get()())

    def run(self, job):
        self.jobs.put(job)
        return self.results.get()


class TwoCalls(torch.autograd.Function):
    """The module's forward before routing and experts became one moka call each way: one autograd
    node calling moka's router, then its layer (backward: the layer, then the router adding its
    part of x's gradient), each with its own DLPack arguments and the expert weights passed again
    to backward. Timed beside ``MoE.forward`` as the "before"."""

    @staticmethod
    def forward(ctx, x, w_router, bias, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, router, layer, top_k, load):
        expert_weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        ctx.router_saved, ids, weights = _route_forward(router, x, w_router, bias, top_k, load)
        ctx.layer_saved, out = _experts_forward(layer, x, ids, weights, expert_weights)
        ctx.router = router
        ctx.layer = layer
        ctx.save_for_backward(x, w_router, ids, weights, *expert_weights)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, w_router, _ids, topk_weights, *weights = ctx.saved_tensors
        d_x, d_topk_weights, d_weights = _experts_backward(ctx.layer, ctx.layer_saved, d_out, x, topk_weights,
                                                           weights)
        d_w_router = torch.empty_like(w_router)
        ctx.router.backward(ctx.router_saved, _dl(d_topk_weights), _dl(d_x), _dl(d_w_router), _stream(x), True)
        return (d_x, d_w_router, None, *d_weights, None, None, None, None)


class NoOp(torch.autograd.Function):
    """An autograd node with the module's tensor inputs that does nothing (an empty output, no
    gradients): what Function.apply and autograd's engine cost any Python layer."""

    @staticmethod
    def forward(ctx, x, *inputs):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, d_out):
        return (None,) * 12


class GradFloor(torch.autograd.Function):
    """An autograd node with the gradients of a layer without a shared expert (x's passed through,
    four weights' allocated and left unwritten) that does nothing else: the per-layer floor of any
    Python autograd layer with these weights."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(*weights)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, d_out):
        return (d_out, *(torch.empty_like(w) for w in ctx.saved_tensors))


def host_overhead(name, tokens, calls, seed, device, allocator="torch"):
    moe, x, ids, weights, d_out = make_layer(name, tokens, seed, device, allocator)
    args = (ids, weights.detach(), moe.w_gate.detach(), moe.w_up.detach(), moe.w_down.detach())
    xs = x.detach()

    def module_step():  # the layer keeps its latest forward's activations: forward, then backward
        moe.zero_grad()  # gradients start at None, as in a training step (untimed phase)
        yield
        out = moe(xs)
        yield
        out.backward(d_out)
        yield

    def forward_step():  # forwards only: no backward (on autograd's device thread on the GPU) between them
        out = moe(xs)
        yield
        del out

    def no_grad_step():  # evaluation: autograd off
        with torch.no_grad():
            moe(xs)
        yield

    def before_step():  # the same with the router and the layer called one after the other
        moe.zero_grad()
        yield
        router, layer, _ = moe._engine(xs)
        (w_router, bias, load), experts = moe._tensors()
        out = TwoCalls.apply(xs, w_router, _selection_bias(bias, xs), *experts, router, layer, moe.top_k, load)
        yield
        out.backward(d_out)
        yield

    def autograd_step():  # an autograd node that does nothing, with the module's inputs
        moe.zero_grad()
        yield
        (w_router, bias, load), experts = moe._tensors()
        out = NoOp.apply(xs, w_router, *experts, bias, load, None, moe.top_k)
        yield
        out.backward(d_out)
        yield

    def op_step():
        moe_experts(xs, *args, allocator=allocator)
        yield

    router, layer, fused = moe._engine(xs)
    stream = _stream(xs)
    routed = (torch.empty_like(ids), torch.empty_like(weights.detach()))
    expert_weights = (*args[2:], None, None, None)
    grads = (torch.empty_like(xs), torch.empty_like(args[1]), *(torch.empty_like(w) for w in args[2:]))
    router_grads = (torch.empty_like(xs), torch.empty_like(moe.w_router))

    def extension_step():  # moka's C++ calls alone, their DLPack arguments made in a phase before
        router_args = (_dl(xs), _dl(moe.w_router), None, *(_dl(t) for t in routed), None, _dl(moe.expert_load),
                       stream)
        layer_args = (_dl(xs), _dl(ids), _dl(args[1]), _weights(*expert_weights), _dl(torch.empty_like(xs)), stream)
        layer_grad_args = (_dl(d_out), _weights(*expert_weights), _dl(grads[0]), _dl(grads[1]),
                           _weights(*grads[2:], None, None, None), stream)
        router_grad_args = (_dl(grads[1]), *(_dl(g) for g in router_grads), stream)
        yield
        router_saved = router.forward(*router_args)
        yield
        layer_saved = layer.forward(*layer_args)
        yield
        layer.backward(layer_saved, *layer_grad_args)
        yield
        router.backward(router_saved, *router_grad_args)
        yield

    def fused_extension_calls(run_backward):  # the module's one call each way alone, arguments made before
        forward_args, backward_args = fused_call_args(moe, xs, d_out, stream)
        yield
        saved = fused.forward(*forward_args)
        yield
        run_backward(lambda: saved.backward(*backward_args))
        yield

    other_thread = OtherThread()

    def fused_extension_step():
        return fused_extension_calls(lambda call: call())

    def fused_extension_threads_step():  # the same with the backward call on another thread
        return fused_extension_calls(other_thread.run)

    before_forward_pieces = ("engine", "tensors", "route_alloc", "route_capsules", "route_call", "out_alloc",
                             "layer_capsules", "layer_call")
    before_backward_pieces = ("grad_alloc", "layer_grad_capsules", "layer_grad_call", "router_grad_capsules",
                              "router_grad_call")

    def before_pieces_step():  # what the two-call forward and backward do, piece by piece
        moe.zero_grad()
        yield
        router, layer, _ = moe._engine(xs)
        yield
        (w_router, bias, load), expert_weights = moe._tensors()
        bias = _selection_bias(bias, xs)
        yield
        ids, weights = _routes(xs, moe.top_k)
        yield
        route_args = (_dl(xs), _dl(w_router), _dl(bias), _dl(ids), _dl(weights), None, _dl(load), _stream(xs))
        yield
        router_saved = router.forward(*route_args)
        yield
        out = torch.empty_like(xs)
        yield
        layer_args = (_dl(xs), _dl(ids), _dl(weights), _weights(*expert_weights), _dl(out), _stream(xs))
        yield
        layer_saved = layer.forward(*layer_args)
        yield
        d_x, d_topk_weights, d_w_router = torch.empty_like(xs), torch.empty_like(weights), torch.empty_like(w_router)
        d_weights = [None if w is None else torch.empty_like(w) for w in expert_weights]
        yield
        layer_grad_args = (_dl(d_out.contiguous()), _weights(*expert_weights), _dl(d_x), _dl(d_topk_weights),
                           _weights(*d_weights), _stream(xs))
        yield
        layer.backward(layer_saved, *layer_grad_args)
        yield
        router_grad_args = (_dl(d_topk_weights.contiguous()), _dl(d_x), _dl(d_w_router), _stream(xs), True)
        yield
        router.backward(router_saved, *router_grad_args)
        yield

    forward_pieces = ("engine", "tensors", "alloc", "capsules", "call")
    backward_pieces = ("grad_alloc", "capsules", "call")

    def pieces_step():  # what MoE's forward and backward do inside autograd, piece by piece
        moe.zero_grad()
        yield
        fused = moe._engine(xs)[2]
        yield
        (w_router, bias, load), (w_gate, w_up, w_down, ws_gate, ws_up, ws_down) = moe._tensors()
        bias = _selection_bias(bias, xs)
        yield
        ids, weights = _routes(xs, moe.top_k)
        out = torch.empty_like(xs)
        yield
        forward_args = (_dl(xs), _dl(w_router), _dl(bias), _dl(load), _dl(w_gate), _dl(w_up), _dl(w_down),
                        _dl(ws_gate), _dl(ws_up), _dl(ws_down), _dl(ids), _dl(weights), _dl(out), _stream(xs))
        yield
        saved = fused.forward(*forward_args)
        yield
        d_x, d_w_router = torch.empty_like(xs), torch.empty_like(w_router)
        d_weights = [_empty_like(w) for w in (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)]
        d_topk_weights = torch.empty_like(weights)
        yield
        backward_args = (_dl(d_out.contiguous()), _dl(d_x), _dl(d_topk_weights), _dl(d_w_router),
                         *(_dl(g) for g in d_weights))
        yield
        saved.backward(*backward_args)
        yield

    for _ in range(3):  # warm: moka's engines and workspaces for this token count
        list(module_step())
        list(before_step())
        list(op_step())
    _, fwd, bwd = host_us(module_step, calls, device)
    (fwd_alone,) = host_us(forward_step, calls, device)
    (fwd_no_grad,) = host_us(no_grad_step, calls, device)
    _, before_fwd, before_bwd = host_us(before_step, calls, device)
    _, floor_fwd, floor_bwd = host_us(autograd_step, calls, device)
    _, *pieces = host_us(pieces_step, calls, device)
    forward_us = dict(zip(forward_pieces, pieces[:len(forward_pieces)]))
    backward_us = dict(zip(backward_pieces, pieces[len(forward_pieces):]))
    _, *pieces = host_us(before_pieces_step, calls, device)
    before_forward_us = dict(zip(before_forward_pieces, pieces[:len(before_forward_pieces)]))
    before_backward_us = dict(zip(before_backward_pieces, pieces[len(before_forward_pieces):]))
    (op,) = host_us(op_step, calls, device)
    _, router_fwd, layer_fwd, layer_bwd, router_bwd = host_us(extension_step, calls, device)
    _, moka_fwd, moka_bwd = host_us(fused_extension_step, calls, device)
    _, threads_fwd, threads_bwd = host_us(fused_extension_threads_step, calls, device)
    # The module with moka's calls keeping the GIL: whether taking it back after autograd's
    # device thread held it is what a forward after a backward pays.
    releasing = moe._engines
    moe._engines = {key: (r, l, moka.torch._moka.Moe(r, l, release_gil=False)) for key, (r, l, _) in releasing.items()}
    _, gil_held_fwd, gil_held_bwd = host_us(module_step, calls, device)
    (gil_held_fwd_alone,) = host_us(forward_step, calls, device)
    moe._engines = releasing
    try:  # the explanation; the times above stand without it
        _, fwd_work, bwd_work = torch_work(module_step, device)
        (op_work,) = torch_work(op_step, device)
    except Exception as e:
        fwd_work = bwd_work = op_work = {"error": repr(e)[:300]}
    # Last, as it replaces this layer's engines: the Python layer alone, moka's calls doing nothing.
    no_moka, op_layers, engines = NoMoka(), dict(moka.torch._op_layers), moe._engines
    moe._engines = {key: (no_moka, no_moka, no_moka) for key in engines}
    moka.torch._op_layers.update((key, no_moka) for key in op_layers)
    _, python_fwd, python_bwd = host_us(module_step, calls, device)
    _, python_before_fwd, python_before_bwd = host_us(before_step, calls, device)
    (python_op,) = host_us(op_step, calls, device)
    moka.torch._op_layers.update(op_layers)
    moe._engines = engines
    return {"measure": "host", "shape": name, "tokens_per_rank": tokens, "calls": calls, "allocator": allocator,
            # MoE's forward and backward: routing through combine as one moka call each way.
            "module_forward_us": fwd, "module_backward_us": bwd,
            # Forwards with no backward between them: a forward's time beside a backward's.
            "module_forward_alone_us": fwd_alone, "module_forward_no_grad_us": fwd_no_grad,
            # The same with moka's calls keeping the GIL (they release it in the module).
            "gil_held_module_forward_us": gil_held_fwd, "gil_held_module_backward_us": gil_held_bwd,
            "gil_held_module_forward_alone_us": gil_held_fwd_alone,
            "extension_forward_us": moka_fwd, "extension_backward_us": moka_bwd,
            # The same calls with each backward on another thread (the forward on this one):
            # whether moka's calls cost more where the thread using the GPU alternates.
            "extension_forward_threads_us": threads_fwd, "extension_backward_threads_us": threads_bwd,
            "python_adds_forward_us": fwd - moka_fwd, "python_adds_backward_us": bwd - moka_bwd,
            # Its own steps timed one by one; what is left of its time is autograd's
            # (Function.apply and the engine: compare autograd_floor_*) and the glue between the steps.
            "module_forward_pieces_us": forward_us, "module_backward_pieces_us": backward_us,
            "module_forward_rest_us": fwd - sum(forward_us.values()),
            "module_backward_rest_us": bwd - sum(backward_us.values()),
            # An autograd node with the same inputs doing nothing: what any Python autograd layer costs.
            "autograd_floor_forward_us": floor_fwd, "autograd_floor_backward_us": floor_bwd,
            # Before: the router's and the layer's calls one after the other in one autograd node.
            "before_module_forward_us": before_fwd, "before_module_backward_us": before_bwd,
            "before_python_adds_forward_us": before_fwd - router_fwd - layer_fwd,
            "before_python_adds_backward_us": before_bwd - layer_bwd - router_bwd,
            "before_module_forward_pieces_us": before_forward_us,
            "before_module_backward_pieces_us": before_backward_us,
            "before_module_forward_rest_us": before_fwd - sum(before_forward_us.values()),
            "before_module_backward_rest_us": before_bwd - sum(before_backward_us.values()),
            "extension_router_forward_us": router_fwd, "extension_layer_forward_us": layer_fwd,
            "extension_layer_backward_us": layer_bwd, "extension_router_backward_us": router_bwd,
            # The functional op's forward (its layer call alone: extension_layer_forward_us).
            "op_forward_us": op, "python_adds_op_forward_us": op - layer_fwd,
            "module_forward_work": fwd_work, "module_backward_work": bwd_work, "op_forward_work": op_work,
            # The same calls with moka's calls doing nothing.
            "python_only_forward_us": python_fwd, "python_only_backward_us": python_bwd,
            "before_python_only_forward_us": python_before_fwd, "before_python_only_backward_us": python_before_bwd,
            "python_only_op_forward_us": python_op}


def _middle_median(samples):
    """The median over samples of each layer's time, the first and the last layer left out."""
    return statistics.median(t for sample in samples for t in sample[1:-1])


def host_per_layer(name, tokens, calls, seed, device, depth, allocator="torch"):
    """Host time per call as one layer of a model sees it: a stack of `depth` MoE layers, forward
    through all and one backward, each layer's forward call timed in turn and each layer's
    backward between the stamps of gradient hooks on the layers' outputs. The median over the
    middle layers is one call's cost; the first and the last layer of each direction also carry
    what a step pays once, whatever its layers (the hand-off of a CUDA backward to autograd's
    device thread and back, a thread's first work after waking). Timed the same ways: moka's
    calls alone (the forwards on this thread, the backwards on one other thread, as autograd
    runs them; DLPack arguments made beforehand), the module with moka's calls made no-ops (its
    Python alone), and an autograd node taking the module's gradients that does nothing else (the
    floor: Function.apply, the engine, four weight gradients allocated and accumulated)."""
    layers, xs, d_out = make_stack(name, tokens, seed, depth, device, allocator)
    stream = _stream(xs)
    other_thread = OtherThread()

    def stamped_step(forward):
        """A step whose forward(h, layer) is timed per layer, and its backward per layer from hooks."""
        def step():
            for m in layers:
                m.zero_grad()
            forward_times, stamps, h = [], [], xs
            for m in layers:
                start = time.perf_counter()
                h_next = forward(h, m)
                forward_times.append(time.perf_counter() - start)
                if h is not xs:
                    h.register_hook(lambda _grad: stamps.append(time.perf_counter()))
                h = h_next
            start = time.perf_counter()
            h.backward(d_out)
            stamps = [start, *stamps, time.perf_counter()]
            return forward_times, [b - a for a, b in zip(stamps, stamps[1:])]
        return step

    def floor_forward(h, m):
        (w_router, _, _), (w_gate, w_up, w_down, *_) = m._tensors()
        return GradFloor.apply(h, w_router, w_gate, w_up, w_down)

    def moka_calls_step():
        calls = [(m._engine(xs)[2], *fused_call_args(m, xs, d_out, stream)) for m in layers]
        forward_times, saved = [], []
        for fused, forward_args, _ in calls:
            start = time.perf_counter()
            saved.append(fused.forward(*forward_args))
            forward_times.append(time.perf_counter() - start)

        def backward():
            stamps = [time.perf_counter()]
            for s, (_, _, backward_args) in zip(reversed(saved), reversed(calls)):
                s.backward(*backward_args)
                stamps.append(time.perf_counter())
            return stamps

        start = time.perf_counter()
        stamps = other_thread.run(backward)
        stamps = [start, *stamps, time.perf_counter()]  # the hand-offs as the first and last layers' parts
        backward_times = [b - a for a, b in zip(stamps, stamps[1:])]
        return forward_times, [backward_times[0] + backward_times[1], *backward_times[2:-2],
                               backward_times[-2] + backward_times[-1]]

    def run(step):
        cuda = device == "cuda"
        samples = []
        for _ in range(calls):
            if cuda:  # an empty queue and a busy GPU: no launch waits
                torch.cuda.synchronize()
                torch.cuda._sleep(int(1e8))
            samples.append(step())
        if cuda:
            torch.cuda.synchronize()
        forward, backward = ([[t * 1e6 for t in sample[i]] for sample in samples] for i in (0, 1))
        return {"forward_per_layer_us": _middle_median(forward), "backward_per_layer_us": _middle_median(backward),
                "first_forward_us": statistics.median(f[0] for f in forward),
                # The backward's first layer is the stack's last: it carries the hand-off to the device thread.
                "first_backward_us": statistics.median(b[0] for b in backward),
                "last_backward_us": statistics.median(b[-1] for b in backward)}

    module_step = stamped_step(lambda h, m: m(h))
    for _ in range(3):  # warm: every layer's engine and workspace
        module_step()
    rows = {"module": run(module_step), "moka_calls": run(moka_calls_step),
            "autograd_floor": run(stamped_step(floor_forward))}
    engines = [m._engines for m in layers]
    no_moka = NoMoka()
    for m in layers:  # last: moka's calls doing nothing
        m._engines = {key: (no_moka, no_moka, no_moka) for key in m._engines}
    rows["python_only"] = run(module_step)
    for m, e in zip(layers, engines):
        m._engines = e
    module, calls_alone = rows["module"], rows["moka_calls"]
    return {"measure": "host_per_layer", "shape": name, "tokens_per_rank": tokens, "calls": calls, "depth": depth,
            "allocator": allocator,
            **rows,
            # The target's figure: what the Python layer adds to one layer's call each way.
            "python_adds_per_layer_forward_us": module["forward_per_layer_us"] - calls_alone["forward_per_layer_us"],
            "python_adds_per_layer_backward_us": module["backward_per_layer_us"] - calls_alone["backward_per_layer_us"]}


def timeline(name, tokens, depth, seed, device, trace_path):
    """One profiled step of a stack of `depth` MoE layers (forward, then backward) after a few
    unprofiled ones: each thread's events in order (torch ops, autograd nodes, CUDA API calls),
    as microseconds from the step's start; the Chrome trace goes to trace_path when given."""
    layers, xs, d_out = make_stack(name, tokens, seed, depth, device)

    def step():
        for m in layers:
            m.zero_grad()
        with torch.profiler.record_function("step.forward"):
            h = xs
            for m in layers:
                h = m(h)
        with torch.profiler.record_function("step.backward"):
            h.backward(d_out)

    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e8))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    start = min(e.time_range.start for e in events)
    threads: dict[int, list] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        threads.setdefault(e.thread, []).append(
            [e.name[:60], round(e.time_range.start - start, 1), round(e.time_range.elapsed_us(), 1)])
    return {"measure": "timeline", "shape": name, "tokens_per_rank": tokens, "depth": depth,
            "threads": {str(t): ev for t, ev in threads.items()}}
