"""ExpertLoadCounter on a transformers Qwen3-MoE: counts equal the top-k of the router logits
that transformers itself returns (`output_router_logits=True`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import grouped_ep.hf  # noqa: F401  (registers experts_implementation="grouped_ep")
from grouped_ep.demo.model import tiny_qwen3_moe_config
from grouped_ep.moe import ExpertLoadCounter


@pytest.mark.parametrize("implementation", ["eager", "grouped_ep"])
def test_counts_match_transformers_router_logits(implementation):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen3_moe_config(num_hidden_layers=2)
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation(implementation)
    counter = ExpertLoadCounter(model)
    assert counter.names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    ids = torch.randint(0, 256, (2, 12))
    want = torch.zeros(2, 8, dtype=torch.int64)
    for batch in (ids, ids[:1, :5]):
        out = model(input_ids=batch, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            chosen = logits.topk(config.num_experts_per_tok, dim=-1).indices
            want[layer] += torch.bincount(chosen.reshape(-1), minlength=8)
    got = counter.local_counts()
    assert got.tolist() == want.tolist()
    assert got.sum().item() == 2 * (24 + 5) * config.num_experts_per_tok
    assert torch.equal(counter.global_counts(), got)  # no process group: the local counts
    counter.reset()
    assert counter.local_counts().sum() == 0
    counter.remove()
    model(input_ids=ids)
    assert counter.local_counts().sum() == 0  # no hooks left


def test_model_without_experts_is_an_error():
    with pytest.raises(ValueError, match="Linear has no transformers experts module"):
        ExpertLoadCounter(nn.Linear(2, 2))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_recompute_is_not_counted(reentrant):
    """The recompute in backward ran the counter's pre-hook again: every count was doubled."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen3_moe_config(num_hidden_layers=2)
    model = Qwen3MoeForCausalLM(config).train()
    model.set_experts_implementation("grouped_ep")
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # the older name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    counter = ExpertLoadCounter(model)
    ids = torch.randint(0, 256, (2, 7))
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert counter.local_counts().sum(1).tolist() == [14 * config.num_experts_per_tok] * 2


def test_transformers_expert_parallel_sentinel_routes():
    """transformers' own expert parallel marks routes to other ranks' experts with the id
    num_experts and weight 0: eager skips them; "grouped_ep" indexed out of range, and so did the
    counter."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    config = tiny_qwen3_moe_config()
    experts = Qwen3MoeExperts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    experts._is_expert_parallel = True
    e = experts.num_experts
    x = torch.randn(4, config.hidden_size)
    ids = torch.tensor([[0, e], [e, 1], [2, 0], [e, e]])
    weights = torch.tensor([[0.6, 0.0], [0.0, 0.3], [0.5, 0.5], [0.0, 0.0]])
    out = {}
    for impl in ("eager", "grouped_ep"):
        config._experts_implementation = impl
        xi = x.clone().requires_grad_(True)
        y = experts(xi, ids, weights)
        y.sum().backward()
        out[impl] = (y.detach(), xi.grad, experts.gate_up_proj.grad.clone())
        experts.zero_grad()
    for a, b in zip(out["eager"], out["grouped_ep"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * a.abs().max().item())
    model = nn.Sequential()
    model.add_module("experts", experts)
    counter = ExpertLoadCounter(model)
    experts(x, ids, weights)
    assert counter.local_counts()[0].tolist() == [2, 1, 1] + [0] * (e - 3)


def _hf_ep_counts(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    config = tiny_qwen3_moe_config(num_experts=8, num_hidden_layers=2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    reference = ExpertLoadCounter(model)
    with torch.no_grad():
        model(input_ids=ids)
    want = reference.global_counts()
    reference.remove()
    plan = {}
    for i in range(config.num_hidden_layers):
        experts = f"model.layers.{i}.mlp.experts"
        plan.update(
            {f"{experts}.gate_up_proj": "grouped_gemm", f"{experts}.down_proj": "grouped_gemm"}
        )
        plan[experts] = "ep_dispatch_experts"
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    tp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan)
    counter = ExpertLoadCounter(model)
    with torch.no_grad():
        model(input_ids=ids)
    return want, counter.global_counts(), model.model.layers[0].mlp.experts.num_experts


def test_transformers_expert_parallel_counts_every_expert():
    """Under transformers' own expert parallel `num_experts` is the local count (4 of 8) while
    the experts module is called with the router's global ids: experts 4-7 were taken for
    sentinels and dropped, and the counts had 4 columns."""
    from _dist import run_ranks

    for want, got, local in run_ranks(_hf_ep_counts, 2, timeout=150):
        assert local == 4  # the case is still the one described
        assert got.shape == (2, 8) and torch.equal(got, want), (got, want)
