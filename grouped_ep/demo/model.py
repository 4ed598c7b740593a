"""The demo's tiny model and data, shared with the tests and benches.

`tiny_qwen3_moe_config` is the one tiny transformers Qwen3-MoE config of the project (tests
override single fields); `make_checkpoint` writes it with transformers' own `save_pretrained`.
The training data is a short built-in text as byte-level tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TEXT = (
    "Mixture-of-Experts models route each token to a few experts. Expert parallelism places "
    "different experts on different ranks, so every rank must hold its own experts and no "
    "other rank's. A loader that broadcasts rank zero's tensors gives every rank the same "
    "experts and the run trains on the wrong weights without any error. Checkpoints must "
    "record how each tensor was sharded, hold each byte once, and load again on another "
    "number of ranks. A grouped matrix product computes every expert's tokens in one call, "
    "with empty experts, odd group sizes and no host synchronization. "
) * 4
GLOBAL_BATCH = 8
SEQ = 48


def tiny_qwen3_moe_config(**overrides):
    """A tiny Qwen3-MoE config (8 experts of intermediate 32, top-2, 3 layers, hidden 64, vocab
    256); keyword arguments replace single fields."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE written by transformers itself, in several safetensors shards."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    model.save_pretrained(path, max_shard_size="200KB")
    return path


def tokens() -> torch.Tensor:
    return torch.tensor(list(TEXT.encode()), dtype=torch.long)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share (sequences rank, rank + world, ...) of the step's global batch."""
    data = tokens()
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(data) - SEQ - 1, (GLOBAL_BATCH,), generator=g)[rank::world]
    seqs = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
    return seqs[:, :-1], seqs[:, 1:]


def eval_batch() -> torch.Tensor:
    return tokens()[: 2 * SEQ].view(2, SEQ)


def num_experts(config) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"demo: {type(config).__name__} names no expert count")


def factor(world: int, ep: int | None, experts: int) -> tuple[int, int]:
    """(dp, ep) for `world` ranks: EP as wide as possible that divides both world and experts."""
    if ep is None:
        ep = max(e for e in range(1, world + 1) if world % e == 0 and experts % e == 0)
    if world % ep or experts % ep:
        sys.exit(f"demo: --ep {ep} must divide the world size {world} and the {experts} experts")
    return world // ep, ep
