#!/usr/bin/env python3
"""`moka train --backend cuda`'s language model in PyTorch eager, for its tokens/s.

The same model as src/train (model.hpp): byte embedding, per layer RMSNorm -> MLA attention
(q = W_q_up W_q_down x, k/v = W_k_up/W_v_up (W_kv_down x); `--attention mha` for plain q/k/v;
causal, no positional encoding, scale 1/sqrt(head_dim)) and RMSNorm -> FFN (layer 0 a dense
SwiGLU, the others MoE: sigmoid router, top-k over score + selection bias, weights renormalized,
SwiGLU experts; aux-loss-free bias update after each step), final RMSNorm, LM head,
cross-entropy; AdamW (fused) on fp32 master weights. Precision as moka's engine: dense matmuls
and attention fp32 with TF32 tensor cores, experts bf16 through torch._grouped_mm (the MoE of
bench/torch_baseline.py). Tokens are random bytes (throughput only).

Measures PyTorch eager and torch.compile side by side in one run (`--modes`), each on a fresh
copy of the same model (same seed), and prints one JSON line with `torch_eager_tokens_per_s`
and `torch_compile_tokens_per_s` (`tokens_per_s` is eager's). torch.compile's warm-up steps
include its compilation, timed separately as `compile_warmup_s`. `--device cpu` runs a tiny
model as a smoke test of the script itself (its experts loop over experts there:
torch._grouped_mm has no CPU backward); its numbers say nothing about GPU speed.
"""
import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline  # noqa: E402
from torch_baseline import act, moe  # noqa: E402  (the grouped-GEMM MoE layer users would write)


def looped_experts(xs, counts, w_gu, w_d, clamped):
    """The experts one at a time: the CPU stand-in for torch._grouped_mm, whose backward fails there."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        g, u = (xs[start:start + n] @ w_gu[e].t()).chunk(2, dim=-1)
        out.append(act(g, u, clamped) @ w_d[e].t())
        start += n
    return torch.cat(out)


def rmsnorm(x, g, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


class Model(torch.nn.Module):
    def __init__(s, a):
        super().__init__()
        d, W = a.d_model, a.heads * a.head_dim
        def P(*shape, std):
            return torch.nn.Parameter(torch.randn(*shape) * std)
        s.a = a
        s.embed = P(256, d, std=1.0)
        s.layers = torch.nn.ModuleList()
        for l in range(a.layers):
            L = torch.nn.Module()
            L.attn_norm, L.ffn_norm = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))
            if a.attention == "mla":
                L.q_down, L.q_up = P(a.q_rank, d, std=d**-0.5), P(W, a.q_rank, std=a.q_rank**-0.5)
                L.kv_down = P(a.kv_rank, d, std=d**-0.5)
                L.k_up, L.v_up = P(W, a.kv_rank, std=a.kv_rank**-0.5), P(W, a.kv_rank, std=a.kv_rank**-0.5)
            else:
                L.q, L.k, L.v = (P(W, d, std=d**-0.5) for _ in range(3))
            L.out = P(d, W, std=W**-0.5)
            E, I = (a.experts, a.expert_intermediate) if l > 0 else (1, a.dense_intermediate)
            L.w_gu = P(E, 2 * I, d, std=d**-0.5)  # gate and up stacked, as torch_baseline.moe takes them
            L.w_d = P(E, d, I, std=I**-0.5)
            if l > 0:
                L.router = P(E, d, std=d**-0.5)
                L.register_buffer("bias", torch.zeros(E))
            s.layers.append(L)
        s.final_norm = torch.nn.Parameter(torch.ones(d))
        s.head = P(256, d, std=d**-0.5)

    def attention(s, L, x, B, S):
        a = s.a
        if a.attention == "mla":
            q = (x @ L.q_down.t()) @ L.q_up.t()
            c = x @ L.kv_down.t()
            k, v = c @ L.k_up.t(), c @ L.v_up.t()
        else:
            q, k, v = x @ L.q.t(), x @ L.k.t(), x @ L.v.t()
        def split(t):
            return t.view(B, S, a.heads, a.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return o.transpose(1, 2).reshape(B * S, -1) @ L.out.t()

    def ffn(s, L, x):
        """The FFN's output and, in an MoE layer, its tokens per expert (else None)."""
        bf = torch.bfloat16
        counts = None
        if not hasattr(L, "router"):
            ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
            w = torch.ones(x.shape[0], 1, device=x.device)
        else:
            scores = torch.sigmoid(x @ L.router.t())
            ids = torch.topk(scores.detach() + L.bias, s.a.top_k, dim=-1).indices
            w = scores.gather(1, ids)
            w = w / w.sum(-1, keepdim=True)
            # A fixed-size count (scatter, not bincount): no data-dependent shape for torch.compile.
            counts = torch.zeros(L.router.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
                0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.int64, device=x.device))
            ids = ids.to(torch.int32)
        return moe(x.to(bf), ids, w, L.w_gu.to(bf), L.w_d.to(bf), None, False).float(), counts

    def forward(s, tokens, targets):
        """The loss and, per MoE layer in order, its tokens per expert."""
        B, S = tokens.shape
        h = s.embed[tokens.flatten()]
        counts = []
        for L in s.layers:
            h = h + s.attention(L, rmsnorm(h, L.attn_norm), B, S)
            y, c = s.ffn(L, rmsnorm(h, L.ffn_norm))
            h = h + y
            if c is not None:
                counts.append(c)
        logits = rmsnorm(h, s.final_norm) @ s.head.t()
        return F.cross_entropy(logits, targets.flatten()), counts


def tokens_per_s(a, dev, compiled):
    """Tokens/s of `a.steps` training steps after `a.warmup_steps`, and the warm-up's seconds."""
    torch.manual_seed(1)
    model = Model(a).to(dev)
    routed = [L for L in model.layers if hasattr(L, "router")]
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=dev == "cuda")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def step():
        tokens = torch.randint(0, 256, (a.batch, a.seq + 1), device=dev)
        loss, counts = forward(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing, as update_selection_bias
            for L, c in zip(routed, counts):
                L.bias += a.bias_rate * torch.sign(c.float().mean() - c.float())
        return loss

    t0 = time.perf_counter()
    for _ in range(a.warmup_steps):
        step()
    sync()
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - t0
    return a.steps * a.batch * a.seq / seconds, seconds, warmup, float(loss.detach())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--attention", default="mla", choices=["mla", "mha"])
    p.add_argument("--q-rank", type=int, default=64)
    p.add_argument("--kv-rank", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense-intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=30, help="timed steps, after --warmup-steps")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=2**-7)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--out", help="append the JSON line to this file too")
    p.add_argument("--modes", default="eager,compile", help="eager, compile or both (comma-separated)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of this script with a tiny model")
    a = p.parse_args()
    modes = a.modes.split(",")
    if not modes or any(m not in ("eager", "compile") for m in modes):
        p.error(f"--modes: '{a.modes}' is not a list of eager and compile")
    dev = a.device
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch_baseline.experts = looped_experts
    result = {"backend": "torch", "d_model": a.d_model, "experts": a.experts, "layers": a.layers, "batch": a.batch,
              "seq": a.seq, "steps": a.steps,
              "device": torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
              "torch": torch.__version__,
              "precision": "fp32 master, TF32 dense + fp32 SDPA, bf16 experts (torch._grouped_mm)" if dev == "cuda"
              else "fp32 master, fp32 dense, bf16 experts (looped)"}
    # The MoE layer's bincount has a data-dependent shape: dynamo breaks the graph there in every
    # layer and recompiles the frame after the break per layer; the default limit of 8 left the
    # rest of the step eager (partly compiled). A higher limit compiles every piece.
    torch._dynamo.config.recompile_limit = 64
    for mode in modes:
        tps, seconds, warmup, loss = tokens_per_s(a, dev, mode == "compile")
        result[f"torch_{mode}_tokens_per_s"] = tps
        result[f"{mode}_seconds"] = seconds
        result[f"{mode}_final_loss"] = loss
        if mode == "compile":
            result["compile_warmup_s"] = warmup
        # Each mode's result as it comes, so a run cut short by a timeout still tells something.
        print(json.dumps({"mode": mode, "tokens_per_s": tps, "warmup_s": warmup}), file=sys.stderr, flush=True)
    if "eager" in modes:
        result["tokens_per_s"] = result["torch_eager_tokens_per_s"]
    line = json.dumps(result)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
