"""grouped_ep: grouped GEMM, sharded loading and checkpoints for expert-parallel MoE on FSDP2.

ops.py            torch.ops.grouped_ep.gemm / gemm_wgrad: wrappers, fakes, autograd, DTensors
backend.py        set_backend, backend_info: which CUDA backend (cutlass, torch, fallback) runs
moe/              GroupedExperts, MoE (layers.py) and token dispatch (dispatch.py)
parallel.py       make_mesh, apply_expert_parallel, fully_shard_moe
loading/          load_sharded, LoadReport, LoadError
checkpoint/       save, load, export_hf, describe, CheckpointError
integrations/     hf.py: transformers experts implementation and parallelize
demo/             `python -m grouped_ep.demo` (`make demo`); model.py is the shared tiny model
"""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from grouped_ep import _C  # noqa: F401, I001  (registers torch.ops.grouped_ep.*)
from grouped_ep.backend import apply_env as _apply_backend_env
from grouped_ep.backend import backend_info, set_backend
from grouped_ep.loading import LoadError, LoadReport, load_sharded
from grouped_ep.ops import gemm, gemm_wgrad

_apply_backend_env()  # GROUPED_EP_BACKEND

__all__ = [
    "gemm",
    "gemm_wgrad",
    "load_sharded",
    "LoadReport",
    "LoadError",
    "set_backend",
    "backend_info",
    "__version__",
]
__version__ = "0.1.0"

# Imported on first use as attributes (`grouped_ep.checkpoint.save`), as the README writes them:
# `import grouped_ep` alone stays free of transformers and torch.distributed.checkpoint.
# `hf` and `integrations` need transformers: they load on first use too, but `dir()` leaves them
# out (introspection, `help(grouped_ep)`, would import them and patch transformers).
_SUBMODULES = ("checkpoint", "moe", "nn", "parallel", "selfcheck")
_NEED_TRANSFORMERS = ("hf", "integrations")


def __getattr__(name: str):
    if name in _SUBMODULES + _NEED_TRANSFORMERS:
        import importlib

        try:
            return importlib.import_module(f"grouped_ep.{name}")
        except ImportError as e:  # hasattr() is False without transformers, not an error
            raise AttributeError(f"grouped_ep.{name} cannot be imported: {e}") from e
    raise AttributeError(f"module 'grouped_ep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES))
