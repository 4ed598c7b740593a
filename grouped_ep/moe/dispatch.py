"""Token dispatch for MoE layers, as swappable objects.

A dispatcher moves routed token copies to the experts that compute them and brings the results
back, weighted and summed per token:

    local_x, offs, handle = dispatcher.dispatch(x, routing)   # [S, H], [E_local] int32
    y = dispatcher.combine(experts(local_x, offs), handle)     # [T, H]

- `LocalDispatcher`: every expert is on this rank; a permutation into expert order, no
  communication, no host sync.
- `AllToAllDispatcher(ep_mesh)`: expert parallel. Rank r of the EP mesh owns experts
  `[r*E_l, (r+1)*E_l)`; each routed copy goes to its expert's rank with `all_to_all_single` and
  comes back the same way, autograd flowing through both. One host sync per layer: the split
  sizes of the exchange (how many rows go to and come from each rank), read with one `.tolist()`.

Any object with these two methods can be passed to `grouped_ep.moe.MoE(dispatcher=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.autograd import forward_ad
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "LocalDispatcher",
    "Routing",
    "default_dispatcher",
    "routed_experts_forward",
    "tokens_per_expert",
]


def tokens_per_expert(expert_ids: Tensor, num_experts: int) -> Tensor:
    """`[E]` int64: how many routed copies each expert gets from `expert_ids` `[T, k]`.

    scatter_add rather than bincount: no host sync for the max id on CUDA.
    """
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


@dataclass(frozen=True)
class Routing:
    """Where each token goes.

    expert_ids: `[T, k]` int64 global expert ids. weights: `[T, k]` combine weights.
    counts: `[E]` int64 routed copies per global expert (`tokens_per_expert`).
    """

    expert_ids: Tensor
    weights: Tensor
    counts: Tensor

    @classmethod
    def from_topk(cls, expert_ids: Tensor, weights: Tensor, num_experts: int) -> Routing:
        """The routing of `[T, k]` expert ids and weights over `num_experts` experts."""
        if expert_ids.shape != weights.shape or expert_ids.dim() != 2:
            raise ValueError(
                f"Routing: expert_ids {tuple(expert_ids.shape)} and weights "
                f"{tuple(weights.shape)} must both be [T, k]"
            )
        if (
            expert_ids.is_floating_point()
            or expert_ids.is_complex()
            or expert_ids.dtype == torch.bool
        ):
            raise TypeError(f"Routing: expert_ids must be integers, got {expert_ids.dtype}")
        expert_ids = expert_ids.long()  # int32 ids (a hand-made routing) failed in scatter
        # Checked where it costs no host sync (CPU, not under torch.compile, where reading the
        # values would break the graph); on CUDA an id out of range fails in the device's own
        # index check.
        if (
            expert_ids.device.type == "cpu"
            and expert_ids.numel()
            and not torch.compiler.is_compiling()
        ):
            low, high = (int(v) for v in torch.aminmax(expert_ids))  # one pass
            if low < 0 or high >= num_experts:
                raise ValueError(
                    f"Routing: expert_ids must be in [0, num_experts={num_experts}), got ids "
                    f"from {low} to {high}"
                )
        return cls(expert_ids, weights, tokens_per_expert(expert_ids, num_experts))

    @property
    def num_experts(self) -> int:
        return self.counts.numel()


class Dispatcher(Protocol):
    """What `MoE` needs from a dispatcher (see the module docstring)."""

    def dispatch(self, x: Tensor, routing: Routing) -> tuple[Tensor, Tensor, Any]:
        """x `[T, H]` -> (tokens of this rank's experts `[S, H]` grouped by local expert,
        offs `[E_local]` int32 cumulative group ends, handle for `combine`)."""
        ...

    def combine(self, y: Tensor, handle: Any) -> Tensor:
        """y `[S, H]` (the experts' outputs, rows as `dispatch` gave them) -> `[T, H]`:
        `sum_j weights[t, j] * y[copy (t, j)]`, in the dtype of the dispatched x."""
        ...


def _inverse_permutation(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


@dataclass
class _Permutation:
    """How routed copies were sorted into global expert order, and how to undo it."""

    order: Tensor  # [T*k] position in the sorted rows -> flat (token, choice) index
    weights: Tensor  # [T, k]
    dtype: torch.dtype


def _permute(x: Tensor, routing: Routing) -> tuple[Tensor, _Permutation]:
    top_k = routing.expert_ids.shape[1]
    # Stable: the rows of one expert keep token order, so results do not depend on the sort.
    order = torch.argsort(routing.expert_ids.reshape(-1), stable=True)
    return x[order // top_k], _Permutation(order, routing.weights, x.dtype)


def _unpermute(y_sorted: Tensor, perm: _Permutation) -> Tensor:
    num_tokens, top_k = perm.weights.shape
    y = y_sorted[_inverse_permutation(perm.order)].view(num_tokens, top_k, y_sorted.shape[-1])
    # Weighted sum over the k choices: deterministic, unlike index_add_ with repeated indices.
    # In the promoted dtype (fp32 weights with bf16 tokens sum in fp32), as transformers does.
    return (y * perm.weights.unsqueeze(-1)).sum(dim=1).to(perm.dtype)


class LocalDispatcher:
    """Every expert on this rank: sort the routed copies by expert, no communication."""

    def dispatch(self, x: Tensor, routing: Routing) -> tuple[Tensor, Tensor, _Permutation]:
        x_sorted, perm = _permute(x, routing)
        return x_sorted, torch.cumsum(routing.counts, 0, dtype=torch.int32), perm

    def combine(self, y: Tensor, handle: _Permutation) -> Tensor:
        return _unpermute(y, handle)

    def __repr__(self) -> str:
        return "LocalDispatcher()"


@dataclass
class _AllToAllHandle:
    perm: _Permutation
    order: Tensor  # received rows (source rank, local expert) -> grouped by local expert
    send_splits: list[int]
    recv_splits: list[int]


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """`all_to_all_single` with autograd; under inference mode, where torch 2.11 / 2.12 have no
    kernel for the autograd op ("Could not run '_c10d_functional_autograd::all_to_all_single'
    with arguments from the 'CPU' backend"), the plain one. Not asked while torch.compile
    traces (dynamo breaks the graph on the question): compiled, it is the autograd op."""
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
    if torch.is_inference_mode_enabled():
        return funcol.all_to_all_single(x, out_splits, in_splits, group)
    if forward_ad._current_level >= 0:  # forward-mode AD (torch.func.jvp): the collective has
        # no forward rule, and the tangent came out of it lost (a review: 97% off, no error).
        # It is linear: the tangent goes the same way. Every rank sends one, zeros if none.
        primal, tangent = forward_ad.unpack_dual(x)
        out = funcol.all_to_all_single_autograd(primal, out_splits, in_splits, group)
        if tangent is None:
            tangent = torch.zeros_like(primal)
        moved = funcol.all_to_all_single_autograd(tangent, out_splits, in_splits, group)
        return forward_ad.make_dual(out, moved)
    return funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)


class AllToAllDispatcher:
    """Expert parallel over the 1-D `ep_mesh`: rank r owns experts `[r*E_l, (r+1)*E_l)`.

    One host sync per `dispatch`: the all-to-all split sizes.
    """

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        if ep_mesh.ndim != 1:
            raise ValueError(
                f"AllToAllDispatcher: ep_mesh must be 1-D, got {ep_mesh.ndim}-D "
                f"{ep_mesh.mesh_dim_names}"
            )
        self.ep_mesh = ep_mesh

    @property
    def group(self) -> dist.ProcessGroup:
        return self.ep_mesh.get_group()

    def dispatch(self, x: Tensor, routing: Routing) -> tuple[Tensor, Tensor, _AllToAllHandle]:
        world = self.ep_mesh.size()
        counts = routing.counts
        num_experts = counts.numel()
        if num_experts % world != 0:
            raise ValueError(
                f"MoE: num_experts={num_experts} is not divisible by the EP degree {world}"
            )
        local = num_experts // world
        x_sorted, perm = _permute(x, routing)
        group = self.group
        # counts is laid out [dest rank, local expert]; after the exchange recv_counts is
        # [source rank, local expert]: how many rows each rank sends to each of my experts.
        recv_counts = funcol.all_to_all_single(counts, None, None, group).view(world, local)
        send_splits, recv_splits = torch.stack(
            [counts.view(world, local).sum(1), recv_counts.sum(1)]
        ).tolist()  # the one host sync of the layer
        x_recv = _all_to_all(x_sorted, recv_splits, send_splits, group)
        # Received rows are ordered (source rank, local expert); the grouped GEMM wants them
        # grouped by local expert. A stable sort on the local expert id keeps the source order.
        local_ids = torch.arange(local, device=counts.device).repeat(world)
        local_ids = local_ids.repeat_interleave(
            recv_counts.reshape(-1), output_size=sum(recv_splits)
        )
        order = torch.argsort(local_ids, stable=True)
        offs = torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)
        handle = _AllToAllHandle(perm, order, send_splits, recv_splits)
        return x_recv[order], offs, handle

    def combine(self, y: Tensor, handle: _AllToAllHandle) -> Tensor:
        y_recv = y[_inverse_permutation(handle.order)]
        y_sorted = _all_to_all(y_recv, handle.send_splits, handle.recv_splits, self.group)
        return _unpermute(y_sorted, handle.perm)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep={self.ep_mesh.size()})"


def default_dispatcher(ep_mesh: DeviceMesh | None) -> Dispatcher:
    """`AllToAllDispatcher(ep_mesh)`, or `LocalDispatcher()` when `ep_mesh` is None."""
    return LocalDispatcher() if ep_mesh is None else AllToAllDispatcher(ep_mesh)


def routed_experts_forward(
    x: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    num_experts: int,
    compute: Callable[[Tensor, Tensor], Tensor],
    ep_mesh: DeviceMesh | None = None,
    dispatcher: Dispatcher | None = None,
) -> Tensor:
    """Dispatch tokens to their experts, run them, combine.

    Args:
        x: `[T, H]` tokens of this rank.
        expert_ids: `[T, k]` int64 chosen experts (global ids). weights: `[T, k]` their weights.
        num_experts: E, the global expert count.
        compute: `(x_grouped [S, H], offs [E_local] int32) -> [S, H]`, the experts on this rank.
        ep_mesh: the EP mesh, or None to run all experts here (ignored when `dispatcher` is set).
        dispatcher: the dispatcher to use; default `default_dispatcher(ep_mesh)`.

    Returns:
        `[T, H]`: `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, in x's dtype.
    """
    if dispatcher is None:
        dispatcher = default_dispatcher(ep_mesh)
    routing = Routing.from_topk(expert_ids, weights, num_experts)
    local_x, offs, handle = dispatcher.dispatch(x, routing)
    return dispatcher.combine(compute(local_x, offs), handle)
