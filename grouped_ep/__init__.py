"""grouped_ep: grouped GEMM, sharded loading and checkpoints for expert-parallel MoE on FSDP2."""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from grouped_ep import _C  # noqa: F401, I001  (registers torch.ops.grouped_ep.*)
from grouped_ep.ops import gemm, gemm_wgrad

__all__ = ["gemm", "gemm_wgrad", "load_sharded", "LoadReport", "LoadError"]
__version__ = "0.1.0"


def __getattr__(name):
    # The loader pulls in safetensors/json planning; import it on first use.
    if name in ("load_sharded", "LoadReport", "LoadError"):
        from grouped_ep import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'grouped_ep' has no attribute {name!r}")
