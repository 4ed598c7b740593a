"""What `checkpoint.save` checks of its arguments before anything is written (on every rank,
through one collective: `extra` may be rank 0's alone)."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from grouped_ep._replaced import built_before_sharding, held_replaced
from grouped_ep._validate import check_module
from grouped_ep.checkpoint.errors import CheckpointError, listed


def check_types(model: object, optimizer: object, extra: object, caller: str = "save") -> None:
    check_module(model, caller, error=CheckpointError)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        hint = ""
        if caller == "save" and isinstance(optimizer, (list, tuple, dict)):
            hint = (
                ": one optimizer per checkpoint; save a second one (Muon's 2-D weights beside "
                "AdamW's experts) to a root of its own, save(root2, model, opt2)"
            )
        elif caller == "save":
            hint = " (user state goes in extra=)"
        raise CheckpointError(
            f"{caller}: optimizer must be a torch.optim.Optimizer or None, got "
            f"{type(optimizer).__name__}{hint}"
        )
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"{caller}: extra must be a dict or None, got {type(extra).__name__}")
    if extra is not None:
        _refuse_dtensors(extra, "extra")


def _refuse_dtensors(obj: object, where: str) -> None:
    """A DTensor in `extra` (an EMA of a sharded model's parameters, another optimizer's state
    dict) is pickled per rank, bound to the saving run's mesh: no run of another layout could
    read it, and torch.load refused it outright (the whole step could not be loaded; a review)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        raise CheckpointError(
            f"save: {where} is a DTensor, which extra cannot hold (pickled per rank, it is bound "
            "to this run's mesh): save its .full_tensor() (the whole value, on every rank) or "
            ".to_local(), or keep the state in the model (a buffer) or the optimizer"
        )
    if isinstance(obj, dict):
        for k, v in obj.items():
            _refuse_dtensors(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _refuse_dtensors(v, f"{where}[{i}]")


def as_int(value: object) -> int | None:
    """`value` as an int where it is an integer: an int, a numpy int or an integer 0-d tensor
    (as training loops keep counters); None otherwise (a bool, a float, a string)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def as_step(value: object, name: str) -> int:
    """A step number given as an int, a numpy int or an integer 0-d tensor, as an int; anything
    else a CheckpointError naming `name` (a float or a tensor step silently ignored numbered the
    checkpoint after the newest one in the root)."""
    step = as_int(value)
    if step is None or step < 0:
        raise CheckpointError(
            f"save: {name} must be a non-negative int (it names the checkpoint), got "
            f"{value!r} of type {type(value).__name__}"
        )
    return step


def as_keep_last(value: object) -> int | None:
    """`keep_last` as an int (or None), taking what `as_step` takes."""
    count = None if value is None else as_int(value)
    if value is not None and (count is None or count < 1):
        raise CheckpointError(
            f"save: keep_last must be a positive int or None, got {value!r} of type "
            f"{type(value).__name__}"
        )
    return count


def check_optimizer_params(model: nn.Module, optimizer: object, caller: str) -> None:
    """After `reshard_all`: every tensor the optimizer holds must be a parameter of the model. An
    optimizer built while FSDP units were gathered (after a forward with gradients on and no
    backward) holds their full, plain tensors, which no training step reaches; torch's
    optimizer-state init then crashed the process in save and load."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    params = {id(p) for p in model.parameters()}
    strangers = [
        (f"group {g} item {i} {list(p.shape)}", p.is_meta)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in params
    ]
    foreign = [where for where, _ in strangers]
    on_meta = [where for where, meta in strangers if meta]
    stale = held_replaced(optimizer)
    if stale:
        raise CheckpointError(f"{caller}: {built_before_sharding(stale)}")
    if on_meta:
        raise CheckpointError(
            f"{caller}: the optimizer holds {len(on_meta)} meta tensors that are not the model's "
            "parameters: it was built before the model was materialized, and the materializing "
            "step replaced the parameters (a load_sharded that warned it could not keep their "
            "identity, or a by-hand swap). Build the optimizer from model.parameters() after that"
        )
    if foreign:
        raise CheckpointError(
            f"{caller}: the optimizer holds tensors that are not the model's parameters: "
            f"{listed(foreign)}. "
            "Was it built after a forward with no backward, while FSDP units were gathered (their "
            "parameters then are the gathered tensors)? Build it from model.parameters() after a "
            "backward or a forward under torch.no_grad(), or before any forward"
        )
