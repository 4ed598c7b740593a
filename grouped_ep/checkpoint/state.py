"""The state dicts `save` and `load` hand to torch.distributed.checkpoint (DCP), and the save
planner that writes each tensor's own bytes only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)


class CompactSavePlanner(DefaultSavePlanner):
    """Writes each tensor's own bytes only.

    `torch.save` of a view writes the whole storage it views (an FSDP2 shard is a view of a
    padded buffer; a user may keep params as views of one flat buffer). DCP's file writer clones
    such tensors on CPU in current releases; doing it here makes it hold for every writer and
    for device tensors too.
    """

    def resolve_data(self, write_item: WriteItem):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.untyped_storage().nbytes() != data.nbytes:
            data = data.detach().clone(memory_format=torch.contiguous_format)
        return data


def state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, keep_made_state: bool = False
) -> dict[str, Any]:
    """The state dicts DCP saves or loads into.

    torch's `get_state_dict` gives an optimizer that has no state yet some, by a step at lr 0
    with zero gradients (AdamW: step 1, zero moments), so that its state dict has every key. That
    state is not the run's: the next real step would be bias-corrected as the second. So unless
    `keep_made_state` (`load` reads into it, and takes it out again if the load fails) it is
    removed, from the optimizer and from the state dict: saved as no state, resumed as none.

    torch skips that step when any parameter has a gradient, and a load would then read no
    optimizer state at all, silently: the gradients are set aside for it and put back.
    """
    opts = StateDictOptions(full_state_dict=False)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    had_state = bool(optimizer.state)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params] if not had_state else []
    try:
        for p in params if grads else ():
            p.grad = None
        msd, osd = get_state_dict(model, optimizer, options=opts)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    if not had_state and optimizer.state and not keep_made_state:
        optimizer.state.clear()
        osd = {**osd, "state": {}}
    return {"model": msd, "optim": osd}
