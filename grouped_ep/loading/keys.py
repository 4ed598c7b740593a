"""Checkpoint keys -> model tensors: which checkpoint tensors tile each model tensor.

A layout is one way the checkpoint may hold a model tensor: a list of (key, offset, shape in the
model's ndim, shape in the file). The first layout whose keys all exist wins. "auto" tries, in order:
the same name; for a transformers model, transformers' own checkpoint conversion (the
weight-conversion mapping `from_pretrained` / `save_pretrained` use: Mixtral's
`block_sparse_moe.experts.{i}.w1/w3/w2`, per-expert biases, ...), read off by running its
reverse on coordinate probes (`converted.converted_layout`); then generic per-expert or split
keys of fused experts (`gate_up_proj`, `down_proj`) for other models. A user `key_map` (callable or mapping)
names keys for anything else.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

from torch import nn

from grouped_ep._names import unwrapped_name
from grouped_ep.loading.converted import (
    converted_layout,
    is_transformers_model,
    own_class_names,
)
from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.plan import Piece
from grouped_ep.loading.safetensors import Checkpoint

KeyMap = Callable[[str], "str | Sequence[str | Sequence[str]] | None"]


# `experts.<proj>` at any depth, the model's top level included (a bare MoE layer).
_EXPERT_PARAM = re.compile(r"^(?P<prefix>(?:.+\.)?experts)\.(?P<proj>[^.]+)$")
# (key, offset in the model tensor, shape there, key's shape[, corner in the key and the key dim
# each model dim follows, when the piece is only part of the key or the key is transposed[, the
# shape the key is read as, when that is a view of it with one dim split in two]])
Layout = list[tuple]


def same_name_transpose(model, name: str) -> tuple[int, int] | None:
    """(dim0, dim1) of a transformers conversion that keeps `name`'s key and transposes it where
    its shape is not the model tensor's (`Transpose(check_dims=True)`: qwen3_vl_moe's experts,
    whose Hub files hold `[E, H, 2I]`), else None. Probes cannot show it: the key keeps the
    tensor's name, and the op compares shapes with the model's real parameter."""
    if not is_transformers_model(model):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    try:
        with own_class_names(model):
            mapping = get_model_conversion_mapping(model, add_legacy=False)
        for conv in mapping:
            if (
                not isinstance(conv, WeightConverter)
                or conv.source_patterns != conv.target_patterns
            ):
                continue
            ops = [op for op in conv.operations if isinstance(op, Transpose) and op.check_dims]
            patterns = [re.escape(p).replace(r"\*", r"[^.]+") for p in conv.source_patterns]
            if len(ops) == 1 and any(re.search(rf"(^|\.){p}$", name) for p in patterns):
                return ops[0].dim0, ops[0].dim1
    except Exception:  # noqa: BLE001 (a mapping that cannot be read: no such conversion known)
        return None
    return None


def _stacked(prefix: str, experts: int, names: Sequence[str], rows: int, cols: int) -> Layout:
    """Per-expert 2-D keys `{prefix}.{i}.{name}` of shape [rows, cols], stacked on dim 0 and
    concatenated on dim 1 in `names` order (gate rows first, then up). Experts in numeric order."""
    return [
        (f"{prefix}.{i}.{name}", (i, j * rows, 0), (1, rows, cols), (rows, cols))
        for i in range(experts)
        for j, name in enumerate(names)
    ]


def _auto_layouts(name: str, shape: tuple[int, ...], ckpt: Checkpoint, model=None) -> list[Layout]:
    zero = (0,) * len(shape)
    layouts = [[(name, zero, shape, shape)]]
    if name in ckpt:
        swap = same_name_transpose(model, name) if ckpt[name].shape != shape else None
        if swap is not None:  # transformers transposes such a key where its shape differs
            dims = list(range(len(shape)))
            dims[swap[0]], dims[swap[1]] = dims[swap[1]], dims[swap[0]]
            file_shape = tuple(shape[d] for d in dims)
            return [[(name, zero, shape, file_shape, zero, tuple(dims))]]
        return layouts
    converted = converted_layout(model, name, shape, ckpt=ckpt) if model is not None else None
    if converted:
        layouts.append(converted)
    if (not converted or not all(key in ckpt for key, *_ in converted)) and getattr(
        model, "_weight_conversions", None
    ) is not None:
        # A model from from_pretrained keeps the conversions its own checkpoint needed (none
        # for a checkpoint of fused keys): this one may need transformers' default ones.
        default = converted_layout(model, name, shape, default_mapping=True, ckpt=ckpt)
        if default and default != converted:
            layouts.append(default)
    m = _EXPERT_PARAM.match(name)
    if m is None or len(shape) != 3 or shape[0] == 0:
        return layouts
    e, rows, cols = shape
    proj = m["proj"]
    prefix = m["prefix"]
    if proj == "gate_up_proj" and rows % 2 == 0:
        half = rows // 2
        layouts.append(_stacked(prefix, e, ["gate_proj.weight", "up_proj.weight"], half, cols))
        split = (e, half, cols)
        layouts.append(
            [
                (f"{prefix}.gate_proj", (0, 0, 0), split, split),
                (f"{prefix}.up_proj", (0, half, 0), split, split),
            ]
        )
    layouts.append(_stacked(prefix, e, [f"{proj}.weight"], rows, cols))
    layouts.append(_stacked(prefix, e, [proj], rows, cols))
    return layouts


def _user_layout(name: str, shape: tuple[int, ...], value: object, ckpt: Checkpoint) -> Layout:
    """A key_map answer: a key, or a list of keys (or tuples of keys, concatenated on dim 0)
    stacked on a new dim 0 (one per index of dim 0) or concatenated on dim 0."""
    nd = len(shape)
    if isinstance(value, str):
        base = value.removesuffix("_blocks")
        if f"{base}_blocks" in ckpt and f"{base}_scales" in ckpt and base not in ckpt:
            return []  # MXFP4 `{value}_blocks` / `_scales`: loading.quant reads them
        if value not in ckpt:
            raise LoadError(f"{ckpt.root}: missing key {value!r} (key_map for {name!r})")
        return [(value, (0,) * nd, shape, shape)]
    if not isinstance(value, Sequence):
        raise LoadError(f"key_map({name!r}) returned {value!r}; expected a key or a list of keys")
    blocks = [[item] if isinstance(item, str) else list(item) for item in value]
    for key in (k for block in blocks for k in block):
        if key not in ckpt:
            raise LoadError(f"{ckpt.root}: missing key {key!r} (key_map for {name!r})")
    shapes = [[ckpt[k].shape for k in block] for block in blocks]
    # 2-D keys into a 3-D tensor are stacked (one block per index of dim 0), else concatenated.
    stack = nd >= 2 and len(blocks) == shape[0] and all(len(s) == nd - 1 for b in shapes for s in b)
    layout: Layout = []
    offset = 0
    for i, (block, block_shapes) in enumerate(zip(blocks, shapes)):
        inner = 0
        for key, s in zip(block, block_shapes):
            if stack:
                layout.append((key, (i, inner) + (0,) * (nd - 2), (1, *s), s))
                inner += s[0]
            elif not stack and len(s) == nd and nd >= 1:
                layout.append((key, (offset,) + (0,) * (nd - 1), s, s))
                offset += s[0]
            else:
                raise LoadError(
                    f"{ckpt[key].path}: shape mismatch: key_map puts {key!r} of shape {s} into "
                    f"{name!r} of shape {shape}"
                )
    return layout


def _check_layout(
    name: str, shape: tuple[int, ...], layout: Layout, ckpt: Checkpoint
) -> list[Piece]:
    pieces = []
    for key, offset, pshape, file_shape, *part in layout:
        entry = ckpt[key]
        if entry.shape != file_shape or any(o + n > s for o, n, s in zip(offset, pshape, shape)):
            tensor = "the model's tensor" if name == key else f"the model's {name!r}"
            needs = (
                "" if tuple(file_shape) == tuple(shape) else f" and needs {list(file_shape)} here"
            )
            raise LoadError(
                f"{entry.path}: shape mismatch for {key!r}: {tensor} is {list(shape)}{needs}, "
                f"the file has {list(entry.shape)} (a model built from another config than the "
                "checkpoint's?)"
            )
        corner, dims, view = (part + [None, None, None])[:3]
        pieces.append(Piece(entry, offset, pshape, corner, dims, view))
    return pieces


def _ask(key_map, name: str) -> object:
    """What a user `key_map` (callable or mapping) answers for `name`; None for "auto" / None."""
    if callable(key_map):
        return key_map(name)
    if isinstance(key_map, Mapping):
        return key_map.get(name)
    if key_map not in ("auto", None):
        raise ValueError(
            f"load_sharded: key_map must be 'auto', None, a callable or a mapping, got {key_map!r}"
        )
    return None


def mapped_keys(names: list[str], key_map) -> list[str]:
    """A tensor's names, each as the single key `key_map` names for it where it names one."""
    out = []
    for name in names:
        value = _ask(key_map, name)
        # an MXFP4 tensor is named by its logical key, or by its `_blocks` key
        out.append(value.removesuffix("_blocks") if isinstance(value, str) else name)
    return out


def resolve_pieces(
    names: list[str], shape: tuple[int, ...], ckpt: Checkpoint, key_map, model=None
) -> list[Piece]:
    """The checkpoint pieces that tile a model tensor (known by `names`), or [] if none.
    `model`: the model being loaded, for transformers' own conversion (see `converted_layout`)."""
    for name in names:
        value = _ask(key_map, name)
        if value is not None:
            layouts = [_user_layout(name, shape, value, ckpt)]
        elif key_map is None:
            layouts = [[(name, (0,) * len(shape), shape, shape)]]
        else:
            layouts = _auto_layouts(name, shape, ckpt, model)
        partial = None
        for layout in layouts:
            found = [key in ckpt for key, *_ in layout]
            if layout and all(found):
                return _check_layout(name, shape, layout, ckpt)
            if any(found) and partial is None:
                partial = (layout[found.index(False)][0], sum(found), len(found))
        if partial is not None:
            key, n, m = partial
            unreadable = getattr(ckpt, "unreadable", {}).get(key)
            if unreadable is not None:  # there, in a dtype not read: not "missing"
                raise LoadError(
                    f"{ckpt.root}: {key!r}, one of the {m} keys that make up {name!r} "
                    f"{list(shape)}, is in a dtype this loader cannot read ({unreadable})"
                )
            raise LoadError(
                f"{ckpt.root}: missing key {key!r}: the checkpoint has {n} of the {m} keys that "
                f"make up {name!r} {list(shape)}"
            )
    return []


def unwrap_ddp(model: nn.Module, key_map) -> tuple[nn.Module, Any]:
    """The model inside DistributedDataParallel / nn.DataParallel wrappers (nested too), and
    `key_map` asked under its names there as well as under the wrapper's `module.` names."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    prefix = ""
    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model, prefix = model.module, prefix + "module."
    if not prefix or not (callable(key_map) or isinstance(key_map, Mapping)):
        return model, key_map
    if isinstance(key_map, Mapping):
        return model, {str(k).removeprefix(prefix): v for k, v in key_map.items()}
    ask = key_map

    def lookup(name: str):
        value = ask(name)
        return ask(prefix + name) if value is None else value

    return model, lookup


def refuse_unknown_names(model: nn.Module, key_map) -> None:
    """A mapping `key_map` whose entries name no tensor of the model (a typo: `lm_head.weights`)
    would be ignored, and the tensor it meant loaded from its own key: a LoadError instead."""
    if not isinstance(key_map, Mapping):
        return
    named = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    names = {m for n, _ in named for m in (n, unwrapped_name(n))}  # also `_orig_mod.` names
    unknown = [k for k in key_map if k not in names]
    if unknown:
        hints = [difflib.get_close_matches(str(k), names, n=1) for k in unknown[:5]]
        shown = ", ".join(
            f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in zip(unknown, hints)
        )
        more = f", ... ({len(unknown)} in all)" if len(unknown) > 5 else ""
        raise LoadError(f"load_sharded: key_map names no tensor of the model: {shown}{more}")


def with_wrapped_names(model: nn.Module, key_map) -> Any:
    """`key_map` (a callable or mapping), also asked under the name a tensor has inside wrapper
    modules (`named_parameters()` of a wrapped model) when its own name gives nothing."""
    named = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    wrapped = {unwrapped_name(n): n for n, _ in named if unwrapped_name(n) != n}
    if not wrapped or not (callable(key_map) or isinstance(key_map, Mapping)):
        return key_map
    ask = key_map if callable(key_map) else key_map.get

    def lookup(name: str):
        value = ask(name)
        return ask(wrapped[name]) if value is None and name in wrapped else value

    return lookup
