"""moka.torch as a model uses it (bench/python_overhead.py, measurements 5 and 6): a stack of MoE
layers against depth times one layer (and times the C++ layer's fwd+bwd, with --moka), and a
block (attention + MoE) trained with torch.compile(fullgraph=True) against the same block eager,
with the compiled op path's fwd+bwd against the module's.

Times are CUDA events on the GPU and the wall clock on the CPU (where they only show that the
measurement runs). Steps that are compared run alternately, the order rotating round by round,
and every ratio is the median of the per-round ratios: two runs made moments apart share the
clocks and temperature of that moment."""
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from torch_baseline import paired_runs, run_times

from moka.torch import MoE, moe_experts

from .common import HOST_SHAPES, make_layer, make_stack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from train_tiny_moe import Block  # noqa: E402  (the example's block: attention, then moka's MoE)


def step_ms(step, device: str) -> float:
    """Milliseconds of one run of ``step``: CUDA events on the GPU, the wall clock on the CPU."""
    if device == "cuda":
        return run_times(step, 0, 1)[0]
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def queued_ms(step, device: str, steps: int = 8) -> float:
    """Milliseconds per run of ``steps`` runs of ``step`` queued back to back, as a training loop
    runs them (no synchronization between: the host's time before a run's first launch overlaps
    the previous run's GPU work instead of adding to it); the wall clock on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    start_s = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start_s) * 1e3 / steps


def alternated_ms(steps: dict, iters: int, warmup: int, device: str, timer=step_ms) -> dict[str, list[float]]:
    """Each step's milliseconds in ``iters`` rounds after ``warmup`` untimed ones; a round runs
    every step once, starting one step later than the round before, so that no step always runs
    right after the same other one.

    Args:
        steps (dict[str, Callable[[], None]]): the steps by name.
        iters (int): timed rounds.
        warmup (int): untimed rounds first.
        device (str): "cuda" or "cpu".
        timer (Callable): ``step_ms`` (one run from an idle GPU) or ``queued_ms``.
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(iters):
        first = round_index % len(names)
        for name in names[first:] + names[:first]:
            times[name].append(timer(steps[name], device))
    return times


def median_ratio(times: dict[str, list[float]], numerator: str, denominator: str, scale: float = 1.0) -> float:
    """The median over rounds of numerator / (scale * denominator)."""
    return statistics.median(a / (scale * b) for a, b in zip(times[numerator], times[denominator]))


def timed_pair(times: dict[str, list[float]], first: str, second: str, prefix: str = "", what: str = "fwdbwd") -> dict:
    """The JSON fields of two alternated steps: each one's median and runs, and their ratio."""
    return {f"{prefix}{first}_{what}_ms": statistics.median(times[first]),
            f"{prefix}{second}_{what}_ms": statistics.median(times[second]),
            f"{prefix}{second}_over_{first}": median_ratio(times, second, first),
            f"{prefix}{first}_runs_ms": times[first], f"{prefix}{second}_runs_ms": times[second]}


def stack(name: str, tokens: int, depth: int, iters: int, warmup: int, seed: int, device: str, moka: str = "") -> dict:
    """A stack of ``depth`` MoE layers of the named shape as a model runs it (x, which requires
    grad, into the first layer, each layer's output into the next, all the forwards, then one
    backward from the last output) against the stack's first layer alone on the same x, depth
    times (``stack_over_depth_layers``), and with ``moka`` (the kernel lab's paired_steps
    executable, GPU only) against depth times its fwd+bwd of the shape and token count, paired run by run
    (``stack_over_depth_cpp``; target: at most 1.05). In the stack each layer routes the previous
    layer's output: ``routes_max_over_mean`` is each layer's busiest expert's routes over the mean,
    from one more step, to tell a routing that got skewed from a slower call."""
    layers, x, d_out = make_stack(name, tokens, seed, depth, device)
    x.requires_grad_()  # as a model's activations: x's gradient is computed too

    def stack_step():
        for m in layers:
            m.zero_grad()
        x.grad = None
        h = x
        for m in layers:
            h = m(h)
        h.backward(d_out)

    def layer_step():
        layers[0].zero_grad()
        x.grad = None
        layers[0](x).backward(d_out)

    times = alternated_ms({"stack": stack_step, "layer": layer_step}, iters, warmup, device)
    for m in layers:
        m.expert_load.zero_()
    stack_step()
    loads = [m.expert_load.double() for m in layers]
    row = {"measure": "stack", "shape": name, "tokens_per_rank": tokens, "depth": depth, "runs": iters,
           "stack_fwdbwd_ms": statistics.median(times["stack"]), "layer_fwdbwd_ms": statistics.median(times["layer"]),
           "stack_over_depth_layers": median_ratio(times, "stack", "layer", depth),
           "routes_max_over_mean": [(load.max() / load.mean()).item() for load in loads],
           "stack_runs_ms": times["stack"], "layer_runs_ms": times["layer"]}
    if moka:
        paired = paired_runs(moka, name, tokens, iters, warmup, seed, stack_step)
        row.update(cpp_fwdbwd_ms=paired["moka_median_ms"], stack_over_depth_cpp=paired["median_ratio"] / depth,
                   cpp_runs_ms=paired["moka_fwdbwd_ms"], paired_stack_runs_ms=paired["torch_fwdbwd_ms"])
    return row


def compiled_op(name: str, tokens: int, iters: int, warmup: int, seed: int, device: str, backend: str) -> dict:
    """fwd+bwd of MoE compiled (``torch.compile(moe, fullgraph=True)``, which traces moka's
    ``moka::moe`` op and its backward op) against the module eager on the same x and weights
    (``compiled_over_eager``; target: at most 1.03), and the same for the experts alone
    (``moe_experts``, op ``moka::moe_experts``) on uniform routing (``experts_compiled_over_eager``).
    Each step alone from an idle GPU (the host's time before the first launch counts: compiled
    code's guards and wrappers), and with ``queued_`` steps back to back as a training loop runs
    them (that time overlaps the previous step's GPU work)."""
    moe, x, ids, weights, d_out = make_layer(name, tokens, seed, device)
    expert_weights = (moe.w_gate, moe.w_up, moe.w_down, moe.ws_gate, moe.ws_up, moe.ws_down)
    compiled_moe = torch.compile(moe, fullgraph=True, backend=backend)
    compiled_experts = torch.compile(moe_experts, fullgraph=True, backend=backend)

    def fwdbwd(call):
        def step():
            moe.zero_grad()
            x.grad = weights.grad = None
            call().backward(d_out)
        return step

    module_steps = {"eager": fwdbwd(lambda: moe(x)), "compiled": fwdbwd(lambda: compiled_moe(x))}
    experts_steps = {"eager": fwdbwd(lambda: moe_experts(x, ids, weights, *expert_weights)),
                     "compiled": fwdbwd(lambda: compiled_experts(x, ids, weights, *expert_weights))}
    fields = {}
    for prefix, timer in (("", step_ms), ("queued_", queued_ms)):
        fields.update(timed_pair(alternated_ms(module_steps, iters, warmup, device, timer), "eager", "compiled",
                                 prefix=prefix))
        fields.update(timed_pair(alternated_ms(experts_steps, iters, warmup, device, timer), "eager", "compiled",
                                 prefix=prefix + "experts_"))
    return {"measure": "compile_op", "shape": name, "tokens_per_rank": tokens, "backend": backend, "runs": iters,
            **fields}


def compiled_block(name: str, tokens: int, seq: int, iters: int, warmup: int, seed: int, device: str,
                   backend: str) -> dict:
    """Training steps (zero_grad, forward, backward, AdamW step) of one block of
    examples/train_tiny_moe.py (causal attention with heads 128 wide, or 64 where H is no multiple
    of 128, then moka's MoE of the named
    shape, SwiGLU) on [tokens // seq, seq, H] inputs: the block compiled with
    ``torch.compile(fullgraph=True)`` against the same block eager, the two alternating on one
    model and optimizer (``compiled_over_eager``; target: at most 1). ``compile_s`` is the first
    compiled call's wall time, ``first_output_max_abs_diff`` how far its output is from eager's."""
    hidden, intermediate, experts, top_k, shared, _clamped = HOST_SHAPES[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    head_dim = next(width for width in (128, 64, 32, 16, 8, hidden) if hidden % width == 0)  # gpt-oss: 2880 = 45 x 64
    sizes = SimpleNamespace(dim=hidden, heads=hidden // head_dim, intermediate=intermediate, experts=experts,
                            top_k=top_k, shared=shared)
    block = Block(sizes, None, MoE, {"device": device, "dtype": dtype})
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-5)
    batch = max(1, tokens // seq)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    d_out = torch.randn_like(x)

    start = time.perf_counter()
    compiled_out = compiled(x)
    if device == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    difference = (compiled_out.detach().float() - block(x).detach().float()).abs().max().item()

    def train_step(model):
        def step():
            optimizer.zero_grad(set_to_none=True)
            model(x).backward(d_out)
            optimizer.step()
        return step

    times = alternated_ms({"eager": train_step(block), "compiled": train_step(compiled)}, iters, warmup, device)
    return {"measure": "compile_block", "shape": name, "tokens_per_rank": batch * seq, "seq": seq,
            "heads": sizes.heads, "backend": backend, "runs": iters,
            **timed_pair(times, "eager", "compiled", what="step"), "compile_s": compile_s,
            "first_output_max_abs_diff": difference}



def kernel_profile(step) -> dict:
    """Every CUDA kernel of one run of ``step`` (after one untimed run): their count, busy and
    first-to-last microseconds, the longest idle gaps between two kernels and the kernels by total
    time (names cut to 90 characters)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:60], b.name[:60])
                   for a, b in zip(events, events[1:])), reverse=True)[:6]
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    return {"kernels": len(events), "busy_us": sum(e.time_range.elapsed_us() for e in events),
            "span_us": events[-1].time_range.end - events[0].time_range.start if events else 0,
            "gaps_us": [[round(g, 1), a, b] for g, a, b in gaps],
            "by_kernel_us": [[name, n, round(us, 1)] for name, (n, us) in
                             sorted(by_name.items(), key=lambda item: -item[1][1])[:25]]}


def module_parts(name: str, tokens: int, iters: int, warmup: int, seed: int, device: str, moka: str = "") -> list:
    """Where a module's fwd+bwd goes beyond the C++ layer's: the module (routing + experts)
    against ``apply_experts`` on uniform routes and on the module's own routes, and the routing
    alone (``route`` and its backward), alternated; with ``moka`` (GPU) the module paired with
    paired_steps' fwd+bwd; on the GPU one profiled step of the module and of the experts alone
    (``kernel_profile``)."""
    moe, x, ids, weights, d_out = make_layer(name, tokens, seed, device)
    with torch.no_grad():
        routed_ids, routed_weights = moe.route(x.detach())
    routed_weights.requires_grad_()

    def module_step():
        moe.zero_grad()
        x.grad = None
        moe(x).backward(d_out)

    def experts_step(topk_ids, topk_weights):
        def step():
            moe.zero_grad()
            x.grad = topk_weights.grad = None
            moe.apply_experts(x, topk_ids, topk_weights).backward(d_out)
        return step

    def route_step():
        moe.zero_grad()
        x.grad = None
        moe.route(x)[1].sum().backward()

    steps = {"module": module_step, "experts_uniform": experts_step(ids, weights),
             "experts_routed": experts_step(routed_ids, routed_weights), "route": route_step}
    times = alternated_ms(steps, iters, warmup, device)
    share = tokens * moe.top_k / moe.experts
    row = {"measure": "parts", "shape": name, "tokens_per_rank": tokens, "runs": iters,
           **{f"{step}_fwdbwd_ms": statistics.median(t) for step, t in times.items()},
           "module_over_experts": median_ratio(times, "module", "experts_uniform"),
           "routed_max_over_mean": (torch.bincount(routed_ids.flatten().long(), minlength=moe.experts).max()
                                    / share).item(),
           "uniform_max_over_mean": (torch.bincount(ids.flatten().long(), minlength=moe.experts).max() / share).item()}
    if moka:
        paired = paired_runs(moka, name, tokens, iters, warmup, seed, module_step)
        row.update(cpp_fwdbwd_ms=paired["moka_median_ms"], module_over_cpp=paired["median_ratio"])
    rows = [row]
    if device == "cuda":
        rows += [{"measure": "parts_profile", "shape": name, "tokens_per_rank": tokens, "step": step,
                  **kernel_profile(steps[step])} for step in ("module", "experts_uniform")]
    return rows
