"""Hugging Face transformers (v5) integration: a `"grouped_ep"` experts implementation and
`parallelize` for expert parallel + FSDP2 on transformers MoE models.

transformers v5 decorates its experts classes (`Qwen3MoeExperts`, `MixtralExperts`, ...) with
`@use_experts_implementation`: their forward looks up `config._experts_implementation` in
`transformers.integrations.moe.ExpertsInterface` and calls the function registered under that
name as `fn(experts_module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`.
Importing this module registers `"grouped_ep"` there (`ExpertsInterface.register`, the
documented extension point), so both of these work:

    import grouped_ep.hf  # registers "grouped_ep"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="grouped_ep")
    model.set_experts_implementation("grouped_ep")

`unregister()` removes it again. The experts' own weights are used as they are
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, or the transposed layout), no copies.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from transformers.modeling_utils import PreTrainedModel

import grouped_ep.ops  # noqa: F401  (DTensor rules and autograd of torch.ops.grouped_ep.gemm)
from grouped_ep._hf_version import require_transformers
from grouped_ep._validate import canonical_device, check_can_hold, check_module
from grouped_ep.loading.buffers import fresh_buffers
from grouped_ep.moe.dispatch import routed_experts_forward
from grouped_ep.moe.layers import GroupedExperts
from grouped_ep.parallel import (
    check_mesh,
    check_policy,
    check_reshard,
    check_shardable,
    experts_modules,
    fully_shard_moe,
    uses_experts_interface,
)

# Before the names older releases lack (the experts interface is new in 5.7).
require_transformers(ImportError, "import grouped_ep.hf")
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate  # noqa: E402

__all__ = [
    "IMPLEMENTATION",
    "check_supported",
    "grouped_ep_experts_forward",
    "init_nonpersistent_buffers",
    "parallelize",
    "register",
    "unregister",
]

IMPLEMENTATION = "grouped_ep"


def _family(experts: nn.Module) -> str:
    config = getattr(experts, "config", None)
    return f"{getattr(config, 'model_type', '?')} ({type(experts).__name__})"


def check_supported(experts: nn.Module) -> None:
    """Raise `NotImplementedError` naming the family and the feature if the `"grouped_ep"`
    forward cannot run this transformers experts module.

    Supported: fused `gate_up_proj [E, 2I, H]` (or `up_proj [E, I, H]` without a gate) and
    `down_proj`, either layout (`is_transposed`), per-expert biases (`*_bias [E, N]`), the
    module's own `_apply_gate` (gpt-oss's interleaved, clamped SwiGLU), `post_expert_norm`.
    Runs when the implementation is set (`set_experts_implementation`, `from_pretrained(...,
    experts_implementation="grouped_ep")`, `parallelize`), so nothing fails at the first forward.
    """
    problems = []
    if not isinstance(getattr(experts, "num_experts", None), int):
        problems.append("no int num_experts")
    has_gate = getattr(experts, "has_gate", True)
    first = "gate_up_proj" if has_gate else "up_proj"
    for name in (first, "down_proj"):
        w = getattr(experts, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            problems.append(f"{name} is not a 3-D expert weight")
        if getattr(experts, "has_bias", False):
            b = getattr(experts, f"{name}_bias", None)
            if not isinstance(b, torch.Tensor) or b.dim() != 2:
                problems.append(f"has_bias without a 2-D {name}_bias")
    gate = getattr(type(experts), "_apply_gate", None)
    if has_gate and not getattr(experts, "is_concatenated", True) and gate is _default_apply_gate:
        problems.append("interleaved gate/up (is_concatenated=False) without its own _apply_gate")
    if not has_gate and not callable(getattr(experts, "act_fn", None)):
        problems.append("has_gate=False without act_fn")
    if getattr(experts, "has_post_expert_norm", False) and not callable(
        getattr(experts, "post_expert_norm", None)
    ):
        problems.append("has_post_expert_norm without a post_expert_norm module")
    if problems:
        raise NotImplementedError(
            f"experts_implementation='grouped_ep' does not support {_family(experts)}: "
            f"{'; '.join(problems)}"
        )


# Experts classes whose eager forward computes in fp32 whatever the model's dtype.
_FP32_MATH = frozenset({"OpenAIPrivacyFilterExperts"})


def _local(t: Tensor) -> Tensor:
    """This rank's experts of a per-expert bias (a DTensor `Shard(0)` under EP); gradients flow
    back with the same placements."""
    if isinstance(t, DTensor):
        return t.to_local(grad_placements=t.placements)
    return t


class _BiasPerRow(torch.autograd.Function):
    """`[rows, N]`: the bias of each row's expert. bias: `[E_local, N]`, offs: `[E_local]`
    cumulative. No host sync (`output_size` given). The backward sums each expert's rows of the
    gradient with `gemm_wgrad` (a column of ones against dy: fp32 accumulation, one rounding),
    with no fp32 copy of `[rows, N]`. (Summing a bf16 gradient one row at a time stalls: 1.2
    relative error over 257 rows, where eager's broadcast add gave 0.02.)"""

    @staticmethod
    def forward(bias: Tensor, offs: Tensor, rows: int) -> Tensor:
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        experts = torch.arange(offs.numel(), device=offs.device)
        return bias[experts.repeat_interleave(counts, output_size=rows)]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        bias, offs, _ = inputs
        ctx.save_for_backward(offs)
        ctx.bias_dtype = bias.dtype

    @staticmethod
    def backward(ctx, grad: Tensor):
        (offs,) = ctx.saved_tensors
        ones = grad.new_ones((grad.shape[0], 1))
        summed = torch.ops.grouped_ep.gemm_wgrad(ones, grad.contiguous(), offs, False)
        return summed.squeeze(1).to(ctx.bias_dtype), None, None


def _bias_per_row(bias: Tensor, offs: Tensor, rows: int) -> Tensor:
    """`[rows, N]`: the bias of each row's expert (see `_BiasPerRow`)."""
    return _BiasPerRow.apply(bias, offs, rows)


def grouped_ep_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The `"grouped_ep"` experts forward for a transformers `@use_experts_implementation` class.

    Args:
        self: the experts module (`gate_up_proj` or `up_proj`, `down_proj`, `num_experts`,
            optional `*_bias [E, N]`, `_apply_gate` or `act_fn`, `post_expert_norm`).
        hidden_states: `[T, H]`. top_k_index: `[T, k]` expert ids. top_k_weights: `[T, k]`.

    Returns:
        `[T, H]`. With EP (`parallelize`), tokens are dispatched to the experts' ranks with
        all-to-all; one host sync per layer for the split sizes.
    """
    check_supported(self)
    if getattr(self, "_is_expert_parallel", False):
        # transformers' own expert parallel: num_experts is this rank's count, and routes to
        # other ranks' experts carry the id num_experts with weight 0. They are sent to the last
        # local expert with weight 0 (as transformers' batched_mm does): no contribution, no
        # gradient, and no out-of-range index.
        sentinel = top_k_index >= self.num_experts
        top_k_weights = top_k_weights.masked_fill(sentinel, 0)
        top_k_index = top_k_index.clamp(max=self.num_experts - 1)
    # transformers' "transposed" layout is [E, in, out]; the default one is nn.Linear's.
    trans_w = not getattr(self, "is_transposed", False)
    has_gate = getattr(self, "has_gate", True)
    has_bias = getattr(self, "has_bias", False)
    first = "gate_up_proj" if has_gate else "up_proj"

    # The families whose eager experts run every product in fp32 (their weights cast per call):
    # the same here, else bf16 models lose precision eager keeps (10x the bias-gradient error).
    fp32 = any(c.__name__ in _FP32_MATH for c in type(self).__mro__)
    dtype = torch.float32 if fp32 else getattr(self, first).dtype

    def linear(x: Tensor, name: str, offs: Tensor) -> Tensor:
        y = torch.ops.grouped_ep.gemm(x, getattr(self, name).to(dtype), offs, trans_w)
        if has_bias:  # per group, outside the op; its gradient flows through the gather
            bias = _local(getattr(self, f"{name}_bias")).to(dtype)
            y = y + _bias_per_row(bias, offs, x.shape[0])
        return y

    def compute(x: Tensor, offs: Tensor) -> Tensor:
        h = linear(x.to(dtype), first, offs)
        h = self._apply_gate(h) if has_gate else self.act_fn(h)
        y = linear(h, "down_proj", offs)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        return y

    return routed_experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.num_experts,
        compute,
        getattr(self, "ep_mesh", None),
    )


def _check_experts(model: nn.Module) -> None:
    for module in model.modules():
        if uses_experts_interface(module):
            check_supported(module)


# transformers validates a requested experts implementation in `_check_and_adjust_experts_
# implementation` (from `set_experts_implementation`, and in `__init__` before the submodules
# exist) and finishes every model in `post_init`. Both are wrapped while "grouped_ep" is
# registered, so experts modules the "grouped_ep" forward cannot run are refused, by family and
# feature, when the implementation is set or a model is built with it (`from_pretrained(...,
# experts_implementation="grouped_ep")`).
def _built_inside_another(model: nn.Module) -> bool:
    """Whether `model` is a part another model builds from its own config in its `__init__`
    (mistral_large4's Pixtral vision tower, built from a sub-config that carries the requested
    implementation): a part without experts is no reason to refuse the whole model, whose own
    experts are checked when it is finished (`post_init`). transformers refuses "grouped_mm"
    there, and grouped_ep refused "grouped_ep" the same way (a review). A model a user's
    wrapper loads in its `__init__` is not such a part: its config is no sub-config of the
    wrapper's."""
    config = getattr(model, "config", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            outer = frame.f_locals.get("self")
            if outer is not model and isinstance(outer, PreTrainedModel):
                outer_config = getattr(outer, "config", None)
                subs = vars(outer_config).values() if outer_config is not None else ()
                return config is not None and any(sub is config for sub in subs)
        frame = frame.f_back
    return False


def _after_check(original):
    @functools.wraps(original)
    def check_and_adjust(self, experts_implementation):
        chosen = original(self, experts_implementation)
        if chosen == IMPLEMENTATION:
            # as transformers refuses "grouped_mm" for such a class (`_grouped_mm_can_dispatch`):
            # its experts, if any, run their own forward, and "grouped_ep" would be ignored
            can_set = getattr(type(self), "_can_set_experts_implementation", None)
            if can_set is not None and not can_set() and not _built_inside_another(self):
                raise NotImplementedError(
                    f"experts_implementation='grouped_ep': {type(self).__name__} does not "
                    "support setting an experts implementation (no module of its family is on "
                    "transformers' experts interface); its own forward would run instead"
                )
            _check_experts(self)
        return chosen

    return check_and_adjust


def _after_post_init(original):
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if getattr(self.config, "_experts_implementation", None) == IMPLEMENTATION:
            _check_experts(self)
        return out

    return post_init


_WRAPPED = {"_check_and_adjust_experts_implementation": _after_check, "post_init": _after_post_init}


def register() -> None:
    """Register `"grouped_ep"` in transformers' ExpertsInterface (done on import), and check
    every experts module when a model is set to it or built with it (see `check_supported`)."""
    ExpertsInterface.register(IMPLEMENTATION, grouped_ep_experts_forward)
    for name, wrap in _WRAPPED.items():
        method = PreTrainedModel.__dict__.get(name)
        if method is not None and not hasattr(method, "__grouped_ep_original__"):
            wrapped = wrap(method)
            wrapped.__grouped_ep_original__ = method
            setattr(PreTrainedModel, name, wrapped)


def unregister() -> None:
    """Remove `"grouped_ep"` from transformers' ExpertsInterface, and its checks."""
    ExpertsInterface._global_mapping.pop(IMPLEMENTATION, None)
    for name in _WRAPPED:
        method = PreTrainedModel.__dict__.get(name)
        if hasattr(method, "__grouped_ep_original__"):
            setattr(PreTrainedModel, name, method.__grouped_ep_original__)


register()


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Expert parallel + FSDP2 on a transformers MoE model (Qwen3-MoE, Mixtral, ...).

    Switches the model to `experts_implementation="grouped_ep"` (the other implementations
    cannot compute on EP-sharded weights), then `grouped_ep.parallel.fully_shard_moe`: experts
    `Shard(0)` over `mesh["ep"]` and FSDP over `"dp"`, decoder layers and the rest FSDP over all
    ranks. `mesh` comes from `grouped_ep.parallel.make_mesh(dp, ep)`. Works on a meta model.
    Returns `model`.
    """
    check_module(model, "parallelize")
    check_policy(mp_policy, "parallelize")
    experts = experts_modules(model)
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    if not experts:
        # LongcatFlash and DBRX stack their experts in their own layout and forward; the
        # message said "a list of per-expert modules" of them (a review)
        own = sorted({type(m).__name__ for m in model.modules() if "Experts" in type(m).__name__})
        kept = (
            f"its experts ({', '.join(own)}) run their family's own forward, not transformers' "
            "experts interface"
            if own
            else "experts kept as a list of per-expert modules are not supported"
        )
        raise ValueError(
            f"parallelize: {type(model).__name__} ({model_type}) has no experts module grouped_ep "
            "can shard (stacked expert weights gate_up_proj / up_proj and down_proj [E, ...] "
            f"with an int num_experts, as transformers v5's experts interface keeps them); {kept}"
        )
    for module in experts:
        if not isinstance(module, GroupedExperts) and not uses_experts_interface(module):
            raise NotImplementedError(
                f"parallelize: {model_type} ({type(module).__name__}) runs its own experts "
                "forward, not "
                "transformers' experts interface: it cannot compute on EP-sharded weights "
                "(grouped_ep's forward is used only through that interface)"
            )
        check_supported(module)
    check_mesh(mesh, "parallelize")
    check_reshard(reshard_after_forward, mesh, "parallelize")
    # Refusals before the implementation is switched: a failed call changes nothing.
    check_shardable(model, mesh["ep"], "parallelize", with_fsdp=True)
    configs = [c for c in (getattr(m, "config", None) for m in experts) if c is not None]
    before = [getattr(c, "_experts_implementation", None) for c in configs]
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    for c in configs:  # a config of its own that the model's call does not reach: peft's
        # modules_to_save copy of an experts module (a review: refused, naming neither)
        if c._experts_implementation != IMPLEMENTATION and hasattr(
            c, "_experts_implementation_internal"
        ):
            c._experts_implementation_internal = IMPLEMENTATION
    for module in experts:
        config = getattr(module, "config", None)
        if config is not None and config._experts_implementation != IMPLEMENTATION:
            for c, impl in zip(configs, before):  # a refused call leaves the model as it was
                c._experts_implementation = impl
            raise ValueError(
                f"parallelize: experts module {type(module).__name__} still uses "
                f"experts_implementation={config._experts_implementation!r}, not 'grouped_ep'"
            )
    return fully_shard_moe(
        model, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
    )


def init_nonpersistent_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recompute every non-persistent buffer (rotary `inv_freq`, ...) of a model on `device`.

    No checkpoint holds them. `load_sharded` recomputes the ones left on meta by itself; call
    this after `model.to_empty(...)` (which leaves them holding garbage) or when building the
    model another way. Each owning module is rebuilt alone from its own `config`; a buffer that
    cannot be recomputed is a `grouped_ep.LoadError` naming it."""
    device = canonical_device(device, "init_nonpersistent_buffers: device")
    check_can_hold(device, "init_nonpersistent_buffers: device")
    for module, name, value in fresh_buffers(model, device, only_meta=False):
        module._buffers[name] = value
