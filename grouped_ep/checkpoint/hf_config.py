"""The config files of an `export_hf` directory: `config.json` and `generation_config.json`,
written as transformers' `save_pretrained` writes them for the model as it is now."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule


def write_hf_configs(model: nn.Module, out_dir: Path) -> None:
    """Write `model.config` (see `config_for_export`) and, for a model that generates, its
    `generation_config` (its end-of-sequence ids and sampling defaults: without it `generate()`
    on the export no longer stops where the original did) into `out_dir`."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    config_for_export(model, config).save_pretrained(str(out_dir))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        try:
            generation.save_pretrained(str(out_dir))
        except ValueError as e:  # its strict check; transformers loaded it with a warning
            warnings.warn(
                f"export_hf: the model's generation config fails transformers' check on save "
                f"({' '.join(str(e).split())[:300]}); generation_config.json is written as it is",
                stacklevel=3,
            )
            generation.to_json_file(out_dir / "generation_config.json", use_diff=True)


def config_for_export(model: nn.Module, config: Any) -> Any:
    """A copy of `config` with what `save_pretrained` records about the model itself, written
    over what the config says, as `save_pretrained` does: `architectures` (the model's class;
    tools such as vLLM pick the model by it) and `dtype` (its floating parameters' dtype, which
    the files hold: a model loaded in bf16 and cast to fp32 exports fp32). A
    `quantization_config` (a model loaded from an FP8 or MXFP4 checkpoint, which `load_sharded`
    dequantizes) is dropped: the files hold plain weights, and transformers would read them as
    quantized ones (on an FP8 GPU: cast to float8 with scales "newly initialized")."""
    config = copy.deepcopy(config)
    if hasattr(model, "config"):  # a transformers model: its class is the architecture
        name = type(model).__name__
        if isinstance(model, FSDPModule) and name.startswith("FSDP"):
            name = name[len("FSDP") :]  # fully_shard's subclass of the model's own class
        config.architectures = [name]
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if floating:
        config.dtype = floating[0]
    for quantized in ("quantization_config", "_pre_quantization_dtype"):
        if quantized in getattr(config, "__dict__", {}):
            delattr(config, quantized)
    return config
