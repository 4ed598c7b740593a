"""Tiny checkpoints for the loader tests: Hugging Face ones written by transformers itself, and
hand-made safetensors files (including corrupt ones).

    from _ckpt_helpers import tiny_qwen3_moe, save_hf, write_safetensors, raw_safetensors
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch


def tiny_qwen3_moe_config(experts: int = 8, layers: int = 2):
    """The demo's tiny Qwen3-MoE, smaller still: hidden 32, expert intermediate 16."""
    from grouped_ep.demo.model import tiny_qwen3_moe_config as demo_config

    return demo_config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=experts,
        num_hidden_layers=layers,
        head_dim=8,
        norm_topk_prob=False,
        max_position_embeddings=32768,
    )


def tiny_mixtral_config(experts: int = 4):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_local_experts=experts,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )


def save_hf(
    directory: str | Path,
    config,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "24KB",
) -> Path:
    """Build the transformers model for `config` with random weights (seeded) and write it with
    its own `save_pretrained` (several shard files with the default max_shard_size)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # make every tensor distinct, norms included
        for p in model.parameters():
            p.normal_()
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def from_pretrained_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The state dict transformers' own `from_pretrained` builds from `directory`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def meta_model(config, dtype: torch.dtype = torch.float32):
    """transformers' model for `config` on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).to(dtype)


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A valid safetensors file written by the safetensors library."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return Path(path)


def raw_safetensors(
    path: str | Path, header: object, data: bytes, length: int | None = None
) -> Path:
    """A file with an arbitrary header (any JSON value, or raw bytes) and data section; the
    8-byte length prefix is `length` if given (to lie about it) else the real header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    Path(path).write_bytes(struct.pack("<Q", n) + raw + data)
    return Path(path)


def write_index(directory: str | Path, weight_map: dict[str, str]) -> Path:
    path = Path(directory) / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def rewrite_metadata(step: str | Path, meta) -> None:
    """Write `meta` as the `.metadata` of checkpoint directory `step` and record its new length
    and CRC32C in the manifest, as a save would: a crafted, well-formed `.metadata` (the CRC
    check refuses any other change)."""
    import pickle

    from grouped_ep.checkpoint.checksum import file_crc

    step = Path(step)
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = json.loads((step / "grouped_ep.json").read_text())
    manifest["metadata_crc32c"] = file_crc(step / ".metadata")
    (step / "grouped_ep.json").write_text(json.dumps(manifest))


def interrupt_outcome(call, done: str) -> str:
    """What a rank saw of `call`: "KeyboardInterrupt", a CheckpointError's text, or `done`."""
    from grouped_ep.checkpoint import CheckpointError

    try:
        call()
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except CheckpointError as e:
        return str(e)
    return done
