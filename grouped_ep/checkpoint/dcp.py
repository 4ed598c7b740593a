"""`save` and `load` of sharded models and optimizers over torch.distributed.checkpoint (DCP).

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

`load` checks the checkpoint against the model and optimizer first (every key present, the same
global shapes, every data file there and long enough), then lets DCP read straight into the
live tensors, as plain DCP does: no second copy of the state.

Model and optimizer state go through torch.distributed.checkpoint (DCP) with the state dicts of
`get_state_dict`, so a checkpoint saved under one layout (world size, EP degree, FSDP degree,
placements) loads under another: DCP records each chunk's global offsets and reads, for every
rank, the overlap of the saved chunks with that rank's shard.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_state_dict,
)

import grouped_ep.checkpoint.async_save as background
from grouped_ep._reshard import reshard_all
from grouped_ep._validate import check_flag, is_int
from grouped_ep.checkpoint.async_save import AsyncSave
from grouped_ep.checkpoint.checksum import FORMAT as CHECKSUMS
from grouped_ep.checkpoint.checksum import (
    ChecksumWriter,
    has_checksums,
    read_manifest,
    verify_share,
)
from grouped_ep.checkpoint.collective import (
    all_ok,
    async_group,
    dcp_quiet,
    distributed,
    on_rank0,
    rank,
    world,
)
from grouped_ep.checkpoint.direct_reader import DirectReader
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.extra import read_extra, write_extra
from grouped_ep.checkpoint.fit import (
    check_fits,
    check_param_groups,
    refuse_meta,
    refuse_split_ties,
    refuse_unexpected,
    refuse_untied,
    stateless_params,
    tied_groups,
    without,
)
from grouped_ep.checkpoint.inspect import METADATA_FILE, describe
from grouped_ep.checkpoint.layout import (
    TMP_PREFIX,
    commit_step,
    next_step,
    prune,
    resolve,
    restore_swapped_out,
    step_dir_name,
)
from grouped_ep.checkpoint.save_args import as_step, check_optimizer_params, check_types
from grouped_ep.checkpoint.state import CompactSavePlanner, state_dicts
from grouped_ep.loading.buffers import refresh_buffers

__all__ = ["AsyncSave", "save", "load"]

FORMAT_VERSION = 1


def _failures(e: CheckpointException) -> str:
    """Each failed rank's own error first, then DCP's report with the tracebacks."""
    own = "; ".join(
        f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items())
    )
    return f"{own}\n{e}" if own else str(e)


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
    root = Path(root)
    error = None  # raised on every rank: `extra` may be rank 0's alone, the others would wait
    try:
        check_types(model, optimizer, extra)
        if step is None and extra is not None and extra.get("step") is not None:
            step = as_step(extra["step"], 'extra["step"]')
        elif step is not None:
            step = as_step(step, "step")
        check_flag(async_save, "save: async_save")
        if keep_last is not None and (not is_int(keep_last) or keep_last < 1):
            raise CheckpointError(
                f"save: keep_last must be a positive int or None, got {keep_last!r}"
            )
        reshard_all(model)  # a unit left gathered gives its full tensors, not its shards
        check_optimizer_params(model, optimizer, "save")
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

    def prepare() -> tuple[int, str, str]:
        if root.exists() and not root.is_dir():
            raise CheckpointError(f"save: checkpoint root {root} exists and is not a directory")
        if (root / METADATA_FILE).is_file():
            raise CheckpointError(
                f"save: {root} is itself a checkpoint (it holds {METADATA_FILE}); save into a "
                f"checkpoint root instead (a directory of step-N checkpoints and `latest`, such "
                f"as {root.parent}), or a load of {root} would keep reading the old one"
            )
        try:
            root.mkdir(parents=True, exist_ok=True)
            s = next_step(root) if step is None else step
            tmp = root / f"{TMP_PREFIX}{step_dir_name(s)}"
            restore_swapped_out(root)
            # Left by saves that died (of any step; this process has none in flight, see
            # above): never the latest, never complete.
            for old in root.glob(f"{TMP_PREFIX}*"):
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            raise CheckpointError(f"save: cannot prepare checkpoint root {root} ({e})") from e
        return s, tmp.name, uuid.uuid4().hex

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

    error, files = None, {}
    if extra is not None:
        try:
            files = write_extra(tmp, rank(), extra)
        except Exception as e:
            error = e
    try:
        all_ok(error, f"save: writing extra into {tmp}")
    except CheckpointError as e:
        raise failed(f"save: writing extra into {tmp} failed", str(e)) from e

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
    }

    def commit() -> Path:
        try:
            commit_step(root, tmp, final, manifest | {"saved_at": time.time()})
        except OSError as e:
            free = _remove_partial(tmp, root)  # rank 0 alone: the others wait for it
            raise CheckpointError(
                f"save: committing {tmp} as {final} failed ({e}); the partial step was removed"
                f"{free}; `latest` still names the previous checkpoint"
            ) from e
        if keep_last is not None:
            try:
                prune(root, keep_last)
            except OSError as e:  # the step is committed: not a failed save
                warnings.warn(
                    f"save: {final} is committed (`latest` names it), but removing older steps "
                    f"for keep_last={keep_last} failed: {e}",
                    stacklevel=2,
                )
        return final

    writer = ChecksumWriter(str(tmp), save_id, files, overwrite=True)
    try:
        with dcp_quiet():
            if async_save:
                # Blocks only while the state is copied to CPU memory; writes in a thread.
                upload = dcp.async_save(
                    state,
                    storage_writer=writer,
                    planner=CompactSavePlanner(),
                    process_group=async_group(),
                    no_dist=not distributed(),
                )
            else:
                dcp.save(
                    state,
                    storage_writer=writer,
                    planner=CompactSavePlanner(),
                    no_dist=not distributed(),
                )
    except CheckpointException as e:  # raised on every rank when any rank failed
        raise failed(f"save to {tmp} failed", _failures(e)) from e
    if not async_save:
        return on_rank0(commit)

    def finish() -> Path:
        try:
            upload.result()
        except CheckpointException as e:  # on every rank (DCP gathers the failures)
            raise failed(f"async save to {tmp} failed", _failures(e), async_group()) from e
        # On the save's own group: every rank's handle says whether the step was committed.
        return on_rank0(commit, group=async_group())

    return background.start(final, finish)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any] | None:
    """Load a checkpoint into `model` (and `optimizer`) as they are sharded now, in place.

    Call on every rank (collective). The checkpoint may have been saved under any other layout
    (world size, EP or FSDP degree, placements, rank assignment); each rank reads the parts of
    the saved chunks that overlap its own shards, straight into its parameters and optimizer
    state (no second copy). Works in a single process without a process group (parameters
    then are plain tensors). A save in flight (`async_save=True`) is waited for first.

    Args:
        path: a checkpoint directory, or a root whose `latest` file names one.
        model: the model to fill; its parameters keep their placements.
        optimizer: an optimizer over `model`'s parameters, or None (optimizer state not read).
        verify: check every chunk's bytes against the CRC32C saved with it before anything is
            read into the model (each rank checks a share of the data files: the checkpoint is
            read once more in all). False skips it. Checkpoints saved without checksums (older
            versions) are not checked.

    Non-persistent buffers (rotary `inv_freq`, ...), which no checkpoint holds, are recomputed
    afterwards from their modules' own initialization, as a fresh build has them: after
    `model.to_empty(...)` they held garbage.

    Returns:
        The `extra` this rank saved (rank 0's when the saving run had no such rank), or None.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete (no `.metadata`, a missing or
            truncated data file, a chunk whose bytes changed since the save) or does not fit
            the model (a key missing or of another shape).
            These checks run before anything is read, and leave the model and optimizer
            untouched. An I/O error during the read itself may leave the model partly loaded;
            its message says so.
    """
    check_flag(verify, "load: verify")
    background.wait_pending("load")
    reshard_all(model)  # a unit left gathered gives its full tensors, not its shards
    check_optimizer_params(model, optimizer, "load")
    refuse_meta(model)
    refuse_untied(model)
    fresh = optimizer is not None and not optimizer.state
    try:
        return _load(path, model, optimizer, verify)
    except BaseException:
        # The state made to read into (see `state.state_dicts`) goes: the optimizer is as it was.
        if fresh:
            optimizer.state.clear()
        raise


def _load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    verify_: bool,
) -> dict[str, Any] | None:
    current = state_dicts(model, optimizer, keep_made_state=True)
    described: list = []  # rank 0's `describe`, kept for the checks below (no second read)

    def check() -> tuple[str, dict[str, Any], list, bool]:
        ckpt = resolve(path)
        info = describe(ckpt)
        described.append(info)
        info.raise_if_invalid()
        manifest = read_manifest(ckpt)
        refuse_split_ties(model, manifest.get("tied", []))
        if optimizer is not None and manifest.get("has_optimizer") is False:
            raise CheckpointError(f"load: checkpoint {ckpt} was saved without optimizer state")
        stateless = stateless_params(info, current) if optimizer is not None else []
        check_fits(info, without(current, stateless))  # global shapes: the same on every rank
        refuse_unexpected(info, current)
        return str(ckpt), manifest, stateless, has_checksums(ckpt, manifest)

    ckpt_s, manifest, stateless, checked = on_rank0(check)
    current = without(current, stateless)  # these parameters resume with no optimizer state
    ckpt = Path(ckpt_s)
    checked = checked and verify_
    if checked:  # each rank checks a share of the files
        try:
            info = described[0] if described else describe(ckpt)  # rank 0 has read it already
            problems = verify_share(info, rank(), world(), manifest.get("save_id"))
        except Exception as e:  # on every rank to all_ok: no rank left waiting
            problems = [f"{type(e).__name__}: {e}"]
        shown = "; ".join(problems[:5]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 5 else ""
        )
        all_ok(CheckpointError(shown) if problems else None, "load: checking checksums")
    if optimizer is not None:  # unpickles the saved groups: after their bytes were checked
        sources = on_rank0(lambda: check_param_groups(described[0], current))
    # `extra` is read before the model is touched, on every rank (a bad file on one rank fails
    # them all, before the collective read): a failure changes nothing.
    extra, error = None, None
    try:
        extra = read_extra(ckpt, rank(), manifest, checked)
    except CheckpointError as e:
        error = e
    all_ok(error, "load: reading extra state")
    try:
        with dcp_quiet():
            reader = DirectReader(str(ckpt))  # DCP's reader, one copy for large chunks
            dcp.load(current, storage_reader=reader, no_dist=not distributed())
    except CheckpointException as e:
        raise CheckpointError(
            f"load from {ckpt} failed while reading, after the checkpoint was checked; the model "
            f"and optimizer may be partly loaded: {_failures(e)}"
        ) from e
    # The tensors were filled in place; this applies the rest (optimizer param groups) and
    # whatever a state-dict conversion did not alias, exactly as plain DCP use does.
    if optimizer is None:
        set_model_state_dict(model, current["model"])
    else:
        # The saved groups' hyperparameters, by position as DCP read them; each group takes its
        # source's afterwards (torch's own mapping can give an empty group another's).
        hyper = [
            {k: v for k, v in g.items() if k != "params"} for g in current["optim"]["param_groups"]
        ]
        # strict=False lets the stateless parameters (checked above) stay without state; every
        # other key was checked against the checkpoint and read.
        set_state_dict(
            model,
            optimizer,
            model_state_dict=current["model"],
            optim_state_dict=current["optim"],
            options=StateDictOptions(strict=not stateless),
        )
        for group, source in zip(optimizer.param_groups, sources or []):
            group.update(hyper[source])
    refresh_buffers(model)
    return extra
