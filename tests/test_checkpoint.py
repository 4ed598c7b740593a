"""Single-process checkpoint tests: layout and atomic commit, compact files for views, bad
input, the `inspect` command, and export to Hugging Face (loaded back with transformers)."""

from __future__ import annotations

import copy
import json
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _ckpt_helpers import rewrite_metadata, tiny_mixtral_config
from test_checkpoint_dist import tiny_qwen3_moe
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from grouped_ep import checkpoint as ck
from grouped_ep.__main__ import main as cli
from grouped_ep._subprocess import run as run_group
from grouped_ep.checkpoint.export import parse_size
from grouped_ep.checkpoint.export_plan import split_expert_tensor


class Small(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.experts = nn.Parameter(torch.randn(4, 6, 5, generator=g))
        self.dense = nn.Linear(5, 3)
        with torch.no_grad():
            self.dense.weight.copy_(torch.randn(3, 5, generator=g))


def _trained(seed: int = 0) -> tuple[Small, torch.optim.Optimizer]:
    model = Small(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.einsum(
        "eab,b->ea", model.experts, model.dense(torch.ones(5)).sum() * torch.ones(5)
    ).sum().backward()
    opt.step()
    return model, opt


def _disk_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.distcp"))


def test_layout_latest_and_roundtrip(tmp_path: Path) -> None:
    model, opt = _trained()
    rng = torch.get_rng_state()
    path = ck.save(tmp_path, model, opt, extra={"step": 7, "rng": rng, "sched": {"last": 7}})
    assert path == tmp_path / "step-00000007"
    assert (tmp_path / "latest").read_text() == "step-00000007\n"
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__0_crc32c.json",
        "extra-rank00000.pt",
        "grouped_ep.json",
    ]
    manifest = json.loads((path / "grouped_ep.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["has_optimizer"]
    assert not list(tmp_path.glob(".tmp-*"))

    fresh, fresh_opt = _trained(seed=1)
    extra = ck.load(tmp_path, fresh, fresh_opt)  # the root: follows `latest`
    assert extra["step"] == 7 and extra["sched"] == {"last": 7} and torch.equal(extra["rng"], rng)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        for k, v in opt.state[p].items():
            assert torch.equal(v, fresh_opt.state[q][k]), (name, k)

    # Without a step: one more than the highest; the same step again replaces it.
    assert ck.save(tmp_path, model).name == "step-00000008"
    with torch.no_grad():
        model.experts.fill_(3.0)
    assert ck.save(tmp_path, model, step=7) == path
    assert ck.load(path, fresh) is None  # no extra in the new step-7
    assert torch.equal(fresh.experts, torch.full((4, 6, 5), 3.0))
    assert ck.resolve(tmp_path) == path and not list(tmp_path.glob(".tmp-*"))


def test_views_of_one_buffer_are_written_compactly(tmp_path: Path) -> None:
    """A view written with torch.save carries its whole storage; checkpoints must not."""
    buffer = torch.randn(16_000_000)  # 64 MB
    model = nn.Module()
    model.a = nn.Parameter(buffer[:6_000_000].view(3000, 2000))
    model.b = nn.Parameter(buffer[6_000_000:12_000_000].view(2000, 3000).T)  # not contiguous
    model.c = nn.Parameter(buffer[12_000_000:13_000_000].view(10, 100, 1000)[:, ::2])  # strided
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert unique >= 50e6
    whole = tmp_path / "view.pt"
    torch.save(model.c.detach(), whole)
    assert whole.stat().st_size > 0.9 * buffer.nbytes  # the hazard is real

    path = ck.save(tmp_path / "ckpt", model)
    assert _disk_bytes(path) <= 1.02 * unique, (_disk_bytes(path), unique)
    loaded = nn.Module()
    for name, p in model.named_parameters():
        setattr(loaded, name, nn.Parameter(torch.zeros_like(p)))
    ck.load(path, loaded)
    for name, p in model.named_parameters():
        assert torch.equal(getattr(loaded, name), p), name

    # The planner itself hands the writer compact tensors, whatever writer DCP uses.
    planner = ck.state.CompactSavePlanner()
    planner.set_up_planner({"c": model.c.detach()}, is_coordinator=True)
    (item,) = planner.create_local_plan().items
    data = planner.resolve_data(item)
    assert data.untyped_storage().nbytes() == data.nbytes and torch.equal(data, model.c)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, opt = _trained()
    return ck.save(tmp_path / "root", model, opt, extra={"step": 1})


def _load_fails(path: Path, *needles: str, verify: bool = True) -> None:
    model, opt = _trained(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(path, model, opt, verify=verify)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    for k, v in model.state_dict().items():  # a failed load leaves the model as it was
        assert torch.equal(v, before[k]), k


def test_missing_metadata_is_named(saved: Path) -> None:
    (saved / ".metadata").unlink()
    _load_fails(saved, str(saved), ".metadata")
    _load_fails(saved.parent, ".metadata")


def test_missing_data_file_is_named(saved: Path) -> None:
    (saved / "__0_0.distcp").unlink()
    _load_fails(saved, "__0_0.distcp", "missing")


def test_truncated_data_file_is_named(saved: Path) -> None:
    data = saved / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _load_fails(saved.parent, "__0_0.distcp", "truncated")


def test_truncated_metadata_and_dangling_latest(saved: Path) -> None:
    meta = saved / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    _load_fails(saved, ".metadata: its [length, CRC32C] is [40, ", "changed since the save")
    manifest = json.loads((saved / "grouped_ep.json").read_text())
    del manifest["metadata_crc32c"]  # as saved before 2026-11-28: unpickled, and refused then
    (saved / "grouped_ep.json").write_text(json.dumps(manifest))
    _load_fails(saved, "cannot read .metadata")
    shutil.rmtree(saved)
    _load_fails(saved.parent, "latest names step-00000001, which does not exist")
    _load_fails(saved.parent / "nowhere", "does not exist")


def test_model_that_does_not_fit_is_named(saved: Path) -> None:
    model = Small()
    model.experts = nn.Parameter(torch.zeros(5, 6, 5))  # 5 experts, the checkpoint has 4
    with pytest.raises(ck.CheckpointError, match=r"model.experts: checkpoint has global shape"):
        ck.load(saved, model)
    model.extra_weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(ck.CheckpointError, match="model.extra_weight: not in the checkpoint"):
        ck.load(saved, model)


def test_a_model_on_meta_is_refused_with_what_to_do(saved: Path) -> None:
    # DCP copies into a meta tensor as a no-op: the load would "succeed" with nothing loaded.
    with torch.device("meta"):
        model = Small()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ck.CheckpointError, match=r"meta device \(experts, dense.weight.*to_empty"):
        ck.load(saved, model, opt)
    assert not opt.state  # nothing made or stepped
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # over the materialized parameters
    ck.load(saved, model, opt)
    ref = Small(seed=5)
    ck.load(saved, ref, torch.optim.AdamW(ref.parameters(), lr=0.1))
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_embeddings_untied_by_to_empty_are_refused(tmp_path: Path) -> None:
    # A tied transformers model built on meta and materialized with to_empty has two embedding
    # tensors: loading would fill both and training would then update two copies, silently.
    tied = tiny_qwen3_moe(seed=0, tie_word_embeddings=True)
    saved = ck.save(tmp_path / "root", tied)
    with torch.device("meta"):
        model = type(tied)(tied.config)
    model.to_empty(device="cpu")
    with pytest.raises(ck.CheckpointError, match=r"tie_word_embeddings=True.*model.tie_weights"):
        ck.load(saved, model)
    model.tie_weights()
    ck.load(saved, model)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert torch.equal(model.get_input_embeddings().weight, tied.get_input_embeddings().weight)


def test_damaged_extra_or_manifest_is_named_before_anything_is_read(saved: Path) -> None:
    (saved / "extra-rank00000.pt").write_bytes(b"garbage")
    _load_fails(saved, "extra-rank00000.pt", "do not match the length and CRC32C")
    _load_fails(saved, "extra-rank00000.pt", "cannot read", verify=False)
    (saved / "extra-rank00000.pt").unlink()
    _load_fails(saved, "extra-rank00000.pt", "is missing")
    (saved / "grouped_ep.json").write_text("{not json")
    _load_fails(saved, "grouped_ep.json", "cannot read")


def test_checkpoint_keys_the_model_lacks_are_refused(tmp_path: Path) -> None:
    # A layer or buffer saved but missing from the resumed model (e.g. an expert bias the new
    # run no longer has) is named, as load_state_dict(strict=True) would; nothing is loaded.
    model, opt = _trained()
    model.register_buffer("expert_bias", torch.ones(4))
    ck.save(tmp_path, model, opt, step=1)
    fresh, fresh_opt = _trained(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(
        ck.CheckpointError, match=r"1 key\(s\) the model has no place for: model.expert_bias"
    ):
        ck.load(tmp_path, fresh, fresh_opt)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    # Optimizer state of a parameter the model lacks, the model's own keys all present.
    bigger, bigger_opt = _trained()
    bigger.extra = nn.Parameter(torch.ones(3))
    bigger_opt.add_param_group({"params": [bigger.extra]})
    bigger.extra.grad = torch.ones(3)
    bigger_opt.step()
    ck.save(tmp_path / "b", bigger, bigger_opt, step=1)
    del bigger.extra
    with pytest.raises(ck.CheckpointError, match=r"no place for: .*optim.state.extra.exp_avg"):
        ck.load(tmp_path / "b", bigger, torch.optim.AdamW(bigger.parameters(), lr=0.1))
    # A parameter the model has and the optimizer does not (frozen on resume): the optimizer is
    # named, not the model.
    ck.save(tmp_path / "c", *_trained(), step=1)
    frozen, _ = _trained(seed=1)
    opt_without = torch.optim.AdamW([frozen.experts], lr=0.1)
    with pytest.raises(
        ck.CheckpointError,
        match=r"optimizer state for \d+ key\(s\) of parameters the model has but the optimizer "
        r"does not hold .*optim\.state\.dense\.weight\.exp_avg.*Build the optimizer over",
    ):
        ck.load(tmp_path / "c", frozen, opt_without)


def test_parameter_without_optimizer_state_resumes(tmp_path: Path) -> None:
    """A parameter that never had a gradient has no AdamW state when saved; it resumes stateless
    while the others get their state back. Part of a parameter's state missing is a mismatch."""
    model = Small()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.dense(torch.ones(5)).sum().backward()  # `experts` gets no gradient, so no state
    opt.step()
    assert model.experts not in opt.state
    ck.save(tmp_path, model, opt, step=1)

    fresh = Small(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    ck.load(tmp_path, fresh, fresh_opt)
    assert fresh.experts not in fresh_opt.state
    torch.testing.assert_close(fresh.experts, model.experts, rtol=0, atol=0)
    for key in ("exp_avg", "exp_avg_sq"):
        got = fresh_opt.state[fresh.dense.weight][key]
        torch.testing.assert_close(got, opt.state[model.dense.weight][key], rtol=0, atol=0)

    # the same checkpoint with one of dense.weight's state tensors gone is refused, by name
    meta = pickle.loads((tmp_path / "step-00000001" / ".metadata").read_bytes())
    del meta.state_dict_metadata["optim.state.dense.weight.exp_avg_sq"]
    rewrite_metadata(tmp_path / "step-00000001", meta)
    with pytest.raises(ck.CheckpointError, match="optim.state.dense.weight.exp_avg_sq"):
        ck.load(tmp_path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))


def test_save_clears_saves_that_died_and_refuses_bool_arguments(tmp_path: Path) -> None:
    model, opt = _trained()
    ck.save(tmp_path, model, opt, step=1)
    died = tmp_path / ".tmp-step-00000002"  # a save of another step that died midway
    died.mkdir()
    (died / "__0_0.distcp").write_bytes(b"half")
    ck.save(tmp_path, model, opt, step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000001",
        "step-00000003",
    ]
    with pytest.raises(ck.CheckpointError, match="keep_last must be a positive int"):
        ck.save(tmp_path, model, keep_last=True)
    with pytest.raises(ck.CheckpointError, match="step must be a non-negative int"):
        ck.save(tmp_path, model, step=True)
    # extra["step"] names the step as step= does; one that cannot (a bool, a float) is refused,
    # not ignored (the next number was taken, and keep_last then removed the wrong steps).
    for bad in (True, 4.0, torch.tensor(4.0), "4"):
        with pytest.raises(ck.CheckpointError, match=r'save: extra\["step"\] must be a non-neg'):
            ck.save(tmp_path, model, extra={"step": bad})
    # numpy ints and integer tensors, as training loops keep the step, name it.
    assert ck.save(tmp_path, model, extra={"step": np.int64(7)}).name == "step-00000007"
    assert ck.save(tmp_path, model, extra={"step": torch.tensor(8)}).name == "step-00000008"
    assert ck.save(tmp_path, model, step=np.int32(9)).name == "step-00000009"


def test_fresh_optimizer_is_not_stepped_by_save_or_failed_load(tmp_path: Path) -> None:
    """torch's get_state_dict makes state for an optimizer that has none (a step at lr 0). A save
    before the first step, or a load that fails, must leave such an optimizer without state: else
    the first real AdamW step is bias-corrected as the second, a smaller update."""
    ref = Small()
    run = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    run_opt = torch.optim.AdamW(run.parameters(), lr=0.1)
    at_save = {k: v.clone() for k, v in run.state_dict().items()}
    saved = ck.save(tmp_path / "root", run, run_opt, step=0)
    assert len(run_opt.state) == 0
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(tmp_path / "nowhere", run, run_opt)
    assert len(run_opt.state) == 0
    other = Small()
    other.experts = nn.Parameter(torch.zeros(5, 6, 5))  # 5 experts, the checkpoint has 4
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    with pytest.raises(ck.CheckpointError, match="model.experts: checkpoint has global shape"):
        ck.load(saved, other, other_opt)
    assert len(other_opt.state) == 0
    for model, opt in ((ref, ref_opt), (run, run_opt)):
        model.dense(model.experts.sum((0, 1))).sum().backward()
        opt.step()
        assert int(opt.state[model.experts]["step"]) == 1
    for k, v in run.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=0, atol=0)
    # The checkpoint saved before the first step resumes with no optimizer state.
    third = Small(seed=1)
    third_opt = torch.optim.AdamW(third.parameters(), lr=0.1)
    ck.load(saved, third, third_opt)
    assert len(third_opt.state) == 0
    for k, v in third.state_dict().items():
        torch.testing.assert_close(v, at_save[k], rtol=0, atol=0)


def test_describe_follows_latest(saved: Path) -> None:
    assert ck.describe(saved.parent).path == saved
    assert not ck.describe(saved.parent).problems


def test_inspect_lists_chunks_and_checks_coverage(saved: Path, capsys) -> None:
    assert cli(["inspect", str(saved.parent)]) == 0
    out = capsys.readouterr().out
    assert "model.experts  float32  [4, 6, 5]" in out
    assert "[0:4, 0:6, 0:5]  __0_0.distcp @" in out
    assert "OK: every element of every tensor is saved exactly once" in out

    # Tamper with the metadata: an overlap (two chunks claim row 1) and a gap (rows 2:4).
    meta_path = saved / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())
    experts = meta.state_dict_metadata["model.experts"]
    experts.chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0, 0]), sizes=torch.Size([2, 6, 5])),
        ChunkStorageMetadata(offsets=torch.Size([1, 0, 0]), sizes=torch.Size([1, 6, 5])),
    ]
    rewrite_metadata(saved, meta)
    assert cli(["inspect", str(saved)]) == 1
    captured = capsys.readouterr()
    assert "model.experts: chunks at [0, 0, 0] and [1, 0, 0] overlap" in captured.out
    assert "problem(s)" in captured.err
    experts.chunks = experts.chunks[:1]
    rewrite_metadata(saved, meta)
    assert cli(["inspect", str(saved)]) == 1
    assert "model.experts: chunks cover 60 of 120 elements" in capsys.readouterr().out
    with pytest.raises(ck.CheckpointError, match="a gap"):
        ck.load(saved, Small())

    assert cli(["inspect", str(saved.parent / "nowhere")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_inspect_command_line(saved: Path) -> None:
    run = run_group(
        [sys.executable, "-m", "grouped_ep", "inspect", "--summary", str(saved.parent)],
        capture=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "optim.state.experts.exp_avg  float32  [4, 6, 5]" in run.stdout
    # the manifest's account of the save, and a root's steps (none were shown; a review)
    assert "saved: step=1, world_size=1, has_optimizer=True, has_extra=True" in run.stdout
    assert f"steps in {saved.parent}: step-00000001 (latest)" in run.stdout
    (saved / "__0_0.distcp").unlink()
    run = run_group(
        [sys.executable, "-m", "grouped_ep", "inspect", str(saved)], capture=True, timeout=60
    )
    assert run.returncode == 1
    assert "data file __0_0.distcp is missing" in run.stdout


def test_split_expert_tensor_order_and_rows() -> None:
    e, inter, h = 12, 3, 4
    gate_up = torch.arange(float(e * 2 * inter * h)).reshape(e, 2 * inter, h)
    pieces = split_expert_tensor("model.layers.0.mlp.experts.gate_up_proj", gate_up)
    keys = [k for k, _ in pieces]
    assert keys[18:22] == [  # numeric order: 9 before 10
        "model.layers.0.mlp.experts.9.gate_proj.weight",
        "model.layers.0.mlp.experts.9.up_proj.weight",
        "model.layers.0.mlp.experts.10.gate_proj.weight",
        "model.layers.0.mlp.experts.10.up_proj.weight",
    ]
    pieces = dict(pieces)
    assert torch.equal(pieces["model.layers.0.mlp.experts.10.gate_proj.weight"], gate_up[10, :3])
    assert torch.equal(pieces["model.layers.0.mlp.experts.10.up_proj.weight"], gate_up[10, 3:])
    down = torch.randn(e, h, inter)
    assert torch.equal(
        dict(split_expert_tensor("x.down_proj", down))["x.11.down_proj.weight"], down[11]
    )
    assert split_expert_tensor("x.gate_up_proj", torch.zeros(4, 5)) is None
    with pytest.raises(ValueError, match="dim 1 must be 2\\*I"):
        split_expert_tensor("x.gate_up_proj", torch.zeros(2, 5, 4))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("5 parsecs")


def test_export_hf_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_qwen3_moe(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    model(tokens, labels=tokens).loss.backward()
    opt.step()
    model.eval()

    index_path = ck.export_hf(model, tmp_path / "hf")
    index = json.loads(index_path.read_text())
    keys = list(index["weight_map"])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    assert (tmp_path / "hf" / "config.json").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)

    # grouped_ep's own loader stacks the per-expert keys back into the fused params.
    from grouped_ep import load_sharded

    other = tiny_qwen3_moe(seed=4)
    report = load_sharded(other, tmp_path / "hf")
    assert not report.unused_keys and not report.missing, report
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name


def test_export_hf_mixtral_uses_its_own_keys(tmp_path: Path) -> None:
    # Regression: Qwen-style gate_proj/up_proj keys for a Mixtral load in transformers with
    # silently re-initialized experts. The export must write block_sparse_moe...w1/w3/w2.
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    torch.manual_seed(5)
    model = MixtralForCausalLM(tiny_mixtral_config(experts=11)).eval()  # > 10: numeric order
    with torch.no_grad():
        for p in model.parameters():  # beyond init's std 0.02: logits depend on every expert
            p.normal_(0, 0.2)
    index_path = ck.export_hf(model, tmp_path / "hf")
    keys = list(json.loads(index_path.read_text())["weight_map"])
    for i in (0, 10):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.0.block_sparse_moe.experts.{i}.{w}.weight" in keys
    assert not any("gate_proj" in k or "gate_up_proj" in k for k in keys)

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name


def test_writer_refuses_a_key_planned_twice(tmp_path: Path) -> None:
    """Two tensors under one key would leave a header pointing at stray bytes: an unreadable
    file that looks complete. The plan is refused before the file exists."""
    from grouped_ep.checkpoint.safetensors_writer import PlannedTensor, StreamingSafetensorsWriter

    planned = [
        PlannedTensor("a.qkv", torch.float32, (2, 2)),
        PlannedTensor("a.qkv", torch.float32, (2, 2)),
    ]
    with pytest.raises(ValueError, match="a.qkv is planned twice"):
        StreamingSafetensorsWriter(tmp_path / "x.safetensors", planned)
    assert not (tmp_path / "x.safetensors").exists()


# ---- DirectReader: large whole chunks read straight into their destination -------------------


def _spy_direct(monkeypatch) -> list[tuple[str, bool]]:
    """Record (key, read directly?) for every item DirectReader considers."""
    from grouped_ep.checkpoint import direct_reader

    seen: list[tuple[str, bool]] = []
    original = direct_reader.DirectReader._read_direct

    def spy(self, f, path, req, planner):
        done = original(self, f, path, req, planner)
        seen.append((req.storage_index.fqn, done))
        return done

    monkeypatch.setattr(direct_reader.DirectReader, "_read_direct", spy)
    return seen


@pytest.mark.parametrize("min_bytes", [1 << 20, 0], ids=["default", "every_size"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_direct_reader_equals_saved_values(tmp_path: Path, monkeypatch, min_bytes) -> None:
    import torch.distributed.checkpoint as dcp

    from grouped_ep.checkpoint import direct_reader

    monkeypatch.setattr(direct_reader, "MIN_DIRECT_BYTES", min_bytes)
    g = torch.Generator().manual_seed(0)
    saved = {
        "fp32": torch.randn(600, 700, generator=g),  # 1.68 MB
        "bf16": torch.randn(1024, 1024, generator=g).bfloat16(),
        "int64": torch.arange(300_000),
        "transposed": torch.randn(800, 700, generator=g).t(),  # saved with its strides
        "small": torch.randn(10, generator=g),
        "scalar": torch.tensor(3.5),
        "into_view": torch.randn(600, 700, generator=g),
    }
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    dest = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in saved.items()}  # contiguous
    dest["into_view"] = torch.zeros(700, 600).t()  # a non-contiguous destination
    seen = _spy_direct(monkeypatch)
    dcp.load(dest, storage_reader=direct_reader.DirectReader(str(tmp_path)), no_dist=True)
    for k, v in saved.items():
        assert torch.equal(dest[k], v), k
    direct = {k for k, done in seen if done}
    expected = {"fp32", "bf16", "int64"} | ({"small", "scalar"} if min_bytes == 0 else set())
    assert direct == expected  # the transposed save and the view destination took DCP's path
    assert ("transposed", False) in seen


def test_direct_reader_names_a_damaged_chunk(tmp_path: Path) -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(600, 700))  # 1.68 MB: read directly
    path = ck.save(tmp_path, model, step=0)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200:] = bytes(200)  # the archive's directory, at its end: same size, unreadable
    data.write_bytes(bytes(raw))
    # Unchecked (the checksums would refuse it before the read), the reader names the file.
    with pytest.raises(ck.CheckpointError, match=r"may be partly loaded(.|\n)*__0_0\.distcp"):
        ck.load(tmp_path, model, verify=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_direct_reader_reads_a_block_of_rows(tmp_path: Path, monkeypatch) -> None:
    """A resharded load asks for part of a saved chunk: a block of rows is read directly, a
    block of columns through DCP's path; both equal the saved values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from grouped_ep.checkpoint.direct_reader import DirectReader

    saved = torch.randn(1000, 600, generator=torch.Generator().manual_seed(1))  # 2.4 MB
    dcp.save({"w": saved}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    reader = DirectReader(str(tmp_path))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    (index,) = reader.storage_data
    boxes = {"rows": ((100, 0), (300, 600)), "cols": ((0, 100), (1000, 200))}
    dest = {name: torch.zeros(size) for name, (_, size) in boxes.items()}
    items = [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(name, (0, 0)),
            dest_offsets=torch.Size([0, 0]),
            storage_index=index,
            storage_offsets=torch.Size(offsets),
            lengths=torch.Size(size),
        )
        for name, (offsets, size) in boxes.items()
    ]

    class Planner:
        def resolve_tensor(self, req):
            return dest[req.dest_index.fqn]

        def commit_tensor(self, req, tensor):
            pass

    seen = _spy_direct(monkeypatch)
    reader.read_data(LoadPlan(items), Planner()).wait()
    assert torch.equal(dest["rows"], saved[100:400])
    assert torch.equal(dest["cols"], saved[:, 100:300])
    assert [done for _, done in seen] == [True, False]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_direct_reader_falls_back_where_meta_loading_fails(tmp_path: Path, monkeypatch) -> None:
    """A torch that cannot load the archive onto the meta device gets DCP's path, not an error."""
    import torch.distributed.checkpoint as dcp

    from grouped_ep.checkpoint import direct_reader

    saved = {"w": torch.randn(600, 700)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    real_load = torch.load

    def no_meta(*args, **kwargs):
        if kwargs.get("map_location") == "meta":
            raise RuntimeError("meta loading is not supported here")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(direct_reader.torch, "load", no_meta)
    seen = _spy_direct(monkeypatch)
    dest = {"w": torch.zeros(600, 700)}
    dcp.load(dest, storage_reader=direct_reader.DirectReader(str(tmp_path)), no_dist=True)
    assert seen == [("w", False)]
    assert torch.equal(dest["w"], saved["w"])


def test_extra_saved_from_a_gpu_loads_without_it(tmp_path: Path, monkeypatch) -> None:
    """A tensor in `extra` saved from cuda:7 (its location recorded as torch records one there)
    loads on a machine without that GPU: on this rank's current GPU, or on CPU where there is
    none. CPU tensors (RNG states) stay on CPU. Before, torch.load asked for cuda:7 and failed."""
    import torch.serialization as ser

    model = torch.nn.Linear(4, 4)
    rng = torch.get_rng_state()
    real_tag = ser.location_tag
    monkeypatch.setattr(ser, "location_tag", lambda s: "cuda:7" if s.nbytes() == 4 else real_tag(s))
    ck.save(tmp_path, model, extra={"loss_ema": torch.tensor(1.5), "rng": rng})
    monkeypatch.setattr(ser, "location_tag", real_tag)
    extra = ck.load(tmp_path, model)
    here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert str(extra["loss_ema"].device) == here and float(extra["loss_ema"]) == 1.5
    assert extra["rng"].device.type == "cpu" and torch.equal(extra["rng"], rng)


def test_resume_with_a_scheduler_the_saving_run_lacked(tmp_path: Path) -> None:
    """Every torch LR scheduler adds `initial_lr` to the groups: a run resumed with one that the
    saving run did not have failed inside DCP's read plan ("Missing key ... initial_lr"), after
    the checks, saying the model may be partly loaded (a review). The group keeps its current
    value for a key the checkpoint lacks; the saved ones come from the checkpoint."""
    model, opt = _trained()
    ck.save(tmp_path, model, opt)
    fresh = Small(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda k: 0.5**k)
    ck.load(tmp_path, fresh, fresh_opt)
    group = fresh_opt.param_groups[0]
    assert group["lr"] == 0.1 and group["initial_lr"] == 0.5
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    state = fresh_opt.state[fresh.dense.weight]
    assert torch.equal(state["exp_avg"], opt.state[model.dense.weight]["exp_avg"])
    scheduler.step()
    assert fresh_opt.param_groups[0]["lr"] == 0.25  # the scheduler's own base, 0.5 * 0.5


def test_a_folder_of_safetensors_or_the_latest_file_is_named_for_what_it_is(tmp_path):
    """Both were answered 'was the save interrupted before it finished?' (a review: inspect
    of an export_hf folder)."""
    from safetensors.torch import save_file

    model = nn.Linear(4, 4)
    save_file(dict(model.state_dict()), str(tmp_path / "model.safetensors"))
    with pytest.raises(ck.CheckpointError, match=r"holds \.safetensors files, .*export_hf"):
        ck.load(tmp_path, model)
    ck.save(tmp_path / "root", model, step=1)
    with pytest.raises(ck.CheckpointError, match=r"latest is the file naming .*pass the root"):
        ck.load(tmp_path / "root" / "latest", model)
