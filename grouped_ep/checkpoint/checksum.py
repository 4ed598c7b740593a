"""A CRC32C of every saved chunk, written at save and checked at load and by `inspect`.

DCP records where each tensor chunk and pickled object lies (file, offset, length) in
`.metadata`, but no checksum: a flipped bit inside a tensor's bytes would load as it is.
`ChecksumWriter`, DCP's `FileSystemWriter`, reads back each chunk it has just written (from the
page cache) and writes the CRC32Cs of one rank's files to `<prefix>crc32c.json` beside them
(`__0_crc32c.json` for `__0_0.distcp`, ...). That happens inside the write step, before the
save's last collective, so a step is committed only with every rank's checksums in it. The
CRCs are computed natively (`torch.ops.grouped_ep.crc32c`, csrc/io/crc32c.cpp: SSE4.2, threads):
page cache to CRC it ran at 3.5 GB/s on one thread and 6.3 on two, where Python's zlib.crc32
alone ran at 2.0 GB/s (Intel Xeon, 2026-11-25).

Each table also holds the save's id (a random hex string, in the manifest too: a data file and
its table copied in from another checkpoint are refused) and, where the rank saved `extra`, the
CRC32C of its `extra-rank<r>.pt`. Tables are written and fsynced before the commit.

`verify_share(info, part, parts)` checks the chunks of every `parts`-th data file from `part` on:
`load` gives each rank its share (every file is read once, by one rank), `inspect` checks all.

Checkpoints saved by grouped_ep between 5fe8965 and 764c765 hold zlib CRC-32s instead, in
`__<r>_crc32.json` tables of the same layout (without save id or `files`), and their manifest
says `"checksums": "crc32"`: those are checked with zlib (`checksum_kind`).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from grouped_ep.checkpoint.errors import CheckpointError
from grouped_ep.checkpoint.inspect import CheckpointInfo
from grouped_ep.checkpoint.layout import MANIFEST_FILE, write_text_atomic

FORMAT = "crc32c"  # the manifest's "checksums" value, and the checksum tables' key
SUFFIX = FORMAT + ".json"
LEGACY = "crc32"  # the same for saves between 5fe8965 and 764c765 (zlib's CRC-32)
_NAMES = {FORMAT: "CRC32C", LEGACY: "CRC-32"}


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def crc32c(path: Path, spans: list[tuple[int, int]]) -> list[int]:
    """The CRC32C of each (offset, length) span of file `path`; RuntimeError naming the file and
    offset where it ends early or cannot be read."""
    if not spans:
        return []
    offsets = torch.tensor([o for o, _ in spans], dtype=torch.int64)
    lengths = torch.tensor([n for _, n in spans], dtype=torch.int64)
    return torch.ops.grouped_ep.crc32c(str(path), offsets, lengths, _threads()).tolist()


def _zlib_crc32(path: Path, spans: list[tuple[int, int]]) -> list[int]:
    """`crc32c` for the older tables: zlib's CRC-32 of each span, read in 4 MiB pieces."""
    out = []
    try:
        with open(path, "rb") as f:
            for offset, length in spans:
                f.seek(offset)
                crc, left = 0, length
                while left:
                    piece = f.read(min(left, 4 << 20))
                    if not piece:
                        raise RuntimeError(f"{path}: ends before offset {offset + length - left}")
                    crc, left = zlib.crc32(piece, crc), left - len(piece)
                out.append(crc)
    except OSError as e:
        raise RuntimeError(f"{path}: cannot read it ({e})") from e
    return out


def file_crc(path: Path) -> list[int]:
    """`[length, CRC32C]` of the whole file `path`."""
    length = path.stat().st_size
    return [length, crc32c(path, [(0, length)])[0] if length else 0]


class ChecksumWriter(dcp.FileSystemWriter):
    """`FileSystemWriter` that also writes the CRC32C of every chunk this rank wrote, the save's
    id (`save_id`) and the `[length, CRC32C]` of this rank's other files (`files`)."""

    def __init__(self, path: str, save_id: str, files: dict[str, list[int]], **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.save_id, self.files = save_id, files

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()
        root = Path(str(self.path))
        regions: dict[str, list[tuple[int, int]]] = {}
        for r in results:
            info = r.storage_data
            regions.setdefault(info.relative_path, []).append((info.offset, info.length))
        sums: dict[str, list[list[int]]] = {}
        for name, spans in regions.items():
            spans = sorted(spans)
            sums[name] = [[o, n, c] for (o, n), c in zip(spans, crc32c(root / name, spans))]
        prefix = plan.storage_data.prefix
        table = {FORMAT: sums, "save_id": self.save_id, "files": self.files}
        write_text_atomic(root / f"{prefix}{SUFFIX}", json.dumps(table))
        done = torch.futures.Future()
        done.set_result(results)
        return done


def _sidecar(data_file: str, kind: str = FORMAT) -> str:
    """`__3_0.distcp` -> `__3_crc32c.json` (the file DCP's prefix for rank 3 names)."""
    return data_file.rpartition("_")[0] + "_" + kind + ".json"


def _spans(value) -> dict[tuple[int, int], int] | None:
    """A file's `[[offset, length, crc], ...]` as {(offset, length): crc}; None if malformed."""
    if not isinstance(value, list):
        return None
    out = {}
    for row in value:
        if not (
            isinstance(row, list)
            and len(row) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)
        ):
            return None
        out[(row[0], row[1])] = row[2]
    return out


def _read_table(
    side: Path, save_id: str | None, kind: str = FORMAT
) -> tuple[dict | None, str | None]:
    """The table of checksum file `side` (`{FORMAT: ..., "save_id": ..., "files": ...}`), or
    (None, what is wrong with it); with `save_id`, the table must be of that save."""
    try:
        table = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        return None, f"{side}: cannot read it ({e})"
    if not isinstance(table, dict) or not isinstance(table.get(kind), dict):
        return None, f"{side}: not a checksum file (no '{kind}' table)"
    if save_id is not None and table.get("save_id") != save_id:
        return None, (
            f"{side}: written by another save (id {table.get('save_id')!r}, the manifest's is "
            f"{save_id!r}): files of another checkpoint were copied in"
        )
    return table, None


def read_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint directory `ckpt`, {} for a plain DCP checkpoint. Raises
    CheckpointError when it cannot be read, or is missing where checksum tables show that
    grouped_ep saved the checkpoint (without it nothing would say to check them)."""
    path = ckpt / MANIFEST_FILE
    try:
        present = path.is_file()
        tables = [] if present else _tables(ckpt, FORMAT) + _tables(ckpt, LEGACY)
    except OSError as e:  # a step directory without permission to look inside
        raise CheckpointError(f"cannot read {path} ({e})") from e
    if not present:
        if tables:
            raise CheckpointError(
                f"{path} is missing, but {ckpt} holds checksum tables ({tables[0]}, ...) of a "
                "grouped_ep save, which always writes it: the checkpoint is incomplete or damaged"
            )
        return {}
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({e})") from e
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is not a grouped_ep manifest (not a JSON object)")
    return manifest


def _tables(ckpt: Path, kind: str) -> list[str]:
    """The names of the checksum tables of `kind` in `ckpt` (`__<rank>_<kind>.json`)."""
    return sorted(p.name for p in ckpt.glob(f"__*_{kind}.json"))


def checksum_kind(ckpt: Path, manifest: dict) -> str | None:
    """The checksums `ckpt` was saved with (`FORMAT`, or `LEGACY` for older saves), as its
    manifest says or its tables show; None for a checkpoint saved without them. A value this
    code does not know is a CheckpointError (a newer save, or a damaged manifest)."""
    kind = manifest.get("checksums")
    if kind is not None:
        if not (isinstance(kind, str) and kind in _NAMES):
            raise CheckpointError(
                f'{ckpt / MANIFEST_FILE}: "checksums" is {kind!r}, which this grouped_ep does not '
                f"know ({', '.join(map(repr, _NAMES))}): the manifest is damaged, or a newer "
                "grouped_ep saved it"
            )
        return kind
    return next((k for k in _NAMES if _tables(ckpt, k)), None)


def checksum_name(kind: str | None) -> str:
    """ "CRC32C" or "CRC-32", for messages."""
    return _NAMES.get(kind or FORMAT, "CRC32C")


def _file_entry(ckpt: Path, name: str, owner: int, save_id: str) -> tuple[Any, str | None]:
    """The `[length, CRC32C]` that rank `owner`'s table in `ckpt` records for file `name` (None
    if it lists none), or (None, what is wrong with the table)."""
    table, problem = _read_table(ckpt / f"__{owner}_{SUFFIX}", save_id)
    if problem is not None:
        return None, problem
    files = table.get("files")
    return (files.get(name) if isinstance(files, dict) else None), None


def lists_file(ckpt: Path, name: str, owner: int, save_id: str | None) -> bool:
    """Whether rank `owner`'s checksum table in `ckpt` lists file `name` (False for checkpoints
    saved before tables listed files, and for a table that cannot be read)."""
    return save_id is not None and _file_entry(ckpt, name, owner, save_id)[0] is not None


def recorded_files(ckpt: Path, save_id: str | None) -> set[tuple[str, int]]:
    """(file name, owning rank) of every file the checksum tables of `ckpt` list (each rank's
    `extra-rank<r>.pt`); tables that cannot be read, or of another save, list none."""
    out: set[tuple[str, int]] = set()
    if save_id is None:
        return out
    for side in ckpt.glob(f"__*_{SUFFIX}"):
        owner = side.name[2 : -len(SUFFIX) - 1]
        table, _ = _read_table(side, save_id)
        files = table.get("files") if table is not None else None
        if owner.isdigit() and isinstance(files, dict):
            out.update((name, int(owner)) for name in files)
    return out


def missing_file(ckpt: Path, name: str, owner: int) -> str | None:
    """What is wrong if file `name`, which rank `owner`'s table lists, is not in `ckpt`."""
    if (ckpt / name).is_file():
        return None
    return f"{ckpt / name} is missing (rank {owner}'s checksum table lists it)"


def verify_file(ckpt: Path, name: str, owner: int, save_id: str | None) -> str | None:
    """What is wrong with file `name` of `ckpt` (an `extra-rank<r>.pt`) against the
    `[length, CRC32C]` in rank `owner`'s table, or None. Checkpoints saved before these files
    had checksums (no `save_id` in the manifest) are not checked."""
    if save_id is None:
        return None
    want, problem = _file_entry(ckpt, name, owner, save_id)
    if problem is not None:
        return f"{problem}; it holds the checksum of {name}"
    if not (isinstance(want, list) and len(want) == 2):
        return f"{ckpt / f'__{owner}_{SUFFIX}'}: no checksum for {name}"
    missing = missing_file(ckpt, name, owner)
    if missing is not None:
        return missing
    try:
        got = file_crc(ckpt / name)
    except (OSError, RuntimeError) as e:
        return f"{ckpt / name}: cannot read it ({str(e).splitlines()[0]})"
    if got != want:
        return (
            f"{ckpt / name}: its bytes do not match the length and CRC32C saved with them "
            f"({got[0]} bytes, {got[1]:08x}; saved {want[0]}, {want[1]:08x}): the file was "
            "changed or damaged after the save, or comes from another checkpoint"
        )
    return None


def verify_share(
    info: CheckpointInfo,
    part: int = 0,
    parts: int = 1,
    save_id: str | None = None,
    kind: str = FORMAT,
) -> list[str]:
    """Problems found checking data files `part`, `part + parts`, ... (sorted by name) against
    the checksums saved with them; [] when they match. Every chunk `.metadata` places in such a
    file must have its checksum; with `save_id` (the manifest's), every table must carry it.
    Call only for a checkpoint saved with checksums, of `checksum_kind`'s `kind`."""
    crc_of, crc_name = crc32c if kind == FORMAT else _zlib_crc32, checksum_name(kind)
    chunks: dict[str, list[tuple[int, int, str]]] = {}
    for key, t in info.tensors.items():
        for c in t.chunks:
            chunks.setdefault(c.file, []).append((c.file_offset, c.length, key))
    for key, c in info.objects.items():
        chunks.setdefault(c.file, []).append((c.file_offset, c.length, key))
    tables: dict[str, tuple[dict | None, str | None]] = {}
    problems: list[str] = []
    for i, name in enumerate(sorted(info.files)):
        if i % parts != part:
            continue
        side = info.path / _sidecar(name, kind)
        if side.name not in tables:
            tables[side.name] = _read_table(side, save_id, kind)
            if tables[side.name][1] is not None:
                problems.append(f"{tables[side.name][1]}; it holds the checksums of {name}")
        table = tables[side.name][0]
        if table is None:
            continue
        if name not in table[kind] and not chunks.get(name):
            continue  # a rank that had nothing to write (replicated tensors are written once)
        sums = _spans(table[kind].get(name))
        if sums is None:
            problems.append(f"{side}: no well-formed checksums for {name}")
            continue
        unsummed = [key for o, n, key in chunks.get(name, []) if (o, n) not in sums]
        if unsummed:
            problems.append(
                f"{side}: no checksum for {len(unsummed)} chunk(s) in {name} (of {unsummed[0]!r})"
            )
        todo = sorted((o, n, key) for o, n, key in chunks.get(name, []) if (o, n) in sums)
        try:
            got = crc_of(info.path / name, [(o, n) for o, n, _ in todo])
        except RuntimeError as e:
            problems.append(str(e).split("\n")[0])
            continue
        for (offset, length, key), crc in zip(todo, got):
            want = sums[(offset, length)]
            if crc != want:
                problems.append(
                    f"{info.path / name}: the bytes of {key!r} (offset {offset}, {length} bytes) "
                    f"do not match the {crc_name} saved with them ({crc:08x}, saved {want:08x}): the "
                    "file was changed or damaged after the save"
                )
    return problems
