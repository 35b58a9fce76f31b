"""The CUDA backend (bfloat16) against the fp32 reference; CUDA graph capture and replay.
Marked cuda: skipped without a GPU or without moka's CUDA backend in the extension."""
import pytest
import torch

from conftest import MokaCalls, assert_equal, module_results, reference_of, run_ep_worker
from moka import reference
from moka.torch import MoE, moe_experts

pytestmark = pytest.mark.cuda
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 512, 8, 2


def bf16_moe(shared=0, **kwargs):
    torch.manual_seed(0)
    return MoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, shared, device="cuda", dtype=torch.bfloat16, **kwargs)


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("shared", [0, 384])
def test_bf16_experts_and_every_gradient_match_the_fp32_reference(shared):
    moe = bf16_moe(shared)
    x = torch.randn(1000, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, weights = reference.route(x.float(), moe.w_router.float(), TOP_K)
    params = [p for p in (moe.w_gate, moe.w_up, moe.w_down, moe.ws_gate, moe.ws_up, moe.ws_down) if p is not None]
    got_in, want_in = leaves(x, weights, *params), leaves(x.float(), weights, *(p.float() for p in params))
    d_out = torch.randn_like(x)
    out = moe_experts(got_in[0], ids, *got_in[1:])
    out.backward(d_out)
    want = reference.experts(want_in[0], ids, *want_in[1:])
    want.backward(d_out.float())
    assert relative_error(out, want) < 1e-2
    for name, g, w in zip(["x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"],
                          got_in, want_in):
        assert relative_error(g.grad, w.grad) < 2e-2, name


def test_bf16_layer_routes_and_trains_like_the_reference():
    moe = bf16_moe(384, score="sigmoid", renormalize=True)
    ref = reference_of(moe).float()
    x = torch.randn(1000, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, _ = moe.route(x)
    ref_ids, _ = ref.route(x.float())
    same = (ids.sort(dim=1).values == ref_ids.sort(dim=1).values).all(dim=1)
    assert same.float().mean() > 0.95  # bf16 and fp32 logits may rank near-ties differently
    out, want = moe(x), ref(x.float())
    assert relative_error(out[same], want[same]) < 1e-2
    out.float().square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        assert relative_error(p.grad, q.grad) < 5e-2, name


def test_the_op_runs_on_the_current_stream_and_replays_in_a_cuda_graph():
    moe = bf16_moe()
    x = torch.randn(256, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, weights = reference.route(x.float(), moe.w_router.float(), TOP_K)
    args = (ids, weights, moe.w_gate.detach(), moe.w_up.detach(), moe.w_down.detach())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = moe_experts(x, *args)  # the first call with this token count allocates moka's workspace
    torch.cuda.current_stream().wait_stream(side)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_experts(static_x, *args)
    static_x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(static_out, moe_experts(x * 2, *args))
    static_x.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_out, want)


def module_gradients(moe, x, d_out, between=lambda: None):
    """out and every gradient (x's first) of one forward and backward; `between` runs between them."""
    moe.zero_grad()
    leaf = x.detach().clone().requires_grad_()
    out = moe(leaf)
    between()
    out.backward(d_out)
    return [out, leaf.grad] + [p.grad for p in moe.parameters()]


def test_backward_reads_its_forwards_routes_after_their_memory_was_offered_again():
    # topk_ids live only in moka's saved state (autograd does not save them), and the caching
    # allocator hands a freed block to the next request of its size on the stream.
    moe = bf16_moe()
    x = torch.randn(256, HIDDEN, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn_like(x)
    want = module_gradients(moe, x, d_out)
    garbage = []

    def reuse_freed_blocks():
        garbage.extend(torch.full((256, TOP_K), EXPERTS + 7, dtype=dtype, device="cuda")
                       for dtype in (torch.int32, torch.float32) for _ in range(16))

    got = module_gradients(moe, x, d_out, reuse_freed_blocks)
    moe.check_errors()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_the_module_forward_and_backward_replay_in_a_cuda_graph(backend):
    # backend: the module as it is, or compiled with torch.compile(fullgraph=True) (compiled in
    # the warm-up, captured as a model's step would be)
    eager = bf16_moe(384)
    moe = eager if backend is None else torch.compile(eager, fullgraph=True, backend=backend)
    x = torch.randn(256, HIDDEN, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn_like(x)
    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: moka's workspace for this token count
        for _ in range(2):
            module_gradients(moe, static_x, d_out)
    torch.cuda.current_stream().wait_stream(side)
    moe.zero_grad()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
        static_out.backward(d_out)
    static_grads = [static_x.grad] + [p.grad for p in moe.parameters()]
    for inputs in (x * 2, x):
        with torch.no_grad():
            static_x.copy_(inputs)
        graph.replay()
        got = [t.clone() for t in (static_out, *static_grads)]
        want = module_gradients(eager, inputs, d_out)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


# The aux outputs come from moka's router call (moka::moe_with_aux when traced), so inductor
# gives eager's bits with them too.
@pytest.mark.parametrize("backend, return_aux", [("aot_eager", True), ("inductor", True), ("inductor", False)])
def test_the_compiled_module_computes_the_eager_bits_on_the_gpu_with_one_moka_call_each_way(backend, return_aux,
                                                                                          monkeypatch):
    moe = bf16_moe(384, selection_bias=True)
    x = torch.randn(4, 96, HIDDEN, device="cuda", dtype=torch.bfloat16)  # [B, S, H]
    want = module_results(moe, moe, x, return_aux=return_aux)
    compiled = torch.compile(moe, fullgraph=True, backend=backend)
    calls = MokaCalls(monkeypatch)
    got = module_results(compiled, moe, x, return_aux=return_aux)
    assert_equal(got, want)
    assert (calls.forwards, calls.backwards) == (1, 1)  # the backward reuses the forward's state


def test_the_aux_outputs_and_their_router_gradients_match_fp32_torch():
    moe = bf16_moe(score="sigmoid")
    x = torch.randn(777, HIDDEN, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(777, EXPERTS, device="cuda")
    _, aux = moe(x, return_aux=True)
    ((aux.router_logits * r).sum() + (aux.router_probs * r).sum() + aux.load_balancing_loss + aux.z_loss).backward()
    w = moe.w_router.detach().float().requires_grad_()
    logits = x.float() @ w.t()
    scores = torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    counts = aux.tokens_per_expert  # moka's selection (near-ties may differ from fp32's)
    balance = EXPERTS * (counts / (777.0 * TOP_K) * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    ((logits * r).sum() + (probs * r).sum() + balance + z).backward()
    assert counts.dtype == torch.int64 and counts.sum().item() == 777 * TOP_K
    assert aux.router_logits.dtype == torch.float32 and relative_error(aux.router_logits, logits) < 1e-5
    assert relative_error(aux.router_probs, probs) < 1e-5
    assert relative_error(aux.load_balancing_loss, balance) < 1e-5 and relative_error(aux.z_loss, z) < 1e-5
    assert relative_error(moe.w_router.grad, w.grad) < 2e-2


def test_the_exported_module_runs_on_the_gpu_with_another_batch_and_computes_the_eager_forward():
    moe = bf16_moe(384)
    x = torch.randn(2, 64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    program = torch.export.export(moe, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    other = torch.randn(3, 64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    want = moe(other)
    for exported in (program, program.run_decompositions()):
        assert torch.equal(exported.module()(other), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_under_torchrun_match_one_gpu():
    log = run_ep_worker("--cuda")
    assert "rank 0: ok" in log and "rank 1: ok" in log, log


def test_a_failure_the_kernels_find_is_raised_by_the_next_call_and_its_output_is_nan():
    import moka
    moe = bf16_moe(path="megakernel", max_tokens=64)
    x = torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, weights = moe.route(x)
    ids[5, 1] = EXPERTS + 3  # out of range: found by the megakernel's schedule on the device
    out = moe.apply_experts(x, ids, weights)
    torch.cuda.synchronize()
    assert out.isnan().all()
    with pytest.raises(moka.Error, match=r"\[5, 1\]"):
        moe.apply_experts(x, moe.route(x)[0], weights)
