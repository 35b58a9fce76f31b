#!/usr/bin/env python3
"""What the Python layer (moka.torch) adds to moka's C++ layer, on one GPU.

1. Device time, per named shape: ``MoE.apply_experts`` forward + ``backward`` through autograd on
   uniform routing, alternated run by run with the C++ layer's fwd+bwd in a
   ``moka bench --paired-steps`` process on the same shape and token count (the same pairing as
   bench/torch_baseline.py --paired-with). Reported: both medians and the median of the per-run
   ratios python / C++ (target: at most 1.03).
2. Host time per call at a small token count: the wall time the Python process spends in one
   ``MoE`` forward (routing + experts), one backward (gradients starting at None, as after a
   training step's zero_grad), and one ``moe_experts`` forward, while the GPU is kept busy so
   that launches never wait on it; and the extension's calls alone (the module's one call each
   way, and the router's and layer's calls), so that what Python adds is the difference (target:
   at most 40 us per call; the module's call alone also with each backward on another thread,
   as autograd runs a CUDA backward on its device thread, and the module with moka's calls
   keeping the GIL). Beside each: the module's own steps timed one by one (engine and
   tensor lookups, allocations, DLPack capsules, the call), an autograd node with the same inputs
   that does nothing (what Function.apply and the engine cost any Python layer), the same calls
   with moka's calls made no-ops (the Python alone), and "before": the module as it was, the
   router's and the layer's calls one after the other in one autograd node (``TwoCalls``), timed
   the same ways. What explains the calls' time: the torch ops they run (top-level aten ops, by
   name), the autograd nodes backward runs, and on the GPU the CUDA launches (kernels, memsets,
   copies) made inside torch ops and in all (moka's own are the difference), from one profiled
   call. ``--host-only --device cpu`` measures the host part on the CPU backend (shape "tiny" by
   default, where compute is small beside the Python; use few tokens, e.g. --host-tokens 16).
3. Host time per call as one layer of a model sees it (``--depth``, default 8): a stack of MoE
   layers, each layer's forward and backward timed in place, the middle layers' median being one
   call's cost and the first and last layers' carrying what a step pays once (autograd's hand-off
   of a CUDA backward to its device thread and back); beside it moka's calls alone, the module's
   Python alone and an autograd node with the module's gradients doing nothing else.
4. ``--timeline-depth N``: one profiled step of N layers, each thread's events in order (torch
   ops, autograd nodes, CUDA API calls), and its Chrome trace with ``--trace``.
One JSON line per measurement on stdout (and appended to --out). The measurements live in
bench/overhead/ (host.py: 2 to 4); this file holds the device comparison and the command line.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_baseline import SHAPES, paired_runs  # noqa: E402

from overhead.common import HOST_SHAPES, make_layer  # noqa: E402
from overhead.host import host_overhead, host_per_layer, timeline  # noqa: E402


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



def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moka", help="the moka binary whose C++ layer is the reference (device time)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=7, help="paired runs per shape")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the host part only")
    p.add_argument("--host-only", action="store_true", help="only the host time per call (no --moka needed)")
    p.add_argument("--host-shape", default="", help="default: qwen3-30b-a3b on the GPU, tiny on the CPU")
    p.add_argument("--host-tokens", type=int, default=256)
    p.add_argument("--host-calls", type=int, default=20)
    p.add_argument("--depth", type=int, default=8, help="layers of the per-layer host time's stack (0: not measured)")
    p.add_argument("--timeline-depth", type=int, default=0, help="a profiled step of this many layers (0: none)")
    p.add_argument("--trace", default="", help="the profiled step's Chrome trace (with --timeline-depth)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.device == "cpu" and not a.host_only:
        p.error("--device cpu measures the host time only: add --host-only")
    if not a.host_only and not a.moka:
        p.error("--moka is needed for the device-time comparison (or pass --host-only)")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("needs a GPU (or --device cpu --host-only)")
    host_shape = a.host_shape or ("qwen3-30b-a3b" if a.device == "cuda" else "tiny")
    if host_shape not in HOST_SHAPES:
        p.error(f"--host-shape: unknown shape '{host_shape}' (known: {', '.join(HOST_SHAPES)})")
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"

    def emit(row):
        line = json.dumps({**row, "device": device})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")

    for name in a.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape '{name}' (known: {', '.join(SHAPES)})")
    emit(host_overhead(host_shape, a.host_tokens, a.host_calls, a.seed, a.device))
    if a.depth:
        if a.depth < 3:
            p.error("--depth: at least 3 layers (the first and the last are left out of the per-layer time)")
        emit(host_per_layer(host_shape, a.host_tokens, a.host_calls, a.seed, a.device, a.depth))
    if a.timeline_depth:
        emit(timeline(host_shape, a.host_tokens, a.timeline_depth, a.seed, a.device, a.trace))
    if a.host_only:
        return
    for name in a.shapes.split(","):
        torch.cuda.empty_cache()
        try:
            emit(device_overhead(a.moka, name, a.tokens, a.iters, a.warmup, a.seed))
        except Exception as e:  # report and continue: one shape's failure must not hide the rest
            emit({"measure": "device", "shape": name, "tokens_per_rank": a.tokens, "error": repr(e)[:300]})


if __name__ == "__main__":
    main()
