"""Planning for `load_sharded`: strict safetensors headers, shard indices, byte ranges.

No I/O beyond headers: from a tensor's DTensor placements to the global indices this rank owns
(per dim), and from those indices plus the checkpoint tensors ("pieces") that tile the global
tensor to coalesced byte ranges (file offset, destination offset, length).

A safetensors file is: 8 bytes (little-endian u64 N), N bytes of UTF-8 JSON mapping each tensor
name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the byte after
the header), an optional `"__metadata__"` string map, then the data. Every check here names the
file and, where there is one, the key; anything wrong is a `LoadError`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class LoadError(ValueError):
    """A checkpoint cannot be loaded into the model; the message names the file and key."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; `start` is its absolute byte offset in the file."""

    key: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass
class SafetensorsFile:
    """The validated header of one file."""

    path: str
    size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise LoadError(f"duplicate key {k!r} in header")
        out[k] = v
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse and validate the header of one safetensors file.

    Checks: the header length fits the file, the header is a JSON object, every dtype is known,
    shapes are lists of non-negative ints, each tensor's byte length matches its shape, and the
    data offsets tile the data section exactly (sorted, contiguous, no overlap, no gap, ending
    at the end of the file).
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise LoadError(
                    f"{path}: truncated file: {size} bytes, too short for the 8-byte header length"
                )
            n = int.from_bytes(prefix, "little")
            if n > size - 8:
                raise LoadError(
                    f"{path}: header length {n} is larger than the file allows "
                    f"({size} bytes in all; truncated file or not a safetensors file)"
                )
            if n > MAX_HEADER_BYTES:
                raise LoadError(f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise LoadError(f"{path}: checkpoint file not found") from None
    except IsADirectoryError:
        raise LoadError(f"{path}: is a directory, expected a .safetensors file") from None
    except OSError as e:
        raise LoadError(f"{path}: cannot read header: {e}") from None
    if len(raw) != n:
        raise LoadError(f"{path}: truncated header: wanted {n} bytes, got {len(raw)}")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except LoadError as e:
        raise LoadError(f"{path}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise LoadError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise LoadError(f"{path}: header must be a JSON object, got {type(header).__name__}")

    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise LoadError(f"{path}: __metadata__ must be an object of strings")
    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        where = f"{path}: tensor {key!r}"
        if not isinstance(info, dict):
            raise LoadError(f"{where}: header entry must be an object, got {info!r:.80}")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise LoadError(f"{where}: unknown dtype {dtype_name!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise LoadError(
                f"{where}: shape must be a list of non-negative ints, got {shape!r:.80}"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
        ):
            raise LoadError(f"{where}: data_offsets must be [begin, end] ints, got {offsets!r:.80}")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise LoadError(f"{where}: data_offsets [{begin}, {end}] are not 0 <= begin <= end")
        if end > data_size:
            raise LoadError(
                f"{where}: data_offsets [{begin}, {end}] out of range: the data section has "
                f"{data_size} bytes (truncated file?)"
            )
        dtype = DTYPES[dtype_name]
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise LoadError(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape "
                f"{shape} of {dtype_name} needs {want}"
            )
        tensors[key] = TensorEntry(key, path, dtype, tuple(shape), data_start + begin, end - begin)
        spans.append((begin, end, key))

    spans.sort()
    pos, prev_key = 0, None
    for begin, end, key in spans:
        if begin < pos:
            raise LoadError(
                f"{path}: data of tensor {key!r} at [{begin}, {end}) overlaps tensor {prev_key!r}"
            )
        if begin > pos:
            raise LoadError(
                f"{path}: data offsets are not contiguous: gap [{pos}, {begin}) before tensor "
                f"{key!r}"
            )
        pos, prev_key = end, key
    if pos != data_size:
        raise LoadError(
            f"{path}: tensors end at data byte {pos} but the file has {data_size} data bytes "
            "(trailing bytes or wrong header)"
        )
    return SafetensorsFile(path, size, data_start, tensors, metadata)


@dataclass
class Checkpoint:
    """A checkpoint's key -> tensor table, over one or several files."""

    root: str
    files: dict[str, SafetensorsFile]
    entries: dict[str, TensorEntry]

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LoadError(f"{index_path}: cannot read index: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{index_path}: index is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise LoadError(f"{index_path}: index must hold a 'weight_map' of key -> file name")
    return weight_map


def open_checkpoint(checkpoint: str | os.PathLike) -> Checkpoint:
    """Find and validate every header of a checkpoint.

    `checkpoint` is a directory holding `model.safetensors.index.json` (or another single
    `*.safetensors.index.json`), a directory holding one `.safetensors` file, a `.safetensors`
    file, or an index file.
    """
    path = Path(checkpoint)
    index_path: Path | None = None
    single: Path | None = None
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            index_path = path / INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            single = path / SINGLE_NAME
        else:
            indexes = sorted(path.glob("*.safetensors.index.json"))
            files = sorted(path.glob("*.safetensors"))
            if len(indexes) == 1:
                index_path = indexes[0]
            elif not indexes and len(files) == 1:
                single = files[0]
            else:
                raise LoadError(
                    f"{path}: expected {INDEX_NAME} or a single .safetensors file, found "
                    f"{len(indexes)} index files and {len(files)} .safetensors files"
                )
    elif path.name.endswith(".index.json"):
        index_path = path
    elif path.is_file():
        single = path
    else:
        raise LoadError(f"{path}: checkpoint not found")

    files: dict[str, SafetensorsFile] = {}
    entries: dict[str, TensorEntry] = {}
    if single is not None:
        header = read_header(single)
        files[header.path] = header
        entries.update(header.tensors)
        return Checkpoint(str(path), files, entries)

    weight_map = _read_index(index_path)
    base = index_path.parent
    for key, name in weight_map.items():
        file_path = str(base / name)
        if file_path not in files:
            if not os.path.isfile(file_path):
                raise LoadError(
                    f"{index_path}: shard file {name!r} (holding {key!r}) not found in {base}"
                )
            files[file_path] = read_header(file_path)
        header = files[file_path]
        if key not in header.tensors:
            raise LoadError(
                f"{file_path}: missing key {key!r}, which {index_path.name} places there"
            )
        entries[key] = header.tensors[key]
    return Checkpoint(str(path), files, entries)


# ---- shard indices and byte ranges --------------------------------------------------------------

try:  # torch >= 2.5 has right-to-left sharding (FSDP on top of a dim-0 sharded DTensor)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor placed in the model tensor's global coordinates.

    `offset` and `shape` have the model tensor's ndim: a per-expert 2-D weight `[I, H]` that is
    expert i's gate rows of `gate_up_proj [E, 2I, H]` has offset `(i, 0, 0)`, shape `(1, I, H)`.
    """

    entry: TensorEntry
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def _chunk(idx: np.ndarray, parts: int, rank: int) -> np.ndarray:
    """torch.chunk's rule, as DTensor's Shard uses it: chunks of ceil(n / parts), the last ones
    smaller or empty."""
    size = -(-len(idx) // parts) if parts else 0
    return idx[rank * size : (rank + 1) * size]


def owned_indices(t: torch.Tensor, name: str) -> list[np.ndarray | None]:
    """Per dim of `t`'s global shape: the global indices this rank holds, in local order, or None
    for the whole dim. A plain tensor holds everything.

    Placements apply left to right over the mesh dims, as in
    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: `Shard(d)` keeps
    this rank's `torch.chunk` of what the earlier mesh dims left on dim d; `_StridedShard(d, sf)`
    chunks into `sf` pieces, chunks each piece across the mesh dim, and keeps this rank's chunk
    of every piece (in piece order).
    """
    if not isinstance(t, DTensor):
        return [None] * t.ndim
    mesh, shape = t.device_mesh, tuple(t.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        raise LoadError(f"{name}: this rank is not part of the DTensor's mesh {mesh}")
    idx: list[np.ndarray | None] = [None] * t.ndim
    for mesh_dim, p in enumerate(t.placements):
        if p.is_replicate():
            continue
        if not (p.is_shard() or isinstance(p, _StridedShard)):
            raise LoadError(
                f"{name}: placement {p} on mesh dim {mesh_dim} cannot be loaded (only Shard and "
                "Replicate have a defined local part of a checkpoint tensor)"
            )
        d = p.dim % t.ndim
        cur = idx[d] if idx[d] is not None else np.arange(shape[d], dtype=np.int64)
        parts, rank = mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            cur = np.concatenate([_chunk(_chunk(cur, sf, j), parts, rank) for j in range(sf)])
        else:
            cur = _chunk(cur, parts, rank)
        idx[d] = cur
    return idx


def local_shape(global_shape: tuple[int, ...], owned: list[np.ndarray | None]) -> tuple[int, ...]:
    return tuple(n if o is None else len(o) for n, o in zip(global_shape, owned))


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired index lists into runs where both advance by one: (src0, dst0, length)."""
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.nonzero(brk)[0]
    lengths = np.diff(np.append(starts, len(src)))
    return src[starts], dst[starts], lengths


def piece_ranges(
    owned: list[np.ndarray | None],
    global_shape: tuple[int, ...],
    piece: Piece,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges of `piece` that land in this rank's local tensor.

    Returns (src, dst, length) int64 arrays: src is an absolute file offset, dst a byte offset
    into the contiguous local tensor `[local_shape]` held in the checkpoint's dtype. Innermost
    dims that are whole on both sides are merged, so a row-sharded matrix is a single range.
    """
    empty = (np.zeros(0, np.int64),) * 3
    item = piece.entry.dtype.itemsize
    nd = len(global_shape)
    if nd == 0:
        return np.array([piece.entry.start]), np.array([0]), np.array([item])
    lshape = local_shape(global_shape, owned)
    src_pos, dst_pos = [], []
    for d in range(nd):
        idx = owned[d] if owned[d] is not None else np.arange(global_shape[d], dtype=np.int64)
        rel = idx - piece.offset[d]
        sel = np.nonzero((rel >= 0) & (rel < piece.shape[d]))[0]
        if sel.size == 0:
            return empty
        src_pos.append(rel[sel])
        dst_pos.append(sel.astype(np.int64))

    def whole(d: int) -> bool:
        n = piece.shape[d]
        every = np.arange(n)
        return (
            n == lshape[d]
            and np.array_equal(src_pos[d], every)
            and np.array_equal(dst_pos[d], every)
        )

    k = nd - 1
    while k > 0 and whole(k):
        k -= 1
    inner = math.prod(piece.shape[k + 1 :])
    s_stride, d_stride = _strides(piece.shape), _strides(lshape)
    run_src, run_dst, run_len = _runs(src_pos[k], dst_pos[k])
    src = run_src * s_stride[k]
    dst = run_dst * d_stride[k]
    for d in range(k - 1, -1, -1):  # outer dims: one entry per index, row-major order
        src = np.add.outer(src_pos[d] * s_stride[d], src).ravel()
        dst = np.add.outer(dst_pos[d] * d_stride[d], dst).ravel()
    length = np.tile(run_len * inner, len(src) // len(run_len))
    return piece.entry.start + src * item, dst * item, length * item


def coalesce(file: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Sort ranges by (file, src) and merge neighbours contiguous in both file and destination.

    Returns int64 [N, 4]: (file, src, dst, length). Empty ranges are dropped.
    """
    keep = length > 0
    file, src, dst, length = file[keep], src[keep], dst[keep], length[keep]
    if len(src) == 0:
        return np.zeros((0, 4), np.int64)
    order = np.lexsort((src, file))
    file, src, dst, length = file[order], src[order], dst[order], length[order]
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (
        (file[1:] != file[:-1])
        | (src[1:] != src[:-1] + length[:-1])
        | (dst[1:] != dst[:-1] + length[:-1])
    )
    starts = np.nonzero(brk)[0]
    return np.stack(
        [file[starts], src[starts], dst[starts], np.add.reduceat(length, starts)], axis=1
    ).astype(np.int64)


def clip(rows: np.ndarray, begin: int, end: int) -> np.ndarray:
    """The parts of ranges `rows` [N, 4] whose destination falls in bytes [begin, end), with the
    destination made relative to `begin`."""
    dst, length = rows[:, 2], rows[:, 3]
    sel = (dst < end) & (dst + length > begin)
    r = rows[sel].copy()
    lo = np.maximum(r[:, 2], begin)
    hi = np.minimum(r[:, 2] + r[:, 3], end)
    r[:, 1] += lo - r[:, 2]
    r[:, 2] = lo - begin
    r[:, 3] = hi - lo
    return r
