"""Names of a model's tensors as checkpoints give them, without the components of modules that
wrap another and add no tensors: torch's activation checkpointing (`_checkpoint_wrapped_module`),
FSDP1 (`_fsdp_wrapped_module`) and torch.compile (`_orig_mod`, of the model or of any block)."""

from __future__ import annotations

import re

_WRAPPERS = re.compile(
    r"(?:^|(?<=\.))(?:_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)\."
)


def unwrapped_name(name: str) -> str:
    """`model.layers.0._orig_mod.mlp.weight` -> `model.layers.0.mlp.weight`."""
    return _WRAPPERS.sub("", name)
