"""FSDP2 units that survive a first forward under `torch.inference_mode`.

FSDP2 allocates each parameter's all-gather buffers and unsharded parameter once, in the first
forward that gathers it, and reuses them in every later one. When that first forward runs under
`torch.inference_mode()` (an evaluation or `generate()` before training, as serving code wraps
it), they are inference tensors, and every later forward fails for good: "Inference tensors do
not track version counter" (a one-rank group, e.g. the experts at dp = 1), or "Inplace update to
inference tensor outside InferenceMode" and "Inference tensors cannot be saved for backward"
(any group) in the next training step. `guard_first_forward(model)` runs the model's forwards
under `torch.no_grad()` instead while inference mode is on, until one forward has run outside
it: the buffers are then normal tensors, and inference mode afterwards reuses them as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def guard_first_forward(root: nn.Module) -> None:
    """Hooks on the root FSDP module `root` (before its own, so that FSDP's gathers run inside)
    that leave inference mode for no_grad around each forward until one has run outside it."""
    state: dict[str, Any] = {"primed": False, "contexts": [], "nested": 0}

    def pre(module: nn.Module, args: Any) -> None:
        if state["contexts"]:  # a forward of the root inside the guarded one
            state["nested"] += 1
            return
        if state["primed"]:
            return
        if not torch.is_inference_mode_enabled():
            state["primed"] = True
            return
        contexts = [torch.inference_mode(False), torch.no_grad()]
        for c in contexts:
            c.__enter__()
        state["contexts"] = contexts

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if state["nested"]:
            state["nested"] -= 1
            return
        contexts, state["contexts"] = state["contexts"], []
        state["primed"] = state["primed"] or bool(contexts)  # the buffers are normal tensors now
        for c in reversed(contexts):
            c.__exit__(None, None, None)

    root.register_forward_pre_hook(pre, prepend=True)
    root.register_forward_hook(post, always_call=True)
