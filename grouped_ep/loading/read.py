"""The reads of `load_sharded`: native `read_ranges` calls straight into fresh tensors, or through
a staging buffer for tensors that need a dtype cast or live on a GPU; a progress bar."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.plan import Target, clip
from grouped_ep.loading.safetensors import SafetensorsFile

_CALL_BYTES = 1 << 30  # bytes per native call: the progress bar's granularity
_STAGING_BYTES = 128 << 20  # cast / host-to-device staging (two buffers of half for CUDA)


def default_threads() -> int:
    """Reader threads per rank: the CPUs this process may run on, shared with the other ranks
    of the host (`LOCAL_WORLD_SIZE`, set by torchrun), between 1 and 16. Hot reads are copies out
    of the page cache, bound by the cores; cold reads keep the disk busy through large reads
    and the kernel's read-ahead (csrc/io/reader.cpp), not through more threads."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1") or "1"
    local_ranks = int(raw) if raw.isascii() and raw.isdigit() else 0  # not "1_0", " 2", "+2"
    if local_ranks < 1:
        raise ValueError(f"load_sharded: LOCAL_WORLD_SIZE must be an integer >= 1, got {raw!r}")
    return max(1, min(16, len(os.sched_getaffinity(0)) // local_ranks))


def _file_order(target: Target) -> tuple[int, int]:
    """(file, first byte) of the target's first range: targets are read in file order. Its
    rows come from `plan.coalesce`, sorted by (file, offset) already."""
    if len(target.rows) == 0:
        return (0, 0)
    return (int(target.rows[0, 0]), int(target.rows[0, 1]))


def _default_progress() -> bool:
    """On a TTY, on one rank per node: torchrun hands its terminal to every local rank, whose
    `\r` bars wrote over each other (a review)."""
    if not sys.stderr.isatty():
        return False
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return local.strip() == "0"
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class Progress:
    def __init__(self, total: int, enabled: bool | None):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.on = _default_progress() if enabled is None else enabled

    def add(self, n: int) -> None:
        self.done += n
        if self.on:
            secs = max(time.perf_counter() - self.t0, 1e-9)
            pct = 100.0 * self.done / max(self.total, 1)
            sys.stderr.write(
                f"\rload_sharded: {pct:5.1f}% {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                f"{self.done / secs / 1e9:.2f} GB/s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


def read_ranges(
    files: list[SafetensorsFile], outs: list[torch.Tensor], rows: np.ndarray, threads: int
) -> int:
    """One native call: rows [N, 5] = (file, out, src, dst, length). A file that is no longer the
    one whose header was read (replaced or rewritten since) is refused before it is read."""
    if len(rows) == 0:
        return 0
    # Only the files these rows read are opened (all of a checkpoint's were, each call: a rank
    # reading one file of 300 needed 300 descriptors; a review).
    used, inverse = np.unique(rows[:, 0], return_inverse=True)
    if len(used) < len(files):
        rows = rows.copy()
        rows[:, 0] = inverse
        files = [files[i] for i in used.tolist()]
    paths = [f.path for f in files]
    expect = [v for f in files for v in f.identity] if all(f.identity for f in files) else None
    try:
        return torch.ops.grouped_ep.read_ranges(
            paths, outs, torch.from_numpy(rows), threads, expect
        )
    except RuntimeError as e:
        raise LoadError(str(e).split("\n")[0]) from None


def read_direct(targets, files, threads, progress) -> int:
    """Targets read as-is into fresh CPU tensors, in file order, in native calls of about 1 GiB
    each (the reader sorts each call's ranges by file offset and merges the ones that touch)."""
    batches: list[list[Target]] = [[]]
    size = 0
    for target in sorted(targets, key=_file_order):
        if size >= _CALL_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(target)
        size += target.read_bytes
    total = 0
    for batch in batches:
        rows = [np.zeros((0, 5), np.int64)]
        for j, target in enumerate(batch):
            target.fresh = torch.empty(target.local_shape, dtype=target.read_dtype)
            rows.append(np.insert(target.rows, 1, j, axis=1))
        n = read_ranges(files, [t.fresh for t in batch], np.concatenate(rows), threads)
        total += n
        progress.add(n)
    return total


def read_staged(targets, files, threads, progress) -> int:
    """Targets that need a cast or live on a GPU: windows of their local tensor go through a
    staging buffer (pinned and double-buffered for CUDA), then `copy_` casts / uploads them."""
    if not targets:
        return 0
    cuda = any(t.device.type == "cuda" for t in targets)
    nbuf = 2 if cuda else 1
    size = _STAGING_BYTES // nbuf
    # Windows of at most `size` bytes, packed into fills of the staging buffer: lists of
    # (target, first element, end element, byte offset in the buffer).
    fills: list[list[tuple[Target, int, int, int]]] = []
    fill, used = [], 0
    for target in sorted(targets, key=_file_order):
        target.fresh = torch.empty(
            target.local_shape, dtype=target.tensor.dtype, device=target.device
        )
        item = target.read_dtype.itemsize
        numel, step = target.read_bytes // item, max(1, size // item)
        for b in range(0, numel, step):
            e = min(numel, b + step)
            if fill and used + (e - b) * item > size:
                fills.append(fill)
                fill, used = [], 0
            fill.append((target, b, e, used))
            used = (used + (e - b) * item + 63) // 64 * 64  # keep every window aligned
    if fill:
        fills.append(fill)

    staging = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(nbuf)]
    # Per buffer, the events recorded after the uploads that read it: one per GPU they went to,
    # on that GPU's current stream (where copy_ runs them), not the current device's.
    events: list[list] = [[] for _ in range(nbuf)]
    total = 0
    for k, fill in enumerate(fills):
        buf = staging[k % nbuf]
        for event in events[k % nbuf]:
            event.synchronize()  # the uploads that last read this buffer are done
        rows = []
        for target, b, e, off in fill:
            item = target.read_dtype.itemsize
            r = clip(target.rows, b * item, e * item)
            r[:, 2] += off
            rows.append(np.insert(r, 1, 0, axis=1))
        n = read_ranges(files, [buf], np.concatenate(rows), threads)
        total += n
        progress.add(n)
        for target, b, e, off in fill:
            src = buf[off : off + (e - b) * target.read_dtype.itemsize].view(target.read_dtype)
            target.fresh.view(-1)[b:e].copy_(src, non_blocking=cuda)
        if cuda:
            events[k % nbuf] = [
                torch.cuda.current_stream(device).record_event()
                for device in {t.device for t, *_ in fill if t.device.type == "cuda"}
            ]
    for device in {t.device for t in targets if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
    return total
