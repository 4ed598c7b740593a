"""load_sharded on quantized checkpoints (block FP8 as DeepSeek-V3 ships, MXFP4 as gpt-oss ships):
dequantized on read, equal to transformers' own dequantization element for element, each rank
reading only its quantized bytes and the scale blocks that cover them; bad input is a LoadError
naming the file and key, with nothing written."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from _dist import run_ranks
from _quant_ckpt import (
    meta_model,
    ref_fp8,
    ref_mxfp4,
    write_fp8,
    write_mxfp4,
)
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

import grouped_ep  # noqa: F401  (loads the ops)
from grouped_ep import LoadError, load_sharded
from grouped_ep.loading.quant_formats import fp8_scale_key


def _exact(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)


def _state(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()
    }


# ---- the native kernel against transformers, over every input value ----------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_every_byte_equals_transformers(dtype):
    q = torch.arange(256, dtype=torch.uint8).repeat(4).view(16, 64).view(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 3.7e-3], [0.5, 2.0**-20], [7.25, 1.0e3], [2.0**-126, 1.5]]).float()
    want = ref_fp8(q, s, (4, 32), dtype)
    out = torch.empty(1, 16, 64, dtype=dtype)
    rb = torch.arange(16) // 4
    cb = torch.arange(64) // 32
    torch.ops.grouped_ep.dequantize(q.view(torch.uint8)[None], s[None], rb, cb, out, "fp8")
    _exact(out[0], want, "fp8")


def _every_byte_with_every_exponent() -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks [1, 4096, 1, 16] and scales [1, 4096, 1]: row 16 e + j holds the bytes
    16 j .. 16 j + 15 (so 16 rows hold all 256) under exponent e, for every e in 0..255."""
    rows = torch.arange(256 * 16)
    blocks = ((rows % 16 * 16).view(-1, 1) + torch.arange(16)).to(torch.uint8)
    scales = (rows // 16).to(torch.uint8)
    return blocks.view(1, -1, 1, 16), scales.view(1, -1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_every_nibble_and_exponent_equals_transformers(dtype):
    """Every FP4 nibble (both halves of every byte) under every E8M0 exponent, 0 and 255
    included (255: 0.5 * 2^128 is 2^127, 0 * 2^128 is 0, as transformers' ldexp gives)."""
    blocks, scales = _every_byte_with_every_exponent()
    want = ref_mxfp4(blocks, scales, dtype)  # [1, 4096, 32]
    assert want[0, 255 * 16, 0] == 0 and want[0, 255 * 16, 2] == 2.0**127 or dtype == torch.float16
    out = torch.empty(want.shape, dtype=dtype)
    torch.ops.grouped_ep.dequantize(
        blocks.view(1, -1, 16),
        scales,
        torch.arange(scales.shape[1]),
        torch.zeros(32, dtype=torch.long),
        out,
        "mxfp4",
    )
    _exact(out, want, "mxfp4")


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_device_path_arithmetic_equals_transformers(kind):
    """dequantize_torch is what CUDA destinations run; here it runs on CPU tensors."""
    from grouped_ep.loading.dequant import dequantize_torch

    if kind == "fp8":
        q = torch.arange(256, dtype=torch.uint8).repeat(4).view(16, 64)
        s = torch.rand(4, 2) * 10
        want = ref_fp8(q.view(torch.float8_e4m3fn), s, (4, 32), torch.bfloat16)[None]
        args = (q[None], s[None], torch.arange(16) // 4, torch.arange(64) // 32)
    else:
        blocks, scales = _every_byte_with_every_exponent()
        want = ref_mxfp4(blocks, scales, torch.bfloat16)
        args = (
            blocks.reshape(1, -1, 16),
            scales,
            torch.arange(scales.shape[1]),
            torch.zeros(32, dtype=torch.long),
        )
    out = torch.empty(want.shape, dtype=torch.bfloat16)
    dequantize_torch(*args, kind, out)
    _exact(out, want, kind)


def test_dequantize_op_rejects_bad_arguments():
    out = torch.empty(1, 4, 4, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 4, dtype=torch.uint8)
    s = torch.ones(1, 1, 1)
    idx = torch.zeros(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="format must be"):
        torch.ops.grouped_ep.dequantize(q, s, idx, idx, out, "int4")
    with pytest.raises(RuntimeError, match=r"col_block\[2\]=1"):
        torch.ops.grouped_ep.dequantize(q, s, idx, torch.tensor([0, 0, 1, 0]), out, "fp8")
    with pytest.raises(RuntimeError, match="q has shape"):
        torch.ops.grouped_ep.dequantize(q, s, idx, idx, out, "mxfp4")


# ---- single process ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [dict(e=4, h=64, i=32, r=48), dict(e=3, h=72, i=40, r=50)],
    ids=["blocks_divide", "partial_edge_blocks"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_checkpoint_equals_transformers(tmp_path, shape, dtype):
    want, tensors = write_fp8(tmp_path, dtype=dtype, **shape)
    model = meta_model("fp8", dtype=dtype, **shape)
    report = load_sharded(model, tmp_path, device="cpu")
    got = _state(model)
    assert set(got) == set(want)
    for k in want:
        _exact(got[k], want[k], k)
    fp8 = sum(t.numel() for t in tensors.values() if t.dtype == torch.float8_e4m3fn)
    scales = sum(t.nbytes for k, t in tensors.items() if k.endswith("weight_scale_inv"))
    plain = sum(t.nbytes for t in tensors.values() if t.dtype == torch.bfloat16)
    assert report.quantized_bytes_read == fp8
    assert report.scale_bytes_read == scales
    assert report.bytes_owned == fp8 + plain
    assert report.bytes_read == report.bytes_owned + report.scale_bytes_read
    assert report.unused_keys == [] and report.missing == []


@pytest.mark.parametrize(
    "scale_dtype", [torch.bfloat16, torch.float8_e8m0fnu], ids=["bf16", "ue8m0"]
)
def test_fp8_scale_dtypes(tmp_path, scale_dtype):
    want, tensors = write_fp8(tmp_path, scale_dtype=scale_dtype, e=2, h=64, i=32, r=48)
    assert tensors["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"].dtype == scale_dtype
    model = meta_model("fp8", e=2, h=64, i=32, r=48)
    load_sharded(model, tmp_path, device="cpu")
    got = _state(model)
    for k in want:
        _exact(got[k], want[k], k)


_OTHER_FP8 = ["float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


@pytest.mark.parametrize("config", [True, False], ids=["fp8_config", "no_config"])
@pytest.mark.parametrize("dtype", _OTHER_FP8)
def test_other_fp8_weights_beside_their_scales_are_refused(tmp_path, dtype, config):
    """The FNUZ ones were loaded as raw codes, their scales unused (up to 240 off, silently)."""
    _, tensors = write_fp8(tmp_path)
    key = "model.layers.0.self_attn.q_a_proj.weight"
    file = _rewrite(tmp_path, key, tensors[key].to(getattr(torch, dtype)))
    if not config:
        cfg = json.loads((tmp_path / "config.json").read_text())
        del cfg["quantization_config"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    said = "block-FP8 dequantization reads" if config else "no config.json quantization_config"
    with pytest.raises(
        LoadError, match=rf"{file}: '{key}' is (quantized \()?torch\.{dtype}.*{said}"
    ):
        load_sharded(meta_model("fp8"), tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_checkpoint_equals_transformers(tmp_path, dtype):
    want, tensors = write_mxfp4(tmp_path, dtype=dtype)
    model = meta_model("mxfp4", dtype=dtype)
    report = load_sharded(model, tmp_path, device="cpu")
    got = _state(model)
    for k in want:
        _exact(got[k], want[k], k)
    blocks = sum(t.nbytes for k, t in tensors.items() if k.endswith("_blocks"))
    scales = sum(t.nbytes for k, t in tensors.items() if k.endswith("_scales"))
    assert report.quantized_bytes_read == blocks and report.scale_bytes_read == scales
    assert report.bytes_read == report.bytes_owned + report.scale_bytes_read
    # gpt-oss expert biases: GroupedExperts has none yet, so they are reported unused.
    assert report.unused_keys == [
        "model.layers.0.mlp.experts.down_proj_bias",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
    ]


def test_materialized_model_is_overwritten_in_place(tmp_path):
    want, _ = write_fp8(tmp_path)
    model = meta_model("fp8").to_empty(device="cpu")
    before = model.model.layers[0].mlp.experts.down_proj
    load_sharded(model, tmp_path)
    assert model.model.layers[0].mlp.experts.down_proj is before
    _exact(before.detach(), want["model.layers.0.mlp.experts.down_proj"], "down_proj")


# ---- bad input: a LoadError naming the file and key, nothing written -------------------------


def _rewrite(path, key, value):
    """Replace one tensor of the checkpoint file that holds `key`."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = index["weight_map"][key]
    tensors = load_file(str(path / name))
    if value is None:
        del tensors[key]
        index["weight_map"].pop(key)
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[key] = value
    save_file(tensors, str(path / name))
    return str(path / name)


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_scales_whose_tensor_is_missing_are_named(tmp_path, kind):
    """The error said only 'no checkpoint key ... Pass key_map=' (a review: a shard copied in
    part); it now names the scales that are there and the quantized key that is not."""
    _, tensors = (write_fp8 if kind == "fp8" else write_mxfp4)(tmp_path)
    key = (
        "model.layers.0.self_attn.q_a_proj.weight"
        if kind == "fp8"
        else next(k for k in tensors if k.endswith("_blocks"))
    )
    scale = fp8_scale_key(key) if kind == "fp8" else key[: -len("_blocks")] + "_scales"
    assert scale in tensors
    _rewrite(tmp_path, key, None)
    with pytest.raises(
        LoadError, match=rf"'{re.escape(scale)}' is there, '{re.escape(key)}' is not"
    ):
        load_sharded(meta_model(kind), tmp_path)


def _assert_untouched(model, fill: float) -> None:
    for k, v in model.state_dict().items():
        assert torch.all(v == fill), f"{k} was written by a failed load"


def _filled(kind):
    model = meta_model(kind).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    return model


def test_scale_that_does_not_cover_its_weight(tmp_path):
    write_fp8(tmp_path)
    key = "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"
    file = _rewrite(tmp_path, key, torch.ones(2, 2))
    model = _filled("fp8")
    with pytest.raises(LoadError, match=rf"{file}: scale '{key}' is torch.float32 \[2, 2\] but"):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def test_missing_scale(tmp_path):
    write_fp8(tmp_path)
    key = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    _rewrite(tmp_path, key, None)
    model = _filled("fp8")
    with pytest.raises(LoadError, match=rf"\.safetensors: missing scale '{key}' for"):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def test_mxfp4_scales_of_wrong_shape(tmp_path):
    write_mxfp4(tmp_path)
    key = "model.layers.0.mlp.experts.down_proj_scales"
    file = _rewrite(tmp_path, key, torch.zeros(4, 96, 3, dtype=torch.uint8))
    model = _filled("mxfp4")
    with pytest.raises(LoadError, match=rf"{file}: scale '{key}' is torch.uint8 \[4, 96, 3\]"):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def test_stack_mixing_quantized_and_plain_keys_names_both(tmp_path):
    want, _ = write_fp8(tmp_path)
    key = "model.layers.0.mlp.experts.2.down_proj.weight"
    plain = want["model.layers.0.mlp.experts.down_proj"][2].to(torch.bfloat16).contiguous()
    file = _rewrite(tmp_path, key, plain)
    _rewrite(tmp_path, key[: -len("weight")] + "weight_scale_inv", None)
    model = _filled("fp8")
    with pytest.raises(
        LoadError,
        match=rf"experts.down_proj: checkpoint tensors mix quantized and plain dtypes: {file}: "
        rf"'{key}' is torch.bfloat16, .*\.safetensors: 'model.layers.0.mlp.experts.0.down_proj"
        r".weight' is torch.float8_e4m3fn",
    ):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def test_unknown_quant_method(tmp_path):
    write_fp8(tmp_path, qc={"quant_method": "awq", "bits": 4})
    model = _filled("fp8")
    with pytest.raises(
        LoadError, match=r"config.json: unknown quantization_config.quant_method 'awq'"
    ):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def test_scales_without_quantization_config_are_an_error(tmp_path):
    """The silent failure of issue 14: fp8 values cast without their scales."""
    write_fp8(tmp_path, qc=None)
    model = _filled("fp8")
    with pytest.raises(LoadError, match=r"is quantized .* no config.json quantization_config"):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def test_dequantize_false_refuses(tmp_path):
    write_mxfp4(tmp_path)
    model = _filled("mxfp4")
    with pytest.raises(
        LoadError, match=r"config.json: the checkpoint is quantized .*dequantize=False"
    ):
        load_sharded(model, tmp_path, dequantize=False)
    _assert_untouched(model, 3.0)


def test_integer_parameters_are_refused(tmp_path):
    write_fp8(tmp_path)
    model = meta_model("fp8")
    model.model.layers[0].self_attn.q_a_proj.weight = torch.nn.Parameter(
        torch.empty(50, 72, dtype=torch.int8, device="meta"), requires_grad=False
    )
    with pytest.raises(
        LoadError,
        match=r"q_a_proj.weight: quantized checkpoint tensors \(.*\.safetensors: "
        r"model.layers.0.self_attn.q_a_proj.weight, torch.float8_e4m3fn\) dequantize",
    ):
        load_sharded(model, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_cuda_destination_equals_cpu_destination(tmp_path, kind):
    """Dequantized on the way to the GPU: element for element what the CPU load gives (which
    the tests above compare with transformers' own dequantization)."""
    (write_fp8 if kind == "fp8" else write_mxfp4)(tmp_path, reference=False)
    on_cpu, on_gpu = meta_model(kind), meta_model(kind)
    load_sharded(on_cpu, tmp_path, device="cpu")
    load_sharded(on_gpu, tmp_path, device="cuda")
    want = _state(on_cpu)
    for k, v in _state(on_gpu).items():
        assert v.device.type == "cuda"
        _exact(v.cpu(), want[k], k)


# ---- ranks: EP = 2 and dp 2 x ep 2, shard boundaries inside scale blocks ---------------------


def _covering_scale_bytes(rows: range, cols: range, block) -> int:
    """Scale blocks (float32) covering rows x cols, counted independently of the planner."""
    br, bc = block
    nr = len({r // br for r in rows})
    nc = len({c // bc for c in cols})
    return nr * nc * 4


def _ep2_body(rank, world, fp8_dir, mx_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from grouped_ep.parallel import apply_expert_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    for kind, path in (("fp8", fp8_dir), ("mxfp4", mx_dir)):
        model = meta_model(kind)
        apply_expert_parallel(model, mesh)
        attn = model.model.layers[0].self_attn.q_a_proj
        # Rows of a dense weight split over the ranks: 25 rows each, cutting a 16-row block.
        attn.weight = torch.nn.Parameter(
            distribute_tensor(attn.weight, mesh, [Shard(0)], src_data_rank=None)
        )
        report = load_sharded(model, path)
        out[kind] = (report, _state(model))
    return out


def test_ep2_equals_transformers_and_reads_only_covering_scales(tmp_path):
    want8, t8 = write_fp8(tmp_path / "fp8")
    wantmx, tmx = write_mxfp4(tmp_path / "mx")
    results = run_ranks(_ep2_body, 2, str(tmp_path / "fp8"), str(tmp_path / "mx"), timeout=240)
    block = (16, 32)
    for rank, out in enumerate(results):
        report, got = out["fp8"]
        for k in want8:
            _exact(got[k], want8[k], f"rank {rank} {k}")
        rows = range(25 * rank, 25 * rank + 25)
        attn_scales = _covering_scale_bytes(rows, range(72), block)
        expert_scales = 2 * sum(
            math.ceil(r / 16) * math.ceil(c / 32) * 4 for r, c in ((40, 72), (40, 72), (72, 40))
        )
        assert report.scale_bytes_read == attn_scales + expert_scales
        assert report.quantized_bytes_read == 25 * 72 + 2 * 3 * 40 * 72
        assert report.bytes_read == report.bytes_owned + report.scale_bytes_read
        # The other rank's experts' scales are used, not unused (they were listed before).
        assert report.unused_keys == [] and report.missing == []
        report, got = out["mxfp4"]
        for k in wantmx:
            _exact(got[k], wantmx[k], f"rank {rank} {k}")
        half = {k: t.nbytes // 2 for k, t in tmx.items() if k.endswith(("_blocks", "_scales"))}
        assert report.quantized_bytes_read == sum(
            v for k, v in half.items() if k.endswith("_blocks")
        )
        assert report.scale_bytes_read == sum(v for k, v in half.items() if k.endswith("_scales"))
        assert report.bytes_read == report.bytes_owned + report.scale_bytes_read
        assert report.unused_keys == [
            "model.layers.0.mlp.experts.down_proj_bias",
            "model.layers.0.mlp.experts.gate_up_proj_bias",
        ]


def _dp2_ep2_body(rank, world, fp8_dir, mx_dir):
    from torch.distributed.tensor import Shard, distribute_tensor

    from grouped_ep.parallel import fully_shard_moe, make_mesh

    mesh = make_mesh(dp=2, ep=2)
    out = {}
    model = meta_model("fp8")
    fully_shard_moe(model, mesh)  # dense weights: rows over 4 ranks (13 each), experts: ep x dp
    report = load_sharded(model, fp8_dir)
    out["fp8"] = (report, _state(model))
    # MXFP4 experts with their columns split over dp: 48 of 96 columns each, so the middle
    # 32-value block's scale is read by both dp ranks (and its bytes split between them).
    model = meta_model("mxfp4")
    experts = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        d = distribute_tensor(p, mesh, [Shard(2), Shard(0)], src_data_rank=None)
        setattr(experts, name, torch.nn.Parameter(d))
    report = load_sharded(model, mx_dir)
    out["mxfp4"] = (report, _state(model))
    return out


@pytest.mark.slow
def test_dp2_ep2_equals_transformers(tmp_path):
    want8, t8 = write_fp8(tmp_path / "fp8")
    wantmx, tmx = write_mxfp4(tmp_path / "mx")
    results = run_ranks(_dp2_ep2_body, 4, str(tmp_path / "fp8"), str(tmp_path / "mx"), timeout=300)
    fp8_total = sum(t.numel() for t in t8.values() if t.dtype == torch.float8_e4m3fn)
    assert sum(out["fp8"][0].quantized_bytes_read for out in results) == fp8_total
    for rank, out in enumerate(results):
        for kind, want in (("fp8", want8), ("mxfp4", wantmx)):
            report, got = out[kind]
            for k in want:
                _exact(got[k], want[k], f"rank {rank} {kind} {k}")
            assert report.bytes_read == report.bytes_owned + report.scale_bytes_read
        # q_a_proj rows [13 r, 13 r + 13) cut 16-row blocks: only the covering ones are read.
        # Experts: 4 over ep 2 x dp 2 is one expert per rank (gate, up [40, 72], down [72, 40]).
        rows = range(13 * rank, min(50, 13 * rank + 13))
        one_expert = sum(
            math.ceil(r / 16) * math.ceil(c / 32) * 4 for r, c in ((40, 72), (40, 72), (72, 40))
        )
        fp8 = out["fp8"][0]
        assert fp8.scale_bytes_read == _covering_scale_bytes(rows, range(72), (16, 32)) + one_expert
        assert fp8.quantized_bytes_read == len(rows) * 72 + 3 * 40 * 72
        mx = out["mxfp4"][0]
        ep, dp = rank % 2, rank // 2
        e = 2  # experts per ep rank; gate_up [E, 128, 96] and down [E, 96, 64]
        cols_gu = range(48 * dp, 48 * dp + 48)
        cols_dn = range(32 * dp, 32 * dp + 32)
        assert mx.quantized_bytes_read == e * (128 * 48 + 96 * 32) // 2
        want_scales = e * (
            128 * len({c // 32 for c in cols_gu}) + 96 * len({c // 32 for c in cols_dn})
        )
        assert mx.scale_bytes_read == want_scales, (rank, ep)


# ---- MXFP4 into transformers' own gpt-oss model ----------------------------------------------


def _gpt_oss_config(hidden: int, inter: int):
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"],
    )  # fmt: skip
    return cfg


def _gpt_oss_mxfp4(path, hidden: int, inter: int):
    """A tiny transformers GptOssForCausalLM saved as gpt-oss ships: experts as MXFP4 blocks and
    scales in the file's [E, R, C] orientation (transformers' parameters are [E, C, R])."""
    from _quant_ckpt import quantize_mxfp4
    from transformers import GptOssForCausalLM

    cfg = _gpt_oss_config(hidden, inter)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).float()
    tensors, want = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(torch.randn(v.transpose(1, 2).shape))
            tensors[f"{k}_blocks"], tensors[f"{k}_scales"] = blocks, scales
            want[k] = ref_mxfp4(blocks, scales, torch.float32).transpose(1, 2)  # transformers'
        else:
            tensors[k] = v.contiguous()
            want[k] = v
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = cfg.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))
    return cfg, want


@pytest.mark.parametrize(
    "hidden,inter", [(64, 64), (64, 32)], ids=["down_square", "gate_up_square"]
)
def test_mxfp4_into_transformers_gpt_oss_takes_its_orientation(tmp_path, hidden, inter):
    """transformers' gpt-oss experts hold the dequantized tensors with their last two dims swapped
    (convert_moe_packed_tensors transposes). With hidden == intermediate (real gpt-oss: 2880 and
    2880) down_proj is square, with hidden == 2 x intermediate gate_up_proj is: the file's
    orientation would then load without a shape error, transposed."""
    from transformers import GptOssForCausalLM

    cfg, want = _gpt_oss_mxfp4(tmp_path / "ckpt", hidden, inter)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg).float()
    report = load_sharded(model, tmp_path / "ckpt", device="cpu")
    assert report.missing == [] and report.unused_keys == []
    got = model.state_dict()
    for k, v in want.items():
        _exact(got[k], v, k)
    ref = GptOssForCausalLM(cfg).float()
    ref.load_state_dict(want)
    ids = torch.arange(12).view(2, 6)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_export_of_a_model_loaded_from_mxfp4_is_a_plain_checkpoint(tmp_path):
    """The export kept the source's `quantization_config`: transformers then read the plain
    weights as quantized (here: "requires accelerate"; on an FP8 GPU: cast to float8, scales
    "newly initialized")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grouped_ep.checkpoint import export_hf

    _gpt_oss_mxfp4(tmp_path / "ckpt", 64, 32)
    config = AutoConfig.from_pretrained(tmp_path / "ckpt")
    assert config.quantization_config["quant_method"] == "mxfp4"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_sharded(model, tmp_path / "ckpt", device="cpu")
    export_hf(model, tmp_path / "hf")
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.arange(12).view(2, 6)
    torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert "quantization_config" in model.config.to_dict()  # the model's own config is kept


def test_mxfp4_without_quantization_config_names_the_keys(tmp_path):
    write_mxfp4(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    model = _filled("mxfp4")
    with pytest.raises(
        LoadError,
        match=r"\.safetensors: model tensor 'model.layers.0.mlp.experts.(gate_up|down)_proj' is "
        r"stored as MXFP4 .* but no config.json quantization_config says so",
    ):
        load_sharded(model, tmp_path)
    _assert_untouched(model, 3.0)


def _gpt_oss_parallelized_body(rank, world, path, hidden, inter):
    from transformers import GptOssForCausalLM

    import grouped_ep.hf
    from grouped_ep.parallel import make_mesh

    with torch.device("meta"):
        model = GptOssForCausalLM(_gpt_oss_config(hidden, inter)).float()
    grouped_ep.hf.parallelize(model, make_mesh(dp=1, ep=world))
    report = load_sharded(model, path)
    experts = model.model.layers[0].mlp.experts
    return report.unused_keys, {
        n: getattr(experts, n).to_local().clone() for n in ("gate_up_proj", "down_proj")
    }


def test_mxfp4_into_gpt_oss_after_parallelize_takes_its_orientation(tmp_path):
    """fully_shard swaps the experts' class for one it makes on the fly (module torch...): the
    transformers orientation was then not recognized and the load refused (or, with square
    tensors, loaded transposed)."""
    cfg, want = _gpt_oss_mxfp4(tmp_path / "ckpt", 64, 64)
    results = run_ranks(_gpt_oss_parallelized_body, 2, str(tmp_path / "ckpt"), 64, 64, timeout=240)
    for rank, (unused, got) in enumerate(results):
        assert unused == []
        for name, local in got.items():
            full = want[f"model.layers.0.mlp.experts.{name}"]
            _exact(local, full[2 * rank : 2 * rank + 2], f"rank {rank} {name}")


def test_fp8_scales_named_weight_scale_without_config_are_an_error(tmp_path):
    """compressed-tensors / ModelOpt name an fp8 weight's scales `weight_scale`: without a
    quantization_config they used to be left unused and the raw fp8 codes loaded (446 off)."""
    from _quant_ckpt import quantize_fp8

    q, s = quantize_fp8(torch.randn(8, 16), (8, 16))
    save_file({"proj.weight": q, "proj.weight_scale": s}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(16, 8, bias=False)
    before = model.proj.weight.detach().clone()
    with pytest.raises(
        LoadError, match=r"'proj\.weight' is quantized .*scales 'proj\.weight_scale'\) but no"
    ):
        load_sharded(model, tmp_path)
    assert torch.equal(model.proj.weight, before)


def test_mxfp4_keys_named_by_key_map(tmp_path):
    """key_map names an MXFP4 tensor by its logical key or by its `_blocks` key (it used to be
    'missing key', or a shape mismatch between [E, R, C] and the packed blocks)."""
    want, _ = write_mxfp4(tmp_path)
    for mapped in ("", "_blocks"):
        model = meta_model("mxfp4")
        renamed = torch.nn.Module()
        renamed.blocks = model.model.layers  # the same tensors, under other names

        def key_map(name, suffix=mapped):
            return (
                "model.layers." + name.removeprefix("blocks.") + suffix
                if "experts." in name and not name.endswith("_bias")
                else "model.layers." + name.removeprefix("blocks.")
            )

        report = load_sharded(renamed, tmp_path, key_map=key_map, device="cpu", strict=False)
        got = _state(model)
        for k in (
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
        ):
            _exact(got[k], want[k], k)
        assert not any(k.endswith(("_blocks", "_scales")) for k in report.unused_keys)


def test_mxfp4_checkpoint_into_a_model_with_more_layers_names_the_missing(tmp_path):
    """A 1-D model tensor with no key (a layer the checkpoint lacks) under an MXFP4 config took
    transformers' swap of the last two dims of its shape: an IndexError, strict or not."""
    from transformers import GptOssForCausalLM

    cfg, _ = _gpt_oss_mxfp4(tmp_path / "ckpt", 64, 32)
    cfg.num_hidden_layers, cfg.layer_types = 2, ["full_attention"] * 2
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg).float()
    with pytest.raises(LoadError, match=r"no checkpoint key for \d+ tensor.*model\.layers\.1\."):
        load_sharded(model, tmp_path / "ckpt", device="cpu")
    report = load_sharded(model, tmp_path / "ckpt", device="cpu", strict=False)
    assert "model.layers.1.self_attn.sinks" in report.missing
    assert "model.layers.1.mlp.experts.gate_up_proj" in report.missing
    assert not model.model.layers[0].mlp.experts.gate_up_proj.is_meta


@pytest.mark.parametrize("direction", ["base_from_head", "head_from_base"])
def test_transformers_base_model_prefix_added_or_stripped(tmp_path, direction):
    """As from_pretrained does: a base model (`GptOssModel`) loads the checkpoint of its model
    with a head (keys `model.layers...`), plain or MXFP4; a model with a head loads its base
    model's checkpoint (the head then missing). Both used to be 'no checkpoint key' for every
    tensor."""
    from transformers import GptOssForCausalLM, GptOssModel

    cfg, want = _gpt_oss_mxfp4(tmp_path / "ckpt", 64, 32)
    if direction == "base_from_head":
        with torch.device("meta"):
            model = GptOssModel(cfg).float()
        report = load_sharded(model, tmp_path / "ckpt", device="cpu")
        assert report.unused_keys == ["lm_head.weight"]
        got = {f"model.{k}": v for k, v in model.state_dict().items()}
        for k, v in got.items():
            _exact(v, want[k], k)
        return
    # Errors name the file's key as the file has it, and the model's tensor as the model does.
    cfg.vocab_size += 1
    with torch.device("meta"):
        wrong = GptOssModel(cfg).float()
    with pytest.raises(
        LoadError,
        match=r"shape mismatch for 'model\.embed_tokens\.weight': the model's "
        r"(tensor|'embed_tokens\.weight') is \[65, 64\]",
    ):
        load_sharded(wrong, tmp_path / "ckpt", device="cpu")
    cfg.vocab_size -= 1
    # A key_map of the user's keeps the file's names (it used to be the only way to do this).
    with torch.device("meta"):
        model = GptOssModel(cfg).float()
    load_sharded(model, tmp_path / "ckpt", device="cpu", key_map=lambda n: f"model.{n}")
    for k, v in model.state_dict().items():
        _exact(v, want[f"model.{k}"], k)
    base = GptOssModel(cfg).float()
    base.save_pretrained(tmp_path / "base")
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg).float()
    report = load_sharded(model, tmp_path / "base", device="cpu", strict=False)
    assert report.missing == ["lm_head.weight"] and report.unused_keys == []
    for k, v in base.state_dict().items():
        _exact(model.state_dict()[f"model.{k}"], v, k)


@pytest.mark.parametrize("config", [False, True], ids=["no_config", "config_says_fp8"])
def test_fp8_model_holding_its_own_scales_loads_its_file(tmp_path, config):
    """An fp8 model tensor takes the codes as they are, next to its own `weight_scale` (an fp8
    inference module): not refused as 'quantized without a config', as a bf16 model is; and with
    a config saying fp8, not refused as 'dequantize into bfloat16, float16 or float32'."""

    class FP8Linear(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            w = torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn)
            self.weight = torch.nn.Parameter(w, requires_grad=False)
            self.weight_scale = torch.nn.Parameter(torch.rand(1, generator=g), requires_grad=False)

    save_file(dict(FP8Linear(0).state_dict()), str(tmp_path / "model.safetensors"))
    bare = FP8Linear(1)
    del bare.weight_scale  # an fp8 model without the scales: the codes alone are wrong values
    with pytest.raises(LoadError, match=r"no scale tensor of its own: copied as they are"):
        load_sharded(bare, tmp_path, strict=False)
    if config:
        qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    model = FP8Linear(1)
    load_sharded(model, tmp_path)
    want = FP8Linear(0)
    assert torch.equal(model.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(model.weight_scale, want.weight_scale)


def test_fused_fp8_experts_holding_scales_under_their_own_names_are_not_called_scaleless(
    tmp_path,
):
    """transformers' FP8Experts holds `gate_up_proj` fp8 and `gate_up_proj_scale_inv`; a
    DeepSeek-V3 checkpoint's per-expert scales cannot fill the fused scales. The error said the
    model had 'no scale tensor of its own' and asked for a per-expert key (a review); it names
    the model's scales that no checkpoint key fills, as before that check."""
    write_fp8(tmp_path, reference=False)
    model = meta_model("fp8")
    experts = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        codes = getattr(experts, name)
        fp8 = torch.empty(codes.shape, dtype=torch.float8_e4m3fn, device="meta")
        setattr(experts, name, nn.Parameter(fp8, requires_grad=False))
        scales = torch.empty(codes.shape[0], 2, 2, device="meta")
        experts.register_parameter(f"{name}_scale_inv", nn.Parameter(scales, requires_grad=False))
    with pytest.raises(LoadError) as err:
        load_sharded(model, tmp_path, device="cpu")
    assert "no scale tensor of its own" not in str(err.value)
    assert re.search(
        r"no checkpoint key for 2 tensor\(s\).*experts\.gate_up_proj_scale_inv, "
        r"model\.layers\.0\.mlp\.experts\.down_proj_scale_inv",
        str(err.value),
    ), str(err.value)


def test_block_indices_kept_compact_equal_the_arrays():
    # Each row's and column's scale block, kept as (first, size, first block) for consecutive
    # indices (arrays per row of every per-expert key of DeepSeek-V3 took 3.3 GB to plan): the
    # same indices as the arrays, which stay for strided (_StridedShard) rows.
    from grouped_ep.loading.quant import _compact, _expand, _used_blocks

    for rel in (np.arange(5, 700), np.arange(0, 128), np.array([3, 4, 9, 130, 131, 500])):
        used = _used_blocks(rel, 128)
        assert np.array_equal(used, np.unique(rel // 128))
        kept = _compact(rel, 128, used)
        assert isinstance(kept, tuple) == (rel[-1] - rel[0] == len(rel) - 1)
        assert np.array_equal(_expand(kept, len(rel)), np.searchsorted(used, rel // 128))


def test_fp8_config_without_block_size_reads_128_blocks_as_transformers_does(tmp_path):
    """transformers' FineGrainedFP8Config fills in 128 x 128 when `weight_block_size` is absent;
    it was refused as per-tensor FP8 (hubkeys review). An explicit null (per-tensor) still is."""
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    shape = dict(e=2, h=137, i=40, r=131)  # over one block; odd, so no smaller block fits
    want, _ = write_fp8(tmp_path, block=(128, 128), qc=qc, **shape)
    model = meta_model("fp8", **shape)
    load_sharded(model, tmp_path, device="cpu")
    got = _state(model)
    for k in want:
        _exact(got[k], want[k], k)
    write_fp8(tmp_path, block=(128, 128), qc=qc | {"weight_block_size": None}, **shape)
    with pytest.raises(LoadError, match=r"per-tensor FP8 is not supported\), got None"):
        load_sharded(meta_model("fp8", **shape), tmp_path, device="cpu")


def test_fp8_key_read_only_in_part_is_refused_naming_its_file():
    """A quantized key the model takes only part of (q_proj's rows of a fused qkv_proj, a
    transposed key) cannot be dequantized by blocks; the error named the key but not its file."""
    from grouped_ep.loading.plan import Piece, Target
    from grouped_ep.loading.quant_formats import QuantConfig, is_quantized
    from grouped_ep.loading.safetensors import TensorEntry

    fused = TensorEntry(
        "qkv_proj.weight", "/ckpt/model-2.safetensors", torch.float8_e4m3fn, (24, 8), 0, 192
    )
    rows = Piece(fused, (0, 0), (8, 8), file_offset=(8, 0))
    target = Target(["k_proj.weight"], torch.empty(8, 8), True, [], pieces=[rows])
    cfg = QuantConfig("fp8", (8, 8), "/ckpt/config.json")
    with pytest.raises(
        LoadError, match=r"only in part .*/ckpt/model-2\.safetensors: 'qkv_proj\.weight'"
    ):
        is_quantized(cfg, target, {})
