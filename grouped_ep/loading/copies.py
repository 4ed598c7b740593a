"""A key held by two shards of one checkpoint (a botched re-shard, old shards copied beside new
ones): which copy is the checkpoint's cannot be known. `load_sharded` reads the one the index
names (of a key it does not list, the last shard by name); transformers' `from_pretrained`
reads the last shard by name. Equal copies give the same weights either way; different ones are
refused, naming both files, before anything is read into the model."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.safetensors import Checkpoint, TensorEntry

_CHUNK = 16 << 20


def _chunks(a: TensorEntry, b: TensorEntry):
    """The two copies' bytes, `_CHUNK` of `a` at a time and as many elements of `b`."""
    ea, eb = a.dtype.itemsize, b.dtype.itemsize
    fa, fb = os.open(a.path, os.O_RDONLY), os.open(b.path, os.O_RDONLY)
    try:
        step = max(1, _CHUNK // ea)
        for at in range(0, a.nbytes // ea, step):
            n = min(step, a.nbytes // ea - at)
            yield os.pread(fa, n * ea, a.start + at * ea), os.pread(fb, n * eb, b.start + at * eb)
    finally:
        os.close(fa)
        os.close(fb)


def _same_values(a: TensorEntry, b: TensorEntry) -> bool:
    """Equal bytes, or, of floating dtypes, equal numbers: an fp32 copy of bf16 weights is the
    same checkpoint (`from_pretrained` loads it to the same values), and so are copies that
    differ only in -0.0 / 0.0 or a NaN's payload (NaN equals NaN)."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    floating = a.dtype.is_floating_point and b.dtype.is_floating_point
    if a.dtype != b.dtype and not floating:
        return False
    for x, y in _chunks(a, b):
        if a.dtype == b.dtype and x == y:
            continue
        if not floating:
            return False
        tx = torch.frombuffer(bytearray(x), dtype=a.dtype).double()
        ty = torch.frombuffer(bytearray(y), dtype=b.dtype).double()
        if not torch.equal(tx.isnan(), ty.isnan()) or not torch.equal(
            tx.nan_to_num(nan=0.0), ty.nan_to_num(nan=0.0)
        ):
            return False
    return True


def refuse_differing_copies(ckpt: Checkpoint, keys: Iterable[str]) -> int:
    """LoadError for the first of `keys` (ones the model reads) whose copies differ; else the
    bytes read to compare them (each copy whole, on every rank: a rank that compared only its
    own slice would load while another rank refuses)."""
    compared = 0
    for key in sorted(set(keys) & ckpt.copies.keys()):
        read = ckpt.entries[key]
        for other in ckpt.copies[key]:
            try:
                same = _same_values(read, other)
            except OSError as e:
                raise LoadError(f"{other.path}: cannot be read to compare {key!r} ({e})") from e
            compared += read.nbytes + other.nbytes
            if not same:
                last = max([read, *ckpt.copies[key]], key=lambda e: os.path.basename(e.path))
                raise LoadError(
                    f"{ckpt.root}: {key!r} is held by two shards with different values: "
                    f"{read.path} ({read.dtype}, {list(read.shape)}; the one this load reads) and "
                    f"{other.path} ({other.dtype}, {list(other.shape)}). Which one is the "
                    "checkpoint's cannot be known (transformers' from_pretrained reads "
                    f"{os.path.basename(last.path)}, the last by name): remove the stale copy"
                )
    return compared
