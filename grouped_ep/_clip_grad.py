"""`clip_grad_norm_` for a model whose gradients are DTensors on several meshes (experts on
("dp", "ep"), the rest on "dp_ep" after `fully_shard_moe`), which torch's cannot combine.
Re-exported by `grouped_ep.parallel`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial


def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model sharded by `fully_shard_moe` or
    `grouped_ep.hf.parallelize`, whose gradients are DTensors on two meshes (experts on
    ("dp", "ep"), the rest on "dp_ep"), which torch's version cannot combine.

    The norm of each mesh's gradients is reduced over that mesh, the total is the same on every
    rank, and every gradient is scaled in place by `min(1, max_norm / (total + 1e-6))`, as
    torch does. Call on every rank (collective), with gradients on the same parameters on
    every rank, as FSDP2 leaves them: a rank whose gradient is None where the others have one
    runs other reductions than they do (one rank then waits for the process group's timeout,
    another returns a wrong total; torch's own has the same precondition). Plain tensors (an
    unsharded model) work too.

    Args:
        parameters: a module, a tensor, or tensors whose `.grad` are clipped.
        max_norm: the largest total norm left.
        norm_type: the p of the p-norm (`float("inf")` for the largest absolute value).
        error_if_nonfinite: raise when the total norm is nan or inf.
        foreach: accepted for torch's signature; the gradients are always scaled with one
            foreach call per device (a device without foreach kernels falls back inside torch).

    Returns:
        The total norm of all the gradients before clipping (a plain 0-d tensor).
    """
    try:
        norm_type = float(norm_type)  # as torch's: "inf" from a config is float("inf")
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: norm_type must be a number, got {norm_type!r}") from None
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        try:
            params = list(parameters)
        except TypeError:
            params = None
        if params is None or not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError(
                "clip_grad_norm_: parameters must be a module, a tensor or an iterable of "
                f"tensors, got {type(parameters).__name__}"
            )
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = _full_norm(norm, norm_type)
        norms.append(norm)
    device = norms[0].device
    norms = [n.to(device) for n in norms]
    # Each mesh's p-norm combines as a p-norm, but the "0-norm" (how many gradients are not all
    # zero, as torch counts it) is a sum of the per-mesh counts.
    if norm_type == 0:
        total = torch.stack(norms).sum()
    else:
        total = torch.nn.utils.get_total_norm(norms, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total {norm_type}-norm of the gradients is {total.item()}"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_device.setdefault(local.device, []).append(local)
    with torch.no_grad():
        for device, group in by_device.items():
            torch._foreach_mul_(group, coef.to(device))
    return total


def _full_norm(norm: DTensor, norm_type: float) -> torch.Tensor:
    """The mesh's norm, reduced over it. An inf / -inf norm reduces with MAX / MIN, which gloo
    computes without NaN: a NaN gradient on a rank other than the first was dropped, and the
    norm came out finite on every rank (`error_if_nonfinite` raised nothing and the next step
    wrote the NaN into the weights; a review). Whether any rank's norm is NaN goes alongside,
    as a 0/1 flag reduced the same way."""
    full = norm.full_tensor()
    if not math.isinf(norm_type):  # sums carry a NaN on every backend
        return full
    local = norm.to_local()
    placements = [Partial("max") if isinstance(p, Partial) else p for p in norm.placements]
    flag = DTensor.from_local(local.isnan().to(local.dtype), norm.device_mesh, placements)
    return torch.where(flag.full_tensor().abs() > 0, torch.full_like(full, math.nan), full)
