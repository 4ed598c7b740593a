"""`save` of sharded models and optimizers over torch.distributed.checkpoint (DCP).

Layout of a checkpoint root (`save(root, ...)`):

    root/
      latest                 text file naming the newest complete checkpoint ("step-00000123")
      step-00000123/         one complete checkpoint
        .metadata            DCP metadata: every key, global shape, dtype, chunks, byte ranges
        __<rank>_0.distcp    the bytes each rank owns (replicated tensors written once)
        __<rank>_crc32c.json the CRC32C of every chunk and extra file of that rank, the save's id
        extra-rank00000.pt   `extra` of each rank (torch.save), if given
        grouped_ep.json      manifest: step, world size, whether an optimizer was saved, save id
      .tmp-step-00000124/    a save in progress (never read; removed by the next save)

A save writes everything into `.tmp-step-N`, waits for every rank, then rank 0 renames it to
`step-N` (one atomic rename) and replaces `latest` atomically (write a temporary file, then
`os.replace`). A save that dies midway leaves the previous checkpoint and `latest` untouched.
With `async_save=True` the same happens in the background (`async_save.py`); with `keep_last=N`
rank 0 then removes the older complete steps beyond the newest N.

`load` (`resume.py`) checks the checkpoint against the model and optimizer first, then lets DCP
read straight into the live tensors, as plain DCP does: no second copy of the state.

Model and optimizer state go through torch.distributed.checkpoint (DCP) with the state dicts of
`get_state_dict`, so a checkpoint saved under one layout (world size, EP degree, FSDP degree,
placements) loads under another: DCP records each chunk's global offsets and reads, for every
rank, the overlap of the saved chunks with that rank's shard.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import grouped_ep.checkpoint.async_save as background
import grouped_ep.checkpoint.writer as jobs
from grouped_ep._reshard import reshard_all
from grouped_ep._validate import check_flag, check_path
from grouped_ep.checkpoint.async_save import AsyncSave
from grouped_ep.checkpoint.checksum import FORMAT as CHECKSUMS
from grouped_ep.checkpoint.checksum import ChecksumWriter, file_crc
from grouped_ep.checkpoint.collective import (
    all_ok,
    async_group,
    dcp_quiet,
    distributed,
    failures,
    on_rank0,
    own_interrupt,
    rank,
    same_on_every_rank,
    same_where_given,
    world,
)
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.extra import write_extra
from grouped_ep.checkpoint.fit import refuse_meta, tied_groups
from grouped_ep.checkpoint.inspect import METADATA_FILE, describe
from grouped_ep.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST_FILE,
    TMP_PREFIX,
    LatestNotUpdated,
    RootLock,
    commit_step,
    latest_name,
    next_step,
    prune,
    refuse_tilde,
    restore_swapped_out,
    step_dir_name,
)
from grouped_ep.checkpoint.save_args import (
    as_keep_last,
    as_step,
    check_optimizer_params,
    check_types,
)
from grouped_ep.checkpoint.state import CompactSavePlanner, state_dicts

__all__ = ["AsyncSave", "save"]

_log = logging.getLogger(__name__)  # rank 0's commits, at INFO: silent unless configured

SAVE_ID_FILE = ".save_id"  # rank 0 writes the save's id into the step it makes: each rank checks


def _remove_partial(tmp: Path, root: Path) -> str:
    """Remove a failed save's partial step `tmp` (a full disk stays full otherwise); the free
    space left on `root`'s file system, as text for the error."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        return f"; {shutil.disk_usage(root).free / 2**20:.0f} MiB free on {root}"
    except OSError:
        return ""


# ---- save / load --------------------------------------------------------------------------------


def save(
    root: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    step: int | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
) -> Path | AsyncSave:
    """Save `model` (and `optimizer`) sharded as they are, atomically, as `root/step-<step>`.

    Call on every rank (collective). Each rank writes only the bytes of its own shards;
    replicated tensors are written once. Works in a single process without a process group.
    A save in flight (`async_save=True`) is waited for first; its failure is raised here.

    Args:
        root: checkpoint root directory (created if needed).
        model: the model; parameters may be DTensors (any mesh and placements) or plain tensors.
        optimizer: an optimizer over `model`'s parameters, or None.
        extra: user state of this rank (step, RNG states, scheduler state dict, ...), written
            with torch.save per rank and returned by `load`.
        step: the step number in the directory name (an int, a numpy int or an integer 0-d
            tensor). Default: `extra["step"]` when it is set (of those types, else a
            CheckpointError), else one more than the highest step already in `root`.
        async_save: copy the state to CPU memory, return, and write it in the background
            (`torch.distributed.checkpoint.async_save`, on a gloo group of its own). Training may
            change the parameters right away. `latest` moves only after every rank finished.
        keep_last: after the commit, remove all but the newest `keep_last` complete steps
            (never the one `latest` names). None keeps every step.

    Returns:
        The checkpoint directory, `root/step-<step:08d>` (`root/latest` names it afterwards);
        with `async_save=True` an `AsyncSave` handle whose `result()` waits and returns it.
    """
    background.wait_pending("save")
    started = time.perf_counter()
    error, given_step = None, None  # raised on every rank: `extra` may be rank 0's alone
    try:
        check_path(root, "save: root", CheckpointError, CheckpointError)
        check_types(model, optimizer, extra)
        refuse_tilde(root, "save: root")
        given_step = None if step is None else as_step(step, "step")
        if step is None and extra is not None and extra.get("step") is not None:
            step = as_step(extra["step"], 'extra["step"]')  # rank 0's names it: `extra` may
            # be rank 0's alone
        else:
            step = given_step
        check_flag(async_save, "save: async_save")
        keep_last = as_keep_last(keep_last)
        reshard_all(model)  # a unit left gathered gives its full tensors, not its shards
        check_optimizer_params(model, optimizer, "save")
        refuse_meta(model, "save")
        state = state_dicts(model, optimizer)  # before anything is written
    except (CheckpointError, ValueError) as e:
        error = e
    except Exception as e:  # noqa: BLE001 (torch's get_state_dict: a hook, a foreign optimizer)
        what = "model and optimizer" if optimizer is not None else "model"
        error = CheckpointError(
            f"save: the state dict of the {what} could not be built, nothing was written "
            f"({type(e).__name__}: {e})"
        )
    all_ok(error, "save: checking its arguments")
    # After refuse_tilde: Path drops a leading './' (`./~` names a dir '~'). Absolute: an async
    # save's background write, its cleanup and its lock went to the wrong place after an
    # os.chdir, and its error said the partial step was removed (a review).
    root = Path(root).absolute()
    # Different ones would run different collectives (an async save's on its own group): a hang.
    same_on_every_rank(  # and step= / keep_last: rank 0's were taken, silently (a review)
        (async_save, optimizer is not None, given_step, keep_last),
        "save: async_save, whether an optimizer is given, step and keep_last",
    )
    # extra["step"] may be rank 0's alone; where several ranks give one, they must agree (rank
    # 0's named the directory, and each rank resumed with its own; a review).
    same_where_given(step if given_step is None else None, 'save: extra["step"]')

    def prepare() -> tuple[int, str, str]:
        try:  # Path.exists raises ENAMETOOLONG and EACCES (a bare OSError; a review)
            not_dir = root.exists() and not root.is_dir()
            is_checkpoint = (root / METADATA_FILE).is_file()
        except OSError as e:
            raise CheckpointError(f"save: cannot prepare checkpoint root {root} ({e})") from e
        if not_dir:
            raise CheckpointError(f"save: checkpoint root {root} exists and is not a directory")
        if is_checkpoint:
            raise CheckpointError(
                f"save: {root} is itself a checkpoint (it holds {METADATA_FILE}); save into a "
                f"checkpoint root instead (a directory of step-N checkpoints and `latest`, such "
                f"as {root.parent}), or a load of {root} would keep reading the old one"
            )
        tmp = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock.acquire(root)  # before anything in the root is read or removed
            jobs.claim(root)  # a second job, between the first's saves
            restore_swapped_out(root)  # before numbering: it may be the highest step
            s = next_step(root) if step is None else step
            tmp = root / f"{TMP_PREFIX}{step_dir_name(s)}"
            # Left by saves that died (of any step; this process has none in flight, see
            # above): never the latest, never complete.
            for old in root.glob(f"{TMP_PREFIX}*"):
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            for old in root.glob(f"{LATEST_FILE}.tmp-*"):  # a `latest` write that died
                old.unlink(missing_ok=True)
            tmp.mkdir()
            (tmp / SAVE_ID_FILE).write_text(save_id)
        except OSError as e:  # a full disk: the step made empty goes, as a failed save's does
            free = _remove_partial(tmp, root) if tmp is not None and tmp.exists() else ""
            raise CheckpointError(
                f"save: cannot prepare checkpoint root {root} ({e}){free}; `latest` is unchanged"
            ) from e
        return s, tmp.name, save_id

    save_id = uuid.uuid4().hex

    lock = RootLock()  # rank 0's, from preparing the step until its commit
    handed_off = False
    try:
        step_, tmp_name, save_id = on_rank0(prepare)
        tmp = root / tmp_name
        final = root / step_dir_name(step_)

        def failed(what: str, detail: str, group: Any = None) -> CheckpointError:
            """The save's error, once every rank has stopped writing (collective, over `group`):
            rank 0 removes the partial step (a full disk stays full otherwise; one rank, so that no
            rank removes the directory of a retry rank 0 has begun) and says the free space."""

            try:
                free = on_rank0(lambda: _remove_partial(tmp, root), group=group)
            except CheckpointError:
                free = ""
            return CheckpointError(
                f"{what} (the partial step was removed{free}; `latest` still names the previous "
                f"checkpoint): {detail}"
            )

        try:  # a rank whose `root` is another directory (a node's own disk) would write elsewhere
            all_ok(_sees(tmp, save_id), "save: finding the step directory rank 0 made")
        except CheckpointError as e:
            raise failed(f"save: the ranks do not share {root}", str(e)) from e

        error, files = None, {}
        if extra is not None:
            try:
                files = write_extra(tmp, rank(), extra)
            except BaseException as e:  # Ctrl-C too: every rank stops, the partial step goes
                error = e
        try:
            all_ok(error, f"save: writing extra into {tmp}")
        except CheckpointError as e:
            cleaned = failed(f"save: writing extra into {tmp} failed", str(e))
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise error from cleaned  # Ctrl-C stays Ctrl-C
            raise cleaned from e

        manifest = {
            "format": FORMAT_VERSION,
            "step": step_,
            "world_size": world(),
            "has_optimizer": optimizer is not None,
            "has_extra": extra is not None,
            "checksums": CHECKSUMS,  # every chunk's CRC32C, beside the data files (checksum.py)
            "save_id": save_id,  # in every checksum table too
            "torch": torch.__version__,
            "tied": tied_groups(model),  # keys of one shared tensor: `load` refuses them split
            "writer": jobs.WRITER,  # the process: a second job into the root is refused
        }

        def commit() -> Path:
            try:
                (tmp / SAVE_ID_FILE).unlink(missing_ok=True)  # every rank found it: done with
                problems = describe(tmp).problems  # every rank's data file there and long enough
                if problems:
                    free = _remove_partial(tmp, root)
                    raise CheckpointError(
                        f"save: {tmp} is incomplete and was not committed (removed{free}; `latest` still "
                        f"names the previous checkpoint): {'; '.join(problems[:5])}"
                    )
                try:
                    # `.metadata` is unpickled before anything else: its CRC32C is checked first
                    md_crc = file_crc(tmp / METADATA_FILE)
                    stamp = {"saved_at": time.time(), "metadata_crc32c": md_crc}
                    commit_step(root, tmp, final, manifest | stamp)
                    jobs.wrote(root, save_id)
                except LatestNotUpdated as e:  # nothing to remove: the step is complete
                    raise CheckpointError(
                        f"save: {final} is complete and holds this save, but pointing `latest` "
                        f"at it failed ({e}); `latest` still names {latest_name(root)}: load "
                        f"{final} by its path, or free space and save again"
                    ) from e
                except OSError as e:
                    free = _remove_partial(tmp, root)  # rank 0 alone: the others wait for it
                    raise CheckpointError(
                        f"save: committing {tmp} as {final} failed ({e}); the partial step was removed"
                        f"{free}; `latest` still names the previous checkpoint"
                    ) from e
                removed: list[Path] = []
                if keep_last is not None:
                    try:
                        removed = prune(root, keep_last)
                    except OSError as e:  # the step is committed: not a failed save
                        warnings.warn(
                            f"save: {final} is committed (`latest` names it), but removing older steps "
                            f"for keep_last={keep_last} failed: {e}",
                            stacklevel=4,  # the caller of save (through on_rank0)
                        )
                _log.info(
                    "save: step %d committed as %s in %.1f s%s%s",
                    step_,
                    final,
                    time.perf_counter() - started,
                    " (async)" if async_save else "",
                    f"; keep_last={keep_last} removed {', '.join(p.name for p in removed)}"
                    if removed
                    else "",
                )
                return final
            except (KeyboardInterrupt, SystemExit):  # rank 0 alone: nothing collective to wait for
                _remove_partial(tmp, root)  # nothing where the rename to `final` happened
                raise

        writer = ChecksumWriter(str(tmp), save_id, files, overwrite=True)
        group = async_group() if async_save else None  # the same one in the background thread
        try:
            with dcp_quiet():
                if async_save:
                    # Blocks only while the state is copied to CPU memory; writes in a thread.
                    staging = None
                    try:
                        upload = dcp.async_save(
                            state,
                            storage_writer=writer,
                            planner=CompactSavePlanner(),
                            process_group=group,
                            no_dist=not distributed(),
                        )
                    except CheckpointException:
                        raise
                    except Exception as e:  # noqa: BLE001 (the copy, raised here, on this rank)
                        staging = e
                    # Every rank learns of it: the partial step goes, every rank raises. (Ranks
                    # whose copy succeeded have a write in flight that waits for this one in
                    # vain; it fails when its group's timeout ends.)
                    try:
                        all_ok(staging, "save: copying the state to CPU memory")
                    except CheckpointError as e:
                        raise failed(f"async save to {tmp} failed", str(e)) from e
                else:
                    dcp.save(
                        state,
                        storage_writer=writer,
                        planner=CompactSavePlanner(),
                        no_dist=not distributed(),
                    )
        except CheckpointException as e:  # raised on every rank when any rank failed
            error = failed(f"save to {tmp} failed", failures(e))
            interrupt = own_interrupt(e)
            if interrupt is not None:
                raise interrupt from error
            raise error from e
        if not async_save:
            return on_rank0(commit)

        def finish() -> Path:
            try:
                try:
                    upload.result()
                except CheckpointException as e:  # on every rank (DCP gathers the failures)
                    raise failed(f"async save to {tmp} failed", failures(e), group) from e
                # On the save's own group: every rank's handle says whether it was committed.
                return on_rank0(commit, group=group)
            finally:
                lock.release()

        handed_off = True  # the background job releases the lock
        return background.start(final, finish)
    finally:
        if not handed_off:
            lock.release()


def _sees(tmp: Path, save_id: str) -> CheckpointError | None:
    """None when `tmp` on this rank is the step directory rank 0 made for save `save_id`."""
    try:
        if (tmp / SAVE_ID_FILE).read_text() == save_id:
            return None
        found = "it is another save's"
    except OSError as e:
        found = f"{type(e).__name__}: {e.strerror or e}"
    return CheckpointError(
        f"{tmp}, which rank 0 made for this save, is not there on this rank ({found}): every "
        "rank must save into the same checkpoint root, on a file system they all see"
    )
