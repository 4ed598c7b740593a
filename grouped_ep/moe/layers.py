"""MoE layers on the grouped GEMM: SwiGLU experts and a top-k routed MoE block (its token
dispatch is `grouped_ep.moe.dispatch`).

Weight layout is the one of Hugging Face transformers v5 (`Qwen3MoeExperts`, `MixtralExperts`):
`gate_up_proj [E, 2I, H]` (the I gate rows first, then the I up rows) and `down_proj [E, H, I]`,
both in the nn.Linear orientation, used by `torch.ops.grouped_ep.gemm(x, w, offs, True)` without a copy.

Expert parallel (EP): `grouped_ep.parallel.apply_expert_parallel` turns each expert weight into
a DTensor `Shard(0)` on the EP mesh and sets `ep_mesh` on the experts module. The MoE then sends
each routed token to the rank that owns its expert (`all_to_all_single`), runs the local experts
on what it received, and sends the results back the same way. Model code never unwraps the
DTensor: `torch.ops.grouped_ep.gemm` computes on the local shard and returns the weight gradient as a
DTensor with the same spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

import grouped_ep.ops  # noqa: F401  (DTensor rules and autograd of torch.ops.grouped_ep.gemm)
from grouped_ep._validate import check_flag, check_sizes, is_int, real_number
from grouped_ep.moe.balance import RouterOutput, add_aux_loss_grad, load_balancing_loss
from grouped_ep.moe.dispatch import (
    Dispatcher,
    LocalDispatcher,
    Routing,
    default_dispatcher,
    tokens_per_expert,
)

__all__ = ["GroupedExperts", "MoE", "route", "swiglu_experts"]


def swiglu_experts(
    x: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    offs: Tensor,
    act_fn: Callable[[Tensor], Tensor] = F.silu,
) -> Tensor:
    """SwiGLU experts on tokens grouped by expert: `down(act(gate(x)) * up(x))` per group.

    Args:
        x: `[T, H]`, rows grouped by expert (expert 0's rows first).
        gate_up_proj: `[E, 2I, H]`, gate rows `[:I]`, up rows `[I:]`; plain tensor or DTensor
            `Shard(0)` (then E is the local expert count).
        down_proj: `[E, H, I]`, same kind as `gate_up_proj`.
        offs: `[E]` int32 cumulative end offsets of the groups in `x`.
        act_fn: activation of the gate half (SiLU for Qwen3-MoE and Mixtral).

    Returns:
        `[T, H]`.
    """
    gate_up = torch.ops.grouped_ep.gemm(x, gate_up_proj, offs, True)  # [T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.ops.grouped_ep.gemm(act_fn(gate) * up, down_proj, offs, True)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights, computed with one grouped GEMM per projection.

    Parameters (transformers v5 layout): `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.
    After `apply_expert_parallel` both are DTensors `Shard(0)` on the EP mesh and `ep_mesh` is
    that mesh; `forward` then takes the tokens of the local experts only.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_sizes(
            "GroupedExperts", num_experts=num_experts, hidden=hidden, intermediate=intermediate
        )
        _check_dtype(dtype, "GroupedExperts")
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        factory = {"dtype": dtype, "device": device}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden, **factory)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **factory))
        self.ep_mesh: DeviceMesh | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per expert (uniform in +-1/sqrt(fan_in))."""
        with torch.no_grad():
            nn.init.uniform_(
                self.gate_up_proj, -1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden)
            )
            bound = 1 / math.sqrt(self.intermediate)
            nn.init.uniform_(self.down_proj, -bound, bound)

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        """x: `[T, H]` grouped by (local) expert; offs: `[E_local]` int32 end offsets -> `[T, H]`."""
        return swiglu_experts(x, self.gate_up_proj, self.down_proj, offs)

    def extra_repr(self) -> str:
        ep = "" if self.ep_mesh is None else f", ep={self.ep_mesh.size()}"
        return f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}{ep}"


def _check_dtype(dtype: object, owner: str) -> None:
    """A floating torch.dtype or None ("bfloat16" or an int dtype failed inside torch)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{owner}: dtype must be a floating torch.dtype or None, got {dtype!r}")


def route(
    x: Tensor,
    router_weight: Tensor,
    top_k: int,
    norm_topk_prob: bool = True,
    expert_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k routing, as Qwen3-MoE and Mixtral do it, with an optional selection bias.

    Args:
        x: `[T, H]`. router_weight: `[E, H]`.
        top_k: experts per token. norm_topk_prob: renormalize the k probabilities to sum to 1.
        expert_bias: `[E]` added to the probabilities to choose the top k only (DeepSeek-V3's
            auxiliary-loss-free balancing); the weights stay the unbiased probabilities.

    Returns:
        `(logits [T, E], weights [T, k] in x's dtype, expert_ids [T, k] int64)`. The softmax runs
        in fp32 (fp64 for fp64 inputs).
    """
    if not is_int(top_k) or not 1 <= top_k <= router_weight.shape[0]:
        raise ValueError(
            f"route: top_k must be an int in [1, {router_weight.shape[0]}] (the experts), got "
            f"{top_k!r}"
        )
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    if expert_bias is None:
        weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    else:
        expert_ids = torch.topk(probs.detach() + expert_bias, top_k, dim=-1).indices
        weights = probs.gather(-1, expert_ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), expert_ids


def in_backward() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing's recompute,
    reentrant or not); False while torch.compile traces."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _recomputing() -> bool:
    """Whether this forward is non-reentrant activation checkpointing recomputing one in the
    backward pass: the first forward counted its tokens (counting them again doubled the load
    counts that `update_expert_bias` returns). Reentrant checkpointing runs the first forward
    under no_grad, uncounted, so its recompute counts."""
    if not in_backward():
        return False
    try:  # torch.utils.checkpoint's recompute runs under its own saved-tensors hooks
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):
        return False
    pack = hooks[0] if hooks else None
    return "_recomputation_hook" in getattr(pack, "__qualname__", "")


class MoE(nn.Module):
    """Sparse MoE block: softmax top-k router (Linear, no bias) and SwiGLU `GroupedExperts`.

    `forward(x [..., H]) -> [..., H]`; with `return_router_outputs=True` it returns
    `(out, RouterOutput(logits [T, E], tokens_per_expert [E], aux_loss))` instead.

    Load balancing, chosen here (both may be on at once):

    - `aux_loss_coef > 0`: the Switch auxiliary loss over this rank's tokens, normalized for
      top-k (`grouped_ep.moe.balance.load_balancing_loss`; transformers' Mixtral loss is
      `top_k` times it: use `aux_loss_coef = top_k * router_aux_loss_coef`). Its gradient, times the coefficient, is
      added in the backward of the output, as if `aux_loss_coef * aux_loss` were part of the
      loss backpropagated through it: nothing to add in the training loop. With gradient
      accumulation (losses divided by N), call `grouped_ep.moe.set_aux_loss_scale(model, 1/N)`.
    - `expert_bias_gamma=gamma`: DeepSeek-V3's auxiliary-loss-free balancing. A buffer
      `expert_bias [E]` (fp32, saved in checkpoints) is added to the probabilities to choose the
      experts, not to the combine weights. Training forwards (training mode, autograd on: not
      under `no_grad` or `inference_mode`) count the tokens per expert;
      `grouped_ep.moe.update_expert_bias(model)` after each optimizer step all-reduces the counts
      of every layer once and moves each bias by `gamma` towards balance.

    Dispatch: `dispatcher` (an object with `dispatch` and `combine`, see
    `grouped_ep.moe.dispatch`) or, when None, `LocalDispatcher` without EP and
    `AllToAllDispatcher(experts.ep_mesh)` once `grouped_ep.parallel.apply_expert_parallel` has
    set that mesh. With EP, each rank keeps its own tokens; routed copies go to the experts'
    ranks with `all_to_all_single` and come back the same way, autograd flowing through both.
    One host sync per layer: the all-to-all split sizes.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        aux_loss_coef: float = 0.0,
        expert_bias_gamma: float | None = None,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__()
        check_sizes("MoE", hidden=hidden, intermediate=intermediate, num_experts=num_experts)
        _check_dtype(dtype, "MoE")
        if not is_int(top_k) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"MoE: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}"
            )
        coef = real_number(aux_loss_coef)
        if coef is None or not 0 <= coef < math.inf:  # NaN fails too
            raise ValueError(
                "MoE: aux_loss_coef must be a finite real number >= 0 (0: off), got "
                f"{aux_loss_coef!r}"
            )
        check_flag(norm_topk_prob, "MoE: norm_topk_prob")
        gamma = real_number(expert_bias_gamma)
        if expert_bias_gamma is not None and (gamma is None or not 0 < gamma < math.inf):
            raise ValueError(
                f"MoE: expert_bias_gamma must be finite and > 0, or None, got {expert_bias_gamma}"
            )
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.num_experts = num_experts
        self.aux_loss_coef = coef
        # set_aux_loss_scale's value, a 0-d CPU tensor (not a buffer): torch.compile reads it
        # at run time instead of recompiling for each value.
        self._aux_scale = torch.ones((), dtype=torch.float64, device="cpu")
        self.expert_bias_gamma = gamma
        if dispatcher is not None and (
            isinstance(dispatcher, type)  # the class, not an instance: failed at the forward
            or not all(callable(getattr(dispatcher, f, None)) for f in ("dispatch", "combine"))
        ):
            raise TypeError(
                "MoE: dispatcher must be an object with dispatch(x, routing) and "
                f"combine(y, handle) methods, got {dispatcher!r}"
            )
        self.dispatcher = dispatcher
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = GroupedExperts(num_experts, hidden, intermediate, dtype=dtype, device=device)
        if self.expert_bias_gamma is not None:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
        # Training forwards' tokens per expert since the last bias update. Not a buffer: it is
        # per-rank bookkeeping, never saved, and created where the tokens are.
        self._load_counts: Tensor | None = None

    @property
    def aux_loss_grad_scale(self) -> float:
        """The aux-loss gradient's scale (`grouped_ep.moe.set_aux_loss_scale`)."""
        return float(self._aux_scale)

    @aux_loss_grad_scale.setter
    def aux_loss_grad_scale(self, scale: float) -> None:
        # A new tensor, not `fill_`: a compiled graph that holds the old one for its backward
        # (torch.compile over a checkpointed block) keeps that forward's value, and in place
        # it failed the backward's version check (a review).
        self._aux_scale = torch.tensor(float(scale), dtype=torch.float64)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # `load_state_dict(..., assign=True)` puts the given tensor in place as it is: a bf16
        # `expert_bias` would round its gamma steps away. It stays fp32 (as through `.to()`).
        key = prefix + "expert_bias"
        bias = state_dict.get(key)
        if isinstance(bias, torch.Tensor) and bias.is_floating_point():
            state_dict[key] = bias.to(torch.float32)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # Tokens counted by forwards before the load (a warm-up step) belong to no step of the
        # loaded run: kept, the first update_expert_bias would move the bias by them.
        self._load_counts = None

    def _apply(self, fn, recurse=True):
        # `expert_bias` stays fp32 through `.to(dtype)`, `.bfloat16()`, ...: its steps of gamma
        # (1e-3) would round away in bf16 near its values. Devices still follow `fn`.
        bias = self._buffers.get("expert_bias")
        super()._apply(fn, recurse)
        new = self._buffers.get("expert_bias")
        if bias is not None and new is not None and new.dtype != torch.float32:
            exact = bias if bias.dtype == torch.float32 and not bias.is_meta else new
            self._buffers["expert_bias"] = exact.to(device=new.device, dtype=torch.float32)
        return self

    def reset_parameters(self) -> None:
        """Fresh router and experts (nn.Linear's init) and a zero expert bias, e.g. after
        `to_empty`."""
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.expert_bias_gamma is not None:
            with torch.no_grad():
                self.expert_bias.zero_()
        self._load_counts = None

    def peek_load_counts(self) -> Tensor:
        """`[E]` int64 tokens per expert routed by training forwards since the last
        `take_load_counts` (zeros when none ran): a copy (it was the live count, which the next
        forward changed under a value kept for logging; a review)."""
        counts = self._load_counts
        if counts is None:
            device = self.expert_bias.device if hasattr(self, "expert_bias") else None
            return torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return counts.clone()

    def take_load_counts(self) -> Tensor:
        """`peek_load_counts()`, and resets the count. Used by `update_expert_bias`."""
        counts = self.peek_load_counts() if self._load_counts is None else self._load_counts
        self._load_counts = None
        return counts

    def forward(
        self, x: Tensor, return_router_outputs: bool = False
    ) -> Tensor | tuple[Tensor, RouterOutput]:
        """x: `[..., H]` -> `[..., H]`, or `(out, RouterOutput)` with `return_router_outputs`."""
        if not isinstance(x, Tensor):
            raise TypeError(f"MoE: x must be a Tensor [..., H], got {type(x).__name__}")
        shape = x.shape
        hidden = self.router.in_features
        # Under autocast: any dtype autocast casts (it never casts float64).
        dtype_ok = x.dtype == self.router.weight.dtype or (
            torch.is_autocast_enabled(x.device.type)
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
        if x.dim() < 1 or shape[-1] != hidden or not dtype_ok:
            raise ValueError(
                f"MoE: x must be [..., {hidden}] in the model's dtype "
                f"{self.router.weight.dtype}, got {list(shape)} {x.dtype}"
            )
        x = x.reshape(-1, shape[-1])
        bias = getattr(self, "expert_bias", None)
        logits, weights, expert_ids = route(
            x, self.router.weight, self.top_k, self.norm_topk_prob, expert_bias=bias
        )
        counts = tokens_per_expert(expert_ids, self.num_experts)  # the aux loss's and the routing's
        aux_loss = None
        if self.aux_loss_coef > 0:
            dtype = torch.promote_types(logits.dtype, torch.float32)  # as `route`'s softmax
            aux_loss = load_balancing_loss(
                torch.softmax(logits, -1, dtype=dtype), counts, self.top_k
            )
            if torch.is_grad_enabled():
                # On the routing weights, which every output element's gradient passes through
                # (not on the output, which model code may change in place).
                coef = self._aux_scale * self.aux_loss_coef  # a new tensor: this forward's
                weights = add_aux_loss_grad(weights, aux_loss, coef)
            aux_loss = aux_loss.detach()
        routing = Routing(expert_ids, weights, counts)
        # Only forwards that train count: not one under no_grad or inference_mode (an eval or
        # generation callback that left the module in training mode), whose counter would
        # also be an inference tensor that the next training forward cannot add to.
        if self.training and bias is not None and torch.is_grad_enabled() and not _recomputing():
            with torch.no_grad():
                if self._load_counts is None:
                    self._load_counts = torch.zeros_like(routing.counts)
                self._load_counts += routing.counts
        dispatcher = self.dispatcher
        if dispatcher is None:
            dispatcher = default_dispatcher(self.experts.ep_mesh)
        elif isinstance(dispatcher, LocalDispatcher) and self.experts.ep_mesh is not None:
            raise ValueError(
                "MoE: dispatcher=LocalDispatcher() runs every expert on this rank, but the experts "
                "are EP-sharded (apply_expert_parallel): set dispatcher=None (all-to-all over the "
                "EP mesh) or pass a dispatcher for EP"
            )
        local_x, offs, handle = dispatcher.dispatch(x, routing)
        out = dispatcher.combine(self.experts(local_x, offs), handle)
        if out.shape != shape:
            # Not a view of the [T, H] result (autograd's view tracking): an in-place op on a
            # view that an FSDP2 unit's forward returned breaks its backward.
            out = torch.ops.aten._unsafe_view(out, shape)
        if return_router_outputs:
            return out, RouterOutput(logits, routing.counts, aux_loss)
        return out

    def extra_repr(self) -> str:
        parts = [f"top_k={self.top_k}"]
        if self.aux_loss_coef > 0:
            parts.append(f"aux_loss_coef={self.aux_loss_coef}")
        if self.expert_bias_gamma is not None:
            parts.append(f"expert_bias_gamma={self.expert_bias_gamma}")
        if self.dispatcher is not None:
            parts.append(f"dispatcher={self.dispatcher!r}")
        return ", ".join(parts)
