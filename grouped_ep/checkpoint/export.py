"""Export a (sharded) model to the Hugging Face safetensors layout with per-expert keys.

Stacked expert weights are split into the per-expert 2D keys that Hugging Face checkpoints
use (and that transformers v5 fuses back on load):

    <prefix>.gate_up_proj [E, 2I, H] -> <prefix>.{i}.gate_proj.weight [I, H]  (rows 0:I)
                                        <prefix>.{i}.up_proj.weight   [I, H]  (rows I:2I)
    <prefix>.down_proj    [E, H, I]  -> <prefix>.{i}.down_proj.weight [H, I]

Every other tensor keeps its name. Expert ids are written in numeric order.

A transformers model is exported with transformers' own reverse conversion
(`revert_weight_conversion`, what `save_pretrained` uses), so every architecture gets the keys
its loader expects (Mixtral: `block_sparse_moe.experts.{i}.w1/w3/w2.weight`). Writing
Qwen-style names for a Mixtral would load with silently re-initialized experts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

INDEX_FILE = "model.safetensors.index.json"
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB" (10^9) or "500MiB" (2^20)."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else ""
        if not m or (unit and unit not in _SIZE_UNITS):
            raise ValueError(f"export_hf: max_shard_size {size!r} is not a size like '5GB'")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit or "B"])
    if n <= 0:
        raise ValueError(f"export_hf: max_shard_size must be positive, got {size!r}")
    return n


def split_expert_tensor(name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """Per-expert (key, tensor) pairs for a stacked expert weight, or None for any other tensor.

    `name` ending in `gate_up_proj` with `full` [E, 2I, H] gives gate (first I rows) and up
    (last I rows) per expert; `down_proj` with `full` [E, H, I] gives one matrix per expert.
    """
    prefix, _, leaf = name.rpartition(".")
    if full.dim() != 3 or leaf not in ("gate_up_proj", "down_proj"):
        return None
    pre = f"{prefix}." if prefix else ""
    if leaf == "down_proj":
        return [(f"{pre}{i}.down_proj.weight", full[i]) for i in range(full.shape[0])]
    if full.shape[1] % 2:
        raise ValueError(f"export_hf: {name} has shape {list(full.shape)}; dim 1 must be 2*I")
    inter = full.shape[1] // 2
    out = []
    for i in range(full.shape[0]):  # numeric expert order: 0, 1, ..., 9, 10 (never "10" < "2")
        out.append((f"{pre}{i}.gate_proj.weight", full[i, :inter]))
        out.append((f"{pre}{i}.up_proj.weight", full[i, inter:]))
    return out


def hf_items(model: nn.Module, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (key, tensor) pairs a Hugging Face checkpoint holds for the model tensor `name`."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # no transformers: our own split for stacked experts
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        return list(revert_weight_conversion(model, {name: full}).items())
    return split_expert_tensor(name, full) or [(name, full)]


def _full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each state-dict entry; DTensors gathered (a collective)."""
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied weights: written once, as transformers does
            continue
        seen.add(id(t))
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, t


def export_hf(
    model: nn.Module, dir: str | os.PathLike, max_shard_size: int | str = "5GB"
) -> Path | None:
    """Write `model` as a Hugging Face checkpoint: safetensors shards, index, config.json.

    Call on every rank (gathering DTensors is collective); rank 0 writes. Stacked expert weights
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] become per-expert 2D keys
    (`...{i}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I]); other names stay.

    Args:
        model: the model; parameters may be DTensors (gathered one at a time).
        dir: output directory (created).
        max_shard_size: most bytes per safetensors file, e.g. "5GB" or an int.

    Returns:
        The index file path on rank 0, None on other ranks.
    """
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    out_dir = Path(dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    shard: dict[str, torch.Tensor] = {}  # the file being filled
    shard_bytes = 0
    written: list[str] = []  # temporary names of the finished files
    weight_map: dict[str, int] = {}  # key -> index into `written`
    total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f".tmp-model-{len(written) + 1:05d}.safetensors"
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            written.append(name)
            shard, shard_bytes = {}, 0

    for name, full in _full_tensors(model):  # every rank: the gathers are collective
        if rank != 0:
            continue
        for key, t in hf_items(model, name, full):
            # safetensors needs contiguous tensors that own their bytes.
            t = t.to("cpu").contiguous().clone()
            if shard_bytes and shard_bytes + t.nbytes > limit:
                flush()
            shard[key] = t
            shard_bytes += t.nbytes
            total += t.nbytes
            weight_map[key] = len(written)
    if rank != 0:
        return None
    flush()

    # Final names need the shard count, known only now: rename the finished files.
    n = len(written)
    final = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for tmp, name in zip(written, final):
        os.replace(out_dir / tmp, out_dir / name)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: final[i] for k, i in weight_map.items()},
    }
    index_path = out_dir / INDEX_FILE
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(out_dir))
    return index_path
