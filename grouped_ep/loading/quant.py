"""Quantized checkpoints: which formats, which scale goes with which weight, and which quantized
bytes and scale blocks this rank reads. No I/O beyond `config.json`.

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

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

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
from grouped_ep.loading.safetensors import Checkpoint, TensorEntry

# Every fp8 dtype a safetensors file can hold: a weight of any of them beside its scales is
# quantized (the FNUZ ones loaded as raw codes, their scales unused, silently: a review).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2) + tuple(
    getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)
)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16) + (
    (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()
)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MXFP4_BLOCK = 32  # values per E8M0 scale


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's `quantization_config`: method "fp8" (with `block`) or "mxfp4"."""

    method: str
    block: tuple[int, int]
    source: str  # the config.json it came from, for messages


def read_quant_config(ckpt: Checkpoint) -> QuantConfig | None:
    """The `quantization_config` of the `config.json` next to the checkpoint, or None.

    Read only when the checkpoint holds a tensor that no plain float model tensor is loaded from
    as is (fp8, integer, uint8): a bf16 / fp16 / fp32 checkpoint costs no extra read."""
    if all(e.dtype.is_floating_point and e.dtype.itemsize >= 2 for e in ckpt.entries.values()):
        return None
    root = Path(ckpt.root)
    path = (root if root.is_dir() else root.parent) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{path}: cannot read config.json: {e}") from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise LoadError(f"{path}: 'quantization_config' must be an object, got {qc!r:.80}")
    method = qc.get("quant_method")
    if method == "mxfp4":
        return QuantConfig("mxfp4", (1, MXFP4_BLOCK), str(path))
    if method == "fp8":
        # transformers' FineGrainedFP8Config: absent means 128 x 128 blocks, null per-tensor
        block = qc.get("weight_block_size", [128, 128])
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise LoadError(
                f"{path}: quantization_config.weight_block_size must be [rows, cols] positive "
                f"ints for quant_method 'fp8' (per-tensor FP8 is not supported), got {block!r}"
            )
        return QuantConfig("fp8", (block[0], block[1]), str(path))
    raise LoadError(
        f"{path}: unknown quantization_config.quant_method {method!r} (known: 'fp8', 'mxfp4')"
    )


def fp8_scale_key(key: str) -> str:
    """DeepSeek-V3's name for the scales of `key` (transformers' rule)."""
    return (
        key[: -len("weight")] + "weight_scale_inv"
        if key.endswith(".weight")
        else key + "_scale_inv"
    )


def _fp8_scale_names(key: str) -> list[str]:
    """Where the scales of fp8 tensor `key` are found in the formats that write them."""
    return [fp8_scale_key(key), f"{key}_scale", f"{key}_scale_inv"]


def orphan_scales(keys: list[str], ckpt: Checkpoint) -> list[str]:
    """For a model tensor found under none of `keys`: each scale of one of them that the
    checkpoint holds, with the quantized key it scales (a shard copied in part)."""
    pairs = [(f"{k}_scales", f"{k}_blocks") for k in keys]
    pairs += [(s, k) for k in keys for s in _fp8_scale_names(k)]
    return [f"{s!r} is there, {k!r} is not" for s, k in pairs if s in ckpt]


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
        want_dtype = _SCALE_DTYPES
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


def _scale_names(key: str) -> list[str]:
    """Where the scales of quantized key `key` (fp8 codes, or MXFP4 `_blocks`) may be."""
    return (
        [key[: -len("_blocks")] + "_scales"] if key.endswith("_blocks") else _fp8_scale_names(key)
    )


def is_quantized(
    cfg: QuantConfig | None, target: Target, ckpt: Checkpoint, model_names: Collection[str] = ()
) -> bool:
    """Whether `target`'s pieces are quantized; a quantized checkpoint without a
    quantization_config is an error (its values would be wrong without their scales).
    `model_names`: the model's tensors, to tell a model that holds its own scales."""
    quant = [
        p for p in target.pieces if p.entry.dtype in FP8_DTYPES or p.entry.key.endswith("_blocks")
    ]
    if not quant:
        return False
    e = quant[0].entry
    scales = [k for k in _scale_names(e.key) if k in ckpt]
    if all(p.entry.dtype == target.tensor.dtype for p in quant):
        if not scales or any(k in model_names for k in scales):
            # plain codes, or a model that holds the codes and their scales itself (an fp8
            # inference module): a plain copy, config or not
            return False
        raise LoadError(
            f"{e.path}: {e.key!r} holds {e.dtype} codes scaled by {scales[0]!r}, and the model's "
            f"{target.name!r} is {target.tensor.dtype} with no scale tensor of its own: copied "
            "as they are, its values would be the unscaled codes. Build the model in bfloat16, "
            f"float16 or float32 (the codes are dequantized), or give it {scales[0]!r}"
        )
    if cfg is None or (cfg.method == "fp8") != (e.dtype in FP8_DTYPES):
        scale = fp8_scale_key(e.key) if e.dtype in FP8_DTYPES else e.key[:-7] + "_scales"
        if cfg is None and e.dtype in FP8_DTYPES:
            # DeepSeek's `weight_scale_inv`, or compressed-tensors' / ModelOpt's `weight_scale`
            scale = scales[0] if scales else None
            if scale is None:
                return False  # no scales: fp8 values as they are, as for bf16
        said = "no config.json quantization_config says so" if cfg is None else ""
        said = said or f"{cfg.source} says quant_method {cfg.method!r}"
        raise LoadError(
            f"{e.path}: {e.key!r} is quantized ({e.dtype}, scales {scale!r}) but {said}"
        )
    if len(quant) != len(target.pieces):
        plain = next(p.entry for p in target.pieces if all(p is not x for x in quant))
        q = quant[0].entry
        raise LoadError(
            f"{target.name}: checkpoint tensors mix quantized and plain dtypes: {plain.path}: "
            f"{plain.key!r} is {plain.dtype}, {q.path}: {q.key!r} is {q.dtype}"
        )
    part = next((p.entry for p in quant if not p.is_whole), None)
    if part is not None:
        raise LoadError(
            f"{target.name}: its quantized checkpoint tensors hold it only in part (a fused or "
            f"permuted key: {part.path}: {part.key!r}); dequantizing such keys is not supported"
        )
    return True


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
