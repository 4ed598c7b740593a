"""The handle of a background save (`save(..., async_save=True)`) and the wait for it.

DCP's `async_save` copies the state to CPU memory on the calling thread (that is the only part
the training step waits for) and writes it from a background thread. Here one more background
step follows on rank 0: once DCP has finished (its last collective gathers every rank's write
results, so every rank's files are complete), rank 0 commits the step directory, moves `latest`
and prunes old steps, and sends the outcome to every rank. Only one save is in flight: the next
`save` or `load` waits for it first.
"""

from __future__ import annotations

import atexit
import functools
import sys
import types
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from grouped_ep.checkpoint.collective import gather_errors
from grouped_ep.checkpoint.errors import CheckpointError

_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: AsyncSave | None = None


class AsyncSave:
    """A save running in the background; `result()` waits for it.

    The handle completes on every rank once rank 0 has committed the checkpoint (`latest`
    names it), or failed to: rank 0 sends the outcome to every rank on the save's own group. A
    failure is raised by `result()`; if no rank saw it there, the next `save` or `load` raises
    it on every rank.
    """

    def __init__(self, path: Path, future: Future) -> None:
        self.path = path  # the checkpoint directory this save becomes: root/step-<step>
        self._future = future
        self._reported = False

    def done(self) -> bool:
        """True once the background work has finished (successfully or not)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        """Wait for the save and return its directory; CheckpointError if it failed."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._reported = True
            raise


def start(path: Path, job: Callable[[], Path]) -> AsyncSave:
    """Run `job` (wait for DCP's writes, then commit on rank 0) in the background."""
    global _EXECUTOR, _PENDING
    if _EXECUTOR is None:  # one worker: background saves run one after the other
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouped_ep-ckpt")

    def run() -> Path:
        try:
            return job()
        except CheckpointError:
            raise
        except BaseException as e:
            raise CheckpointError(f"async save of {path} failed: {type(e).__name__}: {e}") from e

    handle = AsyncSave(path, _EXECUTOR.submit(run))
    _PENDING = handle
    _guard_exit()
    return handle


def _finish_pending() -> None:
    """Wait for the save in flight, if any, without raising (its error stays for `result()`,
    the next `save`/`load`, or the report at exit)."""
    handle = _PENDING
    if handle is not None:
        try:
            handle._future.result()
        except BaseException:
            pass


def _report_at_exit() -> None:
    """A background save that failed and whose error nobody read: say so on stderr (the
    process is exiting; there is no one left to raise it to)."""
    handle = _PENDING
    if handle is None or handle._reported or not handle._future.done():
        return
    error = handle._future.exception()
    if error is not None:
        sys.stderr.write(
            f"grouped_ep.checkpoint: {error}\n(an async save failed and nothing read its error; "
            "call handle.result() before exiting)\n"
        )


def _destroy_shim(*args, **kwargs):
    """The body `torch.distributed.destroy_process_group` runs once a save was started: wait
    for the save in flight, then destroy as torch does. (Run with torch's module globals: it
    names nothing of this module but through the import.)"""
    from grouped_ep.checkpoint import async_save as guard
    from grouped_ep.checkpoint.collective import forget_async_group

    guard._finish_pending()
    world = guard.dist.group.WORLD
    result = guard._ORIGINAL_DESTROY(*args, **kwargs)
    forget_async_group(args[0] if args else kwargs.get("group"), world)
    return result


_ORIGINAL_DESTROY: Callable | None = None


def _guard_exit() -> None:
    """Once per process: `torch.distributed.destroy_process_group` first waits for the save in
    flight (it destroyed the save's process group under it: the step was lost with exit code
    0), and an unread failure is reported on stderr at exit. (The worker thread itself is joined
    at interpreter exit by concurrent.futures, so a save in flight finishes.)

    The function's code is replaced in place, so every reference to it waits: the
    `torch.distributed` attribute, `distributed_c10d`'s, and names a script imported before
    (`from torch.distributed import destroy_process_group`). torch's own body runs from a copy."""
    global _ORIGINAL_DESTROY
    if _ORIGINAL_DESTROY is not None:
        return
    target = c10d.destroy_process_group
    original = types.FunctionType(
        target.__code__, target.__globals__, target.__name__, target.__defaults__,
        target.__closure__,
    )  # fmt: skip
    original.__kwdefaults__ = target.__kwdefaults__
    _ORIGINAL_DESTROY = original
    if target.__code__.co_freevars:  # not a plain function: wrap the module attributes only
        dist.destroy_process_group = c10d.destroy_process_group = functools.wraps(target)(
            _destroy_shim
        )
    else:
        target.__code__ = _destroy_shim.__code__
    atexit.register(_report_at_exit)


def wait_pending(what: str) -> None:
    """Wait for the save in flight, if any; raise on every rank a failure no `result()` raised.

    Collective when distributed (every rank calls it at the start of `save` and `load`).
    """
    global _PENDING
    handle, _PENDING = _PENDING, None
    if handle is None:
        return
    error: BaseException | None = None
    try:
        handle._future.result()
    except BaseException as e:
        error = None if handle._reported else e
    failed = gather_errors(error)
    if failed:
        raise CheckpointError(
            f"{what}: the previous async save to {handle.path} failed on rank(s) "
            f"{sorted(failed)}: {failed}; its step was not committed"
        ) from error
