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

import functools
import inspect
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

_MARK = "_grouped_ep_sharded"  # set on a model grouped_ep sharded: a plain, picklable flag


def _given_state_dict(signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """The `state_dict` argument of a `save_pretrained(self, save_directory, ...)` call, by
    keyword or by position (transformers' third parameter)."""
    try:
        return signature.bind(*args, **kwargs).arguments.get("state_dict")
    except TypeError:  # transformers raises its own error for a bad call
        return kwargs.get("state_dict")


def _refuse(self: nn.Module, save_directory: Any, state_dict: Any) -> None:
    if not getattr(self, _MARK, False) or state_dict is not None:
        return
    if any(isinstance(p, DTensor) for p in self.parameters()):
        raise ValueError(
            f"save_pretrained({str(save_directory)!r}): {type(self).__name__}'s parameters are "
            "DTensors sharded by grouped_ep, which transformers' save_pretrained cannot write "
            "(it would fail part-way, after removing the weights already in that directory). "
            "Call grouped_ep.checkpoint.export_hf(model, save_directory) on every rank (full "
            "tensors in transformers' layout, with config.json), or pass "
            "state_dict=torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True)) to save_pretrained"
        )


def guard_save_pretrained(model: nn.Module) -> None:
    """Make `model.save_pretrained` (and `push_to_hub`, which calls it) refuse, naming
    `export_hf`, while the model holds DTensors and no `state_dict` is given. The model gets a
    flag; its class's method checks it (wrapped once per class): a method bound on the instance
    made the model unpicklable (`torch.save(model)` wrote a file `torch.load` could not read;
    a review). Other models of the class are untouched."""
    cls = type(model)
    original = getattr(cls, "save_pretrained", None)
    if not callable(original):
        return
    setattr(model, _MARK, True)
    if getattr(original, "_grouped_ep_guard", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse(
            self,
            save_directory,
            _given_state_dict(signature, (self, save_directory, *args), kwargs),
        )
        return original(self, save_directory, *args, **kwargs)

    save_pretrained._grouped_ep_guard = True  # type: ignore[attr-defined]
    cls.save_pretrained = save_pretrained
