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


def verify_share(info: CheckpointInfo, part: int = 0, parts: int = 1) -> list[str]:
    """Problems found checking data files `part`, `part + parts`, ... (sorted by name) against
    the checksums saved with them; [] when they match. Call only for a checkpoint saved with
    checksums (its manifest says `"checksums": "crc32"`)."""
    where = {(c.file, c.file_offset): key for key, t in info.tensors.items() for c in t.chunks}
    where.update({(c.file, c.file_offset): key for key, c in info.objects.items()})
    tables: dict[str, dict | None] = {}
    problems: list[str] = []
    for i, name in enumerate(sorted(info.files)):
        if i % parts != part:
            continue
        side = info.path / _sidecar(name)
        if side.name not in tables:
            try:
                tables[side.name] = json.loads(side.read_text())["crc32"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                tables[side.name] = None
                problems.append(f"{side}: cannot read the checksums saved with {name} ({e})")
        table = tables[side.name]
        if table is None:
            continue
        spans = table.get(name)
        if not isinstance(spans, list):
            problems.append(f"{side}: no checksums for {name}")
            continue
        with open(info.path / name, "rb") as f:
            for offset, length, want in spans:
                got, n = _crc(f, offset, length)
                if n == length and got == want:
                    continue
                key = where.get((name, offset), "?")
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
