"""The FSDP2 arguments of an experts module's own unit (`fully_shard_moe`): which dim its
stacked weights are sharded on over "dp", its `reshard_after_forward`, and its reduction at
dp = 1."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import Shard


def expert_placement(local: int, dp: int):
    """How FSDP shards an experts module's stacked weights over `dp`: on dim 0 (the experts)
    where dp divides the local expert count, else on dim 1 where dp divides that (each rank
    keeps every expert's rows), else on dim 0 unevenly (FSDP2 pads only dim 0; uneven dim 1
    is its NotImplementedError)."""

    def placement(param: torch.Tensor) -> Shard:
        if local % dp == 0 or param.dim() < 2 or param.shape[1] % dp != 0:
            return Shard(0)
        return Shard(1)

    return placement


def experts_reshard(kwargs: dict, dp: int) -> dict:
    """`kwargs` with the experts' `reshard_after_forward`: an int between 1 and `dp` becomes
    True there. The experts' weights are DTensors already (Shard(0) on "ep"), and FSDP2 cannot
    reshard a DTensor parameter to a smaller mesh: such an int passed `check_reshard`, then the
    first forward raised torch's NotImplementedError, naming neither (a review)."""
    n = kwargs["reshard_after_forward"]
    if isinstance(n, bool) or n in (1, dp):
        return kwargs
    return {**kwargs, "reshard_after_forward": True}


def single_rank_reduce(module: nn.Module, dp: int, kwargs: dict) -> dict:
    """`kwargs` for the experts' FSDP group. With one rank there (dp = 1) and an fp16 reduction,
    torch 2.14 divides the gradient by the divide factor twice (its fp16 pre/post-divide split,
    then the single-rank copy): the experts' gradients came back / (dp * ep)**2. At dp = 1 the
    group reduces in fp32 where it would in fp16, and where the weights are fp32 now (free: a
    model cast to fp16 after wrapping reduced in fp16, every expert gradient 1/ep of the right
    value, silently; a review). A bf16 model, or a reduce_dtype the caller chose (not fp16),
    keeps its reduction: fp32 buffers would double the gradients' transient memory there; such a
    model cast to fp16 later is refused at its next forward (`_refuse_fp16_reduce`)."""
    if dp > 1:
        return kwargs
    policy = kwargs["mp_policy"]
    dtype = next(module.parameters()).dtype
    reduce = policy.reduce_dtype or policy.param_dtype or dtype
    if reduce in (torch.float16, torch.float32):
        return {**kwargs, "mp_policy": dataclasses.replace(policy, reduce_dtype=torch.float32)}
    if policy.reduce_dtype is None and policy.param_dtype is None:
        module.register_forward_pre_hook(_refuse_fp16_reduce)
    return kwargs


def _refuse_fp16_reduce(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a dp = 1 experts unit wrapped in bf16 with no reduce_dtype: once cast
    to fp16, its gradients would reduce in fp16 and come back 1/ep (see above)."""
    weight = next(module.parameters(), None)
    if weight is not None and weight.dtype == torch.float16:
        raise RuntimeError(
            f"{type(module).__name__}: its weights were cast to fp16 after fully_shard_moe / "
            "parallelize wrapped them in bf16 at dp = 1, where an fp16 reduction gives wrong "
            "expert gradients (torch divides them twice). Cast the model to fp16 before "
            "wrapping it, or pass mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)"
        )
