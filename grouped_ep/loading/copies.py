"""A key held by two shards of one checkpoint (a botched re-shard, old shards copied beside new
ones): which copy is the checkpoint's cannot be known. `load_sharded` reads the one the index
names (of a key it does not list, the last shard by name); transformers' `from_pretrained`
reads the last shard by name. Equal copies give the same weights either way; different ones are
refused, naming both files, before anything is read into the model."""

from __future__ import annotations

import os
from collections.abc import Iterable

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.safetensors import Checkpoint, TensorEntry

_CHUNK = 16 << 20


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    if (a.dtype, tuple(a.shape), a.nbytes) != (b.dtype, tuple(b.shape), b.nbytes):
        return False
    fa, fb = os.open(a.path, os.O_RDONLY), os.open(b.path, os.O_RDONLY)
    try:
        for at in range(0, a.nbytes, _CHUNK):
            n = min(_CHUNK, a.nbytes - at)
            if os.pread(fa, n, a.start + at) != os.pread(fb, n, b.start + at):
                return False
        return True
    finally:
        os.close(fa)
        os.close(fb)


def refuse_differing_copies(ckpt: Checkpoint, keys: Iterable[str]) -> None:
    """LoadError for the first of `keys` (ones the model reads) whose copies differ."""
    for key in sorted(set(keys) & ckpt.copies.keys()):
        read = ckpt.entries[key]
        for other in ckpt.copies[key]:
            try:
                same = _same_bytes(read, other)
            except OSError as e:
                raise LoadError(f"{other.path}: cannot be read to compare {key!r} ({e})") from e
            if not same:
                last = max([read, *ckpt.copies[key]], key=lambda e: os.path.basename(e.path))
                raise LoadError(
                    f"{ckpt.root}: {key!r} is held by two shards with different values: "
                    f"{read.path} ({read.dtype}, {list(read.shape)}; the one this load reads) and "
                    f"{other.path} ({other.dtype}, {list(other.shape)}). Which one is the "
                    "checkpoint's cannot be known (transformers' from_pretrained reads "
                    f"{os.path.basename(last.path)}, the last by name): remove the stale copy"
                )
