"""Every MoE family of the installed transformers whose experts use `@use_experts_implementation`,
found by code, each built tiny from its own config class.

`families()` walks `transformers.models`, imports each `modeling_*` module and keeps the classes
whose `forward` is the decorator's dispatching wrapper. `build(family)` builds the family's
causal LM from a shrunk config; a family that transformers itself cannot build tiny keeps
transformers' error in `Family.build_error`.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache

import torch
import transformers
from torch import nn

VOCAB = 64
MAX_PARAMS = 2_000_000

# Small values for the size fields of MoE configs; only fields the config already has are set.
_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "expert_ffn_hidden_size": 16,
    "ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_start_index": 1,
    "first_k_dense": 1,
    "max_position_embeddings": 64,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "sliding_window": 16,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass
class Family:
    """One MoE family: its `model_type`, experts class, and (when it builds) causal LM class."""

    model_type: str
    experts_class: type
    model_class: type | None = None
    config_class: type | None = None
    build_error: str | None = None

    @property
    def name(self) -> str:
        return self.model_type


def _is_experts_class(cls: object) -> bool:
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and "experts_interface" in code.co_freevars


@cache
def families() -> list[Family]:
    """One `Family` per `transformers.models` package defining an experts class, sorted."""
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        name = info.name
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # noqa: BLE001 (a package without modeling file, or missing extras)
            continue
        experts = [
            c
            for c in vars(mod).values()
            if isinstance(c, type) and c.__module__ == mod.__name__ and _is_experts_class(c)
        ]
        if experts:
            found[name] = _resolve(name, mod, experts[0])
    return [found[k] for k in sorted(found)]


def _resolve(name: str, mod, experts_class: type) -> Family:
    family = Family(name, experts_class)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = name if name in CONFIG_MAPPING_NAMES else None
    if model_type is None:
        for key in CONFIG_MAPPING_NAMES:
            if key.replace("-", "_") == name:
                model_type = key
    family.model_type = model_type or name
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family.model_type)
    if cls_name is None or not hasattr(mod, cls_name):
        family.build_error = f"no AutoModelForCausalLM class for model_type {family.model_type!r}"
        return family
    family.model_class = getattr(mod, cls_name)
    family.config_class = family.model_class.config_class
    return family


def tiny_config(family: Family):
    """The family's config class with every size field present shrunk (see `_TINY`)."""
    base = family.config_class()
    fields = {k: v for k, v in _TINY.items() if hasattr(base, k)}
    layers = fields.get("num_hidden_layers", 2)
    for key in ("layer_types", "mlp_layer_types"):
        value = getattr(base, key, None)
        if isinstance(value, list) and value:
            fields[key] = (value * layers)[:layers]
    config = family.config_class(**fields)
    return config


def build(family: Family, seed: int = 0) -> nn.Module:
    """The family's causal LM, tiny, random (seeded), fp32 on CPU, routers sharpened."""
    config = tiny_config(family)
    with torch.device("meta"):
        size = sum(p.numel() for p in family.model_class(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"{family.name}: the shrunk config still has {size} parameters")
    torch.manual_seed(seed)
    model = family.model_class(config).float()
    with torch.no_grad():  # a sharper router, so tokens spread unevenly over the experts
        for name, p in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")) and p.dim() == 2:
                p.normal_(0, 1.0)
    return model.eval()


def family(name: str) -> Family:
    """The family with this `model_type`."""
    for f in families():
        if f.name == name:
            return f
    raise KeyError(f"no transformers experts family {name!r}")


@cache
def build_error(name: str) -> str | None:
    """None when the family's tiny model builds and runs an eager forward in transformers
    itself, else the reason: transformers' own error, or no causal LM class to build."""
    fam = family(name)
    if fam.build_error:
        return fam.build_error
    try:
        model = build(fam)
        if not any(isinstance(m, fam.experts_class) for m in model.modules()):
            return f"the tiny config builds no {fam.experts_class.__name__} layer"
        model.set_experts_implementation("eager")
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 5)), use_cache=False)
    except Exception as e:  # noqa: BLE001 (the error is the result)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return None


def buildable() -> list[Family]:
    """The families whose tiny model builds and runs in transformers (see `build_error`)."""
    return [f for f in families() if build_error(f.name) is None]
