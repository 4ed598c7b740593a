"""FSDP2 units that survive a first forward under `torch.inference_mode`.

FSDP2 allocates each parameter's all-gather buffers and unsharded parameter once, in the first
gather, and reuses them in every later one. When that first gather runs under
`torch.inference_mode()` (an evaluation or `generate()` before training, as serving code wraps
it), they are inference tensors, and every later forward fails for good: "Inference tensors do
not track version counter" (a one-rank group, e.g. the experts at dp = 1), or "Inplace update to
inference tensor outside InferenceMode" and "Inference tensors cannot be saved for backward"
(any group) in the next training step. `guard_first_forward(model)` gathers and reshards every
unit once, outside inference mode, before the first forward that runs inside it; the forward
itself then runs as the caller asked (a static KV cache made in inference mode keeps working).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def guard_first_forward(root: nn.Module) -> None:
    """A pre-hook on the root FSDP module `root`, ahead of FSDP's own: before the first forward
    under inference mode, every FSDP unit of `root` is gathered once and resharded with
    inference mode off, so that the buffers FSDP keeps are normal tensors (also those of units
    that earlier forwards outside inference mode skipped)."""
    state = {"primed": False}

    def pre(module: nn.Module, args: Any) -> None:
        if state["primed"] or not torch.is_inference_mode_enabled():
            return
        with torch.inference_mode(False), torch.no_grad():
            module._get_fsdp_state()._lazy_init()  # what FSDP's root forward does first
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.unshard()
                    unit.reshard()
        state["primed"] = True

    root.register_forward_pre_hook(pre, prepend=True)
