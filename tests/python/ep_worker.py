"""One rank of the two-process test under torchrun: on the CPU in float64 (test_distributed.py),
or with --cuda on two GPUs in bfloat16 (test_gpu.py; looser tolerances, no bad-input check, as
the GPU reports a bad expert id from its kernels).

Checks, on every rank: the expert-parallel MoE (group=WORLD) against a one-rank MoE with the same
seed on this rank's tokens (outputs, input, router and shared gradients equal; each local
expert's gradient equals the one-rank gradient summed over the ranks), the same for the op, the
module compiled on a new group (as the eager one), the aux-loss-free bias update over the group,
from_hf reading only the local experts, and that a bad input on rank 1 raises moka.Error naming
rank 1 on both ranks.
"""
import os
import sys

import torch
import torch.distributed as dist

import moka
from moka.torch import MoE, moe_experts


CUDA = "--cuda" in sys.argv
H, I, E, IS, T = (256, 128, 4, 64, 64) if CUDA else (8, 6, 4, 5, 11)  # the GPU GEMMs want aligned sizes
FACTORY = dict(device="cuda", dtype=torch.bfloat16) if CUDA else dict(dtype=torch.float64)


def check(got, want, name):
    if CUDA:  # bf16, summed in another order: the relative error of the whole tensor
        error = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
        assert error < 2e-2, f"rank {rank}: {name}: relative error {error}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12, msg=lambda m: f"rank {rank}: {name}: {m}")


def run(module, x):
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = module(x)
    (out * out).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


if CUDA:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if CUDA else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD
kwargs = dict(shared_intermediate=IS, score="sigmoid", renormalize=True, selection_bias=True, **FACTORY)
torch.manual_seed(0)
ep = MoE(H, I, E, 2, group=group, **kwargs)
torch.manual_seed(0)
one = MoE(H, I, E, 2, **kwargs)
local = slice(ep.first_local_expert, ep.first_local_expert + ep.local_experts)
assert ep.local_experts == 2 and ep.first_local_expert == 2 * rank
for name in ("w_gate", "w_up", "w_down"):
    check(getattr(ep, name), getattr(one, name)[local], f"initial {name}")

torch.manual_seed(100 + rank)  # every rank its own tokens (moka wants the same count on every rank)
x = torch.randn(T, H, **FACTORY)
out, dx, g = run(ep, x)
ref_out, ref_dx, ref_g = run(one, x)
check(out, ref_out, "out")
check(dx, ref_dx, "d_x")
for name in ("w_router", "ws_gate", "ws_up", "ws_down"):
    check(g[name], ref_g[name], name)
for name in ("w_gate", "w_up", "w_down"):
    check(g[name], summed(ref_g[name])[local], name)

# The op over the same group, routed by the caller.
ids, weights = one.route(x)
weights = weights.detach().requires_grad_()
xo = x.clone().requires_grad_()
w = [p.detach().clone().requires_grad_() for p in (ep.w_gate, ep.w_up, ep.w_down)]
y = moe_experts(xo, ids, weights, *w, group=group)
(y * y).sum().backward()
wo = [p.detach().clone().requires_grad_() for p in (one.w_gate, one.w_up, one.w_down)]
xr, weights_r = x.clone().requires_grad_(), weights.detach().clone().requires_grad_()
yr = moe_experts(xr, ids, weights_r, *wo)
(yr * yr).sum().backward()
check(y, yr, "op out")
check(xo.grad, xr.grad, "op d_x")
check(weights.grad, weights_r.grad, "op d_topk_weights")
for p, q, name in zip(w, wo, ("w_gate", "w_up", "w_down")):
    check(p.grad, summed(q.grad)[local], f"op {name}")

# The module compiled (fullgraph) over a group no eager call has used: moka's op bootstraps moka's
# group over it at the first compiled call, and computes what the eager module computes.
pair = dist.new_group([0, 1])
torch.manual_seed(0)
compiled = MoE(H, I, E, 2, group=pair, **kwargs)
c_out, c_dx, _ = run(torch.compile(compiled, fullgraph=True, backend="eager"), x)
check(c_out, out, "compiled out")
check(c_dx, dx, "compiled d_x")
for name, p in compiled.named_parameters():
    check(p.grad, g[name], f"compiled {name}")

# The selection bias moves by the load of both ranks together.
load = ep.update_selection_bias(rate=0.25)
assert int(load.sum()) == 2 * 2 * T, load  # k = 2 routes for each token of both ranks
check(summed(ep.selection_bias), 2 * ep.selection_bias, "selection bias agrees")

# from_hf with a group reads this rank's experts only.
sd = {"model.layers.0.mlp.gate.weight": one.w_router.detach(),
      "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(E)}
for e in range(E):
    for name, p in (("gate_proj", one.w_gate), ("up_proj", one.w_up), ("down_proj", one.w_down)):
        sd[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = p[e].detach()
for name, p in (("gate_proj", one.ws_gate), ("up_proj", one.ws_up), ("down_proj", one.ws_down)):
    sd[f"model.layers.0.mlp.shared_experts.{name}.weight"] = p.detach()
loaded = MoE.from_hf(sd, "deepseek_v3", layer=0, top_k=2, group=group, **FACTORY)
check(loaded.w_down, one.w_down.detach()[local], "from_hf local experts")

# A bad input on rank 1 stops both ranks with an error naming rank 1 and the input.
if CUDA:
    print(f"rank {rank}: ok", flush=True)
    sys.exit(0)
if rank == 1:
    ids[3, 0] = 7
try:
    moe_experts(x, ids, weights, *w, group=group)
except moka.Error as e:
    assert "rank 1: topk_ids" in str(e) and e.code == moka.ErrorCode.expert_out_of_range, str(e)
    print(f"rank {rank}: bad input on rank 1 raised: {e}", flush=True)
else:
    sys.exit(f"rank {rank}: a bad input on rank 1 raised nothing")
print(f"rank {rank}: ok", flush=True)
