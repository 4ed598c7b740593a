"""Shared timing: median of repeated runs after warm-up (CUDA events on the GPU)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    fn: Callable[[], object],
    device: str,
    reps: int = 10,
    warmup: int = 2,
    budget_s: float | None = None,
) -> float:
    """Median wall time of `reps` calls of `fn` after `warmup` calls. With `budget_s` (CPU), a
    call so slow that warm-up plus repeats would pass the budget cuts both down (at least one
    warm-up call and one timed call)."""
    if budget_s is not None and not device.startswith("cuda"):
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        if first > 0:
            fit = int(budget_s / first)
            warmup = min(warmup - 1, max(0, fit - reps))
            reps = max(1, min(reps, fit))
        else:
            warmup -= 1
    for _ in range(max(0, warmup)):
        fn()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    device: str,
    reps: int = 10,
    warmup: int = 2,
    budget_s: float | None = None,
) -> dict[str, float]:
    """Median wall time of each callable, timed in rounds (one call of each per round), so a
    machine that slows down for a while slows every method alike instead of the one being timed
    then: ratios between them stay honest on a shared machine. With `budget_s` (CPU), a method
    so slow that its repeats would pass the budget is timed fewer times (at least once).

    A callable that raises is reported as the exception instead of a time."""
    cuda = device.startswith("cuda")
    left: dict[str, int] = {}
    out: dict[str, object] = {}
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
        except (RuntimeError, NotImplementedError) as e:
            out[name] = e
    while any(left.values()):
        for name, fn in fns.items():
            if not left.get(name):
                continue
            if cuda:
                torch.cuda.synchronize()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                out[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - t0)
            left[name] -= 1
    return {k: v if isinstance(v, Exception) else statistics.median(v) for k, v in out.items()}
