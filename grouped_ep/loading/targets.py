"""The tensors `load_sharded` fills: each parameter and persistent buffer once, with all its
names, and how the loaded data goes in."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from grouped_ep._names import unwrapped_name
from grouped_ep.loading.plan import Target, local_tensor


def model_targets(model: nn.Module) -> list[Target]:
    """Parameters and persistent buffers, each distinct tensor once with all its names (as
    `state_dict` names them: no wrapper's component)."""
    by_id: dict[int, Target] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = unwrapped_name(f"{prefix}.") if prefix else ""
        skip = getattr(module, "_non_persistent_buffers_set", set())
        items = [(n, t, True) for n, t in module._parameters.items()]
        items += [(n, t, False) for n, t in module._buffers.items() if n not in skip]
        for attr, t, is_param in items:
            if t is None:
                continue
            target = by_id.setdefault(id(t), Target([], t, is_param, []))
            if dot + attr not in target.names:
                target.names.append(dot + attr)
            target.slots.append((module, attr))
    return list(by_id.values())


def put_in_model(target: Target) -> bool:
    """Put `target.fresh` into the model (no failure is possible past planning). A meta tensor
    keeps its identity, as `Module.to_empty` keeps it: the loaded data is swapped into the same
    Python object, so an optimizer built before the load (FSDP2's order: right after
    `fully_shard`), FSDP's own records and the caller's references all see it. Where torch
    cannot swap (a weak reference to the tensor, a tensor subclass of other slots, another
    holder of its data), the model's slots get a new tensor instead; returns False then."""
    t = target.tensor
    if not t.is_meta:
        with torch.no_grad():
            local_tensor(t).copy_(target.fresh)
        return True
    new = target.fresh
    if isinstance(t, DTensor):
        new = DTensor.from_local(
            new, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    if target.is_param:
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    new.__dict__.update(t.__dict__)  # attributes others set on it (transformers' markers)
    try:
        torch.utils.swap_tensors(t, new)  # checks everything before it changes anything
        return True
    except RuntimeError:
        for module, attr in target.slots:
            (module._parameters if target.is_param else module._buffers)[attr] = new
        return False


def warn_replaced(replaced: list[str]) -> None:
    """Warn, naming them, where `put_in_model` could not keep tensors' identity."""
    if not replaced:
        return
    warnings.warn(
        f"load_sharded: {', '.join(replaced[:3])}{', ...' if len(replaced) > 3 else ''} "
        f"({len(replaced)} tensors) could not keep their identity (torch.utils."
        "swap_tensors refused: a weak reference to them, or another holder of their data), "
        "so the model now holds new tensors for them: an optimizer or other references taken "
        "before this load still see the old meta tensors. Build the optimizer after "
        "load_sharded.",
        stacklevel=3,  # the caller of load_sharded
    )
