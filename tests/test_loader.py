"""load_sharded in one process: planning math, layouts, casts, errors, the native reader."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from _ckpt_helpers import (
    from_pretrained_state,
    meta_model,
    raw_safetensors,
    save_hf,
    tiny_mixtral_config,
    tiny_qwen3_moe_config,
    write_index,
    write_safetensors,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import grouped_ep
from grouped_ep import LoadError, load_sharded
from grouped_ep.loading import load as loader
from grouped_ep.loading import plan as sf
from grouped_ep.loading import read as loader_read

# ---- planning math ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 9, 17])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunk_matches_torch_chunk(n, parts):
    chunks = torch.chunk(torch.arange(n), parts) if n else ()
    for rank in range(parts):
        want = chunks[rank].numpy() if rank < len(chunks) else np.zeros(0)
        assert np.array_equal(sf._chunk(np.arange(n), parts, rank), want)


def _simulate(rows: np.ndarray, file: np.ndarray, out_nbytes: int) -> np.ndarray:
    """Execute planned ranges [N, 4] (file, src, dst, length) against an in-memory file."""
    out = np.full(out_nbytes, 255, np.uint8)
    for _, src, dst, length in rows:
        out[dst : dst + length] = file[src : src + length]
    return out


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    data=st.data(),
)
def test_piece_ranges_read_exactly_the_owned_elements(shape, data):
    """Random shapes, owned index runs per dim and a tiling of dim 0 into pieces: executing the
    planned ranges gives global[owned] and every byte is read once."""
    shape = tuple(shape)
    owned = []
    for n in shape:
        if data.draw(st.booleans()):
            owned.append(None)
        else:
            lo = data.draw(st.integers(0, n))
            hi = data.draw(st.integers(lo, n))
            owned.append(np.arange(lo, hi, dtype=np.int64))
    cuts = (
        sorted(set(data.draw(st.lists(st.integers(1, shape[0] - 1), max_size=3))))
        if shape[0] > 1
        else []
    )
    bounds = [0, *cuts, shape[0]]
    full = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    # The "file": pieces back to back after a 16-byte header.
    blob, pieces = bytearray(16), []
    for a, b in zip(bounds, bounds[1:]):
        part = full[a:b]
        entry = sf.TensorEntry(f"p{a}", "f", torch.int32, part.shape, len(blob), part.nbytes)
        blob += part.tobytes()
        pieces.append(sf.Piece(entry, (a,) + (0,) * (len(shape) - 1), part.shape))
    rs = [sf.piece_ranges(owned, shape, p) for p in pieces]
    rows = sf.coalesce(
        np.zeros(sum(len(r[0]) for r in rs), np.int64), *(np.concatenate(x) for x in zip(*rs))
    )
    lshape = sf.local_shape(shape, owned)
    want = full
    for d, o in enumerate(owned):
        if o is not None:
            want = np.take(want, o, axis=d)
    got = _simulate(rows, np.frombuffer(bytes(blob), np.uint8), want.nbytes)
    assert np.array_equal(got.view(np.int32).reshape(lshape), want)
    assert rows[:, 3].sum() == want.nbytes


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
)
def test_piece_that_is_part_of_its_key_reads_only_that_part(shape, data):
    """A model tensor held as a box of a larger checkpoint tensor (q_proj's rows of a fused
    qkv_proj), read for random owned indices: exactly global[owned], every byte once."""
    shape = tuple(shape)
    lead = [data.draw(st.integers(0, 3)) for _ in shape]
    trail = [data.draw(st.integers(0, 3)) for _ in shape]
    file_shape = tuple(a + n + b for a, n, b in zip(lead, shape, trail))
    big = np.arange(math.prod(file_shape), dtype=np.int32).reshape(file_shape)
    full = big[tuple(slice(a, a + n) for a, n in zip(lead, shape))]
    owned = []
    for n in shape:
        lo = data.draw(st.integers(0, n))
        owned.append(None if data.draw(st.booleans()) else np.arange(lo, n, dtype=np.int64))
    # the key may also be stored with its dims in another order (a transposed key)
    dims = tuple(data.draw(st.permutations(range(len(shape)))))
    big = np.ascontiguousarray(big.transpose(np.argsort(dims)))  # model dim d -> key dim dims[d]
    file_shape = big.shape
    entry = sf.TensorEntry("qkv", "f", torch.int32, file_shape, 24, big.nbytes)
    piece = sf.Piece(
        entry, (0,) * len(shape), shape, tuple(lead[i] for i in np.argsort(dims)), dims
    )
    src, dst, length = sf.piece_ranges(owned, shape, piece)
    rows = sf.coalesce(np.zeros(len(src), np.int64), src, dst, length)
    want = full
    for d, o in enumerate(owned):
        if o is not None:
            want = np.take(want, o, axis=d)
    blob = np.frombuffer(bytes(24) + big.tobytes(), np.uint8)
    got = _simulate(rows, blob, want.nbytes)
    assert np.array_equal(got.view(np.int32).reshape(want.shape), want)
    assert rows[:, 3].sum() == want.nbytes


def test_row_shard_is_one_range_and_columns_one_per_row():
    entry = sf.TensorEntry("w", "f", torch.float32, (8, 6), 100, 8 * 6 * 4)
    piece = sf.Piece(entry, (0, 0), (8, 6))
    src, dst, length = sf.piece_ranges([np.arange(2, 5), None], (8, 6), piece)
    assert (src.tolist(), dst.tolist(), length.tolist()) == ([100 + 2 * 24], [0], [3 * 24])
    src, _, length = sf.piece_ranges([None, np.arange(3, 6)], (8, 6), piece)
    assert len(src) == 8 and set(length.tolist()) == {12}
    # k_proj [8, 6] = rows 8:16 of a fused qkv_proj [24, 6]: rows 2:5 are still one range
    fused = sf.TensorEntry("qkv", "f", torch.float32, (24, 6), 100, 24 * 6 * 4)
    part = sf.Piece(fused, (0, 0), (8, 6), (8, 0))
    src, dst, length = sf.piece_ranges([np.arange(2, 5), None], (8, 6), part)
    assert (src.tolist(), dst.tolist(), length.tolist()) == ([100 + 10 * 24], [0], [3 * 24])
    # stored transposed ([6, 8] on disk): one element per range
    flipped = sf.TensorEntry("wT", "f", torch.float32, (6, 8), 100, 8 * 6 * 4)
    part = sf.Piece(flipped, (0, 0), (8, 6), (0, 0), (1, 0))
    src, dst, length = sf.piece_ranges([np.arange(2, 3), None], (8, 6), part)
    assert src.tolist() == [100 + (j * 8 + 2) * 4 for j in range(6)] and set(length) == {4}


def test_owned_indices_of_plain_tensor_is_everything():
    assert sf.owned_indices(torch.zeros(3, 4), "x") == [None, None]


# ---- layouts written by transformers -----------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    path = save_hf(tmp_path_factory.mktemp("qwen"), tiny_qwen3_moe_config(experts=12), seed=3)
    return path, from_pretrained_state(path)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def test_qwen3_moe_save_pretrained_into_meta_model(qwen_ckpt):
    path, ref = qwen_ckpt
    names = sorted(os.listdir(path))
    assert (
        "model.safetensors.index.json" in names
        and sum(n.endswith(".safetensors") for n in names) > 2
    )
    model = meta_model(tiny_qwen3_moe_config(experts=12))
    report = load_sharded(model, path, device="cpu")
    state = _state(model)
    assert state.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(state[k], v), k
    assert report.bytes_read == report.bytes_owned == sum(v.numel() * 4 for v in ref.values())
    assert report.unused_keys == [] and report.missing == []
    assert report.files_opened == report.headers_parsed > 2
    p = model.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.device.type == "cpu"


def test_hugging_face_cache_layout_with_symlinked_shards(qwen_ckpt, tmp_path):
    # snapshot_download's layout: every file of snapshots/<rev>/ is a symlink to ../../blobs/<sha>,
    # outside the snapshot directory. The index names plain files of the snapshot: it loads.
    path, ref = qwen_ckpt
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(path))):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes((path / name).read_bytes())
        (snap / name).symlink_to(f"../../blobs/blob{i}")
    model = meta_model(tiny_qwen3_moe_config(experts=12))
    load_sharded(model, snap, device="cpu")
    state = _state(model)
    for k, v in ref.items():
        assert torch.equal(state[k], v), k


def test_single_file_beside_an_index_is_read_as_transformers_does(tmp_path):
    # from_pretrained reads model.safetensors when a directory has both it and an index.
    from safetensors.torch import save_file

    state = _fused_state()
    write_index(tmp_path, {k: "s1.safetensors" for k in state})
    save_file({k: v + 1 for k, v in state.items()}, str(tmp_path / "s1.safetensors"))
    save_file(state, str(tmp_path / "model.safetensors"))
    model = _fused_model()
    load_sharded(model, tmp_path)
    for k, v in _state(model).items():
        assert torch.equal(v, state[k]), k


def test_numeric_expert_order(tmp_path):
    """Expert 10 goes to row 10, not after expert 1 (no string sort of expert ids)."""
    e, inter, hidden = 12, 3, 4
    tensors = {}
    for i in range(e):
        for w, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            sign = -1.0 if w == "up_proj" else 1.0
            tensors[f"l.mlp.experts.{i}.{w}.weight"] = torch.full(shape, sign * i)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    m = nn.Module()
    m.l = nn.Module()
    m.l.mlp = nn.Module()
    m.l.mlp.experts = nn.Module()
    m.l.mlp.experts.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * inter, hidden))
    m.l.mlp.experts.down_proj = nn.Parameter(torch.zeros(e, hidden, inter))
    load_sharded(m, tmp_path)
    for i in range(e):
        assert torch.all(m.l.mlp.experts.gate_up_proj[i, :inter] == i)
        assert torch.all(m.l.mlp.experts.gate_up_proj[i, inter:] == -i)
        assert torch.all(m.l.mlp.experts.down_proj[i] == i)


def test_mixtral_save_pretrained_w1_w2_w3(tmp_path):
    config = tiny_mixtral_config()
    path = save_hf(tmp_path, config, seed=4)
    ref = from_pretrained_state(path)
    model = meta_model(config)
    report = load_sharded(model, path, device="cpu")
    for k, v in ref.items():
        assert torch.equal(_state(model)[k], v), k
    assert report.unused_keys == [] and report.missing == []


def test_bf16_file_into_fp32_model_meta_and_materialized(tmp_path):
    config = tiny_qwen3_moe_config(experts=4, layers=1)
    path = save_hf(tmp_path, config, seed=5, dtype=torch.bfloat16)
    ref = from_pretrained_state(path)
    for model in (meta_model(config), meta_model(config).to_empty(device="cpu")):
        report = load_sharded(model, path, device="cpu")
        for k, v in ref.items():
            got = _state(model)[k]
            assert got.dtype == torch.float32 and torch.equal(got, v.float()), k
        assert report.bytes_read == report.bytes_owned == sum(v.numel() * 2 for v in ref.values())


def _fused_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "m.experts.gate_up_proj": torch.randn(5, 6, 4, generator=g),
        "m.experts.down_proj": torch.randn(5, 4, 3, generator=g),
        "m.norm": torch.randn(4, generator=g),
    }


def _fused_model() -> nn.Module:
    root = nn.Module()
    root.m = nn.Module()
    root.m.experts = nn.Module()
    root.m.experts.gate_up_proj = nn.Parameter(torch.zeros(5, 6, 4))
    root.m.experts.down_proj = nn.Parameter(torch.zeros(5, 4, 3))
    root.m.register_buffer("norm", torch.zeros(4))
    root.m.register_buffer("scratch", torch.zeros(2), persistent=False)
    return root


def test_fused_3d_keys_single_file_path(tmp_path):
    state = _fused_state()
    f = write_safetensors(tmp_path / "weights.safetensors", state)
    model = _fused_model()
    report = load_sharded(model, f)
    for k, v in state.items():
        assert torch.equal(_state(model)[k], v), k
    assert report.tensors_loaded == 3 and report.missing == []


def test_split_3d_gate_up_keys(tmp_path):
    state = _fused_state()
    gate, up = state.pop("m.experts.gate_up_proj").chunk(2, dim=1)
    state |= {"m.experts.gate_proj": gate, "m.experts.up_proj": up}
    write_safetensors(tmp_path / "model.safetensors", state)
    model = _fused_model()
    load_sharded(model, tmp_path)
    assert torch.equal(model.m.experts.gate_up_proj.detach(), torch.cat([gate, up], 1))


def test_key_map_callable_mapping_and_unused(tmp_path):
    state = _fused_state()
    renamed = {
        "a": state["m.experts.gate_up_proj"],
        "norm_w": state["m.norm"],
        "extra": torch.ones(1),
    }
    renamed |= {f"d{i}": state["m.experts.down_proj"][i] for i in range(5)}
    write_safetensors(tmp_path / "model.safetensors", renamed)
    table = {"m.experts.gate_up_proj": "a", "m.norm": "norm_w"}
    table["m.experts.down_proj"] = [f"d{i}" for i in range(5)]
    for key_map in (table, table.get):
        model = _fused_model()
        report = load_sharded(model, tmp_path, key_map=key_map)
        for k, v in state.items():
            assert torch.equal(_state(model)[k], v), k
        assert report.unused_keys == ["extra"]


def test_missing_keys_raise_when_strict_else_reported_and_left(tmp_path):
    state = _fused_state()
    write_safetensors(tmp_path / "model.safetensors", {"m.norm": state["m.norm"]})
    model = _fused_model()
    with pytest.raises(
        LoadError,
        match=r"no checkpoint key for 2 tensor\(s\) of the model \(0 of them on meta\): m.experts.gate_up_proj, m.experts.down_proj",
    ):
        load_sharded(model, tmp_path, key_map=None)
    assert torch.all(model.m.norm == 0)  # the strict check runs before anything is read
    report = load_sharded(model, tmp_path, key_map=None, strict=False)
    assert report.missing == ["m.experts.gate_up_proj", "m.experts.down_proj"]
    assert torch.equal(model.m.norm, state["m.norm"])
    assert torch.all(model.m.experts.down_proj == 0)


@pytest.mark.parametrize("form", ["key", "list"])
def test_key_map_naming_an_absent_key_is_an_error(tmp_path, form):
    # A key the user names is checked whether it comes alone or in a list, and nothing is read.
    state = _fused_state()
    write_safetensors(tmp_path / "model.safetensors", state)
    typo = "m.experts.down_prj"
    value = typo if form == "key" else [typo] + [f"d{i}" for i in range(4)]
    model = _fused_model()
    with pytest.raises(
        LoadError, match=rf"missing key '{typo}' \(key_map for 'm.experts.down_proj'\)"
    ):
        load_sharded(model, tmp_path, key_map={"m.experts.down_proj": value})
    assert all(torch.all(t == 0) for t in _state(model).values())


def test_key_map_entry_naming_no_model_tensor_is_an_error(tmp_path):
    # A mapping entry for a name the model does not have (a typo) used to be ignored, the tensor
    # it meant loaded from its own key: now a LoadError naming the entry, nothing read.
    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    model = _fused_model()
    with pytest.raises(
        LoadError,
        match=r"key_map names no tensor of the model: 'm.experts.down_proj.weight' "
        r"\(did you mean 'm.experts.down_proj'\?\)",
    ):
        load_sharded(model, tmp_path, key_map={"m.experts.down_proj.weight": "m.experts.up"})
    assert all(torch.all(t == 0) for t in _state(model).values())


def test_per_expert_keys_of_an_experts_module_at_the_top(tmp_path):
    # A bare experts module (names `experts.gate_up_proj`, no prefix) finds `experts.{i}....` keys.
    state = _fused_state()
    keys = {}
    for i in range(5):
        gate, up = state["m.experts.gate_up_proj"][i].chunk(2)
        keys |= {f"experts.{i}.gate_proj.weight": gate, f"experts.{i}.up_proj.weight": up}
        keys[f"experts.{i}.down_proj.weight"] = state["m.experts.down_proj"][i]
    write_safetensors(tmp_path / "model.safetensors", keys)
    model = _fused_model().m
    del model.norm
    report = load_sharded(model, tmp_path)
    assert torch.equal(model.experts.gate_up_proj, state["m.experts.gate_up_proj"])
    assert torch.equal(model.experts.down_proj, state["m.experts.down_proj"])
    assert report.missing == [] and report.unused_keys == []


def test_progress_bar_flag(tmp_path, capsys):
    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    load_sharded(_fused_model(), tmp_path, progress=True)
    assert "load_sharded:" in capsys.readouterr().err
    load_sharded(_fused_model(), tmp_path, progress=False)
    assert capsys.readouterr().err == ""


# ---- bad input: LoadError naming the file and key, nothing modified ----------------------------


def _expect(match: str, model, path, **kw):
    before = {k: v.clone() for k, v in _state(model).items()}
    with pytest.raises(LoadError, match=match):
        load_sharded(model, path, **kw)
    for k, v in _state(model).items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed load"


def test_error_missing_expert_key(tmp_path):
    state = _fused_state()
    per = {f"m.experts.{i}.down_proj.weight": state["m.experts.down_proj"][i] for i in range(5)}
    del per["m.experts.3.down_proj.weight"]
    write_safetensors(tmp_path / "model.safetensors", per)
    _expect(r"missing key 'm\.experts\.3\.down_proj\.weight'.*4 of the 5", _fused_model(), tmp_path)


def test_expert_key_of_a_dtype_not_read_is_named_with_it(tmp_path):
    """It was 'missing key ...: the checkpoint has 4 of the 5 keys' for a key that is there, in a
    dtype this loader does not know (a review)."""
    import json
    import struct

    state = _fused_state()
    per = {f"m.experts.{i}.down_proj.weight": state["m.experts.down_proj"][i] for i in range(5)}
    path = write_safetensors(tmp_path / "model.safetensors", per)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["m.experts.3.down_proj.weight"]["dtype"] = "F4"
    raw_safetensors(path, header, raw[8 + n :])
    _expect(
        r"'m\.experts\.3\.down_proj\.weight', one of the 5 keys that make up "
        r"'m\.experts\.down_proj' \[5, 4, 3\], is in a dtype this loader cannot read \(F4\)",
        _fused_model(),
        tmp_path,
        key_map="auto",
        strict=False,
    )


def test_error_shape_and_dtype_mismatch(tmp_path):
    state = _fused_state()
    write_safetensors(tmp_path / "a.safetensors", state | {"m.norm": torch.zeros(5)})
    _expect(
        r"a\.safetensors: shape mismatch for 'm\.norm': the model's tensor is \[4\], the file has "
        r"\[5\] \(a model built from another config",
        _fused_model(),
        tmp_path / "a.safetensors",
    )
    write_safetensors(
        tmp_path / "b.safetensors", state | {"m.norm": torch.zeros(4, dtype=torch.int32)}
    )
    _expect(
        r"b\.safetensors: dtype mismatch for 'm\.norm'", _fused_model(), tmp_path / "b.safetensors"
    )


def test_error_missing_shard_file_and_key_not_in_file(tmp_path):
    state = _fused_state()
    write_safetensors(tmp_path / "s1.safetensors", {"m.norm": state["m.norm"]})
    write_index(tmp_path, {"m.norm": "s1.safetensors", "m.experts.down_proj": "s2.safetensors"})
    _expect(r"shard file 's2\.safetensors'.*not found", _fused_model(), tmp_path)
    # Listed in a shard that lacks it, and in no other: left out, with a warning; the model
    # needs it, so the load still fails on it.
    write_index(tmp_path, {"m.norm": "s1.safetensors", "m.experts.down_proj": "s1.safetensors"})
    with pytest.warns(UserWarning, match=r"'m\.experts\.down_proj' \(in no shard: left out\)"):
        _expect(r"no checkpoint key for .*m\.experts\.down_proj", _fused_model(), tmp_path)


def test_index_entries_that_miss_their_shard_read_as_transformers_reads_them(tmp_path):
    """An index that names the wrong shard for a key, or a stale entry for a key no shard holds:
    transformers' from_pretrained loads such checkpoints (the key from the shard that holds it;
    the stale entry ignored), so load_sharded does too, and says so (hubkeys review)."""
    state = _fused_state()
    write_safetensors(tmp_path / "s1.safetensors", {"m.norm": state["m.norm"]})
    rest = {k: v for k, v in state.items() if k != "m.norm"}
    write_safetensors(tmp_path / "s2.safetensors", rest)
    listed = {"m.norm": "s1.safetensors", "m.experts.down_proj": "s1.safetensors"}  # wrong file
    listed |= {"m.experts.gate_up_proj": "s2.safetensors", "rotary.inv_freq": "s2.safetensors"}
    write_index(tmp_path, listed)
    model = _fused_model()
    with pytest.warns(UserWarning) as caught:
        report = load_sharded(model, tmp_path)
    (warning,) = [w for w in caught if "index" in str(w.message)]
    message = str(warning.message)
    assert warning.filename == __file__  # at the caller's line
    assert "2 key(s) are not in the shard the index names" in message
    assert "'m.experts.down_proj' (read from s2.safetensors)" in message
    assert "'rotary.inv_freq' (in no shard: left out)" in message
    for k, v in state.items():
        assert torch.equal(_state(model)[k], v), k
    assert report.unused_keys == []


def test_error_names_the_expert_key_of_another_dtype_and_its_file(tmp_path):
    # The odd key is rarely among the first few of a stack: it and its file are named.
    state = _fused_state()
    per = {f"m.experts.{i}.down_proj.weight": state["m.experts.down_proj"][i] for i in range(5)}
    per["m.experts.4.down_proj.weight"] = per["m.experts.4.down_proj.weight"].to(torch.int32)
    write_safetensors(tmp_path / "model.safetensors", per)
    _expect(
        r"m\.experts\.down_proj: the checkpoint keys stacked into it must share one dtype; 4 of "
        r"5 are torch\.float32, but .*model\.safetensors: 'm\.experts\.4\.down_proj\.weight' "
        r"is torch\.int32",
        _fused_model(),
        tmp_path,
    )


def test_error_shard_path_that_is_a_directory(tmp_path):
    state = _fused_state()
    write_safetensors(tmp_path / "s1.safetensors", {"m.norm": state["m.norm"]})
    (tmp_path / "s2.safetensors").mkdir()
    write_index(tmp_path, {"m.norm": "s1.safetensors", "m.experts.down_proj": "s2.safetensors"})
    _expect(r"shard file 's2\.safetensors'.* is a directory, not a file", _fused_model(), tmp_path)


def _valid_raw(tmp_path):
    t = torch.arange(6, dtype=torch.float32)
    header = {
        "m.norm": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
    }
    return header, t.numpy().tobytes()


@pytest.mark.parametrize(
    "case, match",
    [
        ("truncated", r"out of range.*truncated"),
        ("header_too_long", r"header length \d+ is larger than the file"),
        ("offsets_out_of_range", r"'x': data_offsets \[16, 32\] out of range"),
        ("overlap", r"'x' at \[8, 16\) overlaps tensor 'm\.norm'"),
        ("gap", r"not contiguous: gap \[16, 20\) before tensor 'x'"),
        ("bad_json", r"header is not valid JSON"),
        ("dtype_not_a_string", r"'x': dtype must be a string, got 33"),
        ("short_file", r"truncated file"),
        ("metadata_not_strings", r"__metadata__ must be an object of strings"),
        ("metadata_a_list", r"__metadata__ must be an object of strings"),
    ],
)
def test_error_corrupt_files(tmp_path, case, match):
    header, data = _valid_raw(tmp_path)
    path = tmp_path / f"{case}.safetensors"
    if case == "truncated":
        raw_safetensors(path, header, data[:-4])
    elif case == "header_too_long":
        raw_safetensors(path, header, data, length=10_000)
    elif case == "offsets_out_of_range":
        header["x"] = {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}
        raw_safetensors(path, header, data)
    elif case == "overlap":
        header["x"]["data_offsets"] = [8, 16]
        raw_safetensors(path, header, data)
    elif case == "gap":
        header["x"]["data_offsets"] = [20, 28]
        raw_safetensors(path, header, data + bytes(4))
    elif case == "bad_json":
        raw_safetensors(path, b'{"m.norm": {"dtype": "F32",', data)
    elif case == "dtype_not_a_string":
        header["x"]["dtype"] = 33
        raw_safetensors(path, header, data)
    elif case == "short_file":
        path.write_bytes(b"\x01\x00")
    elif case.startswith("metadata"):
        header["__metadata__"] = (
            {"format": "pt", "epoch": 3} if case == "metadata_not_strings" else []
        )
        raw_safetensors(path, header, data)
    _expect(match, _fused_model(), path)
    _expect(str(path.name), _fused_model(), path)


def test_read_error_midway_leaves_model_untouched(tmp_path, monkeypatch):
    """A file that shrinks after planning: the native read fails naming the file and offset;
    nothing was swapped in (materialized tensors keep their values, meta ones stay meta)."""
    state = _fused_state()
    write_safetensors(tmp_path / "s1.safetensors", {"m.norm": state["m.norm"]})
    write_safetensors(
        tmp_path / "s2.safetensors", {k: v for k, v in state.items() if k != "m.norm"}
    )
    write_index(
        tmp_path,
        {
            "m.norm": "s1.safetensors",
            "m.experts.gate_up_proj": "s2.safetensors",
            "m.experts.down_proj": "s2.safetensors",
        },
    )
    real = loader.open_checkpoint

    def open_then_truncate(path):
        ckpt = real(path)
        victim = tmp_path / "s2.safetensors"
        os.truncate(victim, victim.stat().st_size - 8)
        return ckpt

    monkeypatch.setattr(loader, "open_checkpoint", open_then_truncate)
    _expect(
        r"s2\.safetensors: the file changed since its header was read .*load again",
        _fused_model(),
        tmp_path,
    )
    write_safetensors(
        tmp_path / "s2.safetensors", {k: v for k, v in state.items() if k != "m.norm"}
    )
    with torch.device("meta"):
        model = _fused_model()
    del model.m.scratch  # a meta buffer no checkpoint holds: its own error (tested elsewhere)
    with pytest.raises(LoadError, match="s2.safetensors"):
        load_sharded(model, tmp_path, device="cpu")
    assert all(t.is_meta for t in model.state_dict().values())


def test_file_replaced_after_its_header_was_read_is_refused(tmp_path, monkeypatch):
    """A writer's save-then-rename between planning and reading: the new file's bytes at the old
    header's offsets would load as a mix of two tensors. The reader checks each file is the one
    whose header was read (device, inode, size, modification time)."""
    write_safetensors(tmp_path / "model.safetensors", _fused_state(0))
    real = loader.open_checkpoint

    def open_then_replace(path):
        ckpt = real(path)
        other = tmp_path / "tmp.safetensors"
        write_safetensors(other, _fused_state(1))  # same shapes, same size, new values
        os.replace(other, tmp_path / "model.safetensors")
        return ckpt

    monkeypatch.setattr(loader, "open_checkpoint", open_then_replace)
    _expect(
        r"model\.safetensors: the file changed since its header was read", _fused_model(), tmp_path
    )
    monkeypatch.undo()  # the replaced file, read from its own header, loads whole
    model = _fused_model()
    load_sharded(model, tmp_path)
    assert torch.equal(model.m.experts.down_proj, _fused_state(1)["m.experts.down_proj"])


@pytest.mark.parametrize("case", ["inference_tensor", "expanded_buffer"])
def test_destination_that_cannot_take_a_copy_is_refused_before_reading(tmp_path, case):
    """A materialized model tensor that an in-place copy cannot write (an inference tensor
    outside inference mode, a buffer whose elements share memory) used to fail halfway through
    the copies into the model, leaving some tensors loaded and the rest not."""
    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    if case == "inference_tensor":
        with torch.inference_mode():
            model = _fused_model()
        match = r"'m\.(norm|experts\.\w+)' is an inference tensor .* nothing was read"
    else:
        model = _fused_model()
        model.m.norm = torch.zeros(1).expand(4)
        match = r"'m\.norm' has elements that share memory .* nothing was read"
    _expect(match, model, tmp_path)
    if case == "inference_tensor":
        with torch.inference_mode():  # where it can be written, it loads
            load_sharded(model, tmp_path)
        assert torch.equal(model.m.norm, _fused_state()["m.norm"])


def test_dtypes_unknown_to_the_loader_fail_only_the_tensors_that_need_them(tmp_path):
    """Keys of a dtype the loader does not know (a newer format) are listed as unused when the
    model has no place for them; a tensor that needs one is an error naming the key and dtype.
    complex64 and the FNUZ float8 formats, which safetensors writes, are read."""
    state = _fused_state()
    state["freqs_cis"] = torch.polar(torch.ones(3), torch.arange(3.0))
    state["fnuz"] = torch.ones(2).to(torch.float8_e4m3fnuz)
    write_safetensors(tmp_path / "model.safetensors", state)
    model = _fused_model()
    report = load_sharded(model, tmp_path)
    assert report.unused_keys == ["fnuz", "freqs_cis"]
    header, data = _valid_raw(tmp_path)
    header["x"]["dtype"] = "F33"
    path = tmp_path / "new.safetensors"
    raw_safetensors(path, header, data)
    plain = nn.Module()
    plain.register_buffer("norm", torch.zeros(4))
    plain.register_buffer("x", torch.zeros(2))
    plain_report = load_sharded(plain, path, key_map={"norm": "m.norm"}, strict=False)
    assert plain_report.missing == ["x"] and plain_report.unused_keys == ["x"]
    _expect(
        r"no checkpoint key for 1 tensor.*: x\. .*holds 1 key\(s\) in a dtype this loader "
        r"cannot read: 'x' \(F33\)",
        plain,
        path,
        key_map={"norm": "m.norm"},
    )
    solo = nn.Module()
    solo.register_buffer("norm", torch.zeros(4))
    assert load_sharded(solo, path, key_map={"norm": "m.norm"}).unused_keys == ["x"]


def test_a_named_pipe_in_the_checkpoint_folder_is_not_waited_on(tmp_path):
    """A FIFO named `*.safetensors` (or any non-regular file) is not a checkpoint file: the only
    one in a folder used to be opened, which blocks forever."""
    os.mkfifo(tmp_path / "model.safetensors")
    (tmp_path / "gone.safetensors").symlink_to(tmp_path / "nowhere")
    _expect(
        r"found 0 index files and 0 \.safetensors files; not read: gone\.safetensors \(a broken "
        r"link\), model\.safetensors \(not a regular file\)",
        _fused_model(),
        tmp_path,
    )
    _expect(r"is not a regular file", _fused_model(), tmp_path / "model.safetensors")
    other = tmp_path / "sub"
    other.mkdir()
    write_safetensors(other / "a.safetensors", {"m.norm": _fused_state()["m.norm"]})
    os.mkfifo(other / "b.safetensors")
    write_index(other, {"m.norm": "a.safetensors", "m.experts.down_proj": "b.safetensors"})
    _expect(r"'b\.safetensors'.* is not a regular file", _fused_model(), other)
    os.mkfifo(tmp_path / "x.safetensors.index.json")  # named directly
    _expect(
        r"x\.safetensors\.index\.json: is not a regular file",
        _fused_model(),
        tmp_path / "x.safetensors.index.json",
    )


def test_modification_times_past_2262_and_before_1970(tmp_path):
    """The file identity holds st_mtime_ns, which past 2262 does not fit an int64: it wraps on
    both sides (it was torch's argument error, naming neither file nor cause)."""
    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    for ns in (10**19, -(10**18)):
        os.utime(tmp_path / "model.safetensors", ns=(ns, ns))
        model = _fused_model()
        load_sharded(model, tmp_path)
        assert torch.equal(model.m.norm, _fused_state()["m.norm"])


def test_checkpoint_not_found(tmp_path, monkeypatch):
    _expect(r"checkpoint not found$", _fused_model(), tmp_path / "nope")
    monkeypatch.chdir(tmp_path)  # a Hub id, as README's AutoConfig.from_pretrained(path) takes
    _expect(
        r"not found; if it is a Hugging Face Hub id: .*snapshot_download",
        _fused_model(),
        "Qwen/Qwen3-30B-A3B",
    )
    (tmp_path / "empty").mkdir()
    _expect(
        r"expected model\.safetensors\.index\.json or a single", _fused_model(), tmp_path / "empty"
    )
    torch.save(_fused_model().state_dict(), tmp_path / "empty" / "pytorch_model.bin")
    _expect(
        r"pytorch_model\.bin is a pickled \(torch\.save\) checkpoint, which is not read",
        _fused_model(),
        tmp_path / "empty",
    )


# ---- the native reader ---------------------------------------------------------------------------


def test_read_ranges_op_checks_plan(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(bytes(range(64)))
    out = torch.zeros(8, dtype=torch.uint8)
    plan = torch.tensor([[0, 0, 4, 0, 4], [0, 0, 40, 4, 4]])
    assert torch.ops.grouped_ep.read_ranges([str(f)], [out], plan, 2) == 8
    assert out.tolist() == [4, 5, 6, 7, 40, 41, 42, 43]
    with pytest.raises(RuntimeError, match="writes bytes \\[6, 10\\) of outs\\[0\\], which has 8"):
        torch.ops.grouped_ep.read_ranges([str(f)], [out], torch.tensor([[0, 0, 0, 6, 4]]), 2)
    with pytest.raises(RuntimeError, match="names file 1 but only 1 paths"):
        torch.ops.grouped_ep.read_ranges([str(f)], [out], torch.tensor([[1, 0, 0, 0, 4]]), 2)
    with pytest.raises(RuntimeError, match="cannot open .*missing"):
        torch.ops.grouped_ep.read_ranges([str(tmp_path / "missing")], [out], plan, 2)


def test_read_ranges_many_threads_large_ranges(tmp_path):
    """Ranges longer than the reader's chunk size, more threads than chunks, many small ranges."""
    data = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8)
    f = tmp_path / "big"
    f.write_bytes(data.numpy().tobytes())
    out = torch.empty_like(data)
    plan = torch.tensor([[0, 0, 0, 0, 17 << 20], [0, 0, 17 << 20, 17 << 20, 3 << 20]])
    assert torch.ops.grouped_ep.read_ranges([str(f)], [out], plan, 16) == 20 << 20
    assert torch.equal(out, data)
    small = torch.tensor([[0, 0, i * 7, i * 7, 7] for i in range(1000)])
    out.zero_()
    assert torch.ops.grouped_ep.read_ranges([str(f)], [out], small, 3) == 7000
    assert torch.equal(out[:7000], data[:7000]) and not out[7000:].any()


def test_public_exports():
    assert grouped_ep.load_sharded is load_sharded and issubclass(LoadError, ValueError)


# ---- staged reads: casts and GPU destinations through a bounded buffer -------------------------


def test_staged_cast_through_tiny_staging_buffer(tmp_path, monkeypatch):
    """A staging buffer smaller than one tensor (and not a multiple of the element size):
    every tensor is cut into windows, several windows share a fill, the result is exact."""
    state = {k: v.bfloat16() for k, v in _fused_state(seed=7).items()}
    write_safetensors(tmp_path / "model.safetensors", state)
    monkeypatch.setattr(loader_read, "_STAGING_BYTES", 90)
    model = _fused_model()
    report = load_sharded(model, tmp_path)
    for k, v in state.items():
        got = _state(model)[k]
        assert got.dtype == torch.float32 and torch.equal(got, v.float()), k
    assert report.bytes_read == report.bytes_owned == sum(v.nbytes for v in state.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_model_onto_cuda(tmp_path, monkeypatch, dtype):
    """Pinned double-buffered staging, non_blocking uploads (small buffer: many fills)."""
    state = _fused_state(seed=8)
    write_safetensors(tmp_path / "model.safetensors", state)
    monkeypatch.setattr(loader_read, "_STAGING_BYTES", 256)
    with torch.device("meta"):
        model = _fused_model().to(dtype)
    del model.m.scratch  # a meta buffer no checkpoint holds: its own error (tested elsewhere)
    load_sharded(model, tmp_path, device="cuda")
    for k, v in state.items():
        got = _state(model)[k]
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(got.cpu(), v.to(dtype)), k


def test_plain_model_load_does_not_import_transformers(tmp_path):
    """A plain torch model has no transformers key conversion to look up: load_sharded must not
    import transformers for it (the import takes seconds, once per rank process)."""
    import subprocess
    import sys
    import textwrap

    from safetensors.torch import save_file

    # Per-expert keys for a fused [E, H, I] parameter: the name is not in the checkpoint, so
    # the key rules run (the lookup of transformers' conversion among them).
    keys = {f"mlp.experts.{i}.down_proj.weight": torch.full((4, 3), float(i)) for i in range(2)}
    save_file(keys, str(tmp_path / "model.safetensors"))
    code = textwrap.dedent(
        f"""
        import sys, torch
        from grouped_ep import load_sharded
        model = torch.nn.Module()
        model.mlp = torch.nn.Module()
        model.mlp.experts = torch.nn.Module()
        model.mlp.experts.down_proj = torch.nn.Parameter(torch.empty(2, 4, 3, device="meta"))
        load_sharded(model, {str(tmp_path)!r}, device="cpu", progress=False)
        assert model.mlp.experts.down_proj[1].eq(1).all()
        print("transformers" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


class _Scaled(nn.Module):
    """Like Gemma's scaled embedding: a non-persistent buffer from a constructor argument with
    a default, which a rebuild from the kept arguments would silently get wrong."""

    def __init__(self, n: int, scale: float = 1.0):
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.zeros(n, 2))
        self.scalar_scale = scale
        self.scale = nn.Buffer(torch.tensor(scale), persistent=False)
        self.pos = nn.Buffer(torch.arange(n, dtype=torch.float32), persistent=False)


class _WithInit(nn.Module):
    """A transformers-style owner: `config` and `_init_weights(module)`, which also initializes
    parameters (here to 7), as transformers' does."""

    def __init__(self):
        super().__init__()
        self.config = {"scale": 8.0**0.5}
        self.emb = _Scaled(3, scale=self.config["scale"])

    def _init_weights(self, module):
        if isinstance(module, _Scaled):
            module.scale.fill_(module.scalar_scale)
            module.weight.fill_(7.0)


def test_buffers_from_init_weights_and_rebuild_never_touch_loaded_tensors():
    from grouped_ep.loading.buffers import fresh_buffers

    with torch.device("meta"):
        model = _WithInit()
    model.emb.weight = nn.Parameter(torch.full((3, 2), 0.5))  # "loaded"
    values = {name: v for _, name, v in fresh_buffers(model, "cpu")}
    # scale: from _init_weights (a rebuild gives the default 1.0); pos: _init_weights leaves it,
    # so the rebuild recomputes it
    assert values["scale"].item() == pytest.approx(8.0**0.5)
    assert torch.equal(values["pos"], torch.arange(3, dtype=torch.float32))
    assert torch.equal(model.emb.weight, torch.full((3, 2), 0.5))  # not re-initialized
    assert model.emb.scale.is_meta and model.emb.weight.device.type == "cpu"


def test_box_fast_path_equals_index_lists():
    # plan_target plans consecutive owned indices (Shard, Replicate) with interval arithmetic;
    # it must give exactly the ranges of the general index-list path, for whole keys and for
    # pieces that are a corner of a larger key, including empty intersections.
    import random

    from grouped_ep.loading.safetensors import TensorEntry

    rng = random.Random(0)
    nonempty = 0
    for _ in range(3000):
        nd = rng.randint(1, 4)
        gshape = tuple(rng.randint(1, 7) for _ in range(nd))
        owned = []
        for n in gshape:
            a = rng.randint(0, n)
            b = rng.randint(a, n)
            owned.append(None if rng.random() < 0.4 else np.arange(a, b, dtype=np.int64))
        off = tuple(rng.randint(0, n - 1) for n in gshape)
        shape = tuple(rng.randint(1, n - o) for n, o in zip(gshape, off))
        corner = None if rng.random() < 0.5 else tuple(rng.randint(0, 3) for _ in range(nd))
        fshape = (
            shape
            if corner is None
            else tuple(s + c + rng.randint(0, 3) for s, c in zip(shape, corner))
        )
        entry = TensorEntry("k", "f", torch.bfloat16, fshape, 1000, 2 * math.prod(fshape))
        piece = sf.Piece(entry, off, shape, corner)
        box = sf.owned_boxes(owned, gshape)
        assert box is not None
        slow = sf.piece_ranges(owned, gshape, piece)
        fast = sf.piece_ranges(owned, gshape, piece, box)
        for a, b in zip(slow, fast):
            assert np.array_equal(np.asarray(a, np.int64), np.asarray(b, np.int64)), (
                gshape,
                owned,
                piece,
            )
        nonempty += len(slow[0]) > 0
    assert nonempty > 500
    # Non-consecutive indices (_StridedShard) have no box: the index-list path plans them.
    assert sf.owned_boxes([np.array([0, 2, 4])], (6,)) is None


def test_bad_device_and_threads_are_named_before_anything_is_read(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    with torch.device("meta"):
        model = _fused_model()
    missing_gpu = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 on none)
    for device, message in (
        ("meta", "device='meta' cannot hold"),
        (missing_gpu, "CUDA device"),
        ("gpu", "load_sharded: device='gpu' is not a device"),
        (2.5, "load_sharded: device=2.5 is not a device"),
    ):
        with pytest.raises(ValueError, match=message):
            load_sharded(model, tmp_path, device=device)
    from grouped_ep.hf import init_nonpersistent_buffers

    for device, message in (("gpu", "is not a device"), (missing_gpu, "CUDA device")):
        with pytest.raises(ValueError, match=f"init_nonpersistent_buffers: device=.*{message}"):
            init_nonpersistent_buffers(model, device)
    for threads in (2.5, True, 0):
        with pytest.raises(ValueError, match=r"threads must be an int in \[1, 2\*\*31\)"):
            load_sharded(model, tmp_path, threads=threads, device="cpu")
    assert all(t.is_meta for t in model.parameters())
    # A materialized model ignores `device` (nothing goes there), as documented.
    report = load_sharded(_fused_model(), tmp_path, device="meta")
    assert report.tensors_loaded == 3


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, where):
    state = _fused_state()
    outside = write_safetensors(tmp_path / "x.safetensors", state)
    inner = tmp_path / "inner"
    inner.mkdir()
    name = "../x.safetensors" if where == "parent" else str(outside)
    write_index(inner, {k: name for k in state})
    with pytest.raises(LoadError, match=r"is not a file inside"):
        load_sharded(_fused_model(), inner)


def test_the_first_bad_file_name_in_index_order_is_named(tmp_path):
    """Which of two bad names the error named followed the string hash seed (a review): runs
    and ranks could name different keys. In a child per seed (the seed is fixed at start)."""
    import json

    index = {
        "metadata": {},
        "weight_map": {"a.weight": "../evil.safetensors", "b.weight": "/abs.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    from _child import child_error

    code = "import sys\nfrom grouped_ep.loading.safetensors import open_checkpoint\n"
    for seed in ("3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = child_error(code + "open_checkpoint(sys.argv[1])\n", str(tmp_path), env=env)
        assert "weight_map['a.weight'] = '../evil.safetensors'" in out, (seed, out)


def test_index_naming_a_key_twice_for_two_files_is_refused(tmp_path):
    """JSON keeps the last of two equal keys: the index's other file would be silently ignored."""
    state = _fused_state()
    write_safetensors(tmp_path / "a.safetensors", state)
    write_safetensors(tmp_path / "b.safetensors", state)
    key = next(iter(state))
    entries = [f'"{k}": "a.safetensors"' for k in state] + [f'"{key}": "b.safetensors"']
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(entries) + "}}"
    )
    with pytest.raises(
        LoadError, match=rf"index.json: key '{key}' is listed twice, for 'a.safetensors' and 'b"
    ) as error:
        load_sharded(_fused_model(), tmp_path)
    assert "not valid JSON" not in str(error.value)
    # The same file twice is harmless and loads.
    entries[-1] = f'"{key}": "a.safetensors"'
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(entries) + "}}"
    )
    assert load_sharded(_fused_model(), tmp_path).tensors_loaded == 3


def test_file_cut_after_its_header_was_read_names_the_tensor(tmp_path, monkeypatch):
    """A file that shrinks while it is read (seen by the reader as an early end of file; a change
    before the read is refused by its identity check, tested above): the reader's error gives a
    byte offset; the tensor stored there is named too, found from the file's known path, which
    may hold ': ' (the path used to be cut at the first one, and the tensor went unnamed)."""
    import grouped_ep.loading.load as load_module

    (tmp_path / "run: 3").mkdir()
    path = write_safetensors(tmp_path / "run: 3" / "model.safetensors", _fused_state())
    read_direct = load_module.read_direct

    def cut_then_read(targets, files, *args):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 8])
        for f in files:  # the change lands after the reader's identity check
            f.identity = None
        return read_direct(targets, files, *args)

    monkeypatch.setattr(load_module, "read_direct", cut_then_read)
    model = _fused_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        LoadError,
        match=r"run: 3/model.safetensors: unexpected end of file at offset \d+ .*\(in tensor '",
    ):
        load_sharded(model, tmp_path / "run: 3")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "kwargs", [{"strict": None}, {"strict": "no"}, {"dequantize": 0}, {"progress": "no"}]
)
def test_flags_must_be_bools(tmp_path, kwargs):
    # strict=None loaded a partial model (None is falsy), progress="no" showed the bar.
    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"load_sharded: {name} must be True(, False)? or"):
        load_sharded(_fused_model(), tmp_path, **kwargs)


def test_wrong_model_argument_and_unreadable_folder_are_named(tmp_path, monkeypatch):
    import grouped_ep.loading.safetensors as st

    write_safetensors(tmp_path / "model.safetensors", _fused_state())
    with pytest.raises(TypeError, match="load_sharded: model must be an nn.Module .* got str"):
        load_sharded(str(tmp_path), _fused_model())  # swapped: an AttributeError before
    with pytest.raises(ValueError, match=r"threads must be an int in \[1, 2\*\*31\)"):
        load_sharded(_fused_model(), tmp_path, threads=2**63)

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(st, "_open_checkpoint", denied)  # a folder without read permission
    with pytest.raises(LoadError, match="cannot be read .*Permission denied"):
        load_sharded(_fused_model(), tmp_path)


def test_key_a_listed_shard_holds_but_the_index_omits_is_read(tmp_path):
    """transformers reads every key of every shard the index names; a key its shard holds but
    the index left out was "no checkpoint key", and a key_map naming it "missing key"."""
    state = _fused_state()
    write_safetensors(tmp_path / "s1.safetensors", {"m.norm": state["m.norm"]})
    experts = {k: v for k, v in state.items() if k != "m.norm"}
    write_safetensors(tmp_path / "s2.safetensors", experts)
    write_index(tmp_path, {"m.norm": "s1.safetensors", "m.experts.down_proj": "s2.safetensors"})
    model = _fused_model()
    report = load_sharded(model, tmp_path)  # m.experts.gate_up_proj: in s2, not in the index
    assert report.missing == [] and report.unused_keys == []
    for k, v in state.items():
        assert torch.equal(_state(model)[k], v), k
    # Held by three shards and listed by none: equal copies load.
    write_safetensors(tmp_path / "s0.safetensors", {"a": torch.ones(1), **experts})
    last = {"b": torch.ones(1), "m.experts.gate_up_proj": state["m.experts.gate_up_proj"]}
    write_safetensors(tmp_path / "s3.safetensors", last)
    listed = {"m.norm": "s1.safetensors", "m.experts.down_proj": "s2.safetensors"}
    write_index(tmp_path, listed | {"a": "s0.safetensors", "b": "s3.safetensors"})
    report = load_sharded(model, tmp_path)
    assert report.unused_keys == ["a", "b"]
    # The copies were read whole to compare them: counted, not hidden (they were not counted).
    nbytes = {k: v.numel() * v.element_size() for k, v in state.items()}
    compared = 2 * (nbytes["m.experts.down_proj"] + 2 * nbytes["m.experts.gate_up_proj"])
    assert report.copy_bytes_compared == compared
    assert report.bytes_read == report.bytes_owned + compared
    assert torch.equal(_state(model)["m.experts.gate_up_proj"], last["m.experts.gate_up_proj"])


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "unlisted"])
def test_key_two_shards_hold_with_different_values_is_refused(tmp_path, listed):
    """load_sharded read the index's shard, from_pretrained the last by name: the same folder
    gave 1.0 here and 7.0 there, silently (a review). Copies that differ are now refused, naming
    both files, before anything is read; equal ones load (above)."""
    state = _fused_state()
    write_safetensors(tmp_path / "s1.safetensors", state)
    write_safetensors(
        tmp_path / "s2.safetensors", {"m.norm": torch.full((4,), 7.0), "x": state["m.norm"]}
    )
    names = {k: "s1.safetensors" for k in state if listed or k != "m.norm"}
    write_index(tmp_path, names | {"x": "s2.safetensors"})
    model = _fused_model()
    _expect(
        r"'m\.norm' is held by two shards with different values: .*s[12]\.safetensors .*"
        r"s[12]\.safetensors .*from_pretrained reads s2\.safetensors",
        model,
        tmp_path,
    )


def test_copies_in_two_dtypes_are_compared_by_value(tmp_path):
    """An fp32 copy and a bf16 copy of the same numbers were refused as "different values",
    their bytes differing; from_pretrained loads the folder to the same weights (a review).
    Floating copies of two dtypes are compared as numbers now (NaN equal to NaN)."""
    state = {k: v.bfloat16().float() for k, v in _fused_state().items()}
    state["m.norm"][1] = float("nan")
    write_safetensors(tmp_path / "s1.safetensors", state)
    other = {"m.norm": state["m.norm"].bfloat16(), "x": torch.ones(1)}
    write_safetensors(tmp_path / "s2.safetensors", other)
    write_index(tmp_path, {k: "s1.safetensors" for k in state} | {"x": "s2.safetensors"})
    model = _fused_model()
    load_sharded(model, tmp_path)
    got = _state(model)["m.norm"]
    assert torch.allclose(got, state["m.norm"], rtol=0, atol=0, equal_nan=True)
    # fp32 copies that differ only in the sign of a zero are the same numbers too
    state["m.norm"][0], other = 0.0, {"m.norm": state["m.norm"].clone(), "x": torch.ones(1)}
    other["m.norm"][0] = -0.0
    write_safetensors(tmp_path / "s1.safetensors", state)
    write_safetensors(tmp_path / "s2.safetensors", other)
    load_sharded(_fused_model(), tmp_path)
    other["m.norm"][0] += 1  # one number differs
    write_safetensors(tmp_path / "s2.safetensors", other)
    _expect(r"'m\.norm' is held by two shards with different values", _fused_model(), tmp_path)


def test_missing_keys_error_names_the_one_file_a_folder_was_read_from(tmp_path):
    """A stray adapter file beside pickled weights was read as the checkpoint; the error named
    only the folder."""
    write_safetensors(tmp_path / "adapter_model.safetensors", {"lora_A": torch.ones(2, 2)})
    torch.save(_fused_state(), tmp_path / "pytorch_model.bin")
    _expect(
        r"no checkpoint key .* read from adapter_model\.safetensors alone; pytorch_model\.bin "
        r"beside it is a pickled \(torch\.save\) checkpoint, not read",
        _fused_model(),
        tmp_path,
    )


def test_ctrl_c_while_the_model_takes_its_tensors_finishes_first(tmp_path, monkeypatch):
    """An interrupt between two tensors swapped in left some old, some new, and nothing to say
    which: it is held back until every tensor is in, then raised."""
    import signal

    state = _fused_state()
    write_safetensors(tmp_path / "model.safetensors", state)
    swap, calls = loader.put_in_model, []

    def interrupted_swap(target):
        calls.append(target)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first tensor went in
        return swap(target)

    monkeypatch.setattr(loader, "put_in_model", interrupted_swap)
    model = _fused_model()
    # Python's own handler, as in a terminal (a job started in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_sharded(model, tmp_path)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(calls) == 3
    for k, v in state.items():
        assert torch.equal(_state(model)[k], v), k


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 6, device="meta")
        self.head = nn.Linear(6, 12, bias=False, device="meta")
        self.head.weight = self.embed.weight  # one tensor, two names


def test_a_tie_the_checkpoint_holds_apart_is_refused_before_anything_is_loaded(tmp_path):
    """A tied model and a checkpoint saved untied (its own, different head): one key loaded into
    the shared tensor gave a model with another head, silently (hubkeys review)."""
    embed, head = torch.randn(12, 6), torch.randn(12, 6)
    write_safetensors(tmp_path / "model.safetensors", {"embed.weight": embed, "head.weight": head})
    model = _TiedHead()
    with pytest.raises(LoadError, match=r"ties 'head.weight' to 'embed.weight'.*'head.weight'"):
        load_sharded(model, tmp_path)
    assert model.embed.weight.is_meta and model.head.weight is model.embed.weight  # untouched
    # Equal copies (a .bin conversion keeps both) load as the one tensor, as do bf16 copies of it.
    for dtype in (torch.float32, torch.bfloat16):
        one = embed.to(dtype)
        write_safetensors(
            tmp_path / "model.safetensors", {"embed.weight": one, "head.weight": one.clone()}
        )
        model = _TiedHead()
        report = load_sharded(model, tmp_path)
        assert model.head.weight is model.embed.weight
        assert torch.equal(model.embed.weight, one.float()) and report.unused_keys == []
    # One copy in bf16 and one in fp32 of the same values: compared as values, not bytes.
    half = embed.bfloat16()
    write_safetensors(
        tmp_path / "model.safetensors", {"embed.weight": half, "head.weight": half.float()}
    )
    load_sharded(_TiedHead(), tmp_path)
    # A difference in the last row only is found (the rows are compared a block at a time).
    other = half.clone()
    other[-1, -1] += 1
    write_safetensors(tmp_path / "model.safetensors", {"embed.weight": half, "head.weight": other})
    with pytest.raises(LoadError, match="different values"):
        load_sharded(_TiedHead(), tmp_path)


def test_a_tied_transformers_config_against_an_untied_checkpoint_names_the_flag(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_mixtral_config()
    config.tie_word_embeddings = True
    folder = save_hf(tmp_path / "ckpt", config, max_shard_size="10MB")
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    write_safetensors(folder / "model.safetensors", state)
    with pytest.raises(LoadError, match=r"lm_head.weight.*tie_word_embeddings=False"):
        load_sharded(meta_model(AutoConfig.from_pretrained(folder)), folder)
    # What the message says to do loads both, as transformers' from_pretrained does.
    model = meta_model(AutoConfig.from_pretrained(folder, tie_word_embeddings=False))
    load_sharded(model, folder)
    ref = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(ref.lm_head.weight, model.lm_head.weight)


def test_differing_copies_are_refused_when_keys_are_renamed_to_fit_the_model(tmp_path):
    """A base model's checkpoint read into the model with a head (`model.` added, as
    from_pretrained does): the comparison looked up the renamed keys among the files' names and
    never ran (a review: norm.weight loaded 1.0 where from_pretrained gives 7.0)."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in LlamaModel(cfg).state_dict().items()}
    cfg.save_pretrained(tmp_path)
    first = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    second = {
        "embed_tokens.weight": state["embed_tokens.weight"],
        "norm.weight": torch.full_like(state["norm.weight"], 7.0),
    }
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    names = {k: "model-00001-of-00002.safetensors" for k in first}
    names["embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    for cls in (LlamaModel, LlamaForCausalLM):
        _expect(
            r"'norm\.weight' is held by two shards with different values",
            cls(cfg),
            tmp_path,
            strict=False,
        )
