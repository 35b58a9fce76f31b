#!/usr/bin/env python3
"""The MoE layer users would write in PyTorch, as moka's baseline on one GPU.

argsort by expert, gather, torch._grouped_mm for fused gate|up and for down, SwiGLU (clamped
for GPT-OSS), weighted sum, shared expert, autograd backward. bf16 weights and activations.
Prints one JSON line per (shape, tokens): fwd, bwd and fwd+bwd median ms over --iters runs,
timed with CUDA events after warm-up, and TFLOP/s with the same FLOP count as `moka bench`.
"""
import argparse
import json
import statistics

import torch
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


def moe(x, ids, w, w_gu, w_d, shared, clamped):
    T, k = ids.shape
    E = w_gu.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[order // k]
    gu = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(act(g, u, clamped), w_d.transpose(-2, -1), offs=offs)
    y = y * w.flatten()[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(x).index_add_(0, order // k, y)
    if shared is not None:
        s_gu, s_d = shared
        sg, su = (x @ s_gu.t()).chunk(2, dim=-1)
        out = out + act(sg, su, clamped) @ s_d.t()
    return out


def median_ms(fn, warmup, iters):
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
    return statistics.median(times)


def run(name, T, iters, warmup, seed):
    H, I, E, k, Is, clamped = SHAPES[name]
    torch.manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=bf, requires_grad=True)
    w_gu = (torch.randn(E, 2 * I, H, device=dev, dtype=bf) / H**0.5).requires_grad_()
    w_d = (torch.randn(E, H, I, device=dev, dtype=bf) / I**0.5).requires_grad_()
    shared = None
    if Is:
        shared = ((torch.randn(2 * Is, H, device=dev, dtype=bf) / H**0.5).requires_grad_(),
                  (torch.randn(H, Is, device=dev, dtype=bf) / Is**0.5).requires_grad_())
    ids = torch.argsort(torch.rand(T, E, device=dev), dim=1)[:, :k].to(torch.int32)  # uniform routing
    w = torch.empty(T, k, device=dev).uniform_(0.1, 1.0).requires_grad_()
    d_out = torch.randn(T, H, device=dev, dtype=bf)
    state = {}

    def fwd():
        state["out"] = moe(x, ids, w, w_gu, w_d, shared, clamped)

    def bwd():
        state["out"].backward(d_out, retain_graph=True)

    def both():
        moe(x, ids, w, w_gu, w_d, shared, clamped).backward(d_out)

    f = median_ms(fwd, warmup, iters)
    b = median_ms(bwd, warmup, iters)
    fb = median_ms(both, warmup, iters)
    flops = 6.0 * T * k * H * I + 6.0 * T * H * Is
    return {"shape": name, "backend": "torch", "path": "torch._grouped_mm", "tokens_per_rank": T,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": iters,
            "fwd_ms": f, "bwd_ms": b, "fwdbwd_ms": fb, "tflops": 3.0 * flops / (fb * 1e-3) / 1e12}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    for name in a.shapes.split(","):
        for T in (int(t) for t in a.tokens.split(",")):
            try:
                row = run(name, T, a.iters, a.warmup, a.seed)
            except Exception as e:  # report and continue: one shape's failure must not hide the rest
                row = {"shape": name, "tokens_per_rank": T, "error": repr(e)[:300]}
            torch.cuda.empty_cache()
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
