"""Builds grouped_ep._C: C++ CPU kernels always, CUTLASS CUDA kernels when they can be built.

CUDA kernels are built when nvcc and a CUDA build of torch are present and GROUPED_EP_CUDA is
not "0". The arch list comes from TORCH_CUDA_ARCH_LIST (default "8.0+PTX;9.0a": sm_80 and sm_90a
code, plus compute_80 PTX so that newer GPUs JIT-compile the fallback kernels instead of failing
with "no kernel image"); no GPU is queried.
"""

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
CUTLASS = ROOT / "third_party" / "cutlass"


def _find_cuda_home() -> str | None:
    """Locate the CUDA toolkit that holds lib64/libcudart.so.

    torch guesses CUDA_HOME from the `nvcc` on PATH, which can be a wrapper script outside the
    toolkit; then linking -lcudart fails. Prefer an explicit CUDA_HOME, else the first toolkit
    folder that really has the runtime library.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return home
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates += [Path("/usr/local/cuda")] + sorted(
        Path("/usr/local").glob("cuda-*"), reverse=True
    )
    for home in candidates:
        if (home / "bin" / "nvcc").exists() and any((home / "lib64").glob("libcudart.so*")):
            return str(home)
    return None


def _cuda_home_to_build() -> str | None:
    """The toolkit to build the CUDA kernels with, or None for a CPU-only build."""
    if os.environ.get("GROUPED_EP_CUDA", "1") == "0":
        return None
    import torch

    return _find_cuda_home() if torch.version.cuda is not None else None


CUDA_HOME = _cuda_home_to_build()
WITH_CUDA = CUDA_HOME is not None
if WITH_CUDA:
    os.environ["CUDA_HOME"] = CUDA_HOME
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0+PTX;9.0a")
os.environ.setdefault("MAX_JOBS", "2")  # nvcc on CUTLASS takes GBs per job

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _pip_cuda_includes() -> list[str]:
    """torch's CUDA headers include cusparse.h / cublas*.h, which pip puts in nvidia/cu*/include."""
    out = []
    for site in sys.path:
        out += sorted(glob.glob(os.path.join(site, "nvidia", "cu1*", "include")))
    return [d for d in dict.fromkeys(out) if os.path.isdir(d)]


def _sources(*patterns: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pat in patterns for p in ROOT.glob(pat))


# torch picks the C++ standard it needs (C++20 for 2.14). -g0 overrides Python's own CFLAGS -g:
# debug info for torch's headers nearly doubled each file's compile time (crc32c.cpp: 137 s with
# -g, 75 s with -g0, one after the other on a 2-core EPYC with other jobs running).
cxx_flags = ["-O3", "-g0", "-fopenmp"]
include_dirs = [str(ROOT / "csrc")]
# backend.cpp (grouped_ep.backend_info / set_backend) has no CUDA dependency: in every build.
sources = _sources("csrc/*.cpp", "csrc/cpu/*.cpp", "csrc/io/*.cpp", "csrc/cuda/backend.cpp")


def _write_build_config() -> str:
    """A header telling backend_info what this build was compiled for; returns its folder."""
    folder = ROOT / "build" / "generated"
    folder.mkdir(parents=True, exist_ok=True)
    arch_list = os.environ["TORCH_CUDA_ARCH_LIST"].replace('"', "")
    text = f'#pragma once\n#define GROUPED_EP_CUDA_ARCH_LIST "{arch_list}"\n'
    header = folder / "grouped_ep_build_config.h"
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
    return str(folder)


if WITH_CUDA:
    if not (CUTLASS / "include" / "cutlass" / "cutlass.h").exists():
        sys.exit(
            "grouped_ep: CUTLASS headers not found in third_party/cutlass. "
            "Run `python third_party/fetch_cutlass.py` (or `make cutlass`), "
            "or build CPU-only with GROUPED_EP_CUDA=0."
        )
    include_dirs += [str(CUTLASS / "include"), str(CUTLASS / "tools" / "util" / "include")]
    include_dirs += _pip_cuda_includes() + [_write_build_config()]
    nvcc_flags = [
        "-O3",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-DNDEBUG",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        "-Xcompiler=-fno-strict-aliasing",
        "--threads=1",
    ]
    ext = CUDAExtension(
        "grouped_ep._C",
        sorted(set(sources + _sources("csrc/cuda/*.cpp", "csrc/cuda/*.cu"))),
        include_dirs=include_dirs,
        define_macros=[("GROUPED_EP_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"],
    )
else:
    ext = CppExtension(
        "grouped_ep._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )

print(f"grouped_ep: building {'CPU + CUDA' if WITH_CUDA else 'CPU-only'} extension", flush=True)

setup(
    name="grouped_ep",
    packages=find_packages(include=["grouped_ep*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
