"""FSDP2 units of one parameter dtype in a model that keeps some parameters in another.

`fully_shard` flattens a unit's parameters into buffers of one dtype, and its first forward
asserts "FSDP expects uniform original parameter dtype" otherwise. transformers keeps some
parameters in fp32 in a bf16 model (`_keep_in_fp32_modules_strict`: DeepSeek-V2/V3's router
`gate.weight`, GLM4-MoE, dots1, ERNIE-4.5-MoE, ...). `split_dtypes(unit, ...)`, called just
before `fully_shard(unit)`, makes each module that holds parameters of another dtype than most
of the unit's a unit of its own, sharded the same way but never cast (`param_dtype=None`), so it
keeps the precision the model asked for; the rest of the unit is then of one dtype.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def _params(module: nn.Module, prefix: str = "") -> list[tuple[str, str, torch.Tensor]]:
    """(owner module name, parameter name, parameter) for the parameters `fully_shard(module)`
    would manage: none of a submodule that is already a unit of its own; each tensor once."""
    out, seen = [], set()

    def walk(m: nn.Module, name: str) -> None:
        for n, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, f"{name}{n}", p))
        for child_name, child in m.named_children():
            if not isinstance(child, FSDPModule):
                walk(child, f"{name}{child_name}.")

    walk(module, prefix)
    return out


def split_dtypes(unit: nn.Module, name: str, mesh: Any, kwargs: dict[str, Any]) -> None:
    """Before `fully_shard(unit, mesh=mesh, **kwargs)`: `fully_shard` each submodule of `unit`
    (named `name` in the model) whose parameters are of a dtype other than the one most of the
    unit's are in (by elements), with `kwargs`' mixed precision minus the parameter cast.
    ValueError, naming the parameters, where that cannot give units of one dtype (the unit
    itself, or one module, holds parameters of two dtypes)."""
    prefix = f"{name}." if name else ""
    params = _params(unit, prefix)
    counts: Counter = Counter()
    for _, _, p in params:
        counts[p.dtype] += p.numel()
    if len(counts) < 2:
        return
    main = counts.most_common(1)[0][0]
    owners = sorted({owner for owner, _, p in params if p.dtype != main})
    owners = [o for o in owners if not any(o != a and o.startswith(a) for a in owners)]
    for owner in owners:
        own = [(n, p) for o, n, p in params if o.startswith(owner)]
        dtypes = {p.dtype for _, p in own}
        if owner == prefix or len(dtypes) > 1:
            listed = ", ".join(f"{n} ({p.dtype})" for n, p in own[:6])
            raise ValueError(
                f"FSDP2 needs the parameters of one unit in one dtype, and "
                f"{owner.rstrip('.') or 'the model'} holds several ({listed}): give those "
                "parameters one dtype (e.g. model.to(torch.bfloat16)) before sharding"
            )
        module = unit.get_submodule(owner[len(prefix) :].rstrip("."))
        policy = kwargs.get("mp_policy") or MixedPrecisionPolicy()
        fully_shard(module, mesh=mesh, **{**kwargs, "mp_policy": _uncast(policy)})


def _uncast(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    return dataclasses.replace(policy, param_dtype=None)
