#!/usr/bin/env python3
"""What the Python layer (moka.torch) adds to moka's C++ layer, on one GPU.

1. Device time, per named shape: ``MoE.apply_experts`` forward + ``backward`` through autograd on
   uniform routing, alternated run by run with the C++ layer's fwd+bwd in a
   ``moka bench --paired-steps`` process on the same shape and token count (the same pairing as
   bench/torch_baseline.py --paired-with). Reported: both medians and the median of the per-run
   ratios python / C++ (target: at most 1.03).
2. Host time per call at a small token count: the wall time the Python process spends in one
   ``MoE`` forward (routing + experts), one backward, and one ``moe_experts`` forward, while the
   GPU is kept busy so that launches never wait on it; and the extension's router and layer
   calls alone, so that what Python adds is the difference (target: at most 40 us per call).
One JSON line per measurement on stdout (and appended to --out).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_baseline import SHAPES, paired_runs  # noqa: E402

from moka.torch import MoE, _dl, _weights, moe_experts  # noqa: E402


def make_layer(name, tokens, seed):
    """A bf16 MoE of the named shape on the GPU, tokens, uniform routing and an output gradient."""
    H, I, E, k, Is, clamped = SHAPES[name]
    torch.manual_seed(seed)
    moe = MoE(H, I, E, k, Is, activation="swiglu_clamped" if clamped else "swiglu", device="cuda",
              dtype=torch.bfloat16, init_std=H**-0.5)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.argsort(torch.rand(tokens, E, device="cuda"), dim=1)[:, :k].to(torch.int32)
    weights = torch.empty(tokens, k, device="cuda").uniform_(0.1, 1.0).requires_grad_()
    d_out = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    return moe, x, ids, weights, d_out


def device_overhead(moka, name, tokens, iters, warmup, seed):
    moe, x, ids, weights, d_out = make_layer(name, tokens, seed)

    def step():  # as in a training step: gradients start at None, so autograd need not add them up
        for t in (x, weights, *moe.parameters()):
            t.grad = None
        moe.apply_experts(x, ids, weights).backward(d_out)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    paired = paired_runs(moka, name, tokens, iters, warmup, seed, step)
    ratios = [p / c for p, c in zip(paired["torch_fwdbwd_ms"], paired["moka_fwdbwd_ms"])]
    return {"measure": "device", "shape": name, "tokens_per_rank": tokens, "runs": iters,
            "python_fwdbwd_ms": paired["torch_median_ms"], "cpp_fwdbwd_ms": paired["moka_median_ms"],
            "python_over_cpp": statistics.median(ratios), "python_runs_ms": paired["torch_fwdbwd_ms"],
            "cpp_runs_ms": paired["moka_fwdbwd_ms"]}


def host_us(step, calls):
    """Median host microseconds of each phase of `step` (a generator yielding after each phase),
    with the GPU kept busy (a long sleep kernel queued first) so that no launch waits for room in
    the queue or for the device: a host synchronization would show as a phase of ~1 s."""
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
    torch.cuda.synchronize()
    return [statistics.median(column) for column in zip(*phases)]


def host_overhead(name, tokens, calls, seed):
    moe, x, ids, weights, d_out = make_layer(name, tokens, seed)
    args = (ids, weights.detach(), moe.w_gate.detach(), moe.w_up.detach(), moe.w_down.detach())
    xs = x.detach()

    def module_step():  # the layer keeps its latest forward's activations: forward, then backward
        out = moe(xs)
        yield
        out.backward(d_out)
        yield

    def op_step():
        moe_experts(xs, *args)
        yield

    router, layer = moe._engine(xs)
    stream = torch.cuda.current_stream().cuda_stream
    counts = torch.empty(moe.experts, dtype=torch.int32, device="cuda")
    routed = (torch.empty_like(ids), torch.empty_like(weights.detach()))
    expert_weights = (*args[2:], None, None, None)
    grads = (torch.empty_like(xs), torch.empty_like(args[1]), *(torch.empty_like(w) for w in args[2:]))
    router_grads = (torch.empty_like(xs), torch.empty_like(moe.w_router))

    def extension_step():  # moka's C++ calls alone, their DLPack arguments made in a phase before
        router_args = (_dl(xs), _dl(moe.w_router), None, *(_dl(t) for t in (*routed, counts)), stream)
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

    for _ in range(3):  # warm: moka's engines and workspaces for this token count
        list(module_step())
        list(op_step())
    fwd, bwd = host_us(module_step, calls)
    (op,) = host_us(op_step, calls)
    _, router_fwd, layer_fwd, layer_bwd, router_bwd = host_us(extension_step, calls)
    return {"measure": "host", "shape": name, "tokens_per_rank": tokens, "calls": calls,
            "module_forward_us": fwd, "module_backward_us": bwd, "op_forward_us": op,
            "extension_router_forward_us": router_fwd, "extension_layer_forward_us": layer_fwd,
            "extension_layer_backward_us": layer_bwd, "extension_router_backward_us": router_bwd,
            "python_adds_forward_us": fwd - router_fwd - layer_fwd,
            "python_adds_backward_us": bwd - layer_bwd - router_bwd, "python_adds_op_forward_us": op - layer_fwd}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moka", required=True, help="the moka binary whose C++ layer is the reference")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=7, help="paired runs per shape")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--host-shape", default="qwen3-30b-a3b")
    p.add_argument("--host-tokens", type=int, default=256)
    p.add_argument("--host-calls", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a GPU")
    device = torch.cuda.get_device_name()

    def emit(row):
        line = json.dumps({**row, "device": device})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")

    for name in a.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape '{name}' (known: {', '.join(SHAPES)})")
    emit(host_overhead(a.host_shape, a.host_tokens, a.host_calls, a.seed))
    for name in a.shapes.split(","):
        torch.cuda.empty_cache()
        try:
            emit(device_overhead(a.moka, name, a.tokens, a.iters, a.warmup, a.seed))
        except Exception as e:  # report and continue: one shape's failure must not hide the rest
            emit({"measure": "device", "shape": name, "tokens_per_rank": a.tokens, "error": repr(e)[:300]})


if __name__ == "__main__":
    main()
