"""The quantized rows of the loader suite: `load_sharded` dequantizing a block-FP8 (DeepSeek-V3
style, [128, 128] blocks) and an MXFP4 (gpt-oss style) copy of the loader checkpoint on read,
into the same bf16 model, against reading the bf16 checkpoint itself in the same run.

gbps is GB/s of dequantized (bf16) output: the bytes of the local tensors the ranks end up
with / seconds of the slowest rank, the same measure as the bf16 rows. Hot page cache only
(the files are read once just before), so the rows compare the CPU work, not the disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def _fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = w.shape
    sr, sc = -(-r // block), -(-c // block)
    pad = torch.zeros(sr * block, sc * block)
    pad[:r, :c] = w.float()
    tiles = pad.view(sr, block, sc, block)
    scale = (tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0).float()
    q = (tiles / scale[:, None, :, None]).view(sr * block, sc * block)[:r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = w.float().unflatten(-1, (w.shape[-1] // 32, 32))
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-120) / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    mag = torch.bucketize(x.abs(), (_FP4[1:] + _FP4[:-1]) / 2).to(torch.uint8)
    nib = mag | ((x < 0).to(torch.uint8) << 3)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8)


def write_quantized(src: Path, dst: Path, method: str, spec) -> None:
    """A copy of the bf16 loader checkpoint `src`, quantized: fp8 (every 2-D weight, with
    `weight_scale_inv`) or mxfp4 (experts as fused `{proj}_blocks` / `{proj}_scales`)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_map = {}
    for name in sorted(set(weight_map.values())):
        out = {}
        for key, t in load_file(str(src / name)).items():
            if method == "fp8":
                out[key], out[key[: -len("weight")] + "weight_scale_inv"] = _fp8(t)
            elif ".experts." not in key:
                out[key] = t
        if method == "mxfp4" and name == sorted(set(weight_map.values()))[0]:

            def get(key: str) -> torch.Tensor:  # one tensor at a time: the files stay on disk
                with safe_open(str(src / weight_map[key]), framework="pt") as f:
                    return f.get_tensor(key)

            for layer in range(spec.layers):
                p = f"layers.{layer}.mlp.experts"
                e = range(spec.experts)
                gate_up = torch.stack(
                    [
                        torch.cat(
                            [get(f"{p}.{i}.gate_proj.weight"), get(f"{p}.{i}.up_proj.weight")]
                        )
                        for i in e
                    ]
                )
                down = torch.stack([get(f"{p}.{i}.down_proj.weight") for i in e])
                for proj, w in (("gate_up_proj", gate_up), ("down_proj", down)):
                    out[f"{p}.{proj}_blocks"], out[f"{p}.{proj}_scales"] = _mxfp4(w)
        save_file(out, str(dst / name))
        out_map.update(dict.fromkeys(out, name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": out_map}))
    qc = (
        {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
        if method == "fp8"
        else {"quant_method": "mxfp4"}
    )
    (dst / "config.json").write_text(json.dumps({"quantization_config": qc}))


def quant_rows(
    ctx,
    spec,
    bf16_ckpt: Path,
    dev: str,
    reps: int,
    bf16_speed: dict,
    run_ranks,
    warm,
    log,
    rows: list | None = None,
):
    """One row per (method, ranks): GB/s of dequantized output and the ratio to the bf16
    checkpoint's hot grouped_ep row of the same run (`bf16_speed[world]`, bytes/s). Appended
    to `rows` as each finishes (the runner's list: they survive a stop)."""
    rows = [] if rows is None else rows
    for method in ("fp8", "mxfp4"):
        ckpt = bf16_ckpt / f"quant-{method}"
        write_quantized(bf16_ckpt, ckpt, method, spec)
        files = sorted(ckpt.glob("*.safetensors"))
        on_disk = sum(f.stat().st_size for f in files)
        for world in sorted(bf16_speed):
            warm(files)
            trials = [run_ranks(ctx, world, "grouped_ep", spec, ckpt, dev) for _ in range(reps)]
            ranks = min(trials, key=lambda rs: max(r["seconds"] for r in rs))
            secs = max(r["seconds"] for r in ranks)
            owned = sum(r["owned"] for r in ranks)
            row = {
                "case": f"grouped_ep_{method}-x{world}-hot",
                "ranks": world,
                "seconds": secs,
                "gbps": owned / secs / 1e9,
                "vs_bf16_x": owned / secs / bf16_speed[world],
                "read_ratio": max(r["counted"] / r["owned"] for r in ranks),
                "file_gb": on_disk / 1e9,
                "reps": reps,
            }
            rows.append(row)
            log(
                f"loader: {row['case']:<24} {row['gbps']:6.2f} GB/s dequantized  "
                f"{row['vs_bf16_x']:.2f}x the bf16 checkpoint  read / bf16 bytes "
                f"{row['read_ratio']:.3f}"
            )
        shutil.rmtree(ckpt)
    return rows
