"""Every MoE family of the installed transformers whose experts use `@use_experts_implementation`,
found by code, each built tiny from its own config class.

`families()` walks `transformers.models`, imports each `modeling_*` module and keeps the classes
whose `forward` is the decorator's dispatching wrapper. Each family's model class is found in the
same module (`_model_candidates`: a causal LM, else a multimodal model run on text alone).
`build(family)` builds it from a shrunk config (`tiny_config`); `build_error(name)` says why a
family does not build tiny and run (None when it does).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from functools import cache

import torch
import transformers
from torch import nn

VOCAB = 64
MAX_PARAMS = 2_000_000

# Small values for the size fields of MoE configs; only fields the config already has are set
# (recursively in sub-configs: a multimodal family's text, vision and audio configs). A field
# whose own value is a list gets one tiny value per entry.
_TINY = {
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,  # inkling2: the LM head's width (vocab_size is the padded one)
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "hidden_size": 32,
    "intermediate_size": 32,
    "ffn_hidden_size": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # attention
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "sliding_window": 16,
    "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": 16,
    # multi-head latent attention (kept consistent by `_mla_fields`)
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    # linear attention, mamba, hyper-connections
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "n_groups": 1,
    "ssm_state_size": 16,
    "hc_lowrank": 16,
    # experts
    "moe_intermediate_size": 16,
    "moe_hidden_size": 16,
    "expert_ffn_hidden_size": 16,
    "shared_expert_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "top_k_experts": 2,
    "moe_k": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    # which layers are MoE (see also `_layer_fields`)
    "first_k_dense_replace": 1,
    "moe_layer_start_index": 1,
    "first_k_dense": 1,
    "num_dense_layers": 1,
    # vision / audio towers of multimodal families (their output width is the text width)
    "depth": 2,
    "num_heads": 2,
    "out_hidden_size": 32,
    "output_dim": 32,
    "text_hidden_size": 32,
    "projection_intermediate_size": 32,
    "projector_hidden_size": 32,
    "projection_hidden_dim": 32,
    "adapter_in_dim": 32,
    "adapter_out_dim": 32,
    "downsample_hidden_size": 8,
    "mlp_dim": 32,
    "output_channels": 16,
    "downsample_channels": [16, 32],
    "hidden_sizes": 16,
}
# Fields kept at the config's own value where that is below the tiny one.
_AT_MOST = ("num_experts_per_tok", "top_k_experts", "moe_k", "moe_topk")

# Per config `model_type`, fields the generic shrink cannot derive, each with the reason.
_OVERRIDES: dict[str, dict] = {
    # `layer_types` has no default (the checkpoint sets it); one short-conv and one attention
    # layer, as the released models mix them.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Gemma 4's MoE checkpoints are its dense config with the MoE block switched on.
    "gemma4_text": {"enable_moe_block": True},
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
        experts = _experts_classes(mod)
        if experts:
            found[name] = _resolve(name, mod, experts[0])
    return [found[k] for k in sorted(found)]


def _experts_classes(mod) -> list[type]:
    return [
        c
        for c in vars(mod).values()
        if isinstance(c, type) and c.__module__ == mod.__name__ and _is_experts_class(c)
    ]


def _resolve(name: str, mod, experts_class: type) -> Family:
    family = Family(name, experts_class)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = name if name in CONFIG_MAPPING_NAMES else None
    if model_type is None:
        for key in CONFIG_MAPPING_NAMES:
            if key.replace("-", "_") == name:
                model_type = key
    family.model_type = model_type or name
    candidates = _model_candidates(mod, family.model_type)
    if not candidates:
        heads = sorted(
            n
            for n, c in vars(mod).items()
            if "For" in n and isinstance(c, type) and c.__module__ == mod.__name__
        )
        family.build_error = f"no causal LM class in {mod.__name__} (only {', '.join(heads)})"
        return family
    # The first candidate whose tiny model builds (on meta) with the experts inside, else the
    # first candidate (its build error is then the family's error).
    family.model_class = candidates[0]
    for cls in candidates:
        try:
            with torch.device("meta"):
                model = cls(_shrink(cls.config_class))
        except Exception:  # noqa: BLE001, S112 (a candidate that does not build tiny)
            continue
        if any(isinstance(m, experts_class) for m in model.modules()):
            family.model_class = cls
            break
    family.config_class = family.model_class.config_class
    return family


def _model_candidates(mod, model_type: str) -> list[type]:
    """The module's language-model heads, best first: `*ForCausalLM` (AutoModelForCausalLM's
    class for the model_type first, so a multimodal family's text-only causal LM comes before
    its multimodal model), then AutoModelForCausalLM's class, then `*ForConditionalGeneration`
    (a multimodal model run on text alone)."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    ranked = []
    for index, cls in enumerate(vars(mod).values()):
        if not (
            isinstance(cls, type)
            and issubclass(cls, PreTrainedModel)
            and cls.__module__ == mod.__name__
            and isinstance(cls.config_class, type)
            and issubclass(cls.config_class, PretrainedConfig)
        ):
            continue
        name = cls.__name__
        causal = name.endswith("ForCausalLM")
        if causal or name == auto or name.endswith("ForConditionalGeneration"):
            ranked.append((not causal, name != auto, index, cls))
    return [cls for *_, cls in sorted(ranked, key=lambda r: r[:3])]


_MISSING = object()


def _get(config, key: str, default=None):
    """`config.key`; for a field that varies per layer (`per_layer_config`), its global value."""
    try:
        return getattr(config, key)
    except AttributeError:
        return default
    except Exception:  # noqa: BLE001 (heterogeneous configs refuse a global read)
        return config.to_dict().get(key, default)


def _has(config, key: str) -> bool:
    return _get(config, key, _MISSING) is not _MISSING


_LAYERS = ("num_hidden_layers", "num_layers", "depth")


def _layers_key(config) -> str | None:
    for key in _LAYERS:
        if isinstance(getattr(config, key, None), int):
            return key
    return None


# Fields that say which layers are dense and which are MoE.
_MLP_KIND = re.compile("mlp|moe|expert|sparse|dense")


def _layer_fields(config) -> dict:
    """Per-layer list fields cut down to a few layers: the first layer of each MLP kind (dense,
    sparse, ...), so a tiny model keeps an MoE layer (at least 2 layers; the other per-layer
    fields follow the kept layers). Lists of layer indices (`mlp_only_layers`) are remapped."""
    key = _layers_key(config)
    if key is None:
        return {}
    n = getattr(config, key)
    values = {k: _get(config, k) for k in config.to_dict()}
    per_layer = {
        k: v
        for k, v in values.items()
        if isinstance(v, (list, tuple)) and len(v) == n and n > 0 and k != "per_layer_config"
    }
    index_lists = {
        k: v
        for k, v in values.items()
        if k not in per_layer
        and ("layers" in k or "indexes" in k)
        and isinstance(v, (list, tuple))
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in v)
    }
    mlp = [v for k, v in per_layer.items() if _MLP_KIND.search(k)]
    mlp_indices = [v for k, v in index_lists.items() if _MLP_KIND.search(k)]
    kinds = [tuple(str(v[i]) for v in mlp) + tuple(i in v for v in mlp_indices) for i in range(n)]
    keep: list[int] = []
    for i, kind in enumerate(kinds):
        if kind not in [kinds[j] for j in keep]:
            keep.append(i)
    for i in range(n):
        if len(keep) >= min(2, n):
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    fields = {key: len(keep)}
    for k, v in per_layer.items():
        fields[k] = list(range(len(keep))) if _is_identity(v) else [v[i] for i in keep]
    for k, v in index_lists.items():
        fields[k] = [keep.index(i) for i in v if i in keep]
    per_layer_config = config.to_dict().get("per_layer_config")
    if isinstance(per_layer_config, dict):  # {"03": {field: value}}: the kept layers, renumbered
        kept = {keep.index(int(i)): v for i, v in per_layer_config.items() if int(i) in keep}
        if kept:
            fields["per_layer_config"] = kept
    return fields


def _mla_fields(base, fields: dict) -> None:
    """Multi-head latent attention (`qk_rope_head_dim` + `qk_nope_head_dim`): the shrunk head
    dims keep the config's own relations (`qk_head_dim` = nope + rope, a `head_dim` equal to the
    rope or the qk dim stays so, no rope stays no rope), and every head has its own keys."""
    if not (_has(base, "qk_rope_head_dim") and _has(base, "qk_nope_head_dim")):
        return
    old = {k: _get(base, k) for k in _MLA_DIMS if _has(base, k)}
    rope = fields["qk_rope_head_dim"] if old["qk_rope_head_dim"] else 0
    nope = fields["qk_nope_head_dim"] if old["qk_nope_head_dim"] else 0
    new = {"qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "qk_head_dim": rope + nope}
    new["v_head_dim"] = fields["v_head_dim"]
    if "head_dim" in old:
        same = [k for k in new if old.get(k) == old["head_dim"]]
        new["head_dim"] = new[same[0]] if same else fields["head_dim"]
    fields.update({k: v for k, v in new.items() if k in old})
    if "num_key_value_heads" in fields:
        fields["num_key_value_heads"] = fields["num_attention_heads"]


def _mrope_fields(config_class: type, base, fields: dict) -> None:
    """Multimodal rope (`mrope_section`, whose modeling default fits only the full-size head):
    three sections that sum to half the shrunk rotary dim (the first two equal, as
    ernie4_5_vl_moe's height / width split needs)."""
    rope = _get(base, "rope_parameters")
    if "mrope_section" not in getattr(config_class, "ignore_keys_at_rope_validation", ()):
        return
    if not isinstance(rope, dict) or "rope_type" not in rope:
        return
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    fields["rope_parameters"] = {
        **rope,
        "mrope_section": [half // 3] * 2 + [half - 2 * (half // 3)],
    }


_MLA_DIMS = ("qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "head_dim")


def _is_identity(v) -> bool:
    return list(v) == list(range(len(v)))


def _shrink(config_class: type, base=None):
    """`config_class` with every size field present shrunk (see `_TINY`), sub-configs too."""
    from transformers import PretrainedConfig

    base = config_class() if base is None else base
    layer_fields = _layer_fields(base)
    fields = {
        k: _like(layer_fields.get(k, _get(base, k)), v) for k, v in _TINY.items() if _has(base, k)
    }
    for k in _AT_MOST:  # a top-k below the tiny one is a rule of the config (zaya: top-1)
        if isinstance(_get(base, k), int) and k in fields:
            fields[k] = min(fields[k], _get(base, k))
    fields.update({k: v for k, v in layer_fields.items() if k not in fields or k in _LAYERS})
    if _has(base, "mlp_layer_types") and _get(base, "mlp_layer_types") is None:
        # Left to the checkpoint (the default config does not build): the first layer dense,
        # the rest MoE, in the "dense" / "sparse" names every `mlp_layer_types` uses.
        layers = fields.get(_layers_key(base), 2)
        fields["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    _mla_fields(base, fields)
    _mrope_fields(config_class, base, fields)
    for key in getattr(config_class, "sub_configs", None) or {}:
        sub = getattr(base, key, None)
        if isinstance(sub, PretrainedConfig):
            fields[key] = _shrink(type(sub), sub)
    for layer in (fields.get("per_layer_config") or {}).values():  # per-layer fields shrink alike
        layer.update({k: fields.get(k, _TINY.get(k, v)) for k, v in layer.items()})
    fields.update(_OVERRIDES.get(getattr(config_class, "model_type", None), {}))
    return config_class(**fields)


def _like(value, tiny):
    """`tiny` in the shape of the config's own value: one per entry where that is a list."""
    if isinstance(value, (list, tuple)) and not isinstance(tiny, list):
        return [tiny] * len(value)
    return tiny


def tiny_config(family: Family):
    """The family's config class with every size field present shrunk (see `_TINY`)."""
    return _shrink(family.config_class)


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


@cache
def family(name: str) -> Family:
    """The family with this `model_type`: from its own package when that is where it lives (one
    import; the rank processes of the tests build a few families each), else from `families()`
    (which imports every `modeling_*` module of transformers: about 20 s)."""
    package = name.replace("-", "_")
    try:
        mod = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    except Exception:  # noqa: BLE001 (not a package of that name: the full walk decides)
        mod = None
    experts = _experts_classes(mod) if mod is not None else []
    if experts:
        found = _resolve(package, mod, experts[0])
        if found.name == name:
            return found
    for f in families():
        if f.name == name:
            return f
    raise KeyError(f"no transformers experts family {name!r}")


@cache
def build_error(name: str) -> str | None:
    """None when the family's tiny model builds (with the experts in it) and runs an eager
    forward in transformers itself giving per-token logits, else the reason: transformers' own
    error, or no causal LM class to build. An error of the tiny model where transformers' default
    config builds says so: the shrink is then at fault, not transformers."""
    fam = family(name)
    if fam.build_error:
        return fam.build_error
    try:
        model = build(fam)
        if not any(isinstance(m, fam.experts_class) for m in model.modules()):
            error = f"the tiny config builds no {fam.experts_class.__name__} layer"
        else:
            model.set_experts_implementation("eager")
            with torch.no_grad():
                logits = model(torch.randint(3, VOCAB, (1, 5)), use_cache=False).logits
            if tuple(logits.shape) == (1, 5, VOCAB):
                return None
            error = (
                f"logits of shape {tuple(logits.shape)}, not (batch, tokens, vocab) (1, 5, {VOCAB})"
            )
    except Exception as e:  # noqa: BLE001 (the error is the result)
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    if _default_builds(fam):
        error += " (the default config builds; the shrink is at fault)"
    return error


def _default_builds(fam: Family) -> bool:
    """Whether transformers' default config of the family builds a model with the experts in it
    (on meta: no memory, whatever the size)."""
    try:
        with torch.device("meta"):
            model = fam.model_class(fam.config_class())
    except Exception:  # noqa: BLE001
        return False
    return any(isinstance(m, fam.experts_class) for m in model.modules())


def buildable() -> list[Family]:
    """The families whose tiny model builds and runs in transformers (see `build_error`)."""
    return [f for f in families() if build_error(f.name) is None]
