"""Non-persistent buffers: values no checkpoint holds (rotary `inv_freq`, causal masks, ...).

After a meta-device build they are meta, so the model cannot run after loading its weights.
`fresh_buffers` recomputes them from the owning module's own initialization: the module type is
built again, alone, on the target device, from the arguments it keeps (`config` for transformers
modules), and its buffers are taken. Nothing bigger than the module that owns the buffers is
built. Where that is impossible, the error names each buffer.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from grouped_ep.loading.errors import LoadError

__all__ = ["fresh_buffers", "nonpersistent_buffers"]


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


def _rebuild(module: nn.Module, device: torch.device) -> nn.Module:
    """A new module of `module`'s type on `device`, from the arguments it keeps."""
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
    with torch.device(device):
        return type(module)(**kwargs)


def fresh_buffers(
    model: nn.Module, device: torch.device | str, only_meta: bool = True
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, buffer name, value on `device`) for every non-persistent buffer still on meta
    (or every one, `only_meta=False`: after `to_empty` they hold garbage).

    Raises LoadError naming every buffer that cannot be recomputed, and why.
    """
    device = torch.device(device)
    out, failed = [], []
    for prefix, (module, names) in nonpersistent_buffers(model, only_meta).items():
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
    if failed:
        raise LoadError(
            "non-persistent buffers hold no values and no checkpoint holds them; they could not be "
            "recomputed from their modules' initialization: " + "; ".join(failed) + ". Build "
            "these modules on a real device, or set the buffers before the forward."
        )
    return out
