"""Checkpoint cases a user can hit without noticing: a meta model materialized with `to_empty`
(its non-persistent buffers hold garbage), an optimizer with other parameter groups, a save into
a directory that is itself a checkpoint, a same-step save that dies between its renames, and a
damaged small chunk (read by DCP's own reader)."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from test_checkpoint_dist import tiny_qwen3_moe
from torch import nn

import grouped_ep.checkpoint.layout as layout
from grouped_ep import checkpoint as ck


def test_load_recomputes_buffers_that_to_empty_left_as_garbage(tmp_path: Path) -> None:
    # The documented way to resume into a meta-built model: to_empty, tie_weights, load. No
    # checkpoint holds rotary inv_freq; before, it kept whatever to_empty's memory held.
    ref = tiny_qwen3_moe(seed=0, tie_word_embeddings=True)
    ck.save(tmp_path, ref, step=1)
    with torch.device("meta"):
        model = type(ref)(ref.config)
    model.to_empty(device="cpu")
    model.tie_weights()
    for _, buf in model.named_buffers():
        buf.fill_(float("nan"))  # what garbage may look like
    ck.load(tmp_path, model)
    for (name, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, ref.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def test_buffer_that_cannot_be_recomputed_is_kept_with_a_warning(tmp_path: Path) -> None:
    class Odd(nn.Module):
        def __init__(self, size: int):  # keeps no `size`: cannot be rebuilt
            super().__init__()
            self.w = nn.Parameter(torch.ones(size))
            self.register_buffer("scale", torch.full((size,), 2.0), persistent=False)

    model = Odd(3)
    ck.save(tmp_path, model, step=0)
    with torch.no_grad():
        model.scale.fill_(5.0)
    with pytest.warns(UserWarning, match=r"to_empty, they hold garbage: scale"):
        ck.load(tmp_path, model)
    assert torch.equal(model.scale, torch.full((3,), 5.0))


class _RandomProjection(nn.Module):
    def __init__(self, size: int = 4):
        super().__init__()
        self.size = size
        self.w = nn.Parameter(torch.ones(size))
        self.register_buffer("proj", torch.randn(size, size), persistent=False)


def test_a_random_nonpersistent_buffer_is_kept_with_a_warning(tmp_path: Path) -> None:
    """A fixed random projection kept out of the checkpoint (the seeded build makes it): load
    drew it anew from the RNG of the moment, changed by up to 3.9, and the resumed run trained
    another model (a review). Deterministic ones (rotary inv_freq) are still recomputed."""
    torch.manual_seed(0)
    saved = _RandomProjection()
    ck.save(tmp_path, saved, step=0)
    torch.manual_seed(0)
    model = _RandomProjection()
    torch.randn(100)  # the RNG has moved on since the build
    with pytest.warns(UserWarning, match=r"have a random initialization and keep .*: proj"):
        ck.load(tmp_path, model)
    assert torch.equal(model.proj, saved.proj)


def _two_layers(groups: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    if groups == 2:
        opt = torch.optim.AdamW(
            [
                {"params": model[0].parameters(), "lr": 1e-3},
                {"params": model[1].parameters(), "lr": 1e-2},
            ]
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("saved_groups,groups", [(2, 1), (1, 2)])
def test_other_parameter_groups_are_refused_before_reading(tmp_path, saved_groups, groups):
    # DCP fills the groups it finds by position: 2 saved into 1 gave every parameter group 0's lr.
    ck.save(tmp_path, *_two_layers(saved_groups), step=1)
    model, opt = _two_layers(groups)
    before = [p.clone() for p in model.parameters()]
    lrs = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ck.CheckpointError, match=rf"{saved_groups} parameter group.*has {groups}"):
        ck.load(tmp_path, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [g["lr"] for g in opt.param_groups] == lrs


def _grouped(order: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Three parameters a, b, c in two groups: "ab|c", "a|bc" or "ac|b"."""
    model = nn.ParameterDict({n: nn.Parameter(torch.ones(4)) for n in "abc"})
    first, second = order.split("|")
    opt = torch.optim.AdamW(
        [
            {"params": [model[n] for n in first], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [model[n] for n in second], "lr": 1e-3, "weight_decay": 0.0},
        ]
    )
    sum(p.sum() for p in model.values()).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("order", ["a|bc", "ac|b"])
def test_parameters_in_other_groups_are_refused_before_reading(tmp_path, order):
    """Same number of groups, other members: DCP gave group 0 no hyperparameters (a bare
    KeyError at the next step) or gave `a` c's learning rate and weight decay, silently."""
    ck.save(tmp_path, *_grouped("ab|c"), step=1)
    model, opt = _grouped(order)
    with torch.no_grad():
        for p in model.values():
            p.fill_(7.0)
    moved = "'b' (group 0 saved, 1 now)" if order == "a|bc" else "'c' (group 1 saved, 0 now)"
    with pytest.raises(ck.CheckpointError, match=re.escape(moved)):
        ck.load(tmp_path, model, opt)
    assert all(torch.equal(p, torch.full((4,), 7.0)) for p in model.values())
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]
    # The same groups load, in either order (DCP matches groups by their parameters).
    model, opt = _grouped("ab|c")
    ck.load(tmp_path, model, opt)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    model = nn.ParameterDict({n: nn.Parameter(torch.ones(4)) for n in "abc"})
    opt = torch.optim.AdamW([{"params": [model["c"]]}, {"params": [model["a"], model["b"]]}])
    ck.load(tmp_path, model, opt)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(1e-3, 0.0), (1e-2, 0.1)]


def test_group_that_would_get_no_hyperparameters_is_refused(tmp_path):
    """A group whose parameters the saved groups never held (the saved group held only a frozen
    parameter, no longer in the optimizer) has no hyperparameters to resume with: refused
    before reading (it was a bare KeyError: 'betas' at the next step)."""
    model = nn.ParameterDict({n: nn.Parameter(torch.ones(4)) for n in "abc"})
    model["b"].requires_grad_(False)
    opt = torch.optim.AdamW([{"params": [model["a"]], "lr": 1e-2}, {"params": [model["b"]]}])
    model["a"].sum().backward()
    opt.step()
    ck.save(tmp_path / "frozen", model, opt, step=1)
    fresh = torch.optim.AdamW([{"params": [model["a"]], "lr": 5.0}, {"params": [model["c"]]}])
    with pytest.raises(ck.CheckpointError, match=r"group 1 \('c'\) shares no parameter"):
        ck.load(tmp_path / "frozen", model, fresh)
    assert [g["lr"] for g in fresh.param_groups] == [5.0, 1e-3]


@pytest.mark.parametrize(
    "saved,loaded,kept",
    [
        (dict(momentum=0.9), dict(momentum=0.0), "momentum_buffer"),
        (dict(amsgrad=True), dict(amsgrad=False), "max_exp_avg_sq"),
    ],
    ids=["sgd_momentum_left_out", "adamw_amsgrad_left_out"],
)
def test_optimizer_state_the_optimizer_does_not_keep_is_refused(tmp_path, saved, loaded, kept):
    """The state was dropped while the saved settings were taken: SGD resumed with momentum 0.9
    and no buffer (0.62 off after one step), AdamW with amsgrad and no max_exp_avg_sq (a bare
    KeyError at the next step); a review."""
    cls = torch.optim.SGD if "momentum" in saved else torch.optim.AdamW
    model = nn.Linear(4, 4)
    opt = cls(model.parameters(), lr=0.1, **saved)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ck.save(tmp_path, model, opt, step=1)
    fresh = nn.Linear(4, 4)
    before = fresh.weight.detach().clone()
    with pytest.raises(ck.CheckpointError, match=rf"does not keep \('{kept}', for 2 key"):
        ck.load(tmp_path, fresh, cls(fresh.parameters(), lr=0.1, **loaded))
    assert torch.equal(fresh.weight, before)  # nothing loaded
    again = cls(fresh.parameters(), lr=0.1, **saved)  # as the run that saved built it
    ck.load(tmp_path, fresh, again)
    assert torch.equal(fresh.weight, model.weight)
    assert kept in again.state[fresh.weight]


def test_a_gradient_present_at_load_still_reads_the_optimizer_state(tmp_path: Path) -> None:
    """torch builds the state to read into by a step of zeros, which it skips when a parameter
    has a gradient: the load then read no optimizer state and resumed AdamW from step 0,
    silently; and a mismatch of settings went unseen. The gradients are kept as they were."""
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ck.save(tmp_path, model, opt, step=1)

    def with_grad(**kw):
        fresh = nn.Linear(4, 4)
        fresh(torch.full((2, 4), 3.0)).sum().backward()
        return fresh, fresh.weight.grad.clone(), torch.optim.AdamW(fresh.parameters(), lr=0.1, **kw)

    fresh, grad, fresh_opt = with_grad()
    ck.load(tmp_path, fresh, fresh_opt)
    state = fresh_opt.state[fresh.weight]
    assert float(state["step"]) == 1.0
    assert torch.equal(state["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert torch.equal(fresh.weight.grad, grad)
    fresh, grad, fresh_opt = with_grad(amsgrad=True)
    with pytest.raises(ck.CheckpointError, match="max_exp_avg_sq"):
        ck.load(tmp_path, fresh, fresh_opt)  # the saved run kept no max_exp_avg_sq
    assert not fresh_opt.state and torch.equal(fresh.weight.grad, grad)


@pytest.mark.parametrize(
    "saved,now",
    [("e|a|b", "e|a|b"), ("e|a|b", "e|b|a"), ("a|e", "a|e")],
    ids=["empty_first", "others_reordered", "empty_last"],
)
def test_empty_groups_resume_with_their_own_hyperparameters(tmp_path, saved, now):
    """torch's set_state_dict gives an empty group the last saved group's hyperparameters, so
    an empty group that was not last left another group with none (KeyError: 'betas' at the
    next step). Each group now resumes with its own saved group's, wherever it is."""
    model = nn.ParameterDict({n: nn.Parameter(torch.ones(4)) for n in "ab"})

    def build(layout: str, shift: float):
        groups, empty = [], 0
        for name in layout.split("|"):
            if name == "e":
                empty += 1
                groups.append({"params": [], "lr": shift + 0.1 * empty, "weight_decay": 0.5})
            else:
                lr = shift + (1.0 if name == "a" else 2.0)
                groups.append({"params": [model[name]], "lr": lr, "weight_decay": 0.0})
        return torch.optim.AdamW(groups)

    opt = build(saved, 0.0)
    sum(p.sum() for p in model.values()).backward()
    opt.step()
    ck.save(tmp_path, model, opt, step=1)
    fresh = build(now, 100.0)
    ck.load(tmp_path, model, fresh)
    want = {"a": 1.0, "b": 2.0}
    empty = 0
    for name, group in zip(now.split("|"), fresh.param_groups):
        if name == "e":
            empty += 1
            assert (group["lr"], group["weight_decay"]) == (0.1 * empty, 0.5), group
        else:
            assert (group["lr"], group["weight_decay"]) == (want[name], 0.0), group
    sum(p.sum() for p in model.values()).backward()
    fresh.step()  # every group has its hyperparameters


def test_moved_empty_group_is_refused_before_reading(tmp_path):
    """Moving an empty group made torch's set_state_dict fail after the model was loaded."""
    model = nn.Linear(4, 4, bias=False)
    opt = torch.optim.AdamW([{"params": []}, {"params": [model.weight]}])
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ck.save(tmp_path, model, opt, step=1)
    fresh = nn.Linear(4, 4, bias=False)
    before = fresh.weight.detach().clone()
    moved = torch.optim.AdamW([{"params": [fresh.weight]}, {"params": []}])
    with pytest.raises(ck.CheckpointError, match=r"group 1 is empty, and the saved empty group"):
        ck.load(tmp_path, fresh, moved)
    assert torch.equal(fresh.weight, before)
    # Two empty groups: torch's set_state_dict supports one, and raised after the read.
    two = torch.optim.AdamW([{"params": [model.weight]}, {"params": []}, {"params": []}])
    model(torch.ones(1, 4)).sum().backward()
    two.step()
    ck.save(tmp_path / "two", model, two, step=1)
    again = torch.optim.AdamW([{"params": [fresh.weight]}, {"params": []}, {"params": []}])
    with pytest.raises(ck.CheckpointError, match=r"more than one empty optimizer parameter group"):
        ck.load(tmp_path / "two", fresh, again)
    assert torch.equal(fresh.weight, before)


def test_unreadable_saved_param_groups_are_a_checkpoint_error(tmp_path):
    """DCP's CheckpointException is a BaseException: it escaped `except Exception` bare (and on
    several ranks rank 0 left the others waiting in a broadcast)."""
    step = ck.save(tmp_path, *_grouped("ab|c"), step=1)
    obj = ck.describe(step).objects["optim.param_groups.0.params"]
    with open(step / obj.file, "r+b") as f:
        f.seek(obj.file_offset)
        f.write(b"\x00" * obj.length)
    model, opt = _grouped("ab|c")
    with pytest.raises(ck.CheckpointError, match=r"the bytes of 'optim.param_groups.0.params'"):
        ck.load(tmp_path, model, opt)  # the checksum sees it first
    with pytest.raises(ck.CheckpointError, match=r"cannot read its optimizer parameter groups"):
        ck.load(tmp_path, model, opt, verify=False)


def test_save_into_a_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    # `load(root)` prefers the root's own .metadata over `latest`: the new save was never read.
    model = nn.Linear(4, 4)
    step = ck.save(tmp_path, model, step=1)
    with pytest.raises(
        ck.CheckpointError, match=r"is itself a checkpoint.*save into a checkpoint root"
    ):
        ck.save(step, model, step=2)
    assert sorted(p.name for p in step.iterdir()) == sorted(
        p.name for p in ck.save(tmp_path / "other", model, step=1).iterdir()
    )


def _saved_twice(root: Path, monkeypatch, exchange: bool):
    old, new = nn.Linear(4, 4), nn.Linear(4, 4)
    ck.save(root, old, step=1)
    if not exchange:
        monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    real = os.rename

    def dies_between_the_renames(a, b):
        if str(a).endswith(".tmp-step-00000001"):
            raise OSError(5, "EIO (simulated)")
        return real(a, b)

    monkeypatch.setattr(os, "rename", dies_between_the_renames)
    return old, new


def test_same_step_save_swaps_atomically(tmp_path: Path, monkeypatch) -> None:
    if not layout._exchange(tmp_path, tmp_path):  # renameat2 unsupported here: nothing to test
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this system")
    old, new = _saved_twice(tmp_path, monkeypatch, exchange=True)
    ck.save(tmp_path, new, step=1)  # the exchange does not rename: unaffected
    got = nn.Linear(4, 4)
    ck.load(tmp_path, got)
    assert torch.equal(got.weight, new.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def test_same_step_save_that_dies_between_renames_keeps_the_old_one(tmp_path, monkeypatch):
    old, new = _saved_twice(tmp_path, monkeypatch, exchange=False)
    with pytest.raises(ck.CheckpointError, match=r"committing .* failed.*latest"):
        ck.save(tmp_path, new, step=1)
    monkeypatch.undo()
    got = nn.Linear(4, 4)
    ck.load(tmp_path, got)  # `latest` names step-1: its swapped-out copy is read
    assert torch.equal(got.weight, old.weight)
    ck.save(tmp_path, new, step=2)  # puts the old step-1 back before clearing .tmp-*
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000001",
        "step-00000002",
    ]
    ck.load(tmp_path / "step-00000001", got)
    assert torch.equal(got.weight, old.weight)


def test_numbered_save_after_a_same_step_save_died_between_renames_comes_after_it(
    tmp_path, monkeypatch
):
    """save(step=None) numbered its step before putting back the swapped-out step-1 that `latest`
    names: it saw no complete step and wrote step-0, which `latest` then named, below step-1."""
    old, new = _saved_twice(tmp_path, monkeypatch, exchange=False)
    with pytest.raises(ck.CheckpointError, match=r"committing .* failed.*latest"):
        ck.save(tmp_path, new, step=1)
    monkeypatch.undo()
    assert ck.save(tmp_path, new).name == "step-00000002"
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    got = nn.Linear(4, 4)
    ck.load(tmp_path / "step-00000001", got)
    assert torch.equal(got.weight, old.weight)


@pytest.mark.parametrize("checksums", [True, False], ids=["crc32c", "older_save_without"])
def test_damaged_small_chunk_names_its_file_and_key(tmp_path: Path, checksums: bool) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))  # every chunk under 1 MB
    step = ck.save(tmp_path, model, step=1)
    if not checksums:  # as saved before checksums were written: the reader's own error
        manifest = json.loads((step / "grouped_ep.json").read_text())
        del manifest["checksums"], manifest["save_id"]
        (step / "grouped_ep.json").write_text(json.dumps(manifest))
        (step / "__0_crc32c.json").unlink()
    chunk = ck.describe(step).tensors["model.1.weight"].chunks[0]
    with open(step / chunk.file, "r+b") as f:
        f.seek(chunk.file_offset)
        f.write(b"\xff" * 64)
    match = (
        r"checking checksums failed: .*__0_0\.distcp: the bytes of 'model\.1\.weight'"
        if checksums
        else r"rank 0: OSError: .*__0_0\.distcp \(model\.1\.weight\)"
    )
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load(tmp_path, nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)))


def test_flipped_bit_in_tensor_data_is_refused_and_inspect_reports_it(tmp_path: Path) -> None:
    """DCP keeps no checksum: one flipped bit inside a tensor's bytes loaded silently (a weight
    off by 7e35 in a review) and `inspect` said OK. Now load refuses it before touching the
    model, naming the file and key, and `inspect` exits 1."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    step = ck.save(tmp_path, model, opt, step=1)
    assert (step / "__0_crc32c.json").is_file()
    cli = [sys.executable, "-m", "grouped_ep", "inspect", str(tmp_path), "--summary"]
    ok = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "match the CRC32C saved with them" in ok.stdout
    chunk = ck.describe(step).tensors["model.0.weight"].chunks[0]
    data = bytearray((step / chunk.file).read_bytes())
    at = data.find(model[0].weight.detach().numpy().tobytes(), chunk.file_offset)
    assert chunk.file_offset <= at < chunk.file_offset + chunk.length
    data[at + 1001] ^= 0x04  # one bit of one value, not the framing around it
    (step / chunk.file).write_bytes(bytes(data))
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    before = [p.clone() for p in fresh.parameters()]
    with pytest.raises(
        ck.CheckpointError,
        match=r"__0_0\.distcp: the bytes of 'model\.0\.weight' .* do not match the CRC32C",
    ):
        ck.load(tmp_path, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    assert not fresh_opt.state
    bad = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "'model.0.weight'" in bad.stdout
    ck.load(tmp_path, fresh, fresh_opt, verify=False)  # asked not to check: loads as it is
    assert not torch.equal(fresh[0].weight, model[0].weight)
    assert torch.equal(fresh[1].weight, model[1].weight)


@pytest.mark.parametrize(
    "table",
    [
        {"crc32c": None},
        {"crc32c": []},
        {"crc32c": {"__0_0.distcp": []}},
        {"crc32c": {"__0_0.distcp": [[0, 5]]}},
        {"crc32c": {"__0_0.distcp": [None]}},
        [],
    ],
    ids=["null", "list", "no_rows", "short_row", "null_row", "not_an_object"],
)
def test_malformed_checksum_file_is_a_checkpoint_error(tmp_path: Path, table) -> None:
    """Valid JSON of the wrong shape skipped the check (the damaged data loaded, `inspect` said
    OK) or raised bare AttributeError / ValueError / TypeError."""
    model = nn.Linear(8, 4)
    step = ck.save(tmp_path, model, step=1)
    (step / "__0_crc32c.json").write_text(json.dumps(table))
    with pytest.raises(ck.CheckpointError, match=r"checking checksums failed.*__0_crc32c\.json"):
        ck.load(tmp_path, nn.Linear(8, 4))


def test_sgd_group_without_momentum_resumes(tmp_path: Path) -> None:
    """SGD keeps no state for a group without momentum: load read everything, then torch's
    strict set_state_dict raised 'Missing optimizer state for parameter' after the model was
    filled."""

    def build(fill: float):
        model = nn.ParameterDict({n: nn.Parameter(torch.full((3,), fill)) for n in "sw"})
        opt = torch.optim.SGD(
            [{"params": [model["s"]], "lr": 0.1}, {"params": [model["w"]], "momentum": 0.9}],
            lr=0.2,
        )
        return model, opt

    model, opt = build(1.0)
    sum(p.sum() for p in model.values()).backward()
    opt.step()
    ck.save(tmp_path, model, opt, step=1)
    fresh, fresh_opt = build(0.0)
    ck.load(tmp_path, fresh, fresh_opt)
    assert all(torch.equal(fresh[n], model[n]) for n in "sw")
    assert torch.equal(fresh_opt.state[fresh["w"]]["momentum_buffer"], torch.ones(3))
    assert fresh["s"] not in fresh_opt.state


class _TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_load_refuses_a_tie_that_to_empty_split(tmp_path: Path) -> None:
    """A model whose head shares the embedding's weight, saved tied: `to_empty` of a meta build
    unties the two (any model, not only a transformers config's tie_word_embeddings). A load
    filled both copies and training moved them apart, silently; now refused before reading."""
    torch.manual_seed(0)
    ck.save(tmp_path, _TiedHead())
    with torch.device("meta"):
        model = _TiedHead()
    model.to_empty(device="cpu")
    assert model.head.weight is not model.embed.weight
    with torch.no_grad():
        model.embed.weight.fill_(3.0)
    with pytest.raises(ck.CheckpointError, match=r"embed\.weight = head\.weight .*to_empty"):
        ck.load(tmp_path, model)
    assert bool((model.embed.weight == 3.0).all())  # untouched
    model.head.weight = model.embed.weight
    ck.load(tmp_path, model)
    torch.manual_seed(0)
    assert torch.equal(model.head.weight, _TiedHead().embed.weight)


def test_flags_must_be_bools(tmp_path: Path) -> None:
    """verify=None skipped the checksums, async_save="no" saved in the background,
    max_shard_size=True wrote one file per tensor: each read by its truthiness."""
    model = _TiedHead()
    with pytest.raises(ValueError, match="save: async_save must be True or False, got 'no'"):
        ck.save(tmp_path, model, async_save="no")
    assert not list(tmp_path.iterdir())  # refused before anything was written
    ck.save(tmp_path, model)
    with pytest.raises(ValueError, match="load: verify must be True or False, got None"):
        ck.load(tmp_path, model, verify=None)
    with pytest.raises(ValueError, match="max_shard_size must be a size like '5GB' or an int"):
        ck.export_hf(model, tmp_path / "hf", max_shard_size=True)


def test_save_with_wrong_arguments_names_them_and_writes_nothing(tmp_path: Path) -> None:
    """`save(root, model, {"step": 5})` (extra= forgotten) or model and optimizer swapped gave an
    AttributeError from deep inside torch and left a `.tmp-step-*` behind."""
    model = _TiedHead()
    opt = torch.optim.AdamW(model.parameters())
    other = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    cases = [
        ((model, {"step": 5}), "optimizer must be a torch.optim.Optimizer or None, got dict"),
        ((opt, model), "model must be an nn.Module, got AdamW"),
        ((model, None, [1]), "extra must be a dict or None, got list"),
        ((model, other), r"optimizer holds tensors that are not the model.s parameters"),
    ]
    for args, message in cases:
        with pytest.raises(ck.CheckpointError, match=message):
            ck.save(tmp_path, *args)
        assert not list(tmp_path.iterdir()), args


def _tie_through_ddp(rank: int, world: int, root: str) -> list[bool]:
    from torch.nn.parallel import DistributedDataParallel

    refused = []
    for save_ddp, load_ddp in ((True, False), (False, True)):
        path = f"{root}/{save_ddp}-{load_ddp}"
        model = _TiedHead()
        ck.save(path, DistributedDataParallel(model) if save_ddp else model)
        with torch.device("meta"):
            fresh = _TiedHead()
        fresh.to_empty(device="cpu")  # unties
        try:
            ck.load(path, DistributedDataParallel(fresh) if load_ddp else fresh)
            refused.append(False)
        except ck.CheckpointError as e:
            refused.append("embed.weight = head.weight" in str(e))
    return refused


def test_split_tie_is_refused_through_ddp(tmp_path: Path) -> None:
    """The shared-tensor record used DDP's `module.` names: saved through DDP and loaded
    without (or the other way), a split tie loaded as two copies (a review)."""
    from _dist import run_ranks

    assert run_ranks(_tie_through_ddp, 1, str(tmp_path), timeout=120) == [[True, True]]


def test_load_names_arguments_of_the_wrong_kind(tmp_path: Path) -> None:
    """save named them; load gave a bare AttributeError ('StepLR' object has no attribute
    'state'; a review)."""
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    ck.save(tmp_path, model, opt, step=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ck.CheckpointError, match="load: optimizer must be a torch.optim.Optimizer"):
        ck.load(tmp_path, model, sched)
    with pytest.raises(ck.CheckpointError, match="load: model must be an nn.Module, got AdamW"):
        ck.load(tmp_path, opt, model)


def _half_loaded() -> nn.Module:
    """A model whose second layer is still on meta, as load_sharded(strict=False) leaves the
    tensors the checkpoint lacks."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].to_empty(device="meta")
    return model


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_of_a_model_on_meta_names_its_tensors_and_writes_nothing(tmp_path, async_save):
    """save failed late inside torch's writer naming no tensor; with async_save it raised a bare
    NotImplementedError and left .tmp-step-N behind (a review)."""
    with pytest.raises(
        ck.CheckpointError,
        match=r"save: the model's tensors are on the meta "
        r"device \(1\.weight, 1\.bias\).*report\.missing",
    ):
        ck.save(tmp_path, _half_loaded(), step=1, async_save=async_save)
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_model_on_meta_names_its_tensors(tmp_path: Path) -> None:
    with pytest.raises(
        ck.CheckpointError,
        match=r"export_hf: the model's tensors are on the "
        r"meta device \(1\.weight, 1\.bias\)",
    ):
        ck.export_hf(_half_loaded(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_async_save_whose_copy_fails_removes_its_partial_step(tmp_path, monkeypatch) -> None:
    """A failure while async_save copies the state (raised on the caller's rank, not as DCP's
    CheckpointException) skipped the removal of .tmp-step-N and was not a CheckpointError."""
    import grouped_ep.checkpoint.dcp as saver

    model = nn.Linear(4, 4)
    ck.save(tmp_path, model, step=1)

    def fail(*args, **kwargs):
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(saver.dcp, "async_save", fail)
    with pytest.raises(ck.CheckpointError, match="async save .* failed.*out of pinned memory"):
        ck.save(tmp_path, model, step=2, async_save=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest") == ["step-00000001"]
    assert layout.resolve(tmp_path).name == "step-00000001"


def test_a_path_starting_with_a_tilde_is_not_found_with_a_hint(tmp_path, monkeypatch) -> None:
    from grouped_ep import LoadError, load_sharded

    monkeypatch.setenv("HOME", str(tmp_path))
    model = nn.Linear(4, 4)
    ck.save(tmp_path / "run", model, step=1)
    with pytest.raises(ck.CheckpointError, match=r"'~' is not expanded: pass os\.path\.expanduser"):
        ck.load("~/run", model)
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file(model.state_dict(), str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(LoadError, match=r"not found \('~' is not expanded"):
        load_sharded(model, "~/hf")
    # Writing: a directory named '~' would be made in the working directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"save: root '~/new' starts with '~'"):
        ck.save("~/new", model, step=1)
    with pytest.raises(ck.CheckpointError, match=r"export_hf: dir '~/out' starts with '~'"):
        ck.export_hf(model, "~/out")
    assert not (tmp_path / "~").exists()
    with pytest.raises(ck.CheckpointError, match=r"a directory named '~root' would be made"):
        ck.save("~root/new", model, step=1)  # it named '~' (a review)
    # A name that only starts with '~' (no such user: expanduser leaves it), and './~', are
    # names: save refused them, its advice leading back to the same path (a review).
    for given, made in (("~nosuchuser_run1", "~nosuchuser_run1"), ("./~", "~")):
        ck.save(given, model, step=1)
        assert (tmp_path / made / "step-00000001").is_dir()
        ck.load(given, model)


def test_save_of_an_optimizer_without_state_runs_no_step(tmp_path: Path) -> None:
    """To give the state dict every key torch runs a step at lr 0; an optimizer that sets its
    own step size (transformers' Adafactor) then changed the parameters, and step hooks ran, on
    a save of an optimizer that had not stepped (a review)."""

    class OwnStepSize(torch.optim.Optimizer):  # ignores lr, as Adafactor's relative step does
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p]["seen"] = self.state[p].get("seen", 0) + 1
                        p.add_(0.5)

    model = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = OwnStepSize(model.parameters())
    steps = []
    handle = opt.register_step_pre_hook(lambda *args: steps.append(1))
    ck.save(tmp_path, model, opt, step=1)
    handle.remove()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert steps == [] and not opt.state
    assert all(p.grad is None for p in model.parameters())


def test_another_optimizer_class_is_named_as_the_misfit(tmp_path: Path) -> None:
    """An AdamW checkpoint loaded with SGD(momentum) said the checkpoint 'does not fit the
    model', one momentum_buffer line per parameter, and nothing of why (a review)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ck.save(tmp_path, model, opt, step=1)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        ck.CheckpointError,
        match=r"the optimizer does not: the checkpoint's optimizer kept exp_avg, exp_avg_sq, "
        r"step, this one keeps momentum_buffer",
    ):
        ck.load(tmp_path, fresh, sgd)
    ck.load(tmp_path, fresh)  # the weights alone, as the message says
    assert torch.equal(fresh[0].weight, model[0].weight)
    # Two optimizers (Muon's 2-D weights beside AdamW's experts): one root each
    with pytest.raises(ck.CheckpointError, match=r"one optimizer per checkpoint.*root of its own"):
        ck.save(tmp_path, model, [opt, sgd], step=2)


def test_a_root_name_too_long_or_a_full_disk_while_preparing_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch
) -> None:
    """Path.exists raises ENAMETOOLONG: save and export_hf raised a bare OSError. A disk that
    fills while the step directory is made left an empty `.tmp-step-N` (a review)."""
    import errno

    model = nn.Linear(2, 2)
    long = tmp_path / ("x" * 300)
    with pytest.raises(ck.CheckpointError, match="save: cannot prepare checkpoint root .*too long"):
        ck.save(long, model)
    with pytest.raises(ck.CheckpointError, match="export_hf: cannot create .*too long"):
        ck.export_hf(model, long)
    ck.save(tmp_path / "root", model, step=0)
    write_text = Path.write_text

    def full(self: Path, *args, **kwargs):
        if self.name == ".save_id":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(ck.CheckpointError, match=r"No space left .* MiB free .*`latest` is unch"):
        ck.save(tmp_path / "root", model, step=1)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["latest", "step-00000000"]


def test_extra_of_another_world_size_warns(tmp_path: Path) -> None:
    """Each rank's own `extra` (RNG states, data position), read at another world size: the
    ranks the saving run did not have got rank 0's, and the state of ranks now gone was
    dropped, silently (a review: ranks 0, 2 and 3 drew the same dropout masks)."""
    from grouped_ep.checkpoint.extra import extra_name, read_extra

    for r in range(2):
        torch.save({"rank": r}, tmp_path / extra_name(r))
    manifest = {"world_size": 2}
    with pytest.warns(UserWarning, match=r"rank 3 gets rank 0's extra state: .* saved by 2 ranks"):
        assert read_extra(tmp_path, 3, manifest, False, world=4) == {"rank": 0}
    with pytest.warns(UserWarning, match=r"extra state of ranks 1\.\.1 of the saving run is not"):
        assert read_extra(tmp_path, 0, manifest, False, world=1) == {"rank": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same world size, the same extra on every rank
        assert read_extra(tmp_path, 1, manifest, False, world=2) == {"rank": 1}  # (`step` alone:
        for r in range(2):  # a review), or extra on rank 0 alone: quiet
            torch.save({"step": 5}, tmp_path / extra_name(r))
        assert read_extra(tmp_path, 3, manifest, False, world=4) == {"step": 5}
        (tmp_path / extra_name(1)).unlink()
        assert read_extra(tmp_path, 3, manifest, False, world=4) == {"step": 5}
