"""The handle of a background save (`save(..., async_save=True)`) and the wait for it.

DCP's `async_save` copies the state to CPU memory on the calling thread (that is the only part
the training step waits for) and writes it from a background thread. Here one more background
step follows on rank 0: once DCP has finished (its last collective gathers every rank's write
results, so every rank's files are complete), rank 0 commits the step directory, moves `latest`
and prunes old steps. Only one save is in flight: the next `save` or `load` waits for it first.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from grouped_ep.checkpoint.collective import gather_errors
from grouped_ep.checkpoint.errors import CheckpointError

_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: AsyncSave | None = None


class AsyncSave:
    """A save running in the background; `result()` waits for it.

    On rank 0 the handle completes once the checkpoint is committed (`latest` names it); on
    other ranks once DCP has written every rank's files. A failure is raised by `result()`; if
    no rank saw it there, the next `save` or `load` raises it on every rank.
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
    return handle


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
