"""Which backend runs `torch.ops.grouped_ep.gemm` / `gemm_wgrad` on CUDA, and why.

Backends (CUDA; on CPU the C++ kernels always run):

- ``torch``: torch's own grouped kernel (`torch._grouped_mm`), bf16 on compute capability 9.0
  and 10.0, with K and N multiples of 8. grouped_ep adds its guarantees around it: exact zeros
  for rows past ``offs[-1]`` and for empty groups' weight gradients, clamped ``offs``, no host
  sync, any group size.
- ``cutlass``: this project's CUTLASS kernels (sm90a and sm80), bf16 / fp16, K and N multiples
  of 8.
- ``fallback``: tiled kernels for any dtype, shape and device (PTX, so newer GPUs JIT them).

Default (``auto``): ``torch`` where it runs the case, else ``cutlass`` on architectures where
the GPU tests have passed (compute capability 9.0 with the sm90a kernels: H100 / H200, since
2026-11-26; a build without the ``9.0a`` arch would run the untested sm80 ones there), else
``fallback``. So on Hopper bf16 runs torch's kernel and fp16 runs CUTLASS; fp32 and K or N not
a multiple of 8 run the fallback.
``GROUPED_EP_BACKEND=cutlass|torch|fallback|auto`` (read when grouped_ep is imported) and
:func:`set_backend` override the default; a case the requested backend cannot run still takes
the fallback, and :func:`backend_for` / :func:`backend_info` say so, with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

BACKENDS = ("cutlass", "torch", "fallback")
ENV_VAR = "GROUPED_EP_BACKEND"

# The cases backend_info() reports per device: label -> (dtype, K, N).
CASES: dict[str, tuple[torch.dtype, int, int]] = {
    "bf16": (torch.bfloat16, 64, 64),
    "fp16": (torch.float16, 64, 64),
    "fp32": (torch.float32, 64, 64),
    "bf16, K or N % 8 != 0": (torch.bfloat16, 63, 64),
}


def _query(
    set_backend: str | None = None,
    device: int = -1,
    dtype: torch.dtype | None = None,
    k: int = 0,
    n: int = 0,
) -> dict[str, str]:
    lines = torch.ops.grouped_ep.backend_info(set_backend, device, dtype, k, n)
    return dict(line.split("=", 1) for line in lines)


def _check_name(name: str, where: str) -> str:
    name = name.strip().lower()
    if name not in ("auto", *BACKENDS):
        raise ValueError(
            f"{where}: backend must be one of 'auto', {', '.join(map(repr, BACKENDS))}; "
            f"got {name!r}"
        )
    return name


def set_backend(name: str | None) -> None:
    """Request the backend of the CUDA grouped GEMM ops, process-wide.

    Args:
        name: ``"cutlass"``, ``"torch"``, ``"fallback"``, or ``"auto"`` / ``None`` for the
            default policy. Cases the backend cannot run (dtype, alignment, architecture) still
            run on the fallback; :func:`backend_for` tells which backend a call gets.

    Raises:
        ValueError: naming the argument, for any other name.
    """
    if name is not None and not isinstance(name, str):
        raise ValueError(f"grouped_ep.set_backend: name must be a str or None, got {name!r}")
    _query(set_backend=_check_name(name or "auto", "grouped_ep.set_backend(name)"))


def get_backend() -> str:
    """The requested backend: ``"auto"`` (default), ``"cutlass"``, ``"torch"`` or ``"fallback"``."""
    return _query()["requested"]


def backend_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The backend named by ``GROUPED_EP_BACKEND`` in ``environ`` (default ``os.environ``).

    Returns None when the variable is unset or empty. Raises ValueError naming the variable for
    a value that is not a backend.
    """
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not value.strip():
        return None
    return _check_name(value, f"environment variable {ENV_VAR}={value!r}")


def backend_for(
    dtype: torch.dtype, k: int, n: int, device: int | torch.device | None = None
) -> tuple[str, str]:
    """The backend a CUDA call with this dtype, K and N runs on ``device``, and why.

    For ``gemm(x [T, K], w, offs)`` pass x's K and the output's N; for ``gemm_wgrad`` the
    weight's two trailing dims. Assumes 16-byte aligned tensors (fresh allocations are).

    Returns:
        ``(backend, reason)``, e.g. ``("torch", "default: torch._grouped_mm runs this case")``.
        On a CPU-only build or without a GPU: ``("cpu", ...)``.
    """
    if not torch.cuda.is_available() or _query()["built_cuda"] != "1":
        return "cpu", "no CUDA device or a CPU-only build: the C++ CPU kernels run"
    index = device if isinstance(device, int) else None
    if isinstance(device, torch.device | str):
        index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    info = _query(device=index, dtype=dtype, k=k, n=n)
    return info["backend"], info["reason"]


@dataclass(frozen=True)
class DeviceBackends:
    """What one CUDA device would use.

    ``choices`` maps a case label of :data:`CASES` to ``(backend, reason)``.
    """

    index: int
    name: str
    compute_capability: str
    cutlass_kernels: str  # "sm90a", "sm80" or "none": the CUTLASS kernels this device can run
    cutlass_verified: bool  # the GPU tests passed on this architecture
    choices: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendInfo:
    """What is built, what is requested, and per visible CUDA device what each case uses."""

    requested: str
    built: tuple[str, ...]  # backends compiled in: ("cpu",) or ("cpu", *BACKENDS)
    cuda_arch_list: str | None  # TORCH_CUDA_ARCH_LIST of the build; None for CPU-only
    devices: tuple[DeviceBackends, ...]

    def __str__(self) -> str:
        lines = [
            f"requested backend: {self.requested}",
            f"built: {', '.join(self.built)}"
            + (f" (CUDA archs {self.cuda_arch_list})" if self.cuda_arch_list else ""),
        ]
        if not self.devices:
            lines.append("no CUDA device: the C++ CPU kernels run")
        for d in self.devices:
            lines.append(
                f"cuda:{d.index} {d.name} (sm {d.compute_capability}): CUTLASS kernels "
                f"{d.cutlass_kernels}, {'verified' if d.cutlass_verified else 'not verified'}"
            )
            for case, (backend, reason) in d.choices.items():
                lines.append(f"  {case:<22} -> {backend:<8} {reason}")
        return "\n".join(lines)


def backend_info() -> BackendInfo:
    """What this build contains and which backend each visible CUDA device uses, with reasons.

    Host-side queries only: no kernel runs, nothing syncs.
    """
    base = _query()
    built_cuda = base["built_cuda"] == "1"
    devices = []
    if built_cuda and torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            dev = _query(device=index)
            choices = {}
            for label, (dtype, k, n) in CASES.items():
                info = _query(device=index, dtype=dtype, k=k, n=n)
                choices[label] = (info["backend"], info["reason"])
            devices.append(
                DeviceBackends(
                    index=index,
                    name=dev["device_name"],
                    compute_capability=dev["compute_capability"],
                    cutlass_kernels=dev["cutlass_kernels"],
                    cutlass_verified=dev["cutlass_verified"] == "1",
                    choices=choices,
                )
            )
    return BackendInfo(
        requested=base["requested"],
        built=("cpu", *BACKENDS) if built_cuda else ("cpu",),
        cuda_arch_list=base.get("cuda_arch_list") if built_cuda else None,
        devices=tuple(devices),
    )


def apply_env() -> None:
    """Set the backend from ``GROUPED_EP_BACKEND`` when it is set (runs at import)."""
    name = backend_from_env()
    if name is not None:
        set_backend(name)
