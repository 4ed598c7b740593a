"""MoE layers on the grouped GEMM (`layers`) and their token dispatch (`dispatch`).

`grouped_ep.nn` is the same package under its older name.
"""

from grouped_ep.moe.dispatch import routed_experts_forward
from grouped_ep.moe.layers import GroupedExperts, MoE, route, swiglu_experts

__all__ = ["GroupedExperts", "MoE", "route", "routed_experts_forward", "swiglu_experts"]
