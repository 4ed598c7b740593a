"""FSDP2 units that a forward left gathered: their parameters are then the full, plain tensors
of the gather, not the sharded DTensors, in `model.parameters()` and `state_dict()`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def reshard_all(model: nn.Module) -> None:
    """Shard every FSDP2 unit of `model` that a forward left gathered (no reshard after its
    forward: the root, the last block; or a forward that raised, which leaves units in FSDP's
    forward state, where `reshard()` does nothing). Their gathered tensors are freed by the
    next `state_dict()` or forward: tensors taken from the model must be the sharded ones."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.14; 2.11: one group
        if groups is None:
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            group._training_state = TrainingState.IDLE
        module.reshard()


def reshard_after_gradless_forward(root: nn.Module) -> None:
    """A forward hook on the root FSDP module: after a forward no backward can follow (under
    `torch.no_grad()` or inference mode: an evaluation, `generate()`), every unit is sharded
    again. The root and the last blocks stay gathered after a forward for the backward that
    follows it in training; after an evaluation, an optimizer built from `model.parameters()`
    held their gathered tensors, which no step reached (a review: 9 of 25 parameters unchanged
    by training), and `checkpoint.save` with it crashed in torch's optimizer-state init."""

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():  # the forward finished: its units are idle
            for unit in units:
                unit.reshard()

    root.register_forward_hook(post)
