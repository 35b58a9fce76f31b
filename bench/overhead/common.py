"""What the measurements of bench/python_overhead.py share: the shapes and the MoE layers they time."""
import torch

from torch_baseline import SHAPES

from moka.torch import MoE

# Host-time shapes: the named ones, and one whose CPU-backend compute is small beside the Python.
HOST_SHAPES = {**SHAPES, "tiny": (64, 32, 8, 2, 0, False)}


def make_layer(name, tokens, seed, device="cuda", allocator="torch"):
    """An MoE of the named shape (bf16 on the GPU, fp32 on the CPU; moka's device memory from
    `allocator`), tokens, uniform routing and an output gradient."""
    H, I, E, k, Is, clamped = HOST_SHAPES[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    moe = MoE(H, I, E, k, Is, activation="swiglu_clamped" if clamped else "swiglu", device=device,
              dtype=dtype, init_std=H**-0.5, allocator=allocator)
    x = torch.randn(tokens, H, device=device, dtype=dtype, requires_grad=True)
    ids = torch.argsort(torch.rand(tokens, E, device=device), dim=1)[:, :k].to(torch.int32)
    weights = torch.empty(tokens, k, device=device).uniform_(0.1, 1.0).requires_grad_()
    d_out = torch.randn(tokens, H, device=device, dtype=dtype)
    return moe, x, ids, weights, d_out


def make_stack(name, tokens, seed, depth, device, allocator="torch"):
    """`depth` MoE layers of the named shape (seeds seed, seed + 1, ...), the input x (detached)
    and the output gradient of make_layer's first."""
    first, x, _, _, d_out = make_layer(name, tokens, seed, device, allocator)
    layers = [first] + [make_layer(name, tokens, seed + i, device, allocator)[0] for i in range(1, depth)]
    return layers, x.detach(), d_out
