"""Parameters that sharding replaced, and optimizers that still hold them.

`apply_expert_parallel`, `fully_shard_moe` (and so `grouped_ep.hf.parallelize`) put new
Parameter objects (DTensors) in the model. An optimizer built before them holds the old ones,
which no backward reaches: every step then changes nothing, and no error says so (FSDP2's own
behaviour). The old parameters are remembered here (weakly: they go when nothing else holds
them), and a step of any optimizer that holds one is refused, naming it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id -> (a weak reference to the replaced parameter, its name in the model, what replaced it)
_REPLACED: dict[int, tuple[weakref.ref, str, str]] = {}
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its signature
_SHARDED: weakref.WeakSet = weakref.WeakSet()  # models fully_shard_moe sharded
_version = 0
_hook = None


def replaced_by(param: torch.Tensor) -> tuple[str, str] | None:
    """(name, caller) when `param` is a parameter that sharding replaced, else None."""
    entry = _REPLACED.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1], entry[2]


@contextlib.contextmanager
def noting_replaced(model: nn.Module, caller: str) -> Iterator[None]:
    """Remember the parameters of `model` that the body replaces."""
    before = list(model.named_parameters(remove_duplicate=False))
    yield
    now = {id(p) for p in model.parameters()}
    gone = [(name, p) for name, p in before if id(p) not in now]
    if not gone:
        return
    global _version, _hook
    for name, p in gone:
        key = id(p)
        _REPLACED[key] = (weakref.ref(p, lambda _, key=key: _REPLACED.pop(key, None)), name, caller)
    _version += 1
    if _hook is None:  # every optimizer's step, once the first parameter was replaced
        _hook = register_optimizer_step_pre_hook(_refuse_replaced)


def held_replaced(optimizer: torch.optim.Optimizer) -> list[tuple[str, str]]:
    """(name, caller) of every parameter `optimizer` holds that sharding replaced."""
    return [found for g in optimizer.param_groups for p in g["params"] if (found := replaced_by(p))]


def built_before_sharding(stale: list[tuple[str, str]]) -> str:
    """The message for an optimizer holding the parameters `stale` names."""
    names = ", ".join(name for name, _ in stale[:5]) + (" ..." if len(stale) > 5 else "")
    return (
        f"the optimizer holds {len(stale)} parameter(s) that {stale[0][1]} replaced with sharded "
        f"ones ({names}): it was built before the model was sharded, and its steps change "
        "nothing. Build the optimizer from model.parameters() after parallelize / "
        "fully_shard_moe / apply_expert_parallel"
    )


def noting_gathered(model: nn.Module) -> None:
    """Watch `model`'s FSDP2 units: a step of an optimizer holding their gathered tensors (built
    after a training forward, which leaves the root and the last block gathered for the
    backward) is refused. Its steps never reach the sharded parameters (a review: the whole
    last block untrained, no error until `checkpoint.save`)."""
    global _version, _hook
    _SHARDED.add(model)
    _version += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_replaced)


def held_gathered(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the gathered FSDP2 tensors of a watched model that `optimizer` holds."""
    from grouped_ep._reshard import gathered_params

    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [
        name
        for model in list(_SHARDED)
        for key, name in gathered_params(model).items()
        if key in held
    ]


def built_while_gathered(names: list[str]) -> str:
    """The message for an optimizer holding the gathered tensors `names`."""
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    return (
        f"the optimizer holds {len(names)} gathered FSDP tensor(s) instead of the sharded "
        f"parameters ({shown}): it was built after a training forward, which leaves the root "
        "and the last block gathered for the backward, and its steps would never change them. "
        "Build the optimizer from model.parameters() before the first forward, or after a "
        "backward or a forward under torch.no_grad()"
    )


def _refuse_replaced(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _REPLACED and not _SHARDED:
        return
    signature = (_version, sum(len(g["params"]) for g in optimizer.param_groups))
    if _CHECKED.get(optimizer) == signature:
        return
    stale = held_replaced(optimizer)
    if stale:
        raise RuntimeError(f"{type(optimizer).__name__}.step: {built_before_sharding(stale)}")
    gathered = held_gathered(optimizer)
    if gathered:
        raise RuntimeError(f"{type(optimizer).__name__}.step: {built_while_gathered(gathered)}")
    _CHECKED[optimizer] = signature
