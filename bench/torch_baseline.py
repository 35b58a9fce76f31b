#!/usr/bin/env python3
"""The MoE layer users would write in PyTorch, as moka's baseline.

One GPU: argsort by expert, gather, torch._grouped_mm for fused gate|up and for down, SwiGLU
(clamped for GPT-OSS), weighted sum, shared expert, autograd backward. bf16 weights and
activations. Under torchrun (or `moka launch -n N -- python3 bench/torch_baseline.py`) the
experts are split over the ranks and rows move with NCCL all_to_all_single (the PyTorch + NCCL
path): per-expert counts exchanged with all_to_all, split sizes read on the host, rows sent,
regrouped by local expert, the grouped GEMMs, rows sent back, weighted sum.
Prints one JSON line per (shape, tokens) (rank 0; times are the max over ranks of per-rank
medians): fwd, bwd and fwd+bwd median ms over --iters runs, timed with CUDA events after
warm-up, and TFLOP/s with the same FLOP count as `moka bench`.

peak_memory_bytes (max over ranks) is what `moka bench` reports per path as the layer's peak
memory, the saved context and workspace of one fwd+bwd: torch.cuda.max_memory_allocated() during
one fwd+bwd, after torch.cuda.reset_peak_memory_stats(), minus memory_allocated() before it (the
inputs, weights and d_out, which moka does not count either), minus the .grad tensors the
backward creates (every .grad is None before it: moka writes gradients into the caller's buffers
and does not count them), each subtracted from the peaks after it was created only (peak_memory()
cuts the step at every gradient's accumulation). gradient_bytes gives what was subtracted in all.

saved_bytes_per_layer (max over ranks) is what autograd keeps between one layer's forward and its
backward, the memory a model holds per layer until its backward runs: torch.cuda.memory_allocated()
after one forward (its output and graph alive) minus memory_allocated() before it (the inputs and
weights), minus the bytes of the output itself (the caller's, not saved). null without CUDA.

stack_peak_memory_bytes (max over ranks) is peak_memory_bytes of --depth (default 1; "depth" in the
JSON line) layers in a model's order: layers of the same shape, each with its own weights and
routing (the first is the layer measured above), x (which requires grad) into the first, the output
of each into the next, all the forwards, then one backward from a random d_out of the last output.
Measured as peak_memory_bytes is, less the .grad tensors of every layer and of x; with --depth 1
it is the same measurement as peak_memory_bytes. When the stack does not fit on the GPU it is null
and stack_error says why (the rest of the line stands).

With --paired-with PAIRED_STEPS (one GPU; the kernel lab's bench/kernels/paired_steps), each
case then also starts PAIRED_STEPS on the same shape, which holds its own copy of the case on
the GPU, and alternates one moka fwd+bwd with one torch fwd+bwd --iters times (moka first on
even runs, torch first on odd ones, so neither always runs on a GPU the other just warmed).
"paired" in the JSON line holds every run's time and the median of the per-run ratios torch /
moka: two runs made moments apart share the clocks and temperature of that moment, which a
ratio of two medians taken minutes apart does not.
"""
import argparse
import json
import math
import os
import statistics
import subprocess

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F

SHAPES = {  # hidden, intermediate, experts, top_k, shared, clamped (as src/core/shapes.cpp)
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0, False),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 0, False),
    "deepseek-v3": (7168, 2048, 256, 8, 2048, False),
    "gpt-oss-120b": (2880, 2880, 128, 4, 0, True),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0, False),
}


def act(g, u, clamped, limit=7.0):
    if not clamped:
        return F.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return g * torch.sigmoid(1.702 * g) * (u + 1)


def experts(xs, counts, w_gu, w_d, clamped):
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gu = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    return torch._grouped_mm(act(g, u, clamped), w_d.transpose(-2, -1), offs=offs)


def expert_parallel(xs, counts, w_gu, w_d, clamped):
    """Rows sorted by global expert go to their experts' ranks and come back in the same order."""
    R = dist.get_world_size()
    E_local = w_gu.shape[0]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)  # [source rank][local expert]
    send_splits = counts.view(R, E_local).sum(1).tolist()  # host synchronization
    recv_splits = recv_counts.view(R, E_local).sum(1).tolist()
    out = xs.new_empty(sum(recv_splits), xs.shape[1])
    xr = dist_fn.all_to_all_single(out, xs, recv_splits, send_splits)
    local_expert = torch.repeat_interleave(torch.arange(E_local, device=xs.device).repeat(R), recv_counts)
    order = torch.argsort(local_expert, stable=True)
    y = experts(xr[order], torch.bincount(local_expert, minlength=E_local), w_gu, w_d, clamped)
    y_received = torch.empty_like(y).index_copy(0, order, y)
    back = y.new_empty(xs.shape[0], y.shape[1])
    return dist_fn.all_to_all_single(back, y_received, send_splits, recv_splits)


def moe(x, ids, w, w_gu, w_d, shared, clamped):
    T, k = ids.shape
    E = w_gu.shape[0] * (dist.get_world_size() if dist.is_initialized() else 1)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    xs = x[order // k]
    if dist.is_initialized():
        y = expert_parallel(xs, counts, w_gu, w_d, clamped)
    else:
        y = experts(xs, counts, w_gu, w_d, clamped)
    y = y * w.flatten()[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(x).index_add_(0, order // k, y)
    if shared is not None:
        s_gu, s_d = shared
        sg, su = (x @ s_gu.t()).chunk(2, dim=-1)
        out = out + act(sg, su, clamped) @ s_d.t()
    return out


def run_times(fn, warmup, iters):
    """Milliseconds of each of `iters` runs of fn after `warmup` untimed ones (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def median_ms(fn, warmup, iters):
    return statistics.median(run_times(fn, warmup, iters))


def paired_runs(paired_steps, name, T, iters, warmup, seed, torch_step):
    """Alternates moka's fwd+bwd (a bench/kernels/paired_steps process) with torch_step."""
    cmd = [paired_steps, "--shape", name, "--tokens", str(T), "--warmup", str(warmup), "--seed", str(seed)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        ready = proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"paired_steps did not start (said {ready!r}, exit code {proc.poll()})")

        def moka_step():
            proc.stdin.write("step\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        moka_ms, torch_ms = [], []
        for i in range(iters):
            for who in ("moka", "torch") if i % 2 == 0 else ("torch", "moka"):
                if who == "moka":
                    moka_ms.append(moka_step())
                else:
                    torch_ms.append(run_times(torch_step, 0, 1)[0])
        proc.stdin.close()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    ratios = [t / m for t, m in zip(torch_ms, moka_ms)]
    return {"runs": iters, "order": "alternating, moka first on even runs", "moka_fwdbwd_ms": moka_ms,
            "torch_fwdbwd_ms": torch_ms, "moka_median_ms": statistics.median(moka_ms),
            "torch_median_ms": statistics.median(torch_ms), "median_ratio": statistics.median(ratios)}


def make_layer(T, H, I, E, k, Is, ranks=1, device="cuda", dtype=torch.bfloat16):
    """One layer's (ids, w, w_gu, w_d, shared), moe()'s arguments after x: this rank's E / ranks
    experts, the shared expert when Is, and uniform routing of T rows to k of the E experts."""
    w_gu = (torch.randn(E // ranks, 2 * I, H, device=device, dtype=dtype) / H**0.5).requires_grad_()
    w_d = (torch.randn(E // ranks, H, I, device=device, dtype=dtype) / I**0.5).requires_grad_()
    shared = None
    if Is:
        shared = ((torch.randn(2 * Is, H, device=device, dtype=dtype) / H**0.5).requires_grad_(),
                  (torch.randn(H, Is, device=device, dtype=dtype) / Is**0.5).requires_grad_())
    ids = torch.argsort(torch.rand(T, E, device=device), dim=1)[:, :k].to(torch.int32)  # uniform routing
    w = torch.empty(T, k, device=device).uniform_(0.1, 1.0).requires_grad_()
    return ids, w, w_gu, w_d, shared


def layer_leaves(layer):
    """The tensors of a make_layer() layer that get a .grad."""
    _, w, w_gu, w_d, shared = layer
    return [w, w_gu, w_d] + list(shared or [])


def stack_forward(x, layers, clamped):
    """The layers in order: x into the first, each one's output into the next; the last output."""
    for layer in layers:
        x = moe(x, *layer, clamped)
    return x


def stack_peak_memory(x, layers, d_out, clamped):
    """peak_memory() of all the forwards of the stack, then one backward from d_out; its leaves
    are x and every layer's."""
    leaves = [x] + [t for layer in layers for t in layer_leaves(layer)]
    return peak_memory(lambda: stack_forward(x, layers, clamped).backward(d_out), leaves)


def run(name, T, iters, warmup, seed, paired_with="", depth=1):
    H, I, E, k, Is, clamped = SHAPES[name]
    R = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(seed * 1000 + (dist.get_rank() if R > 1 else 0))
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=bf, requires_grad=True)
    layer = make_layer(T, H, I, E, k, Is, R, dev, bf)
    d_out = torch.randn(T, H, device=dev, dtype=bf)
    state = {}

    def fwd():
        state["out"] = moe(x, *layer, clamped)

    def bwd():
        state["out"].backward(d_out, retain_graph=True)

    def both():
        moe(x, *layer, clamped).backward(d_out)

    f = max_over_ranks(median_ms(fwd, warmup, iters))
    b = max_over_ranks(median_ms(bwd, warmup, iters))
    fb = max_over_ranks(median_ms(both, warmup, iters))
    state.clear()  # the retained graph of fwd/bwd
    peak, grads = peak_memory(both, [x] + layer_leaves(layer))
    saved = saved_bytes(lambda: moe(x, *layer, clamped))
    stack_peak, stack_error = None, None
    try:
        layers = [layer] + [make_layer(T, H, I, E, k, Is, R, dev, bf) for _ in range(depth - 1)]
        stack_peak, _ = stack_peak_memory(x, layers, d_out, clamped)
    except torch.cuda.OutOfMemoryError as e:
        stack_error = repr(e)[:300]
    layers = None  # the other layers' weights and all gradients go before the paired runs
    for t in [x] + layer_leaves(layer):
        t.grad = None
    flops = 6.0 * T * k * H * I + 6.0 * T * H * Is
    row = {"shape": name, "backend": "torch", "ep": R,
           "path": "all_to_all_single + torch._grouped_mm" if R > 1 else "torch._grouped_mm",
           "tokens_per_rank": T, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "iters": iters, "fwd_ms": f, "bwd_ms": b, "fwdbwd_ms": fb,
           "tflops": 3.0 * flops / (fb * 1e-3) / 1e12,
           "peak_memory_bytes": max_bytes_over_ranks(peak), "gradient_bytes": max_bytes_over_ranks(grads),
           "saved_bytes_per_layer": max_bytes_over_ranks(saved), "depth": depth,
           "stack_peak_memory_bytes": max_bytes_over_ranks(stack_peak)}
    if stack_error:
        row["stack_error"] = stack_error
    if paired_with:
        torch.cuda.empty_cache()  # moka's process needs the memory
        row["paired"] = paired_runs(paired_with, name, T, iters, warmup, seed, both)
    return row


def peak_memory(step, leaves):
    """Bytes one run of step() allocates at its peak beyond what exists before it, not counting the
    .grad tensors of `leaves` (all None before: they are the caller's, as moka's gradients are),
    and those gradients' bytes. The gradients are subtracted where they exist: the step is cut
    at every gradient's accumulation (a post-accumulate hook), and each piece's peak loses the
    gradients existing at its end, so a stack's peak in its first layer's backward is not
    lowered by gradients created after it. The peak is None when no leaf is on a CUDA device
    (step() still runs)."""
    for t in leaves:
        t.grad = None
    cuda = any(t.is_cuda for t in leaves)
    grad_bytes = [0]
    peaks = []

    def end_piece(_leaf=None):
        if _leaf is not None and _leaf.grad is not None:
            grad_bytes[0] += _leaf.grad.numel() * _leaf.grad.element_size()
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated() - before - grad_bytes[0])
            torch.cuda.reset_peak_memory_stats()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    hooks = [t.register_post_accumulate_grad_hook(end_piece) for t in leaves if t.requires_grad]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    if not cuda:
        return None, grads
    torch.cuda.synchronize()
    end_piece()
    return max(peaks), grads


def saved_bytes(forward):
    """Bytes autograd keeps from one forward() for its backward: memory_allocated() with forward()'s
    output (and so its graph) alive, less before it, less the output's own bytes. None when the
    output is not on a CUDA device."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    out = forward()
    if not out.is_cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before - out.numel() * out.element_size()


def max_over_ranks(value):
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def max_bytes_over_ranks(value):
    """max_over_ranks() of a byte count as an int; None when it is None on any rank."""
    value = max_over_ranks(math.inf if value is None else value)
    return None if value == math.inf else int(value)


def at_least_one(text):
    """argparse type: an int >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    p.add_argument("--paired-with", default="", metavar="PAIRED_STEPS",
                   help="the kernel lab's paired_steps executable (build/bench/kernels/paired_steps) to alternate "
                        "runs with (one GPU): adds the median of per-run ratios")
    p.add_argument("--depth", type=at_least_one, default=1, metavar="N",
                   help="layers in the stack whose fwd+bwd peak is stack_peak_memory_bytes (default 1)")
    return p


def main():
    p = parser()
    a = p.parse_args()
    if a.paired_with and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--paired-with runs on one GPU")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for name in a.shapes.split(","):
        for T in (int(t) for t in a.tokens.split(",")):
            try:
                row = run(name, T, a.iters, a.warmup, a.seed, a.paired_with, a.depth)
            except Exception as e:  # report and continue: one shape's failure must not hide the rest
                row = {"shape": name, "tokens_per_rank": T, "error": repr(e)[:300]}
            torch.cuda.empty_cache()
            line = json.dumps(row)
            if not rank0:
                continue
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
