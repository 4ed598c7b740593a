"""Public wrappers, fake kernels and autograd for the grouped_ep ops.

Per op one block: a typed wrapper, `register_fake` (shapes and dtypes only), and
`register_autograd` whose backward calls other registered ops.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

_ops = torch.ops.grouped_ep


# ---- DTensor weights ------------------------------------------------------------------------------
# Expert weights in an EP model are DTensors sharded on the expert dim (`Shard(0)`) of the EP
# mesh, or replicated. The op runs on the local shard: `local_weight` unwraps it with a
# differentiable `to_local`, whose backward wraps the local weight gradient back into a DTensor
# with the weight's own mesh and placements. Model code never calls `.to_local()` itself.


def check_weight_placements(w: DTensor, name: str = "w") -> None:
    """Raise unless every placement of `w` is Shard(0) (the expert dim) or Replicate()."""
    for mesh_dim, p in enumerate(w.placements):
        if isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0):
            continue
        raise ValueError(
            f"grouped_ep.gemm: {name} is a DTensor with placements {tuple(w.placements)} on mesh "
            f"dims {w.device_mesh.mesh_dim_names or tuple(range(w.device_mesh.ndim))}; mesh dim "
            f"{mesh_dim} has {p}. Only Shard(0) (experts split across ranks) or Replicate() can be "
            "computed on the local shard. Gather other shardings first (FSDP does this in forward)."
        )


def local_weight(w: torch.Tensor, name: str = "w") -> torch.Tensor:
    """The local expert shard of `w` (a DTensor) or `w` itself (a plain tensor)."""
    if not isinstance(w, DTensor):
        return w
    check_weight_placements(w, name)
    # grad_placements default to the forward placements: the weight gradient comes back as a
    # DTensor with w's own spec.
    return w.to_local()


def check_plain(t: torch.Tensor, name: str) -> None:
    if isinstance(t, DTensor):
        raise ValueError(
            f"grouped_ep.gemm: {name} is a DTensor; pass this rank's local tokens as a plain tensor "
            "(only the expert weight w may be a DTensor)"
        )


# ---- gemm ----------------------------------------------------------------------------------------


def gemm(x: Tensor, w: Tensor, offs: Tensor, *, trans_w: bool = False) -> Tensor:
    """Grouped matrix product: group g's rows of `x` times expert g's weight.

    Args:
        x: `[T, K]`, rows grouped by expert (expert 0's rows first). A plain tensor.
        w: `[E, K, N]`, or `[E, N, K]` with `trans_w=True` (the nn.Linear / Hugging Face layout,
            used without a copy). A plain tensor, or a DTensor sharded on the expert dim
            (`Shard(0)`) or replicated: then E is the local expert count and the op runs on the
            local shard; the weight gradient comes back as a DTensor with the same spec.
        offs: `[E]` int32 (int64 accepted), cumulative end offsets on x's device: group g is
            rows `offs[g-1]:offs[g]`. Empty groups are allowed; rows past `offs[-1]` give zeros.
            On CPU, decreasing offsets or `offs[-1] > T` raise. On CUDA the host never reads
            `offs` (that would sync): such values are clamped on the device to
            `min(max(offs[g], offs[g-1]), T)`, so they can never read or write out of bounds.
        trans_w: whether `w` is `[E, N, K]`.

    Returns:
        `[T, N]` in x's dtype, accumulated in fp32 (fp64 for fp64 inputs).
    """
    check_plain(x, "x")
    check_plain(offs, "offs")
    return _ops.gemm(x, local_weight(w), offs, trans_w)


def _check_offs_meta(op: str, offs: Tensor, groups: int | None, x: Tensor) -> None:
    """`groups`: the count offs must match (w's E), or None where offs itself defines it."""
    torch._check(
        offs.dim() == 1, lambda: f"grouped_ep.{op}: offs must be 1-D [E], got {offs.dim()}-D"
    )
    torch._check(
        offs.dtype in (torch.int32, torch.int64),
        lambda: f"grouped_ep.{op}: offs must be int32 or int64, got {offs.dtype}",
    )
    torch._check(
        groups is None or offs.shape[0] == groups,
        lambda: f"grouped_ep.{op}: offs has length {offs.shape[0]} but w has {groups} groups",
    )
    torch._check(
        offs.device == x.device,
        lambda: f"grouped_ep.{op}: offs is on {offs.device} but x is on {x.device}",
    )


@torch.library.register_fake("grouped_ep::gemm")
def _gemm_fake(x: Tensor, w: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    torch._check(x.dim() == 2, lambda: f"grouped_ep.gemm: x must be 2-D [T, K], got {x.dim()}-D")
    torch._check(w.dim() == 3, lambda: f"grouped_ep.gemm: w must be 3-D, got {w.dim()}-D")
    torch._check(
        w.dtype == x.dtype, lambda: f"grouped_ep.gemm: w has dtype {w.dtype} but x has {x.dtype}"
    )
    torch._check(
        w.device == x.device, lambda: f"grouped_ep.gemm: w is on {w.device} but x is on {x.device}"
    )
    k, n = (w.shape[2], w.shape[1]) if trans_w else (w.shape[1], w.shape[2])
    torch._check(k == x.shape[1], lambda: f"grouped_ep.gemm: x has K={x.shape[1]} but w has K={k}")
    _check_offs_meta("gemm", offs, w.shape[0], x)
    return x.new_empty((x.shape[0], n))


def _gemm_setup_context(ctx, inputs, output) -> None:
    x, w, offs, trans_w = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.trans_w = trans_w


def _gemm_backward(ctx, dy: Tensor):
    x, w, offs = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # dx_g = dy_g @ w_g^T: the same op with w read the other way round.
        dx = _ops.gemm(dy, w, offs, not ctx.trans_w)
    if ctx.needs_input_grad[1]:
        dw = _ops.gemm_wgrad(x, dy, offs, ctx.trans_w)
    return dx, dw, None, None


torch.library.register_autograd(
    "grouped_ep::gemm", _gemm_backward, setup_context=_gemm_setup_context
)


# ---- gemm_wgrad ----------------------------------------------------------------------------------


def gemm_wgrad(x: Tensor, dy: Tensor, offs: Tensor, *, trans_w: bool = False) -> Tensor:
    """Weight gradient of `gemm`, the "ragged K" product, one output per group.

    Args:
        x: `[T, K]`, dy: `[T, N]`, rows grouped by expert as in `gemm`.
        offs: `[E]` cumulative end offsets (int32 or int64) on x's device.
        trans_w: layout of the result, matching `gemm`'s `w`.

    Returns:
        `[E, K, N]` with `out[g] = x_g^T @ dy_g`, or `[E, N, K]` (`dy_g^T @ x_g`) with
        `trans_w=True`. Groups with no rows give exact zeros.
    """
    return _ops.gemm_wgrad(x, dy, offs, trans_w)


@torch.library.register_fake("grouped_ep::gemm_wgrad")
def _gemm_wgrad_fake(x: Tensor, dy: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    torch._check(x.dim() == 2, lambda: f"grouped_ep.gemm_wgrad: x must be 2-D, got {x.dim()}-D")
    torch._check(dy.dim() == 2, lambda: f"grouped_ep.gemm_wgrad: dy must be 2-D, got {dy.dim()}-D")
    torch._check(
        dy.shape[0] == x.shape[0],
        lambda: f"grouped_ep.gemm_wgrad: dy has {dy.shape[0]} rows but x has {x.shape[0]}",
    )
    torch._check(
        dy.device == x.device,
        lambda: f"grouped_ep.gemm_wgrad: dy is on {dy.device} but x is on {x.device}",
    )
    _check_offs_meta("gemm_wgrad", offs, None, x)
    e, k, n = offs.shape[0], x.shape[1], dy.shape[1]
    return x.new_empty((e, n, k) if trans_w else (e, k, n))


def _wgrad_setup_context(ctx, inputs, output) -> None:
    x, dy, offs, trans_w = inputs
    ctx.save_for_backward(x, dy, offs)
    ctx.trans_w = trans_w


def _wgrad_backward(ctx, grad: Tensor):
    # out_g = x_g^T dy_g  ([K, N]):  d x_g = dy_g grad_g^T,  d dy_g = x_g grad_g.
    # out_g = dy_g^T x_g  ([N, K]):  d x_g = dy_g grad_g,    d dy_g = x_g grad_g^T.
    x, dy, offs = ctx.saved_tensors
    dx = ddy = None
    if ctx.needs_input_grad[0]:
        dx = _ops.gemm(dy, grad, offs, not ctx.trans_w)
    if ctx.needs_input_grad[1]:
        ddy = _ops.gemm(x, grad, offs, ctx.trans_w)
    return dx, ddy, None, None


torch.library.register_autograd(
    "grouped_ep::gemm_wgrad", _wgrad_backward, setup_context=_wgrad_setup_context
)
