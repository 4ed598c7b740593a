"""How the grouped GEMM treats DTensor weights.

Expert weights in an EP model are DTensors sharded on the expert dim (`Shard(0)`) of the EP
mesh, or replicated. The op runs on the local shard: `local_weight` unwraps it with a
differentiable `to_local`, whose backward wraps the local weight gradient back into a DTensor
with the weight's own mesh and placements. Model code never calls `.to_local()` itself.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def check_weight_placements(w: DTensor, name: str = "w") -> None:
    """Raise unless every placement of `w` is Shard(0) (the expert dim) or Replicate()."""
    for mesh_dim, p in enumerate(w.placements):
        if isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0):
            continue
        raise ValueError(
            f"grouped_ep.gemm: {name} is a DTensor with placements {tuple(w.placements)} on mesh "
            f"dims {w.device_mesh.mesh_dim_names or tuple(range(w.device_mesh.ndim))}; mesh dim "
            f"{mesh_dim} has {p}. Only Shard(0) (experts split across ranks) or Replicate() can be "
            "computed on the local shard. Gather other shardings first (FSDP does this in forward)."
        )


def local_weight(w: torch.Tensor, name: str = "w") -> torch.Tensor:
    """The local expert shard of `w` (a DTensor) or `w` itself (a plain tensor)."""
    if not isinstance(w, DTensor):
        return w
    check_weight_placements(w, name)
    # grad_placements default to the forward placements: the weight gradient comes back as a
    # DTensor with w's own spec.
    return w.to_local()


def check_plain(t: torch.Tensor, name: str) -> None:
    if isinstance(t, DTensor):
        raise ValueError(
            f"grouped_ep.gemm: {name} is a DTensor; pass this rank's local tokens as a plain tensor "
            "(only the expert weight w may be a DTensor)"
        )
