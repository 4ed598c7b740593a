"""What `checkpoint.load` checks before it reads anything: a model that can hold the values (not
on meta), every model key in the checkpoint with its global shape, no checkpoint key the model
has no place for, and which parameters resume without optimizer state."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from grouped_ep._names import unwrapped_model, unwrapped_name
from grouped_ep.checkpoint.errors import CheckpointError, listed
from grouped_ep.checkpoint.inspect import CheckpointInfo
from grouped_ep.checkpoint.layout import FORMAT_VERSION, MANIFEST_FILE


def refuse_meta(model: nn.Module, caller: str = "load") -> None:
    """A model on meta has no storage to load into (DCP would copy into nothing, silently), and
    nothing to save or export (torch's writer failed late, naming no tensor)."""
    on_meta = [
        n
        for n, t in model.state_dict(keep_vars=True).items()  # what a load fills
        if (t.to_local() if isinstance(t, DTensor) else t).is_meta
    ]
    if not on_meta:
        return
    if caller == "load":
        raise CheckpointError(
            f"load: the model's tensors are on the meta device ({listed(on_meta)}); nothing can be loaded "
            "into them. Materialize the model first (model.to_empty(device=...), or "
            "grouped_ep.load_sharded from a Hugging Face checkpoint), then load"
        )
    raise CheckpointError(
        f"{caller}: the model's tensors are on the meta device ({listed(on_meta)}); they hold no "
        "values to write (left there by load_sharded(strict=False), whose report.missing names "
        "them?). Load or initialize them first"
    )


def refuse_untied(model: nn.Module) -> None:
    """A transformers model whose config ties the input and output embeddings but whose two
    embeddings are separate tensors (`model.to_empty` unties them): loading would fill both from
    the one saved tensor, and training would then update two copies, silently."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    outputs = getattr(model, "get_output_embeddings", lambda: None)()
    w_in, w_out = getattr(inputs, "weight", None), getattr(outputs, "weight", None)
    if w_in is not None and w_out is not None and w_in is not w_out:
        raise CheckpointError(
            "load: the model's config ties the input and output embeddings "
            "(tie_word_embeddings=True) but they are two tensors now (model.to_empty unties "
            "them); call model.tie_weights() before load, or training updates two copies"
        )


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The model's state-dict keys that name one tensor (a shared parameter: a head tied to the
    embedding, a router shared by layers), in groups of two or more, recorded at save."""
    groups: dict[int, list[str]] = {}
    for name, t in unwrapped_model(model).state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(unwrapped_name(name))
    return [g for g in groups.values() if len(g) > 1]


def refuse_split_ties(model: nn.Module, saved: list[list[str]]) -> None:
    """Keys that were one tensor at save (`tied_groups`) but are separate tensors in `model`
    (`model.to_empty` unties shared parameters): loading would fill each copy from the one saved
    tensor, and training would then update them apart, silently."""
    now = {
        unwrapped_name(n): t for n, t in unwrapped_model(model).state_dict(keep_vars=True).items()
    }
    split = []
    for group in saved:
        present = [k for k in group if k in now]
        if len({id(now[k]) for k in present}) > 1:
            split.append(" = ".join(present))
    if split:
        raise CheckpointError(
            "load: these tensors were one shared tensor when the checkpoint was saved and are "
            f"separate tensors in the model now: {'; '.join(split)} (model.to_empty unties "
            "shared parameters); share them again before load (e.g. model.head.weight = "
            "model.embed.weight, or model.tie_weights()), or training updates separate copies"
        )


def check_format(ckpt: Path, manifest: dict, who: str = "load") -> None:
    """Refuse a checkpoint of a newer format than this code reads (none for plain DCP ones);
    `who` names the caller in the message."""
    if not manifest:
        return
    fmt = manifest.get("format", 1)
    if not (isinstance(fmt, int) and not isinstance(fmt, bool) and 1 <= fmt <= FORMAT_VERSION):
        raise CheckpointError(
            f"{who}: {ckpt / MANIFEST_FILE} says checkpoint format {fmt!r}; this grouped_ep reads "
            f"formats 1 to {FORMAT_VERSION}: the checkpoint was saved by a newer grouped_ep, "
            "which is needed to load it"
        )
    tied = manifest.get("tied", [])
    if not (
        isinstance(tied, list)
        and all(isinstance(g, list) and all(isinstance(k, str) for k in g) for g in tied)
    ):
        raise CheckpointError(
            f'{who}: {ckpt / MANIFEST_FILE}: "tied" is {tied!r}, expected lists of key names '
            "(the manifest is damaged)"
        )


def warn_untracked_ties(ckpt: Path, manifest: dict, stateless: list[str]) -> None:
    """For a checkpoint saved before shared tensors were recorded (no "tied":
    `refuse_split_ties` cannot check it), warn where a parameter has no optimizer state in it:
    the mark a shared tensor split by `to_empty` leaves."""
    if manifest and "tied" not in manifest and stateless:
        warnings.warn(
            f"load: {ckpt} was saved before grouped_ep recorded shared tensors, and these "
            f"parameters have no optimizer state in it: {listed(stateless)}. If one was shared with "
            "another parameter when saved (a head tied to the embedding, untied by "
            "model.to_empty), share it again and load again: as loaded, it resumes as a separate "
            "copy without optimizer state",
            stacklevel=6,  # the caller of checkpoint.load (through check, on_rank0, _load)
        )


def _flat_tensor_shapes(obj: Any, prefix: str) -> dict[str, torch.Size]:
    """DCP's flattened key (`model.layer.weight`) -> global shape, for every tensor in `obj`."""
    out: dict[str, torch.Size] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.shape  # a DTensor's .shape is its global shape
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensor_shapes(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_fits(info: CheckpointInfo, state: dict[str, Any]) -> None:
    """Raise CheckpointError naming every key that is missing or has another shape."""
    saved = info.metadata.state_dict_metadata
    problems, missing = [], []
    for key, shape in _flat_tensor_shapes(state, "").items():
        meta = saved.get(key)
        if meta is None:
            missing.append(key)
            problems.append(f"{key}: not in the checkpoint")
        elif not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key}: saved as a non-tensor object")
        elif tuple(meta.size) != tuple(shape):
            problems.append(
                f"{key}: checkpoint has global shape {list(meta.size)}, model {list(shape)}"
            )
    if problems:
        shown = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        raise CheckpointError(
            f"checkpoint {info.path} does not fit the model:\n  {shown}"
            + (_optimizer_kind(missing, saved) if len(missing) == len(problems) else "")
        )


def _optimizer_kind(missing: list[str], saved: dict) -> str:
    """When only optimizer state is missing: the state kinds each optimizer keeps (an AdamW
    checkpoint loaded with SGD named momentum_buffer for every parameter and no reason)."""
    if not all(k.startswith("optim.state.") for k in missing):
        return ""
    want = sorted({k.rsplit(".", 1)[-1] for k in missing})
    have = sorted({k.rsplit(".", 1)[-1] for k in saved if k.startswith("optim.state.")})
    return (
        f"\nThe model fits; the optimizer does not: the checkpoint's optimizer kept "
        f"{', '.join(have) or 'no state'}, this one keeps {', '.join(want)} (another optimizer "
        "class, or other settings). Build it as the run that saved did, or load without the "
        "optimizer (optimizer=None: the weights alone) and build a new one"
    )


def refuse_unexpected(
    info: CheckpointInfo, state: dict[str, Any], stateless_optimizer: bool = False
) -> None:
    """Raise CheckpointError naming the checkpoint's model tensors (and, when an optimizer is
    loaded, optimizer state) that the model has no place for: a layer or buffer the resumed
    model lacks (as `load_state_dict(strict=True)` refuses them), or optimizer state this
    optimizer does not keep: of a parameter it holds state for, or of any when it keeps none
    (`stateless_optimizer`: its state was built by a step and stayed empty, as SGD's without
    momentum)."""
    model_keys = {f"model.{k}" for k in state["model"]}
    params, slots = set(), set()
    if "optim" in state:
        params = {
            f"optim.state.{fqn}" for g in state["optim"]["param_groups"] for fqn in g["params"]
        }
        # what this optimizer keeps per parameter it has state for (built by a step of zeros,
        # unless a parameter had a gradient: then nothing is known of the others)
        kept = state["optim"]["state"]
        slots = {f"optim.state.{fqn}.{k}" for fqn, st in kept.items() for k in st}
        if not stateless_optimizer:
            slots |= {p for p in params if p[len("optim.state.") :] not in kept}

    def under(key: str, names: set[str]) -> bool:  # a name, or a value nested in one (DCP
        parts = key.split(".")  # flattens nested dicts into dotted keys)
        return any(".".join(parts[:i]) in names for i in range(1, len(parts) + 1))

    extra, orphans, unkept = [], [], []
    for key in info.metadata.state_dict_metadata:
        if key.startswith("model.") and not under(key, model_keys):
            extra.append(key)
        elif "optim" in state and key.startswith("optim.state."):
            if not under(key, params):
                # the model has the parameter, the optimizer does not (frozen, or left out of it)
                in_model = under("model." + key[len("optim.state.") :], model_keys)
                (orphans if in_model else extra).append(key)
            elif not under(key, slots):
                unkept.append(key)  # an optimizer of other settings (SGD's momentum, amsgrad)

    def show(keys: list[str]) -> str:
        return ", ".join(sorted(keys)[:20]) + (" ..." if len(keys) > 20 else "")

    if extra:
        raise CheckpointError(
            f"checkpoint {info.path} has {len(extra)} key(s) the model has no place for: "
            f"{show(extra)}"
        )
    if orphans:
        raise CheckpointError(
            f"checkpoint {info.path} has optimizer state for {len(orphans)} key(s) of "
            f"parameters the model has but the optimizer does not hold (frozen, or left out of "
            f"its parameter groups): {show(orphans)}. Build the optimizer over the same "
            "parameters as the run that saved, or load without the optimizer "
            "(optimizer=None) and build a new one"
        )
    if unkept:
        names = sorted({k.rsplit(".", 1)[-1] for k in unkept})
        raise CheckpointError(
            f"checkpoint {info.path} has optimizer state this optimizer does not keep "
            f"({', '.join(map(repr, names))}, for {len(unkept)} key(s): {show(unkept)}): the "
            "run that saved built it with other settings (SGD's momentum, Adam's amsgrad, ...), "
            "whose state would be dropped while the saved settings were taken. Build it as "
            "that run did, or load without the optimizer (optimizer=None) and build a new one"
        )


def take_unsaved_hyperparameters(info: CheckpointInfo, state: dict[str, Any]) -> list[dict]:
    """Remove from `state`'s optimizer groups (in place) the hyperparameters the checkpoint has
    no value for, and return them per group, for `load` to put back: an LR scheduler adds
    `initial_lr` to every group, and a run resumed with one that the saving run lacked failed
    inside DCP's read plan ("Missing key ... initial_lr"), saying the model may be partly
    loaded (a review). Such a group keeps its current value, as the saved ones take theirs."""
    saved = info.metadata.state_dict_metadata
    groups = state.get("optim", {}).get("param_groups", [])
    taken = []
    for i, group in enumerate(groups):
        missing = [k for k in group if k != "params" and f"optim.param_groups.{i}.{k}" not in saved]
        taken.append({k: group.pop(k) for k in missing})
    return taken


def check_param_groups(info: CheckpointInfo, state: dict[str, Any]) -> list[int] | None:
    """Raise CheckpointError when the optimizer's parameter groups are not the saved ones: another
    number of groups (as `Optimizer.load_state_dict` refuses it), or a parameter in another group.
    DCP maps each saved group to the current group that holds its last parameter: a group could
    be left without hyperparameters (a bare KeyError at the next step) or silently get another
    group's learning rate and weight decay.

    Returns, for each group, the position of the saved group it resumes from (None when the
    checkpoint has no optimizer groups to match)."""
    if "optim" not in state:
        return
    prefix = "optim.param_groups."
    saved = {
        key[len(prefix) :].split(".", 1)[0]
        for key in info.metadata.state_dict_metadata
        if key.startswith(prefix)
    }
    have = [list(g["params"]) for g in state["optim"]["param_groups"]]
    if saved and len(saved) != len(have):
        raise CheckpointError(
            f"checkpoint {info.path} holds optimizer state with {len(saved)} parameter group(s), "
            f"the optimizer has {len(have)}; build the optimizer with the same parameter groups as "
            "the run that saved it"
        )
    if not saved or any(
        f"{prefix}{i}.params" not in info.metadata.state_dict_metadata for i in range(len(have))
    ):
        return
    was = _saved_group_params(info, len(have))
    # The groups may come in another order (DCP matches each saved group to the current group
    # holding its parameters); what must hold is the partition: parameters saved together are
    # together now, and apart otherwise. Parameters on one side only are not compared here.
    both = {n for g in was for n in g} & {n for g in have for n in g}
    group_now = {name: i for i, names in enumerate(have) for name in names}
    saved_set = {n: frozenset(g) & both for g in was for n in g}
    now_set = {n: frozenset(g) & both for g in have for n in g}
    group_was = {name: i for i, names in enumerate(was) for name in names}
    moved = [
        f"{name!r} (group {group_was[name]} saved, {group_now[name]} now)"
        for name in sorted(both)
        if saved_set[name] != now_set[name]
    ]
    if moved:
        shown = ", ".join(moved[:10]) + (" ..." if len(moved) > 10 else "")
        raise CheckpointError(
            f"checkpoint {info.path}: {len(moved)} parameter(s) are in another optimizer "
            f"parameter group than when it was saved: {shown}; build the optimizer with the same "
            "parameter groups as the run that saved it"
        )
    # The saved group each group resumes from: the one sharing its parameters (the partition
    # is the same, checked above), and for empty groups the saved empty groups in order. `load`
    # applies these itself after torch's `set_state_dict`, whose own mapping gives an empty
    # group the last saved group's hyperparameters and can leave another group with none.
    sources: list[int] = []
    empties = [j for j, g in enumerate(was) if not g]
    empty_now = sum(not g for g in have)
    if len(empties) > 1 or empty_now > 1:  # torch raises midway, the model loaded
        raise CheckpointError(
            f"checkpoint {info.path}: more than one empty optimizer parameter group (saved "
            f"{len(empties)}, now {empty_now}); torch's set_state_dict supports one"
        )
    for i, names in enumerate(have):
        if names:
            found = [j for j, g in enumerate(was) if set(names) & set(g)]
        else:
            found = empties
            if (
                found and found[0] != i
            ):  # torch's set_state_dict then fails midway, the model loaded
                raise CheckpointError(
                    f"checkpoint {info.path}: optimizer parameter group {i} is empty, and the "
                    f"saved empty group was group {found[0]}; torch's set_state_dict cannot "
                    "move an empty group: keep the groups in their saved order"
                )
        if not found:
            shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
            why = (
                "shares no parameter with any saved group"
                if names
                else "is empty, and the saved groups have no empty group"
            )
            raise CheckpointError(
                f"checkpoint {info.path}: optimizer parameter group {i} ({shown or 'empty'}) "
                f"{why}, so it has no saved hyperparameters (lr, betas, weight decay) to resume "
                "with; build the optimizer with the same parameter groups as the run that saved it"
            )
        sources.append(found[0])
    return sources


def _saved_group_params(info: CheckpointInfo, groups: int) -> list[list[str]]:
    """The parameter names of each saved optimizer group (small pickled lists, read alone)."""
    import torch.distributed.checkpoint as dcp

    from grouped_ep.checkpoint.collective import dcp_quiet

    state: dict[str, Any] = {"optim": {"param_groups": [{"params": []} for _ in range(groups)]}}
    try:
        with dcp_quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(info.path)), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(
            f"checkpoint {info.path}: cannot read its optimizer parameter groups "
            f"({type(e).__name__}: {e})"
        ) from None
    return [list(g["params"]) for g in state["optim"]["param_groups"]]


def stateless_params(info: CheckpointInfo, state: dict[str, Any]) -> list[str]:
    """The optimizer's parameters that have no state at all in the checkpoint.

    An optimizer keeps no state for a parameter that has not had a gradient yet (a layer the
    data never reached, an expert no token picked), nor for one whose group needs none (SGD
    without momentum). Such a parameter is resumed stateless, as it was saved; a parameter with
    only part of its state saved is a mismatch (`check_fits`).
    """
    saved = info.metadata.state_dict_metadata
    prefixes = {key.rsplit(".", 1)[0] for key in saved if key.startswith("optim.state.")}
    optim = state.get("optim", {})
    names = list(optim.get("state", {}))
    names += [n for g in optim.get("param_groups", []) for n in g["params"] if n not in names]
    return [fqn for fqn in names if f"optim.state.{fqn}" not in prefixes]


def without(state: dict[str, Any], stateless: list[str]) -> dict[str, Any]:
    if not stateless:
        return state
    drop = set(stateless)
    optim = dict(state["optim"])
    optim["state"] = {k: v for k, v in optim["state"].items() if k not in drop}
    return state | {"optim": optim}
