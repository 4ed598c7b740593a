"""grouped_ep.gemm with DTensor expert weights on a 2-rank gloo mesh vs a single-process run."""

from __future__ import annotations

import pytest
import torch
from _dist import RankError, run_ranks
from _gemm_ref import assert_close, gemm_ref, offsets, wgrad_ref

E, K, N = 6, 12, 10
SIZES = [5, 0, 3, 9, 1, 4]  # expert 1 gets no tokens


def _full_problem(trans_w: bool):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(E, *((N, K) if trans_w else (K, N)), generator=g, dtype=torch.float64)
    x = torch.randn(sum(SIZES), K, generator=g, dtype=torch.float64)
    dy = torch.randn(sum(SIZES), N, generator=g, dtype=torch.float64)
    return x, w, dy


def _ep_rank(rank: int, world: int, trans_w: bool):
    """Rank r owns experts [r*E/world, (r+1)*E/world) and the tokens routed to them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import grouped_ep

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    x, w, dy = _full_problem(trans_w)
    per = E // world
    lo, hi = rank * per, (rank + 1) * per
    ends = offsets(SIZES).tolist()
    row_lo, row_hi = (ends[lo - 1] if lo else 0), ends[hi - 1]

    w_dt = DTensor.from_local(w[lo:hi].clone(), mesh, [Shard(0)]).requires_grad_(True)
    assert w_dt.shape == w.shape  # the global view is the full expert stack
    x_local = x[row_lo:row_hi].clone().requires_grad_(True)
    offs_local = offsets(SIZES[lo:hi])
    out = grouped_ep.gemm(x_local, w_dt, offs_local, trans_w=trans_w)
    assert not isinstance(out, DTensor)  # tokens stay plain tensors
    out.backward(dy[row_lo:row_hi])

    grad = w_dt.grad
    assert isinstance(grad, DTensor), type(grad)
    assert grad.placements == w_dt.placements and grad.device_mesh == mesh
    full_grad = grad.full_tensor()  # a collective: every rank's shard, stitched
    dist.barrier()
    return out.detach(), x_local.grad, full_grad


@pytest.mark.parametrize("trans_w", [False, True], ids=["w_KN", "w_NK"])
def test_dtensor_shard0_matches_single_process(trans_w):
    results = run_ranks(_ep_rank, 2, trans_w, timeout=120)
    x, w, dy = _full_problem(trans_w)
    offs = offsets(SIZES)
    out_ref = gemm_ref(x, w, offs, trans_w)
    dx_ref = gemm_ref(dy, w, offs, not trans_w)
    dw_ref = wgrad_ref(x, dy, offs, trans_w)
    out = torch.cat([r[0] for r in results])
    dx = torch.cat([r[1] for r in results])
    assert_close(out, out_ref, torch.float64)
    assert_close(dx, dx_ref, torch.float64)
    for _, _, full_grad in results:
        assert_close(full_grad, dw_ref, torch.float64)
    assert torch.all(dw_ref[1] == 0) and torch.all(results[0][2][1] == 0)  # expert without tokens


def _replicated_and_bad(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import grouped_ep

    mesh = init_device_mesh("cpu", (world,))
    x, w, dy = _full_problem(False)
    offs = offsets(SIZES)
    w_rep = distribute_tensor(w, mesh, [Replicate()]).requires_grad_(True)
    out = grouped_ep.gemm(x, w_rep, offs)
    out.backward(dy)
    assert isinstance(w_rep.grad, DTensor) and w_rep.grad.placements == (Replicate(),)
    assert_close(out, gemm_ref(x, w, offs), torch.float64)
    assert_close(w_rep.grad.to_local(), wgrad_ref(x, dy, offs), torch.float64)

    errors = []
    w_bad = distribute_tensor(w, mesh, [Shard(1)])
    try:
        grouped_ep.gemm(x[:, : K // world], w_bad, offs)
    except ValueError as e:
        errors.append(str(e))
    x_dt = distribute_tensor(x, mesh, [Replicate()])
    try:
        grouped_ep.gemm(x_dt, w_rep, offs)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_dtensor_replicate_and_clear_errors():
    for errors in run_ranks(_replicated_and_bad, 2, timeout=120):
        assert len(errors) == 2
        assert "w is a DTensor with placements (Shard(dim=1),)" in errors[0]
        assert "Only Shard(0)" in errors[0]
        assert "x is a DTensor" in errors[1]


def test_run_ranks_reports_failing_rank():
    # The harness itself must surface a rank's exception, not hang or pass silently.
    with pytest.raises(RankError, match="rank 1 raised"):
        run_ranks(_fails_on_rank_1, 2, timeout=60)


def _fails_on_rank_1(rank: int, world: int):
    if rank == 1:
        raise ValueError("boom")
    return rank
