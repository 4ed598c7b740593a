"""transformers' `save_pretrained` on a model whose parameters grouped_ep made DTensors.

transformers gathers sharded tensors only for its own distributed set-up
(`config.distributed_config`); on a model sharded by `apply_expert_parallel` or
`fully_shard_moe` it handed DTensors to safetensors. Rank 0 then failed inside safetensors
("invalid python storage") after it had deleted the shard files of an export already in the
directory, while rank 1 returned normally (a review, 2026-11-26): the directory held no weights,
and the earlier export no longer loaded. `guard_save_pretrained` makes the call refuse first, on
every rank, unless the caller passes the full `state_dict` itself.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("state_dict") is None and any(isinstance(p, DTensor) for p in self.parameters()):
        raise ValueError(
            f"save_pretrained({str(save_directory)!r}): {type(self).__name__}'s parameters are "
            "DTensors sharded by grouped_ep, which transformers' save_pretrained cannot write "
            "(it would fail part-way, after removing the weights already in that directory). "
            "Call grouped_ep.checkpoint.export_hf(model, save_directory) on every rank (full "
            "tensors in transformers' layout, with config.json), or pass "
            "state_dict=torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True)) to save_pretrained"
        )
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)


def guard_save_pretrained(model: nn.Module) -> None:
    """Make `model.save_pretrained` (and `push_to_hub`, which calls it) refuse, naming
    `export_hf`, while the model holds DTensors and no `state_dict` is given. A bound method on
    the instance: `copy.deepcopy` rebinds it to the copy; the class is left alone."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(_save_pretrained, model)
