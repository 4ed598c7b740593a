"""MoE layers on the grouped GEMM (`layers`), their token dispatch (`dispatch`) and load
balancing (`balance`), and a per-expert token counter for transformers models (`monitor`).

`grouped_ep.nn` is the same package under its older name.
"""

from grouped_ep.moe.balance import (
    RouterOutput,
    load_balancing_loss,
    set_aux_loss_scale,
    update_expert_bias,
)
from grouped_ep.moe.dispatch import (
    AllToAllDispatcher,
    Dispatcher,
    LocalDispatcher,
    Routing,
    routed_experts_forward,
)
from grouped_ep.moe.layers import GroupedExperts, MoE, route, swiglu_experts
from grouped_ep.moe.monitor import ExpertLoadCounter

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertLoadCounter",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "RouterOutput",
    "Routing",
    "load_balancing_loss",
    "route",
    "set_aux_loss_scale",
    "routed_experts_forward",
    "swiglu_experts",
    "update_expert_bias",
]
