"""A tiny MoE transformer (byte-level language model) trained on the project's English text, with
moka's MoE layer as every block's feed-forward: on the CPU, on one GPU, or under torchrun with the
experts split over the ranks (expert parallelism; the rest is data-parallel).

  python examples/train_tiny_moe.py --steps 300                      # CPU or one GPU
  torchrun --nproc-per-node 2 examples/train_tiny_moe.py --steps 200  # EP=2
  ... --block torch   # the same model and initial weights with a pure-PyTorch MoE block

It prints the loss every --log-every steps and a last JSON line with the block, the loss curve
and the throughput (tokens/s over all ranks, first 10 steps excluded); --out writes that JSON.
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moka.reference import TorchMoE
from moka.torch import MoE

# scripts/fetch_data.sh installs it; MOKA_TEXT_DIR (as for `moka train`) or --text-dir picks another.
TEXT_DIR = Path(os.environ.get("MOKA_TEXT_DIR", "/usr/share/games/fortunes"))


def load_text(text_dir: Path) -> torch.Tensor:
    files = sorted(p for p in text_dir.glob("*") if p.is_file() and p.suffix not in (".dat", ".u8"))
    if not files:
        raise SystemExit(f"no text in {text_dir}: run scripts/fetch_data.sh")
    data = b"".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, args, group, moe_class, factory):
        super().__init__()
        self.heads = args.heads
        self.norm1 = nn.LayerNorm(args.dim, **factory)
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False, **factory)
        self.proj = nn.Linear(args.dim, args.dim, bias=False, **factory)
        self.norm2 = nn.LayerNorm(args.dim, **factory)
        self.moe = moe_class(args.dim, args.intermediate, args.experts, args.top_k, args.shared, group=group,
                             selection_bias=True, renormalize=True, **factory)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, args, group, moe_class, factory):
        super().__init__()
        self.embed = nn.Embedding(256, args.dim, **factory)
        self.pos = nn.Parameter(torch.zeros(args.seq, args.dim, **factory))
        self.blocks = nn.ModuleList(Block(args, group, moe_class, factory) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.dim, **factory)
        self.head = nn.Linear(args.dim, 256, bias=False, **factory)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", choices=["moka", "torch"], default="moka")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--shared", type=int, default=0, help="shared expert's intermediate size (0: none)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free balancing rate per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", type=Path, help="write the final JSON here too")
    parser.add_argument("--text-dir", type=Path, default=TEXT_DIR, help="folder of the training text")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    # moka's block splits the experts over the ranks; the pure-PyTorch block keeps all of them on
    # every rank (plain data parallelism). The same seed gives both the same initial weights.
    group = dist.group.WORLD if distributed and args.block == "moka" else None
    factory = {"device": torch.device(args.device), "dtype": torch.bfloat16 if cuda else torch.float32}
    torch.manual_seed(args.seed)
    model = TinyMoELM(args, group, MoE if args.block == "moka" else TorchMoE, factory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    expert_params = {id(p) for b in model.blocks for p in (b.moe.w_gate, b.moe.w_up, b.moe.w_down)} if group else set()

    text = load_text(args.text_dir)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    losses, start, timed_tokens = [], None, 0
    for step in range(args.steps):
        if step == 10:
            torch.cuda.synchronize() if cuda else None
            start = time.perf_counter()
        offsets = torch.randint(0, len(text) - args.seq - 1, (args.batch,), generator=generator)
        window = torch.stack([text[o: o + args.seq + 1] for o in offsets.tolist()]).to(args.device)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if distributed:
            # Data-parallel mean of the replicated parameters; a moka expert's gradient already sums
            # over every rank's tokens, so it only takes the same 1/world.
            for p in model.parameters():
                if id(p) not in expert_params:
                    dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        for block in model.blocks:
            if distributed and block.moe.group is None:
                dist.all_reduce(block.moe.expert_load)  # the same bias on every data-parallel rank
            block.moe.update_selection_bias(args.bias_rate)
        loss = loss.detach()
        if distributed:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        if step >= 10:
            timed_tokens += args.batch * args.seq * world
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    torch.cuda.synchronize() if cuda else None
    elapsed = time.perf_counter() - start if start else math.nan
    summary = {"block": args.block, "world": world, "device": args.device, "steps": args.steps,
               "tokens_per_s": timed_tokens / elapsed if start else None, "losses": losses}
    if rank == 0:
        print(json.dumps(summary))
        if args.out:
            args.out.write_text(json.dumps(summary) + "\n")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
