"""Backend choice of the CUDA grouped GEMM (grouped_ep.backend, csrc/cuda/backend.cpp) and the
`python -m grouped_ep check` command.

What runs without a GPU is tested here on any machine: set_backend validation, the
GROUPED_EP_BACKEND variable, backend_info on the build at hand, and the check command on CPU.
The tests marked `cuda` need a GPU (they skip without one): the default policy on the device,
the torch backend's guarantees (zeros, clamped offs, no host sync), the fallback's N limit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import grouped_ep
from grouped_ep import backend as be
from grouped_ep import selfcheck
from grouped_ep.__main__ import main

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _reset_backend():
    yield
    grouped_ep.set_backend(None)


# ---- without a GPU -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cutlass", "torch", "fallback", "auto"])
def test_set_backend_round_trip(name):
    grouped_ep.set_backend(name)
    assert be.get_backend() == name
    assert grouped_ep.backend_info().requested == name
    grouped_ep.set_backend(None)
    assert be.get_backend() == "auto"


@pytest.mark.parametrize("bad", ["cublas", "", "CUTLASS2"])
def test_set_backend_rejects_unknown_names(bad):
    grouped_ep.set_backend("torch")
    with pytest.raises(ValueError, match=r"set_backend\(name\).*'auto', 'cutlass'"):
        grouped_ep.set_backend(bad or " ")
    assert be.get_backend() == "torch"  # a rejected name changes nothing


def test_set_backend_rejects_non_strings():
    with pytest.raises(ValueError, match="name must be a str"):
        grouped_ep.set_backend(3)  # type: ignore[arg-type]


def test_op_rejects_unknown_names_itself():
    """The C++ op validates too (someone may call torch.ops.grouped_ep.backend_info)."""
    with pytest.raises(ValueError, match="backend must be one of"):
        torch.ops.grouped_ep.backend_info("tensorrt")


@pytest.mark.parametrize(
    "value,expected",
    [(None, None), ("", None), ("  ", None), ("torch", "torch"), (" Fallback ", "fallback")],
)
def test_backend_from_env(value, expected):
    environ = {} if value is None else {be.ENV_VAR: value}
    assert be.backend_from_env(environ) == expected


def test_backend_from_env_names_the_variable():
    with pytest.raises(ValueError, match=r"GROUPED_EP_BACKEND='cutless'"):
        be.backend_from_env({be.ENV_VAR: "cutless"})


def _import_with_env(value: str) -> subprocess.CompletedProcess:
    code = "import grouped_ep, grouped_ep.backend as b; print(b.get_backend())"
    env = dict(os.environ, GROUPED_EP_BACKEND=value, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_env_var_is_applied_at_import():
    proc = _import_with_env("fallback")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "fallback"


def test_bad_env_var_fails_the_import_naming_it():
    proc = _import_with_env("fast")
    assert proc.returncode != 0
    assert "GROUPED_EP_BACKEND='fast'" in proc.stderr


def test_backend_info_describes_this_build():
    info = grouped_ep.backend_info()
    built_cuda = torch.ops.grouped_ep.backend_info()[1] == "built_cuda=1"
    assert info.requested == "auto"
    if built_cuda:
        assert info.built == ("cpu", "cutlass", "torch", "fallback")
        assert info.cuda_arch_list and info.cuda_arch_list != "unknown"
        assert len(info.devices) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    else:
        assert info.built == ("cpu",)
        assert info.cuda_arch_list is None and info.devices == ()
    text = str(info)
    assert "requested backend: auto" in text and "built: cpu" in text


def test_backend_for_says_cpu_only_without_a_gpu():
    ran, reason = be.backend_for(torch.bfloat16, 64, 64)
    built_cuda = torch.ops.grouped_ep.backend_info()[1] == "built_cuda=1"
    if torch.cuda.is_available() and built_cuda:
        assert ran in be.BACKENDS, (ran, reason)
    else:
        assert ran == "cpu", (ran, reason)


def test_check_command_on_cpu(capsys):
    assert main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("cpu ")]
    assert len(rows) == len(selfcheck.DTYPES) * len(selfcheck.LAYOUTS)
    assert all(line.rstrip().endswith("pass") for line in rows), out
    assert "all 9 checks passed" in out


def test_check_command_names_a_bad_device(capsys):
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 on none)
    for device, message in (
        ("foo", "--device 'foo'"),
        ("meta", "only cpu and cuda"),
        (missing, "CUDA device(s)"),
    ):
        assert main(["check", "--device", device]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, err


def test_check_rows_measure_real_errors():
    rows = selfcheck.run_checks(torch.device("cpu"))
    assert {(r.dtype, r.layout) for r in rows} == {
        (str(d).removeprefix("torch."), layout)
        for d in selfcheck.DTYPES
        for layout in selfcheck.LAYOUTS
    }
    # Half-precision outputs are rounded: their error is nonzero but within the tolerance.
    for r in rows:
        assert r.passed and r.ran == "cpu"
        if r.dtype != "float32":
            assert 0 < r.max_error <= selfcheck.TOLERANCE[getattr(torch, r.dtype)]


def test_check_command_fails_on_wrong_results(monkeypatch, capsys):
    """The check can fail: forward results 5% off are reported, with exit code 1."""
    real = torch.ops.grouped_ep.gemm

    class Broken:
        def __call__(self, x, w, offs, trans_w=False):
            return real(x, w, offs, trans_w) * 1.05

    monkeypatch.setattr(torch.ops.grouped_ep, "gemm", Broken())
    assert main(["check", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "checks failed" in captured.err


# ---- with a GPU ----------------------------------------------------------------------------


@needs_gpu
def test_default_policy_on_this_gpu():
    """auto: torch where its grouped kernel runs the case, else CUTLASS where it is listed as
    verified for this architecture (sm 9.0 since its GPU tests passed on an H200), else the
    fallback."""
    major, minor = torch.cuda.get_device_capability()
    torch_arch = (major, minor) in ((9, 0), (10, 0))
    dev = grouped_ep.backend_info().devices[torch.cuda.current_device()]
    if (major, minor) == (9, 0) and dev.cutlass_kernels == "sm90a":
        assert dev.cutlass_verified, dev
    other = "cutlass" if dev.cutlass_verified else "fallback"
    assert dev.choices["bf16"][0] == ("torch" if torch_arch else other), dev
    for case in ("fp16", "fp32", "bf16, K or N % 8 != 0"):
        expected = "cutlass" if dev.cutlass_verified and case == "fp16" else "fallback"
        assert dev.choices[case][0] == expected, (case, dev.choices[case])


@needs_gpu
def test_requested_backend_that_cannot_run_a_case_says_why():
    grouped_ep.set_backend("torch")
    ran, reason = be.backend_for(torch.float16, 64, 64)
    assert ran == "fallback" and reason.startswith("torch requested, but")
    grouped_ep.set_backend("cutlass")
    ran, reason = be.backend_for(torch.bfloat16, 60, 64)
    assert ran == "fallback" and "multiples of 8" in reason


@needs_gpu
def test_check_command_on_gpu(capsys):
    assert main(["check"]) == 0, capsys.readouterr().out


@needs_gpu
@pytest.mark.parametrize("backend", ["torch", "cutlass", "fallback"])
def test_guarantees_without_host_sync(backend):
    """Zeros past offs[-1] and for empty groups' gradients, clamped bad offs, no host sync."""
    from _cuda_helpers import clamp_offs, poisoned_pool

    grouped_ep.set_backend(backend)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(50, 64, device="cuda", generator=gen).bfloat16()
    w = torch.randn(4, 64, 32, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(50, 32, device="cuda", generator=gen).bfloat16()
    for offs_list in ([7, 7, 30, 41], [9, 3, 100, 2]):  # the second one is clamped
        offs = torch.tensor(offs_list, dtype=torch.int32, device="cuda")
        ends = clamp_offs(torch.tensor(offs_list), 50).tolist()
        with poisoned_pool("cuda"):  # unwritten output elements would be NaN
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = torch.ops.grouped_ep.gemm(x, w, offs, False)
                dw = torch.ops.grouped_ep.gemm_wgrad(x, dy, offs, False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        start = 0
        for g, end in enumerate(ends):
            ref = x[start:end].double() @ w[g].double()
            torch.testing.assert_close(out[start:end].double(), ref, atol=3e-2, rtol=2e-2)
            if end == start:
                assert (dw[g] == 0).all(), f"{backend}: empty group {g} gradient not zero"
            start = end
        assert (out[ends[-1] :] == 0).all(), f"{backend}: rows past offs[-1] not zero"


@needs_gpu
def test_fallback_has_no_column_limit():
    """N above 65535 tiles of 64 (4,194,240 columns): the grid strides over column tiles."""
    grouped_ep.set_backend("fallback")
    n = 65535 * 64 + 72
    x = torch.randn(6, 16, device="cuda")
    w = torch.randn(2, 16, n, device="cuda")
    offs = torch.tensor([2, 5], dtype=torch.int32, device="cuda")
    out = torch.ops.grouped_ep.gemm(x, w, offs, False)
    ref = torch.cat([x[:2] @ w[0], x[2:5] @ w[1], torch.zeros(1, n, device="cuda")])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    dw = torch.ops.grouped_ep.gemm_wgrad(x, out, offs, False)
    torch.testing.assert_close(dw[1], x[2:5].T @ out[2:5], atol=1e-3, rtol=1e-4)
