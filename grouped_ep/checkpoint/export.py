"""Export a (sharded) model to the Hugging Face safetensors layout with per-expert keys.

Stacked expert weights are split into the per-expert 2D keys of Hugging Face checkpoints
(which transformers v5 fuses back on load): `gate_up_proj [E, 2I, H]` into
`{i}.gate_proj.weight [I, H]` (rows 0:I) and `{i}.up_proj.weight` (rows I:2I), `down_proj
[E, H, I]` into `{i}.down_proj.weight [H, I]`, in numeric expert order; other names stay.

A transformers model is exported with transformers' own reverse conversion
(`revert_weight_conversion`, what `save_pretrained` uses), so every architecture gets the keys
its loader expects (Mixtral: `block_sparse_moe.experts.{i}.w1/w3/w2.weight`). Writing
Qwen-style names for a Mixtral would load with silently re-initialized experts.

At scale no rank gathers the model. Every rank plans the whole export from global shapes alone
(the same plan everywhere, one small all-gather of who holds which expert rows), then writes
the keys it owns into its own safetensors files, one tensor staged at a time:
- an expert weight whose local shard is a block of whole experts (`Shard(0)` over EP,
  replicated elsewhere) is converted from the local shard; its per-expert keys go to the one
  rank holding that block (the lowest, if several do);
- any other DTensor (rows of a dense weight, experts split inside) is gathered one tensor at a
  time (`full_tensor`) and written by the least-loaded rank; plain tensors likewise, without the
  gather.
Model tensors that transformers' conversion merges into one key (`q_proj`, `k_proj`, `v_proj`
into a fused `qkv_proj`; text and vision experts into one expert list) are converted together,
gathered whole on one rank.
Files are written under temporary names, renamed once every rank has finished, and the index
comes last (rank 0), so a failed export never looks complete (a failed rename leaves no index
and no single-file `model.safetensors`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from grouped_ep._names import unwrapped_name
from grouped_ep.checkpoint.collective import all_ok, on_rank0
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.hf_config import write_hf_configs
from grouped_ep.checkpoint.layout import write_text_atomic
from grouped_ep.checkpoint.safetensors_writer import (
    PlannedTensor,
    StreamingSafetensorsWriter,
    parse_size,
)
from grouped_ep.loading.keys import conversion_groups, is_transformers_model, revert_conversion

INDEX_FILE = "model.safetensors.index.json"


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
class _Entry:
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


def _merge_groups(entries: list[_Entry], model: nn.Module) -> list[_Entry]:
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


def _renumber(key: str, position: int, first: int) -> str:
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


def _plan_local(model: nn.Module, e: _Entry, blocks: list[tuple[int, int] | None]) -> bool:
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
            (k if count == e.tensor.shape[0] else _renumber(k, position, first), s)
            for k, s in local
        ]
        for k, s in keys:
            if wanted.get(k) != s or k in covered:
                return False
            covered[k] = s
        e.writes[r] = [PlannedTensor(k, e.tensor.dtype, s) for k, s in keys]
    return covered == wanted


def _plan(model: nn.Module, rank: int, world: int) -> list[_Entry]:
    """Every entry's writers and keys: the same result on every rank (one all-gather)."""
    entries: list[_Entry] = []
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        name = unwrapped_name(name)  # a block compiled on its own keeps `_orig_mod.` there
        if id(t) in seen:  # tied weights: written once, as transformers does
            continue
        seen.add(id(t))
        entries.append(_Entry(name, t.detach()))
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


def _pack(keys: list[PlannedTensor], limit: int) -> list[list[PlannedTensor]]:
    files: list[list[PlannedTensor]] = []
    size = 0
    for p in keys:
        if not files or (size and size + p.nbytes > limit):
            files.append([])
            size = 0
        files[-1].append(p)
        size += p.nbytes
    return files


# The weight files of a Hugging Face checkpoint: one file, or shards of an index.
_HF_WEIGHTS = re.compile(r"(\.tmp-)?model(-\d+-of-\d+)?\.safetensors")
SINGLE_FILE = "model.safetensors"


def export_hf(
    model: nn.Module, dir: str | os.PathLike, max_shard_size: int | str = "5GB"
) -> Path | None:
    """Write `model` as a Hugging Face checkpoint: safetensors shards, index, config.json (and
    generation_config.json for a model that generates).

    Call on every rank (collective). Each rank writes the keys it owns into its own files: its
    experts from its local shard, and its share of the tensors that must be whole (gathered one
    at a time). No rank holds more than its shard plus one tensor being written. Stacked expert
    weights `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] become per-expert 2D keys
    (`...{i}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I]); other names stay.
    Args:
        model: the model (or its torch.compile wrapper); parameters may be DTensors or plain
            tensors (the same on every rank).
        dir: output directory (created; not ""). Weight files of an earlier checkpoint there
            (`model.safetensors`, `model-*-of-*.safetensors`) are replaced: after the new files
            are in place, those this export did not write are removed, with the `.tmp-` files
            an export that was killed left.
        max_shard_size: most bytes per safetensors file, e.g. "5GB" or an int.

    Returns:
        The index file path on rank 0, None on other ranks.
    """
    # torch.compile's wrapper: its keys carry `_orig_mod.` and it is no transformers model.
    model = (
        model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    )
    if not any(True for _ in model.state_dict()):
        raise CheckpointError(f"export_hf: {type(model).__name__} has no tensors to export")
    if not os.fspath(dir):
        raise CheckpointError("export_hf: dir is empty; name the directory to export into")
    limit = parse_size(max_shard_size)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    out_dir = Path(dir)
    index_path = out_dir / INDEX_FILE

    def prepare() -> None:
        if out_dir.exists() and not out_dir.is_dir():
            raise CheckpointError(f"export_hf: {out_dir} exists and is not a directory")
        out_dir.mkdir(parents=True, exist_ok=True)

    on_rank0(prepare)
    entries = _plan(model, rank, world)
    per_rank = [
        _pack([p for e in entries for p in e.writes.get(r, [])], limit) for r in range(world)
    ]
    seen_keys: set[str] = set()
    for p in (p for files in per_rank for f in files for p in f):
        if p.key in seen_keys:  # the same on every rank: all raise before anything is written
            raise CheckpointError(f"export_hf: checkpoint key {p.key!r} is planned twice")
        seen_keys.add(p.key)
    n_files = sum(len(f) for f in per_rank)
    first_file = sum(len(f) for f in per_rank[:rank])
    names = [
        f"model-{first_file + i + 1:05d}-of-{n_files:05d}.safetensors"
        for i in range(len(per_rank[rank]))
    ]

    staged = out_dir / f".tmp-configs-{uuid.uuid4().hex}"  # written with the weights, moved last

    # Everything is written under .tmp- names first: an earlier export in `dir` stays whole and
    # readable until every rank has written all of its files, and a failed export removes its
    # own temporary files and changes nothing else.
    def step(what: str, work) -> None:  # on every rank; a failure anywhere: .tmp- files go
        error = None
        try:
            work()
        except Exception as e:
            error = e
        try:
            all_ok(error, f"export_hf: {what}")
        except CheckpointError:
            for name in names:
                (out_dir / f".tmp-{name}").unlink(missing_ok=True)
            shutil.rmtree(staged, ignore_errors=True)
            raise

    def write() -> None:
        _write_rank(model, entries, rank, per_rank[rank], out_dir, names)
        if rank == 0:  # its failure (a generation config transformers refuses) changes nothing
            write_hf_configs(model, staged)

    step(f"writing {out_dir}", write)
    # From here the earlier export must not load as a half-new one: its index goes first, and a
    # single-file `model.safetensors` (which transformers reads before any index). A failed
    # rename is raised on every rank (no rank left waiting in a collective) and leaves neither,
    # so the directory does not load as a model.
    on_rank0(lambda: [(out_dir / n).unlink(missing_ok=True) for n in (INDEX_FILE, SINGLE_FILE)])
    step(
        f"renaming the files in {out_dir} (it holds no index now)",
        lambda: [os.replace(out_dir / f".tmp-{n}", out_dir / n) for n in names],
    )

    def write_index() -> Path:
        # Weight files of an earlier export (or a save_pretrained) into this directory go:
        # shards this export did not write, and the temporary files of an export that was
        # killed (ours are all renamed by now).
        ours = {f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)}
        for old in out_dir.iterdir():
            if old.name not in ours and _HF_WEIGHTS.fullmatch(old.name):
                old.unlink()
            elif old.name.startswith(".tmp-configs-") and old != staged and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        weight_map = {}
        for r, files in enumerate(per_rank):
            start = sum(len(f) for f in per_rank[:r])
            for i, planned in enumerate(files):
                for p in planned:
                    weight_map[p.key] = f"model-{start + i + 1:05d}-of-{n_files:05d}.safetensors"
        total = sum(p.nbytes for files in per_rank for f in files for p in f)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        if staged.is_dir():
            for config in staged.iterdir():
                os.replace(config, out_dir / config.name)
            staged.rmdir()
        write_text_atomic(index_path, json.dumps(index, indent=2) + "\n")
        return index_path

    result = on_rank0(write_index)
    return result if rank == 0 else None


def _write_rank(
    model: nn.Module,
    entries: list[_Entry],
    rank: int,
    files: list[list[PlannedTensor]],
    out_dir: Path,
    names: list[str],
) -> None:
    """Write this rank's files, one tensor at a time, in planned order.

    After a failure the rank still takes part in every remaining gather (so that no other rank
    waits forever), writes nothing more, and raises at the end.
    """
    queue = [f for f, planned in enumerate(files) for _ in planned]
    cursor = 0
    writer: StreamingSafetensorsWriter | None = None
    error: Exception | None = None
    for e in entries:
        group: dict[str, torch.Tensor] = {}
        for name, member in e.members or ([(e.name, e.tensor)] if e.kind == "whole" else []):
            # full_tensor is a collective: every rank, every such entry, in order
            group[name] = member.full_tensor() if isinstance(member, DTensor) else member
        if error is not None or rank not in e.writes:
            group = {}  # gathered tensors another rank writes: dropped at once
            continue
        try:
            if e.kind == "whole":
                items = hf_group_items(model, group)
            else:
                items = hf_items(model, e.name, e.tensor.to_local())
                if e.block[1] != e.tensor.shape[0]:
                    items = [(_renumber(k, e.position, e.block[0]), v) for k, v in items]
            for key, value in items:
                if cursor >= len(queue):
                    raise CheckpointError(f"export_hf: {key} was not planned for rank {rank}")
                name = out_dir / f".tmp-{names[queue[cursor]]}"
                if writer is None or writer.path != name:
                    if writer is not None:
                        writer.close()
                    writer = StreamingSafetensorsWriter(name, files[queue[cursor]])
                writer.write(key, value)
                cursor += 1
        except Exception as exc:
            error = exc
        finally:
            group = items = None  # one entry staged at a time: drop it before the next gather
    if writer is not None:
        try:
            writer.close()
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    if cursor != len(queue):
        raise CheckpointError(f"export_hf: rank {rank} wrote {cursor} of its {len(queue)} keys")
