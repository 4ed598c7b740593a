"""transformers' checkpoint conversion of a large tensor read off probes of a scaled-down shape
(`grouped_ep/loading/scaled.py`): the same layout as a probe at the real size, and real-size
expert stacks that a real-size probe could not plan (over its 2 GiB limit) are planned."""

from __future__ import annotations

import json
import math
import struct
import warnings

import pytest
import torch

import grouped_ep.loading.converted as converted
import grouped_ep.loading.scaled as scaled


def test_scale_factor_keeps_expert_dim_and_smallest_size():
    assert scaled.scalable_dims((8, 32768, 6144)) == [False, True, True]
    assert scaled.scalable_dims((4096, 40)) == [True, False]
    assert scaled.scale_factor([(8, 32768, 6144)]) == 128  # 6144 = 3 * 2**11: 48 rows left
    assert scaled.scale_factor([(256, 3072, 1536)]) == 32
    assert scaled.scale_factor([(8, 40, 40)]) == 1
    assert scaled.scaled((8, 32768, 6144), 128) == (8, 256, 48)


def test_layouts_that_do_not_double_are_not_grown():
    """An interleaved split (gate rows at even indices) gives runs of one row at every scale:
    not a layout that grows with the shape."""
    shape = (2, 256, 64)
    small = [
        ("k", (0, i, 0), (2, 1, 32), (2, 64, 32), (0, i // 2, 0), (0, 1, 2)) for i in range(64)
    ]
    double = [
        ("k", (0, i, 0), (2, 1, 64), (2, 128, 64), (0, i // 2, 0), (0, 1, 2)) for i in range(128)
    ]
    assert scaled.grown(small, double, shape, 4) is None
    # a stack of two halves does grow: [2, 2I, H] from [2, I, H] keys "g" and "u"
    small = [
        ("g", (0, 0, 0), (2, 32, 16), (2, 32, 16)),
        ("u", (0, 32, 0), (2, 32, 16), (2, 32, 16)),
    ]
    double = [
        ("g", (0, 0, 0), (2, 64, 32), (2, 64, 32)),
        ("u", (0, 64, 0), (2, 64, 32), (2, 64, 32)),
    ]
    assert scaled.grown(small, double, shape, 4) == [
        ("g", (0, 0, 0), (2, 128, 64), (2, 128, 64)),
        ("u", (0, 128, 0), (2, 128, 64), (2, 128, 64)),
    ]
    # a fixed split at row 16 (not a half) does not
    small = [
        ("g", (0, 0, 0), (2, 16, 16), (2, 16, 16)),
        ("u", (0, 16, 0), (2, 48, 16), (2, 48, 16)),
    ]
    double = [
        ("g", (0, 0, 0), (2, 16, 32), (2, 16, 32)),
        ("u", (0, 16, 0), (2, 112, 32), (2, 112, 32)),
    ]
    assert scaled.grown(small, double, shape, 4) is None


# Families whose expert stacks are stored per expert, split, transposed or fused with other
# tensors, and two whose conversions do not scale (gpt_oss interleaves gate and up rows).
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "ernie4_5_vl_moe", "granitemoe", "gpt_oss",
            "qwen3_omni_moe", "inkling2_loop"]  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_scaled_probe_equals_a_real_size_probe(name, monkeypatch):
    """Every tensor of a tiny model of the family, its layout probed with the scaled probe
    forced (thresholds lowered to the tiny sizes) against the probe at its real size. A sweep of
    all 65 families the tests build (2026-11-26): 2757 tensors, none different, 839 of them
    from a scaled probe."""
    from _hf_families import build, family

    model = build(family(name))
    grown = []
    real_grown = scaled.grown

    def recording(small, double, shape, f):
        layout = real_grown(small, double, shape, f)
        grown.append(layout is not None)
        return layout

    monkeypatch.setattr(scaled, "grown", recording)
    for tensor, value in model.state_dict().items():
        shape = tuple(value.shape)
        monkeypatch.setattr(converted, "_SCALE_ABOVE", 1 << 62)
        monkeypatch.setattr(scaled, "_SMALLEST", 32)
        want = converted._probed_layout(model, tensor, shape)
        monkeypatch.setattr(converted, "_SCALE_ABOVE", -1)
        monkeypatch.setattr(scaled, "_SMALLEST", 4)
        assert converted._probed_layout(model, tensor, shape) == want, tensor
    if name != "gpt_oss":
        assert any(grown), "no layout came from a scaled probe"


def _header_only_checkpoint(path, shapes: dict[str, list[int]]):
    """A safetensors file with `shapes` (bf16) in its header and a sparse hole for data."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        n = 2 * math.prod(shape)
        header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


@pytest.mark.parametrize(
    "config",
    [  # Mixtral-8x22B and MiniMax-M2 layer sizes: probes of 3 and 4.5 GiB at the real size
        dict(cls="Mixtral", hidden_size=6144, intermediate_size=16384, num_local_experts=8,
             num_attention_heads=48),
        dict(cls="MiniMaxM2", hidden_size=3072, intermediate_size=1536, num_local_experts=256,
             num_attention_heads=24, head_dim=128),
    ],
    ids=["mixtral-8x22b", "minimax-m2"],
)  # fmt: skip
def test_real_size_per_expert_stacks_are_planned(config, tmp_path):
    """The Hub's Mixtral-8x22B and MiniMax-M2 store experts as per-expert w1/w3/w2 keys. A probe
    of their real-size stacks is over the probe limit, and without key_map= these tensors had
    "no checkpoint key". Planned from scaled probes: each expert's w1 and w3 rows, in place."""
    import transformers

    from grouped_ep.loading.keys import resolve_pieces
    from grouped_ep.loading.safetensors import open_checkpoint

    config = dict(config)
    cls = config.pop("cls")
    cfg = getattr(transformers, f"{cls}Config")(
        num_hidden_layers=1, num_key_value_heads=8, vocab_size=64, **config
    )
    with torch.device("meta"):
        model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    experts = model.model.layers[0].mlp.experts
    e, rows, h = experts.gate_up_proj.shape
    i = rows // 2
    prefix = "model.layers.0.block_sparse_moe.experts"
    shapes = {}
    for x in range(e):
        shapes |= {f"{prefix}.{x}.w1.weight": [i, h], f"{prefix}.{x}.w3.weight": [i, h]}
        shapes[f"{prefix}.{x}.w2.weight"] = [h, i]
    _header_only_checkpoint(tmp_path, shapes)
    ckpt = open_checkpoint(tmp_path)
    with converted.conversions_cached(model), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not probed" warning
        gate_up = resolve_pieces(
            ["model.layers.0.mlp.experts.gate_up_proj"], (e, rows, h), ckpt, "auto", model=model
        )
        down = resolve_pieces(
            ["model.layers.0.mlp.experts.down_proj"], (e, h, i), ckpt, "auto", model=model
        )
    want = {
        (f"{prefix}.{x}.{w}.weight", (x, j * i, 0), (1, i, h))
        for x in range(e)
        for j, w in enumerate(("w1", "w3"))
    }
    assert {(p.entry.key, tuple(p.offset), tuple(p.shape)) for p in gate_up} == want
    assert {(p.entry.key, tuple(p.offset)) for p in down} == {
        (f"{prefix}.{x}.w2.weight", (x, 0, 0)) for x in range(e)
    }


def test_scaled_probe_load_equals_from_pretrained(tmp_path, monkeypatch):
    """A per-expert (w1/w3/w2) Mixtral checkpoint loaded with every conversion read off scaled
    probes (thresholds lowered to the tiny sizes): bit-equal to from_pretrained."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from grouped_ep import load_sharded

    cfg = MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    monkeypatch.setattr(converted, "_SCALE_ABOVE", -1)
    monkeypatch.setattr(scaled, "_SMALLEST", 4)
    grown = []
    real_grown = scaled.grown
    monkeypatch.setattr(scaled, "grown", lambda *a: grown.append(real_grown(*a)) or grown[-1])
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    report = load_sharded(model, tmp_path, device="cpu")
    assert report.missing == [] and report.unused_keys == []
    assert any(layout is not None for layout in grown)
    ref = MixtralForCausalLM.from_pretrained(tmp_path)
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_skipped_probe_warns_only_for_tensors_left_without_keys(tmp_path, monkeypatch):
    """A probe over the limit (scaled probes off here) warns that key_map= may be needed; it
    warned for every such tensor, also those found next (gpt-oss-120b's MXFP4 stacks: 72
    warnings for a load that needed nothing). Now only for tensors that end without keys."""
    from _hf_families import build, family

    from grouped_ep import load_sharded

    monkeypatch.setattr(converted, "_SCALE_ABOVE", 1 << 62)
    monkeypatch.setattr(converted, "_PROBE_LIMIT", 0)
    for name, left in (("qwen3_moe", False), ("mixtral", True)):
        model = build(family(name))
        model.save_pretrained(tmp_path / name)  # per-expert keys: gate_proj or w1/w3/w2
        with torch.device("meta"):
            fresh = type(model)(model.config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = load_sharded(fresh, tmp_path / name, device="cpu", strict=False)
        said = [str(w.message) for w in caught if "is not probed" in str(w.message)]
        # qwen3_moe's are found under the generic per-expert names; mixtral's w1/w3/w2 are not
        assert bool(report.missing) == left and bool(said) == left, (name, report.missing, said)
        assert all(any(m.removeprefix("model.") in s for m in report.missing) for s in said)
