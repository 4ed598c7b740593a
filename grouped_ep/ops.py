"""The Python side of the grouped_ep ops: typed aliases, fake kernels, autograd, DTensor rules.

Per op one block: a typed alias of `torch.ops.grouped_ep.<op>`, `register_fake` (shapes and
dtypes only), and `register_autograd` whose backward calls other registered ops.

DTensor arguments are handled by the op itself, through torch's extension point for tensor
subclasses, `torch.library.register_torch_dispatch(op, DTensor, rule)`: when any argument is a
DTensor, the rule runs below autograd, computes on the local tensors and wraps the result. Model
code calls `torch.ops.grouped_ep.gemm(x, w, offs, True)` with `w` an expert weight as it lives in
the sharded model (`Shard(0)` on the expert dim, or `Replicate()`, on a 1-D or 2-D mesh), and
never calls `.to_local()`. The backward wraps the local weight gradient with `w`'s mesh:
`Shard(0)` stays `Shard(0)`; a `Replicate()` dim becomes `Partial()` (each rank's gradient holds
only its own tokens' contribution; labelling it `Replicate` would let replicas drift apart).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from grouped_ep._op_autograd import register_autograd

_ops = torch.ops.grouped_ep

__all__ = ["gemm", "gemm_wgrad"]


# ---- DTensor rules ----------------------------------------------------------------------------


def _mesh_dims(t: DTensor) -> tuple:
    mesh = t.device_mesh
    return mesh.mesh_dim_names or tuple(range(mesh.ndim))


def _check_placements(op: str, name: str, t: DTensor, allowed: str | None) -> None:
    """Raise unless every placement of `t` is Shard(0) (where `allowed` says what a shard
    holds; None: offsets, which a shard cannot hold) or Replicate()."""
    for mesh_dim, p in enumerate(t.placements):
        shard0 = isinstance(p, Shard) and p.dim == 0
        if isinstance(p, Replicate) or (shard0 and (allowed or t.device_mesh.size(mesh_dim) == 1)):
            continue
        where = f"on mesh dim {mesh_dim} ({_mesh_dims(t)[mesh_dim]!r}) of {tuple(t.placements)}"
        if allowed is None:
            raise ValueError(
                f"grouped_ep.{op}: {name} is a DTensor with placement {p!r} {where}; {name} "
                "holds this rank's cumulative row offsets for its own experts"
                + (
                    ", which a slice of global offsets is not (they count from other ranks' rows)"
                    if isinstance(p, Shard)
                    else ""
                )
                + ". Pass a plain tensor of this rank's offsets, or a Replicate() DTensor of them."
            )
        raise ValueError(
            f"grouped_ep.{op}: {name} is a DTensor with placement {p!r} {where}; only Shard(0) "
            f"({allowed}) or Replicate() can be computed on the local shard. Gather other "
            "shardings first (FSDP does this in forward)."
        )


def _local(op: str, name: str, t: Tensor, allowed: str | None) -> Tensor:
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.get_coordinate() is None:
        raise ValueError(
            f"grouped_ep.{op}: {name} is a DTensor on {t.device_mesh}, which does not include "
            f"this rank ({torch.distributed.get_rank()}): it holds no part of {name} here. Call "
            "the op on the ranks of the argument's mesh only."
        )
    _check_placements(op, name, t, allowed)
    return t._local_tensor


def _wrap_rows(out: Tensor, like: DTensor) -> DTensor:
    """`out` (this rank's rows) as a DTensor with the spec of `like` (a DTensor of rows)."""
    rows = like.shape[0]
    shape = (rows, *out.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        out, like.device_mesh, like.placements, run_check=False, shape=shape, stride=stride
    )


def weight_grad_placements(w: DTensor, rows: Tensor | None = None) -> list[Placement]:
    """Placements of `w`'s gradient: Shard(0) stays; Replicate() becomes Partial() (ranks saw
    different tokens, so each holds a partial sum), except on a mesh dim where the rows
    (`rows`, a DTensor x on w's mesh) are Replicate() too: every rank then summed the same
    rows, and the gradient is Replicate() (Partial() would count it once per rank)."""
    same_mesh = isinstance(rows, DTensor) and rows.device_mesh == w.device_mesh
    return [
        (Replicate() if same_mesh and isinstance(rows.placements[i], Replicate) else Partial())
        if isinstance(p, Replicate)
        else p
        for i, p in enumerate(w.placements)
    ]


def _wrap_weight_grad(dw: Tensor, w: Tensor, rows: Tensor) -> Tensor:
    if isinstance(dw, DTensor):  # from a DTensor x: its local sum over this rank's rows
        dw = dw._local_tensor
    if not isinstance(w, DTensor):  # a plain weight gets a plain gradient (this rank's rows)
        return dw
    return DTensor.from_local(
        dw, w.device_mesh, weight_grad_placements(w, rows), run_check=False, shape=w.shape,
        stride=w.stride(),
    )  # fmt: skip


def _check_rows_match_experts(x: Tensor, w: Tensor) -> None:
    """x and w DTensors on one mesh, and no Replicate() x where w is Shard(0) on the same mesh
    dim: every rank would multiply the same rows by different experts, an output no DTensor
    placement describes."""
    if not (isinstance(x, DTensor) and isinstance(w, DTensor)):
        return
    if x.device_mesh != w.device_mesh:  # which dims of one cover which of the other is unknown
        raise ValueError(
            f"grouped_ep.gemm: x is a DTensor on {x.device_mesh} and w on another mesh, "
            f"{w.device_mesh}; the output's and the weight gradient's placements are only "
            "known on one mesh. Pass x on w's mesh, or as a plain tensor (this rank's rows)."
        )
    for i, (px, pw) in enumerate(zip(x.placements, w.placements)):
        # On a dim of one rank, Shard(0) holds every expert: nothing to refuse.
        if isinstance(px, Replicate) and isinstance(pw, Shard) and w.device_mesh.size(i) > 1:
            raise ValueError(
                f"grouped_ep.gemm: x is Replicate() on mesh dim {i} ({_mesh_dims(x)[i]!r}), where "
                "w is Shard(0): each rank's experts would multiply the same rows. Pass each "
                "rank's own rows for its experts: x as a plain tensor or a Shard(0) DTensor."
            )


def _rows_like(t: Tensor, x: Tensor, op: str, name: str) -> Tensor:
    """The rows DTensor `t` (a gradient dy) laid out like the rows DTensor `x`: the loss taken on
    a DTensor output gives dy the loss's layout (Replicate() for `y.sum()`), whose local tensor
    is not this rank's rows."""
    if not (isinstance(t, DTensor) and isinstance(x, DTensor)):
        return t
    if t.device_mesh != x.device_mesh or tuple(t.placements) != tuple(x.placements):
        t = t.redistribute(x.device_mesh, x.placements)
    if t._local_tensor.shape[0] != x._local_tensor.shape[0]:
        raise ValueError(
            f"grouped_ep.{op}: {name} has {t._local_tensor.shape[0]} local rows in x's layout "
            f"{tuple(x.placements)}, x has {x._local_tensor.shape[0]}: x's Shard(0) rows are "
            "uneven across ranks in a way DTensor cannot redistribute to. Take the loss on "
            "y.to_local(), or pass x as a plain tensor."
        )
    return t


def _args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list:
    values = list(args) + [kwargs[n] for n in names[len(args) :] if n in kwargs]
    return values + [False] * (len(names) - len(values))  # the one defaulted arg: trans_w


def _gemm_dtensor(mode, func, types, args, kwargs=None):
    x, w, offs, trans_w = _args(args, kwargs or {}, ("x", "w", "offs", "trans_w"))
    _check_rows_match_experts(x, w)
    local_x = _local("gemm", "x", x, "rows split across ranks")
    local_w = _local("gemm", "w", w, "experts split across ranks")
    local_offs = _local("gemm", "offs", offs, None)
    _check_offs_per_local_expert(w, local_w, local_offs)
    out = func(local_x, local_w, local_offs, trans_w)
    return _wrap_rows(out, x) if isinstance(x, DTensor) else out


def _check_offs_per_local_expert(w, local_w, offs) -> None:
    """One offset per expert of this rank's shard of a DTensor `w`, not per global expert: the
    plain op's error would count the shard's experts without saying so (opfuzz review)."""
    if not isinstance(w, DTensor) or not isinstance(offs, Tensor) or offs.dim() != 1:
        return
    local = local_w.shape[0]
    if local != w.shape[0] and offs.shape[0] != local:
        raise ValueError(
            f"grouped_ep.gemm: offs has length {offs.shape[0]} but this rank's shard of w holds "
            f"{local} of its {w.shape[0]} experts (w is {tuple(w.placements)} on "
            f"{w.device_mesh.mesh_dim_names or 'its mesh'}); pass one cumulative end offset per "
            "local expert, the rows this rank computes"
        )


def _gemm_wgrad_dtensor(mode, func, types, args, kwargs=None):
    x, dy, offs, trans_w = _args(args, kwargs or {}, ("x", "dy", "offs", "trans_w"))
    if isinstance(x, DTensor) and isinstance(dy, DTensor):
        if x.device_mesh != dy.device_mesh or tuple(x.placements) != tuple(dy.placements):
            raise ValueError(
                f"grouped_ep.gemm_wgrad: x is {tuple(x.placements)} and dy is "
                f"{tuple(dy.placements)}; both must hold this rank's rows in the same layout "
                "(redistribute dy to x's placements first)"
            )
    out = func(
        _local("gemm_wgrad", "x", x, "rows split across ranks"),
        _local("gemm_wgrad", "dy", dy, "rows split across ranks"),
        _local("gemm_wgrad", "offs", offs, None),
        trans_w,
    )
    rows = x if isinstance(x, DTensor) else dy if isinstance(dy, DTensor) else None
    if rows is None:
        return out
    # Each rank summed its own rows: a partial sum over every mesh dim the rows are split on.
    placements = [Partial() if isinstance(p, Shard) else Replicate() for p in rows.placements]
    return DTensor.from_local(
        out, rows.device_mesh, placements, run_check=False, shape=out.shape, stride=out.stride()
    )


torch.library.register_torch_dispatch("grouped_ep::gemm", DTensor, _gemm_dtensor)
torch.library.register_torch_dispatch("grouped_ep::gemm_wgrad", DTensor, _gemm_wgrad_dtensor)


# ---- gemm ----------------------------------------------------------------------------------------


def gemm(x: Tensor, w: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    """Grouped matrix product: group g's rows of `x` times expert g's weight.

    The same as `torch.ops.grouped_ep.gemm(x, w, offs, trans_w)`, which model code may call
    directly (DTensor weights included).

    Args:
        x: `[T, K]`, rows grouped by expert (expert 0's rows first): this rank's tokens. A plain
            tensor, or a DTensor (`Shard(0)` or `Replicate()`) whose local tensor holds them;
            then the output is a DTensor with x's spec.
        w: `[E, K, N]`, or `[E, N, K]` with `trans_w=True` (the nn.Linear / Hugging Face layout,
            used without a copy). A plain tensor, or a DTensor whose placements are `Shard(0)`
            (experts split across ranks) or `Replicate()` on every mesh dim: then E is the local
            expert count, the op runs on the local shard, and the weight gradient is a DTensor
            on w's mesh: `Shard(0)` kept; `Replicate()` turned into `Partial()` (each rank
            summed only its own rows), except where x is a `Replicate()` DTensor on w's mesh
            too: every rank then summed the same rows, and the gradient stays `Replicate()`.
        offs: `[E]` int32 (int64 accepted), cumulative end offsets on x's device: group g is
            rows `offs[g-1]:offs[g]`. Empty groups are allowed; rows past `offs[-1]` give zeros.
            On CPU, decreasing offsets or `offs[-1] > T` raise. On CUDA the host never reads
            `offs` (that would sync): such values are clamped on the device to
            `min(max(offs[g], offs[g-1]), T)`, so they can never read or write out of bounds.
        trans_w: whether `w` is `[E, N, K]`.

    Returns:
        `[T, N]` in x's dtype, accumulated in fp32 (fp64 for fp64 inputs).

    Raises:
        RuntimeError: bad shapes, dtypes, devices or offsets, naming the argument.
        ValueError: DTensor arguments it cannot compute on the local shard: a placement other
            than `Shard(0)` / `Replicate()`, x on another mesh than w, a `Replicate()` x where
            w is `Shard(0)` (each rank's experts would multiply the same rows), a DTensor `offs`
            sharded, or offs' length not w's local expert count; each message says what to pass.
    """
    return _ops.gemm(x, w, offs, trans_w)


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


def _check_dtype_meta(op: str, name: str, t: Tensor) -> None:
    """The kernels' dtypes (csrc/checks.h), refused while tracing too, not first at run time."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    torch._check(
        t.dtype in floats or (t.dtype == torch.float64 and t.device.type != "cuda"),
        lambda: (
            f"grouped_ep.{op}: {name} must be bfloat16, float16 or float32 (float64 on "
            f"CPU), got {t.dtype} on {t.device}"
        ),
    )


@torch.library.register_fake("grouped_ep::gemm")
def _gemm_fake(x: Tensor, w: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    torch._check(x.dim() == 2, lambda: f"grouped_ep.gemm: x must be 2-D [T, K], got {x.dim()}-D")
    torch._check(w.dim() == 3, lambda: f"grouped_ep.gemm: w must be 3-D, got {w.dim()}-D")
    _check_dtype_meta("gemm", "x", x)
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
    dy = _rows_like(dy, x, "gemm", "dy")
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # dx_g = dy_g @ w_g^T: the same op with w read the other way round.
        dx = _ops.gemm(dy, w, offs, not ctx.trans_w)
    if ctx.needs_input_grad[1]:
        dw = _wrap_weight_grad(_ops.gemm_wgrad(x, dy, offs, ctx.trans_w), w, x)
    return dx, dw, None, None


register_autograd("gemm", _gemm_backward, _gemm_setup_context)


# ---- gemm_wgrad ----------------------------------------------------------------------------------


def gemm_wgrad(x: Tensor, dy: Tensor, offs: Tensor, trans_w: bool = False) -> Tensor:
    """Weight gradient of `gemm`, the "ragged K" product, one output per group.

    The same as `torch.ops.grouped_ep.gemm_wgrad(x, dy, offs, trans_w)`.

    Args:
        x: `[T, K]`, dy: `[T, N]`, rows grouped by expert as in `gemm`. Plain tensors, or
            DTensors whose local tensors hold this rank's rows: then the result is a DTensor on
            their mesh, `Partial()` where the rows are sharded (each rank summed its own rows).
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
    _check_dtype_meta("gemm_wgrad", "x", x)
    torch._check(
        dy.dtype == x.dtype,
        lambda: f"grouped_ep.gemm_wgrad: dy has dtype {dy.dtype} but x has {x.dtype}",
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
    if isinstance(grad, DTensor):  # the gradient of a weight gradient: this rank's experts
        grad = grad._local_tensor
    dx = ddy = None
    if ctx.needs_input_grad[0]:
        dx = _ops.gemm(dy, grad, offs, not ctx.trans_w)
    if ctx.needs_input_grad[1]:
        ddy = _ops.gemm(x, grad, offs, ctx.trans_w)
    return dx, ddy, None, None


register_autograd("gemm_wgrad", _wgrad_backward, _wgrad_setup_context)


# ---- native I/O ops ---------------------------------------------------------------------------
# `read_ranges` and `crc32c` (csrc/io) read files; the package calls them eagerly, from
# `load_sharded` and the checkpoint checks. `crc32c`'s fake kernel gives its output's shape, so
# code calling it traces; `read_ranges` returns the bytes it read, known only once read (its
# schema's `int` cannot be left unknown), so tracing it is refused by name. `dequantize`
# returns nothing: torch derives its fake kernel.


@torch.library.register_fake("grouped_ep::read_ranges")
def _read_ranges_fake(paths, outs, plan: Tensor, threads: int = 8, expect=None):
    raise RuntimeError(
        "grouped_ep.read_ranges reads files: call it eagerly, not under torch.compile, "
        "torch.export or FakeTensorMode"
    )


@torch.library.register_fake("grouped_ep::crc32c")
def _crc32c_fake(path: str, offsets: Tensor, lengths: Tensor, threads: int = 4) -> Tensor:
    torch._check(
        offsets.dim() == 1 and lengths.shape == offsets.shape,
        lambda: "grouped_ep.crc32c: offsets and lengths must be 1-D tensors of one length",
    )
    return offsets.new_empty(offsets.shape, dtype=torch.int64)
