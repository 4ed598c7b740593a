"""`python -m grouped_ep check`: every built backend against an fp64 reference on this device.

Builds nothing and needs no network: it imports the built extension, runs a small grouped GEMM
(an empty group, unaligned group sizes, rows past ``offs[-1]``) per backend, dtype and layout,
and prints one row each: backend, dtype, layout, max error, pass/fail. A row whose backend
cannot run the case (say ``torch`` for fp16) says which backend ran instead and why, and is
checked all the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grouped_ep.backend import BACKENDS, backend_for, backend_info, get_backend, set_backend

# Max error allowed, relative to the largest |reference| element of the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("w_kn", "w_nk", "wgrad")
SIZES = (5, 0, 17, 9)  # group 1 is empty; 3 rows past offs[-1]
TAIL, K, N = 3, 64, 48


@dataclass(frozen=True)
class CheckRow:
    """One checked case. ``ran`` is the backend that actually ran it."""

    backend: str
    ran: str
    dtype: str
    layout: str
    max_error: float  # relative to max |reference|; inf when exact zeros were not exact
    passed: bool
    note: str = ""


def _reference(x: torch.Tensor, w: torch.Tensor, layout: str, dy: torch.Tensor) -> torch.Tensor:
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    outs, start = [], 0
    for g, size in enumerate(SIZES):
        rows = slice(start, start + size)
        if layout == "wgrad":
            outs.append(x64[rows].T @ dy64[rows])
        else:
            wg = w64[g].T if layout == "w_nk" else w64[g]
            outs.append(x64[rows] @ wg)
        start += size
    if layout == "wgrad":
        return torch.stack(outs)
    return torch.cat([*outs, torch.zeros(TAIL, N, dtype=torch.float64, device=x.device)])


def _run_case(backend: str, dtype: torch.dtype, layout: str, device: torch.device) -> CheckRow:
    seed = 10 * DTYPES.index(dtype) + LAYOUTS.index(layout)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(SIZES) + TAIL
    x = torch.randn(t, K, generator=gen).to(device=device, dtype=dtype)
    shape = (len(SIZES), N, K) if layout == "w_nk" else (len(SIZES), K, N)
    w = (torch.randn(shape, generator=gen) / K**0.5).to(device=device, dtype=dtype)
    dy = torch.randn(t, N, generator=gen).to(device=device, dtype=dtype)
    offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    if layout == "wgrad":
        out = torch.ops.grouped_ep.gemm_wgrad(x, dy, offs, False)
    else:
        out = torch.ops.grouped_ep.gemm(x, w, offs, layout == "w_nk")
    ref = _reference(x, w, layout, dy)
    # Rows past offs[-1] and the empty group's gradient must be exact zeros, not just small.
    zeros = out[1] if layout == "wgrad" else out[sum(SIZES) :]
    exact = bool((zeros == 0).all())
    scale = ref.abs().max().item() or 1.0
    err = (out.double() - ref).abs().max().item() / scale if exact else float("inf")
    ran, why = (backend, "") if device.type == "cpu" else backend_for(dtype, K, N, device)
    note = "" if ran == backend else why
    if not exact:
        note = "rows that must be exact zeros are not"
    passed = exact and err <= TOLERANCE[dtype]
    return CheckRow(backend, ran, str(dtype).removeprefix("torch."), layout, err, passed, note)


def run_checks(device: torch.device | None = None) -> list[CheckRow]:
    """Run every built backend on ``device`` (default: the current CUDA device, else CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda" and "cutlass" in backend_info().built
    backends = BACKENDS if on_cuda else ("cpu",)
    if device.type == "cuda" and not on_cuda:
        raise RuntimeError("grouped_ep check: this build has no CUDA kernels (CPU-only build)")
    previous = get_backend()
    rows = []
    try:
        for backend in backends:
            if on_cuda:
                set_backend(backend)
            for dtype in DTYPES:
                for layout in LAYOUTS:
                    rows.append(_run_case(backend, dtype, layout, device))
    finally:
        set_backend(previous)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


def format_rows(rows: list[CheckRow]) -> str:
    """The table `python -m grouped_ep check` prints."""
    head = f"{'backend':<9} {'ran':<9} {'dtype':<9} {'layout':<6} {'max error':>10}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.backend:<9} {r.ran:<9} {r.dtype:<9} {r.layout:<6} {r.max_error:>10.2e}  "
            f"{'pass' if r.passed else 'FAIL'}" + (f"  ({r.note})" if r.note else "")
        )
    return "\n".join(lines)
