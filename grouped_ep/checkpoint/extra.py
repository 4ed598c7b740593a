"""Each rank's `extra` (user state: step, RNG states, scheduler, data position) in a checkpoint:
`extra-rank<r>.pt`, written with torch.save and fsynced, its length and CRC32C recorded in the
rank's checksum table (checksum.py)."""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from grouped_ep.checkpoint.checksum import file_crc, lists_file, verify_file
from grouped_ep.checkpoint.errors import CheckpointError


def extra_name(rank: int) -> str:
    return f"extra-rank{rank:05d}.pt"


def write_extra(directory: Path, rank: int, extra: Any) -> dict[str, list[int]]:
    """Write rank `rank`'s `extra` into `directory`; {file name: [length, CRC32C]}."""
    path = directory / extra_name(rank)
    with open(path, "wb") as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())
    return {path.name: file_crc(path)}


def _per_rank(ckpt: Path) -> bool:
    """Whether ranks 0 and 1 saved different `extra` (each its RNG state, say), not the same
    (`extra={"step": step}` on every rank: nothing per-rank to lose)."""
    try:
        return _records(ckpt / extra_name(0)) != _records(ckpt / extra_name(1))
    except (OSError, zipfile.BadZipFile):
        return False


def _records(path: Path) -> dict[str, bytes]:
    """A torch.save file's records, but for what differs between two saves of the same value:
    the folder named after the file, and the random serialization id."""
    with zipfile.ZipFile(path) as archive:
        return {
            name.split("/", 1)[-1]: archive.read(name)
            for name in archive.namelist()
            if not name.endswith("serialization_id")
        }


def read_extra(ckpt: Path, rank: int, manifest: dict, checked: bool, world: int = 1) -> Any:
    """The `extra` rank `rank` (of `world`) saved in checkpoint `ckpt`. A rank that saved none
    while rank 0 did (`extra` given on rank 0 only), or that the saving run did not have, gets
    rank 0's; None when rank 0 saved none either. A file that its rank's checksum table lists
    but that is gone is an error naming it. With `checked`, the file's length and CRC32C must
    match those saved with it (checkpoints that recorded them). Where the saving run's ranks
    each saved their own and the world size changed, the ranks it did not have (taking rank
    0's RNG states and data position) and rank 0 (for the ranks now gone) warn (a review: the
    new ranks drew rank 0's dropout masks, silently)."""
    save_id = manifest.get("save_id")
    saved_world = manifest.get("world_size")
    if isinstance(saved_world, int) and saved_world != world and _per_rank(ckpt):
        if rank >= saved_world:
            warnings.warn(
                f"checkpoint.load: rank {rank} gets rank 0's extra state: the checkpoint was "
                f"saved by {saved_world} ranks, each with its own extra (per-rank RNG states or "
                "data positions are then rank 0's: re-derive them from the rank)",
                stacklevel=3,
            )
        elif rank == 0 and saved_world > world:
            warnings.warn(
                f"checkpoint.load: the extra state of ranks {world}..{saved_world - 1} of the "
                f"saving run is not read ({world} ranks now)",
                stacklevel=3,
            )

    def missing(owner: int) -> CheckpointError:
        return CheckpointError(
            f"{ckpt / extra_name(owner)} is missing: rank {owner} of the saving run saved extra "
            "state (the checkpoint's records list it)"
        )

    owner = rank
    if not (ckpt / extra_name(rank)).is_file():
        if lists_file(ckpt, extra_name(rank), rank, save_id):
            raise missing(rank)
        owner = 0
    path = ckpt / extra_name(owner)
    if not path.is_file():
        # Rank 0's manifest says whether it saved extra (older checkpoints: no tables to ask).
        if lists_file(ckpt, path.name, 0, save_id) or manifest.get("has_extra"):
            raise missing(0)
        return None
    if checked:
        problem = verify_file(ckpt, path.name, owner, save_id)
        if problem is not None:
            raise CheckpointError(problem)
    try:
        # The checkpoint is trusted as much as DCP's own pickled .metadata is.
        return torch.load(path, weights_only=False, map_location=_this_ranks_device())
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {e})") from e


def _this_ranks_device() -> dict[str, str]:
    """torch.load's map_location for `extra`: a tensor the saving rank had on a GPU comes back on
    this rank's current GPU (CPU where there is none), whatever GPU index it was saved from (a
    rank 7 save read on a 4-GPU node); CPU tensors stay on CPU. A mapping, not a function: torch
    refuses a function for a DTensor's storage, and a step whose `extra` held one could not be
    loaded at all (save refuses them now; a review)."""
    here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return {f"cuda:{i}": here for i in range(1024)} | {"cuda": here}
