"""Run a function on N gloo ranks (CPU processes) with a deadline; collect what each returns.

    from _dist import run_ranks          # tests/ is on sys.path under pytest

    def body(rank: int, world_size: int, n: int) -> float:   # module level: it is pickled
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.sum().item()

    results = run_ranks(body, 2, 3, timeout=120)   # [3.0, 3.0], one entry per rank

Each rank is a fresh process with the default process group already initialized (gloo, a free
TCP port on localhost) and one intra-op thread (the CI machine has few cores). Ranks are forked
from a fork server that has imported torch and transformers once: a spawned rank spent about 8 s
of CPU importing them (tests/test_parallel_dist.py took 159 s with spawned ranks, 40 s forked, on
a 2-core EPYC). Each rank takes the caller's environment and its stdout / stderr at its start, as
a spawned process would (tests/test_dist_harness.py). `fn` is
called as `fn(rank, world_size, *args)`; its return value must be picklable (tensors included:
they come back by value). When a rank raises,
the other ranks are killed and `RankError` is raised with that rank's traceback; when the
deadline passes, the unfinished ranks print every thread's stack to stderr, then every rank is
killed and `TimeoutError` is raised. No rank can outlive the call. Several threads may call it at
once (each call has its own ranks, port and queue).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any
from unittest import mock

import torch.multiprocessing as mp

# Imported once by the fork server; a rank imports the rest (grouped_ep included: it reads
# GROUPED_EP_BACKEND at import, which a test may set) after taking the caller's environment.
_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers.modeling_utils",
    "safetensors.torch",
]


_START = threading.Lock()
_started = False


def _context():
    """The fork server's context, the server started on the first call with the devices of a GPU
    machine hidden (see `run_ranks`): it must not have touched CUDA before forking a rank."""
    global _started
    with _START:
        ctx = mp.get_context("forkserver")
        if not _started:
            ctx.set_forkserver_preload(_PRELOAD)
            with mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES=""):
                forkserver.ensure_running()
            _started = True
        return ctx


class _Caller:
    """The caller's environment and stdout / stderr, adopted by a rank when it is unpickled
    (first of its arguments, so before the test's module is imported). A fork server's child
    otherwise has the server's, fixed when the server started."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __reduce__(self):
        from multiprocessing import reduction

        return (_adopt, (self.env, reduction.DupFd(1), reduction.DupFd(2)))


def _adopt(env: dict[str, str], out, err) -> None:
    for fd, dup in ((1, out), (2, err)):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)
    os.environ.clear()
    os.environ.update(env)


class RankError(RuntimeError):
    """A rank raised; the message holds its rank and traceback."""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    caller: None,  # a _Caller: adopted when unpickled, None here
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable,
    args: tuple,
    results,
) -> None:
    import torch
    import torch.distributed as dist

    os.setpgrp()  # its own process group: killing the group also ends anything it started
    # On a timeout run_ranks sends SIGUSR1 first: every thread's stack goes to stderr (which
    # pytest shows with the failure), so a hang says where each rank was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        # Plain pickle, not the queue's: tensors travel as bytes instead of shared-memory
        # handles that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill_group(p) -> None:
    """SIGKILL rank `p`'s process group (each rank leads its own, see `_worker`)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p.is_alive():  # killed before it could call setpgrp: still in our group
        p.kill()


def _dump_stacks(procs: list) -> None:
    """Ask each live rank in `procs` to print its threads' stacks (see `_worker`); wait briefly."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(2)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        args: picklable extra arguments, the same for every rank.
        timeout: seconds for the whole run (startup included) before every rank is killed.

    Returns:
        A list with rank r's return value at index r.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    # The ranks are gloo processes on CPU: a GPU machine's devices are hidden from them (make_mesh
    # and load_sharded would otherwise default to cuda there), so they run as they do in CI. The
    # fork server, started by the first call, has them hidden too.
    # os.environ itself is left alone: run_ranks may be called from several threads at once.
    caller = _Caller(dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    procs = [
        ctx.Process(
            target=_worker,
            args=(caller, rank, world_size, port, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                _dump_stacks([procs[r] for r in missing])
                raise TimeoutError(
                    f"run_ranks({fn.__name__}): ranks {missing} did not finish within {timeout} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in values and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead and results.empty():
                    raise RankError(
                        f"run_ranks({fn.__name__}): rank {dead[0]} died with exit code "
                        f"{procs[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            if not ok:
                raise RankError(f"run_ranks({fn.__name__}): rank {rank} raised:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0)
            if p.is_alive() or p.exitcode is not None:
                _kill_group(p)
                p.join(timeout=5)
        results.close()
    return [values[r] for r in range(world_size)]
