"""Names of a model's tensors as checkpoints give them, without the components of modules that
wrap another and add no tensors: torch's activation checkpointing (`_checkpoint_wrapped_module`),
FSDP1 (`_fsdp_wrapped_module`) and torch.compile (`_orig_mod`, of the model or of any block);
and the model inside the wrappers a whole model may come in."""

from __future__ import annotations

import re

_WRAPPERS = re.compile(
    r"(?:^|(?<=\.))(?:_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)\."
)


def unwrapped_name(name: str) -> str:
    """`model.layers.0._orig_mod.mlp.weight` -> `model.layers.0.mlp.weight`."""
    return _WRAPPERS.sub("", name)


def unwrapped_model(model):
    """The model inside torch.compile's, DistributedDataParallel's and nn.DataParallel's
    wrappers, nested ones too: their tensors' names carry `_orig_mod.` or `module.`, and none
    of them is a transformers model."""
    import torch
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return model
