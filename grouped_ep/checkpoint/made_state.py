"""The optimizer state that saves before ae712ba (2026-11-25) wrote for an optimizer that had
not stepped: torch's `get_state_dict` made it by a step at lr 0 with zero gradients. Resumed
as it is, the first update is not a fresh optimizer's; `load` warns of it (`warn_made_state`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def warn_made_state(ckpt: Path, manifest: dict, optimizer: torch.optim.Optimizer) -> None:
    """For a checkpoint of a grouped_ep from before 2026-11-25 (ae712ba; its manifest has no
    "tied"), warn where the optimizer state just loaded is, on every parameter, exactly the one
    torch's `get_state_dict` made for an optimizer that had not stepped (a step at lr 0 with
    zero gradients), and where resuming from it changes the first update: AdamW's is
    bias-corrected as the second (0.74x), Adamax's 0.53x (a review). Both are found by running
    the optimizer's own class on a one-element parameter of each group: RMSprop's made state
    changes nothing (no warning), Adamax's `exp_inf` is `eps`, not zero (found)."""
    if not manifest or "tied" in manifest or not optimizer.state:
        return
    made: dict[tuple[int, torch.dtype], dict | None] = {}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            key = (index, p.dtype)
            if key not in made:
                made[key] = _made_state_that_matters(optimizer, group, p.dtype)
            if made[key] is None or not _is_made(state, made[key]):
                return
    if not made:
        return
    warnings.warn(
        f"load: {ckpt} was saved by a grouped_ep from before 2026-11-25, and its optimizer "
        "state is exactly what such a save wrote for an optimizer that had not stepped yet "
        "(torch's step at lr 0 with zero gradients). If it had not, call "
        "optimizer.state.clear() after this load; as loaded, the first update differs from a "
        "fresh optimizer's",
        stacklevel=4,  # the caller of checkpoint.load (through _load)
    )


def _made_state_that_matters(
    optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype
) -> dict | None:
    """The state torch's lr-0 step of zero gradients makes for `optimizer`'s class with
    `group`'s hyperparameters, per key as a scalar; None when a first update from it equals a
    fresh optimizer's (nothing to warn of) or the class cannot be run on a scratch parameter."""
    hyper = {k: v for k, v in group.items() if k != "params"}
    hyper.update(foreach=False, fused=None, capturable=False, differentiable=False)
    if not dtype.is_floating_point:
        return None

    def scratch() -> tuple[torch.Tensor, torch.optim.Optimizer]:
        p = torch.zeros(1, dtype=dtype, requires_grad=True)
        opt = type(optimizer)([p])
        opt.param_groups[0].update({k: v for k, v in hyper.items() if k in opt.param_groups[0]})
        return p, opt

    # The class's own step, without the step hooks (global ones are the user's: a load must not
    # run them for steps that never happened; a review).
    hooked = type(optimizer).step  # torch wraps each class's step once, to run the hooks
    step = hooked.__wrapped__ if getattr(hooked, "hooked", False) else None
    if step is None:
        return None
    try:
        fresh_p, fresh = scratch()
        made_p, made = scratch()
        made.param_groups[0]["lr"] = 0.0
        made_p.grad = torch.zeros_like(made_p)
        step(made)
        state = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in made.state[made_p].items()
        }
        for p, opt in ((fresh_p, fresh), (made_p, made)):
            opt.param_groups[0]["lr"] = 0.1
            p.grad = torch.ones_like(p)
            step(opt)
    except Exception:  # noqa: BLE001 (a class that needs more than one parameter, a closure)
        return None
    if torch.equal(fresh_p, made_p):
        return None
    return state


def _is_made(state: dict, made: dict) -> bool:
    """Whether every entry of a parameter's loaded `state` equals the made one's everywhere."""
    if state.keys() != made.keys():
        return False
    for key, value in state.items():
        want = made[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if isinstance(want, torch.Tensor) != isinstance(local, torch.Tensor):
            return False
        if not isinstance(local, torch.Tensor):
            if local != want:
                return False
        elif want.numel() != 1 or not bool((local == want.reshape(()).to(local.dtype)).all()):
            return False
    return True
