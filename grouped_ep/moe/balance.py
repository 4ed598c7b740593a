"""Load balancing for MoE routers: the Switch Transformer auxiliary loss and DeepSeek-V3's
auxiliary-loss-free expert bias.

- Auxiliary loss (Switch Transformer's, normalized for top-k): `E * sum_i f_i * P_i`, where `f_i`
  is the fraction of the `T * k` routed copies that went to expert i (no gradient) and `P_i` the
  mean router probability of expert i over the T tokens. It is 1 for a perfectly balanced router
  with uniform probabilities and grows to E when every token goes to one expert. transformers'
  `load_balancing_loss_func` (Mixtral, Qwen-MoE: `router_aux_loss_coef`) divides by T, not
  T * k: its value is k times this one, so `aux_loss_coef = k * router_aux_loss_coef` gives the
  same gradient as a transformers config's coefficient.
- Expert bias (DeepSeek-V3, "auxiliary-loss-free"): a per-expert bias `b` added to the router
  scores for the top-k *selection* only; the combine weights stay the unbiased probabilities.
  After each optimizer step, `update_expert_bias(model)` adds `gamma * sign(mean load - load_i)`
  to `b_i`, from the token counts of every rank since the last update (one all-reduce for all
  layers). Overloaded experts get picked less, underloaded ones more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grouped_ep._validate import check_module, is_int, real_number

__all__ = ["RouterOutput", "load_balancing_loss", "set_aux_loss_scale", "update_expert_bias"]


@dataclass
class RouterOutput:
    """What `MoE(x, return_router_outputs=True)` returns next to the hidden states.

    logits: `[T, E]` router logits of the T tokens of this rank (differentiable).
    tokens_per_expert: `[E]` int64 routed copies per expert from this rank's tokens.
    aux_loss: the unscaled auxiliary loss (a detached scalar, for logging) when the layer has
        `aux_loss_coef > 0`, else None. Its gradient, times the coefficient, is already in the
        backward of the hidden states: do not add it to the loss again.
    """

    logits: Tensor
    tokens_per_expert: Tensor
    aux_loss: Tensor | None = None


def load_balancing_loss(probs: Tensor, tokens_per_expert: Tensor, top_k: int) -> Tensor:
    """The Switch load-balancing loss `E * sum_i f_i * P_i`, `f` over the `T * top_k` routed
    copies (see the module docstring: transformers' Mixtral loss is `top_k` times this).

    Args:
        probs: `[T, E]` router probabilities (softmax over experts), differentiable.
        tokens_per_expert: `[E]` routed copies per expert (their sum is `T * top_k`).
        top_k: experts per token.

    Returns:
        A scalar in `probs`' dtype; 0 when there are no tokens.
    """
    if not is_int(top_k) or top_k < 1:
        raise ValueError(f"load_balancing_loss: top_k must be an int >= 1, got {top_k!r}")
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum()
    f = tokens_per_expert.to(probs.dtype) / (num_tokens * top_k)
    return num_experts * (f * probs.mean(dim=0)).sum()


def _seed(aux_loss: Tensor, coef: Tensor) -> Tensor:
    # In place on a fresh tensor: aux_loss's dtype and device, and the CPU coef read as a scalar
    # (coef.to(device) would be a blocking host-to-device copy in every backward).
    return torch.ones_like(aux_loss).mul_(coef)


class _AddAuxLossGrad(torch.autograd.Function):
    """A copy of `out`; backward also sends `coef` into `aux_loss`, as if `coef * aux_loss` had
    been added to whatever loss is backpropagated through `out`. (A copy, not `out` itself: an
    input returned as it is becomes a view that autograd forbids changing in place.) The form
    torch.compile traces (dynamo refuses a Function with a `jvp`); eager calls take `_Once`."""

    @staticmethod
    def forward(out: Tensor, aux_loss: Tensor, coef: Tensor) -> Tensor:
        return out.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[1])
        # The scale as it is now, kept on ctx: a saved tensor is recomputed in the backward under
        # activation checkpointing, and would read the scale of a later micro-batch (a review).
        ctx.coef = inputs[2].clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return grad_out, _seed(ctx.saved_tensors[0], ctx.coef), None


class _Sent:
    """Which node of a call sent its aux-loss gradient: torch.func records the call once per
    transform level, a node each (not a list: torch.func rebuilds containers per level)."""

    __slots__ = ("node",)

    def __init__(self) -> None:
        self.node: int | None = None


class _Once(torch.autograd.Function):
    """`_AddAuxLossGrad`, eagerly, with forward-mode and vmap rules (torch.func.jvp and hessian
    through it failed): the value is `out`'s, the aux term only a gradient. Under nested
    torch.func transforms (hessian, grad of grad) the coefficient goes in at one level only,
    the first to run its backward, the loss's: the outer levels differentiate a gradient, and
    sending it there too put `coef * d aux` into every second derivative (a review). Every
    backward pass over the same graph still sends it (a gradient norm taken with
    autograd.grad, then the loss's backward; a gradient penalty), as a loss holding the term
    would: once per forward dropped it from the second pass (a review)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(out: Tensor, aux_loss: Tensor, coef: Tensor, sent: _Sent) -> Tensor:
        return out.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _AddAuxLossGrad.setup_context(ctx, inputs, output)
        ctx.sent = inputs[3]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if not isinstance(ctx, _Once._backward_cls):  # a node torch.func made at its level:
            if ctx.sent.node not in (None, id(ctx)):  # another level's node sent it
                return grad_out, None, None, None
            ctx.sent.node = id(ctx)
        # Plain autograd's node sends it on every pass: the loss a `grad_and_value` also
        # returned, backpropagated, lost it when torch.func's node had sent it (a review).
        return grad_out, _seed(ctx.saved_tensors[0], ctx.coef), None, None

    @staticmethod
    def jvp(ctx, t_out, t_aux, t_coef, t_sent):
        return t_out.clone()


def add_aux_loss_grad(out: Tensor, aux_loss: Tensor, coef: Tensor) -> Tensor:
    """`out`'s values, whose backward also backpropagates `coef * aux_loss`. `coef` is a 0-d
    tensor: torch.compile then does not specialize on its value (a
    recompile per loss scale)."""
    if torch.compiler.is_compiling():
        return _AddAuxLossGrad.apply(out, aux_loss, coef)
    return _Once.apply(out, aux_loss, coef, _Sent())


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale the aux-loss gradient of every `MoE` of `model` by `scale` (default 1).

    The aux loss reaches the gradient through the backward of each MoE's routing weights, so it
    does not see how the training loop scales the loss. With gradient accumulation over N
    micro-batches whose losses are divided by N, set `scale = 1 / N`, so that the aux term is
    averaged like the loss. With a loss scaler (`torch.amp.GradScaler`), set
    `scale = scaler.get_scale() / N` at the start of each step: the scaler multiplies the loss
    and later divides every gradient, aux terms included, by its factor. The scale is read when
    a forward runs (it is stored with that forward's graph): set it before the forward whose
    backward it is for. Data-parallel and EP ranks need nothing: FSDP averages the gradients,
    aux terms included.
    """
    check_module(model, "set_aux_loss_scale")
    value = real_number(scale)
    if value is None or not value >= 0 or math.isinf(value):  # NaN fails too
        raise ValueError(
            f"set_aux_loss_scale: scale must be a finite real number >= 0, got {scale!r}"
        )
    for module in model.modules():
        if hasattr(module, "aux_loss_grad_scale"):
            module.aux_loss_grad_scale = value


def _balanced_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "expert_bias_gamma", None) is not None]


@torch.no_grad()
def update_expert_bias(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> Tensor | list[Tensor] | None:
    """DeepSeek-V3's bias update for every `MoE` of `model` built with `expert_bias_gamma`.

    Call once per optimizer step, on every rank, after `optimizer.step()`. Sums the token counts
    each layer gathered in training forwards since the last update over the ranks of `group`
    (default: the whole world, i.e. every data-parallel and EP rank) with one all-reduce for all
    layers, then sets `bias += gamma * sign(counts.mean() - counts)` and clears the counts. Every
    rank ends with the same bias.

    Returns:
        `[L, E]` int64 global tokens per expert of the L balanced layers (module order); a list
        of L `[E_l]` tensors where the layers' expert counts differ; None when `model` has no
        balanced layer. The counts are cleared only once the all-reduce succeeded.
    """
    check_module(model, "update_expert_bias")
    layers = _balanced_layers(model)
    if not layers:
        return None
    rows = [m.peek_load_counts() for m in layers]
    counts = join_reduce_split(rows, group)
    for layer, load in zip(layers, counts):
        layer.take_load_counts()
        load_f = load.to(torch.float32)
        layer.expert_bias.add_(layer.expert_bias_gamma * torch.sign(load_f.mean() - load_f))
    return stack_if_equal(counts)


def join_reduce_split(rows: list[Tensor], group: dist.ProcessGroup | None) -> list[Tensor]:
    """Each of `rows` summed over the ranks of `group` (one all-reduce of them end to end, so
    layers of different expert counts go together), as new tensors."""
    if not rows:
        return []
    flat = torch.cat([r.reshape(-1) for r in rows])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    return list(flat.split([r.numel() for r in rows]))


def stack_if_equal(rows: list[Tensor]) -> Tensor | list[Tensor]:
    """`[L, E]` when every row has E elements, else the rows as they are."""
    return torch.stack(rows) if len({r.numel() for r in rows}) == 1 else rows
