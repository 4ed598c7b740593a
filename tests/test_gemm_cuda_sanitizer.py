"""compute-sanitizer over the CUDA grouped GEMM: memcheck, racecheck, synccheck and initcheck.

One sanitizer process per tool runs a small case of every backend (cutlass, torch, fallback),
dtype and layout, forward and both gradients, with valid, empty and out-of-range `offs`.
Skipped without a GPU; on a GPU machine a missing compute-sanitizer is a failure.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap

import pytest
import torch

from grouped_ep._subprocess import run as run_group

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_SCRIPT = textwrap.dedent(
    """
    import torch, grouped_ep
    dev = "cuda"
    for backend in ("cutlass", "torch", "fallback"):
        print(f"== backend {backend}", flush=True)  # between the sanitizer's reports
        grouped_ep.set_backend(backend)
        for dtype, k, n in [(torch.bfloat16, 64, 32), (torch.float16, 16, 8),
                            (torch.bfloat16, 136, 264), (torch.float32, 24, 16),
                            (torch.bfloat16, 13, 7)]:
            for offs in ([5, 5, 40, 41], [0, 0, 0, 0], [7, 3, 100, 2]):  # the last is clamped
                offs = torch.tensor(offs, dtype=torch.int32, device=dev)
                x = torch.randn(45, k, device=dev).to(dtype).requires_grad_(True)
                for trans_w in (False, True):
                    shape = (4, n, k) if trans_w else (4, k, n)
                    w = torch.randn(shape, device=dev).to(dtype).requires_grad_(True)
                    out = grouped_ep.gemm(x, w, offs, trans_w=trans_w)
                    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    print("sanitizer-case-done")
    """
)


def _sanitizer() -> str:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        from torch.utils.cpp_extension import CUDA_HOME

        in_toolkit = os.path.join(CUDA_HOME or "", "bin", "compute-sanitizer")
        if CUDA_HOME and os.access(in_toolkit, os.X_OK):
            exe = in_toolkit
    if exe is None:
        pytest.fail(
            "compute-sanitizer was found neither on PATH nor in $CUDA_HOME/bin "
            f"(CUDA_HOME={os.environ.get('CUDA_HOME')!r}); it ships with the CUDA toolkit and "
            "must be installed on GPU machines: put the toolkit's bin directory on PATH"
        )
    return exe


# initcheck, on an H200 (2026-11-26): 118,942 reports of a 4-byte "uninitialized global read" by
# the consumer warp groups of the CUTLASS sm90 pointer-array kernel, each warp reading 32
# consecutive words: a 128-byte TMA descriptor. torch._grouped_mm's own CUTLASS kernel gives the
# same reports (bench/results/nvidia-h200-20261126-gpu-session.md). Every output was right
# (NaN-poisoned outputs, 367 GPU tests) and memcheck, racecheck and synccheck were clean. Strict:
# a run where initcheck comes out clean fails here, so the mark is taken off then.
INITCHECK = pytest.param(
    "initcheck",
    marks=pytest.mark.xfail(
        strict=True,
        reason="initcheck flags the tensormap reads of CUTLASS sm90 ptr-array kernels (torch's too)",
    ),
)


@pytest.mark.timeout(500)  # with pytest-timeout (GPU runs): instrumented runs are slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck", INITCHECK])
def test_compute_sanitizer_clean(tool):
    # Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees any
    # access past a tensor's end (inside a cached block it could not), and initcheck sees reads
    # of memory that nothing wrote since its allocation.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env.pop("GROUPED_EP_BACKEND", None)
    cmd = [_sanitizer(), "--tool", tool, "--error-exitcode", "3"]
    proc = run_group([*cmd, sys.executable, "-c", _SCRIPT], capture=True, timeout=600, env=env)
    report = proc.stdout + proc.stderr
    # The first reports name the kernel and access; the end has the summary.
    shown = report if len(report) < 8000 else report[:5000] + "\n[...]\n" + report[-3000:]
    assert "sanitizer-case-done" in report, shown
    assert proc.returncode == 0, shown
    summary = (
        "RACECHECK SUMMARY: 0 hazards displayed"
        if tool == "racecheck"
        else "ERROR SUMMARY: 0 errors"
    )
    assert summary in report, shown
