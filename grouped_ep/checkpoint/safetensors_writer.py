"""Write a safetensors file one tensor at a time: the header from a plan, then each tensor's bytes.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. A file planned in
advance (names, dtypes, shapes) has its header known before any tensor exists, so a writer can
stream: header first, then the tensors in planned order, each staged (made contiguous, on CPU)
and dropped before the next. Format: 8-byte little-endian header length, a JSON header padded
with spaces to a multiple of 8, then the data, each tensor at its `data_offsets`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from grouped_ep.loading.safetensors import DTYPES

_DTYPES = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> header name


@dataclass(frozen=True)
class PlannedTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StreamingSafetensorsWriter:
    """Writes the planned tensors of one file, in order: `write(key, tensor)` per tensor, `close()`."""

    def __init__(self, path: Path, planned: list[PlannedTensor]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        start = 0
        for p in planned:
            if p.key in header:  # a second copy would make the header point at stray bytes
                raise ValueError(f"export_hf: {p.key} is planned twice for {path.name}")
            if p.dtype not in _DTYPES:
                raise ValueError(f"export_hf: {p.key} has dtype {p.dtype}, which safetensors lacks")
            header[p.key] = {
                "dtype": _DTYPES[p.dtype],
                "shape": list(p.shape),
                "data_offsets": [start, start + p.nbytes],
            }
            start += p.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.path = path
        self._planned = list(planned)
        self._next = 0
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor; its key, dtype and shape must be the planned ones."""
        if self._next >= len(self._planned):
            raise ValueError(f"export_hf: {key} was not planned for {self.path.name}")
        p = self._planned[self._next]
        if (key, tensor.dtype, tuple(tensor.shape)) != (p.key, p.dtype, p.shape):
            raise ValueError(
                f"export_hf: {self.path.name} expected {p.key} {p.dtype} {list(p.shape)} next, got "
                f"{key} {tensor.dtype} {list(tensor.shape)}"
            )
        staged = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(staged.numpy()))
        self._next += 1

    def close(self) -> None:
        """Flush and fsync; raise if a planned tensor was never written."""
        try:
            if self._next != len(self._planned):
                missing = [p.key for p in self._planned[self._next :]]
                raise ValueError(f"export_hf: {self.path.name} never got {missing[:5]}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB" (10^9) or "500MiB" (2^20)."""
    if isinstance(size, bool) or not isinstance(size, (numbers.Integral, str)):  # 1.5 GB?
        raise ValueError(
            f"export_hf: max_shard_size must be a size like '5GB' or an int, got {size!r}"
        )
    if isinstance(size, numbers.Integral):
        n = int(size)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else ""
        if not m or (unit and unit not in _SIZE_UNITS):
            raise ValueError(f"export_hf: max_shard_size {size!r} is not a size like '5GB'")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit or "B"])
    if n <= 0:
        raise ValueError(f"export_hf: max_shard_size must be positive, got {size!r}")
    return n
