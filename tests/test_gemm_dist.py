"""`torch.ops.grouped_ep.gemm` itself on DTensor expert weights, on gloo meshes of 2 and 4 ranks,
against an fp64 reference of each rank's local problem. Every rank has different tokens."""

from __future__ import annotations

import pytest
import torch
from _dist import RankError, run_ranks
from _gemm_ref import assert_close, gemm_ref, offsets, wgrad_ref

E, K, N = 6, 12, 10
SIZES = [5, 0, 3, 9, 1, 4]  # tokens per expert on data-parallel rank 0; expert 1 gets none


def _problem(dp_rank: int, trans_w: bool):
    """The weights (the same everywhere) and data-parallel rank `dp_rank`'s tokens."""
    w = torch.randn(
        E, *((N, K) if trans_w else (K, N)), generator=torch.Generator().manual_seed(7),
        dtype=torch.float64,
    )  # fmt: skip
    g = torch.Generator().manual_seed(100 + dp_rank)
    sizes = SIZES if dp_rank == 0 else [s + dp_rank for s in reversed(SIZES)]
    x = torch.randn(sum(sizes), K, generator=g, dtype=torch.float64)
    dy = torch.randn(sum(sizes), N, generator=g, dtype=torch.float64)
    return w, x, dy, sizes


def _rows_of(sizes: list[int], lo: int, hi: int) -> slice:
    ends = offsets(sizes).tolist()
    return slice(ends[lo - 1] if lo else 0, ends[hi - 1])


def _ep_rank(rank: int, world: int, dp: int, trans_w: bool):
    """Mesh ("ep",) when dp == 1, else ("dp", "ep"); rank (d, e) owns experts [e*E/ep, ...) and
    the tokens of data-parallel rank d routed to them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import grouped_ep  # noqa: F401  (registers the op)

    ep = world // dp
    if dp == 1:
        mesh, placements, d, e = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)), [Shard(0)], 0, rank  # fmt: skip
    else:
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
        placements, (d, e) = [Replicate(), Shard(0)], divmod(rank, ep)
    w, x, dy, sizes = _problem(d, trans_w)
    lo, hi = e * E // ep, (e + 1) * E // ep
    rows = _rows_of(sizes, lo, hi)
    w_dt = DTensor.from_local(w[lo:hi].clone(), mesh, placements, run_check=False)
    w_dt.requires_grad_(True)
    assert w_dt.shape == w.shape  # the global view is the full expert stack
    x_local = x[rows].clone().requires_grad_(True)
    offs_local = offsets(sizes[lo:hi])

    out = torch.ops.grouped_ep.gemm(x_local, w_dt, offs_local, trans_w)
    assert type(out) is torch.Tensor  # plain tokens in, plain tokens out
    out.backward(dy[rows])
    assert type(x_local.grad) is torch.Tensor
    grad = w_dt.grad
    assert isinstance(grad, DTensor) and grad.device_mesh == mesh, type(grad)
    want = [Partial() if isinstance(p, Replicate) else p for p in placements]
    assert list(grad.placements) == want, grad.placements

    local_w = w[lo:hi]
    assert_close(out.detach(), gemm_ref(x[rows], local_w, offs_local, trans_w), torch.float64)
    dx_ref = gemm_ref(dy[rows], local_w, offs_local, not trans_w)
    assert_close(x_local.grad, dx_ref, torch.float64)
    assert_close(grad.to_local(), wgrad_ref(x[rows], dy[rows], offs_local, trans_w), torch.float64)
    return grad.full_tensor()  # a collective: experts stitched, dp partial sums added


@pytest.mark.parametrize("trans_w", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("dp,world", [(1, 2), (2, 4)], ids=["ep_mesh", "dp_ep_mesh"])
def test_raw_op_on_shard0_weight(dp, world, trans_w):
    full_grads = run_ranks(_ep_rank, world, dp, trans_w, timeout=180)
    want = sum(
        wgrad_ref(x, dy, offsets(sizes), trans_w)
        for w, x, dy, sizes in (_problem(d, trans_w) for d in range(dp))
    )
    for g in full_grads:
        assert_close(g, want, torch.float64)
    assert torch.all(full_grads[0][1] == 0) == (dp == 1)  # expert 1 has tokens only on dp rank 1


def _replicated(rank: int, world: int):
    """A replicated weight, different tokens per rank: the gradient is Partial, and replicas
    stepped with its reduced value stay identical."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    import grouped_ep  # noqa: F401

    mesh = init_device_mesh("cpu", (world,))
    w, x, dy, sizes = _problem(rank, False)
    offs = offsets(sizes)
    w_rep = distribute_tensor(w, mesh, [Replicate()]).requires_grad_(True)
    out = torch.ops.grouped_ep.gemm(x, w_rep, offs, False)
    out.backward(dy)
    assert w_rep.grad.placements == (Partial(),), w_rep.grad.placements
    assert_close(out, gemm_ref(x, w, offs), torch.float64)
    assert_close(w_rep.grad.to_local(), wgrad_ref(x, dy, offs), torch.float64)
    reduced = w_rep.grad.redistribute(placements=[Replicate()])
    with torch.no_grad():
        w_rep -= 0.1 * reduced
    return reduced.to_local(), w_rep.to_local()


def test_replicated_weight_gets_partial_gradient():
    (g0, w0), (g1, w1) = run_ranks(_replicated, 2, timeout=120)
    want = sum(wgrad_ref(x, dy, offsets(s)) for _, x, dy, s in (_problem(r, False) for r in (0, 1)))
    assert_close(g0, want, torch.float64)
    assert torch.equal(g0, g1) and torch.equal(w0, w1)  # replicas stay replicas


def _errors_and_dtensor_tokens(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import grouped_ep  # noqa: F401

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    w, x, dy, sizes = _problem(0, False)
    offs = offsets(sizes)
    errors = []
    w_bad = distribute_tensor(w, mesh, [Shard(1)])
    for args in ((x[:, : K // world], w_bad, offs), (distribute_tensor(x, mesh, [Shard(1)]), w, offs)):  # fmt: skip
        try:
            torch.ops.grouped_ep.gemm(*args, False)
        except ValueError as e:
            errors.append(str(e))
    # offs sharded like the weight: a slice of global offsets is not this rank's offsets (it
    # was taken as them, silently: wrong rows on rank 1). A weight on a mesh without this rank.
    global_offs = torch.arange(1, 2 * world + 1, dtype=torch.int32)
    solo = torch.distributed.device_mesh.DeviceMesh("cpu", [0], mesh_dim_names=("solo",))
    w_solo = DTensor.from_local(w if rank == 0 else w[:0], solo, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride())  # fmt: skip
    for args in ((x, distribute_tensor(w, mesh, [Shard(0)]), distribute_tensor(global_offs, mesh, [Shard(0)])), (x, w_solo, offs)):  # fmt: skip
        try:
            torch.ops.grouped_ep.gemm(*args, False)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    # One offset per global expert of a Shard(0) weight: named as the local count (the plain
    # op's "w has 2 groups" contradicted w.shape).
    try:
        torch.ops.grouped_ep.gemm(x, distribute_tensor(w, mesh, [Shard(0)]), offs, False)
        errors.append("")
    except ValueError as e:
        errors.append(str(e))
    # Tokens as a DTensor Shard(0): its local rows are this rank's; the output keeps its spec.
    x_dt = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
    out = torch.ops.grouped_ep.gemm(x_dt, w, offs, False)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    assert out.shape == (world * x.shape[0], N)
    assert_close(out.to_local(), gemm_ref(x, w, offs), torch.float64)
    # ... and a plain weight gets a plain gradient, this rank's own rows' sum (it was a Partial
    # DTensor on the plain parameter, which the optimizer step then refused).
    w_plain = torch.nn.Parameter(w.clone())
    torch.ops.grouped_ep.gemm(x_dt, w_plain, offs, False).to_local().backward(dy)
    assert type(w_plain.grad) is torch.Tensor, type(w_plain.grad)
    assert_close(w_plain.grad, wgrad_ref(x, dy, offs), torch.float64)
    torch.optim.SGD([w_plain], lr=0.1).step()
    return errors


def test_bad_placements_name_argument_placement_and_mesh_dim():
    for rank, errors in enumerate(run_ranks(_errors_and_dtensor_tokens, 2, timeout=120)):
        assert len(errors) == 5
        local = f"offs has length {len(SIZES)} but this rank's shard of w holds {len(SIZES) // 2} of its {len(SIZES)} experts"
        assert local in errors[4] and "per local expert" in errors[4], errors[4]
        assert "w is a DTensor with placement Shard(dim=1) on mesh dim 0 ('ep')" in errors[0]
        assert "x is a DTensor with placement Shard(dim=1) on mesh dim 0 ('ep')" in errors[1]
        assert "offs is a DTensor with placement Shard(dim=0) on mesh dim 0 ('ep')" in errors[2]
        assert "Replicate() DTensor" in errors[2]
        if rank == 0:
            assert errors[3] == ""  # rank 0 is the weight's mesh: it computes
        else:
            assert (
                "w is a DTensor on" in errors[3] and "does not include this rank (1)" in errors[3]
            )


def _compiled(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import grouped_ep  # noqa: F401

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    w, x, dy, sizes = _problem(0, True)
    lo, hi = rank * E // world, (rank + 1) * E // world
    rows = _rows_of(sizes, lo, hi)
    offs = offsets(sizes[lo:hi])

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shard = DTensor.from_local(w[lo:hi].clone(), mesh, [Shard(0)], run_check=False)
            self.w = torch.nn.Parameter(shard)

        def forward(self, x, offs):
            return torch.nn.functional.silu(torch.ops.grouped_ep.gemm(x, self.w, offs, True))

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        module = Experts()
        fn = torch.compile(module, fullgraph=True) if compiled else module
        xi = x[rows].clone().requires_grad_(True)
        out = fn(xi, offs)
        out.backward(dy[rows])
        results.append((out.detach(), xi.grad, module.w.grad.to_local(), module.w.grad.placements))
    return results


def test_compile_fullgraph_on_dtensor_weight_matches_eager():
    for eager, compiled in run_ranks(_compiled, 2, timeout=300):
        for a, b in zip(eager[:3], compiled[:3]):
            assert_close(b, a, torch.float64)
        assert eager[3] == compiled[3]


def test_run_ranks_reports_failing_rank():
    # The harness itself must surface a rank's exception, not hang or pass silently.
    with pytest.raises(RankError, match="rank 1 raised"):
        run_ranks(_fails_on_rank_1, 2, timeout=60)


def _fails_on_rank_1(rank: int, world: int):
    if rank == 1:
        raise ValueError("boom")
    return rank


def _loss_on_dtensor_output(rank: int, world: int):
    """The loss taken on the DTensor output itself (`y.sum()`), not on `y.to_local()`: dy then
    arrives Replicate(), and before it was read as this rank's rows (rank 1's dx was zeros, or
    gemm_wgrad refused 'dy has 6 rows but x has 3'); x and w Replicate() gave a weight gradient
    counted once per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import grouped_ep  # noqa: F401

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    w, x, dy, sizes = _problem(0, False)
    offs = offsets(sizes)
    mine = slice(rank * 3, rank * 3 + 3)  # global rows: [x; x + 1], 3 per rank, one group
    xs = torch.cat([x[:3], x[:3] + 1])
    w1 = w[:1]
    out = {}
    for w_kind in ("plain", "replicate"):
        x_dt = DTensor.from_local(xs[mine].clone(), mesh, [Shard(0)], run_check=False)
        x_dt.requires_grad_(True)
        wp = w1.clone()
        wp = DTensor.from_local(wp, mesh, [Replicate()]) if w_kind == "replicate" else wp
        wp.requires_grad_(True)
        y = torch.ops.grouped_ep.gemm(x_dt, wp, torch.tensor([3], dtype=torch.int32), False)
        y.sum().backward()
        assert x_dt.grad.placements == (Shard(0),), x_dt.grad.placements
        gw = wp.grad.full_tensor() if isinstance(wp.grad, DTensor) else wp.grad
        out[w_kind] = (x_dt.grad.to_local(), gw)
    # x and w both Replicate(): the same rows on every rank, a Replicate() gradient once.
    x_rep = DTensor.from_local(x.clone(), mesh, [Replicate()]).requires_grad_(True)
    w_rep = DTensor.from_local(w.clone(), mesh, [Replicate()]).requires_grad_(True)
    torch.ops.grouped_ep.gemm(x_rep, w_rep, offs, False).sum().backward()
    assert w_rep.grad.placements == (Replicate(),), w_rep.grad.placements
    out["both_replicate"] = (x_rep.grad.to_local(), w_rep.grad.full_tensor())
    # x Replicate() against experts split over the same mesh dim has no meaning: refused.
    w_sh = DTensor.from_local(w[rank * 3 : rank * 3 + 3].clone(), mesh, [Shard(0)])
    try:
        torch.ops.grouped_ep.gemm(x_rep, w_sh, offs[:3], False)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    # x on a 1-D submesh of w's 2-D mesh: the placement rules above cannot be applied across
    # meshes (the gradient came back Partial on both dims, world_size times too large).
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    w_2d = DTensor.from_local(w.clone(), mesh2, [Replicate(), Replicate()])
    x_ep = DTensor.from_local(x.clone(), mesh2["ep"], [Replicate()])
    try:
        torch.ops.grouped_ep.gemm(x_ep, w_2d, offs, False)
        out["other_mesh"] = None
    except ValueError as e:
        out["other_mesh"] = str(e)
    # Replicate() x against Shard(0) w on a dim of one rank (ep=1): every expert is there, so
    # this is no "same rows, other experts" case; it was refused.
    mesh_ep1 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))
    w_ep1 = DTensor.from_local(w.clone(), mesh_ep1, [Replicate(), Shard(0)])
    x_ep1 = DTensor.from_local(x.clone(), mesh_ep1, [Shard(0), Replicate()])
    out["ep1"] = torch.ops.grouped_ep.gemm(x_ep1, w_ep1, offs, False).to_local()
    return out


def test_loss_on_dtensor_output_gives_the_right_gradients():
    w, x, dy, sizes = _problem(0, False)
    xs, w1 = torch.cat([x[:3], x[:3] + 1]), w[:1]
    ones = torch.ones(3, N, dtype=torch.float64)
    for rank, out in enumerate(run_ranks(_loss_on_dtensor_output, 2, timeout=120)):
        for kind in ("plain", "replicate"):
            dx, gw = out[kind]
            assert_close(dx, ones @ w1[0].T, torch.float64)
            # plain w: this rank's rows' sum; Replicate() w: Partial, summed over both ranks
            rows = xs[rank * 3 : rank * 3 + 3] if kind == "plain" else xs
            assert_close(
                gw[0], rows.T @ torch.ones(rows.shape[0], N, dtype=torch.float64), torch.float64
            )
        dx, gw = out["both_replicate"]
        offs = offsets(sizes)
        assert_close(
            dx,
            gemm_ref(torch.ones(x.shape[0], N, dtype=torch.float64), w, offs, True),
            torch.float64,
        )
        assert_close(
            gw, wgrad_ref(x, torch.ones(x.shape[0], N, dtype=torch.float64), offs), torch.float64
        )
        assert "x is Replicate() on mesh dim 0 ('ep'), where w is Shard(0)" in out["error"]
        assert "x is a DTensor on DeviceMesh" in out["other_mesh"], out["other_mesh"]
        assert "Pass x on w's mesh" in out["other_mesh"]
        assert_close(out["ep1"], gemm_ref(x, w, offsets(sizes), False), torch.float64)
