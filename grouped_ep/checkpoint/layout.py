"""The directory layout of a checkpoint root: step directories, `latest`, atomic writes.

root/
  latest                 text file naming the newest complete checkpoint ("step-00000123")
  step-00000123/         one complete checkpoint
  .tmp-step-00000124/    a save in progress (never read; removed by the next save)
"""

from __future__ import annotations

import os
from pathlib import Path

from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.inspect import METADATA_FILE

LATEST_FILE = "latest"
MANIFEST_FILE = "grouped_ep.json"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    """`step-00000123`: zero-padded so that names sort in step order."""
    return f"{STEP_PREFIX}{step:08d}"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory that `path` names: itself, or the one its `latest` file names.

    Raises CheckpointError when `path` is neither a checkpoint (no `.metadata`) nor a root with a
    `latest` file, or when `latest` names a directory that does not exist.
    """
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{latest}: expected a checkpoint directory name, got {name!r}")
        target = path / name
        if not target.is_dir():
            raise CheckpointError(f"{latest} names {name}, which does not exist in {path}")
        return target
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {METADATA_FILE}) nor a checkpoint root (no "
        f"{LATEST_FILE} file); was the save interrupted before it finished?"
    )


def next_step(root: Path) -> int:
    steps = [
        int(p.name[len(STEP_PREFIX) :])
        for p in root.glob(f"{STEP_PREFIX}*")
        if p.name[len(STEP_PREFIX) :].isdigit()
    ]
    return max(steps) + 1 if steps else 0
