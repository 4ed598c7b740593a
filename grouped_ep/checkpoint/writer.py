"""One job per checkpoint root, also when two jobs' saves do not overlap in time.

The root's lock (`layout.RootLock`) refuses a save while another is in flight. Two jobs whose
saves alternate (a requeued job beside its first instance still running) each replaced the
other's steps, both reported success, and a resume loaded the other job's weights (a review).
Each manifest names the process that saved it (`WRITER`); a process that saved into a root, or
loaded from it, refuses its next save there when `latest` names a step of another process that
it has not seen. A process's first save into a root takes it over (a run resumed after a crash,
a copied root)."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from grouped_ep.checkpoint.checksum import read_manifest
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.layout import LATEST_FILE, _latest_or_none

WRITER: dict = {}
_SEEN: dict[str, str | None] = {}  # root -> the save id of the latest step this process saw


def _new_process() -> None:
    """A fresh identity: at import, and in a forked child (which shared its parent's)."""
    WRITER.update(run=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid())
    _SEEN.clear()


_new_process()
os.register_at_fork(after_in_child=_new_process)


def _latest_manifest(root: Path) -> tuple[str | None, dict]:
    name = _latest_or_none(root / LATEST_FILE)
    if not name:
        return None, {}
    try:
        return name, read_manifest(root / name)
    except CheckpointError:  # a damaged step: the save's own checks deal with the root
        return name, {}


def claim(root: Path) -> None:
    """Rank 0, under the root's lock, before a save: refuse it when this process saved into or
    loaded from `root` before and `latest` now names another process's step it has not seen."""
    key = os.path.realpath(root)
    if key not in _SEEN:
        return
    name, manifest = _latest_manifest(root)
    writer = manifest.get("writer")
    if not isinstance(writer, dict) or writer.get("run") == WRITER["run"]:
        return
    if manifest.get("save_id") == _SEEN[key]:
        return  # the step this process resumed from: continuing it is not a second writer
    raise CheckpointError(
        f"save: another job saved {root / name} after this process last saved into or loaded "
        f"from {root} (process {writer.get('pid')} on {writer.get('host')}): two jobs are "
        "writing one checkpoint root, and each would replace the other's steps. Stop one of "
        "them, or save elsewhere; or load that step first to continue from it"
    )


def wrote(root: Path, save_id: str) -> None:
    """After this process committed step `save_id` in `root`."""
    _SEEN[os.path.realpath(root)] = save_id


def read(ckpt: Path) -> None:
    """After this process loaded `ckpt`: its root's latest step counts as seen."""
    root = ckpt.parent
    if (root / LATEST_FILE).is_file():
        _SEEN[os.path.realpath(root)] = _latest_manifest(root)[1].get("save_id")
