"""Quantized checkpoint formats: a checkpoint's `quantization_config`, which scale goes with
which quantized key, and whether a model tensor's checkpoint pieces are quantized (see
`loading.quant` for what each rank then reads)."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from grouped_ep.loading.errors import LoadError
from grouped_ep.loading.plan import Target
from grouped_ep.loading.safetensors import Checkpoint

# Every fp8 dtype a safetensors file can hold: a weight of any of them beside its scales is
# quantized (the FNUZ ones loaded as raw codes, their scales unused, silently: a review).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2) + tuple(
    getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)
)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16) + (
    (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()
)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MXFP4_BLOCK = 32  # values per E8M0 scale


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's `quantization_config`: method "fp8" (with `block`) or "mxfp4"."""

    method: str
    block: tuple[int, int]
    source: str  # the config.json it came from, for messages


def read_quant_config(ckpt: Checkpoint) -> QuantConfig | None:
    """The `quantization_config` of the `config.json` next to the checkpoint, or None.

    Read only when the checkpoint holds a tensor that no plain float model tensor is loaded from
    as is (fp8, integer, uint8): a bf16 / fp16 / fp32 checkpoint costs no extra read."""
    if all(e.dtype.is_floating_point and e.dtype.itemsize >= 2 for e in ckpt.entries.values()):
        return None
    root = Path(ckpt.root)
    path = (root if root.is_dir() else root.parent) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{path}: cannot read config.json: {e}") from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise LoadError(f"{path}: 'quantization_config' must be an object, got {qc!r:.80}")
    method = qc.get("quant_method")
    if method == "mxfp4":
        return QuantConfig("mxfp4", (1, MXFP4_BLOCK), str(path))
    if method == "fp8":
        # transformers' FineGrainedFP8Config: absent means 128 x 128 blocks, null per-tensor
        block = qc.get("weight_block_size", [128, 128])
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise LoadError(
                f"{path}: quantization_config.weight_block_size must be [rows, cols] positive "
                f"ints for quant_method 'fp8' (per-tensor FP8 is not supported), got {block!r}"
            )
        return QuantConfig("fp8", (block[0], block[1]), str(path))
    raise LoadError(
        f"{path}: unknown quantization_config.quant_method {method!r} (known: 'fp8', 'mxfp4')"
    )


def fp8_scale_key(key: str) -> str:
    """DeepSeek-V3's name for the scales of `key` (transformers' rule)."""
    return (
        key[: -len("weight")] + "weight_scale_inv"
        if key.endswith(".weight")
        else key + "_scale_inv"
    )


def fp8_scale_names(key: str) -> list[str]:
    """Where the scales of fp8 tensor `key` are found in the formats that write them."""
    return [fp8_scale_key(key), f"{key}_scale", f"{key}_scale_inv"]


def orphan_scales(keys: list[str], ckpt: Checkpoint) -> list[str]:
    """For a model tensor found under none of `keys`: each scale of one of them that the
    checkpoint holds, with the quantized key it scales (a shard copied in part)."""
    pairs = [(f"{k}_scales", f"{k}_blocks") for k in keys]
    pairs += [(s, k) for k in keys for s in fp8_scale_names(k)]
    return [f"{s!r} is there, {k!r} is not" for s, k in pairs if s in ckpt]


def _scale_names(key: str) -> list[str]:
    """Where the scales of quantized key `key` (fp8 codes, or MXFP4 `_blocks`) may be."""
    return [key[: -len("_blocks")] + "_scales"] if key.endswith("_blocks") else fp8_scale_names(key)


def is_quantized(
    cfg: QuantConfig | None, target: Target, ckpt: Checkpoint, model_names: Collection[str] = ()
) -> bool:
    """Whether `target`'s pieces are quantized; a quantized checkpoint without a
    quantization_config is an error (its values would be wrong without their scales).
    `model_names`: the model's tensors, to tell a model that holds its own scales."""
    quant = [
        p for p in target.pieces if p.entry.dtype in FP8_DTYPES or p.entry.key.endswith("_blocks")
    ]
    if not quant:
        return False
    e = quant[0].entry
    scales = [k for k in _scale_names(e.key) if k in ckpt]
    if all(p.entry.dtype == target.tensor.dtype for p in quant):
        own = [n for name in target.names for n in fp8_scale_names(name)]
        if not scales or any(k in model_names for k in scales + own):
            # plain codes, or a model that holds the codes and their scales itself (an fp8
            # inference module; its scale under its own name, `gate_up_proj_scale_inv`, when it
            # fuses the checkpoint's experts: a key for it is then looked for like any other's)
            return False
        raise LoadError(
            f"{e.path}: {e.key!r} holds {e.dtype} codes scaled by {scales[0]!r}, and the model's "
            f"{target.name!r} is {target.tensor.dtype} with no scale tensor of its own: copied "
            "as they are, its values would be the unscaled codes. Build the model in bfloat16, "
            f"float16 or float32 (the codes are dequantized), or give it {scales[0]!r}"
        )
    if cfg is None or (cfg.method == "fp8") != (e.dtype in FP8_DTYPES):
        scale = fp8_scale_key(e.key) if e.dtype in FP8_DTYPES else e.key[:-7] + "_scales"
        if cfg is None and e.dtype in FP8_DTYPES:
            # DeepSeek's `weight_scale_inv`, or compressed-tensors' / ModelOpt's `weight_scale`
            scale = scales[0] if scales else None
            if scale is None:
                return False  # no scales: fp8 values as they are, as for bf16
        said = "no config.json quantization_config says so" if cfg is None else ""
        said = said or f"{cfg.source} says quant_method {cfg.method!r}"
        raise LoadError(
            f"{e.path}: {e.key!r} is quantized ({e.dtype}, scales {scale!r}) but {said}"
        )
    if len(quant) != len(target.pieces):
        plain = next(p.entry for p in target.pieces if all(p is not x for x in quant))
        q = quant[0].entry
        raise LoadError(
            f"{target.name}: checkpoint tensors mix quantized and plain dtypes: {plain.path}: "
            f"{plain.key!r} is {plain.dtype}, {q.path}: {q.key!r} is {q.dtype}"
        )
    part = next((p.entry for p in quant if not p.is_whole), None)
    if part is not None:
        raise LoadError(
            f"{target.name}: its quantized checkpoint tensors hold it only in part (a fused or "
            f"permuted key: {part.path}: {part.key!r}); dequantizing such keys is not supported"
        )
    return True
