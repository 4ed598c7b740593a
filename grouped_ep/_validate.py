"""Argument checks shared across the package."""

from __future__ import annotations

import numbers
import os

import torch


def check_flag(value: object, what: str, none_ok: bool = False) -> None:
    """Raise ValueError naming `what` unless `value` is a bool (or None where `none_ok`): a
    string, number or None would be read as true or false by its truthiness, silently."""
    if isinstance(value, bool) or is_numpy_bool(value) or (none_ok and value is None):
        return
    expected = "True, False or None" if none_ok else "True or False"
    raise ValueError(f"{what} must be {expected}, got {value!r}")


def check_module(
    model: object, caller: str, name: str = "model", error: type[Exception] = TypeError
) -> None:
    """`error` (TypeError) naming `caller`'s `name` unless `model` is an nn.Module (swapped
    arguments, an optimizer passed as the model, gave an AttributeError from deep inside)."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise error(f"{caller}: {name} must be an nn.Module, got {type(model).__name__}")


def check_path(
    path: object,
    what: str,
    error: type[Exception] = ValueError,
    type_error: type[Exception] = TypeError,
) -> None:
    """`path` must be a str or os.PathLike (None or bytes: `type_error` naming `what`, not
    pathlib's message), and not empty: "" names the working directory, which no caller means
    (an unset environment variable, `os.environ.get("CKPT_DIR", "")`): `error`."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise type_error(f"{what} must be a str or os.PathLike, got {type(path).__name__}")
    if not os.fspath(path):
        raise error(
            f'{what} is empty ("" would be the working directory: an unset variable?); name '
            "the directory"
        )


def is_numpy_bool(value: object) -> bool:
    """A numpy bool scalar (`np.True_`), by its type: named `bool_` before numpy 2, `bool` since."""
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def is_int(value: object) -> bool:
    """An int, and not a bool (True is an int to Python: `step=True` must not mean step 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(owner: str, **sizes: object) -> None:
    """ValueError naming the first of `sizes` that is not an int >= 1 (numpy ints count; bools
    do not)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, got {value!r}")


def real_number(value: object) -> float | None:
    """`value` as a float if it is a real number (numpy scalars and one-element tensors too,
    not bools), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def canonical_device(device: torch.device | str, what: str = "device") -> torch.device:
    """`device` as tensors placed there report it: a CUDA device with its index (the current
    device when none is given), a CPU device without one. `torch.device("cuda")` does not equal
    a tensor's `cuda:0`, nor `cpu:0` a tensor's `cpu`. A spelling torch refuses is a ValueError
    naming `what` (e.g. "load_sharded: device")."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what}={device!r} is not a device ({e})") from None
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and device.index is not None:
        return torch.device("cpu")
    return device


def check_can_hold(device: torch.device, what: str = "device") -> None:
    """ValueError naming `what` unless `device` can hold values: not meta, and a CUDA device
    this machine has."""
    if device.type == "meta":
        raise ValueError(f"{what}='meta' cannot hold the loaded values")
    if device.type == "cuda" and (
        not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
    ):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"{what}={str(device)!r}, and this machine has {have} CUDA device(s)")


def tilde_hint(path: os.PathLike | str) -> str:
    """For a path not found that starts with `~`: that `~` is not expanded, as by open()."""
    text = os.fspath(path)
    if not text.startswith("~") or not os.path.exists(os.path.expanduser(text)):
        return ""
    return f" ('~' is not expanded: pass os.path.expanduser(path), {os.path.expanduser(text)})"
