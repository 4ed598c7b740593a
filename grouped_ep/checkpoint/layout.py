"""The directory layout of a checkpoint root: step directories, `latest`, atomic writes.

root/
  latest                 text file naming the newest complete checkpoint ("step-00000123")
  step-00000123/         one complete checkpoint
  .tmp-step-00000124/    a save in progress (never read; removed by the next save)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from grouped_ep._validate import check_path, tilde_hint
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.inspect import METADATA_FILE

LATEST_FILE = "latest"
LOCK_FILE = ".save-lock"  # see RootLock
MANIFEST_FILE = "grouped_ep.json"
# The manifest's "format". 1: every save before 2026-11-26 (its fields grew over time: "checksums"
# "crc32" then "crc32c", "save_id", "tied"); 2: the first that `load` checks, refusing a newer one.
# Bump it when a save writes something an older `load` would read wrong.
FORMAT_VERSION = 2
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    """`step-00000123`: zero-padded so that names sort in step order."""
    return f"{STEP_PREFIX}{step:08d}"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no temporary file left behind for good
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def fsync_dir(path: Path) -> None:
    fd = -1
    try:  # os.open inside: an interrupt right after it leaves no descriptor open
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)


def refuse_tilde(path: str | os.PathLike, what: str) -> None:
    """A path to write into that starts with a home reference (`~`, `~/...`, `~user/...`): not
    expanded (as by open()), it would make a directory named `~` in the working directory. A
    name that only starts with `~` (`~run1`: no such user) is a name, as is `./~`."""
    text = os.fspath(path)
    if text.startswith("~") and os.path.expanduser(text) != text:
        raise CheckpointError(
            f"{what} {text!r} starts with '~', which is not expanded (a directory named "
            f"{text.split(os.sep)[0]!r} would be made here): pass os.path.expanduser(...), "
            f"{os.path.expanduser(text)}"
        )


def read_latest(latest: Path) -> str:
    """The step directory name a `latest` file holds (OSError if it cannot be read)."""
    try:
        return latest.read_text().strip()
    except UnicodeDecodeError as e:  # not text: a damaged file
        raise CheckpointError(
            f"{latest}: expected a checkpoint directory name, got bytes ({e})"
        ) from e


def _latest_or_none(latest: Path) -> str | None:
    """For a save: what `latest` names, None when absent or not text (the save replaces it)."""
    try:
        return read_latest(latest) if latest.is_file() else None
    except CheckpointError:
        return None


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory that `path` names: itself, or the one its `latest` file names.

    Raises CheckpointError when `path` is neither a checkpoint (no `.metadata`) nor a root with a
    `latest` file, or when `latest` names a directory that does not exist, or cannot be read.
    """
    check_path(path, "checkpoint path", CheckpointError)
    try:
        return _resolve(Path(path))
    except OSError as e:  # a folder without read permission
        raise CheckpointError(f"checkpoint path {path} cannot be read ({e})") from e


def _resolve(path: Path) -> Path:
    if (path / METADATA_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        name = read_latest(latest)
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{latest}: expected a checkpoint directory name, got {name!r}")
        target = path / name
        if not target.is_dir():
            copy = swapped_out(path, name)  # a same-step save died between its renames
            if copy is not None:
                return copy
            raise CheckpointError(f"{latest} names {name}, which does not exist in {path}")
        return target
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist{tilde_hint(path)}")
    if path.name == LATEST_FILE and path.is_file():
        raise CheckpointError(
            f"{path} is the file naming a checkpoint root's latest step: pass the root, "
            f"{path.parent}, or the step directory it names"
        )
    if path.is_dir() and any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} holds .safetensors files, not a checkpoint of grouped_ep.checkpoint.save "
            f"(no {METADATA_FILE}): an export_hf folder, or Hugging Face weights, which "
            "grouped_ep.load_sharded or transformers' from_pretrained read"
        )
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {METADATA_FILE}) nor a checkpoint root (no "
        f"{LATEST_FILE} file); was the save interrupted before it finished?"
    )


def complete_steps(root: Path) -> dict[int, Path]:
    """step -> directory for every complete checkpoint (`step-N`, renamed in place) in `root`."""
    out = {}
    for p in root.glob(f"{STEP_PREFIX}*"):
        digits = p.name[len(STEP_PREFIX) :]
        if digits.isdigit() and p.is_dir():
            out[int(digits)] = p
    return out


def next_step(root: Path) -> int:
    steps = complete_steps(root)
    return max(steps) + 1 if steps else 0


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux renameat2 RENAME_EXCHANGE). False where the
    system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


def commit_step(root: Path, tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Make the finished save in `tmp` the checkpoint `final` and point `latest` at it.

    Run once (rank 0), after every rank has written its files. The manifest goes in first; one
    rename makes the directory complete; `latest` is replaced atomically.

    Saving a step that exists already swaps the two directories in one atomic step where Linux
    can (renameat2), so that `final` is at every moment either the old complete checkpoint or
    the new one. Elsewhere the old one is first renamed to `.tmp-old-<name>-<pid>` and the new
    one renamed in; `resolve` falls back to that copy if `latest` names `final` and it is
    missing (a crash between the two renames), and a later save puts it back first.
    """
    write_text_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    fsync_dir(tmp)
    old = None
    if final.exists():  # saving the same step again
        if _exchange(tmp, final):
            old = tmp  # now holds the previous checkpoint
        else:
            old = root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)
    try:  # `final` is complete and holds this save from here on
        write_text_atomic(root / LATEST_FILE, final.name + "\n")
        fsync_dir(root)
    except OSError as e:
        raise LatestNotUpdated(str(e)) from e
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class LatestNotUpdated(Exception):
    """`commit_step` put the step in place but could not point `latest` at it."""


def latest_name(root: Path) -> str:
    """What `root/latest` names, for messages."""
    try:
        return repr(read_latest(root / LATEST_FILE))
    except (OSError, CheckpointError):
        return "nothing (it cannot be read)"


class RootLock:
    """An exclusive lock on a checkpoint root, held by rank 0 from preparing a save's step until
    its commit. A second writer (a requeued job whose first instance still runs) is refused:
    it removed the first save's step directory under it, and both reported saves that `load`
    refused (crash review). The kernel drops the lock of a process that dies; the file goes
    with the release. On a file system without `flock` the save goes on unlocked."""

    def __init__(self) -> None:
        self.fd, self.path = -1, None

    def acquire(self, root: Path) -> None:
        path = root / LOCK_FILE
        for _ in range(100):  # the holder may remove the file between our open and our flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CheckpointError(
                    f"save: another save into {root} is in progress (it holds {path}): one "
                    "writer per checkpoint root; wait for it to finish, or save elsewhere"
                ) from None
            except OSError:  # no flock here (some network file systems)
                os.close(fd)
                return
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    self.fd, self.path = fd, path
                    return
            except FileNotFoundError:
                pass
            os.close(fd)  # locked a file already removed: take the one at `path` now
        raise CheckpointError(f"save: cannot lock {path}: it keeps being replaced")

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                self.path.unlink()  # while still held: no other save has it open and locked
            os.close(fd)


def swapped_out(root: Path, name: str) -> Path | None:
    """The complete copy of checkpoint `name` that a same-step save swapped out and did not
    replace (it died between its two renames), or None."""
    for p in sorted(root.glob(f"{TMP_PREFIX}old-{name}-*")):
        if (p / METADATA_FILE).is_file():
            return p
    return None


def restore_swapped_out(root: Path) -> None:
    """Before a save clears `.tmp-*`: put back a checkpoint that `latest` names and that only
    survives as a swapped-out copy (see `commit_step`)."""
    latest = root / LATEST_FILE
    name = _latest_or_none(latest) or ""
    if not name.startswith(STEP_PREFIX) or (root / name).exists():
        return
    copy = swapped_out(root, name)
    if copy is not None:
        os.rename(copy, root / name)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the `keep_last` complete steps of the highest step numbers up to the one
    `latest` names (never that one). Steps above it were saved by a run that a resume from an
    earlier step abandoned: they are neither counted nor removed (counted, they pushed out the
    steps of the run going on, its rollback point first), and a warning names them.

    Each removed directory is first renamed to a `.tmp-` name (one atomic step), so a crash
    while deleting never leaves a half-deleted `step-N` that looks complete. Returns the
    directories removed.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1, got {keep_last}")
    steps = complete_steps(root)
    latest = root / LATEST_FILE
    current = _latest_or_none(latest)
    now = next((s for s, p in steps.items() if p.name == current), None)
    above = sorted(s for s in steps if now is not None and s > now)
    if above:
        warnings.warn(
            f"keep_last={keep_last}: {', '.join(steps[s].name for s in above)} in {root} "
            f"{'is' if len(above) == 1 else 'are'} above {current}, which was just saved (a run "
            "resumed from an earlier step?): kept, and not counted among the last "
            f"{keep_last}; remove {'it' if len(above) == 1 else 'them'} by hand if abandoned",
            stacklevel=5,  # the caller of save (through commit and on_rank0)
        )
    removed = []
    for s in sorted(set(steps) - set(above))[:-keep_last]:
        path = steps[s]
        if path.name == current:
            continue
        doomed = root / f"{TMP_PREFIX}removed-{path.name}-{os.getpid()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    if removed:
        fsync_dir(root)
    return removed
