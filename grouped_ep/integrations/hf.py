"""Hugging Face transformers (v5) integration: a `"grouped_ep"` experts implementation and
`parallelize` for expert parallel + FSDP2 on transformers MoE models.

transformers v5 decorates its experts classes (`Qwen3MoeExperts`, `MixtralExperts`, ...) with
`@use_experts_implementation`: their forward looks up `config._experts_implementation` in
`transformers.integrations.moe.ExpertsInterface` and calls the function registered under that
name as `fn(experts_module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`.
Importing this module registers `"grouped_ep"` there (`ExpertsInterface.register`, the
documented extension point), so both of these work:

    import grouped_ep.hf  # registers "grouped_ep"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="grouped_ep")
    model.set_experts_implementation("grouped_ep")

`unregister()` removes it again. The experts' own weights are used as they are
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, or the transposed layout), no copies.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers.integrations.moe import ExpertsInterface

import grouped_ep.ops  # noqa: F401  (DTensor rules and autograd of torch.ops.grouped_ep.gemm)
from grouped_ep.loading.buffers import fresh_buffers
from grouped_ep.moe.dispatch import routed_experts_forward
from grouped_ep.parallel import experts_modules, fully_shard_moe

__all__ = [
    "IMPLEMENTATION",
    "grouped_ep_experts_forward",
    "init_nonpersistent_buffers",
    "parallelize",
    "register",
    "unregister",
]

IMPLEMENTATION = "grouped_ep"


def _check_supported(experts: nn.Module) -> None:
    unsupported = [
        flag
        for flag, bad in (
            ("has_bias", getattr(experts, "has_bias", False)),
            ("has_post_expert_norm", getattr(experts, "has_post_expert_norm", False)),
            ("has_gate=False", not getattr(experts, "has_gate", True)),
        )
        if bad
    ]
    if unsupported:
        raise NotImplementedError(
            f"experts_implementation='grouped_ep' does not support {type(experts).__name__} "
            f"with {', '.join(unsupported)}; use 'grouped_mm' or 'eager' for this model"
        )


def grouped_ep_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The `"grouped_ep"` experts forward for a transformers `@use_experts_implementation` class.

    Args:
        self: the experts module (`gate_up_proj`, `down_proj`, `num_experts`, `_apply_gate`).
        hidden_states: `[T, H]`. top_k_index: `[T, k]` expert ids. top_k_weights: `[T, k]`.

    Returns:
        `[T, H]`. With EP (`parallelize`), tokens are dispatched to the experts' ranks with
        all-to-all; one host sync per layer for the split sizes.
    """
    _check_supported(self)
    # transformers' "transposed" layout is [E, in, out]; the default one is nn.Linear's.
    trans_w = not getattr(self, "is_transposed", False)

    def compute(x: Tensor, offs: Tensor) -> Tensor:
        gemm = torch.ops.grouped_ep.gemm
        gate_up = gemm(x.to(self.gate_up_proj.dtype), self.gate_up_proj, offs, trans_w)
        return gemm(self._apply_gate(gate_up), self.down_proj, offs, trans_w)

    return routed_experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.num_experts,
        compute,
        getattr(self, "ep_mesh", None),
    )


def register() -> None:
    """Register `"grouped_ep"` in transformers' ExpertsInterface (done on import)."""
    ExpertsInterface.register(IMPLEMENTATION, grouped_ep_experts_forward)


def unregister() -> None:
    """Remove `"grouped_ep"` from transformers' ExpertsInterface."""
    ExpertsInterface._global_mapping.pop(IMPLEMENTATION, None)


register()


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Expert parallel + FSDP2 on a transformers MoE model (Qwen3-MoE, Mixtral, ...).

    Switches the model to `experts_implementation="grouped_ep"` (the other implementations
    cannot compute on EP-sharded weights), then `grouped_ep.parallel.fully_shard_moe`: experts
    `Shard(0)` over `mesh["ep"]` and FSDP over `"dp"`, decoder layers and the rest FSDP over all
    ranks. `mesh` comes from `grouped_ep.parallel.make_mesh(dp, ep)`. Works on a meta model.
    Returns `model`.
    """
    experts = experts_modules(model)
    if not experts:
        raise ValueError(f"parallelize: {type(model).__name__} has no MoE experts module")
    for module in experts:
        _check_supported(module)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    for module in experts:
        config = getattr(module, "config", None)
        if config is not None and config._experts_implementation != IMPLEMENTATION:
            raise ValueError(
                f"parallelize: experts module {type(module).__name__} still uses "
                f"experts_implementation={config._experts_implementation!r}, not 'grouped_ep'"
            )
    return fully_shard_moe(
        model, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
    )


def init_nonpersistent_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recompute every non-persistent buffer (rotary `inv_freq`, ...) of a model on `device`.

    No checkpoint holds them. `load_sharded` recomputes the ones left on meta by itself; call
    this after `model.to_empty(...)` (which leaves them holding garbage) or when building the
    model another way. Each owning module is rebuilt alone from its own `config`; a buffer that
    cannot be recomputed is a `grouped_ep.LoadError` naming it."""
    for module, name, value in fresh_buffers(model, device, only_meta=False):
        module._buffers[name] = value
