"""Tiny quantized checkpoints written by the tests: DeepSeek-V3-style block FP8 and gpt-oss-style
MXFP4, with `quantization_config` in `config.json`, and transformers' own dequantization of
them (the reference every test compares with, element for element)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from grouped_ep.nn import GroupedExperts

FP4 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> float8_e4m3fn [R, C] and float32 weight_scale_inv [ceil(R/br), ceil(C/bc)]
    (per-block amax / 448, partial blocks at the edges)."""
    r, c = w.shape
    br, bc = block
    sr, sc = math.ceil(r / br), math.ceil(c / bc)
    pad = torch.zeros(sr * br, sc * bc)
    pad[:r, :c] = w
    tiles = pad.view(sr, br, sc, bc)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = (amax / 448.0).float()
    q = (tiles / scale_inv[:, None, :, None]).clamp(-448, 448).view(sr * br, sc * bc)[:r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] -> blocks uint8 [..., R, C/32, 16] (low nibble = even column) and E8M0
    scales uint8 [..., R, C/32]."""
    g = w.unflatten(-1, (w.shape[-1] // 32, 32))
    amax = g.abs().amax(-1).clamp(min=2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    nib = (x[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8)


def ref_fp8(q: torch.Tensor, s: torch.Tensor, block, dtype) -> torch.Tensor:
    """transformers' FP8 dequantization: Fp8Dequantize (the load path) where the weight divides
    into the scale grid, else _dequantize_fp8_weight in fp32 (partial edge blocks) rounded once."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    r, c = q.shape[-2:]
    if r % s.shape[-2] == 0 and c % s.shape[-1] == 0:
        return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    return _dequantize_fp8_weight(q, s, list(block), torch.float32).to(dtype)


def ref_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """transformers' MXFP4 dequantization ([E, C, R] for GptOssExperts), back in the file's
    [E, R, C] orientation, which is GroupedExperts' layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2).contiguous()


class _Layer(nn.Module):
    def __init__(self, e: int, h: int, i: int, r: int, router: str) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_a_proj = nn.Linear(h, r, bias=False)
        self.input_layernorm = nn.RMSNorm(h)
        self.mlp = nn.Module()
        setattr(self.mlp, router, nn.Linear(h, e, bias=False))
        self.mlp.experts = GroupedExperts(e, h, i)


class TinyMoE(nn.Module):
    """`model.layers.{l}` with `self_attn.q_a_proj`, `input_layernorm`, `mlp.{router}` and
    `mlp.experts` (a GroupedExperts: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""

    def __init__(self, e, h, i, r, layers=1, router="gate", dtype=torch.bfloat16) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer(e, h, i, r, router) for _ in range(layers))
        self.to(dtype)


def _save(directory: Path, tensors: dict[str, torch.Tensor], qc: dict, files: int = 2) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    weight_map = {}
    for f in range(files):
        name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[f::files]}
        save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"model_type": "tiny"}
    if qc is not None:
        config["quantization_config"] = qc
    (directory / "config.json").write_text(json.dumps(config))


def write_fp8(
    directory: Path,
    scale_dtype=torch.float32,
    e=4,
    h=72,
    i=40,
    r=50,
    block=(16, 32),
    layers=1,
    seed=0,
    dtype=torch.bfloat16,
    qc="default",
    reference=True,
):
    """A DeepSeek-V3-style checkpoint: fp8 weights with `weight_scale_inv` per block, per-expert
    keys; router and norms in bf16. Returns {model name: transformers' dequantized tensor}
    (empty with reference=False, which needs no transformers), tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors, want = {}, {}

    def fp8(key: str, w: torch.Tensor) -> torch.Tensor:
        q, s = quantize_fp8(w, block)
        if scale_dtype == torch.float8_e8m0fnu:  # UE8M0: powers of two, rounded up
            s = torch.exp2(torch.ceil(torch.log2(s))).to(scale_dtype)
        else:
            s = s.to(scale_dtype)
        tensors[key], tensors[key[: -len("weight")] + "weight_scale_inv"] = q, s
        return ref_fp8(q, s, block, dtype) if reference else q.float()

    for layer in range(layers):
        p = f"model.layers.{layer}"
        want[f"{p}.self_attn.q_a_proj.weight"] = fp8(
            f"{p}.self_attn.q_a_proj.weight", torch.randn(r, h, generator=g)
        )
        for name, shape in (
            (f"{p}.mlp.gate.weight", (e, h)),
            (f"{p}.input_layernorm.weight", (h,)),
        ):
            tensors[name] = torch.randn(*shape, generator=g).to(torch.bfloat16)
            want[name] = tensors[name].to(dtype)
        gate_up, down = [], []
        for x in range(e):
            q = f"{p}.mlp.experts.{x}"
            gu = [
                fp8(f"{q}.{n}.weight", torch.randn(i, h, generator=g))
                for n in ("gate_proj", "up_proj")
            ]
            gate_up.append(torch.cat(gu))
            down.append(fp8(f"{q}.down_proj.weight", torch.randn(h, i, generator=g) * 0.05))
        want[f"{p}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        want[f"{p}.mlp.experts.down_proj"] = torch.stack(down)
    if qc == "default":
        qc = {
            "quant_method": "fp8",
            "weight_block_size": list(block),
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
        }
    _save(directory, tensors, qc)
    return (want if reference else {}), tensors


def write_mxfp4(
    directory: Path, e=4, h=96, i=64, r=50, layers=1, seed=0, dtype=torch.bfloat16, reference=True
):
    """A gpt-oss-style checkpoint: experts as `{proj}_blocks` / `{proj}_scales` (MXFP4) with bf16
    biases, attention and router in bf16. Returns {model name: dequantized tensor} (empty with
    reference=False), tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors, want = {}, {}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for name, shape in (
            (f"{p}.self_attn.q_a_proj.weight", (r, h)),
            (f"{p}.mlp.router.weight", (e, h)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * i)),
            (f"{p}.mlp.experts.down_proj_bias", (e, h)),
        ):
            tensors[name] = torch.randn(*shape, generator=g).to(torch.bfloat16)
            want[name] = tensors[name].to(dtype)
        for proj, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
            blocks, scales = quantize_mxfp4(torch.randn(*shape, generator=g))
            key = f"{p}.mlp.experts.{proj}"
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            if reference:
                want[key] = ref_mxfp4(blocks, scales, dtype)
    qc = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    _save(directory, tensors, qc)
    for k in [k for k in want if k.endswith("_bias")]:
        del want[k]  # GroupedExperts has no expert biases yet: those keys stay unused
    return (want if reference else {}), tensors


def meta_model(kind: str, dtype=torch.bfloat16, **shape) -> TinyMoE:
    defaults = {"fp8": dict(e=4, h=72, i=40, r=50), "mxfp4": dict(e=4, h=96, i=64, r=50)}[kind]
    defaults.update(shape)
    with torch.device("meta"):
        return TinyMoE(**defaults, router="gate" if kind == "fp8" else "router", dtype=dtype)
