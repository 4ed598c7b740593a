"""Shared helpers for the grouped GEMM tests: fp64 references, tolerances, group-size patterns,
and a poisoned CUDA memory pool that proves every output element is written.

Importable from any test (`from _cuda_helpers import ...`); nothing here needs a GPU to import.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from torch import Tensor

# (atol, rtol) per dtype, relative to the reference's scale (see `assert_close_to`). Low-precision
# outputs carry one rounding of the fp32 accumulator (bf16: 2^-8, fp16: 2^-11 relative).
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (3e-3, 3e-3),
}

# Named group-size patterns (the test ids): each maps (E, rng) to E sizes.
PATTERNS = ("balanced", "empty_group", "one_row", "odd", "skewed", "all_empty", "random")


def group_sizes(pattern: str, groups: int, rng: random.Random) -> list[int]:
    """E group sizes for a named pattern."""
    if pattern == "balanced":
        return [64] * groups
    if pattern == "empty_group":
        return [0 if g % 3 == 1 else 40 + g for g in range(groups)]
    if pattern == "one_row":
        return [1] * groups
    if pattern == "odd":
        return [2 * rng.randrange(0, 50) + 1 for _ in range(groups)]
    if pattern == "skewed":  # one expert gets most tokens, most get none or a few
        sizes = [rng.choice((0, 0, 1, 3)) for _ in range(groups)]
        sizes[rng.randrange(groups)] = 1000 + rng.randrange(100)
        return sizes
    if pattern == "all_empty":
        return [0] * groups
    if pattern == "random":
        return [rng.randrange(0, 200) for _ in range(groups)]
    raise ValueError(f"unknown group-size pattern {pattern!r}")


def make_offs(
    sizes: list[int], device: torch.device | str, dtype: torch.dtype = torch.int32
) -> Tensor:
    """[E] cumulative end offsets from group sizes."""
    ends, total = [], 0
    for s in sizes:
        total += s
        ends.append(total)
    return torch.tensor(ends, dtype=dtype, device=device)


def _bounds(offs: Tensor) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs.tolist()]
    return [(ends[g - 1] if g else 0, e) for g, e in enumerate(ends)]


def reference_gemm(x: Tensor, w: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    """fp64 per-group loop: [T, N]; rows past offs[-1] are zero. offs must be valid."""
    n = w.shape[1] if trans_w else w.shape[2]
    out = torch.zeros(x.shape[0], n, dtype=torch.float64, device=x.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        w_g = w[g].double()
        out[s:e] = x[s:e].double() @ (w_g.t() if trans_w else w_g)
    return out


def reference_wgrad(x: Tensor, dy: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    """fp64 per-group loop: [E, K, N] (x_g^T dy_g), or [E, N, K] (dy_g^T x_g) with trans_w."""
    a, b = (dy, x) if trans_w else (x, dy)
    out = torch.zeros(offs.shape[0], a.shape[1], b.shape[1], dtype=torch.float64, device=x.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[g] = a[s:e].double().t() @ b[s:e].double()
    return out


def clamp_offs(offs: Tensor, rows: int) -> Tensor:
    """What the CUDA kernels do with bad offs: running max, clamped to [0, rows]."""
    return torch.cummax(offs.long(), 0).values.clamp(0, rows).to(offs.dtype)


def assert_close_to(out: Tensor, ref: Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Compares against an fp64 reference with the dtype's tolerance, scaled by the reference's
    largest magnitude (sums of many products grow with the reduction length)."""
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(
        out.double(), ref.double(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


@contextlib.contextmanager
def poisoned_pool(device: torch.device | str) -> Iterator[list[tuple[int, int]]]:
    """Routes this thread's CUDA allocations to a fresh private pool whose memory is all NaN.

    The pool holds one small-pool segment (2 MiB, for allocations up to 1 MiB) and one large one
    (20 MiB), each filled with NaN and freed before the body runs, so any tensor allocated inside
    the body of at most 20 MiB starts as NaN. Yields the segments as (start, end) addresses, to
    check that an output really came from them.
    """
    device = torch.device(device)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device=device):
        mib = 1 << 20
        fills = [
            torch.full((mib // 4,), float("nan"), device=device),  # two 1 MiB blocks fill
            torch.full((mib // 4,), float("nan"), device=device),  # the 2 MiB small segment
            torch.full((20 * mib // 4,), float("nan"), device=device),  # one whole large segment
        ]
        torch.cuda.synchronize(device)
        segments = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in fills]
        small = (min(segments[0][0], segments[1][0]), max(segments[0][1], segments[1][1]))
        spans = [small, segments[2]]
        del fills
        yield spans


def assert_in_poisoned(t: Tensor, spans: list[tuple[int, int]]) -> None:
    """Checks the poisoning took: `t`'s memory lies in one of the NaN segments."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    assert any(s <= start and end <= e for s, e in spans), (
        "test setup: the output was not allocated from the NaN-poisoned pool"
    )
