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
    with zero gradients (AdamW: step 1, zero moments), so that its state dict has every key; it
    skips that step when any parameter has a gradient. `load` (`keep_made_state`) reads into
    that state, and takes it out again if the load fails: the gradients are set aside for the
    step and put back (with one present, no state was built and the load read none, silently).
    `save` wants none of it: that state is not the run's, and a step at lr 0 still changes an
    optimizer that sets its own step size (transformers' Adafactor) and runs step hooks. So a
    save holds a zero gradient on one parameter while torch looks, and saves no state.
    """
    opts = StateDictOptions(full_state_dict=False)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    try:
        if not optimizer.state and keep_made_state:
            for p in params:
                p.grad = None  # torch's step of zeros builds the state to read into
        elif not optimizer.state and params and all(g is None for g in grads):
            small = min(params, key=lambda p: p.numel())
            small.grad = torch.zeros_like(small)  # no step: nothing to build, nothing changed
        msd, osd = get_state_dict(model, optimizer, options=opts)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return {"model": msd, "optim": osd}
