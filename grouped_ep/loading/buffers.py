"""Non-persistent buffers: values no checkpoint holds (rotary `inv_freq`, causal masks, ...).

After a meta-device build they are meta, so the model cannot run after loading its weights.
`fresh_buffers` recomputes them from the owning module's own initialization:
- in a transformers model, the way `from_pretrained` does: the `_init_weights` of the nearest
  `PreTrainedModel` runs on the module, with its parameters and other buffers swapped for meta
  stand-ins (so nothing loaded is touched) and these buffers fresh on the target device (Gemma's
  `embed_scale` comes from a constructor argument that only `_init_weights` knows again; BERT's
  integer `position_ids` and `token_type_ids` are set there too);
- otherwise, or for a buffer `_init_weights` leaves alone, the module type is built again, alone,
  on the target device, from the arguments it keeps (`config` for transformers modules), and its
  buffers are taken.
Nothing bigger than the module that owns the buffers is built, and that with its parameters on
meta. Where neither works, the error names each buffer.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from grouped_ep._names import unwrapped_name
from grouped_ep._validate import canonical_device
from grouped_ep.loading.errors import LoadError

__all__ = ["fresh_buffers", "nonpersistent_buffers", "refresh_buffers"]


def nonpersistent_buffers(
    model: nn.Module, only_meta: bool = True
) -> dict[str, tuple[nn.Module, list[str]]]:
    """Module name -> (module, names of its non-persistent buffers [that are on meta])."""
    out = {}
    for prefix, module in model.named_modules():
        names = [
            n
            for n, b in module._buffers.items()
            if b is not None
            and (b.is_meta or not only_meta)
            and n in module._non_persistent_buffers_set
        ]
        if names:
            out[prefix] = (module, names)
    return out


_ON_META = threading.local()  # .active: this thread is inside `_parameters_on_meta`
_PATCH_LOCK = threading.Lock()


def _install_patch() -> None:
    """Wrap `nn.Module.register_parameter` once, for good: in a thread inside
    `_parameters_on_meta` a registered parameter moves to meta; elsewhere nothing changes (a
    patch of the method for the duration put other threads' new parameters on meta too)."""
    with _PATCH_LOCK:
        register = nn.Module.register_parameter
        if getattr(register, "__grouped_ep_on_meta__", False):
            return

        def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(self, name, param)
            if not getattr(_ON_META, "active", False):
                return
            held = self._parameters.get(name)
            if held is not None and not held.is_meta:
                self._parameters[name] = nn.Parameter(
                    held.detach().to("meta"), requires_grad=held.requires_grad
                )

        register_parameter.__grouped_ep_on_meta__ = True  # type: ignore[attr-defined]
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within, in this thread, every parameter a module registers is moved to meta as it is
    registered, before its initialization writes it: a constructor then builds its buffers on
    the device and its parameters cost no memory and no random numbers. The memory of each
    parameter is taken before the move, untouched (an untouched allocation costs no physical
    memory)."""
    _install_patch()
    before = getattr(_ON_META, "active", False)
    _ON_META.active = True
    try:
        yield
    finally:
        _ON_META.active = before


def nonpersistent_names(model: nn.Module) -> list[str]:
    """The names of `model`'s non-persistent buffers still on meta, as checkpoints would name
    them (wrapper components dropped)."""
    return [
        unwrapped_name(f"{prefix}.{n}" if prefix else n)
        for prefix, (_, names) in nonpersistent_buffers(model).items()
        for n in names
    ]


def _rebuild(module: nn.Module, device: torch.device) -> nn.Module:
    """A new module of `module`'s type on `device`, from the arguments it keeps, its parameters
    on meta (a torchtitan model keeps `freqs_cis` on the model itself: building it again, whole,
    took the model's memory once more on every rank). If a buffer comes out on meta that way
    (a constructor that computes it from a parameter), the module is built again for real.
    The random number generators are left as they were."""
    params = inspect.signature(type(module).__init__).parameters
    required = [
        n
        for n, p in list(params.items())[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not all(hasattr(module, n) for n in required):
        missing = [n for n in required if not hasattr(module, n)]
        raise TypeError(f"it does not keep its constructor arguments {missing}")
    kwargs = {n: getattr(module, n) for n in required}
    if "device" in params:
        kwargs["device"] = device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        with _parameters_on_meta():
            fresh = type(module)(**kwargs)
        if any(b is not None and b.is_meta for b in fresh._buffers.values()):
            fresh = type(module)(**kwargs)
    return fresh


def _init_weights_owners(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> the nearest enclosing module (itself included) with `_init_weights`."""
    owners: dict[str, nn.Module] = {}
    for prefix, module in model.named_modules():
        if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
            owners[prefix] = module
        else:
            owner = owners.get(prefix.rpartition(".")[0]) if prefix else None
            if owner is not None:
                owners[prefix] = owner
    return owners


def _from_init_weights(
    owner: nn.Module, module: nn.Module, names: list[str], device: torch.device
) -> dict[str, torch.Tensor]:
    """The buffers `names` of `module` as `owner._init_weights(module)` sets them (those it
    sets: a floating-point buffer left all-NaN was not touched; an integer or bool one is run
    twice, from its dtype's lowest and highest value, and kept where both runs agree: BERT's
    `position_ids`). Nothing of `module` changes."""
    buffers = dict(module._buffers)
    names = [n for n in names if buffers.get(n) is not None]
    floats = [n for n in names if buffers[n].is_floating_point()]
    others = [n for n in names if n not in floats and not buffers[n].is_complex()]
    if not floats and not others:
        return {}

    def filled(n: str, high: bool) -> torch.Tensor:
        b = buffers[n]
        if b.is_floating_point():
            value = math.nan
        elif b.dtype == torch.bool:
            value = high
        else:
            info = torch.iinfo(b.dtype)
            value = info.max if high else info.min
        return torch.full(b.shape, value, dtype=b.dtype, device=device)

    runs = [_init_once(owner, module, {n: filled(n, high) for n in floats + others})
            for high in ((False, True) if others else (False,))]  # fmt: skip
    if runs[0] is None or runs[-1] is None:
        return {}
    low, high = runs[0], runs[-1]
    got = {n: low[n] for n in floats if not bool(low[n].isnan().all())}
    got |= {n: low[n] for n in others if torch.equal(low[n], high[n])}
    return {n: v for n, v in got.items() if isinstance(v, torch.Tensor) and v.device == device}


def _init_once(
    owner: nn.Module, module: nn.Module, fresh: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """`owner._init_weights(module)` run with the buffers `fresh` in place and every other
    tensor of `module` a meta stand-in (so nothing loaded is touched); `fresh` as it set them,
    or None if it cannot run this way. `module` is restored."""
    params, buffers = dict(module._parameters), dict(module._buffers)
    try:
        for k, p in params.items():
            if p is not None:
                stand_in = torch.empty(p.shape, dtype=p.dtype, device="meta")
                module._parameters[k] = nn.Parameter(stand_in, requires_grad=p.requires_grad)
        for k, b in buffers.items():
            if b is not None:
                module._buffers[k] = fresh.get(
                    k, torch.empty(b.shape, dtype=b.dtype, device="meta")
                )
        with torch.no_grad():
            owner._init_weights(module)
        return {n: module._buffers[n] for n in fresh}
    except Exception:  # noqa: BLE001 (an _init_weights that cannot run this way: rebuild)
        return None
    finally:
        module._parameters.clear()
        module._parameters.update(params)
        module._buffers.clear()
        module._buffers.update(buffers)


def fresh_buffers(
    model: nn.Module,
    device: torch.device | str,
    only_meta: bool = True,
    failures: list[str] | None = None,
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, buffer name, value on `device`) for every non-persistent buffer still on meta
    (or every one, `only_meta=False`: after `to_empty` they hold garbage).

    Raises LoadError naming every buffer that cannot be recomputed, and why; with `failures`
    given, those are appended to it instead and the others returned.
    """
    device = canonical_device(device)  # compared with the device of computed values
    out, failed = [], []
    owners = _init_weights_owners(model)
    for prefix, (module, names) in nonpersistent_buffers(model, only_meta).items():
        owner = owners.get(prefix)
        initialized = _from_init_weights(owner, module, names, device) if owner else {}
        out += [(module, n, initialized[n]) for n in names if n in initialized]
        names = [n for n in names if n not in initialized]
        if not names:
            continue
        where = [f"{prefix}.{n}" if prefix else n for n in names]
        try:
            fresh = _rebuild(module, device)
        except Exception as e:  # any constructor failure: report it with the buffer names
            failed.append(f"{', '.join(where)} ({type(module).__name__}: {type(e).__name__}: {e})")
            continue
        for name, full in zip(names, where):
            value = fresh._buffers.get(name)
            old = module._buffers[name]
            if value is None or value.is_meta or value.shape != old.shape:
                got = None if value is None else (tuple(value.shape), str(value.device))
                failed.append(
                    f"{full} ({type(module).__name__} rebuilt gives {got}, need {tuple(old.shape)})"
                )
                continue
            out.append((module, name, value.to(old.dtype)))
    if failed and failures is not None:
        failures.extend(failed)
    elif failed:
        raise LoadError(
            "non-persistent buffers hold no values, and none is read from a checkpoint (they are "
            "not part of the state dict); they could not be recomputed from their modules' "
            "initialization: " + "; ".join(failed) + ". Build "
            "these modules on a real device, or set the buffers before the forward."
        )
    return out


def refresh_buffers(model: nn.Module, warn_random: bool = True) -> None:
    """Recompute the model's non-persistent buffers (rotary `inv_freq`, ...): no checkpoint holds
    them, and after `model.to_empty(...)` (the way to materialize a meta model before a load)
    they hold garbage. Each takes the value its module's own initialization gives, as in a
    fresh build; one that cannot be recomputed keeps its value, with a warning naming it. So
    does one whose initialization is random (drawn twice, from two seeds, it differs): drawn
    anew here, it replaced a seeded build's value with another (a review: a fixed random
    projection changed by 3.9 and the resumed run trained another model)."""
    found = nonpersistent_buffers(model, only_meta=False)
    if not found:
        return
    module, names = next(iter(found.values()))
    device = module._buffers[names[0]].device
    failures: list[str] = []
    values = fresh_buffers(model, device, False, failures)
    seed = (torch.initial_seed() + 1) % 2**63
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if (
        device.type == "cuda") else []  # fmt: skip
    with torch.random.fork_rng(devices=cuda):  # the generators it draws from, restored after
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(cuda[0]):
                torch.cuda.manual_seed(seed)
        again = fresh_buffers(model, device, False, [])
    drawn = {(id(owner), name): value for owner, name, value in again}
    names_of = {id(m): prefix for prefix, (m, _) in found.items()}
    random = []
    for owner, name, value in values:
        other = drawn.get((id(owner), name))
        if other is not None and not torch.equal(other.to(value.device), value):
            prefix = names_of.get(id(owner), "")
            random.append(f"{prefix}.{name}" if prefix else name)
            continue
        owner._buffers[name] = value.to(owner._buffers[name].device)
    if random and warn_random:  # the same on every rank: the caller says it on one
        warnings.warn(
            "checkpoint.load: these non-persistent buffers (held by no checkpoint) have a random "
            "initialization and keep the values they hold (a seeded build's, or garbage if the "
            "model was materialized with to_empty: then set them yourself, or make them "
            "persistent buffers): " + ", ".join(random),
            stacklevel=4,
        )
    if failures:
        warnings.warn(
            "checkpoint.load: these non-persistent buffers (held by no checkpoint) could not be "
            "recomputed from their modules' initialization and keep their values; if the model "
            "was materialized with to_empty, they hold garbage: " + "; ".join(failures),
            stacklevel=4,
        )
