"""FSDP2 units that a forward left gathered: their parameters are then the full, plain tensors
of the gather, not the sharded DTensors, in `model.parameters()` and `state_dict()`."""

from __future__ import annotations

from collections.abc import Mapping
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
        for group in _param_groups(module):
            group._training_state = TrainingState.IDLE
        module.reshard()


def _param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.14; 2.11: one group
    if groups is None:
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return groups


def gathered_params(model: nn.Module) -> dict[int, str]:
    """id -> name of the gathered (unsharded) tensors of `model`'s FSDP2 units, those a forward
    made. Each unit keeps its gathered Parameter objects between forwards (freed storage, same
    objects): an optimizer built while they were in the model holds them still."""
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in _param_groups(module):
                for fsdp_param in group.fsdp_params:
                    gathered = getattr(fsdp_param, "_unsharded_param", None)  # after a gather
                    if gathered is not None:
                        info = fsdp_param._module_info
                        prefix = modules.get(id(info.module), "?")
                        out[id(gathered)] = f"{prefix}.{info.param_name}".lstrip(".")
    return out


def _needs_grad(output: Any) -> bool:
    """Whether any tensor in a forward's `output` (tensors, lists, tuples, dicts, transformers'
    ModelOutput) requires grad: a backward through it can follow."""
    from torch.utils._pytree import tree_leaves

    stack = list(tree_leaves(output))
    while stack:
        leaf = stack.pop()
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                return True
        elif isinstance(leaf, Mapping):  # a dict subclass pytree does not know
            stack.extend(leaf.values())
        elif isinstance(leaf, (list, tuple)):
            stack.extend(leaf)
    return False


def reshard_after_gradless_forward(root: nn.Module) -> None:
    """A forward hook on the root FSDP module: after a forward no backward can follow (under
    `torch.no_grad()` or inference mode: an evaluation, `generate()`; or with gradients on,
    but no output requiring grad: a frozen model, a frozen teacher), every unit is sharded
    again. The root and the last blocks stay gathered after a forward for the backward that
    follows it in training; after an evaluation, an optimizer built from `model.parameters()`
    held their gathered tensors, which no step reached (a review: 9 of 25 parameters unchanged
    by training), and `checkpoint.save` with it crashed in torch's optimizer-state init. After
    a grad-enabled forward of a frozen model, parameters unfrozen next were the gathered
    copies: the sharded ones never trained (a review, 2026-11-26: a router left unchanged)."""

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not _needs_grad(output):  # its units are idle
            # Found now, not when wrapped: a unit the user adds later (a value head sharded
            # with reshard_after_forward=False) stayed gathered and never trained (a review).
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    root.register_forward_hook(post)
