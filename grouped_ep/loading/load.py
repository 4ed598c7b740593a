"""`load_sharded`: each rank reads its own slice of a safetensors checkpoint, nothing more.

Three steps, the first two in Python, with no collective anywhere:

1. Plan. Parse every header strictly (`safetensors.py`), map each model tensor to the
   checkpoint tensors that tile it (a same-named tensor; per-expert 2-D weights stacked, gate and
   up fused; 3-D split tensors; or a user `key_map`), find the indices this rank owns from the
   tensor's own DTensor placements, and turn them into coalesced byte ranges. Every error is
   raised here, before anything is read.
2. Read. `torch.ops.grouped_ep.read_ranges` (csrc/io/reader.cpp) preads the ranges with a pool
   of threads straight into fresh CPU tensors; ranges that need a dtype cast or a copy to a GPU
   go through a bounded staging buffer (pinned and double-buffered for CUDA).
3. Swap. Only when every read succeeded: the data is swapped into meta tensors, which keep
   their identity (same objects, DTensor spec and requires_grad, as `Module.to_empty`; see
   `targets.py`), and materialized ones are overwritten in place. A failed load changes nothing.
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from grouped_ep._hf_version import require_transformers
from grouped_ep._names import unwrapped_model
from grouped_ep._reshard import reshard_all
from grouped_ep._signals import sigint_deferred
from grouped_ep._validate import canonical_device, check_can_hold, check_flag, is_int
from grouped_ep.loading.buffers import fresh_buffers, nonpersistent_names
from grouped_ep.loading.converted import conversions_cached, is_transformers_model
from grouped_ep.loading.copies import refuse_differing_copies
from grouped_ep.loading.dequant import read_quantized
from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.keys import (
    KeyMap,
    mapped_keys,
    refuse_unknown_names,
    resolve_pieces,
    unwrap_ddp,
    with_wrapped_names,
)
from grouped_ep.loading.plan import Target, local_tensor, plan_target
from grouped_ep.loading.prefixes import model_named, toggle_prefix
from grouped_ep.loading.quant import mxfp4_pieces, plan_quant
from grouped_ep.loading.quant_formats import is_quantized, orphan_scales, read_quant_config
from grouped_ep.loading.read import Progress, default_threads, read_direct, read_staged
from grouped_ep.loading.safetensors import open_checkpoint
from grouped_ep.loading.targets import model_targets, put_in_model, warn_replaced
from grouped_ep.loading.ties import refuse_split_tie
from grouped_ep.moe.layers import MoE

__all__ = ["load_sharded", "LoadReport", "LoadError"]


_log = logging.getLogger(__name__)  # at INFO: silent unless configured


@dataclass
class LoadReport:
    """What one rank's `load_sharded` did.

    bytes_read: bytes this rank read from checkpoint files (data only, headers excluded).
    bytes_owned: bytes of this rank's local shards, in the checkpoint's dtypes (quantized
        tensors: their quantized bytes). bytes_read = bytes_owned + scale_bytes_read +
        copy_bytes_compared when nothing is read twice or read for another rank.
    quantized_bytes_read: of bytes_read, the quantized values (fp8 bytes, packed FP4 pairs).
    scale_bytes_read: of bytes_read, the scale blocks covering them (each block read once).
    copy_bytes_compared: of bytes_read, the bytes read to compare copies of one key held by
        two shards (both copies whole, on every rank); 0 when no key the model reads has one.
    files_opened: files this rank read data from (every header is parsed: `headers_parsed`).
    unused_keys: checkpoint keys no model tensor maps to. Keys of experts or rows owned by
        other ranks are used, just not read here.
    missing: model tensors (first name) with no checkpoint key (only with strict=False); they
        are left untouched.
    """

    bytes_read: int
    bytes_owned: int
    files_opened: int
    seconds: float
    gbps: float
    unused_keys: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    tensors_loaded: int = 0
    headers_parsed: int = 0
    quantized_bytes_read: int = 0
    scale_bytes_read: int = 0
    copy_bytes_compared: int = 0


def _name_tensor(message: str, ckpt) -> str:
    """A read error names a file and a byte offset: add the tensor stored there."""
    prefix = "grouped_ep.read_ranges: "
    # The file by its known path (a path may itself hold ": "), then the offset after it.
    file = next((f for p, f in ckpt.files.items() if message.startswith(f"{prefix}{p}: ")), None)
    m = re.search(r" at offset (\d+)", message[len(prefix) + len(file.path) :]) if file else None
    if m is None:
        return message
    offset = int(m.group(1))
    for entry in file.tensors.values():
        if entry.start <= offset < entry.start + entry.nbytes:
            return (
                f"{message} (in tensor {entry.key!r}; the file changed since its header was read?)"
            )
    return message


def _checkpoint_note(ckpt) -> str:
    """What else may explain tensors without keys: the one file a folder was read from (a stray
    adapter file beside pickled weights), keys whose dtype this loader does not know."""
    note = ""
    root = Path(ckpt.root)
    if len(ckpt.files) == 1 and root.is_dir():
        note = f" The keys were read from {Path(next(iter(ckpt.files))).name} alone"
        pickled = sorted(p.name for p in root.glob("*.bin"))
        if pickled:
            note += f"; {pickled[0]} beside it is a pickled (torch.save) checkpoint, not read"
        note += "."
    if ckpt.unreadable:
        shown = ", ".join(f"{k!r} ({d})" for k, d in list(ckpt.unreadable.items())[:10])
        note += (
            f" The checkpoint also holds {len(ckpt.unreadable)} key(s) in a dtype this loader "
            f"cannot read: {shown}{' ...' if len(ckpt.unreadable) > 10 else ''}."
        )
    return note


def _file_key_names(message: str, key_names: dict[str, str]) -> str:
    """`message` with each quoted checkpoint key renamed by the base-model prefix alignment
    given its name in the files."""
    for renamed, original in key_names.items():
        if f"'{renamed}'" in message:  # not where it names the model's tensor
            message = re.sub(rf"(?<!tensor )'{re.escape(renamed)}'", f"'{original}'", message)
    return message


def _check_writable(targets: list[Target]) -> None:
    """Before any read: every materialized tensor the load copies into must take an in-place
    copy, or a failure halfway through the copies would leave the model partly loaded."""
    for target in targets:
        local = local_tensor(target.tensor)
        why = None
        if local.is_inference() and not torch.is_inference_mode_enabled():
            why = (
                "is an inference tensor (made under torch.inference_mode()), which cannot be "
                "written outside inference mode: call load_sharded under inference mode too, or "
                "rebuild the model outside it"
            )
        elif torch._debug_has_internal_overlap(local) == 1:
            why = (
                "has elements that share memory (an expanded or stride-0 tensor), which an "
                "in-place copy cannot fill: make it contiguous (.clone()) before loading"
            )
        if why:
            raise LoadError(f"load_sharded: model tensor {target.name!r} {why}; nothing was read")


def _owned_by_transformers(model: nn.Module, name: str) -> bool:
    """Whether the module holding tensor `name` is a transformers class (its MXFP4 experts take
    the dequantized tensor with its last two dims swapped, as transformers loads them)."""
    owner = model.get_submodule(name.rpartition(".")[0])
    # Any class up the MRO: fully_shard swaps a module's class for a subclass made on the fly.
    return any(c.__module__.startswith("transformers.") for c in type(owner).__mro__)


def _refuse_unconfigured_mxfp4(name: str, keys: list[str], ckpt, quant_cfg) -> None:
    """A model tensor found only as MXFP4 `{key}_blocks` while no quantization_config says
    mxfp4: name the keys and the missing config (not 'no checkpoint key')."""
    for key in keys:
        blocks = f"{key}_blocks"
        if blocks in ckpt and f"{key}_scales" in ckpt:
            said = (
                "no config.json quantization_config says so"
                if quant_cfg is None
                else (f"{quant_cfg.source} says quant_method {quant_cfg.method!r}")
            )
            raise LoadError(
                f"{ckpt[blocks].path}: model tensor {name!r} is stored as MXFP4 ({blocks!r}, "
                f"'{key}_scales') but {said}; an MXFP4 checkpoint's config.json needs "
                '"quantization_config": {"quant_method": "mxfp4"}'
            )


def default_device(model: nn.Module) -> torch.device:
    """Where meta tensors go by default: the device type of the model's DTensor meshes, else
    the current accelerator, else CPU."""
    for t in model.parameters():
        if isinstance(t, DTensor):
            return canonical_device(t.device_mesh.device_type)  # cuda: the current device
    return canonical_device("cuda" if torch.cuda.is_available() else "cpu")


def load_sharded(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    key_map: str | KeyMap | Mapping[str, object] | None = "auto",
    threads: int | None = None,
    progress: bool | None = None,
    strict: bool = True,
    dequantize: bool = True,
) -> LoadReport:
    """Load this rank's shard of every parameter and persistent buffer from safetensors files.

    Args:
        model: a module whose tensors are plain tensors (read whole) or DTensors (read only
            this rank's part, from their own mesh and placements: `Shard(d)` and
            `_StridedShard(d)` narrow dim d, `Replicate()` keeps it whole). Call it before
            `fully_shard` (experts as `Shard(0)` DTensors on the EP mesh) or after it. Meta
            tensors are replaced by new ones on `device` with the same DTensor spec and
            requires_grad; materialized tensors are overwritten in place.
        checkpoint: a directory with `model.safetensors.index.json`, a directory with one
            `.safetensors` file, or a `.safetensors` file (a directory holding both
            `model.safetensors` and the index: `model.safetensors`, as `from_pretrained` does).
            A Hugging Face cache snapshot (files symlinked to blobs) is read as it is.
        device: where meta tensors are materialized. Default: the device type of the model's
            DTensor meshes (a `cuda` mesh: the current CUDA device), else the current CUDA
            device when there is one, else CPU. Ignored for tensors that are not on meta.
        key_map: "auto" maps the model's fused experts (`...experts.gate_up_proj [E, 2I, H]`,
            `...experts.down_proj [E, H, I]`) to per-expert keys (`experts.{i}.gate_proj.weight`
            `[I, H]`; for a transformers model also Mixtral's
            `block_sparse_moe.experts.{i}.w1/w3/w2.weight`, which its conversion names) or 3-D
            keys, else same names. None: same names only. A callable or mapping from model name to a
            key, to a list of E keys stacked on a new dim 0 (an entry may be a tuple of keys
            concatenated on their dim 0, e.g. (gate, up)), or to None for the "auto" rule. A
            mapping entry that names no tensor of the model is an error.
        threads: parallel preads (default: the CPUs available / LOCAL_WORLD_SIZE, 1 to 16).
        progress: a progress bar on stderr (`\r` updates about once per GiB read): None
            shows it where stderr is a TTY, on local rank 0 only (`LOCAL_RANK`, else rank 0).
        strict: a parameter or persistent buffer with no checkpoint key is an error naming
            them, before anything is read (the missing-key half of
            `load_state_dict(strict=True)`). False: they are listed in `report.missing` and left
            as they are (on meta, or with their values). A tensor the checkpoint holds only in
            part (an expert stack missing an expert's keys) is an error either way. Checkpoint
            keys the model has no place
            for are never an error (real checkpoints carry some: DeepSeek-V3's multi-token
            prediction layer, which transformers ignores too); they are listed in
            `report.unused_keys`, so check it to catch a model built with the wrong config.
        dequantize: when `config.json` next to the checkpoint has a `quantization_config`
            (quant_method "fp8" with `weight_block_size`, DeepSeek-V3; or "mxfp4", gpt-oss),
            quantized tensors are read with the scale blocks covering this rank's part and
            dequantized into the model's dtype (bf16, fp16 or fp32), equal to transformers'
            own dequantization. False: a quantized checkpoint is a `LoadError`.

    After the load, non-persistent buffers still on meta (rotary `inv_freq`, whose values no
    checkpoint holds) are recomputed on `device` from their modules' own initialization, so the
    model runs as soon as this returns; where that is impossible, `LoadError` names each one.

    Returns:
        A `LoadReport`. Raises `LoadError` (nothing modified) for a bad checkpoint or mismatch.
    """
    t0 = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"load_sharded: model must be an nn.Module (the model to load into), got "
            f"{type(model).__name__}; call load_sharded(model, checkpoint)"
        )
    model, key_map = unwrap_ddp(model, key_map)  # DDP's `module.` names: the model inside
    refuse_unknown_names(model, key_map)
    key_map = with_wrapped_names(model, key_map)  # before unwrapping: `_orig_mod.` names too
    model = unwrapped_model(model)  # torch.compile's, DDP's wrapper: the model inside
    if is_transformers_model(model):
        require_transformers(LoadError, "load_sharded")
    check_flag(strict, "load_sharded: strict")
    check_flag(dequantize, "load_sharded: dequantize")
    check_flag(progress, "load_sharded: progress", none_ok=True)
    if threads is None:
        threads = default_threads()
    if not is_int(threads) or not 1 <= threads < 2**31:
        raise ValueError(f"load_sharded: threads must be an int in [1, 2**31), got {threads!r}")
    if device is None:
        device = default_device(model)
    # "cuda" -> the current device, as tensors report it
    device = canonical_device(device, "load_sharded: device")
    ckpt = open_checkpoint(checkpoint)
    quant_cfg = read_quant_config(ckpt)
    if quant_cfg is not None and not dequantize:
        raise LoadError(
            f"{quant_cfg.source}: the checkpoint is quantized (quant_method "
            f"{quant_cfg.method!r}) and load_sharded was called with dequantize=False"
        )
    paths = list(ckpt.files)
    file_ids = {p: i for i, p in enumerate(paths)}
    # A key_map of the user's names the file's own keys: the checkpoint keeps them.
    user_keys = callable(key_map) or isinstance(key_map, Mapping)
    files_ckpt = ckpt  # the keys as the files name them
    ckpt, key_names = (ckpt, {}) if user_keys else model_named(model, ckpt)
    toggles = (
        not user_keys
        and bool(getattr(model, "base_model_prefix", ""))
        and is_transformers_model(model)
    )
    # An FSDP2 unit left gathered (no reshard after its forward, e.g. the last block after an
    # eval forward) holds plain full tensors that its next state_dict() call frees: shard
    # every unit first, so that the tensors taken here are the ones that stay.
    reshard_all(model)
    targets = model_targets(model)
    if any(t.tensor.is_meta for t in targets):  # `device` is where they go: it must hold them
        check_can_hold(device, "load_sharded: device")
    used: set[str] = set()
    missing, todo, quantized, tied_copies = [], [], [], []
    try:
        with conversions_cached(model) as unprobed:
            for target in targets:
                target.pieces = resolve_pieces(
                    target.names, tuple(target.tensor.shape), ckpt, key_map, model=model
                )
                tied_copies += refuse_split_tie(target, ckpt, key_map, model)
                if not target.pieces and toggles:
                    # transformers' conversions that match the prefixed keys themselves (or rename
                    # the prefix: nemotron_h's `backbone.`): the names with the prefix added or
                    # stripped, against the keys as the files have them
                    target.pieces = resolve_pieces(
                        toggle_prefix(model, target.names),
                        tuple(target.tensor.shape),
                        files_ckpt,
                        key_map,
                        model=model,
                    )
        renamed = {old: new for new, old in key_names.items()}  # file key -> key in `ckpt`
        model_names = {n for t in targets for n in t.names}
        used.update(renamed.get(k, k) for k in tied_copies)  # equal copies of a tied tensor
        for target in targets:
            shape = tuple(target.tensor.shape)
            hf_layout = False  # transformers' gpt-oss experts: the file's last two dims swapped
            if not target.pieces and quant_cfg is not None and quant_cfg.method == "mxfp4":
                hf_layout = _owned_by_transformers(model, target.names[0])
                keys = mapped_keys(target.names, key_map)
                target.pieces = mxfp4_pieces(target.name, keys, shape, ckpt, hf_layout)
            elif not target.pieces:
                keys = mapped_keys(target.names, key_map)
                _refuse_unconfigured_mxfp4(target.name, keys, ckpt, quant_cfg)
            if not target.pieces:
                missing.append(target.name)
                continue
            used.update(renamed.get(p.entry.key, p.entry.key) for p in target.pieces)
            if is_quantized(quant_cfg, target, ckpt, model_names):
                plan_quant(target, quant_cfg, ckpt, file_ids, device, hf_layout)
                used.update(target.quant.scale_keys)
                quantized.append(target)
                continue
            plan_target(target, file_ids, device)
            todo.append(target)
    except LoadError as e:  # named as the files name them, not as renamed to fit the model
        raise LoadError(_file_key_names(str(e), key_names)) from None
    unfound = [t for t in targets if not t.pieces]  # the tensors `missing` names
    for target in unfound:  # why, where a probe was skipped
        names = target.names + (toggle_prefix(model, target.names) if toggles else [])
        for why in dict.fromkeys(unprobed[n] for n in names if n in unprobed):
            warnings.warn(why, stacklevel=2)
    if strict and missing:
        on_meta = sum(t.tensor.is_meta for t in unfound)
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        orphans = [o for t in unfound for o in orphan_scales(mapped_keys(t.names, key_map), ckpt)]
        scales = f" Scales without their tensor: {'; '.join(orphans[:5])}." if orphans else ""
        raise LoadError(
            _file_key_names(
                f"{ckpt.root}: no checkpoint key for {len(missing)} tensor(s) of the model "
                f"({on_meta} of them on meta): {shown}.{scales} Pass key_map= to name their "
                "keys, or strict=False to load the rest and list these in report.missing (left "
                f"as they are: on meta, or with their current values).{_checkpoint_note(ckpt)}",
                key_names,
            )
        )
    compared = refuse_differing_copies(files_ckpt, {key_names.get(k, k) for k in used})
    _check_writable([t for t in todo + quantized if not t.tensor.is_meta])
    try:
        buffers = fresh_buffers(model, device)  # before any read: a failure changes nothing
    except LoadError as e:
        held = [k for k in nonpersistent_names(model) if k in ckpt]
        if not held:
            raise
        raise LoadError(f"{e} ({ckpt.root} has keys of these names: {', '.join(held)})") from e

    direct = [t for t in todo if t.device.type == "cpu" and t.read_dtype == t.tensor.dtype]
    staged = [t for t in todo if not (t.device.type == "cpu" and t.read_dtype == t.tensor.dtype)]
    quant_bytes = sum(int(t.quant.rows[:, 4].sum()) for t in quantized)
    bar = Progress(sum(t.read_bytes for t in todo) + quant_bytes, progress)
    try:
        files = list(ckpt.files.values())
        nread = read_direct(direct, files, threads, bar)
        nread += read_staged(staged, files, threads, bar)
        qbytes, sbytes = read_quantized(quantized, files, threads, bar)
        nread += qbytes + sbytes
    except BaseException as e:
        for t in todo + quantized:
            t.fresh = None
        if isinstance(e, LoadError):
            raise LoadError(_name_tensor(str(e), ckpt)) from None
        raise
    finally:
        bar.close()
    todo += quantized
    with sigint_deferred():  # all of the model, or (before this) none of it
        replaced = [target.names[0] for target in todo if not put_in_model(target)]
        for target in todo:
            target.fresh = None
        for module, name, value in buffers:
            module._buffers[name] = value
    warn_replaced(replaced)
    for module in model.modules():  # tokens counted by forwards before the load belong to
        if isinstance(module, MoE):  # no step of the loaded run
            module.take_load_counts()
    files_read = {f for t in todo for f in t.rows[:, 0].tolist()}
    nread += compared
    seconds = time.perf_counter() - t0
    _log.info(  # every rank reads its own share
        "load_sharded: %d tensors, %.3f GB read from %s in %.1f s (%.2f GB/s)",
        len(todo),
        nread / 1e9,
        checkpoint,
        seconds,
        nread / seconds / 1e9 if seconds > 0 else 0.0,
    )
    return LoadReport(
        bytes_read=nread,
        bytes_owned=sum(t.quant.data_bytes if t.quant else t.read_bytes for t in todo),
        files_opened=len(files_read),
        seconds=seconds,
        gbps=nread / seconds / 1e9 if seconds > 0 else 0.0,
        unused_keys=sorted(
            key_names.get(k, k) for k in (set(ckpt.entries) | set(ckpt.unreadable)) - used
        ),
        missing=missing,
        tensors_loaded=len(todo),
        headers_parsed=len(paths),
        quantized_bytes_read=qbytes,
        scale_bytes_read=sbytes,
        copy_bytes_compared=compared,
    )
