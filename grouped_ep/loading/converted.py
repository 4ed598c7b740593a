"""transformers' own checkpoint conversion, read off on probes: where `save_pretrained` puts a
model tensor on disk (renamed keys, per-expert keys of a fused stack, a slice of a fused key, a
permuted or transposed key), found by running the conversion's reverse on coordinate probes.
Used by `keys.resolve_pieces` ("auto") and by `export_hf` (which keys each tensor becomes).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import sys
import threading
import warnings
from collections.abc import Iterator

import numpy as np
import torch

import grouped_ep.loading.scaled as scaled
from grouped_ep.loading.plan import runs

# (key, offset in the model tensor, shape there, key's shape[, ...]): as in `keys.Layout`
Layout = list[tuple]


def is_transformers_model(model) -> bool:
    """Whether `model` is a transformers `PreTrainedModel`, without importing transformers: such
    a model means transformers is imported already, and the import costs seconds."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


_CLASS_NAMES_LOCK = threading.Lock()
_SESSIONS: dict[int, list] = {}  # id(model) -> its default conversions, during a session


@contextlib.contextmanager
def conversion_session(model) -> Iterator[None]:
    """For the duration, `model`'s FSDP2 classes show their own names (`own_class_names`,
    entered once) and transformers' default conversions of `model` are computed once: per
    tensor, each walked every module of the model, so an export took time in layers squared
    (a review: 96 layers, 5.7 million `named_modules` calls, 27 s of CPU against 4.8 s for
    `save_pretrained`)."""
    if not is_transformers_model(model) or id(model) in _SESSIONS:
        yield
        return
    with own_class_names(model):
        _SESSIONS[id(model)] = default_conversions(model)
        try:
            yield
        finally:
            del _SESSIONS[id(model)]


def default_conversions(model) -> list:
    """transformers' default conversions of `model`, as `revert_weight_conversion` computes them
    for a model `from_pretrained` recorded none on (its PrefixChanges dropped); computed once
    per `conversion_session`. Call under `own_class_names`: they are found by class name."""
    cached = _SESSIONS.get(id(model))
    if cached is not None:
        return cached
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    forward = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in forward if not isinstance(c, PrefixChange)]


@contextlib.contextmanager
def own_class_names(model) -> Iterator[None]:
    """For the duration, every FSDP2-wrapped module of `model` shows its own class's name and
    module instead of FSDP2's `FSDP<Name>` subclass, which is defined in torch.

    transformers finds a model's checkpoint conversion by class name, then `model_type`, and
    skips every class defined outside transformers as custom code. A `fully_shard`-ed model
    would then save and load with no conversion at all (hy_v4's `hc_head`, nemotron_h's
    `backbone.` names)."""
    if id(model) in _SESSIONS:  # a session has them shown already
        yield
        return
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapper = getattr(fsdp, "FSDPModule", None)
    classes = {type(m) for m in model.modules()} if wrapper is not None else set()
    swaps = []
    for cls in classes:
        bases = [b for b in cls.__bases__ if not issubclass(b, wrapper)]
        if issubclass(cls, wrapper) and len(bases) == 1:
            swaps.append((cls, bases[0]))
    if not swaps:
        yield
        return
    with _CLASS_NAMES_LOCK:
        saved = [(cls, cls.__name__, cls.__qualname__, cls.__module__) for cls, _ in swaps]
        try:
            for cls, base in swaps:
                cls.__name__, cls.__qualname__ = base.__name__, base.__qualname__
                cls.__module__ = base.__module__
            yield
        finally:
            for cls, name, qualname, module in saved:
                cls.__name__, cls.__qualname__, cls.__module__ = name, qualname, module


def revert_conversion(
    model, state_dict: dict[str, torch.Tensor], default_mapping: bool = False
) -> dict[str, torch.Tensor]:
    """transformers' save-time conversion (`revert_weight_conversion`, what `save_pretrained`
    runs) of in-memory tensors to checkpoint keys, also for a model `fully_shard` has wrapped.
    default_mapping: transformers' default conversions for the model's type, not the ones a
    `from_pretrained` recorded on it (`_weight_conversions`)."""
    from transformers.core_model_loading import revert_weight_conversion

    recorded = model.__dict__.get("_weight_conversions", _NONE)
    with own_class_names(model):
        if not default_mapping and recorded not in (_NONE, None):  # from_pretrained's own
            return revert_weight_conversion(model, state_dict)
        default = default_conversions(model)
        if not default:  # no conversion for the model: transformers returns the dict as it is
            return state_dict
        model.__dict__["_weight_conversions"] = default  # handed over, not computed again
        try:
            return revert_weight_conversion(model, state_dict)
        finally:
            if recorded is _NONE:
                del model.__dict__["_weight_conversions"]
            else:
                model.__dict__["_weight_conversions"] = recorded


_NONE = object()


def conversion_groups(model, names: list[str], default_mapping: bool = False) -> list[list[str]]:
    """`names` (model tensors) partitioned into the sets transformers' save-time conversion
    turns into checkpoint keys together: a converter that merges several model tensors (a fused
    `qkv_proj` from `q_proj`, `k_proj`, `v_proj`; text and vision experts into one list) needs
    all of them in one call. Each name alone when the model is not a transformers model or the
    conversion cannot be read.

    transformers groups a converter's sources by the key the converter renames them to
    (`apply_converters`); this asks the same question of the same reversed converters.
    """
    singles = [[n] for n in names]
    if not is_transformers_model(model):
        return singles
    from transformers.core_model_loading import WeightConverter, apply_converters

    try:
        with own_class_names(model):
            forward = None if default_mapping else getattr(model, "_weight_conversions", None)
            if forward is None:
                forward = default_conversions(model)
            reverse = [c.reverse_transform() for c in forward[::-1]]
        converters = [c for c in reverse if isinstance(c, WeightConverter)]
        groups: dict[str, list[str]] = {}
        for name in names:
            renamed, pattern = apply_converters(name, converters)
            groups.setdefault(renamed if pattern is not None else f"\0{name}", []).append(name)
        return list(groups.values())
    except ImportError:  # a name that moved (5.21+ is checked at the entry points): raised,
        raise  # not one tensor at a time, which is wrong for merging converters
    except Exception:  # noqa: BLE001 (a mapping that cannot be read: one name at a time)
        return singles


_PROBE_LIMIT = 1 << 31  # most probe bytes per dim before giving up on a conversion
_SCALE_ABOVE = 1 << 26  # probe bytes above which a scaled-down probe is tried first


_MEMBERS_CACHE = "_grouped_ep_conversion_members"
_LAYOUTS_CACHE = "_grouped_ep_converted_layouts"
_UNPROBED = "_grouped_ep_unprobed"
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")  # a numeric component inside a name: a layer index


@contextlib.contextmanager
def conversions_cached(model) -> Iterator[dict[str, str]]:
    """Within, `_conversion_members` works the model's conversion groups out once, and
    `converted_layout` probes each layer's tensors once (see `_layout_for_layer`). Yields
    {tensor name: why its conversion was not probed}, filled instead of warning at once: the
    caller warns only for tensors no key was found for in the end (gpt-oss's MXFP4 stacks,
    over the probe limit, are read from their `_blocks` keys)."""
    model.__dict__[_MEMBERS_CACHE] = None
    model.__dict__[_LAYOUTS_CACHE] = {}
    model.__dict__[_UNPROBED] = unprobed = {}
    try:
        yield unprobed
    finally:
        model.__dict__.pop(_MEMBERS_CACHE, None)
        model.__dict__.pop(_LAYOUTS_CACHE, None)
        model.__dict__.pop(_UNPROBED, None)


def _conversion_members(
    model, name: str, default_mapping: bool = False
) -> dict[str, tuple[int, ...]] | None:
    """The model tensors converted together with `name` (see `conversion_groups`; under
    transformers' default conversions with `default_mapping`), `name` first, with their global
    shapes (once per mapping per `conversions_cached` block)."""
    caches = model.__dict__.get(_MEMBERS_CACHE) or {}
    cache = caches.get(default_mapping)
    if cache is None:
        shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        cache = {}
        for group in conversion_groups(model, list(shapes), default_mapping):
            for n in group:
                cache[n] = {m: shapes[m] for m in [n] + [g for g in group if g != n]}
        if _MEMBERS_CACHE in model.__dict__:
            model.__dict__[_MEMBERS_CACHE] = {**caches, default_mapping: cache}
    return dict(cache[name]) if name in cache else None


def _key_pieces(coords: list[torch.Tensor], mine: torch.Tensor, key: str, shape) -> Layout | None:
    """The layout pieces of one checkpoint key: `coords[d]` holds, per element of the key, the
    model coordinate on dim d; `mine` marks the elements of this model tensor. Either the
    whole key is a box of the model tensor (size-1 dims may be squeezed), or the key has the
    model's ndim, this tensor's elements form a box of it, and each model dim follows one key
    dim (a slice of a fused key, a permutation of rows, a transposed key): one piece per run."""
    nd = len(shape)
    file_shape = tuple(coords[0].shape)
    if bool(mine.all()):
        lo = [int(c.min()) for c in coords]
        box = tuple(int(c.max()) - lo[d] + 1 for d, c in enumerate(coords))
        if math.prod(box) == math.prod(file_shape) and all(
            torch.equal(
                c.reshape(box),
                (lo[d] + torch.arange(box[d]))
                .view([box[d] if i == d else 1 for i in range(nd)])
                .expand(box),
            )
            for d, c in enumerate(coords)
        ):
            return [(key, tuple(lo), box, file_shape)]
    if len(file_shape) != nd:
        return _split_key_pieces(coords, mine, key, shape)
    where = torch.nonzero(mine)
    lo_f, hi_f = where.min(0).values.tolist(), where.max(0).values.tolist()
    region = tuple(slice(a, b + 1) for a, b in zip(lo_f, hi_f))
    if not bool(mine[region].all()):
        return None  # this tensor's elements of the key are not one box
    per_dim, dims = [], []
    for d in range(nd):  # the key dim model dim d follows, and its runs along it
        c = coords[d][region]
        for a in range(nd):
            line = c[tuple(slice(None) if i == a else 0 for i in range(nd))]
            view = [line.numel() if i == a else 1 for i in range(nd)]
            if torch.equal(c, line.view(view).expand(c.shape)):
                break
        else:
            return None  # model dim d follows no single key dim
        dims.append(a)
        model_idx = line.numpy()  # key index i of the box -> model index; its runs are pieces
        starts, firsts, lengths = runs(np.arange(len(model_idx)), model_idx)
        per_dim.append(
            [(int(f) + lo_f[a], int(m), int(n)) for f, m, n in zip(starts, firsts, lengths)]
        )
    if sorted(dims) != list(range(nd)):
        return None
    in_order = dims == list(range(nd))
    layout: Layout = []
    for combo in itertools.product(*per_dim):
        corner = [0] * nd
        for d, (f, _, _) in enumerate(combo):
            corner[dims[d]] = f
        offset = tuple(m for _, m, _ in combo)
        box = tuple(n for _, _, n in combo)
        if in_order and corner == [0] * nd and box == file_shape:
            layout.append((key, offset, box, file_shape))
        else:
            layout.append((key, offset, box, file_shape, tuple(corner), tuple(dims)))
    return layout


def _split_key_pieces(
    coords: list[torch.Tensor], mine: torch.Tensor, key: str, shape
) -> Layout | None:
    """`_key_pieces` for a key of one dim fewer than the model tensor, read as a view of itself
    with one dim split in two (the same bytes): inkling2_loop's message queries [2 * L, H] hold,
    per layer l, rows 2l and 2l + 1 for two of the model tensor's [L, 4, H] slots. Each split is
    tried; a piece keeps the key's real shape, and a partial one the view it is read through."""
    file_shape = tuple(coords[0].shape)
    if len(file_shape) + 1 != len(shape):
        return None
    for k, n in enumerate(file_shape):
        for f in range(2, n):
            if n % f:
                continue
            view = file_shape[:k] + (n // f, f) + file_shape[k + 1 :]
            pieces = _key_pieces([c.reshape(view) for c in coords], mine.reshape(view), key, shape)
            if pieces is not None:
                return [
                    (p[0], p[1], p[2], file_shape)
                    if len(p) == 4
                    else (*p[:3], file_shape, *p[4:], view)
                    for p in pieces
                ]
    return None


def converted_layout(
    model, name: str, shape: tuple[int, ...], default_mapping: bool = False, ckpt=None
) -> Layout | None:
    """`_probed_layout`, probed once per layer: transformers' conversions match names with any
    layer index, so layer l's tensor of the same name pattern, shape and group lies where layer
    0's does with the index changed. The layout of a tensor whose name holds a number (the last
    one: `model.layers.7.`) is kept when all its keys start with the name up to that number;
    another layer's is made from it by changing that prefix (a probe of a real-size expert stack
    at its real size took seconds and gigabytes: one per layer made a 48-layer load minutes
    long)."""
    cache = model.__dict__.get(_LAYOUTS_CACHE)
    found = list(_NUMBER.finditer(name))
    if cache is None or not found or not is_transformers_model(model) or not shape:
        return _probed_layout(model, name, shape, default_mapping)
    prefix = name[: found[-1].end() + 1]
    members = _conversion_members(model, name, default_mapping) or {name: shape}
    group = tuple(sorted((_NUMBER.sub("#", n), tuple(s)) for n, s in members.items()))
    slot = (_NUMBER.sub("#", name), tuple(shape), group, default_mapping)
    if slot in cache:
        old, layout = cache[slot]
        reused = [(prefix + key[len(old) :], *rest) for key, *rest in layout]
        # A conversion that maps index numbers to others (Sapiens2's heads: conv_layers.{0,1,2}
        # are keys .{0,3,6}) gives keys the checkpoint lacks: this one is probed.
        if ckpt is None or all(key in ckpt for key, *_ in reused):
            return reused
        return _probed_layout(model, name, shape, default_mapping)
    layout = _probed_layout(model, name, shape, default_mapping)
    if layout is not None and all(key.startswith(prefix) for key, *_ in layout):
        cache[slot] = (prefix, layout)
    return layout


def _probe_dtype(most: int) -> torch.dtype:
    """The smallest integer dtype holding values up to `most` (probes of a real-size expert stack
    are as many elements as the stack: int16 takes a quarter of int64's memory)."""
    for dtype in (torch.int16, torch.int32):
        if most <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _probed_layout(
    model, name: str, shape: tuple[int, ...], default_mapping: bool = False
) -> Layout | None:
    """Where transformers' own save-time conversion puts the model tensor `name` on disk.

    Runs `revert_conversion` (what `save_pretrained` does) once per dim d on probes: `name`'s
    holds, at every element, its coordinate on d (an expanded `arange`, no memory of the
    tensor's size); the tensors converted together with it (`conversion_groups`: the other
    parts of a fused key) hold their own index in the group, so that each element of each
    checkpoint key tells which model tensor it belongs to and where. The keys must then hold
    `name` as boxes, whole or in runs of a fused or permuted key (`_key_pieces`), tiling it
    once (a transposed key included). None: not a transformers model, no conversion for
    `name`, or a conversion that is not like that, which `key_map=` must then name.

    A probe of over `_SCALE_ABOVE` bytes (a real-size expert stack) is first made on the shape
    scaled down (`scaled`), and at its real size only where that does not scale up.
    """
    if not is_transformers_model(model) or not shape or 0 in shape:
        return None
    members = _conversion_members(model, name, default_mapping) or {name: shape}
    members[name] = shape
    probe_bytes = _probe_bytes(members)
    f = scaled.scale_factor(members.values()) if probe_bytes > _SCALE_ABOVE else 1
    if f >= 4:  # two scales, f and f / 2, both below the real size

        def at(g: int) -> Layout | None:
            smaller = {n: scaled.scaled(s, g) for n, s in members.items()}
            return _probe(model, name, smaller, default_mapping)

        small = at(f)
        double = at(f // 2) if small is not None else None
        layout = scaled.grown(small, double, shape, f) if double is not None else None
        if layout is not None:
            return layout
    if probe_bytes > _PROBE_LIMIT:
        why = (
            f"load_sharded: {name} {list(shape)}: transformers' checkpoint conversion is not "
            f"probed for it ({probe_bytes / 2**30:.1f} GiB per probe, over "
            f"{_PROBE_LIMIT / 2**30:.0f} GiB, and no smaller probe scales up to it); its keys "
            "are looked for under the per-expert gate_proj / up_proj / down_proj names, else "
            "name them with key_map="
        )
        unprobed = model.__dict__.get(_UNPROBED)
        if unprobed is not None:
            unprobed[name] = why
        else:
            warnings.warn(why, stacklevel=2)
        return None
    return _probe(model, name, members, default_mapping)


def _dtype_and_source(members: dict[str, tuple[int, ...]]) -> tuple[torch.dtype, int]:
    """A probe's dtype and `source`, the step between members' values: probe value = member
    index * source + coordinate, `source` above every coordinate."""
    largest = max(max(s) for s in members.values() if s)
    source = 1 << largest.bit_length()
    return _probe_dtype((len(members) - 1) * source + largest - 1), source  # the largest value


def _probe_bytes(members: dict[str, tuple[int, ...]]) -> int:
    dtype, _ = _dtype_and_source(members)
    return sum(math.prod(s) for s in members.values()) * dtype.itemsize


def _probe(
    model, name: str, members: dict[str, tuple[int, ...]], default_mapping: bool
) -> Layout | None:
    """`_probed_layout` on probes of `members`' shapes (`name` first among them)."""
    shape = members[name]
    nd = len(shape)
    dtype, source = _dtype_and_source(members)
    probes = []
    for d in range(nd):
        view = [1] * nd
        view[d] = shape[d]
        group = {name: torch.arange(shape[d], dtype=dtype).view(view).expand(shape)}
        for j, (other, other_shape) in enumerate(members.items()):
            if other != name:
                group[other] = torch.full((), j * source, dtype=dtype).expand(other_shape)
        try:
            probes.append(revert_conversion(model, group, default_mapping))
        except Exception:  # noqa: BLE001 (a conversion that cannot run on a probe)
            return None
    keys = list(probes[0])
    if keys == [name] or any(list(p) != keys for p in probes):
        return None
    layout: Layout = []
    for key in keys:
        if any(not isinstance(p[key], torch.Tensor) for p in probes):
            return None
        # one member: every element is this tensor's (`source` may not fit the probe dtype then:
        # int16 probes of a 28672-row stack, compared with 32768, wrapped to -32768)
        probe = probes[0][key]
        mine = probe < source if len(members) > 1 else torch.ones_like(probe, dtype=torch.bool)
        if not bool(mine.any()):
            continue
        pieces = _key_pieces([p[key] for p in probes], mine, key, shape)
        if pieces is None:
            return None
        layout += pieces
    if sum(math.prod(box) for _, _, box, *_ in layout) != math.prod(shape):
        return None  # not tiled exactly once
    return layout
