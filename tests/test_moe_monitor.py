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
