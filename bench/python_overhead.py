#!/usr/bin/env python3
"""What the Python layer (moka.torch) adds to moka's C++ layer, on one GPU.

1. Device time, per named shape: ``MoE.apply_experts`` forward + ``backward`` through autograd on
   uniform routing, alternated run by run with the C++ layer's fwd+bwd in a
   bench/kernels/paired_steps process on the same shape and token count (the same pairing as
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
5. ``--measure stack`` (per shape of --shapes, at --tokens): a stack of --stack-depth (4) MoE layers,
   forward through all, then backward through all, against depth x the first layer's fwd+bwd
   alone, and with --paired-steps (GPU) against depth x paired_steps' fwd+bwd, paired run by run
   (target: at most 1.05); each layer's routing skew beside it (bench/overhead/model.py).
6. ``--measure compile`` (per shape): MoE's fwd+bwd compiled with torch.compile(fullgraph=True),
   which runs moka's ops, against the module eager (target: at most 1.03), the same for
   ``moe_experts``, and training steps of examples/train_tiny_moe.py's block (attention + MoE,
   --block-seq tokens a sequence, AdamW) compiled against eager (target: at most 1).
7. ``--measure parts`` (per shape): where the module's fwd+bwd goes beyond the C++ layer's: the
   module against ``apply_experts`` on uniform routes and on its own routes, the routing alone,
   with --paired-steps the module against paired_steps, and on the GPU each CUDA kernel of one
   profiled step of the module and of the experts alone, with the GPU's idle gaps.
--measure picks them (default host,device; 1 to 4 are "host" and "device"); ``--smoke`` runs
host, stack, compile and parts on the CPU backend at tiny sizes in seconds (tests/python/test_bench_smoke.py).
One JSON line per measurement on stdout (and appended to --out). The measurements live in
bench/overhead/ (host.py: 2 to 4, model.py: 5 and 6); this file holds the device comparison and
the command line.
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
from overhead.model import compiled_block, compiled_op, module_parts, stack  # noqa: E402


def device_overhead(paired_steps, name, tokens, iters, warmup, seed):
    moe, x, ids, weights, d_out = make_layer(name, tokens, seed)

    def step():  # as in a training step: gradients start at None, so autograd need not add them up
        for t in (x, weights, *moe.parameters()):
            t.grad = None
        moe.apply_experts(x, ids, weights).backward(d_out)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    paired = paired_runs(paired_steps, name, tokens, iters, warmup, seed, step)
    ratios = [p / c for p, c in zip(paired["torch_fwdbwd_ms"], paired["moka_fwdbwd_ms"])]
    return {"measure": "device", "shape": name, "tokens_per_rank": tokens, "runs": iters,
            "python_fwdbwd_ms": paired["torch_median_ms"], "cpp_fwdbwd_ms": paired["moka_median_ms"],
            "python_over_cpp": statistics.median(ratios), "python_runs_ms": paired["torch_fwdbwd_ms"],
            "cpp_runs_ms": paired["moka_fwdbwd_ms"]}


MEASUREMENTS = ("host", "device", "stack", "compile", "parts")
# --smoke: every measurement that runs without a GPU, on the CPU backend at sizes that take
# seconds (the Python test suite runs it); options given beside it still apply.
SMOKE = {"device": "cpu", "measure": "host,stack,compile,parts", "shapes": "tiny", "tokens": 64, "iters": 2,
         "warmup": 1, "host_tokens": 16, "host_calls": 3, "depth": 3, "block_seq": 8, "compile_backend": "aot_eager"}


def parser(smoke: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a quick run on the CPU: " + ", ".join(
        f"--{key.replace('_', '-')} {value}" for key, value in SMOKE.items()))
    p.add_argument("--measure", default="host,device",
                   help=f"comma-separated, of {', '.join(MEASUREMENTS)} (host: also --depth and --timeline-depth)")
    p.add_argument("--paired-steps", help="the kernel lab's paired_steps executable, whose C++ layer is the "
                                          "reference (build/bench/kernels/paired_steps; device; stack on the GPU)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="the shapes of device, stack and compile")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of device, stack and compile")
    p.add_argument("--iters", type=int, default=7, help="timed (paired or alternated) runs per shape")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: all but the device measurement")
    p.add_argument("--host-only", action="store_true", help="the same as --measure host (no --paired-steps needed)")
    p.add_argument("--host-shape", default="", help="default: qwen3-30b-a3b on the GPU, tiny on the CPU")
    p.add_argument("--host-tokens", type=int, default=256)
    p.add_argument("--host-calls", type=int, default=20)
    p.add_argument("--depth", type=int, default=8, help="layers of the per-layer host time's stack (0: not measured)")
    p.add_argument("--timeline-depth", type=int, default=0, help="a profiled step of this many layers (0: none)")
    p.add_argument("--trace", default="", help="the profiled step's Chrome trace (with --timeline-depth)")
    p.add_argument("--stack-depth", type=int, default=4, help="MoE layers of the stack measurement")
    p.add_argument("--block-seq", type=int, default=2048, help="sequence length of the compile measurement's block")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (inductor, aot_eager, ...)")
    p.add_argument("--allocator", choices=("torch", "moka"), default="torch",
                   help="where the host measurements' layers take moka's device memory (MoE's allocator)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    if smoke:
        p.set_defaults(**SMOKE)
    return p


def main():
    smoke = argparse.ArgumentParser(add_help=False)
    smoke.add_argument("--smoke", action="store_true")
    p = parser(smoke.parse_known_args()[0].smoke)
    a = p.parse_args()
    measure = set(["host"] if a.host_only else a.measure.split(","))
    unknown = measure - set(MEASUREMENTS)
    if unknown:
        p.error(f"--measure: unknown {', '.join(sorted(unknown))} (known: {', '.join(MEASUREMENTS)})")
    if "device" in measure and (a.device == "cpu" or not a.paired_steps):
        p.error("the device measurement needs --device cuda and --paired-steps (or leave it out of --measure)")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("needs a GPU (or --device cpu, without the device measurement)")
    host_shape = a.host_shape or ("qwen3-30b-a3b" if a.device == "cuda" else "tiny")
    if host_shape not in HOST_SHAPES:
        p.error(f"--host-shape: unknown shape '{host_shape}' (known: {', '.join(HOST_SHAPES)})")
    # The C++ comparison takes the shapes moka bench and torch_baseline know; the others, tiny too.
    known = SHAPES if "device" in measure else HOST_SHAPES
    shapes = a.shapes.split(",")
    for name in shapes:
        if name not in known:
            p.error(f"--shapes: unknown shape '{name}' (known: {', '.join(known)})")
    if "host" in measure and 0 < a.depth < 3:
        p.error("--depth: at least 3 layers (the first and the last are left out of the per-layer time)")
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"

    def emit(row):
        line = json.dumps({**row, "device": device})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")

    if "host" in measure:
        emit(host_overhead(host_shape, a.host_tokens, a.host_calls, a.seed, a.device, a.allocator))
        if a.depth:
            emit(host_per_layer(host_shape, a.host_tokens, a.host_calls, a.seed, a.device, a.depth, a.allocator))
        if a.timeline_depth:
            emit(timeline(host_shape, a.host_tokens, a.timeline_depth, a.seed, a.device, a.trace))
    per_shape = {
        "device": lambda name: device_overhead(a.paired_steps, name, a.tokens, a.iters, a.warmup, a.seed),
        "stack": lambda name: stack(name, a.tokens, a.stack_depth, a.iters, a.warmup, a.seed, a.device,
                                    a.paired_steps if a.device == "cuda" else ""),
        "parts": lambda name: module_parts(name, a.tokens, a.iters, a.warmup, a.seed, a.device,
                                           a.paired_steps if a.device == "cuda" else ""),
        "compile": lambda name: [
            compiled_op(name, a.tokens, a.iters, a.warmup, a.seed, a.device, a.compile_backend),
            compiled_block(name, a.tokens, a.block_seq, a.iters, a.warmup, a.seed, a.device, a.compile_backend)],
    }
    for kind in (kind for kind in per_shape if kind in measure):
        for name in shapes:
            if a.device == "cuda":
                torch.cuda.empty_cache()
            try:
                rows = per_shape[kind](name)
            except Exception as e:  # report and continue: one shape's failure must not hide the rest
                rows = {"measure": kind, "shape": name, "tokens_per_rank": a.tokens, "error": repr(e)[:300]}
            for row in rows if isinstance(rows, list) else [rows]:
                emit(row)


if __name__ == "__main__":
    main()
