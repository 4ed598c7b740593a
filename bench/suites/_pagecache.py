"""Page-cache state of checkpoint files for the loader benches: how much is resident, evicting
and warming them, and the disk's limit (one sequential read of the files)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path


def resident_fraction(paths: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore on a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for p in paths:
        size = p.stat().st_size
        pages = (size + page - 1) // page
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
            if not ok:
                return float("nan")
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in bytes(vec))
        total += pages
    return resident / max(total, 1)


def evict(paths: list[Path]) -> str:
    """Evict the files from the page cache: posix_fadvise(DONTNEED) on just these files (kinder
    to a shared machine than drop_caches, which is the fallback)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if resident_fraction(paths) < 0.01:
        return "fadvise"
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise (partial)"


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def sequential_read(paths: list[Path], block: int = 16 << 20) -> tuple[int, float]:
    """Read the files whole, in order, into one reused buffer: (bytes, seconds). The buffer is
    written once before the clock starts, so no page fault is timed."""
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0
