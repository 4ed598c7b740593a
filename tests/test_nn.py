"""GroupedExperts and MoE (single process) against plain per-expert PyTorch loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grouped_ep.nn import GroupedExperts, MoE, route

TOLS = {torch.float64: 1e-10, torch.float32: 1e-5}


def experts_ref(x, gate_up_proj, down_proj, sizes):
    """Per-expert loop with F.linear, as transformers' eager experts compute it."""
    out, start = [], 0
    for e, n in enumerate(sizes):
        xe = x[start : start + n]
        gate, up = F.linear(xe, gate_up_proj[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, down_proj[e]))
        start += n
    return torch.cat(out)


def moe_ref(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token: softmax, top-k, optional renormalization, weighted sum of experts."""
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    weights, ids = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    w1, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = ids[t, j]
            gate, up = (w1[e] @ x[t]).chunk(2)
            out[t] = out[t] + weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize(
    "sizes", [[3, 0, 5, 1], [0, 0, 7, 0], [0, 0, 0, 0]], ids=["empty_group", "skewed", "no_tokens"]
)
def test_grouped_experts_matches_loop(sizes, dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 6, dtype=dtype)
    assert experts.gate_up_proj.shape == (4, 12, 8) and experts.down_proj.shape == (4, 8, 6)
    x = torch.randn(sum(sizes), 8, dtype=dtype, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y = experts(x, offs)
    x_ref = x.detach().clone().requires_grad_(True)
    w1 = experts.gate_up_proj.detach().clone().requires_grad_(True)
    w2 = experts.down_proj.detach().clone().requires_grad_(True)
    y_ref = experts_ref(x_ref, w1, w2, sizes)
    tol = TOLS[dtype]
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(experts.gate_up_proj.grad, w1.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(experts.down_proj.grad, w2.grad, atol=tol, rtol=tol)
    empty = torch.tensor(sizes) == 0
    assert torch.all(experts.gate_up_proj.grad[empty] == 0)
    assert torch.all(experts.down_proj.grad[empty] == 0)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_matches_token_loop(top_k, norm_topk_prob):
    torch.manual_seed(1)
    moe = MoE(8, 6, 4, top_k, norm_topk_prob=norm_topk_prob, dtype=torch.float64)
    with torch.no_grad():
        moe.router.weight.mul_(3)  # uneven routing
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = moe_ref(moe, x_ref.view(-1, 8)).view(2, 5, 8)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-10, rtol=1e-10)
    for g, p in zip(grads, moe.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-10, rtol=1e-10)


def test_route_weights_and_order():
    x = torch.tensor([[3.0, 2.0, 0.0, 1.0]])
    logits, weights, ids = route(x, torch.eye(4), top_k=2)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(logits, x)
    p = torch.softmax(x, -1)[0]
    torch.testing.assert_close(weights[0], p[:2] / p[:2].sum())
    _, raw, _ = route(x, torch.eye(4), top_k=2, norm_topk_prob=False)
    torch.testing.assert_close(raw[0], p[:2])


def test_moe_on_meta_device_and_bad_arguments():
    with torch.device("meta"):
        moe = MoE(16, 8, 4, 2)
    assert moe.experts.gate_up_proj.is_meta and moe.experts.gate_up_proj.shape == (4, 16, 16)
    with pytest.raises(ValueError, match="top_k"):
        MoE(16, 8, 4, 5)
    with pytest.raises(ValueError, match="num_experts"):
        GroupedExperts(0, 16, 8)
    with pytest.raises(ValueError, match="intermediate"):
        GroupedExperts(4, 16, 0)
    with pytest.raises(ValueError, match="MoE: norm_topk_prob must be True or False, got 'no'"):
        MoE(16, 8, 4, 2, norm_topk_prob="no")  # was read as true


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("aux_loss_coef", [0.0, 0.01])
def test_moe_without_ep_never_syncs_the_host_on_cuda(aux_loss_coef):
    """Without EP, routing, permutation, the grouped GEMMs and combine stay on the device; so
    does the aux-loss gradient (its CPU coefficient was once copied to the GPU, blocking)."""
    torch.manual_seed(0)
    moe = MoE(64, 32, 8, 2, device="cuda", dtype=torch.bfloat16, aux_loss_coef=aux_loss_coef)
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().sum().backward()  # warm-up: lazy inits may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(x)
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(y).all() and torch.isfinite(moe.experts.gate_up_proj.grad).all()


def test_bad_arguments_are_named():
    # Each was accepted and failed later, or failed deep inside with a message naming nothing.
    from grouped_ep.moe import load_balancing_loss, route

    probs, counts = torch.full((4, 2), 0.5), torch.tensor([4, 4])
    for k in (0, -2, 1.5):
        with pytest.raises(ValueError, match="load_balancing_loss: top_k must be an int >= 1"):
            load_balancing_loss(probs, counts, k)  # 0 gave inf, -2 a negative loss
    for k in (0, 3):
        with pytest.raises(ValueError, match=r"route: top_k must be an int in \[1, 2\]"):
            route(torch.randn(4, 8), torch.randn(2, 8), k)
    with pytest.raises(TypeError, match="MoE: dispatcher must be an object with dispatch"):
        MoE(16, 8, 4, 2, dispatcher=object())  # failed at the first forward
