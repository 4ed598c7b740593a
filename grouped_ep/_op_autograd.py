"""Autograd registration of the grouped_ep ops: torch's reverse-mode kernel, plus a forward-mode
rule (torch gives custom ops none: `torch.func.jvp`, `jacfwd` and `forward_ad` gave zero
tangents, silently, until a review)."""

from __future__ import annotations

import torch
from torch import Tensor


def _bilinear_tangent(op, first: Tensor, second: Tensor, offs: Tensor, trans_w: bool, t1, t2):
    """The tangent of `op(first, second, offs, trans_w)`, linear in each of its two tensors:
    op(t1, second) + op(first, t2), a term for each tangent that is there."""
    terms = [op(t1, second, offs, trans_w)] if t1 is not None else []
    if t2 is not None:
        terms.append(op(first, t2, offs, trans_w))
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


_AUTOGRAD_LIB = torch.library.Library("grouped_ep", "IMPL")  # held: its kernels live with it


def saved_inputs(ctx) -> tuple[Tensor, Tensor, Tensor]:
    """The two tensors and offs a backward reads: with their tangents where the forward ran
    under a forward-AD level (`register_autograd`'s kernel saves them stripped)."""
    first, second, offs = ctx.saved_tensors
    duals = getattr(ctx, "duals", None)
    return (*duals, offs) if duals is not None else (first, second, offs)


def _under_jvp_transform() -> bool:
    """A torch.func.jvp transform without a forward-AD level: torch.compile tracing it."""
    try:
        top = torch._C._functorch.peek_interpreter_stack()
        return top is not None and top.key() == torch._C._functorch.TransformType.Jvp
    except AttributeError:  # a torch without these internals
        return False


def register_autograd(name: str, backward, setup_context) -> None:
    """`torch.library.register_autograd`, plus forward-mode AD (`torch.func.jvp`, `jacfwd`,
    `torch.autograd.forward_ad`): torch gives a custom op no forward rule, and its tangents came
    out zero, silently (a review). Both ops are bilinear in their two tensors, so the tangent is
    the op applied to each tangent with the other primal. A torch without the kernel maker this
    uses (internal) registers reverse mode only."""
    op = getattr(torch.ops.grouped_ep, name).default
    maker = getattr(getattr(torch._library, "autograd", None), "make_autograd_impl", None)
    if maker is None:
        torch.library.register_autograd(
            f"grouped_ep::{name}", backward, setup_context=setup_context
        )
        return
    reverse = maker(op, torch._library.autograd.Info(backward, setup_context))

    def kernel(keyset, *args, **kwargs):
        if torch.autograd.forward_ad._current_level < 0:  # no dual level: reverse mode only
            if _under_jvp_transform():
                raise NotImplementedError(
                    f"grouped_ep.{name}: torch.func.jvp inside torch.compile is not supported "
                    "(the tangents are not reachable while it traces; it failed in functorch's "
                    "_unwrap_for_grad). Call torch.func.jvp eagerly, or compile the function "
                    "jvp is taken of"
                )
            return reverse(keyset, *args, **kwargs)
        first, second, offs, *rest = args
        (p1, t1), (p2, t2) = (torch.autograd.forward_ad.unpack_dual(a) for a in (first, second))
        if t1 is None and t2 is None:
            return reverse(keyset, *args, **kwargs)
        out = reverse(keyset, p1, p2, offs, *rest, **kwargs)
        if out.grad_fn is not None:  # its ctx: a backward under this level (forward-over-
            # reverse, a Hessian-vector product) reads the inputs with their tangents, else it
            # dropped the cross terms, gemm(dy, t_w) in dx (a review: off by 14 in 49)
            out.grad_fn.duals = (first, second)
        trans_w = rest[0] if rest else False
        tangent = _bilinear_tangent(op, p1, p2, offs, trans_w, t1, t2)
        return torch.autograd.forward_ad.make_dual(out, tangent)

    _AUTOGRAD_LIB.impl(name, kernel, "Autograd", with_keyset=True)
