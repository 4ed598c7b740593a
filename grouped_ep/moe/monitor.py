"""Tokens per expert of a transformers MoE model, counted in its experts' forward.

transformers v5 experts modules (`Qwen3MoeExperts`, `MixtralExperts`, ..., whatever
`experts_implementation` they run, "grouped_ep" included) are called as
`experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])` with the router's
choices. A forward pre-hook reads `top_k_index` there: no change to the model or its
integration, one small `scatter_add` per layer and forward, no host sync.

    counter = ExpertLoadCounter(model)      # hooks every experts module
    ...train...
    counts = counter.global_counts()        # [L, E] int64, summed over ranks (one all-reduce)
    counter.remove()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grouped_ep._hf_version import require_transformers
from grouped_ep._names import unwrapped_model
from grouped_ep._validate import check_module
from grouped_ep.loading.converted import is_transformers_model
from grouped_ep.moe.balance import join_reduce_split, stack_if_equal
from grouped_ep.moe.layers import in_backward

__all__ = ["ExpertLoadCounter"]


def _hf_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of `model` (`grouped_ep.parallel.is_experts_module`) whose forward
    takes the router's `top_k_index` (transformers' experts interface): all but GroupedExperts,
    which is called with offs instead."""
    from grouped_ep.moe.layers import GroupedExperts
    from grouped_ep.parallel import (  # imports grouped_ep.moe: not at the top
        is_experts_module,
        uses_experts_interface,
    )

    found = [
        (name, module)
        for name, module in model.named_modules()
        if is_experts_module(module) and not isinstance(module, GroupedExperts)
    ]
    own = [f"{n} ({type(m).__name__})" for n, m in found if not uses_experts_interface(m)]
    if own:  # Llama4's experts: called with the routed tokens, no top_k_index to count
        raise ValueError(
            "ExpertLoadCounter: these experts modules run their family's own forward, not "
            f"transformers' experts interface, and get no top_k_index to count: {', '.join(own)}"
        )
    return found


def _count(ids: Tensor, num_experts: int) -> Tensor:
    """`[E]` copies per expert; ids >= num_experts (transformers' expert parallel marks routes to
    other ranks' experts with id num_experts) are not counted. No host sync."""
    valid = (ids < num_experts).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids.clamp(max=num_experts - 1), valid)


def _router_experts(module: nn.Module) -> int:
    """How many experts the router's ids range over. transformers' own expert parallel sets
    `num_experts` to this rank's count, while the experts module is still called with the
    router's global ids; its stacked weights are DTensors of the global shape."""
    if getattr(module, "_is_expert_parallel", False):
        for name in ("gate_up_proj", "up_proj", "down_proj"):
            weight = getattr(module, name, None)
            if isinstance(weight, Tensor) and weight.dim() == 3:
                return weight.shape[0]
    return module.num_experts


class ExpertLoadCounter:
    """Counts, per experts module of `model`, the routed token copies each expert received in
    forwards while it is attached (training and eval alike; `reset()` between phases).

    Args:
        model: a transformers MoE model (any experts implementation; EP and FSDP2 allowed).

    Raises:
        ValueError: `model` has no transformers experts module.
    """

    def __init__(self, model: nn.Module) -> None:
        check_module(model, "ExpertLoadCounter")
        if is_transformers_model(
            unwrapped_model(model)
        ):  # before 5.7 no experts class looks like one
            require_transformers(ValueError, "ExpertLoadCounter")
        modules = _hf_experts_modules(model)
        if not modules:
            raise ValueError(
                f"ExpertLoadCounter: {type(model).__name__} has no transformers experts module "
                "(num_experts, 3-D gate_up_proj or up_proj and down_proj, called with top_k_index)"
            )
        self.names = [name for name, _ in modules]
        self.num_experts = [_router_experts(m) for _, m in modules]
        self._counts: list[Tensor | None] = [None] * len(modules)
        self._handles = [
            m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, (_, m) in enumerate(modules)
        ]

    def _hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if ids is None:
                raise ValueError(
                    f"ExpertLoadCounter: {self.names[index]} was called without top_k_index"
                )
            if in_backward():
                return  # activation checkpointing recomputing a forward counted when it ran
            with torch.no_grad():
                counts = _count(ids.reshape(-1), self.num_experts[index])
                seen = self._counts[index]
                self._counts[index] = counts if seen is None else seen + counts

        return hook

    def _rows(self) -> list[Tensor]:
        return [
            torch.zeros(experts, dtype=torch.int64) if counts is None else counts.cpu()
            for counts, experts in zip(self._counts, self.num_experts)
        ]

    def local_counts(self) -> Tensor | list[Tensor]:
        """`[L, E]` int64 copies per expert from this rank's tokens (zeros for unseen layers); a
        list of L `[E_l]` tensors where the layers' expert counts differ."""
        return stack_if_equal(self._rows())

    def global_counts(
        self, group: dist.ProcessGroup | None = None, device=None
    ) -> Tensor | list[Tensor]:
        """`local_counts()` summed over the ranks of `group` (default: all). Collective when a
        process group is initialized: call on every rank. `device`: where the all-reduce runs
        (the default device of the backend: CPU for gloo, CUDA for NCCL)."""
        rows = self._rows()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            if device is None and dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            rows = [r.to(device) for r in rows] if device is not None else rows
        return stack_if_equal([r.cpu() for r in join_reduce_split(rows, group)])

    def reset(self) -> None:
        """Forget what was counted so far."""
        self._counts = [None] * len(self._counts)

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
