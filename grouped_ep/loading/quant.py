"""Quantized checkpoints: which quantized bytes and scale blocks this rank reads (the formats, and
which scale goes with which weight: `quant_formats`). No I/O.

Two formats, both as transformers reads them:

- "fp8" (DeepSeek-V3): a `float8_e4m3fn` weight `[..., R, C]` and a sibling `weight_scale_inv`
  `[..., ceil(R / br), ceil(C / bc)]` (float32, bfloat16, float16 or float8_e8m0fnu) for
  `weight_block_size: [br, bc]`; value = float(q) * float(scale of its block).
- "mxfp4" (gpt-oss): `{name}_blocks` uint8 `[..., R, G, 16]` (two FP4 E2M1 values per byte, the low
  nibble first) and `{name}_scales` uint8 `[..., R, G]` (E8M0 exponents, one per 32 values) for a
  model tensor `{name}` `[..., R, 32 G]`; value = fp4 * 2^(scale - 127).

Planning turns each quantized checkpoint tensor into a `QuantPiece`: the quantized bytes this
rank owns (read like any other tensor, one byte per fp8 value or per FP4 pair) and the scale
blocks that cover them, each read once even where a shard boundary cuts through a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.plan import (
    Piece,
    Target,
    coalesce,
    owned_boxes,
    owned_indices,
    piece_ranges,
)
from grouped_ep.loading.quant_formats import (
    MXFP4_BLOCK,
    OUT_DTYPES,
    SCALE_DTYPES,
    QuantConfig,
    fp8_scale_key,
)
from grouped_ep.loading.safetensors import Checkpoint, TensorEntry


def mxfp4_pieces(
    name: str,
    keys: list[str],
    shape: tuple[int, ...],
    ckpt: Checkpoint,
    transposed: bool = False,
) -> list[Piece]:
    """Model tensor `name`, stored as `{key}_blocks` / `{key}_scales` for one of `keys` (its
    names, or what key_map makes of them): one piece, in the dequantized shape `[..., R, 32 G]`,
    whose entry is the blocks tensor. [] if there are no such keys. transposed: the model tensor
    is `[..., 32 G, R]` (transformers' gpt-oss experts, which `convert_moe_packed_tensors` fills
    with the dequantized tensor's last two dims swapped)."""
    if transposed and len(shape) >= 2:  # a 1-D tensor never matches MXFP4 blocks (>= 2-D)
        shape = shape[:-2] + (shape[-1], shape[-2])
    else:
        transposed = False
    for key in keys:
        blocks = f"{key}_blocks"
        if blocks not in ckpt:
            continue
        entry = ckpt[blocks]
        if entry.dtype != torch.uint8 or len(entry.shape) < 3 or entry.shape[-1] != 16:
            raise LoadError(
                f"{entry.path}: {blocks!r} must be uint8 [..., R, G, 16] (MXFP4 blocks), got "
                f"{entry.dtype} {list(entry.shape)}"
            )
        logical = entry.shape[:-2] + (entry.shape[-2] * MXFP4_BLOCK,)
        if logical != shape:
            got, want = list(logical), list(shape)
            if transposed:  # both in the model's orientation
                got, want = got[:-2] + got[:-3:-1], want[:-2] + want[:-3:-1]
            how = " and transformers' swap of its last two dims" if transposed else ""
            raise LoadError(
                f"{entry.path}: shape mismatch for {blocks!r}: it dequantizes{how} to {got}, "
                f"model tensor {name!r} is {want}"
            )
        return [Piece(entry, (0,) * len(shape), shape)]
    return []


@dataclass
class QuantPiece:
    """One quantized checkpoint tensor's part in this rank's shard.

    box: per dim, the slice of the local tensor it fills. scale: the scale tensor's entry;
    scale_at/scale_shape: where its covering blocks land in the target's scale buffer (bytes)
    and their shape `[A, SR, SC]`; row_block/col_block: for each local row/column of the box,
    the index of its block in that buffer (`blocks()`), kept as (first index in the piece, block
    size, first block) where the box's indices are consecutive: arrays per row and column of
    every per-expert key of DeepSeek-V3 took 3.3 GB to plan, a review measured.
    """

    piece: Piece
    scale: TensorEntry
    box: tuple[slice, ...]
    scale_at: int
    scale_shape: tuple[int, int, int]
    row_block: np.ndarray | tuple[int, int, int]
    col_block: np.ndarray | tuple[int, int, int]

    def blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(row_block, col_block) as int64 arrays, one entry per row / column of the box."""
        return tuple(  # type: ignore[return-value]
            _expand(b, s.stop - s.start) for b, s in ((self.row_block, self.box[-2]),
                                                     (self.col_block, self.box[-1]))
        )  # fmt: skip


def _expand(blocks: np.ndarray | tuple[int, int, int], n: int) -> np.ndarray:
    if not isinstance(blocks, tuple):
        return blocks
    first, size, first_block = blocks
    return np.arange(first, first + n, dtype=np.int64) // size - first_block


def _consecutive(rel: np.ndarray) -> bool:
    return len(rel) > 0 and int(rel[-1]) - int(rel[0]) == len(rel) - 1


def _used_blocks(rel: np.ndarray, size: int) -> np.ndarray:
    """The sorted distinct blocks (of `size`) that the increasing indices `rel` fall in."""
    if _consecutive(rel):
        return np.arange(int(rel[0]) // size, int(rel[-1]) // size + 1, dtype=np.int64)
    return np.unique(rel // size)


def _compact(rel: np.ndarray, size: int, used: np.ndarray) -> np.ndarray | tuple[int, int, int]:
    """Block of each index in `rel` (blocks of `size`), as a position in `used` (the sorted
    distinct blocks): `_expand`'s tuple where `rel` is consecutive, else the array."""
    if _consecutive(rel):
        return int(rel[0]), size, int(used[0])
    return np.searchsorted(used, rel // size)


@dataclass
class QuantPlan:
    """What a quantized target reads: `rows` [N, 5] (file, out, src, dst, length) with out 0 the
    quantized bytes (`data_shape`, uint8) and out 1 the scale bytes (`scale_bytes`)."""

    method: str
    pieces: list[QuantPiece]
    data_shape: tuple[int, ...]
    scale_bytes: int
    rows: np.ndarray
    data_bytes: int
    scale_keys: tuple[str, ...] = ()  # every piece's scale key, this rank's share or not
    transposed: bool = False  # the model tensor holds the file's last two dims swapped


def _scale_entry(cfg: QuantConfig, piece: Piece, ckpt: Checkpoint) -> tuple[TensorEntry, tuple]:
    """The scale tensor of a quantized piece, checked to cover it; and its block size."""
    key, entry = piece.entry.key, piece.entry
    if cfg.method == "mxfp4":
        skey = key[: -len("_blocks")] + "_scales"
        want = entry.shape[:-1]
        want_dtype: tuple = (torch.uint8,)
    else:
        if entry.dtype != torch.float8_e4m3fn:
            raise LoadError(
                f"{entry.path}: {key!r} is {entry.dtype}; block-FP8 dequantization reads "
                "float8_e4m3fn weights only"
            )
        skey = fp8_scale_key(key)
        r, c = entry.shape[-2:]
        want = entry.shape[:-2] + (-(-r // cfg.block[0]), -(-c // cfg.block[1]))
        want_dtype = SCALE_DTYPES
    if skey not in ckpt:
        raise LoadError(f"{entry.path}: missing scale {skey!r} for the quantized tensor {key!r}")
    scale = ckpt[skey]
    if scale.shape != want or scale.dtype not in want_dtype:
        raise LoadError(
            f"{scale.path}: scale {skey!r} is {scale.dtype} {list(scale.shape)} but {key!r} "
            f"{list(entry.shape)} needs {list(want)} of {'/'.join(map(str, want_dtype))} "
            f"(block {list(cfg.block)} from {cfg.source})"
        )
    return scale, cfg.block


def _box(owned: np.ndarray, lo: int, n: int) -> tuple[slice, np.ndarray]:
    """The contiguous run of local positions whose global index is in [lo, lo + n)."""
    sel = np.nonzero((owned >= lo) & (owned < lo + n))[0]
    if sel.size and sel[-1] - sel[0] + 1 != sel.size:  # owned indices are increasing
        raise LoadError("owned indices are not increasing")  # pragma: no cover
    return (slice(int(sel[0]), int(sel[-1]) + 1) if sel.size else slice(0, 0)), owned[sel] - lo


def plan_quant(
    target: Target,
    cfg: QuantConfig,
    ckpt: Checkpoint,
    file_ids: dict[str, int],
    device: torch.device | None,
    transposed: bool = False,
) -> None:
    """Fill `target.quant` (a `QuantPlan`), `local_shape`, `device` and `read_dtype`.
    transposed: the model tensor is the file's tensor with its last two dims swapped (pieces,
    ranges and scales are then planned in the file's orientation)."""
    t = target.tensor
    if t.dtype not in OUT_DTYPES:
        src = target.pieces[0].entry if target.pieces else None
        where = f" ({src.path}: {src.key}, {src.dtype})" if src is not None else ""
        raise LoadError(
            f"{target.name}: quantized checkpoint tensors{where} dequantize into bfloat16, "
            f"float16 or float32 parameters; this one is {t.dtype}"
        )
    if t.ndim not in (2, 3):
        raise LoadError(f"{target.name}: quantized tensors must be 2-D or 3-D, got {list(t.shape)}")
    gshape = tuple(t.shape)
    owned = owned_indices(t, target.name)
    full = [o if o is not None else np.arange(n, dtype=np.int64) for o, n in zip(owned, gshape)]
    target.local_shape = tuple(len(o) for o in full)
    have = tuple(getattr(t, "_local_tensor", t).shape)
    if have != target.local_shape:
        raise LoadError(
            f"{target.name}: the local tensor has shape {have}, placements give "
            f"{target.local_shape}"
        )
    target.read_dtype = t.dtype
    target.device = (
        torch.device(device or "cpu") if t.is_meta else getattr(t, "_local_tensor", t).device
    )
    if transposed:  # from here on, the file's orientation
        full = full[:-2] + [full[-1], full[-2]]
        gshape = gshape[:-2] + (gshape[-1], gshape[-2])
    local_shape = tuple(len(o) for o in full)
    pack = 2 if cfg.method == "mxfp4" else 1  # values per stored byte, on the last dim
    if pack == 2:
        cols = full[-1]
        if len(cols) % 2 or np.any(cols[0::2] % 2) or np.any(cols[1::2] != cols[0::2] + 1):
            raise LoadError(
                f"{target.name}: this rank's columns split a packed MXFP4 byte (two values); "
                "shard the last dim on even boundaries"
            )
    data_shape = local_shape[:-1] + (local_shape[-1] // pack,)
    byte_owned = full[:-1] + [full[-1][0::pack] // pack]
    byte_global = gshape[:-1] + (gshape[-1] // pack,)
    nd = len(gshape)
    byte_box = owned_boxes(byte_owned, byte_global)  # interval arithmetic where consecutive
    files, srcs, dsts, lens, outs = [], [], [], [], []
    pieces, scale_at, scale_keys = [], 0, []

    def add(entry: TensorEntry, out: int, ranges, base: int = 0) -> None:
        src, dst, length = ranges
        files.append(np.full(len(src), file_ids[entry.path], np.int64))
        outs.append(np.full(len(src), out, np.int64))
        srcs.append(src)
        dsts.append(dst + base)
        lens.append(length)

    for piece in target.pieces:
        scale, (br, bc) = _scale_entry(cfg, piece, ckpt)
        scale_keys.append(scale.key)  # used even where the piece is another rank's
        bytes_piece = Piece(
            piece.entry,
            piece.offset[:-1] + (piece.offset[-1] // pack,),
            piece.shape[:-1] + (piece.shape[-1] // pack,),
        )
        add(piece.entry, 0, piece_ranges(byte_owned, byte_global, bytes_piece, byte_box))
        boxes, rels = zip(*(_box(full[d], piece.offset[d], piece.shape[d]) for d in range(nd)))
        if any(b.stop == b.start for b in boxes):
            continue
        ublock_r, ublock_c = _used_blocks(rels[-2], br), _used_blocks(rels[-1], bc)
        sgshape = piece.shape[:-2] + tuple(scale.shape[-2:])
        # The scale tensor in the piece's own coordinates: the same leading dims (a per-expert
        # key's size-1 expert dim holds no bytes), then the blocks covering this rank's rows and
        # columns, each once.
        s_owned = list(rels[:-2]) + [ublock_r, ublock_c]
        s_piece = Piece(scale, (0,) * nd, sgshape)
        add(
            scale,
            1,
            piece_ranges(s_owned, sgshape, s_piece, owned_boxes(s_owned, sgshape)),
            scale_at,
        )
        lead = int(np.prod([len(r) for r in rels[:-2]], dtype=np.int64))
        sshape = (lead, len(ublock_r), len(ublock_c))
        pieces.append(
            QuantPiece(
                piece,
                scale,
                boxes,
                scale_at,
                sshape,
                _compact(rels[-2], br, ublock_r),
                _compact(rels[-1], bc, ublock_c),
            )
        )
        scale_at += int(np.prod(sshape)) * scale.dtype.itemsize
        scale_at = (scale_at + 63) // 64 * 64  # every piece's scales aligned for any dtype
    rows = coalesce_two(files, outs, srcs, dsts, lens)
    data_bytes = int(np.prod(data_shape, dtype=np.int64))
    planned = int(rows[rows[:, 1] == 0, 4].sum())
    if planned != data_bytes:
        raise LoadError(
            f"{target.name}: checkpoint keys cover {planned} of the {data_bytes} quantized bytes "
            f"of this rank's shard {target.local_shape}"
        )
    target.quant = QuantPlan(
        cfg.method, pieces, data_shape, scale_at, rows, data_bytes, tuple(scale_keys), transposed
    )
    target.rows = rows[:, [0, 2, 3, 4]]


def coalesce_two(files, outs, srcs, dsts, lens) -> np.ndarray:
    """Coalesced rows [N, 5] (file, out, src, dst, length) for outs 0 and 1."""
    cat = [
        np.concatenate(a) if a else np.zeros(0, np.int64) for a in (files, outs, srcs, dsts, lens)
    ]
    f, o, s, d, n = cat
    parts = []
    for out in (0, 1):
        r = coalesce(f[o == out], s[o == out], d[o == out], n[o == out])
        parts.append(np.insert(r, 1, out, axis=1))
    return np.concatenate(parts)
