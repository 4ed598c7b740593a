"""Each rank's `extra` (user state: step, RNG states, scheduler, data position) in a checkpoint:
`extra-rank<r>.pt`, written with torch.save and fsynced, its length and CRC32C recorded in the
rank's checksum table (checksum.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from grouped_ep.checkpoint.checksum import file_crc, verify_file
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


def read_extra(ckpt: Path, rank: int, manifest: dict, checked: bool) -> Any:
    """The `extra` rank `rank` saved in checkpoint `ckpt`, None if the save had none. A rank
    the saving run did not have (it had fewer ranks) gets rank 0's. With `checked`, the file's
    length and CRC32C must match those saved with it (checkpoints that recorded them)."""
    saved_world = manifest.get("world_size")
    owner = rank
    if not (ckpt / extra_name(rank)).is_file() and isinstance(saved_world, int):
        owner = 0 if rank >= saved_world else rank
    elif not (ckpt / extra_name(rank)).is_file():  # no manifest: a plain DCP checkpoint
        owner = 0
    path = ckpt / extra_name(owner)
    if not path.is_file():
        if manifest.get("has_extra"):
            raise CheckpointError(
                f"{path} is missing (the checkpoint was saved with extra state on each of its "
                f"{saved_world} rank(s))"
            )
        return None
    if checked:
        problem = verify_file(ckpt, path.name, owner, manifest.get("save_id"))
        if problem is not None:
            raise CheckpointError(problem)
    try:
        # The checkpoint is trusted as much as DCP's own pickled .metadata is.
        return torch.load(path, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {e})") from e
