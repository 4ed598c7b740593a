"""Checkpoint keys renamed to the model's names the way `from_pretrained` renames them before
any conversion: transformers' prefix changes (`PrefixChange`: a VLM checkpoint's
`model.language_model.` keys for its text model, Qwen-Omni's `thinker.`), then the base model's
prefix added or stripped (a base model from its head model's checkpoint, and back).
"""

from __future__ import annotations

import dataclasses
from itertools import chain

from torch import nn

from grouped_ep._names import unwrapped_name
from grouped_ep.loading.converted import is_transformers_model, own_class_names
from grouped_ep.loading.safetensors import Checkpoint


def model_named(model: nn.Module, ckpt: Checkpoint) -> tuple[Checkpoint, dict[str, str]]:
    """`ckpt` with its keys named as `model` names them: `with_prefix_changes`, then
    `align_base_prefix`. Returns the renamed checkpoint and {renamed key: key in the files}
    (empty if nothing changed)."""
    names = _names(model)
    changed, first = with_prefix_changes(model, ckpt, names)
    aligned, second = align_base_prefix(model, changed, names)
    in_files = dict(first)  # renamed key -> key in the files
    for new, old in second.items():
        in_files.pop(old, None)
        in_files[new] = first.get(old, old)
    return aligned, {new: old for new, old in in_files.items() if new != old}


def with_prefix_changes(
    model: nn.Module, ckpt: Checkpoint, names: set[str]
) -> tuple[Checkpoint, dict[str, str]]:
    """`ckpt` with transformers' `PrefixChange` renamings of `model`'s type applied to its keys,
    as `from_pretrained` applies them before it matches keys to the model: where that names
    more of the model's tensors (after the base prefix is aligned) than the keys as they are.
    `save_pretrained` does not reverse them (nothing records that the prefix was there), so
    they are read here, not off the probes of `converted`. `names`: the model's (`_names`)."""
    changes = _prefix_changes(model)
    if not changes:
        return ckpt, {}
    from transformers.core_model_loading import apply_renamings

    keys = list(chain(ckpt.entries, ckpt.unreadable))
    rename = {k: apply_renamings(k, changes) for k in keys}
    if all(k == v for k, v in rename.items()) or len(set(rename.values())) != len(rename):
        return ckpt, {}
    renamed = _renamed(ckpt, rename)
    if _named(model, renamed, names) <= _named(model, ckpt, names):
        return ckpt, {}
    return renamed, {new: old for old, new in rename.items() if new != old}


def _prefix_changes(model: nn.Module) -> list:
    if not is_transformers_model(model):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    try:
        with own_class_names(model):
            mapping = get_model_conversion_mapping(model, add_legacy=False)
        return [c for c in mapping if isinstance(c, PrefixChange)]
    except Exception:  # noqa: BLE001 (a mapping that cannot be read: no prefix change known)
        return []


def _names(model: nn.Module) -> set[str]:
    return {unwrapped_name(n) for n, _ in chain(model.named_parameters(), model.named_buffers())}


def _named(model: nn.Module, ckpt: Checkpoint, names: set[str]) -> int:
    """How many of `ckpt`'s keys, base prefix aligned, are `names` of `model`'s tensors."""
    aligned, _ = align_base_prefix(model, ckpt, names)
    return len(names.intersection(chain(aligned.entries, aligned.unreadable)))


def _renamed(ckpt: Checkpoint, rename: dict[str, str]) -> Checkpoint:
    entries = {rename[k]: dataclasses.replace(e, key=rename[k]) for k, e in ckpt.entries.items()}
    unreadable = {rename[k]: d for k, d in ckpt.unreadable.items()}
    return Checkpoint(ckpt.root, ckpt.files, entries, unreadable)


def align_base_prefix(model: nn.Module, ckpt: Checkpoint, names: set[str]):
    """A transformers base model (`Qwen3MoeModel`) from a checkpoint of its model with a head
    (`model.layers...`), or a model with a head from its base model's checkpoint: the keys with
    the base model's prefix stripped or added, as `from_pretrained` does. Returns the checkpoint
    as the model names it, and {renamed key: key in the files} (empty if nothing changed).
    `names`: the model's tensors' names (`_names`)."""
    prefix = getattr(model, "base_model_prefix", "") if is_transformers_model(model) else ""
    if not prefix:
        return ckpt, {}
    dot = f"{prefix}."
    keys = list(chain(ckpt.entries, ckpt.unreadable))
    model_has = any(n.startswith(dot) for n in names)
    ckpt_has = any(k.startswith(dot) for k in keys)
    if model_has == ckpt_has:
        return ckpt, {}
    if ckpt_has:  # strip: keys of the head (lm_head) stay as they are, unused
        rename = {k: k.removeprefix(dot) for k in keys}
    else:  # add, to the keys that are not the model's names already
        rename = {k: k if k in names else dot + k for k in keys}
    # Only where it names more of the model's tensors (a VLM's `language_model.model.` keys,
    # which transformers' conversion renames, are not its base model's; Qwen-Omni's thinker
    # has `audio_tower.` keys under either name), and names each once.
    if len(set(rename.values())) != len(rename) or len(names.intersection(rename.values())) <= len(
        names.intersection(keys)
    ):
        return ckpt, {}
    return _renamed(ckpt, rename), {new: old for old, new in rename.items() if new != old}


def toggle_prefix(model: nn.Module, names: list[str]) -> list[str]:
    """`names` with the base model's prefix stripped where they have it, else added."""
    dot = f"{model.base_model_prefix}."
    return [n.removeprefix(dot) if n.startswith(dot) else dot + n for n in names]
