"""Which bytes this rank reads: from a tensor's DTensor placements to the global indices it owns
(per dim), and from those indices plus the checkpoint tensors ("pieces") that tile the global
tensor to coalesced byte ranges (file offset, destination offset, length). No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.safetensors import TensorEntry

try:  # torch >= 2.5 has right-to-left sharding (FSDP on top of a dim-0 sharded DTensor)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor placed in the model tensor's global coordinates.

    `offset` and `shape` have the model tensor's ndim: a per-expert 2-D weight `[I, H]` that is
    expert i's gate rows of `gate_up_proj [E, 2I, H]` has offset `(i, 0, 0)`, shape `(1, I, H)`.
    """

    entry: TensorEntry
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    # A piece that is only part of its checkpoint tensor (q_proj's rows of a fused qkv_proj, one
    # run of rows of a permuted weight): its corner in the checkpoint tensor, which then has the
    # model tensor's ndim. None: the piece is the whole checkpoint tensor.
    file_offset: tuple[int, ...] | None = None
    # For such a piece, the key dim each model dim follows (a transposed key), if not in order.
    file_dims: tuple[int, ...] | None = None
    # For such a piece, the shape its key is read as, if not the key's own: a view of the same
    # bytes with the model tensor's ndim (one key dim split in two).
    file_view: tuple[int, ...] | None = None

    @property
    def file_shape(self) -> tuple[int, ...]:
        """The shape of the key as this piece reads it (for a partial piece)."""
        return self.file_view or tuple(self.entry.shape)

    @property
    def is_whole(self) -> bool:
        return self.file_offset is None


def _chunk(idx: np.ndarray, parts: int, rank: int) -> np.ndarray:
    """torch.chunk's rule, as DTensor's Shard uses it: chunks of ceil(n / parts), the last ones
    smaller or empty."""
    size = -(-len(idx) // parts) if parts else 0
    return idx[rank * size : (rank + 1) * size]


def owned_indices(t: torch.Tensor, name: str) -> list[np.ndarray | None]:
    """Per dim of `t`'s global shape: the global indices this rank holds, in local order, or None
    for the whole dim. A plain tensor holds everything.

    Placements apply left to right over the mesh dims, as in
    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: `Shard(d)` keeps
    this rank's `torch.chunk` of what the earlier mesh dims left on dim d; `_StridedShard(d, sf)`
    chunks into `sf` pieces, chunks each piece across the mesh dim, and keeps this rank's chunk
    of every piece (in piece order).
    """
    if not isinstance(t, DTensor):
        return [None] * t.ndim
    mesh, shape = t.device_mesh, tuple(t.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        raise LoadError(f"{name}: this rank is not part of the DTensor's mesh {mesh}")
    idx: list[np.ndarray | None] = [None] * t.ndim
    for mesh_dim, p in enumerate(t.placements):
        if p.is_replicate():
            continue
        if not (p.is_shard() or isinstance(p, _StridedShard)):
            raise LoadError(
                f"{name}: placement {p} on mesh dim {mesh_dim} cannot be loaded (only Shard and "
                "Replicate have a defined local part of a checkpoint tensor)"
            )
        d = p.dim % t.ndim
        cur = idx[d] if idx[d] is not None else np.arange(shape[d], dtype=np.int64)
        parts, rank = mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            cur = np.concatenate([_chunk(_chunk(cur, sf, j), parts, rank) for j in range(sf)])
        else:
            cur = _chunk(cur, parts, rank)
        idx[d] = cur
    return idx


def local_shape(global_shape: tuple[int, ...], owned: list[np.ndarray | None]) -> tuple[int, ...]:
    return tuple(n if o is None else len(o) for n, o in zip(global_shape, owned))


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired index lists into runs where both advance by one: (src0, dst0, length)."""
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.nonzero(brk)[0]
    lengths = np.diff(np.append(starts, len(src)))
    return src[starts], dst[starts], lengths


def owned_boxes(owned: list[np.ndarray | None], global_shape: tuple[int, ...]):
    """`owned` as one [begin, end) range per dim when every dim's indices are consecutive (Shard
    and Replicate placements; not _StridedShard), else None."""
    out = []
    for n, o in zip(global_shape, owned):
        if o is None:
            out.append((0, n))
        elif len(o) == 0:
            out.append((0, 0))
        elif int(o[-1]) - int(o[0]) == len(o) - 1 and (len(o) < 2 or bool(np.all(np.diff(o) == 1))):
            out.append((int(o[0]), int(o[0]) + len(o)))
        else:
            return None
    return out


def _box_ranges(box: list[tuple[int, int]], piece: Piece):
    """piece_ranges for an owned box and a piece in dim order: interval arithmetic, no index
    lists (planning a model with thousands of experts runs this once per checkpoint key)."""
    nd, item = len(box), piece.entry.dtype.itemsize
    file_shape = piece.shape if piece.is_whole else piece.file_shape
    corner = piece.file_offset or (0,) * nd
    count, s0, d0 = [], [], []
    for d, (lo, hi) in enumerate(box):
        a, b = max(lo, piece.offset[d]), min(hi, piece.offset[d] + piece.shape[d])
        if b <= a:
            return (np.zeros(0, np.int64),) * 3
        count.append(b - a)
        s0.append(a - piece.offset[d] + corner[d])
        d0.append(a - lo)
    lshape = [hi - lo for lo, hi in box]
    k = nd - 1  # dims after k are whole in the file and in the local tensor: one run
    while k > 0 and s0[k] == 0 and d0[k] == 0 and count[k] == file_shape[k] == lshape[k]:
        k -= 1
    f_stride, d_stride = _strides(file_shape), _strides(lshape)
    length = count[k] * math.prod(count[k + 1 :]) * item
    if math.prod(count[:k]) == 1:  # one run (an expert's whole matrix): no index arithmetic
        src = piece.entry.start + sum(s * f for s, f in zip(s0[: k + 1], f_stride)) * item
        dst = sum(s * f for s, f in zip(d0[: k + 1], d_stride)) * item
        return np.array([src], np.int64), np.array([dst], np.int64), np.array([length], np.int64)
    src = np.array([s0[k] * f_stride[k]], np.int64)
    dst = np.array([d0[k] * d_stride[k]], np.int64)
    for d in range(k - 1, -1, -1):
        steps = np.arange(count[d], dtype=np.int64)
        src = np.add.outer((steps + s0[d]) * f_stride[d], src).ravel()
        dst = np.add.outer((steps + d0[d]) * d_stride[d], dst).ravel()
    return piece.entry.start + src * item, dst * item, np.full(len(src), length, np.int64)


def piece_ranges(
    owned: list[np.ndarray | None],
    global_shape: tuple[int, ...],
    piece: Piece,
    box: list[tuple[int, int]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges of `piece` that land in this rank's local tensor.

    Returns (src, dst, length) int64 arrays: src is an absolute file offset, dst a byte offset
    into the contiguous local tensor `[local_shape]` held in the checkpoint's dtype. Innermost
    dims that are whole on both sides are merged, so a row-sharded matrix is a single range.
    `box`: `owned_boxes(owned, global_shape)` when known (the fast path for consecutive indices).
    """
    empty = (np.zeros(0, np.int64),) * 3
    item = piece.entry.dtype.itemsize
    nd = len(global_shape)
    if nd == 0:
        return np.array([piece.entry.start]), np.array([0]), np.array([item])
    if box is not None and piece.file_dims in (None, tuple(range(nd))):
        return _box_ranges(box, piece)
    lshape = local_shape(global_shape, owned)
    dims = piece.file_dims or tuple(range(nd))
    in_order = dims == tuple(range(nd))
    src_pos, dst_pos = [], []
    for d in range(nd):
        idx = owned[d] if owned[d] is not None else np.arange(global_shape[d], dtype=np.int64)
        rel = idx - piece.offset[d]
        sel = np.nonzero((rel >= 0) & (rel < piece.shape[d]))[0]
        if sel.size == 0:
            return empty
        src_pos.append(rel[sel] + (0 if piece.is_whole else piece.file_offset[dims[d]]))
        dst_pos.append(sel.astype(np.int64))
    file_shape = piece.shape if piece.is_whole else piece.file_shape

    def whole(d: int) -> bool:
        n = file_shape[d]
        every = np.arange(n)
        return (
            in_order
            and n == lshape[d]
            and np.array_equal(src_pos[d], every)
            and np.array_equal(dst_pos[d], every)
        )

    k = nd - 1
    while k > 0 and whole(k):
        k -= 1
    inner = math.prod(piece.shape[k + 1 :])
    file_strides, d_stride = _strides(file_shape), _strides(lshape)
    s_stride = [file_strides[dims[d]] for d in range(nd)]  # a model dim's step in the file
    if in_order or s_stride[k] == 1:  # in order, dims after k are whole: runs are contiguous
        run_src, run_dst, run_len = runs(src_pos[k], dst_pos[k])
    else:  # a transposed key: neighbours on the model's last dim are apart in the file
        run_src, run_dst, run_len = src_pos[k], dst_pos[k], np.ones_like(src_pos[k])
    src = run_src * s_stride[k]
    dst = run_dst * d_stride[k]
    for d in range(k - 1, -1, -1):  # outer dims: one entry per index, row-major order
        src = np.add.outer(src_pos[d] * s_stride[d], src).ravel()
        dst = np.add.outer(dst_pos[d] * d_stride[d], dst).ravel()
    length = np.tile(run_len * inner, len(src) // len(run_len))
    return piece.entry.start + src * item, dst * item, length * item


def coalesce(file: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Sort ranges by (file, src) and merge neighbours contiguous in both file and destination.

    Returns int64 [N, 4]: (file, src, dst, length). Empty ranges are dropped.
    """
    keep = length > 0
    file, src, dst, length = file[keep], src[keep], dst[keep], length[keep]
    if len(src) == 0:
        return np.zeros((0, 4), np.int64)
    order = np.lexsort((src, file))
    file, src, dst, length = file[order], src[order], dst[order], length[order]
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (
        (file[1:] != file[:-1])
        | (src[1:] != src[:-1] + length[:-1])
        | (dst[1:] != dst[:-1] + length[:-1])
    )
    starts = np.nonzero(brk)[0]
    return np.stack(
        [file[starts], src[starts], dst[starts], np.add.reduceat(length, starts)], axis=1
    ).astype(np.int64)


def clip(rows: np.ndarray, begin: int, end: int) -> np.ndarray:
    """The parts of ranges `rows` [N, 4] whose destination falls in bytes [begin, end), with the
    destination made relative to `begin`."""
    dst, length = rows[:, 2], rows[:, 3]
    sel = (dst < end) & (dst + length > begin)
    r = rows[sel].copy()
    lo = np.maximum(r[:, 2], begin)
    hi = np.minimum(r[:, 2] + r[:, 3], end)
    r[:, 1] += lo - r[:, 2]
    r[:, 2] = lo - begin
    r[:, 3] = hi - lo
    return r


@dataclass
class Target:
    """One distinct model tensor (tied names share one), what it needs and where it goes."""

    names: list[str]
    tensor: torch.Tensor
    is_param: bool
    slots: list[tuple[nn.Module, str]]
    pieces: list[Piece] = field(default_factory=list)
    read_dtype: torch.dtype | None = None
    local_shape: tuple[int, ...] = ()
    device: torch.device | None = None
    rows: np.ndarray | None = None  # [N, 4] (file, src, dst, length) bytes
    fresh: torch.Tensor | None = None
    quant: object = None  # a quant.QuantPlan when the pieces are quantized

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def read_bytes(self) -> int:
        return int(np.prod(self.local_shape, dtype=np.int64)) * self.read_dtype.itemsize


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def plan_target(target: Target, file_ids: dict[str, int], device: torch.device | None) -> None:
    t = target.tensor
    dtypes = [p.entry.dtype for p in target.pieces]
    if len(set(dtypes)) != 1:
        # Name the pieces that differ from the most common dtype, with their files (the key at
        # fault is rarely among the first few of an expert stack).
        common = max(set(dtypes), key=dtypes.count)
        odd = [p.entry for p in target.pieces if p.entry.dtype != common]
        shown = "; ".join(f"{e.path}: {e.key!r} is {e.dtype}" for e in odd[:4])
        more = f" (and {len(odd) - 4} more)" if len(odd) > 4 else ""
        raise LoadError(
            f"{target.name}: the checkpoint keys stacked into it must share one dtype; "
            f"{len(dtypes) - len(odd)} of {len(dtypes)} are {common}, but {shown}{more}"
        )
    src_dtype = dtypes[0]
    if src_dtype != t.dtype and not (src_dtype.is_floating_point and t.dtype.is_floating_point):
        p = target.pieces[0].entry
        raise LoadError(
            f"{p.path}: dtype mismatch for {p.key!r}: the file holds {src_dtype}, model tensor "
            f"{target.name!r} is {t.dtype} (only floating-point dtypes are cast)"
        )
    owned = owned_indices(t, target.name)
    target.local_shape = local_shape(tuple(t.shape), owned)
    have = tuple(local_tensor(t).shape)
    if have != target.local_shape:
        raise LoadError(
            f"{target.name}: the local tensor has shape {have} but its placements "
            f"{getattr(t, 'placements', None)} give {target.local_shape} for this rank"
        )
    target.read_dtype = src_dtype
    target.device = torch.device(device or "cpu") if t.is_meta else local_tensor(t).device
    ids, runs, srcs, dsts, lens = [], [], [], [], []
    box = owned_boxes(owned, tuple(t.shape))
    for piece in target.pieces:
        src, dst, length = piece_ranges(owned, tuple(t.shape), piece, box)
        ids.append(file_ids[piece.entry.path])
        runs.append(len(src))
        srcs.append(src)
        dsts.append(dst)
        lens.append(length)
    files = np.repeat(np.array(ids, np.int64), runs)
    target.rows = coalesce(files, *(np.concatenate(a) for a in (srcs, dsts, lens)))
    planned = int(target.rows[:, 3].sum()) if len(target.rows) else 0
    if planned != target.read_bytes:  # the pieces must tile this rank's shard exactly
        raise LoadError(
            f"{target.name}: checkpoint keys cover {planned} of the {target.read_bytes} bytes of "
            f"this rank's shard {target.local_shape} (keys {[p.entry.key for p in target.pieces][:4]})"
        )
