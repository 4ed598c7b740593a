"""`load`: a checkpoint of `save` into a model (and optimizer) as they are sharded now.

It checks the checkpoint against the model and optimizer first (every key present, the same
global shapes, every data file there and long enough, on every rank against its own model), then
lets DCP read straight into the live tensors, as plain DCP does: no second copy of the state.
Every rank reads the checkpoint its own `path` names; they must name the same save.
"""

from __future__ import annotations

import logging
import os
import time
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
import grouped_ep.checkpoint.writer as jobs
from grouped_ep._reshard import reshard_all
from grouped_ep._validate import check_flag
from grouped_ep.checkpoint.checksum import checksum_kind, read_manifest, verify_share
from grouped_ep.checkpoint.collective import (
    all_ok,
    dcp_quiet,
    distributed,
    failures,
    on_rank0,
    own_interrupt,
    rank,
    same_on_every_rank,
    world,
)
from grouped_ep.checkpoint.direct_reader import DirectReader
from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.extra import read_extra
from grouped_ep.checkpoint.fit import (
    check_fits,
    check_format,
    check_param_groups,
    refuse_meta,
    refuse_split_ties,
    refuse_unexpected,
    refuse_untied,
    stateless_params,
    take_unsaved_hyperparameters,
    warn_untracked_ties,
    without,
)
from grouped_ep.checkpoint.inspect import describe
from grouped_ep.checkpoint.layout import resolve
from grouped_ep.checkpoint.made_state import warn_made_state
from grouped_ep.checkpoint.save_args import check_optimizer_params, check_types
from grouped_ep.checkpoint.state import state_dicts
from grouped_ep.loading.buffers import refresh_buffers

__all__ = ["load"]

_log = logging.getLogger(__name__)  # rank 0's loads, at INFO: silent unless configured


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
            versions) are not checked; older ones with CRC-32s are checked against those.

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
    error = None  # on every rank: one rank's refusal alone left the others in a collective
    try:
        check_types(model, optimizer, None, "load")
        check_flag(verify, "load: verify")
    except CheckpointError as e:
        error = e
    except ValueError as e:
        error = CheckpointError(str(e))
    all_ok(error, "load: checking its arguments")
    # Different ones would run different collectives: a hang until the timeout (a review).
    same_on_every_rank(
        (optimizer is not None, verify), "load: whether an optimizer is given and verify"
    )
    background.wait_pending("load")
    reshard_all(model)  # a unit left gathered gives its full tensors, not its shards
    error = None
    try:
        check_optimizer_params(model, optimizer, "load")
        refuse_meta(model)
        refuse_untied(model)
    except CheckpointError as e:
        error = e
    all_ok(error, "load: checking the model and optimizer")
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
    started = time.perf_counter()
    current = state_dicts(model, optimizer, keep_made_state=True)
    # torch's step of zeros ran (gradients set aside for it) and built no state: it keeps none
    stateless_optimizer = optimizer is not None and not current["optim"]["state"]
    ckpt = _own_checkpoint(path)
    described: list = []  # rank 0's `describe`, kept for the checks below (no second read)

    def check() -> tuple[dict[str, Any], list, str | None]:
        manifest = read_manifest(ckpt)  # a newer format first: its files may differ from ours
        check_format(ckpt, manifest)
        kind = checksum_kind(ckpt, manifest)
        info = describe(ckpt)
        described.append(info)
        info.raise_if_invalid()
        refuse_split_ties(model, manifest.get("tied", []))
        if optimizer is not None and manifest.get("has_optimizer") is False:
            raise CheckpointError(f"load: checkpoint {ckpt} was saved without optimizer state")
        stateless = stateless_params(info, current) if optimizer is not None else []
        warn_untracked_ties(ckpt, manifest, stateless)
        check_fits(info, without(current, stateless))  # rank 0's model; the others' below
        refuse_unexpected(info, current, stateless_optimizer)
        return manifest, stateless, kind

    manifest, stateless, kind = on_rank0(check)
    current = without(current, stateless)  # these parameters resume with no optimizer state
    info, error = described[0] if described else None, None
    if info is None:  # the other ranks' models: each may differ from rank 0's
        try:
            info = describe(ckpt)
            check_fits(info, current)
            refuse_unexpected(info, current, stateless_optimizer)
        except Exception as e:  # noqa: BLE001 (on every rank to all_ok: no rank left waiting)
            error = e if isinstance(e, CheckpointError) else CheckpointError(f"{e!r}")
    all_ok(error, "load: checking the model against the checkpoint")
    checked = kind is not None and verify_
    if checked:  # each rank checks a share of the files
        try:
            problems = verify_share(info, rank(), world(), manifest.get("save_id"), kind)
        except Exception as e:  # on every rank to all_ok: no rank left waiting
            problems = [f"{type(e).__name__}: {e}"]
        shown = "; ".join(problems[:5]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 5 else ""
        )
        all_ok(CheckpointError(shown) if problems else None, "load: checking checksums")
    if optimizer is not None:  # unpickles the saved groups: after their bytes were checked
        sources = on_rank0(lambda: check_param_groups(described[0], current))
        unsaved = take_unsaved_hyperparameters(info, current)
    # `extra` is read before the model is touched, on every rank (a bad file on one rank fails
    # them all, before the collective read): a failure changes nothing.
    extra, error = None, None
    try:
        extra = read_extra(ckpt, rank(), manifest, checked, world())
    except CheckpointError as e:
        error = e
    all_ok(error, "load: reading extra state")
    try:
        with dcp_quiet():
            reader = DirectReader(str(ckpt))  # DCP's reader, one copy for large chunks
            dcp.load(current, storage_reader=reader, no_dist=not distributed())
    except CheckpointException as e:
        error = CheckpointError(
            f"load from {ckpt} failed while reading, after the checkpoint was checked; the model "
            f"and optimizer may be partly loaded: {failures(e)}"
        )
        interrupt = own_interrupt(e)
        if interrupt is not None:  # a loop that starts afresh when a load fails trained the
            # partly loaded model on (a review: 3 of 8 tensors loaded)
            raise interrupt from error
        raise error from e
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
        for group, kept in zip(optimizer.param_groups, unsaved):
            for key, value in kept.items():
                group.setdefault(key, value)
        warn_made_state(ckpt, manifest, optimizer)
    refresh_buffers(model, warn_random=rank() == 0)
    jobs.read(ckpt)  # a save into its root from here continues the step it saw
    if rank() == 0:
        _log.info(
            "load: %s read into the model%s in %.1f s (checksums %s)",
            ckpt,
            " and optimizer" if optimizer is not None else "",
            time.perf_counter() - started,
            "checked" if checked else "not checked",
        )
    return extra


def _own_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names on this rank. Every rank resolves its own (a node-local copy
    may lie elsewhere); they must be the same save, by the id in its manifest (a plain DCP
    checkpoint: by the resolved path). Before, rank 0's choice was read on every rank."""
    if not distributed():
        return resolve(path)
    ckpt, ident, error = None, None, None
    try:
        ckpt = resolve(path)
        ident = read_manifest(ckpt).get("save_id") or str(ckpt.resolve())
    except Exception as e:  # noqa: BLE001 (on every rank to all_ok: no rank left waiting)
        error = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: {e!r}")
    all_ok(error, f"load: finding the checkpoint {path}")
    same_on_every_rank(ident, "load: the checkpoints that path names", shown=f"{ckpt} ({ident})")
    return ckpt
