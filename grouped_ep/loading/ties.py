"""Tied tensors whose checkpoint holds its own value for more than one of their names.

A model built from a config that ties (transformers' `tie_word_embeddings=True`, the default of
several MoE families) can meet a checkpoint saved untied: `embed_tokens.weight` and a different
`lm_head.weight`. transformers' `from_pretrained` then unties them and warns. Loading one key
into the one shared tensor would run the model on a head it was never trained with, silently, so
`load_sharded` compares the keys and refuses when their values differ. Equal copies (a `.bin`
conversion keeps both) load as one."""

from __future__ import annotations

import math

import torch

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.keys import resolve_pieces
from grouped_ep.loading.plan import Piece, Target
from grouped_ep.loading.safetensors import Checkpoint, TensorEntry

_CHUNK_BYTES = 64 << 20  # compared a block of rows at a time: no whole embedding in memory


def _whole_key(pieces: list[Piece]) -> TensorEntry | None:
    """The one checkpoint key the pieces are, read whole and as is; None for anything else (a
    stack of keys, part of a fused key): such tensors are never tied in practice."""
    if len(pieces) != 1 or pieces[0].file_offset is not None:
        return None
    return pieces[0].entry


def _rows(f, entry: TensorEntry, first: int, count: int, row_bytes: int) -> bytes:
    f.seek(entry.start + first * row_bytes)
    data = f.read(count * row_bytes)
    if len(data) != count * row_bytes:
        raise LoadError(f"{entry.path}: {entry.key!r} ends before its {entry.nbytes} bytes")
    return data


def same_values(a: TensorEntry, b: TensorEntry) -> bool:
    """Whether two keys of the same shape hold equal values (bytes when of one dtype)."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    rows = a.shape[0] if a.shape else 1
    row_elems = math.prod(a.shape[1:]) if a.shape else 1
    size_a, size_b = a.dtype.itemsize * row_elems, b.dtype.itemsize * row_elems
    step = max(1, _CHUNK_BYTES // max(1, size_a + size_b))
    with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
        for first in range(0, rows, step):
            count = min(step, rows - first)
            da, db = _rows(fa, a, first, count, size_a), _rows(fb, b, first, count, size_b)
            if a.dtype == b.dtype:
                if da != db:
                    return False
                continue
            ta = torch.frombuffer(bytearray(da), dtype=a.dtype).to(torch.float64)
            tb = torch.frombuffer(bytearray(db), dtype=b.dtype).to(torch.float64)
            if not torch.equal(ta, tb):
                return False
    return True


def refuse_split_tie(target: Target, ckpt: Checkpoint, key_map, model) -> list[str]:
    """Raise `LoadError` when another name of the tied `target` has its own checkpoint key with
    values that differ from the key its pieces come from; the keys of equal copies (used)."""
    if len(target.names) < 2 or not target.pieces:
        return []
    loaded = _whole_key(target.pieces)
    if loaded is None:
        return []
    shape, copies = tuple(target.tensor.shape), []
    for name in target.names:
        own = _whole_key(resolve_pieces([name], shape, ckpt, key_map, model=model) or [])
        if own is None or own.key == loaded.key:
            continue
        if same_values(loaded, own):
            copies.append(own.key)
            continue
        flag = _tie_flag(model)
        raise LoadError(
            f"{ckpt.root}: the model ties {name!r} to {target.names[0]!r} (one tensor), but the "
            f"checkpoint holds different values for both: {own.key!r} and {loaded.key!r}. "
            f"Loading one into both would change the model silently; transformers' "
            f"from_pretrained unties them. Build the model untied{flag} to load both"
        )
    return copies


def _tie_flag(model) -> str:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if True in (
        getattr(config, "tie_word_embeddings", None),
        getattr(text, "tie_word_embeddings", None),
    ):
        return (
            " (tie_word_embeddings=False in its config, e.g. "
            "AutoConfig.from_pretrained(path, tie_word_embeddings=False))"
        )
    return ""
