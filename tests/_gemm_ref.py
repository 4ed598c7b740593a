"""Plain-PyTorch reference for the grouped GEMM ops and the shared tolerance table."""

from __future__ import annotations

import torch

# One tolerance table per dtype (atol, rtol), for outputs of magnitude ~1 (inputs are scaled so).
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

# Group-size patterns, named for the edge case each exercises. `tail` rows follow offs[-1].
GROUP_PATTERNS = {
    "balanced": ([16] * 8, 0),
    "empty_group": ([5, 0, 7, 0, 3], 0),
    "all_empty": ([0, 0, 0], 6),
    "single_group": ([37], 0),
    "unaligned": ([1, 7, 13, 3, 29], 0),
    "skewed": ([97, 1, 0, 2, 40, 0, 0, 5], 0),
    "tail_rows": ([4, 9, 2], 11),
    "groups_256": (None, 3),  # 256 groups of random sizes 0..4, made by make_case
}


def offsets(sizes: list[int], dtype=torch.int32, device="cpu") -> torch.Tensor:
    """Cumulative end offsets of `sizes`: [E]."""
    ends, total = [], 0
    for s in sizes:
        total += s
        ends.append(total)
    return torch.tensor(ends, dtype=dtype, device=device)


def make_case(pattern: str, k: int, n: int, dtype, trans_w: bool, device="cpu", seed: int = 0):
    """x [T, K], w [E, K, N] (or [E, N, K]), offs [E] for a named group pattern."""
    g = torch.Generator().manual_seed(seed)
    sizes, tail = GROUP_PATTERNS[pattern]
    if sizes is None:
        sizes = torch.randint(0, 5, (256,), generator=g).tolist()
    t = sum(sizes) + tail
    x = torch.randn(t, k, generator=g, dtype=torch.float64) / k**0.5
    w = torch.randn(len(sizes), k, n, generator=g, dtype=torch.float64)
    if trans_w:
        w = w.transpose(1, 2).contiguous()
    return x.to(dtype).to(device), w.to(dtype).to(device), offsets(sizes, device=device)


def gemm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, trans_w: bool = False):
    """Per-group loop in fp64: [T, N]; rows past offs[-1] are zero."""
    x64, w64 = x.double(), w.double()
    n = w.shape[1] if trans_w else w.shape[2]
    out = torch.zeros(x.shape[0], n, dtype=torch.float64, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        w_g = w64[g].t() if trans_w else w64[g]
        out[start:end] = x64[start:end] @ w_g
        start = end
    return out


def wgrad_ref(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, trans_w: bool = False):
    """Per-group x_g^T dy_g ([E, K, N]) or dy_g^T x_g ([E, N, K]) in fp64."""
    x64, dy64 = x.double(), dy.double()
    outs, start = [], 0
    for end in offs.tolist():
        a, b = x64[start:end], dy64[start:end]
        outs.append(b.t() @ a if trans_w else a.t() @ b)
        start = end
    k, n = x.shape[1], dy.shape[1]
    shape = (0, n, k) if trans_w else (0, k, n)
    return torch.stack(outs) if outs else torch.zeros(shape, dtype=torch.float64)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, scale: float = 1.0):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=atol * scale, rtol=rtol
    )
