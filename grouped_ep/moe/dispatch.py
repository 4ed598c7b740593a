"""Token dispatch for MoE layers: permute tokens into expert order, run the experts here or on
the ranks that own them (expert parallel, `all_to_all_single`), and combine the results.

Expert parallel (EP): rank r of the EP mesh owns experts `[r*E_l, (r+1)*E_l)`. Each routed
token copy goes to its expert's rank and comes back the same way, autograd flowing through both
all-to-alls. One host sync per layer: the split sizes of the exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["routed_experts_forward"]


def _inverse_permutation(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def _ep_group(ep_mesh: DeviceMesh) -> dist.ProcessGroup:
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be 1-D, got {ep_mesh.ndim}-D {ep_mesh.mesh_dim_names}")
    return ep_mesh.get_group()


def _expert_parallel(
    x_sorted: Tensor,
    counts: Tensor,
    ep_mesh: DeviceMesh,
    compute: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """Send grouped tokens to the ranks owning their experts, compute there, bring results back.

    x_sorted: `[S, H]` this rank's routed tokens sorted by global expert id. counts: `[E]` int64
    tokens per global expert. Rank r owns experts `[r*E_l, (r+1)*E_l)`.

    One host sync: the split sizes of the two all-to-alls (how many rows go to and come from
    each rank) are read back to the host once, with a single `.tolist()`.
    """
    group = _ep_group(ep_mesh)
    world = ep_mesh.size()
    num_experts = counts.numel()
    if num_experts % world != 0:
        raise ValueError(
            f"MoE: num_experts={num_experts} is not divisible by the EP degree {world}"
        )
    local = num_experts // world
    # counts is laid out [dest rank, local expert]; after the exchange recv_counts is
    # [source rank, local expert]: how many rows each rank sends to each of my experts.
    recv_counts = funcol.all_to_all_single(counts, None, None, group).view(world, local)
    send_splits, recv_splits = torch.stack(
        [counts.view(world, local).sum(1), recv_counts.sum(1)]
    ).tolist()  # the one host sync of the layer

    x_recv = funcol.all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
    # Received rows are ordered (source rank, local expert); the grouped GEMM wants them
    # grouped by local expert. A stable sort on the local expert id keeps the source order.
    recv_total = sum(recv_splits)
    local_ids = torch.arange(local, device=counts.device).repeat(world)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=recv_total)
    order = torch.argsort(local_ids, stable=True)
    offs = torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)
    y_local = compute(x_recv[order], offs)
    y_recv = y_local[_inverse_permutation(order)]
    return funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)


def routed_experts_forward(
    x: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    num_experts: int,
    compute: Callable[[Tensor, Tensor], Tensor],
    ep_mesh: DeviceMesh | None = None,
) -> Tensor:
    """Permute tokens to expert order, run the experts (locally or over EP), combine.

    Args:
        x: `[T, H]` tokens of this rank.
        expert_ids: `[T, k]` int64 chosen experts (global ids). weights: `[T, k]` their weights.
        num_experts: E, the global expert count.
        compute: `(x_grouped [S, H], offs [E_local] int32) -> [S, H]`, the experts on this rank.
        ep_mesh: the EP mesh, or None to run all experts here.

    Returns:
        `[T, H]`: `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, in x's dtype.
    """
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    # Stable: the rows of one expert keep token order, so results do not depend on the sort.
    order = torch.argsort(flat_ids, stable=True)
    x_sorted = x[order // top_k]
    # scatter_add instead of bincount: no host sync for the max id on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    if ep_mesh is None:
        y_sorted = compute(x_sorted, torch.cumsum(counts, 0, dtype=torch.int32))
    else:
        y_sorted = _expert_parallel(x_sorted, counts, ep_mesh, compute)
    y = y_sorted[_inverse_permutation(order)].view(num_tokens, top_k, y_sorted.shape[-1])
    # Weighted sum over the k choices: deterministic, unlike index_add_ with repeated indices.
    # In the promoted dtype (fp32 weights with bf16 tokens sum in fp32), as transformers does.
    return (y * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
