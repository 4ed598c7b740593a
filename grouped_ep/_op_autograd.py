"""Autograd registration of the grouped_ep ops: torch's reverse-mode kernel, plus a forward-mode
rule (torch gives custom ops none: `torch.func.jvp`, `jacfwd` and `forward_ad` gave zero
tangents, silently, until a review), plus the single-level form torch.func's `grad`, `vjp`,
`jacrev` and `hessian` record (they refused torch's kernel)."""

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


def _top_transform(name: str) -> bool:
    """Whether the innermost torch.func transform running is `name` ("Jvp", "Grad")."""
    try:
        top = torch._C._functorch.peek_interpreter_stack()
        return top is not None and top.key() == getattr(torch._C._functorch.TransformType, name)
    except AttributeError:  # a torch without these internals
        return False


def _grad_transform_kernel(op, backward, setup_context):
    """The op's reverse mode under a torch.func.grad-like transform (`grad`, `vjp`, `jacrev`,
    `hessian`), recorded at the transform's level by a single-level autograd.Function, the form
    torch.func gives each Function it runs: the Function torch makes for a custom op keeps its
    setup inside `forward`, which those transforms refused ("must override the setup_context
    staticmethod"). None on a torch without the internals this uses (torch's refusal stays)."""
    try:
        from torch._functorch.utils import enable_single_level_autograd_function
        from torch.autograd.function import _SingleLevelFunction

        fwd_grad_enabled = torch.autograd.forward_ad._set_fwd_grad_enabled
        after_autograd = torch._C._after_autograd_keyset
    except (ImportError, AttributeError):
        return None

    class SingleLevel(_SingleLevelFunction):
        @staticmethod
        def forward(first, second, offs, trans_w, keyset):
            # Below this level's autograd, with gradients on (apply turns them off): the level
            # beneath, another transform's, records the op in turn (a Hessian's second pass).
            with torch._C._AutoDispatchBelowAutograd(), torch.enable_grad():
                with fwd_grad_enabled(True):
                    return op.redispatch(keyset & after_autograd, first, second, offs, trans_w)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs[:4], output)

        @staticmethod
        def backward(ctx, grad):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[:4]
            try:
                return (*backward(ctx, grad), None)
            finally:
                ctx.needs_input_grad = needs

    def kernel(keyset, first, second, offs, trans_w=False):
        with enable_single_level_autograd_function():
            return SingleLevel.apply(first, second, offs, trans_w, keyset)

    return kernel


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
    grad_transform = _grad_transform_kernel(op, backward, setup_context)

    def reverse_mode(keyset, *args, **kwargs):
        if grad_transform is not None and _top_transform("Grad"):
            if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
                return grad_transform(keyset, *args, **kwargs)
        return reverse(keyset, *args, **kwargs)

    def kernel(keyset, *args, **kwargs):
        if torch.autograd.forward_ad._current_level < 0:  # no dual level: reverse mode only
            if _top_transform("Jvp"):
                raise NotImplementedError(
                    f"grouped_ep.{name}: torch.func.jvp inside torch.compile is not supported "
                    "(the tangents are not reachable while it traces; it failed in functorch's "
                    "_unwrap_for_grad). Call torch.func.jvp eagerly, or compile the function "
                    "jvp is taken of"
                )
            return reverse_mode(keyset, *args, **kwargs)
        first, second, offs, *rest = args
        (p1, t1), (p2, t2) = (torch.autograd.forward_ad.unpack_dual(a) for a in (first, second))
        if t1 is None and t2 is None:
            return reverse_mode(keyset, *args, **kwargs)
        # Run on the dual inputs, so that they are saved with their tangents: a backward under
        # this level (forward-over-reverse, a Hessian-vector product) reads them so, else it
        # dropped the cross terms, gemm(dy, t_w) in dx (a review: off by 14 in 49). Forward
        # grad is off in the call: the tangent is made below, torch's Function has no rule.
        with torch.autograd.forward_ad._set_fwd_grad_enabled(False):
            out = reverse_mode(keyset, first, second, offs, *rest, **kwargs)
        trans_w = rest[0] if rest else False
        tangent = _bilinear_tangent(op, p1, p2, offs, trans_w, t1, t2)
        return torch.autograd.forward_ad.make_dual(out, tangent)

    _AUTOGRAD_LIB.impl(name, kernel, "Autograd", with_keyset=True)
