"""The safetensors format: strict header parsing, and a checkpoint's key -> tensor table.

No I/O beyond headers. A safetensors file is: 8 bytes (little-endian u64 N), N bytes of UTF-8 JSON mapping each tensor
name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the byte after
the header), an optional `"__metadata__"` string map, then the data. Every check here names the
file and, where there is one, the key; anything wrong is a `LoadError`.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grouped_ep._validate import check_path, is_int, tilde_hint
from grouped_ep.loading.errors import LoadError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The safetensors library's own limit (MAX_HEADER_SIZE, 100,000,000): a longer header loaded
# here while safetensors and transformers refuse the file (it was 100 MiB; a review).
MAX_HEADER_BYTES = 100_000_000

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
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
if hasattr(torch, "float8_e8m0fnu"):  # DeepSeek-V3.1-style UE8M0 scales
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


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
    # (st_dev, st_ino, st_size, st_mtime_ns) when the header was read, as int64: the native
    # reader refuses a file that no longer matches (replaced or rewritten since).
    identity: tuple[int, int, int, int] | None = None
    # Keys whose dtype this loader does not know (a newer format), with that dtype: listed as
    # unused when the model does not need them, an error naming them when it does.
    unreadable: dict[str, str] = field(default_factory=dict)


def _int64(v: int) -> int:
    """An unsigned 64-bit stat field as the int64 C++ reads it."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    # mtime in ns wraps modulo 2^64 as in C++ (a time past 2262 does not fit an int64)
    return (_int64(st.st_dev), _int64(st.st_ino), st.st_size, _int64(st.st_mtime_ns % (1 << 64)))


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)  # called for every object of the header: the loop only on a duplicate
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise LoadError(f"duplicate key {k!r} in header")
            seen.add(k)
    return out


def _open_nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK)


def read_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse and validate the header of one safetensors file.

    Checks: the header length fits the file, the header is a JSON object, every dtype is known,
    shapes are lists of non-negative ints, each tensor's byte length matches its shape, and the
    data offsets tile the data section exactly (sorted, contiguous, no overlap, no gap, ending
    at the end of the file).
    """
    path = str(path)
    try:
        # O_NONBLOCK: a named pipe (or other special file) is refused below, not waited on. The
        # file object owns the descriptor from the start (Ctrl-C between an os.open and an
        # open(fd) leaked it for the life of the process; a review).
        with open(path, "rb", opener=_open_nonblocking) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise LoadError(f"{path}: is not a regular file, expected a .safetensors file")
            size = st.st_size
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
                raise LoadError(
                    f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes, the safetensors "
                    "format's limit (the safetensors library refuses the file too)"
                )
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
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    # As the safetensors format (and its own reader) has it: a map of strings to strings.
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise LoadError(f"{path}: __metadata__ must be an object of strings, got {metadata!r:.80}")
    tensors: dict[str, TensorEntry] = {}
    unreadable: dict[str, str] = {}
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        where = f"{path}: tensor {key!r}"
        if not isinstance(info, dict):
            raise LoadError(f"{where}: header entry must be an object, got {info!r:.80}")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_name, str):
            raise LoadError(f"{where}: dtype must be a string, got {dtype_name!r:.80}")
        if not isinstance(shape, list) or not all(is_int(s) and s >= 0 for s in shape):
            raise LoadError(
                f"{where}: shape must be a list of non-negative ints, got {shape!r:.80}"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
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
        spans.append((begin, end, key))
        dtype = DTYPES.get(dtype_name)
        if dtype is None:  # its bytes are accounted for by the tiling check below
            unreadable[key] = dtype_name
            continue
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise LoadError(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape "
                f"{shape} of {dtype_name} needs {want}"
            )
        tensors[key] = TensorEntry(key, path, dtype, tuple(shape), data_start + begin, end - begin)

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
    return SafetensorsFile(path, size, data_start, tensors, metadata, _identity(st), unreadable)


@dataclass
class Checkpoint:
    """A checkpoint's key -> tensor table, over one or several files."""

    root: str
    files: dict[str, SafetensorsFile]
    entries: dict[str, TensorEntry]
    unreadable: dict[str, str] = field(default_factory=dict)  # key -> unknown dtype name
    # key -> its other copies, in other shards than the one read (see loading/copies.py)
    copies: dict[str, list[TensorEntry]] = field(default_factory=dict)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]


def _read_index(index_path: Path) -> dict[str, str]:
    def pairs(items: list) -> dict:
        table = dict(items)
        if len(table) == len(items):  # no key named twice: the common case, at C speed
            return table
        table = {}
        for k, v in items:  # a key named twice for two files: which one holds it?
            if k in table and table[k] != v and isinstance(v, str):
                raise LoadError(
                    f"{index_path}: key {k!r} is listed twice, for {table[k]!r} and {v!r}"
                )
            table[k] = v
        return table

    try:
        index = json.loads(index_path.read_text(encoding="utf-8"), object_pairs_hook=pairs)
    except LoadError:
        raise
    except OSError as e:
        raise LoadError(f"{index_path}: cannot read index: {e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{index_path}: index is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise LoadError(f"{index_path}: index must hold a 'weight_map' of key -> file name")
    # Files of this checkpoint only, never a path out of it. Checked on the name as written, not
    # on where it resolves: in the Hugging Face cache every file of a snapshot is a symlink to
    # a blob outside the snapshot directory.
    # Each file name once: a real index names its ~16 shards for tens of thousands of keys.
    for name in dict.fromkeys(weight_map.values()):  # in index order: the first bad one
        if not name or Path(name).is_absolute() or ".." in Path(name).parts:
            key = next(k for k, v in weight_map.items() if v == name)
            raise LoadError(
                f"{index_path}: weight_map[{key!r}] = {name!r} is not a file inside {index_path.parent}"
            )
    return weight_map


def _not_regular(folder: Path) -> str:
    """A note naming the `*.safetensors` entries of `folder` that are not regular files (a named
    pipe, a folder, a broken link), which the search above passed over."""
    odd = sorted(
        p.name
        for p in folder.glob("*.safetensors*")
        if p.name.endswith((".safetensors", ".safetensors.index.json")) and not p.is_file()
    )
    if not odd:
        return ""
    kinds = [
        f"{n} ({'a broken link' if not (folder / n).exists() else 'not a regular file'})"
        for n in odd
    ]
    return "; not read: " + ", ".join(kinds)


def open_checkpoint(checkpoint: str | os.PathLike) -> Checkpoint:
    """Find and validate every header of a checkpoint.

    `checkpoint` is a directory holding `model.safetensors.index.json` (or another single
    `*.safetensors.index.json`), a directory holding one `.safetensors` file, a `.safetensors`
    file, or an index file. A directory holding both `model.safetensors` and the index gives
    `model.safetensors`, the file transformers' `from_pretrained` reads there.
    """
    check_path(checkpoint, "load_sharded: checkpoint", LoadError)
    try:
        return _open_checkpoint(Path(checkpoint))
    except LoadError:
        raise
    except OSError as e:  # a folder without read permission: is_file() of what is inside raises
        raise LoadError(f"{checkpoint}: cannot be read ({e})") from e


def _visible(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(".")


def _open_checkpoint(path: Path) -> Checkpoint:
    index_path: Path | None = None
    single: Path | None = None
    if path.is_dir():
        if (path / SINGLE_NAME).is_file():
            single = path / SINGLE_NAME
        elif (path / INDEX_NAME).is_file():
            index_path = path / INDEX_NAME
        else:
            # not hidden files: an export's temporary `.tmp-...` ones, left by a failed export
            indexes = sorted(p for p in path.glob("*.safetensors.index.json") if _visible(p))
            files = sorted(p for p in path.glob("*.safetensors") if _visible(p))
            if len(indexes) == 1:
                index_path = indexes[0]
            elif not indexes and len(files) == 1:
                single = files[0]
            else:
                pickled = sorted(p.name for p in path.glob("*.bin")) if not files else []
                hint = (
                    f"; {pickled[0]} is a pickled (torch.save) checkpoint, which is not read: "
                    "save it as safetensors (transformers' save_pretrained does by default)"
                    if pickled
                    else ""
                )
                hint += _not_regular(path)
                raise LoadError(
                    f"{path}: expected {INDEX_NAME} or a single .safetensors file, found "
                    f"{len(indexes)} index files and {len(files)} .safetensors files{hint}"
                )
    elif path.name.endswith(".index.json") and path.is_file():
        index_path = path
    elif path.is_file():
        single = path
    elif path.exists():
        raise LoadError(f"{path}: is not a regular file, expected a .safetensors file")
    else:
        hint = (
            "; if it is a Hugging Face Hub id: load_sharded reads a local folder, download it "
            "first (huggingface_hub.snapshot_download)"
            if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path))  # as "org/name"
            else tilde_hint(path)
        )
        raise LoadError(f"{path}: checkpoint not found{hint}")

    files: dict[str, SafetensorsFile] = {}
    entries: dict[str, TensorEntry] = {}
    unreadable: dict[str, str] = {}
    if single is not None:
        header = read_header(single)
        files[header.path] = header
        entries.update(header.tensors)
        return Checkpoint(str(path), files, entries, dict(header.unreadable))

    weight_map = _read_index(index_path)
    base = index_path.parent
    misplaced: set[str] = set()  # keys whose shard, as the index names it, lacks them
    paths = {name: str(base / name) for name in set(weight_map.values())}
    for key, name in weight_map.items():
        file_path = paths[name]
        if file_path not in files:
            if not os.path.isfile(file_path):
                what = (
                    "is a directory, not a file"
                    if os.path.isdir(file_path)
                    else "is not a regular file"
                    if os.path.exists(file_path)
                    else "was not found"
                )
                raise LoadError(
                    f"{index_path}: shard file {name!r} (holding {key!r}) in {base} {what}"
                )
            files[file_path] = read_header(file_path)
        header = files[file_path]
        if key in header.unreadable:
            unreadable[key] = header.unreadable[key]
            continue
        if key not in header.tensors:
            misplaced.add(key)  # found in another listed shard below, or in none
            continue
        entries[key] = header.tensors[key]
    # A key a listed shard holds but the index does not list: transformers reads every key of
    # every shard the index names, so it counts (the index's file wins for a key it lists; of
    # two shards holding an unlisted key, the last by name, as transformers reads them).
    for file_path in sorted(files):
        header = files[file_path]
        for key, entry in header.tensors.items():
            if key not in weight_map or key in misplaced:
                entries[key] = entry
                unreadable.pop(key, None)
        for key, dtype in header.unreadable.items():
            if key not in weight_map:
                unreadable[key] = dtype
                entries.pop(key, None)
    if misplaced:
        _warn_misplaced(index_path, misplaced, entries)
    copies: dict[str, list[TensorEntry]] = {}
    for header in files.values():
        for key, entry in header.tensors.items():
            if key in entries and entries[key] is not entry:
                copies.setdefault(key, []).append(entry)
    return Checkpoint(str(path), files, entries, unreadable, copies)


def _warn_misplaced(index_path: Path, misplaced: set[str], entries: dict) -> None:
    """Index entries whose shard lacks the key: read from the listed shard that holds it, or
    left out (a stale entry), as transformers does; a missing key the model needs still fails."""
    shown = [
        f"{key!r} (read from {Path(entries[key].path).name})"
        if key in entries
        else f"{key!r} (in no shard: left out)"
        for key in sorted(misplaced)[:3]
    ]
    more = f" and {len(misplaced) - 3} more" if len(misplaced) > 3 else ""
    warnings.warn(
        f"{index_path}: {len(misplaced)} key(s) are not in the shard the index names: "
        f"{', '.join(shown)}{more}",
        stacklevel=5,  # load_sharded's caller
    )
