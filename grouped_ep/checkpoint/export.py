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
The plan (keys, writers) is `export_plan.py`.
Files are written under temporary names, renamed once every rank has finished, and the index
comes last (rank 0), so a failed export never looks complete (a failed rename leaves no index
and no single-file `model.safetensors`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from grouped_ep._hf_version import require_transformers
from grouped_ep._names import unwrapped_model
from grouped_ep._validate import check_module, check_path
from grouped_ep.checkpoint.collective import all_ok, on_rank0
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.export_plan import Entry, hf_group_items, hf_items, plan, renumber
from grouped_ep.checkpoint.fit import refuse_meta
from grouped_ep.checkpoint.hf_config import write_hf_configs
from grouped_ep.checkpoint.layout import refuse_tilde, write_text_atomic
from grouped_ep.checkpoint.safetensors_writer import (
    PlannedTensor,
    StreamingSafetensorsWriter,
    parse_size,
)
from grouped_ep.loading.converted import conversion_session, is_transformers_model

INDEX_FILE = "model.safetensors.index.json"


_log = logging.getLogger(__name__)  # rank 0's exports, at INFO: silent unless configured


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
        model: the model (or its torch.compile or DDP wrapper); parameters may be DTensors or plain
            tensors (the same on every rank).
        dir: output directory (created; not ""). Weight files of an earlier checkpoint there
            (`model.safetensors`, `model-*-of-*.safetensors`) are replaced: after the new files
            are in place, those this export did not write are removed, with the `.tmp-` files
            an export that was killed left.
        max_shard_size: most bytes per safetensors file, e.g. "5GB" or an int.

    Returns:
        The index file path on rank 0, None on other ranks.
    """
    started = time.perf_counter()
    check_module(model, "export_hf", error=CheckpointError)
    # torch.compile's and DDP's wrappers: keys with `_orig_mod.` / `module.`, no transformers model
    model = unwrapped_model(model)
    if is_transformers_model(model):
        require_transformers(CheckpointError, "export_hf")
    if not any(True for _ in model.state_dict()):
        raise CheckpointError(f"export_hf: {type(model).__name__} has no tensors to export")
    refuse_meta(model, "export_hf")
    check_path(dir, "export_hf: dir", CheckpointError)
    refuse_tilde(dir, "export_hf: dir")
    limit = parse_size(max_shard_size)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    out_dir = Path(dir)
    index_path = out_dir / INDEX_FILE

    def prepare() -> None:
        try:  # Path.exists raises ENAMETOOLONG and EACCES (a bare OSError; a review)
            not_dir = out_dir.exists() and not out_dir.is_dir()
        except OSError as e:
            raise CheckpointError(f"export_hf: cannot create {out_dir} ({e})") from e
        if not_dir:
            raise CheckpointError(f"export_hf: {out_dir} exists and is not a directory")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            # what it writes or replaces there, as directories: the export would fail part-way
            ours = (INDEX_FILE, "config.json", "generation_config.json")
            blocked = sorted(
                p.name
                for p in out_dir.iterdir()
                if (p.name in ours or _HF_WEIGHTS.fullmatch(p.name)) and p.is_dir()
            )
        except OSError as e:
            raise CheckpointError(f"export_hf: cannot create {out_dir} ({e})") from e
        if blocked:
            raise CheckpointError(
                f"export_hf: {out_dir} holds directories named as files it writes or replaces: "
                f"{', '.join(blocked)}; move them away"
            )

    on_rank0(prepare)
    with conversion_session(model):  # transformers' conversions, read once per export
        entries = plan(model, rank, world)
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

        staged = (
            out_dir / f".tmp-configs-{uuid.uuid4().hex}"
        )  # written with the weights, moved last

        # Everything is written under .tmp- names first: an earlier export in `dir` stays whole and
        # readable until every rank has written all of its files, and a failed export removes its
        # own temporary files and changes nothing else.
        def remove_tmp() -> None:
            for name in names:  # never in place of the error that brought us here (a read-only
                with contextlib.suppress(OSError):  # mount says EROFS even for a missing file)
                    (out_dir / f".tmp-{name}").unlink(missing_ok=True)
            shutil.rmtree(staged, ignore_errors=True)

        def step(what: str, work) -> None:  # on every rank; a failure anywhere: .tmp- files go
            error, interrupt = None, None
            try:
                work()
            except Exception as e:
                error = e
            except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C: the other ranks hear of it
                # (they got gloo's "Connection closed by peer" and kept their files; a review)
                interrupt = e
                error = CheckpointError(f"{type(e).__name__} on rank {rank} (interrupted)")
            try:
                all_ok(error, f"export_hf: {what}")
            except Exception:  # ours, or the collective's own when a rank died
                remove_tmp()
                if interrupt is not None:
                    raise interrupt from None
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
        _log.info(
            "export_hf: %d tensors, %.2f GB in %d files written to %s in %.1f s",
            len(weight_map),
            total / 1e9,
            n_files,
            out_dir,
            time.perf_counter() - started,
        )
        return index_path

    result = on_rank0(write_index)
    return result if rank == 0 else None


@contextlib.contextmanager
def _gathers_unlogged():
    """torch logs a warning when it gathers a (_StridedShard, Shard) expert weight of a dp x ep
    mesh in two all-gathers, that they "may give inconsistent results between ranks due to
    different reduction orders": a gather reduces nothing, and users took it for a fault."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _write_rank(
    model: nn.Module,
    entries: list[Entry],
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
            with _gathers_unlogged():
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
                    items = [(renumber(k, e.position, e.block[0]), v) for k, v in items]
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
