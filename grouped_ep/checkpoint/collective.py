"""Process-group helpers of `save` / `load`; every one of them works without init_process_group."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from grouped_ep.checkpoint.errors import CheckpointError

_T = TypeVar("_T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world() -> int:
    return dist.get_world_size() if distributed() else 1


@contextlib.contextmanager
def dcp_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def on_rank0(fn: Callable[[], _T], group: Any = None) -> _T:
    """Run `fn` on rank 0 and give every rank its result, or raise its error on every rank
    (over process group `group`, default: the default group, which must hold global rank 0)."""
    if not distributed():
        return fn()
    msg: list[Any] = [None, None]  # [result, error text]
    error: BaseException | None = None
    if rank() == 0:
        try:
            msg[0] = fn()
        except (Exception, CheckpointException) as e:  # sent to the other ranks: nobody waits
            # forever (DCP's CheckpointException is a BaseException)
            error, msg[1] = e, f"{type(e).__name__}: {e}"
        except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C on rank 0: raised there as it is,
            # an error on the others (they waited in the broadcast until rank 0's process died)
            error, msg[1] = e, f"{type(e).__name__} on rank 0 (interrupted)"
    dist.broadcast_object_list(msg, src=0, group=group)
    if error is not None:
        raise error
    if msg[1] is not None:
        raise CheckpointError(f"rank 0 failed: {msg[1]}")
    return msg[0]


def same_on_every_rank(value: Any, what: str, shown: Any = None) -> None:
    """Raise the same CheckpointError on every rank unless `value` is equal on all of them (a
    collective when distributed); the error shows `shown` (default: `value`) of rank 0 and of
    the ranks that differ from it."""
    if not distributed():
        return
    gathered: list[Any] = [None] * world()
    dist.all_gather_object(gathered, (value, value if shown is None else shown))
    odd = [r for r, (v, _) in enumerate(gathered) if v != gathered[0][0]]
    if odd:
        listed = "; ".join(f"rank {r}: {gathered[r][1]}" for r in [0, *odd[:3]])
        raise CheckpointError(
            f"{what} differ between ranks ({listed}{' ...' if len(odd) > 3 else ''}); every "
            "rank must pass the same"
        )


def same_where_given(value: Any, what: str) -> None:
    """Raise the same CheckpointError on every rank unless the ranks whose `value` is not None
    agree on it, rank 0 among them if any gives one (it decides; a collective when
    distributed)."""
    if not distributed():
        return
    gathered: list[Any] = [None] * world()
    dist.all_gather_object(gathered, value)
    given = {r: v for r, v in enumerate(gathered) if v is not None}
    if given and gathered[0] is None:
        raise CheckpointError(
            f"{what} is given on rank(s) {sorted(given)[:4]} but not on rank 0, which names the "
            "checkpoint; give it on rank 0 alone or the same on every rank"
        )
    if len(set(given.values())) > 1:
        listed = "; ".join(f"rank {r}: {v}" for r, v in list(given.items())[:4])
        raise CheckpointError(
            f"{what} differs between ranks ({listed}{' ...' if len(given) > 4 else ''}); give "
            "it on rank 0 alone or the same on every rank"
        )


def failures(e: CheckpointException) -> str:
    """Each failed rank's own error in DCP's `CheckpointException` first, then DCP's report
    with the tracebacks."""
    own = "; ".join(
        f"rank {r}: {type(exc).__name__}: {exc}{_os_cause(exc)}"
        for r, (exc, _) in sorted(e.failures.items())
    )
    return f"{own}\n{e}" if own else str(e)


def _os_cause(error: BaseException) -> str:
    """The OSError behind `error` when it is only in its chain: torch.save's zip writer on a
    full disk says "unexpected pos 704 vs 598", ENOSPC in its `__context__` (crash review)."""
    cause = None if isinstance(error, OSError) else in_chain(error, OSError)
    return f" (caused by {type(cause).__name__}: {cause})" if cause is not None else ""


def in_chain(error: BaseException, types) -> BaseException | None:
    """The first exception of `types` among `error` and its causes and contexts, or None."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, types):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def own_interrupt(e: CheckpointException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit that this rank's failure in DCP's exception `e` is,
    or that caused it: Ctrl-C stays Ctrl-C, not an error a loop would log and go on from.
    Inside torch.save's zip writer it came back as its RuntimeError ("unexpected pos"), the
    interrupt only in its `__context__` (a review)."""
    own = e.failures.get(rank())
    return None if own is None else in_chain(own[0], (KeyboardInterrupt, SystemExit))


def gather_errors(error: BaseException | None) -> dict[int, str]:
    """rank -> error text for every rank whose `error` is set (a collective when distributed)."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    if not distributed():
        return {} if text is None else {0: text}
    gathered: list[str | None] = [None] * world()
    dist.all_gather_object(gathered, text)
    return {r: t for r, t in enumerate(gathered) if t is not None}


def all_ok(error: Exception | None, what: str) -> None:
    """Raise on every rank if `error` is set on any rank."""
    failed = gather_errors(error)
    if error is not None:
        where = f" on rank {rank()}" if distributed() else ""
        raise CheckpointError(f"{what} failed{where}: {error}") from error
    if failed:
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {failed}")


_ASYNC_GROUP: tuple[Any, Any] | None = None  # (the default group it was made for, the group)


def async_group() -> Any:
    """A gloo group of all ranks for background saves, made once per default group (collective).

    A background save runs collectives from its own thread; on the default group they could
    interleave with the training step's collectives (FSDP all-gathers on gloo), which mismatches
    them across ranks. Its own group keeps the two streams apart. Kept for the default group
    object itself (not its `id`, which a later default group reused after a re-initialization:
    a destroyed group went to DCP; a review), and dropped when that group is destroyed
    (`forget_async_group`), with its sockets and threads.
    """
    global _ASYNC_GROUP
    if not distributed():
        return None
    world = dist.group.WORLD
    if _ASYNC_GROUP is None or _ASYNC_GROUP[0] is not world:
        timeout = _timeout(world)  # the user's: torch gives a new group its 30 min default
        _ASYNC_GROUP = (world, dist.new_group(backend="gloo", timeout=timeout))
    return _ASYNC_GROUP[1]


def _timeout(group: Any) -> Any:
    """The timeout `group` was made with, or None (torch's default) where it cannot be read.
    A background save's group took torch's 30 minutes whatever `init_process_group` was given:
    a stuck rank held the others that long (a review: 156 s against a 20 s timeout)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 (no backend for that device; a torch without these)
            continue
    return None


def forget_async_group(destroyed: Any, world: Any) -> None:
    """After `destroy_process_group(destroyed)` of default group `world`: drop the background
    saves' group where it went with it (the whole world, or that group itself)."""
    global _ASYNC_GROUP
    if _ASYNC_GROUP is not None and (
        destroyed is None or destroyed is world or destroyed is _ASYNC_GROUP[1]
    ):
        _ASYNC_GROUP = None
