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

from grouped_ep._validate import canonical_device

# (atol, rtol) per dtype for `assert_close_to`: each element may be off by
# atol * scale + rtol * |ref|, where scale is local (the element's row, or its expert's slice).
#
# Why these numbers. The fp64 references are computed from the same already-rounded
# bf16/fp16 inputs the kernel reads, so input rounding cancels out; and the products of two
# bf16/fp16 values are exact in fp32. What a correct kernel (fp32 accumulation) adds is:
#   - fp32 accumulation error, about sqrt(K) * 2^-24 of the local scale: negligible;
#   - one rounding of the fp32 result to the output dtype: at most u * |ref| with
#     round-to-nearest, u = 2^-8 (bf16) or 2^-11 (fp16); one ulp = 2u with round-toward-zero.
# So rtol = 2u covers the output rounding even with truncation, and atol = u/2 of the local
# scale covers the accumulation error a thousand times over and elements near zero. A kernel
# that keeps its accumulator in bf16/fp16 rounds once per k step (or per k tile): the running
# sum is ~sqrt(k) times a term, so the error grows like u * sqrt(K) of the scale. Simulated on
# unit-scale random data (/tmp check, T=512, N=96), max |err| / allowed:
#   correct (fp32 acc, RN output): 0.38; correct but RZ output: 0.77 (bf16);
#   bf16/fp16 accumulator rounded every k step: ~15 at K=256, ~30 at K=1024;
#   rounded every 16-k MMA step: ~4 at K=256; every 64-k tile: ~1.5 at K=256, ~3 at K=1024.
# (Short reductions, K ~ 64, give a broken accumulator too few roundings to be caught.)
# fp32 runs the fp32 fallback (no TF32): error ~ sqrt(K) * 2^-24, far below 1e-4.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2.0**-9, 2.0**-7),  # (u/2, 2u), u = 2^-8
    torch.float16: (2.0**-12, 2.0**-10),  # (u/2, 2u), u = 2^-11
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
    """Compares against an fp64 reference: |out - ref| <= atol * scale + rtol * |ref| elementwise,
    with (atol, rtol) = TOLERANCE[dtype] and a local scale, max(1, max |ref|) over each index of
    dim 0: per row of a 2-D [T, N] result (forward output, dx), per expert of a 3-D [E, K, N]
    result (dw). A whole-tensor scale would let one big group (skewed routing) loosen the check
    on every small one."""
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    got, ref = out.double(), ref.double().to(out.device)
    mag = ref.abs()
    if ref.ndim >= 2:
        scale = mag.flatten(1).amax(1).clamp_min(1.0).view(-1, *([1] * (ref.ndim - 1)))
    else:
        scale = mag.max().clamp_min(1.0)
    allowed = atol * scale + rtol * mag
    err = (got - ref).abs()
    bad = ~(err <= allowed)  # NaN counts as bad
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    ratio = (err / allowed).nan_to_num(nan=float("inf"))
    flat = int(ratio.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ref.shape))
    raise AssertionError(
        f"{what}: {n_bad} of {ref.numel()} elements off by more than "
        f"atol={atol:.3g} * local scale + rtol={rtol:.3g} * |ref| ({dtype}); worst at {idx}: "
        f"got {float(got[idx]):.6g}, expected {float(ref[idx]):.6g}, "
        f"|err| {float(err[idx]):.3g} vs allowed {float(allowed[idx]):.3g} "
        f"(scale {float(scale.expand_as(ref)[idx]):.4g}, {float(ratio[idx]):.3g}x)"
    )


@contextlib.contextmanager
def poisoned_pool(device: torch.device | str) -> Iterator[list[tuple[int, int]]]:
    """Routes this thread's CUDA allocations to a fresh private pool whose memory is all NaN.

    The pool holds one small-pool segment (2 MiB, for allocations up to 1 MiB) and one large one
    (20 MiB), each filled with NaN and freed before the body runs, so any tensor allocated inside
    the body of at most 20 MiB starts as NaN. Yields the segments as (start, end) addresses, to
    check that an output really came from them.
    """
    device = canonical_device(device)  # torch 2.11's use_mem_pool refuses "cuda" (no index)
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
