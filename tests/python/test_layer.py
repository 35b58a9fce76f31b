"""moka.torch.MoE and moe_experts on the CPU backend against the pure-PyTorch reference."""
import weakref

import pytest
import torch

import moka.torch
from conftest import reference_of, tiny_moe
from moka import reference
from moka.torch import MoE, moe_experts

SHARED = [0, 5]


def grads(module, x):
    module.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = module(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("routing", [dict(), dict(score="sigmoid", renormalize=True, route_scale=2.5),
                                     dict(activation="swiglu_clamped", clamp_limit=0.5)])
def test_forward_and_every_gradient_match_the_reference_in_fp64(shared, routing):
    moe = tiny_moe(shared=shared, **routing)
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    out, got = grads(moe, x)
    ref_out, want = grads(reference_of(moe), x)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert set(got) == set(want) == {"x", "w_router", "w_gate", "w_up", "w_down"} | (
        {"ws_gate", "ws_up", "ws_down"} if shared else set())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("shared", SHARED)
def test_gradcheck_of_the_layer(shared):
    moe = tiny_moe(shared=shared, score="sigmoid", renormalize=True)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    params = list(moe.parameters())
    assert torch.autograd.gradcheck(lambda x, *_: moe(x), (x, *params), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("shared", SHARED)
def test_gradcheck_of_the_op(shared):
    moe = tiny_moe(shared=shared)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    ids, weights = reference.route(x.detach(), moe.w_router.detach(), moe.top_k)
    weights.requires_grad_()
    w = [p.detach().clone().requires_grad_() for p in (moe.w_gate, moe.w_up, moe.w_down)]
    ws = [p.detach().clone().requires_grad_() for p in (moe.ws_gate, moe.ws_up, moe.ws_down)] if shared else []

    def op(x, weights, *weights_and_shared):
        return moe_experts(x, ids, weights, *weights_and_shared)

    assert torch.autograd.gradcheck(op, (x, weights, *w, *ws), eps=1e-6, atol=1e-7)
    torch.testing.assert_close(op(x, weights, *w, *ws), reference.experts(x, ids, weights, *w, *ws))


def test_fp32_matches_the_fp64_reference():
    moe = tiny_moe()
    ref = reference_of(moe)
    moe32 = tiny_moe(dtype=torch.float32)
    moe32.load_state_dict(moe.state_dict())
    x = torch.randn(33, 8, dtype=torch.float64)
    out32, got = grads(moe32, x.float())
    out, want = grads(ref, x)
    torch.testing.assert_close(out32, out.float(), rtol=1e-5, atol=1e-6)
    for name in want:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want[name].float(), rtol=1e-4, atol=1e-5, msg=name)


def test_selection_bias_steers_routing_and_balances_load():
    moe = tiny_moe(selection_bias=True)
    x = torch.randn(64, 8, dtype=torch.float64)
    moe.selection_bias[2] = 10.0  # expert 2 wins every token's first slot
    ids, _ = moe.route(x)
    assert (ids[:, 0] == 2).all()
    torch.testing.assert_close(moe(x), reference_of(moe)(x))
    load = moe.update_selection_bias(rate=0.5)
    assert load[2] == 128  # two forward passes of 64 tokens
    assert moe.selection_bias[2] == 9.5 and (moe.expert_load == 0).all()
    assert (moe.selection_bias[[0, 1, 3]] == 0.5).all()


def test_tokens_keep_their_leading_dimensions():
    moe = tiny_moe()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    assert moe(x).shape == (2, 3, 8)


def test_a_weight_changed_in_place_between_forward_and_backward_raises():
    moe = tiny_moe()
    out = moe(torch.randn(5, 8, dtype=torch.float64, requires_grad=True))
    with torch.no_grad():
        moe.w_gate.add_(1.0)  # moka's saved state points into w_gate: its gradient would be wrong
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()



def test_the_layers_input_is_released_by_backward_while_its_output_lives():
    # Autograd releases what it saved once backward has run; moka's saved state must not keep the
    # input (an activation as large as the layer's output) alive for as long as the graph lives.
    moe = tiny_moe()
    leaf = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    x = leaf * 2
    x_alive = weakref.ref(x)
    out = moe(x)
    del x
    assert x_alive() is not None  # saved for backward
    out.sum().backward()
    assert x_alive() is None and out.grad_fn is not None


def test_a_forward_without_autograd_skips_the_autograd_function(monkeypatch):
    moe = tiny_moe()
    x = torch.randn(5, 8, dtype=torch.float64)
    want = moe(x)
    monkeypatch.setattr(moka.torch._MoE, "apply", None)  # a call through it would raise
    for no_autograd in (torch.no_grad, torch.inference_mode):
        with no_autograd():
            got = moe(x)
        assert got.grad_fn is None and torch.equal(got, want)


def test_threads_sharing_one_module_or_the_op_get_the_results_of_one_thread():
    import threading
    moe = tiny_moe(shared=5)
    inputs = [torch.randn(5 + 3 * i, 8, dtype=torch.float64) for i in range(8)]

    def step(x):
        x = x.clone().requires_grad_()
        out = moe(x)
        ids, weights = reference.route(x.detach(), moe.w_router.detach(), moe.top_k)
        op = moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down)
        (out.square().sum() + op.sum()).backward(inputs=[x])
        return out.detach(), op.detach(), x.grad

    alone = [step(x) for x in inputs]
    mismatches = [0] * len(inputs)

    def run(i):
        for _ in range(10):
            if not all(torch.equal(a, b) for a, b in zip(step(inputs[i]), alone[i])):
                mismatches[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mismatches == [0] * len(inputs)


def test_copies_pickles_and_saves_of_a_used_module_compute_what_it_computes():
    import copy
    import io
    import pickle
    moe = tiny_moe(shared=5)
    x = torch.randn(6, 8, dtype=torch.float64)
    want = moe(x)
    buffer = io.BytesIO()
    torch.save(moe, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(moe), pickle.loads(pickle.dumps(moe)), torch.load(buffer, weights_only=False)):
        assert other._engines == {}
        assert torch.equal(other(x), want)


def test_an_empty_batch_runs_forward_and_backward():
    moe = tiny_moe(shared=5)
    x = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    out.sum().backward()
    assert out.shape == (0, 8) and x.grad.shape == (0, 8)
    ids = torch.empty(0, 2, dtype=torch.int32)
    weights = torch.empty(0, 2, dtype=torch.float64, requires_grad=True)
    moe_experts(x, ids, weights, moe.w_gate, moe.w_up, moe.w_down).sum().backward()
    assert weights.grad.shape == (0, 2)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_routing_aux_outputs_and_losses_match_a_hand_computation(score):
    torch.manual_seed(3)
    moe = MoE(8, 6, 4, 2, score=score, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out, aux = moe(x, return_aux=True)
    assert torch.equal(out, moe(x))  # the same output as without aux
    tokens = x.reshape(-1, 8)
    ids, _ = reference.route(tokens.detach(), moe.w_router.detach(), 2, score=score)
    counts = torch.bincount(ids.flatten().long(), minlength=4)
    assert torch.equal(aux.tokens_per_expert, counts)
    logits = tokens @ moe.w_router.t()
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(aux.router_logits, logits)
    torch.testing.assert_close(aux.router_probs, probs)
    torch.testing.assert_close(aux.load_balancing_loss, 4 * (counts / 20.0 * probs.mean(0)).sum())
    torch.testing.assert_close(aux.z_loss, (torch.logsumexp(logits, -1) ** 2).mean())
    (aux.load_balancing_loss + aux.z_loss).backward()
    assert moe.w_router.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


@pytest.mark.parametrize("score, renormalize", [("softmax", False), ("sigmoid", True)])
def test_gradients_through_every_aux_output_match_a_torch_block(score, renormalize):
    """A loss on the output, the logits and probabilities themselves and both losses: moka's router
    backward takes all their gradients; the same loss on the pure-torch block gives the same ones."""
    torch.manual_seed(5)
    moe = MoE(8, 6, 4, 2, 3, score=score, renormalize=renormalize, dtype=torch.float64)
    ref = reference_of(moe)
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    r_out, r_logits, r_probs = (torch.randn(21, n, dtype=torch.float64) for n in (8, 4, 4))

    def loss_of(out, logits, probs, balance, z):
        return ((out.reshape(-1, 8) * r_out).sum() + (logits * r_logits).sum() + (probs * r_probs).sum() + 0.3 * balance
                - 0.7 * z)

    xm = x.clone().requires_grad_()
    out, aux = moe(xm, return_aux=True)
    loss_of(out, aux.router_logits, aux.router_probs, aux.load_balancing_loss, aux.z_loss).backward()

    xr = x.clone().requires_grad_()
    tokens = xr.reshape(-1, 8)
    logits = tokens @ ref.w_router.t()
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    counts = torch.bincount(reference.route(tokens.detach(), ref.w_router.detach(), 2, score=score)[0].flatten().long(),
                            minlength=4)
    balance = 4 * (counts / 42.0 * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    loss_of(ref(xr), logits, probs, balance, z).backward()

    assert torch.equal(aux.tokens_per_expert, counts)
    torch.testing.assert_close(xm.grad, xr.grad)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, msg=name)


def test_a_loss_on_the_aux_losses_alone_reaches_the_router():
    """No gradient for the output (None into moka's backward): the experts' weights get zeros, the
    router the losses' gradients; without autograd the aux outputs are the same values."""
    torch.manual_seed(6)
    moe = tiny_moe()
    x = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    _, aux = moe(x, return_aux=True)
    (aux.load_balancing_loss + aux.z_loss).backward()
    assert moe.w_router.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert moe.w_gate.grad.abs().sum() == 0 and moe.w_down.grad.abs().sum() == 0
    with torch.no_grad():
        _, again = moe(x, return_aux=True)
    for got, want in zip(again, aux):
        assert torch.equal(got, want)


def test_routing_aux_of_an_empty_batch_is_zero():
    moe = MoE(8, 6, 4, 2, dtype=torch.float64)
    out, aux = moe(torch.zeros(0, 8, dtype=torch.float64), return_aux=True)
    assert out.shape == (0, 8) and aux.tokens_per_expert.sum() == 0
    assert aux.load_balancing_loss.item() == 0 and aux.z_loss.item() == 0
