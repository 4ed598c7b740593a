"""`save` and `load` of sharded models and optimizers over torch.distributed.checkpoint (DCP).

Layout of a checkpoint root (`save(root, ...)`):

    root/
      latest                 text file naming the newest complete checkpoint ("step-00000123")
      step-00000123/         one complete checkpoint
        .metadata            DCP metadata: every key, global shape, dtype, chunks, byte ranges
        __<rank>_0.distcp    the bytes each rank owns (replicated tensors written once)
        extra-rank00000.pt   `extra` of each rank (torch.save), if given
        grouped_ep.json      manifest: step, world size, whether an optimizer was saved
      .tmp-step-00000124/    a save in progress (never read; removed by the next save)

A save writes everything into `.tmp-step-N`, waits for every rank, then rank 0 renames it to
`step-N` (one atomic rename) and replaces `latest` atomically (write a temporary file, then
`os.replace`). A save that dies midway leaves the previous checkpoint and `latest` untouched.

Model and optimizer state go through torch.distributed.checkpoint (DCP) with the state dicts of
`get_state_dict`, so a checkpoint saved under one layout (world size, EP degree, FSDP degree,
placements) loads under another: DCP records each chunk's global offsets and reads, for every
rank, the overlap of the saved chunks with that rank's shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.inspect import CheckpointInfo, describe
from grouped_ep.checkpoint.layout import (
    LATEST_FILE,
    MANIFEST_FILE,
    TMP_PREFIX,
    fsync_dir,
    next_step,
    resolve,
    step_dir_name,
    write_text_atomic,
)

__all__ = ["save", "load"]

FORMAT_VERSION = 1

_T = TypeVar("_T")


# ---- process group helpers (all of them work without init_process_group) -----------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _on_rank0(fn: Callable[[], _T]) -> _T:
    """Run `fn` on rank 0 and give every rank its result, or raise its error on every rank."""
    if not _distributed():
        return fn()
    msg: list[Any] = [None, None]  # [result, error text]
    error: Exception | None = None
    if _rank() == 0:
        try:
            msg[0] = fn()
        except Exception as e:  # sent to the other ranks so that nobody waits forever
            error, msg[1] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(msg, src=0)
    if error is not None:
        raise error
    if msg[1] is not None:
        raise CheckpointError(f"rank 0 failed: {msg[1]}")
    return msg[0]


def _all_ok(error: Exception | None, what: str) -> None:
    """Raise on every rank if `error` is set on any rank."""
    texts: list[str | None] = [None if error is None else f"{type(error).__name__}: {error}"]
    if _distributed():
        gathered: list[str | None] = [None] * _world()
        dist.all_gather_object(gathered, texts[0])
        texts = gathered
    if error is not None:
        raise CheckpointError(f"{what} failed on rank {_rank()}: {error}") from error
    failed = {r: t for r, t in enumerate(texts) if t is not None}
    if failed:
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {failed}")


# ---- state dicts --------------------------------------------------------------------------------


class _CompactSavePlanner(DefaultSavePlanner):
    """Writes each tensor's own bytes only.

    `torch.save` of a view writes the whole storage it views (an FSDP2 shard is a view of a
    padded buffer; a user may keep params as views of one flat buffer). DCP's file writer clones
    such tensors on CPU in current releases; doing it here makes it hold for every writer and
    for device tensors too.
    """

    def resolve_data(self, write_item: WriteItem):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.untyped_storage().nbytes() != data.nbytes:
            data = data.detach().clone(memory_format=torch.contiguous_format)
        return data


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    opts = StateDictOptions(full_state_dict=False)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": msd, "optim": osd}


def _empty_copy(obj: Any) -> Any:
    """The same nested structure with every tensor (DTensor included) replaced by empty_like."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _empty_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_empty_copy(v) for v in obj]
    return obj


def _flat_tensor_shapes(obj: Any, prefix: str) -> dict[str, torch.Size]:
    """DCP's flattened key (`model.layer.weight`) -> global shape, for every tensor in `obj`."""
    out: dict[str, torch.Size] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.shape  # a DTensor's .shape is its global shape
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensor_shapes(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _check_fits(info: CheckpointInfo, state: dict[str, Any]) -> None:
    """Raise CheckpointError naming every key that is missing or has another shape."""
    saved = info.metadata.state_dict_metadata
    problems = []
    for key, shape in _flat_tensor_shapes(state, "").items():
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{key}: not in the checkpoint")
        elif not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key}: saved as a non-tensor object")
        elif tuple(meta.size) != tuple(shape):
            problems.append(
                f"{key}: checkpoint has global shape {list(meta.size)}, model {list(shape)}"
            )
    if problems:
        shown = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        raise CheckpointError(f"checkpoint {info.path} does not fit the model:\n  {shown}")


# ---- save / load --------------------------------------------------------------------------------


def save(
    root: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    step: int | None = None,
) -> Path:
    """Save `model` (and `optimizer`) sharded as they are, atomically, as `root/step-<step>`.

    Call on every rank (collective). Each rank writes only the bytes of its own shards;
    replicated tensors are written once. Works in a single process without a process group.

    Args:
        root: checkpoint root directory (created if needed).
        model: the model; parameters may be DTensors (any mesh and placements) or plain tensors.
        optimizer: an optimizer over `model`'s parameters, or None.
        extra: user state of this rank (step, RNG states, scheduler state dict, ...), written
            with torch.save per rank and returned by `load`.
        step: the step number in the directory name. Default: `extra["step"]` when that is an
            int, else one more than the highest step already in `root`.

    Returns:
        The checkpoint directory, `root/step-<step:08d>`. `root/latest` names it afterwards.
    """
    root = Path(root)
    if step is None and extra is not None and isinstance(extra.get("step"), int):
        step = extra["step"]
    if step is not None and (not isinstance(step, int) or step < 0):
        raise CheckpointError(f"save: step must be a non-negative int, got {step!r}")

    def prepare() -> tuple[int, str]:
        if root.exists() and not root.is_dir():
            raise CheckpointError(f"save: checkpoint root {root} exists and is not a directory")
        root.mkdir(parents=True, exist_ok=True)
        s = next_step(root) if step is None else step
        tmp = root / f"{TMP_PREFIX}{step_dir_name(s)}"
        if tmp.exists():  # left by a save that died; it was never the latest
            shutil.rmtree(tmp)
        tmp.mkdir()
        return s, tmp.name

    step_, tmp_name = _on_rank0(prepare)
    tmp = root / tmp_name
    final = root / step_dir_name(step_)

    state = _state(model, optimizer)
    try:
        with _dcp_quiet():
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(tmp), overwrite=True),
                planner=_CompactSavePlanner(),
                no_dist=not _distributed(),
            )
    except CheckpointException as e:  # raised on every rank when any rank failed
        raise CheckpointError(f"save to {tmp} failed: {e}") from e

    error = None
    if extra is not None:
        try:
            torch.save(extra, tmp / f"extra-rank{_rank():05d}.pt")
        except Exception as e:
            error = e
    _all_ok(error, f"save: writing extra into {tmp}")

    def commit() -> None:
        manifest = {
            "format": FORMAT_VERSION,
            "step": step_,
            "world_size": _world(),
            "has_optimizer": optimizer is not None,
            "has_extra": extra is not None,
            "saved_at": time.time(),
            "torch": torch.__version__,
        }
        write_text_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
        fsync_dir(tmp)
        old = None
        if final.exists():  # saving the same step again: swap the old one out, then delete it
            old = root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        write_text_atomic(root / LATEST_FILE, final.name + "\n")
        fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    _on_rank0(commit)
    return final


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any] | None:
    """Load a checkpoint into `model` (and `optimizer`) as they are sharded now.

    Call on every rank (collective). The checkpoint may have been saved under any other layout
    (world size, EP or FSDP degree, placements, rank assignment); each rank reads the parts of
    the saved chunks that overlap its own shards. Works in a single process without a process
    group (parameters then are plain tensors).

    Args:
        path: a checkpoint directory, or a root whose `latest` file names one.
        model: the model to fill; its parameters keep their placements.
        optimizer: an optimizer over `model`'s parameters, or None (optimizer state not read).

    Returns:
        The `extra` this rank saved (rank 0's when the saving run had no such rank), or None.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete (no `.metadata`, a missing or
            truncated data file) or does not fit the model (a key missing or of another shape).
            The check runs before any parameter is written; the state is read into new buffers
            and copied into the model only once all of it was read.
    """

    current = _state(model, optimizer)  # also creates optimizer state if there is none yet

    def check() -> tuple[str, dict[str, Any]]:
        ckpt = resolve(path)
        info = describe(ckpt)
        info.raise_if_invalid()
        manifest_path = ckpt / MANIFEST_FILE
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        if optimizer is not None and manifest.get("has_optimizer") is False:
            raise CheckpointError(f"load: checkpoint {ckpt} was saved without optimizer state")
        _check_fits(info, current)  # global shapes: the same on every rank
        return str(ckpt), manifest

    ckpt_s, manifest = _on_rank0(check)
    ckpt = Path(ckpt_s)
    # Read into new buffers so that a failure midway leaves the model as it was.
    state = _empty_copy(current)
    try:
        with _dcp_quiet():
            reader = dcp.FileSystemReader(str(ckpt))
            dcp.load(state, storage_reader=reader, no_dist=not _distributed())
    except CheckpointException as e:
        raise CheckpointError(f"load from {ckpt} failed: {e}") from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    own = ckpt / f"extra-rank{_rank():05d}.pt"
    extra_file = own if own.is_file() else ckpt / "extra-rank00000.pt"
    if not extra_file.is_file():
        if manifest.get("has_extra"):
            raise CheckpointError(f"load: {extra_file} is missing (the checkpoint had extra state)")
        return None
    try:
        # The checkpoint is trusted as much as DCP's own pickled .metadata is.
        return torch.load(extra_file, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"load: cannot read {extra_file} ({type(e).__name__}: {e})") from e
