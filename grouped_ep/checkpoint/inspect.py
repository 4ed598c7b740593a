"""Reading and checking a DCP checkpoint directory without loading it.

A torch.distributed.checkpoint (DCP) directory holds `.metadata` (a pickle naming every key, its
global shape and dtype, the chunks it was saved in and where each chunk's bytes lie) and one or
more `__<rank>_<i>.distcp` files with the bytes. `describe` reads the metadata and checks it
against the files; `python -m grouped_ep inspect DIR` prints the result.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from grouped_ep.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class ChunkInfo:
    """One saved piece of a tensor: `offsets`/`sizes` in the global shape, bytes in `file`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None  # relative path; None when the metadata names no storage for it
    file_offset: int
    length: int  # bytes in the file, serialization framing included


@dataclass
class TensorInfo:
    """A saved tensor: global `shape`, `dtype` name, the chunks it was saved in."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    element_size: int
    chunks: list[ChunkInfo] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor (each element once)."""
        return math.prod(self.shape) * self.element_size


@dataclass
class CheckpointInfo:
    """What a checkpoint directory holds, and what is wrong with it (`problems`, empty if OK)."""

    path: Path
    metadata: Metadata | None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    objects: dict[str, ChunkInfo] = field(default_factory=dict)  # pickled non-tensor values
    files: dict[str, int] = field(default_factory=dict)  # file name -> size in bytes
    problems: list[str] = field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        """Unique bytes of all tensors (each element once)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.files.values())

    def raise_if_invalid(self) -> None:
        if self.problems:
            shown = "\n  ".join(self.problems[:20])
            more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
            raise CheckpointError(f"checkpoint {self.path} is not usable:\n  {shown}{more}")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of checkpoint directory `path`; CheckpointError if absent or unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {METADATA_FILE} file: not a complete DCP checkpoint (a save "
            "that did not finish writes none)"
        )
    _check_metadata_crc(path)  # before unpickling it: one flipped bit could ask for many GB
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign file: pickle raises many types
        raise CheckpointError(
            f"checkpoint {path}: cannot read {METADATA_FILE} ({type(e).__name__}: {e})"
        ) from e


def _check_metadata_crc(path: Path) -> None:
    """Against the `[length, CRC32C]` of `.metadata` that the manifest records (saves since
    2026-11-28; others, and a manifest that cannot be read, which `load` names, are not
    checked)."""
    from grouped_ep.checkpoint.checksum import file_crc  # both import this module
    from grouped_ep.checkpoint.layout import MANIFEST_FILE

    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return
    want = manifest.get("metadata_crc32c") if isinstance(manifest, dict) else None
    if want is None:
        return
    try:
        got = file_crc(path / METADATA_FILE)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {METADATA_FILE} ({e})") from e
    if got != want:
        raise CheckpointError(
            f"{path / METADATA_FILE}: its [length, CRC32C] is {got}, the manifest "
            f"{path / MANIFEST_FILE} records {want}: the file changed since the save (damaged)"
        )


def _coverage_problems(key: str, shape: tuple[int, ...], chunks: list[ChunkInfo]) -> list[str]:
    """Problems unless the chunks tile `shape` exactly: in bounds, no overlap, no gap."""
    problems = []
    ndim = len(shape)
    for c in chunks:
        if len(c.offsets) != ndim or len(c.sizes) != ndim:
            problems.append(
                f"{key}: chunk at {list(c.offsets)} has rank {len(c.sizes)}, tensor {ndim}"
            )
            return problems
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            problems.append(
                f"{key}: chunk offsets {list(c.offsets)} sizes {list(c.sizes)} fall outside the "
                f"global shape {list(shape)}"
            )
    if problems:
        return problems
    # Chunks are few (about one per rank): a pairwise box test is cheap and exact.
    boxes = [c for c in chunks if math.prod(c.sizes) > 0]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + as_, bo + bs)
                for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
            ):
                problems.append(
                    f"{key}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap "
                    "(elements saved twice)"
                )
    covered = sum(math.prod(c.sizes) for c in boxes)
    if not problems and covered != math.prod(shape):
        problems.append(
            f"{key}: chunks cover {covered} of {math.prod(shape)} elements of shape "
            f"{list(shape)} (a gap: some elements were never saved)"
        )
    return problems


def _chunk(md: Metadata, key: str, chunk: ChunkStorageMetadata | None) -> ChunkInfo:
    offsets = tuple(chunk.offsets) if chunk is not None else ()
    index = MetadataIndex(key, offsets if chunk is not None else None)
    info = (md.storage_data or {}).get(index)
    sizes = tuple(chunk.sizes) if chunk is not None else ()
    if info is None:
        return ChunkInfo(offsets, sizes, None, 0, 0)
    return ChunkInfo(offsets, sizes, info.relative_path, info.offset, info.length)


def describe(path: str | os.PathLike) -> CheckpointInfo:
    """Read the metadata of checkpoint `path` (a checkpoint directory, or a root whose `latest`
    file names one, as `load` takes) and check it against the files.

    Checks: every chunk has storage; every file named exists and is long enough for the byte
    ranges it holds; every tensor's chunks tile its global shape exactly once. Problems are
    listed in the result (`raise_if_invalid()` turns them into a CheckpointError); a missing or
    unreadable `.metadata` raises CheckpointError at once.
    """
    from grouped_ep.checkpoint.layout import resolve  # layout imports this module

    path = resolve(path)  # a folder that cannot be read is a CheckpointError there
    md = read_metadata(path)
    out = CheckpointInfo(path=path, metadata=md)
    for name in sorted(os.listdir(path)):
        if name.endswith(".distcp") and (path / name).is_file():  # not a dangling link
            out.files[name] = (path / name).stat().st_size
    try:
        _check_files(path, md, out)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (a .metadata of other objects than DCP writes)
        raise CheckpointError(
            f"checkpoint {path}: {METADATA_FILE} does not describe a DCP checkpoint "
            f"({type(e).__name__}: {e})"
        ) from e
    return out


def _check_files(path: Path, md: Metadata, out: CheckpointInfo) -> None:
    """`describe`'s checks of `md` against the files, into `out.problems`."""
    missing: dict[str, list[str]] = {}  # missing file -> keys with bytes in it
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            t = TensorInfo(key, tuple(meta.size), str(dtype).removeprefix("torch."), dtype.itemsize)
            t.chunks = [_chunk(md, key, c) for c in meta.chunks]
            out.tensors[key] = t
            out.problems += _coverage_problems(key, t.shape, t.chunks)
            chunks = t.chunks
        elif isinstance(meta, BytesStorageMetadata):
            out.objects[key] = _chunk(md, key, None)
            chunks = [out.objects[key]]
        else:
            out.problems.append(f"{key}: unknown metadata type {type(meta).__name__}")
            continue
        for c in chunks:
            if c.file is None:
                where = f" chunk at {list(c.offsets)}" if c.offsets else ""
                out.problems.append(f"{key}{where}: no storage entry in {METADATA_FILE}")
                continue
            if c.file not in out.files:
                fpath = path / c.file
                if not fpath.is_file():
                    missing.setdefault(c.file, []).append(key)
                    continue
                out.files[c.file] = fpath.stat().st_size
            size = out.files[c.file]
            if c.file_offset + c.length > size:
                out.problems.append(
                    f"{key}: file {c.file} is truncated (needs bytes {c.file_offset}.."
                    f"{c.file_offset + c.length}, has {size})"
                )
    for name, keys in sorted(missing.items()):
        held = ", ".join(sorted(set(keys))[:5]) + (", ..." if len(set(keys)) > 5 else "")
        out.problems.insert(0, f"data file {name} is missing (it holds bytes of {held})")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_report(info: CheckpointInfo, chunks: bool = True) -> str:
    """A human-readable listing of `info` (one line per tensor, one per chunk when `chunks`)."""
    lines = [
        f"checkpoint {info.path}",
        f"  {len(info.tensors)} tensors, {len(info.objects)} objects, {len(info.files)} data files, "
        f"{_fmt_bytes(info.disk_bytes)} on disk, {_fmt_bytes(info.tensor_bytes)} of tensor data",
    ]
    for name, size in sorted(info.files.items()):
        lines.append(f"  file {name}: {_fmt_bytes(size)}")
    for t in info.tensors.values():
        lines.append(
            f"{t.key}  {t.dtype}  {list(t.shape)}  {_fmt_bytes(t.nbytes)}  {len(t.chunks)} chunk(s)"
        )
        if chunks:
            for c in t.chunks:
                span = ", ".join(f"{o}:{o + s}" for o, s in zip(c.offsets, c.sizes))
                lines.append(f"    [{span}]  {c.file} @ {c.file_offset} ({_fmt_bytes(c.length)})")
    for key, c in info.objects.items():
        lines.append(f"{key}  object  {c.file} @ {c.file_offset} ({_fmt_bytes(c.length)})")
    if info.problems:
        lines.append(f"PROBLEMS ({len(info.problems)}):")
        lines += [f"  {p}" for p in info.problems]
    else:
        lines.append("OK: every element of every tensor is saved exactly once; all files present")
    return "\n".join(lines)
