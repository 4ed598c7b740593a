"""compute-sanitizer over the CUDA grouped GEMM: memcheck, racecheck, synccheck and initcheck.

One sanitizer process per tool runs a small case of every backend (cutlass, torch, fallback),
dtype and layout, forward and both gradients, with valid, empty and out-of-range `offs`.
Skipped without a GPU; on a GPU machine a missing compute-sanitizer is a failure. The initcheck
report parser is tested on CPU, with report lines from the H200 run.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap

import pytest
import torch

from grouped_ep._subprocess import run as run_group

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_SCRIPT = textwrap.dedent(
    """
    import torch, grouped_ep
    dev = "cuda"
    # Our own kernels first (fallback, then the setup kernel before each CUTLASS launch): under
    # initcheck their reports, if any, come before the CUTLASS kernels' and are printed.
    for backend in ("fallback", "cutlass", "torch"):
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


def _run(tool: str, *options: str):
    # Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees any
    # access past a tensor's end (inside a cached block it could not), and initcheck sees reads
    # of memory that nothing wrote since its allocation.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env.pop("GROUPED_EP_BACKEND", None)
    cmd = [_sanitizer(), "--tool", tool, "--error-exitcode", "3", *options]
    proc = run_group([*cmd, sys.executable, "-c", _SCRIPT], capture=True, timeout=600, env=env)
    report = proc.stdout + proc.stderr
    # The first reports name the kernel and access; the end has the summary.
    shown = report if len(report) < 8000 else report[:5000] + "\n[...]\n" + report[-3000:]
    if "sanitizer-case-done" not in report:  # a crash or a refused option, not a finding
        raise RuntimeError(f"the {tool} run did not finish its script:\n{shown}")
    return proc, report, shown


@pytest.mark.cuda
@needs_gpu
@pytest.mark.timeout(500)  # with pytest-timeout (GPU runs): instrumented runs are slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_clean(tool):
    proc, report, shown = _run(tool)
    assert proc.returncode == 0, shown
    summary = (
        "RACECHECK SUMMARY: 0 hazards displayed"
        if tool == "racecheck"
        else "ERROR SUMMARY: 0 errors"
    )
    assert summary in report, shown


# initcheck on an H200 (2026-11-26) reported 118,942 4-byte "uninitialized global reads" for this
# script, all it printed in the consumer warp groups of CUTLASS sm90 pointer-array kernels, each
# warp reading 32 consecutive words (a 128-byte TMA descriptor), and torch._grouped_mm's own
# CUTLASS kernel the same way (bench/results/nvidia-h200-20261126-gpu-session.md). So reports in
# those kernels are accepted, and any other kernel's report fails. This exact form of the test
# has not run on a GPU yet (the run used the same script, every error counted).
_KNOWN_INITCHECK_KERNELS = (
    # ours (csrc/cuda/sm90_grouped.cuh) and torch's (ATen's enable_3x_kernel_for_sm9x wrapper)
    "cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape",
    "cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape",
)


def unexplained_initcheck_reports(report: str) -> list[str]:
    """The kernels of the printed initcheck reports that are not the known CUTLASS pointer-array
    kernels (one entry per report, the kernel name cut at 200 characters)."""
    out = []
    for line in report.splitlines():
        line = line.strip().removeprefix("=========").strip()
        if not line.startswith("at "):
            continue
        kernel = line.removeprefix("at ").removeprefix("void ")
        if not kernel.startswith(_KNOWN_INITCHECK_KERNELS):
            out.append(kernel[:200])
    return out


@pytest.mark.cuda
@needs_gpu
@pytest.mark.timeout(500)
def test_compute_sanitizer_initcheck_only_known_cutlass_reports():
    proc, report, shown = _run("initcheck", "--print-limit", "400", "--show-backtrace", "no")
    assert "ERROR SUMMARY:" in report, shown
    bad = unexplained_initcheck_reports(report)
    assert not bad, f"initcheck reports in {len(bad)} accesses of other kernels: {bad[:5]}"
    if proc.returncode != 0:  # the known reports: say how many, so a change shows in the log
        print([line for line in report.splitlines() if "ERROR SUMMARY" in line][:1])


# Report lines as compute-sanitizer printed them on the H200 (kernel names cut after the prefix
# that matters), and one of our own kernels, which must not pass.
_OURS = (
    "=========     at void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::"
    "gemm::GroupProblemShape<cute::tuple<int, int, int>>, cutlass::gemm::collective::"
    "CollectiveMma<...>>(T1::Params)+0x3650"
)
_TORCHS = (
    "=========     at void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<"
    "cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int,"
    " int>>, cutlass::gemm::collective::CollectiveMma<...>>>(T1::Params)+0x3970"
)
_OTHER = (
    "=========     at void grouped_ep::cuda::fallback::fwd_kernel<float, int>(grouped_ep::cuda::"
    "FallbackParams)+0x1f0"
)


def test_initcheck_report_parser():
    head = "========= COMPUTE-SANITIZER\n========= Uninitialized __global__ memory read of size 4 bytes\n"
    tail = "\n=========     by thread (128,0,0) in block (0,0,0)\n=========     Address 0x7f2a58810800\n"
    known = head + _OURS + tail + head + _TORCHS + tail + "========= ERROR SUMMARY: 2 errors\n"
    assert unexplained_initcheck_reports(known) == []
    got = unexplained_initcheck_reports(known + head + _OTHER + tail)
    assert len(got) == 1 and got[0].startswith("grouped_ep::cuda::fallback::fwd_kernel"), got
    assert unexplained_initcheck_reports("========= ERROR SUMMARY: 0 errors\n") == []
