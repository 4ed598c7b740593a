"""FSDP2 units of one parameter dtype in a model that keeps some parameters in another.

`fully_shard` flattens a unit's parameters into buffers of one dtype, and its first forward
asserts "FSDP expects uniform original parameter dtype" otherwise. transformers keeps some
parameters in fp32 in a bf16 model (`_keep_in_fp32_modules_strict`: DeepSeek-V2/V3's router
`gate.weight`, GLM4-MoE, dots1, ERNIE-4.5-MoE, ...). `split_dtypes(unit, ...)`, called just
before `fully_shard(unit)`, makes the parts of the unit in another dtype units of their own
(see its docstring); those not in the unit's main dtype are never cast (`param_dtype=None`), so
they keep the precision the model asked for.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def _dtype_counts(module: nn.Module) -> Counter:
    """Elements per dtype of the parameters `fully_shard(module)` would manage: none of a
    submodule that is already a unit of its own; each tensor once."""
    counts: Counter = Counter()
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                counts[p.dtype] += p.numel()
        for child in m.children():
            if not isinstance(child, FSDPModule):
                walk(child)

    walk(module)
    return counts


def split_dtypes(unit: nn.Module, name: str, mesh: Any, kwargs: dict[str, Any]) -> None:
    """Before `fully_shard(unit, mesh=mesh, **kwargs)`: `fully_shard` the parts of `unit` (named
    `name` in the model) whose parameters are of another dtype than the rest, so that every unit
    is of one dtype. The unit keeps the dtype most of its parameters are in (by elements); a
    submodule whose own parameters are of another dtype becomes a unit of its own with its
    descendants of that dtype (`kwargs`' mixed precision minus the parameter cast: it keeps the
    precision the model asked for), and its descendants of yet another dtype units of theirs.
    The split units are gathered when `unit`'s forward starts (a parent may read a submodule's
    weight without calling it, as Mamba-style mixers do with their `conv1d`). A module holding
    parameters of two dtypes itself is refused before anything is sharded (`check_dtypes`)."""
    counts = _dtype_counts(unit)
    if len(counts) < 2:
        return
    main = counts.most_common(1)[0][0]
    policy = kwargs.get("mp_policy") or MixedPrecisionPolicy()
    split: list[nn.Module] = []

    def isolate(module: nn.Module, prefix: str, keep: torch.dtype) -> None:
        """Make every unit under `module` of one dtype, `module`'s own kept at `keep`."""
        for child_name, child in module.named_children():
            if isinstance(child, FSDPModule):
                continue
            path = f"{prefix}{child_name}."
            child_counts = _dtype_counts(child)
            if not child_counts or set(child_counts) == {keep}:
                continue
            own = {p.dtype for p in child.parameters(recurse=False)}  # one (`check_dtypes`)
            if not own and type(child).forward is nn.Module.forward:
                # A container without a forward (peft's lora_A ModuleDict of fp32 adapters in a
                # bf16 model): fully_shard refuses it; its children become units instead.
                isolate(child, path, keep)
                continue
            # The child's unit takes its own parameters' dtype, or else its most common one.
            child_keep = next(iter(own)) if own else child_counts.most_common(1)[0][0]
            isolate(child, path, child_keep)
            if child_keep != keep:
                cast = policy if child_keep == main else _uncast(policy)
                fully_shard(child, mesh=mesh, **{**kwargs, "mp_policy": cast})
                split.append(child)

    isolate(unit, f"{name}." if name else "", main)
    if split:
        unit.register_forward_pre_hook(_gather(split))


def _refuse_mixed(module: nn.Module, path: str) -> None:
    listed = ", ".join(f"{path}{n} ({p.dtype})" for n, p in module.named_parameters(recurse=False))
    raise ValueError(
        f"FSDP2 needs the parameters of one unit in one dtype, and {path.rstrip('.') or 'the model'} "
        f"holds several itself ({listed}). Load the model in fp32 and pass "
        "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32) (fp32 master weights, bf16 compute), or give "
        "these parameters one dtype before sharding"
    )


def check_dtypes(model: nn.Module) -> None:
    """Before anything is sharded: the ValueError `split_dtypes` would raise part-way, for a
    module that holds parameters of two dtypes itself."""
    for name, module in model.named_modules():
        if len({p.dtype for p in module.parameters(recurse=False)}) > 1:
            _refuse_mixed(module, f"{name}." if name else "")


def _gather(split: list[nn.Module]):
    """A forward pre-hook that gathers the split units' parameters (a no-op for one whose own
    forward runs and gathers them anyway; the rest are resharded after the backward, by FSDP's
    final callback, or by the next forward under no_grad)."""

    def hook(module: nn.Module, args: Any) -> None:
        for unit in split:
            unit.unshard()

    return hook


def _uncast(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    return dataclasses.replace(policy, param_dtype=None)
