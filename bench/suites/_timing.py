"""Shared timing: median of repeated runs after warm-up (CUDA events on the GPU)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def _seconds(fn: Callable[[], object], cuda: bool) -> float:
    """Wall time of one call of `fn` (CUDA events around it on the GPU)."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    device: str,
    reps: int = 10,
    warmup: int = 2,
    budget_s: float | None = None,
    min_s: float | None = None,
    max_reps: int = 60,
) -> dict[str, float | Exception]:
    """Median wall time of each callable, timed in rounds (one call of each per round), so a
    machine that slows down for a while slows every method alike instead of the one being timed
    then: ratios between them stay honest on a shared machine. With `budget_s` (CPU), a method
    so slow that its repeats would pass the budget is timed fewer times (at least once). With
    `min_s` (CPU), the rounds go on past `reps` (up to `max_reps`) until the fastest method has
    run for about `min_s` seconds: a millisecond call timed 5 times on a shared 2-core machine
    gives a median that moves by 10% or more from run to run.

    A callable that raises RuntimeError or NotImplementedError is reported as the exception
    instead of a time."""
    cuda = device.startswith("cuda")
    left: dict[str, int] = {}
    firsts: dict[str, float] = {}
    out: dict[str, list[float] | Exception] = {}
    for name, fn in fns.items():
        try:
            t0 = time.perf_counter()
            fn()  # first warm-up call, also the cost estimate
            first = time.perf_counter() - t0
            n = reps
            if budget_s is not None and not cuda and first > 0:
                n = max(1, min(reps, int(budget_s / first)))
            for _ in range(warmup - 1 if n == reps else 0):
                fn()
            left[name] = n
            out[name] = []
            firsts[name] = first
        except (RuntimeError, NotImplementedError) as e:
            out[name] = e
    if min_s is not None and not cuda and firsts:
        # Extra rounds, sized by the fastest method; a slower one takes part in them only up to
        # about 2 * min_s of its own time (its longer calls vary less from call to call).
        rounds = min(max_reps, max(reps, math.ceil(min_s / max(min(firsts.values()), 1e-6))))
        for name in left:
            own = int(2 * min_s / max(firsts[name], 1e-6))
            left[name] = max(left[name], min(rounds, own))
    while any(left.values()):
        for name, fn in fns.items():
            if left.get(name):
                out[name].append(_seconds(fn, cuda))
                left[name] -= 1
    return {k: v if isinstance(v, Exception) else statistics.median(v) for k, v in out.items()}


def median_seconds(
    fn: Callable[[], object],
    device: str,
    reps: int = 10,
    warmup: int = 2,
    budget_s: float | None = None,
) -> float:
    """Median wall time of `reps` calls of `fn` after `warmup` calls (interleaved_medians of one
    callable; its error is raised)."""
    got = interleaved_medians({"fn": fn}, device, reps, warmup, budget_s)["fn"]
    if isinstance(got, Exception):
        raise got
    return got
