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
