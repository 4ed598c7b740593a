"""A DCP storage reader that reads large tensor chunks straight into their destination.

DCP's `FileSystemReader` loads each saved chunk with `torch.load` into a new tensor, then copies
it into the destination: every byte is written twice, and the new tensor's fresh pages are
faulted in on the way. A chunk saved by DCP is one `torch.save` archive inside a `.distcp` file
(stored, not compressed); its bytes lie in one record of that archive. Where the destination is
contiguous, on CPU and of the saved dtype, the saved tensor is contiguous and fills its storage,
and the request is whole rows of it (all of it, or a block of its first dim, as a resharded
load asks for), `DirectReader` reads those bytes into the destination itself. The saved
tensor's dtype, shape and strides come from the archive's pickle, loaded onto the meta device
(no data read). Every other item (small chunks, other parts of a chunk such as a block of
columns, non-contiguous layouts, transformed streams, non-tensor values) goes through DCP's own
path.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

# Chunks smaller than this go through DCP's path: the archive's pickle costs about 0.25 ms to
# parse, about what copying 1 MB costs.
MIN_DIRECT_BYTES = 1 << 20


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open binary file, as a seekable read-only file."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buf).cast("B")[:n])
        self._pos += got or 0
        return got or 0


def _read_exactly(f, offset: int, out: memoryview, what: str) -> None:
    f.seek(offset)
    done = 0
    while done < len(out):
        got = f.readinto(out[done:])
        if not got:
            raise OSError(f"{what}: the file ends {len(out) - done} bytes early")
        done += got


class DirectReader(FileSystemReader):
    """`FileSystemReader` that reads large chunks (or row blocks of them) into their destination
    in one copy."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        rest: list[ReadItem] = []
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if (
                req.type == LoadItemType.TENSOR
                and not getattr(info, "transform_descriptors", None)
                and info.length >= MIN_DIRECT_BYTES
            ):
                per_file.setdefault(info.relative_path, []).append(req)
            else:
                rest.append(req)
        for relative_path, reqs in per_file.items():
            path = os.path.join(str(self.path), relative_path)
            with open(path, "rb", buffering=0) as f:
                reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                for req in reqs:
                    if not self._read_direct(f, path, req, planner):
                        rest.append(req)
        if rest:
            try:
                return super().read_data(dataclasses.replace(plan, items=rest), planner)
            except Exception as e:  # DCP's message names neither the file nor the key
                bad = self._first_unreadable(rest)
                if bad is None:
                    raise
                raise OSError(f"{bad}: cannot read the saved item ({type(e).__name__}: {e})") from e
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _first_unreadable(self, reqs: list[ReadItem]) -> str | None:
        """'<file> (<key>)' of the first item that torch.load cannot read, or None."""
        for req in reqs:
            info = self.storage_data[req.storage_index]
            path = os.path.join(str(self.path), info.relative_path)
            try:
                with open(path, "rb", buffering=0) as f:
                    # The checkpoint is trusted as much as DCP's own pickled .metadata is.
                    torch.load(
                        _Window(f, info.offset, info.length), map_location="cpu", weights_only=False
                    )
            except Exception:  # noqa: BLE001 (pickle and zip raise many types)
                return f"{path} ({req.storage_index.fqn})"
        return None

    def _read_direct(self, f, path: str, req: ReadItem, planner: LoadPlanner) -> bool:
        """Read `req` into its destination if it qualifies (see the module docstring)."""
        info = self.storage_data[req.storage_index]
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous():
            return False
        window = _Window(f, info.offset, info.length)
        what = f"{path} ({req.storage_index.fqn})"
        try:
            saved = torch.load(window, map_location="meta", weights_only=True)
        except Exception as e:  # pickle and zip raise many types
            window.seek(0)
            try:  # can DCP's path read it? Then this torch cannot load it onto meta: use that
                torch.load(window, map_location="cpu", weights_only=True)
            except Exception:
                raise OSError(
                    f"{what}: cannot read the saved chunk ({type(e).__name__}: {e})"
                ) from e
            return False
        if not isinstance(saved, torch.Tensor) or saved.dtype != target.dtype:
            return False
        nbytes = saved.numel() * saved.element_size()
        lengths, offsets = tuple(req.lengths), tuple(req.storage_offsets)
        if (
            not saved.is_contiguous()
            or saved.storage_offset() != 0
            or saved.untyped_storage().nbytes() != nbytes
            or tuple(target.shape) != lengths
            or len(lengths) != saved.dim()
        ):
            return False
        # The request: whole rows of the saved chunk (all of it, or a block of its first dim, as
        # a resharded load asks for), one contiguous byte range.
        start, count = 0, nbytes
        if saved.dim() > 0:
            if any(offsets[1:]) or lengths[1:] != tuple(saved.shape[1:]):
                return False
            if offsets[0] + lengths[0] > saved.shape[0]:
                return False
            row = nbytes // saved.shape[0] if saved.shape[0] else 0
            start, count = offsets[0] * row, lengths[0] * row
        window.seek(0)
        try:  # torch's archive reader (a private API: if it ever changes, DCP's path)
            archive = torch._C.PyTorchFileReader(window)
            records = archive.get_all_records()
            data = [r for r in records if r.startswith("data/")]
            order = archive.get_record("byteorder") if "byteorder" in records else b"little"
            if len(data) != 1 or bytes(order).decode() != sys.byteorder:
                return False
            offset = info.offset + archive.get_record_offset(data[0]) + start
        except (AttributeError, TypeError, RuntimeError):
            return False
        if count:
            out = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            _read_exactly(f, offset, out, what)
        planner.commit_tensor(req, target)
        return True
