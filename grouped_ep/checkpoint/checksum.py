"""A CRC32 of every saved chunk, written at save and checked at load and by `inspect`.

DCP records where each tensor chunk and pickled object lies (file, offset, length) in
`.metadata`, but no checksum: a flipped bit inside a tensor's bytes would load as it is.
`ChecksumWriter`, DCP's `FileSystemWriter`, reads back each chunk it has just written (from the
page cache) and writes the CRC32s of one rank's files to `<prefix>crc32.json` beside them
(`__0_crc32.json` for `__0_0.distcp`, ...). That happens inside the write step, before the
save's last collective, so a step is committed only with every rank's checksums in it.

`verify_share(info, part, parts)` checks the chunks of every `parts`-th data file from `part` on:
`load` gives each rank its share (every file is read once, by one rank), `inspect` checks all.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from grouped_ep.checkpoint.inspect import CheckpointInfo

SUFFIX = "crc32.json"
_PIECE = 8 << 20  # bytes read at a time


def _crc(f, offset: int, length: int) -> tuple[int, int]:
    """(crc32, bytes read) of `length` bytes of open file `f` from `offset` (fewer at EOF)."""
    f.seek(offset)
    crc, done = 0, 0
    while done < length:
        piece = f.read(min(_PIECE, length - done))
        if not piece:
            break
        crc = zlib.crc32(piece, crc)
        done += len(piece)
    return crc, done


class ChecksumWriter(dcp.FileSystemWriter):
    """`FileSystemWriter` that also writes the CRC32 of every chunk this rank wrote."""

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()
        root = Path(str(self.path))
        regions: dict[str, list[tuple[int, int]]] = {}
        for r in results:
            info = r.storage_data
            regions.setdefault(info.relative_path, []).append((info.offset, info.length))
        sums: dict[str, list[list[int]]] = {}
        for name, spans in regions.items():
            with open(root / name, "rb") as f:
                sums[name] = [[o, n, _crc(f, o, n)[0]] for o, n in sorted(spans)]
        prefix = plan.storage_data.prefix
        (root / f"{prefix}{SUFFIX}").write_text(json.dumps({"crc32": sums}))
        done = torch.futures.Future()
        done.set_result(results)
        return done


def _sidecar(data_file: str) -> str:
    """`__3_0.distcp` -> `__3_crc32.json` (the file DCP's prefix for rank 3 names)."""
    return data_file.rpartition("_")[0] + "_" + SUFFIX


def _spans(value) -> dict[tuple[int, int], int] | None:
    """A file's `[[offset, length, crc32], ...]` as {(offset, length): crc32}; None if malformed."""
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


def _read_table(side: Path) -> tuple[dict | None, str | None]:
    """The `crc32` table of checksum file `side`, or (None, what is wrong with it)."""
    try:
        table = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        return None, f"{side}: cannot read it ({e})"
    if not isinstance(table, dict) or not isinstance(table.get("crc32"), dict):
        return None, f"{side}: not a checksum file (no 'crc32' table)"
    return table["crc32"], None


def verify_share(info: CheckpointInfo, part: int = 0, parts: int = 1) -> list[str]:
    """Problems found checking data files `part`, `part + parts`, ... (sorted by name) against
    the checksums saved with them; [] when they match. Every chunk `.metadata` places in such a
    file must have its checksum. Call only for a checkpoint saved with checksums (its manifest
    says `"checksums": "crc32"`)."""
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
        side = info.path / _sidecar(name)
        if side.name not in tables:
            tables[side.name] = _read_table(side)
            if tables[side.name][1] is not None:
                problems.append(f"{tables[side.name][1]}; it holds the checksums of {name}")
        table = tables[side.name][0]
        if table is None:
            continue
        sums = _spans(table.get(name))
        if sums is None:
            problems.append(f"{side}: no well-formed checksums for {name}")
            continue
        unsummed = [key for o, n, key in chunks.get(name, []) if (o, n) not in sums]
        if unsummed:
            problems.append(
                f"{side}: no checksum for {len(unsummed)} chunk(s) in {name} (of {unsummed[0]!r})"
            )
        with open(info.path / name, "rb") as f:
            for offset, length, key in sorted(chunks.get(name, [])):
                want = sums.get((offset, length))
                if want is None:
                    continue
                got, n = _crc(f, offset, length)
                if n == length and got == want:
                    continue
                problems.append(
                    f"{info.path / name}: the bytes of {key!r} (offset {offset}, {length} bytes) "
                    + (
                        f"end after {n} bytes"
                        if n < length
                        else f"do not match the CRC32 saved with them ({got:08x}, saved "
                        f"{want:08x}): the file was changed or damaged after the save"
                    )
                )
    return problems
