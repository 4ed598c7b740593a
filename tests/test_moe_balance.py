"""MoE router outputs, load balancing (aux loss, expert bias) and swappable dispatch, single
process, against hand-written references."""

from __future__ import annotations

import copy

import pytest
import torch

from grouped_ep.moe import (
    LocalDispatcher,
    MoE,
    RouterOutput,
    Routing,
    load_balancing_loss,
    route,
    set_aux_loss_scale,
    update_expert_bias,
)


def aux_loss_ref(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/Mixtral loss written out token by token: E * sum_i f_i * P_i."""
    num_tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    chosen = [set(probs[t].topk(top_k).indices.tolist()) for t in range(num_tokens)]
    total = 0.0
    for i in range(num_experts):
        f_i = sum(1 for t in range(num_tokens) if i in chosen[t]) / (num_tokens * top_k)
        p_i = sum(probs[t, i] for t in range(num_tokens)) / num_tokens
        total = total + f_i * p_i
    return num_experts * total


def skewed_moe(**kwargs) -> tuple[MoE, torch.Tensor]:
    """An 8-expert top-2 MoE whose router sends most tokens to experts 0 and 1, and the token
    direction `d` that does it (tokens are `randn + d`)."""
    torch.manual_seed(0)
    moe = MoE(16, 16, 8, 2, **kwargs)
    d = torch.randn(16)
    d /= d.norm()
    with torch.no_grad():
        moe.router.weight.mul_(0.5)
        moe.router.weight[:2] += 2.0 * d
    return moe, d


def test_plain_call_returns_hidden_states_only_and_router_outputs_on_request():
    moe, d = skewed_moe()
    x = torch.randn(3, 5, 16) + d
    y = moe(x)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    y2, out = moe(x, return_router_outputs=True)
    assert isinstance(out, RouterOutput) and out.aux_loss is None
    torch.testing.assert_close(y2, y, atol=0, rtol=0)
    flat = x.reshape(-1, 16)
    torch.testing.assert_close(out.logits, flat @ moe.router.weight.T)
    ids = torch.softmax(flat @ moe.router.weight.T, -1).topk(2).indices
    assert out.tokens_per_expert.dtype == torch.int64
    assert out.tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()
    assert out.tokens_per_expert[:2].sum() > 15  # the skew is real: 0 and 1 take most of 30


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_aux_loss_matches_hand_written_reference(top_k):
    torch.manual_seed(top_k)
    logits = 2 * torch.randn(11, 6, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(probs.topk(top_k).indices.reshape(-1), minlength=6)
    got = load_balancing_loss(probs, counts, top_k)
    torch.testing.assert_close(got, aux_loss_ref(logits, top_k), atol=1e-12, rtol=0)
    # Bounds: 1 for a uniform router and balanced counts, E when everything goes to expert 0.
    uniform = torch.full((12, 6), 1 / 6, dtype=torch.float64)
    balanced = torch.full((6,), 12 * top_k // 6)
    assert abs(load_balancing_loss(uniform, balanced, top_k).item() - 1) < 1e-12
    collapsed = torch.zeros(12, 6, dtype=torch.float64)
    collapsed[:, 0] = 1
    counts0 = torch.zeros(6, dtype=torch.int64)
    counts0[0] = 12 * top_k
    assert abs(load_balancing_loss(collapsed, counts0, top_k).item() - 6) < 1e-12


@pytest.mark.parametrize("scale", [1.0, 0.25], ids=["scale1", "scale_quarter"])
def test_moe_aux_loss_value_and_gradient_match_reference(scale):
    """The backward adds scale * coef * d(aux)/d(params), exactly as an explicit loss
    term (`set_aux_loss_scale`, e.g. 1/N for N accumulated micro-batches)."""
    coef = 0.37
    moe, d = skewed_moe(aux_loss_coef=coef)
    moe.double()
    set_aux_loss_scale(moe, scale)
    plain = copy.deepcopy(moe)
    plain.aux_loss_coef = 0.0
    x = (torch.randn(20, 16) + d).double()
    dy = torch.randn(20, 16, dtype=torch.float64)

    y, out = moe(x, return_router_outputs=True)
    ref_aux = aux_loss_ref(x @ moe.router.weight.detach().T, 2)
    torch.testing.assert_close(out.aux_loss, ref_aux, atol=1e-12, rtol=0)
    assert not out.aux_loss.requires_grad  # for logging; its gradient is already in y
    (y * dy).sum().backward()

    y_ref = plain(x)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)  # the forward value is untouched
    logits = x @ plain.router.weight.T
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(probs.topk(2).indices.reshape(-1), minlength=8)
    ((y_ref * dy).sum() + scale * coef * load_balancing_loss(probs, counts, 2)).backward()
    for (name, p), q in zip(moe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10, msg=name)
    assert moe.router.weight.grad.abs().sum() > 0


def test_expert_bias_changes_selection_not_weights():
    x = torch.tensor([[3.0, 2.0, 0.0, 1.0]])
    p = torch.softmax(x, -1)[0]
    bias = torch.tensor([0.0, -1.0, 0.0, 0.0])  # expert 1 may not be chosen any more
    _, weights, ids = route(x, torch.eye(4), 2, norm_topk_prob=False, expert_bias=bias)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights[0], p[[0, 3]])  # unbiased probabilities
    _, weights, _ = route(x, torch.eye(4), 2, expert_bias=bias)
    torch.testing.assert_close(weights[0], p[[0, 3]] / p[[0, 3]].sum())


def test_bias_update_rule_counts_only_training_forwards():
    moe, d = skewed_moe(expert_bias_gamma=0.1)
    assert "expert_bias" in moe.state_dict()  # a persistent buffer: checkpoints hold it
    x = torch.randn(40, 16) + d
    moe.eval()
    moe(x)
    assert update_expert_bias(moe).sum() == 0  # eval forwards are not counted
    moe.train()
    # Forwards in training mode that cannot train (an eval or generation callback): not counted,
    # and an inference-mode one leaves nothing that breaks the next training step.
    with torch.inference_mode():
        moe(x)
    with torch.no_grad():
        moe(x)
    y1, out1 = moe(x, return_router_outputs=True)
    y2, out2 = moe(x[:7], return_router_outputs=True)
    (y1.sum() + y2.sum()).backward()
    counts = update_expert_bias(moe)
    want = out1.tokens_per_expert + out2.tokens_per_expert
    assert counts.tolist() == [want.tolist()]
    load = want.double()
    expected = 0.1 * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.expert_bias, expected.float())
    assert moe.expert_bias[0] < 0  # the overloaded expert is pushed down
    assert update_expert_bias(moe).sum() == 0  # the counts were cleared
    assert update_expert_bias(torch.nn.Linear(2, 2)) is None


def _train_skewed(gamma: float | None, steps: int = 200) -> tuple[float, float]:
    moe, d = skewed_moe(expert_bias_gamma=gamma)
    target = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    loads = []
    for _ in range(steps):
        x = torch.randn(256, 16, generator=g) + d
        y, out = moe(x, return_router_outputs=True)
        (y - target(x).detach()).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if gamma is not None:
            update_expert_bias(moe)
        loads.append(out.tokens_per_expert.double())
    first = loads[0]
    last = torch.stack(loads[-20:]).sum(0)  # the last 20 steps: 10240 routed copies
    return (first.max() / first.mean()).item(), (last.max() / last.mean()).item()


def test_loading_a_state_dict_drops_counts_of_earlier_forwards(tmp_path):
    """A warm-up training step before resuming: its token counts belong to no step of the
    loaded run, and the first update_expert_bias after the load moved the bias by them."""
    from grouped_ep import checkpoint

    moe, d = skewed_moe(expert_bias_gamma=0.1)
    saved = copy.deepcopy(moe.state_dict())
    checkpoint.save(tmp_path / "ckpt", moe)
    x = torch.randn(40, 16) + d
    from safetensors.torch import save_file

    import grouped_ep

    save_file(saved, str(tmp_path / "model.safetensors"))
    loads = (
        lambda: moe.load_state_dict(saved),
        lambda: checkpoint.load(tmp_path / "ckpt", moe),
        lambda: grouped_ep.load_sharded(moe, tmp_path / "model.safetensors"),
    )
    for load in loads:
        moe(x).sum().backward()
        assert moe.peek_load_counts().sum() == 40 * moe.top_k
        load()
        assert moe.peek_load_counts().sum() == 0
        assert update_expert_bias(moe).sum() == 0 and not moe.expert_bias.any()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_counts_each_token_once(use_reentrant):
    # The recompute in backward is a training forward with grad enabled: it counted again.
    from torch.utils.checkpoint import checkpoint

    moe, d = skewed_moe(expert_bias_gamma=0.1)
    x = (torch.randn(40, 16) + d).requires_grad_()
    y, out = moe(x, return_router_outputs=True)
    y.sum().backward()
    want = update_expert_bias(copy.deepcopy(moe))
    assert want.tolist() == [out.tokens_per_expert.tolist()]
    moe.take_load_counts()
    checkpoint(moe, x, use_reentrant=use_reentrant).sum().backward()
    assert update_expert_bias(moe).tolist() == want.tolist()


def test_expert_bias_balances_a_skewed_router_and_without_it_the_skew_stays():
    start, end = _train_skewed(gamma=3e-3)
    start_plain, end_plain = _train_skewed(gamma=None)
    print(
        f"max/mean tokens per expert over 200 steps: with expert bias {start:.2f} -> {end:.3f}, "
        f"without {start_plain:.2f} -> {end_plain:.3f}"
    )
    assert start > 2.5 and start_plain > 2.5
    assert end < 1.3
    assert end_plain > 2.5


class CountingDispatcher:
    """A user dispatcher: LocalDispatcher's work, plus a record of the calls."""

    def __init__(self) -> None:
        self.inner, self.calls = LocalDispatcher(), []

    def dispatch(self, x, routing):
        self.calls.append(("dispatch", routing.counts.tolist()))
        return self.inner.dispatch(x, routing)

    def combine(self, y, handle):
        self.calls.append(("combine", y.shape[0]))
        return self.inner.combine(y, handle)


def test_model_code_can_pass_its_own_dispatcher():
    moe, d = skewed_moe()
    custom = copy.deepcopy(moe)
    custom.dispatcher = CountingDispatcher()
    x = torch.randn(9, 16) + d
    y, out = custom(x, return_router_outputs=True)
    torch.testing.assert_close(y, moe(x), atol=0, rtol=0)
    assert custom.dispatcher.calls == [
        ("dispatch", out.tokens_per_expert.tolist()),
        ("combine", 18),
    ]


def test_local_dispatcher_groups_by_expert_and_combines_with_weights():
    x = torch.arange(12.0).view(3, 4)
    ids = torch.tensor([[2, 0], [0, 1], [2, 2]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2]])
    routing = Routing.from_topk(ids, weights, 4)
    assert routing.counts.tolist() == [2, 1, 3, 0]
    disp = LocalDispatcher()
    local_x, offs, handle = disp.dispatch(x, routing)
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 3, 6, 6]
    # expert 0: tokens 0, 1; expert 1: token 1; expert 2: tokens 0, 2, 2 (token order kept)
    torch.testing.assert_close(local_x, x[[0, 1, 1, 0, 2, 2]])
    y = disp.combine(local_x * 10, handle)
    torch.testing.assert_close(y, 10 * x * weights.sum(1, keepdim=True))
    with pytest.raises(ValueError, match="expert_ids"):
        Routing.from_topk(ids, weights[:, :1], 4)


def test_bad_balancing_arguments_are_named():
    with pytest.raises(ValueError, match="aux_loss_coef"):
        MoE(8, 8, 4, 2, aux_loss_coef=-1.0)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        MoE(8, 8, 4, 2, aux_loss_coef=float("nan"))
    with pytest.raises(ValueError, match="expert_bias_gamma"):
        MoE(8, 8, 4, 2, expert_bias_gamma=0.0)
    with pytest.raises(ValueError, match="expert_bias_gamma"):
        MoE(8, 8, 4, 2, expert_bias_gamma=float("nan"))
    for top_k in (1.5, True, 0, 5):
        with pytest.raises(ValueError, match="top_k must be an int"):
            MoE(8, 8, 4, top_k)
    with pytest.raises(ValueError, match="scale"):
        set_aux_loss_scale(MoE(8, 8, 4, 2), float("nan"))


def test_output_with_aux_loss_may_be_changed_in_place():
    # The aux gradient rides on the routing weights: model code may scale or add to the output
    # in place (`out *= routed_scaling_factor`), and gets the same gradients as out of place.
    moe, d = skewed_moe(aux_loss_coef=0.1)
    moe.double()
    other = copy.deepcopy(moe)
    x = (torch.randn(12, 16) + d).double()
    y = moe(x)
    y.mul_(2.0).add_(x)
    y.sum().backward()
    (other(x) * 2.0 + x).sum().backward()
    for (name, p), q in zip(moe.named_parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=0, msg=name)


def test_expert_bias_stays_fp32_when_the_model_is_cast():
    # Steps of gamma = 1e-3 around 0.75 vanish in bf16 (its spacing there is 2^-8): the bias is
    # kept fp32 through .to(dtype) and the update runs in fp32.
    moe = MoE(16, 8, 4, 2, expert_bias_gamma=1e-3).to(torch.bfloat16)
    assert moe.expert_bias.dtype == torch.float32 and moe.router.weight.dtype == torch.bfloat16
    moe.expert_bias.copy_(torch.tensor([0.75, 0.0, 0.0, 0.0]))
    for _ in range(20):
        moe._load_counts = torch.tensor([0, 10, 10, 10])
        update_expert_bias(moe)
    expect = torch.tensor([0.75, 0.0, 0.0, 0.0]) + 20 * torch.tensor([1e-3, -1e-3, -1e-3, -1e-3])
    torch.testing.assert_close(moe.expert_bias, expect, atol=1e-6, rtol=0)
    moe.double()
    assert moe.expert_bias.dtype == torch.float32
    torch.testing.assert_close(moe.expert_bias, expect, atol=1e-6, rtol=0)
    moe(torch.randn(5, 16, dtype=torch.float64))  # still runs in the model's dtype
    # load_state_dict(..., assign=True) of a bf16 state dict put a bf16 bias in place.
    state = {k: v.to(torch.bfloat16) for k, v in moe.state_dict().items()}
    moe.load_state_dict(state, assign=True)
    assert moe.expert_bias.dtype == torch.float32


def test_layers_of_different_expert_counts_update_together():
    """torch.stack of [4] and [8] counts raised, after every layer's counts had been cleared: a
    retry dropped the step's load."""
    model = torch.nn.Sequential(
        MoE(16, 8, 4, 2, expert_bias_gamma=1e-2), MoE(16, 8, 8, 2, expert_bias_gamma=1e-2)
    )
    model(torch.randn(6, 16)).sum().backward()
    want = [m.peek_load_counts().clone() for m in model]
    counts = update_expert_bias(model)
    assert isinstance(counts, list) and [c.tolist() for c in counts] == [w.tolist() for w in want]
    for m, load in zip(model, want):
        load = load.float()
        torch.testing.assert_close(m.expert_bias, 1e-2 * torch.sign(load.mean() - load))
        assert m.peek_load_counts().sum() == 0  # cleared once used


def test_compiled_moe_reads_a_new_aux_loss_scale_without_recompiling():
    """The scale was a Python float in the graph: each new value (a GradScaler's every change)
    recompiled, and after 8 dynamo fell back to eager for good."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    moe = MoE(16, 8, 4, 2, aux_loss_coef=0.1)
    compiled = torch.compile(moe)
    x = torch.randn(5, 16)
    for scale in (1.0, 0.5, 0.25):
        set_aux_loss_scale(moe, scale)
        moe.zero_grad()
        compiled(x).sum().backward()
        got = moe.router.weight.grad.clone()
        moe.zero_grad()
        moe(x).sum().backward()
        torch.testing.assert_close(got, moe.router.weight.grad, msg=f"scale {scale}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_bad_sizes_and_inputs_are_named():
    for kwargs, name in (
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=4.0), "num_experts"),
        (dict(hidden=0), "hidden"),
        (dict(intermediate=8.5), "intermediate"),
    ):
        args = {"hidden": 16, "intermediate": 8, "num_experts": 4, "top_k": 1} | kwargs
        with pytest.raises(ValueError, match=f"MoE: {name} must be an int >= 1"):
            MoE(**args)
    with pytest.raises(ValueError, match="aux_loss_coef must be a finite real number >= 0"):
        MoE(16, 8, 4, 2, aux_loss_coef=None)
    with pytest.raises(ValueError, match="set_aux_loss_scale: scale"):
        set_aux_loss_scale(MoE(16, 8, 4, 2), None)
    moe = MoE(16, 8, 4, 2)
    for x in (torch.randn(3, 15), torch.randn(3, 16, dtype=torch.float64), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"MoE: x must be \[\.\.\., 16\]"):
            moe(x)
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, num_experts=4\)"):
        Routing.from_topk(torch.tensor([[0, 4]]), torch.ones(1, 2), 4)


def test_moe_compiles_as_one_graph():
    """No graph break (fullgraph=True raises on one), and the gradients of eager."""
    moe = MoE(16, 8, 4, 2, aux_loss_coef=0.1, expert_bias_gamma=1e-3)
    x = torch.randn(5, 16)
    torch.compile(moe, fullgraph=True)(x).sum().backward()
    got = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe(x).sum().backward()
    torch.testing.assert_close(got, moe.router.weight.grad)


def test_autocast_takes_activations_of_another_dtype():
    moe = MoE(16, 8, 4, 2).to(torch.bfloat16)
    x = torch.randn(5, 16)  # fp32 activations into a bf16 layer: autocast casts them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    torch.testing.assert_close(out.float(), moe(x.bfloat16()).float(), rtol=0.02, atol=0.02)
    # autocast never casts float64: MoE's own error names x, not the router's matmul later
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="MoE: x"):
        moe(x.double())


def test_numpy_scalars_and_one_element_tensors_are_numbers():
    import numpy as np

    moe = MoE(np.int64(16), 8, np.int32(4), 2, aux_loss_coef=np.float32(0.01))
    assert moe.aux_loss_coef == pytest.approx(0.01)
    set_aux_loss_scale(moe, torch.tensor(0.5))
    assert moe.aux_loss_grad_scale == 0.5
    set_aux_loss_scale(moe, np.float64(0.25))
    assert moe.aux_loss_grad_scale == 0.25


def test_aux_scale_of_each_forward_holds_under_activation_checkpointing():
    """The scale was a saved tensor, which checkpointing recomputes in the backward: with both
    backwards after both forwards, each aux term took the last scale set (router gradient 1.8e-2
    off; a review). Kept on the forward's context now: the same gradient as without
    checkpointing (reentrant checkpointing reruns the forward at backward time, see README).
    torch.compile over the checkpointed layer (torchtitan's order) failed the backward's version
    check, the scale having been filled in place since the forward (a review)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    xs = [torch.randn(7, 16) for _ in range(2)]
    gys = [torch.randn(7, 16) for _ in range(2)]
    grads = {}
    for mode in ("plain", "checkpointed", "compiled over checkpointed"):
        torch.manual_seed(1)
        moe = MoE(16, 8, 4, 2, aux_loss_coef=0.5)
        run = {
            "plain": moe,
            "checkpointed": lambda x, moe=moe: checkpoint(moe, x, use_reentrant=False),
            "compiled over checkpointed": torch.compile(
                lambda x, moe=moe: checkpoint(moe, x, use_reentrant=False), backend="aot_eager"
            ),
        }[mode]
        losses = []
        for x, gy, s in zip(xs, gys, (0.25, 0.75)):
            set_aux_loss_scale(moe, s)
            losses.append(s * (run(x) * gy).sum())
        sum(losses).backward()
        grads[mode] = moe.router.weight.grad
    for mode in ("checkpointed", "compiled over checkpointed"):
        torch.testing.assert_close(grads[mode], grads["plain"], rtol=0, atol=1e-6, msg=mode)


def test_peek_load_counts_is_a_copy():
    """It returned the live count: a value kept for logging changed with the next forward, and
    zeroing it zeroed the layer's own count (a review)."""
    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 2, expert_bias_gamma=1e-3)
    moe(torch.randn(5, 16))
    kept = moe.peek_load_counts()
    assert int(kept.sum()) == 10
    moe(torch.randn(5, 16))
    kept.zero_()
    assert int(moe.peek_load_counts().sum()) == 20
    assert int(moe.take_load_counts().sum()) == 20 and int(moe.peek_load_counts().sum()) == 0


def test_second_derivatives_and_jvp_with_the_aux_loss():
    """torch.func's nested transforms sent the aux-loss gradient at every level: a Hessian was
    off by `coef * d aux`; hessian and jvp failed (no vmap or jvp rule). Every backward over one
    graph still sends it: a gradient penalty and a gradient norm taken before the backward
    (once per forward dropped it from the second pass). Against `loss + coef * aux` written
    out (reviews)."""
    torch.manual_seed(0)
    coef, lam = 0.01, 0.1
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    moe = MoE(16, 32, 4, 2, dtype=torch.float64, aux_loss_coef=coef)
    plain = copy.deepcopy(moe)
    plain.aux_loss_coef = 0.0
    params = {k: v.detach() for k, v in moe.named_parameters()}
    w = params["router.weight"]

    def loss(m, xi, r=None, written_out=False):
        given = {**params, "router.weight": r} if r is not None else dict(m.named_parameters())
        if not written_out:
            return (torch.func.functional_call(m, given, (xi,)) ** 2).sum()
        kwargs = {"return_router_outputs": True}
        out, ro = torch.func.functional_call(m, given, (xi,), kwargs)
        probs = torch.softmax(xi.reshape(-1, 16) @ given["router.weight"].T, -1)
        return (out**2).sum() + coef * load_balancing_loss(probs, ro.tokens_per_expert, 2)

    close = dict(rtol=1e-9, atol=1e-12)
    ours = lambda r: loss(moe, x, r)  # noqa: E731
    written_out = lambda r: loss(plain, x, r, written_out=True)  # noqa: E731
    want = torch.func.hessian(written_out)(w)
    assert want.abs().max() > 0
    torch.testing.assert_close(torch.func.hessian(ours)(w), want, **close)
    torch.testing.assert_close(torch.func.jacrev(torch.func.jacrev(ours))(w), want, **close)
    v = torch.randn_like(w)
    plain_out = lambda r: loss(plain, x, r)  # noqa: E731
    got, expected = torch.func.jvp(ours, (w,), (v,))[1], torch.func.jvp(plain_out, (w,), (v,))[1]
    torch.testing.assert_close(got, expected, **close)

    def penalized(m, written_out):  # an input-gradient penalty, then the backward
        xi = x.clone().requires_grad_()
        value = loss(m, xi, written_out=written_out)
        (gx,) = torch.autograd.grad(value, xi, create_graph=True)
        (value + lam * (gx**2).sum()).backward()
        return m.router.weight.grad

    got = penalized(copy.deepcopy(moe), False)
    torch.testing.assert_close(got, penalized(copy.deepcopy(plain), True), **close)

    def by_grad_and_value(m, written_out):  # the same penalty through torch.func, whose node
        # had sent the term: the value's backward then lost it (a review)
        gx, value = torch.func.grad_and_value(lambda xi: loss(m, xi, written_out=written_out))(x)
        (value + lam * (gx**2).sum()).backward()
        return m.router.weight.grad

    got = by_grad_and_value(copy.deepcopy(moe), False)
    torch.testing.assert_close(got, by_grad_and_value(copy.deepcopy(plain), True), **close)
    m, ref = copy.deepcopy(moe), copy.deepcopy(plain)
    value = loss(m, x)
    (norm_of,) = torch.autograd.grad(value, m.router.weight, retain_graph=True)
    value.backward()  # after a gradient norm taken with autograd.grad
    loss(ref, x, written_out=True).backward()
    torch.testing.assert_close(norm_of, ref.router.weight.grad, **close)
    torch.testing.assert_close(m.router.weight.grad, ref.router.weight.grad, **close)
