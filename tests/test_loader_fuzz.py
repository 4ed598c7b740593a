"""Fuzzing load_sharded with corrupted checkpoints: it loads, or raises LoadError, and a failed
load leaves the model as it was. Never another exception, a crash or a hang."""

from __future__ import annotations

import faulthandler
import json
import struct
from pathlib import Path

import pytest
import torch
from _ckpt_helpers import write_index, write_safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from grouped_ep import LoadError, load_sharded

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(autouse=True)
def hang_guard():
    """A hang in native code cannot be interrupted from Python: dump stacks and exit instead."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _model() -> nn.Module:
    root = nn.Module()
    root.l = nn.Module()
    root.l.mlp = nn.Module()
    root.l.mlp.experts = nn.Module()
    root.l.mlp.experts.gate_up_proj = nn.Parameter(torch.zeros(3, 4, 2))
    root.l.mlp.experts.down_proj = nn.Parameter(torch.zeros(3, 2, 2))
    root.norm = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    return root


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"norm": torch.randn(2, generator=g)}  # fp32 into a bf16 param: a cast
    for i in range(3):
        for w, shape in (("gate_proj", (2, 2)), ("up_proj", (2, 2)), ("down_proj", (2, 2))):
            out[f"l.mlp.experts.{i}.{w}.weight"] = torch.randn(shape, generator=g)
    return out


def _check(path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        load_sharded(model, path, progress=False)
    except LoadError as e:
        assert str(e)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed by a failed load: {e}"


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "model.safetensors"
    write_safetensors(path, _tensors())
    return path.read_bytes()


@SETTINGS
@given(data=st.data())
def test_fuzz_bytes(tmp_path, valid_file, data):
    """Truncation, flipped bytes (header length, JSON and data), appended junk."""
    raw = bytearray(valid_file)
    action = data.draw(st.sampled_from(["truncate", "flip", "append", "flip_prefix"]))
    if action == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif action == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
    elif action == "flip_prefix":
        raw[data.draw(st.integers(0, 7))] ^= data.draw(st.integers(1, 255))
    else:
        raw += data.draw(st.binary(min_size=1, max_size=16))
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(raw))
    _check(path)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@SETTINGS
@given(data=st.data())
def test_fuzz_header_fields(tmp_path, valid_file, data):
    """Valid JSON with wrong content: dtypes, shapes, offsets replaced by arbitrary values."""
    n = struct.unpack("<Q", valid_file[:8])[0]
    header = json.loads(valid_file[8 : 8 + n])
    body = valid_file[8 + n :]
    keys = [k for k in header if k != "__metadata__"]
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(keys))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "extra"]))
        if not isinstance(header[key], dict):
            field = "entry"
        if field == "dtype":
            header[key]["dtype"] = data.draw(
                st.sampled_from(["F16", "BF16", "I32", "F64", "X"]) | _json
            )
        elif field == "shape":
            header[key]["shape"] = data.draw(st.lists(st.integers(-2, 6), max_size=4) | _json)
        elif field == "data_offsets":
            lim = len(body) + 8
            header[key]["data_offsets"] = data.draw(
                st.lists(st.integers(-4, lim), min_size=2, max_size=2) | _json
            )
        elif field == "entry":
            header[key] = data.draw(_json)
        else:
            header[data.draw(st.text(max_size=8))] = data.draw(_json)
    raw = json.dumps(header, allow_nan=True).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    _check(path)


@SETTINGS
@given(
    header=st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()),
    body=st.binary(max_size=64),
)
def test_fuzz_arbitrary_headers(tmp_path, header, body):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)
    _check(path)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    weight_map=_json
    | st.dictionaries(
        st.sampled_from(sorted(_tensors())),
        st.sampled_from(
            ["a.safetensors", "b.safetensors", "../a.safetensors", "", "missing.safetensors"]
        ),
    )
)
def test_fuzz_index(tmp_path, weight_map):
    tensors = _tensors()
    keys = sorted(tensors)
    write_safetensors(tmp_path / "a.safetensors", {k: tensors[k] for k in keys[:5]})
    write_safetensors(tmp_path / "b.safetensors", {k: tensors[k] for k in keys[5:]})
    if isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values()):
        write_index(tmp_path, weight_map)
    else:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
    _check(tmp_path)


def test_header_over_the_format_limit_is_refused(tmp_path):
    """The limit was 100 MiB, over the format's 100,000,000 bytes: a file that safetensors and
    from_pretrained refuse loaded here (a review). The file is sparse: nothing is read."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001))
        f.truncate(8 + 100_000_001 + 64)
    with pytest.raises(LoadError, match=r"header length 100000001 exceeds 100000000 bytes"):
        load_sharded(_model(), path, progress=False)


def test_a_key_named_twice_in_a_header_is_refused(tmp_path):
    """JSON keeps the last of two equal keys: a header naming a tensor twice (or a field of
    one twice) would load whichever came last, silently. Refused, naming the key."""
    body = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    entry = '{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}'
    twice = {
        "tensor": '{"w": ' + entry + ', "w": ' + entry + "}",
        "field": '{"w": {"dtype": "F32", "dtype": "F16", "shape": [4], "data_offsets": [0, 16]}}',
    }
    for what, header in twice.items():
        path = tmp_path / f"{what}.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + body)
        with pytest.raises(LoadError, match=rf"{what}\.safetensors: duplicate key '(w|dtype)'"):
            load_sharded(_model(), path, progress=False)
