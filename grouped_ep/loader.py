"""`load_sharded`: each rank reads its own slice of a safetensors checkpoint, nothing more.

Three steps, the first two in Python, with no collective anywhere:

1. Plan. Parse every header strictly (`grouped_ep._safetensors`), map each model tensor to the
   checkpoint tensors that tile it (a same-named tensor; per-expert 2-D weights stacked, gate and
   up fused; 3-D split tensors; or a user `key_map`), find the indices this rank owns from the
   tensor's own DTensor placements, and turn them into coalesced byte ranges. Every error is
   raised here, before anything is read.
2. Read. `torch.ops.grouped_ep.read_ranges` (csrc/io/reader.cpp) preads the ranges with a pool
   of threads straight into fresh CPU tensors; ranges that need a dtype cast or a copy to a GPU
   go through a bounded staging buffer (pinned and double-buffered for CUDA).
3. Swap. Only when every read succeeded: meta tensors are replaced (same DTensor spec, same
   requires_grad), materialized ones are overwritten in place. A failed load changes nothing.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from grouped_ep._safetensors import (
    Checkpoint,
    LoadError,
    Piece,
    clip,
    coalesce,
    local_shape,
    open_checkpoint,
    owned_indices,
    piece_ranges,
)

__all__ = ["load_sharded", "LoadReport", "LoadError"]

KeyMap = Callable[[str], "str | Sequence[str | Sequence[str]] | None"]
_CALL_BYTES = 1 << 30  # bytes per native call: the progress bar's granularity
_STAGING_BYTES = 128 << 20  # cast / host-to-device staging (two buffers of half for CUDA)


@dataclass
class LoadReport:
    """What one rank's `load_sharded` did.

    bytes_read: bytes this rank read from checkpoint files (data only, headers excluded).
    bytes_owned: bytes of this rank's local shards, in the checkpoint's dtypes. Equal to
        bytes_read when nothing is read twice or read for another rank.
    files_opened: files this rank read data from (every header is parsed: `headers_parsed`).
    unused_keys: checkpoint keys no model tensor maps to. Keys of experts or rows owned by
        other ranks are used, just not read here.
    missing: model tensors (first name) with no checkpoint key; they are left untouched.
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


@dataclass
class _Target:
    """One distinct model tensor (tied names share one), what it needs and where it goes."""

    names: list[str]
    tensor: torch.Tensor
    is_param: bool
    slots: list[tuple[nn.Module, str]]
    pieces: list[Piece] = field(default_factory=list)
    read_dtype: torch.dtype | None = None
    local_shape: tuple[int, ...] = ()
    device: torch.device | None = None
    rows: np.ndarray | None = None  # [N, 4] (file, src, dst, length) bytes
    fresh: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def read_bytes(self) -> int:
        return int(np.prod(self.local_shape, dtype=np.int64)) * self.read_dtype.itemsize


def _targets(model: nn.Module) -> list[_Target]:
    """Parameters and persistent buffers, each distinct tensor once with all its names."""
    by_id: dict[int, _Target] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        skip = getattr(module, "_non_persistent_buffers_set", set())
        items = [(n, t, True) for n, t in module._parameters.items()]
        items += [(n, t, False) for n, t in module._buffers.items() if n not in skip]
        for attr, t, is_param in items:
            if t is None:
                continue
            target = by_id.setdefault(id(t), _Target([], t, is_param, []))
            if dot + attr not in target.names:
                target.names.append(dot + attr)
            target.slots.append((module, attr))
    return list(by_id.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _plan_target(target: _Target, file_ids: dict[str, int], device: torch.device | None) -> None:
    t = target.tensor
    dtypes = {p.entry.dtype for p in target.pieces}
    if len(dtypes) != 1:
        keys = ", ".join(f"{p.entry.key} ({p.entry.dtype})" for p in target.pieces[:4])
        raise LoadError(f"{target.name}: checkpoint tensors have different dtypes: {keys}")
    src_dtype = dtypes.pop()
    if src_dtype != t.dtype and not (src_dtype.is_floating_point and t.dtype.is_floating_point):
        p = target.pieces[0].entry
        raise LoadError(
            f"{p.path}: dtype mismatch for {p.key!r}: the file holds {src_dtype}, model tensor "
            f"{target.name!r} is {t.dtype} (only floating-point dtypes are cast)"
        )
    owned = owned_indices(t, target.name)
    target.local_shape = local_shape(tuple(t.shape), owned)
    have = tuple(_local(t).shape)
    if have != target.local_shape:
        raise LoadError(
            f"{target.name}: the local tensor has shape {have} but its placements "
            f"{getattr(t, 'placements', None)} give {target.local_shape} for this rank"
        )
    target.read_dtype = src_dtype
    target.device = torch.device(device or "cpu") if t.is_meta else _local(t).device
    files, srcs, dsts, lens = [], [], [], []
    for piece in target.pieces:
        src, dst, length = piece_ranges(owned, tuple(t.shape), piece)
        files.append(np.full(len(src), file_ids[piece.entry.path], np.int64))
        srcs.append(src)
        dsts.append(dst)
        lens.append(length)
    target.rows = coalesce(*(np.concatenate(a) for a in (files, srcs, dsts, lens)))
    planned = int(target.rows[:, 3].sum()) if len(target.rows) else 0
    if planned != target.read_bytes:  # the pieces must tile this rank's shard exactly
        raise LoadError(
            f"{target.name}: checkpoint keys cover {planned} of the {target.read_bytes} bytes of "
            f"this rank's shard {target.local_shape} (keys {[p.entry.key for p in target.pieces][:4]})"
        )


# ---- key mapping ---------------------------------------------------------------------------------
# A layout is one way the checkpoint may hold a model tensor: a list of (key, offset, shape in the
# model's ndim, shape in the file). The first layout whose keys all exist wins.

_EXPERT_PARAM = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>[^.]+)$")
Layout = list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def _stacked(prefix: str, experts: int, names: Sequence[str], rows: int, cols: int) -> Layout:
    """Per-expert 2-D keys `{prefix}.{i}.{name}` of shape [rows, cols], stacked on dim 0 and
    concatenated on dim 1 in `names` order (gate rows first, then up). Experts in numeric order."""
    return [
        (f"{prefix}.{i}.{name}", (i, j * rows, 0), (1, rows, cols), (rows, cols))
        for i in range(experts)
        for j, name in enumerate(names)
    ]


def _auto_layouts(name: str, shape: tuple[int, ...]) -> list[Layout]:
    zero = (0,) * len(shape)
    # Mixtral checkpoints say `block_sparse_moe` where transformers v5 modules say `mlp`.
    aliases = list(dict.fromkeys([name, name.replace(".mlp.", ".block_sparse_moe.")]))
    layouts = [[(a, zero, shape, shape)] for a in aliases]
    m = _EXPERT_PARAM.match(name)
    if m is None or len(shape) != 3 or shape[0] == 0:
        return layouts
    e, rows, cols = shape
    proj = m["proj"]
    for prefix in dict.fromkeys(a[: -len(proj) - 1] for a in aliases):
        if proj == "gate_up_proj" and rows % 2 == 0:
            half = rows // 2
            for gate, up in (("gate_proj", "up_proj"), ("w1", "w3")):
                layouts.append(_stacked(prefix, e, [f"{gate}.weight", f"{up}.weight"], half, cols))
            split = (e, half, cols)
            layouts.append(
                [
                    (f"{prefix}.gate_proj", (0, 0, 0), split, split),
                    (f"{prefix}.up_proj", (0, half, 0), split, split),
                ]
            )
        if proj == "down_proj":
            layouts.append(_stacked(prefix, e, ["w2.weight"], rows, cols))
        layouts.append(_stacked(prefix, e, [f"{proj}.weight"], rows, cols))
        layouts.append(_stacked(prefix, e, [proj], rows, cols))
    return layouts


def _user_layout(name: str, shape: tuple[int, ...], value: object, ckpt: Checkpoint) -> Layout:
    """A key_map answer: a key, or a list of keys (or tuples of keys, concatenated on dim 0)
    stacked on a new dim 0 (one per index of dim 0) or concatenated on dim 0."""
    nd = len(shape)
    if isinstance(value, str):
        return [(value, (0,) * nd, shape, shape)]
    if not isinstance(value, Sequence):
        raise LoadError(f"key_map({name!r}) returned {value!r}; expected a key or a list of keys")
    blocks = [[item] if isinstance(item, str) else list(item) for item in value]
    for key in (k for block in blocks for k in block):
        if key not in ckpt:
            raise LoadError(f"{ckpt.root}: missing key {key!r} (key_map for {name!r})")
    shapes = [[ckpt[k].shape for k in block] for block in blocks]
    # 2-D keys into a 3-D tensor are stacked (one block per index of dim 0), else concatenated.
    stack = nd >= 2 and len(blocks) == shape[0] and all(len(s) == nd - 1 for b in shapes for s in b)
    layout: Layout = []
    offset = 0
    for i, (block, block_shapes) in enumerate(zip(blocks, shapes)):
        inner = 0
        for key, s in zip(block, block_shapes):
            if stack:
                layout.append((key, (i, inner) + (0,) * (nd - 2), (1, *s), s))
                inner += s[0]
            elif not stack and len(s) == nd and nd >= 1:
                layout.append((key, (offset,) + (0,) * (nd - 1), s, s))
                offset += s[0]
            else:
                raise LoadError(
                    f"{ckpt[key].path}: shape mismatch: key_map puts {key!r} of shape {s} into "
                    f"{name!r} of shape {shape}"
                )
    return layout


def _check_layout(
    name: str, shape: tuple[int, ...], layout: Layout, ckpt: Checkpoint
) -> list[Piece]:
    pieces = []
    for key, offset, pshape, file_shape in layout:
        entry = ckpt[key]
        if entry.shape != file_shape or any(o + n > s for o, n, s in zip(offset, pshape, shape)):
            raise LoadError(
                f"{entry.path}: shape mismatch for {key!r}: model tensor {name!r} {list(shape)} "
                f"needs {list(file_shape)} here, the file has {list(entry.shape)}"
            )
        pieces.append(Piece(entry, offset, pshape))
    return pieces


def _resolve(names: list[str], shape: tuple[int, ...], ckpt: Checkpoint, key_map) -> list[Piece]:
    """The checkpoint pieces that tile a model tensor (known by `names`), or [] if none."""
    for name in names:
        value = None
        if callable(key_map):
            value = key_map(name)
        elif isinstance(key_map, Mapping):
            value = key_map.get(name)
        elif key_map not in ("auto", None):
            raise ValueError("load_sharded: key_map must be 'auto', None, a callable or a mapping")
        if value is not None:
            layouts = [_user_layout(name, shape, value, ckpt)]
        elif key_map is None:
            layouts = [[(name, (0,) * len(shape), shape, shape)]]
        else:
            layouts = _auto_layouts(name, shape)
        partial = None
        for layout in layouts:
            found = [key in ckpt for key, *_ in layout]
            if layout and all(found):
                return _check_layout(name, shape, layout, ckpt)
            if any(found) and partial is None:
                partial = (layout[found.index(False)][0], sum(found), len(found))
        if partial is not None:
            key, n, m = partial
            raise LoadError(
                f"{ckpt.root}: missing key {key!r}: the checkpoint has {n} of the {m} keys that "
                f"make up {name!r} {list(shape)}"
            )
    return []


class _Progress:
    def __init__(self, total: int, enabled: bool | None):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.on = sys.stderr.isatty() if enabled is None else enabled

    def add(self, n: int) -> None:
        self.done += n
        if self.on:
            secs = max(time.perf_counter() - self.t0, 1e-9)
            pct = 100.0 * self.done / max(self.total, 1)
            sys.stderr.write(
                f"\rload_sharded: {pct:5.1f}% {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                f"{self.done / secs / 1e9:.2f} GB/s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


def _read(paths: list[str], outs: list[torch.Tensor], rows: np.ndarray, threads: int) -> int:
    """One native call: rows [N, 5] = (file, out, src, dst, length)."""
    if len(rows) == 0:
        return 0
    try:
        return torch.ops.grouped_ep.read_ranges(paths, outs, torch.from_numpy(rows), threads)
    except RuntimeError as e:
        raise LoadError(str(e).split("\n")[0]) from None


def _read_direct(targets, paths, threads, progress) -> int:
    """Targets read as-is into fresh CPU tensors, in native calls of about 1 GiB each."""
    batches: list[list[_Target]] = [[]]
    size = 0
    for target in targets:
        if size >= _CALL_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(target)
        size += target.read_bytes
    total = 0
    for batch in batches:
        rows = [np.zeros((0, 5), np.int64)]
        for j, target in enumerate(batch):
            target.fresh = torch.empty(target.local_shape, dtype=target.read_dtype)
            rows.append(np.insert(target.rows, 1, j, axis=1))
        n = _read(paths, [t.fresh for t in batch], np.concatenate(rows), threads)
        total += n
        progress.add(n)
    return total


def _read_staged(targets, paths, threads, progress) -> int:
    """Targets that need a cast or live on a GPU: windows of their local tensor go through a
    staging buffer (pinned and double-buffered for CUDA), then `copy_` casts / uploads them."""
    if not targets:
        return 0
    cuda = any(t.device.type == "cuda" for t in targets)
    nbuf = 2 if cuda else 1
    size = _STAGING_BYTES // nbuf
    # Windows of at most `size` bytes, packed into fills of the staging buffer: lists of
    # (target, first element, end element, byte offset in the buffer).
    fills: list[list[tuple[_Target, int, int, int]]] = []
    fill, used = [], 0
    for target in targets:
        target.fresh = torch.empty(
            target.local_shape, dtype=target.tensor.dtype, device=target.device
        )
        item = target.read_dtype.itemsize
        numel, step = target.read_bytes // item, max(1, size // item)
        for b in range(0, numel, step):
            e = min(numel, b + step)
            if fill and used + (e - b) * item > size:
                fills.append(fill)
                fill, used = [], 0
            fill.append((target, b, e, used))
            used = (used + (e - b) * item + 63) // 64 * 64  # keep every window aligned
    if fill:
        fills.append(fill)

    staging = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(nbuf)]
    events: list = [None] * nbuf
    total = 0
    for k, fill in enumerate(fills):
        buf = staging[k % nbuf]
        if events[k % nbuf] is not None:
            events[k % nbuf].synchronize()  # the upload that last read this buffer is done
        rows = []
        for target, b, e, off in fill:
            item = target.read_dtype.itemsize
            r = clip(target.rows, b * item, e * item)
            r[:, 2] += off
            rows.append(np.insert(r, 1, 0, axis=1))
        n = _read(paths, [buf], np.concatenate(rows), threads)
        total += n
        progress.add(n)
        for target, b, e, off in fill:
            src = buf[off : off + (e - b) * target.read_dtype.itemsize].view(target.read_dtype)
            target.fresh.view(-1)[b:e].copy_(src, non_blocking=cuda)
        if cuda:
            events[k % nbuf] = torch.cuda.Event()
            events[k % nbuf].record()
    if cuda:
        torch.cuda.synchronize()
    return total


def _swap(target: _Target) -> None:
    """Put `target.fresh` into the model (no failure is possible past planning)."""
    t = target.tensor
    if not t.is_meta:
        with torch.no_grad():
            _local(t).copy_(target.fresh)
        return
    new = target.fresh
    if isinstance(t, DTensor):
        new = DTensor.from_local(
            new, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    if target.is_param:
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    for module, attr in target.slots:
        (module._parameters if target.is_param else module._buffers)[attr] = new


def load_sharded(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    key_map: str | KeyMap | Mapping[str, object] | None = "auto",
    threads: int | None = None,
    progress: bool | None = None,
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
            `.safetensors` file, or a `.safetensors` file.
        device: where meta tensors are materialized (default CPU). Ignored for others.
        key_map: "auto" maps the model's fused experts (`...experts.gate_up_proj [E, 2I, H]`,
            `...experts.down_proj [E, H, I]`) to per-expert keys (`experts.{i}.gate_proj.weight`
            `[I, H]`, Mixtral's `block_sparse_moe.experts.{i}.w1/w3/w2.weight`) or 3-D keys,
            else same names. None: same names only. A callable or mapping from model name to a
            key, to a list of E keys stacked on a new dim 0 (an entry may be a tuple of keys
            concatenated on their dim 0, e.g. (gate, up)), or to None for the "auto" rule.
        threads: parallel preads (default: the CPUs available / LOCAL_WORLD_SIZE, 1 to 16).
        progress: a progress bar on stderr: None shows it on a TTY only.

    Returns:
        A `LoadReport`. Raises `LoadError` (nothing modified) for a bad checkpoint or mismatch.
    """
    t0 = time.perf_counter()
    if threads is None:
        # Share the CPUs with the other ranks of this node (torchrun sets LOCAL_WORLD_SIZE):
        # page-cache reads are memcpy-bound, and cold reads are kept busy by read-ahead hints.
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        threads = max(1, min(16, len(os.sched_getaffinity(0)) // local_ranks))
    if threads < 1:
        raise ValueError(f"load_sharded: threads must be >= 1, got {threads}")
    ckpt = open_checkpoint(checkpoint)
    paths = list(ckpt.files)
    file_ids = {p: i for i, p in enumerate(paths)}
    targets = _targets(model)
    used: set[str] = set()
    missing, todo = [], []
    for target in targets:
        target.pieces = _resolve(target.names, tuple(target.tensor.shape), ckpt, key_map)
        if not target.pieces:
            missing.append(target.name)
            continue
        used.update(p.entry.key for p in target.pieces)
        _plan_target(target, file_ids, device)
        todo.append(target)

    direct = [t for t in todo if t.device.type == "cpu" and t.read_dtype == t.tensor.dtype]
    staged = [t for t in todo if not (t.device.type == "cpu" and t.read_dtype == t.tensor.dtype)]
    bar = _Progress(sum(t.read_bytes for t in todo), progress)
    try:
        nread = _read_direct(direct, paths, threads, bar)
        nread += _read_staged(staged, paths, threads, bar)
    except BaseException:
        for t in todo:
            t.fresh = None
        raise
    finally:
        bar.close()
    for target in todo:
        _swap(target)
        target.fresh = None
    files_read = {f for t in todo for f in t.rows[:, 0].tolist()}
    seconds = time.perf_counter() - t0
    return LoadReport(
        bytes_read=nread,
        bytes_owned=sum(t.read_bytes for t in todo),
        files_opened=len(files_read),
        seconds=seconds,
        gbps=nread / seconds / 1e9 if seconds > 0 else 0.0,
        unused_keys=sorted(set(ckpt.entries) - used),
        missing=missing,
        tensors_loaded=len(todo),
        headers_parsed=len(paths),
    )
