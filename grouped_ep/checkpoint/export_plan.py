"""Planning an export to the Hugging Face layout: which keys each model tensor becomes, and
which rank writes them.

Every rank computes the same plan from global shapes alone (`plan`: one small all-gather of who
holds which expert rows). An expert weight whose local shard is a block of whole experts is a
"local" entry: each block's lowest holder converts its own experts and writes their keys. Any
other tensor, and model tensors that transformers' conversion merges into one key, are "whole"
entries, written by the least-loaded rank. `export.py` writes what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from grouped_ep._names import unwrapped_name
from grouped_ep.checkpoint.safetensors_writer import PlannedTensor
from grouped_ep.loading.converted import (
    conversion_groups,
    is_transformers_model,
    revert_conversion,
)


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
    return hf_group_items(model, {name: full})


def hf_group_items(
    model: nn.Module, tensors: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The (key, tensor) pairs for model tensors converted together: a conversion that merges
    several model tensors into one key (a fused `qkv_proj` from `q_proj`, `k_proj`, `v_proj`;
    text and vision experts in one per-expert list) needs all of them in one call."""
    if is_transformers_model(model):
        return list(revert_conversion(model, tensors).items())
    out = []
    for name, full in tensors.items():  # our own split for stacked experts; other names stay
        out += split_expert_tensor(name, full) or [(name, full)]
    return out


@dataclass
class Entry:
    """One state-dict tensor and how it is exported."""

    name: str
    tensor: torch.Tensor
    kind: str = "whole"  # "local": each block holder converts its own experts; "whole": one owner
    owner: int = 0  # the writer of a "whole" entry
    block: tuple[int, int] | None = None  # this rank's (first expert, count) for "local" entries
    position: int | None = None  # the dotted component of the keys that numbers the experts
    writes: dict[int, list[PlannedTensor]] = field(default_factory=dict)  # rank -> its keys
    # (name, tensor) of every model tensor converted together with this one, this one first;
    # set when a key of the checkpoint is made from several model tensors (always "whole").
    members: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _meta_items(model: nn.Module, name: str, shape, dtype) -> list[tuple[str, tuple[int, ...]]]:
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return [(k, tuple(v.shape)) for k, v in hf_items(model, name, meta)]


def _merge_groups(entries: list[Entry], model: nn.Module) -> list[Entry]:
    """Entries that transformers' conversion turns into keys together (`conversion_groups`)
    become one entry converted as a whole, placed where the first of them was."""
    by_name = {e.name: e for e in entries}
    first = {}
    for group in conversion_groups(model, [e.name for e in entries]):
        first[group[0]] = group
    out = []
    for e in entries:
        group = first.get(e.name)
        if group is None:
            continue  # converted with an earlier entry of its group
        if len(group) > 1:
            e.members = [(n, by_name[n].tensor) for n in group]
        out.append(e)
    return out


def _expert_position(keys: list[str]) -> int | None:
    """The dotted component that numbers the experts: the one numeric position that varies."""
    parts = [k.split(".") for k in keys]
    if len({len(p) for p in parts}) != 1:
        return None
    varying = [
        i
        for i in range(len(parts[0]))
        if all(p[i].isdigit() for p in parts) and len({p[i] for p in parts}) > 1
    ]
    return varying[0] if len(varying) == 1 else None


def renumber(key: str, position: int, first: int) -> str:
    parts = key.split(".")
    parts[position] = str(int(parts[position]) + first)
    return ".".join(parts)


def _on_dim0(p: object) -> bool:
    """A placement that keeps each rank's rows of dim 0 one contiguous block: `Replicate`, or
    `Shard(0)`, or the `_StridedShard(0)` that FSDP2 puts on "dp" over experts already
    `Shard(0)` on "ep" (each dp rank holds one contiguous part of its ep rank's block)."""
    if type(p) is Replicate:
        return True
    return type(p).__name__ in ("Shard", "_StridedShard") and getattr(p, "dim", None) == 0


def _local_block(t: torch.Tensor) -> tuple[int, int] | None:
    """(first expert, count) when this rank's shard of DTensor `t` is whole rows of dim 0."""
    if not isinstance(t, DTensor) or t.dim() < 1:
        return None
    if not all(_on_dim0(p) for p in t.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(t.to_local().shape) != tuple(shape) or tuple(shape[1:]) != tuple(t.shape[1:]):
        return None
    return (int(offset[0]), int(shape[0]))


def _plan_local(model: nn.Module, e: Entry, blocks: list[tuple[int, int] | None]) -> bool:
    """Fill `e.writes` from per-rank expert blocks; False if the conversion is not per expert."""
    if any(b is None for b in blocks):
        return False
    global_items = _meta_items(model, e.name, e.tensor.shape, e.tensor.dtype)
    position = _expert_position([k for k, _ in global_items])
    wanted = dict(global_items)
    seen: dict[tuple[int, int], int] = {}  # block -> the lowest rank holding it
    for r, b in enumerate(blocks):
        seen.setdefault(b, r)
    e.position = position
    covered: dict[str, tuple[int, ...]] = {}
    for (first, count), r in seen.items():
        if count == 0:
            continue
        if count != e.tensor.shape[0] and position is None:
            return False
        local = _meta_items(model, e.name, (count, *e.tensor.shape[1:]), e.tensor.dtype)
        keys = [
            (k if count == e.tensor.shape[0] else renumber(k, position, first), s) for k, s in local
        ]
        for k, s in keys:
            if wanted.get(k) != s or k in covered:
                return False
            covered[k] = s
        e.writes[r] = [PlannedTensor(k, e.tensor.dtype, s) for k, s in keys]
    return covered == wanted


def plan(model: nn.Module, rank: int, world: int) -> list[Entry]:
    """Every entry's writers and keys: the same result on every rank (one all-gather)."""
    entries: list[Entry] = []
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        name = unwrapped_name(name)  # a block compiled on its own keeps `_orig_mod.` there
        if id(t) in seen:  # tied weights: written once, as transformers does
            continue
        seen.add(id(t))
        entries.append(Entry(name, t.detach()))
    entries = _merge_groups(entries, model)
    mine = [None if e.members else _local_block(e.tensor) for e in entries]
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    load = [0] * world
    for i, e in enumerate(entries):
        blocks = [everyone[r][i] for r in range(world)]
        if not e.members and _plan_local(model, e, blocks):
            e.kind, e.block = "local", mine[i]
        else:
            e.kind, e.owner = "whole", min(range(world), key=lambda r: (load[r], r))
            if e.members:
                metas = {n: _meta(t) for n, t in e.members}
                items = [(k, tuple(v.shape)) for k, v in hf_group_items(model, metas)]
            else:
                items = _meta_items(model, e.name, e.tensor.shape, e.tensor.dtype)
            e.writes = {e.owner: [PlannedTensor(k, e.tensor.dtype, s) for k, s in items]}
        for r, planned in e.writes.items():
            load[r] += sum(p.nbytes for p in planned)
    return entries
