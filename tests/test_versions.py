"""Other versions: checkpoints of other grouped_ep versions (the older checksum tables, zlib
CRC-32s of saves between 5fe8965 and 764c765, are checked, not taken for "no checksums"; a newer
format than this code reads is refused; a save from before shared tensors were recorded warns
where a split tie would show), and transformers releases older than 5.21, refused by name. The
old checkpoint layouts are rebuilt here from a current save, as those commits wrote them (a
review compared them with checkpoints the old commits saved, 2026-11-26)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from grouped_ep import checkpoint as ck
from grouped_ep.__main__ import main


def _model(fill: float) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * fill + i)
    return model


def _inspect(path: Path) -> subprocess.CompletedProcess:
    """`python -m grouped_ep inspect path --summary`, run in this process (a new one spends about
    5 s importing torch; the command's own process is tested in test_checkpoint)."""
    argv = ["inspect", str(path), "--summary"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _saved_with(root: Path, model: nn.Module, **manifest_changes) -> Path:
    """A save of `model` into `root` whose manifest then gets `manifest_changes`."""
    step = ck.save(root, model, step=1)
    manifest = json.loads((step / "grouped_ep.json").read_text())
    assert manifest["format"] == 2
    (step / "grouped_ep.json").write_text(json.dumps(manifest | manifest_changes))
    return step


def _refused(root: Path, pattern: str) -> None:
    """`load` from `root` raises a CheckpointError matching `pattern`, the model untouched."""
    fresh = _model(0.0)
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.load(root, fresh)
    for a, b in zip(fresh.parameters(), _model(0.0).parameters()):
        assert torch.equal(a, b)


def _as_crc32_era(step: Path) -> None:
    """Rewrite a current save's step as saves between 5fe8965 and 764c765 wrote it: manifest format
    1 with `"checksums": "crc32"` and no save id or "tied"; `__<r>_crc32.json` tables of zlib
    CRC-32s over the same spans."""
    for table_path in sorted(step.glob("__*_crc32c.json")):
        table = json.loads(table_path.read_text())["crc32c"]
        old = {}
        for name, rows in table.items():
            data = (step / name).read_bytes()
            old[name] = [[o, n, zlib.crc32(data[o : o + n])] for o, n, _ in rows]
        (step / table_path.name.replace("crc32c", "crc32")).write_text(json.dumps({"crc32": old}))
        table_path.unlink()
    manifest = json.loads((step / "grouped_ep.json").read_text())
    for key in ("save_id", "tied"):
        del manifest[key]
    manifest.update(format=1, checksums="crc32")
    (step / "grouped_ep.json").write_text(json.dumps(manifest))


def test_crc32_era_checkpoint_is_checked(tmp_path: Path) -> None:
    """HEAD loaded a flipped bit in such a checkpoint into the model without a word (it looked
    for CRC32C tables only), and `inspect` said it was saved without checksums."""
    saved = _model(1.0)
    step = ck.save(tmp_path, saved, step=3)
    _as_crc32_era(step)
    fresh = _model(0.0)
    ck.load(tmp_path, fresh)
    for a, b in zip(fresh.parameters(), saved.parameters()):
        assert torch.equal(a, b)
    good = _inspect(tmp_path)
    assert good.returncode == 0, good.stderr
    assert "OK: every chunk's bytes match the CRC-32 saved with them" in good.stdout

    chunk = ck.describe(step).tensors["model.0.weight"].chunks[0]
    with open(step / chunk.file, "r+b") as f:
        f.seek(chunk.file_offset + chunk.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    _refused(tmp_path, r"'model\.0\.weight'.* do not match the CRC-32")
    bad = _inspect(tmp_path)
    assert bad.returncode == 1 and "do not match the CRC-32" in bad.stdout + bad.stderr
    (step / "grouped_ep.json").unlink()  # tables without their manifest: refused, as CRC32C ones
    _refused(tmp_path, r"grouped_ep\.json is missing, but .*__0_crc32\.json")
    assert _inspect(tmp_path).returncode == 1


@pytest.mark.parametrize("value", [["crc32c"], "sha256", 7])
def test_unknown_checksums_value_is_refused_naming_the_manifest(tmp_path: Path, value) -> None:
    """A list there was a bare TypeError (unhashable); an unknown name counted as no checksums."""
    _saved_with(tmp_path, _model(1.0), checksums=value)
    _refused(tmp_path, r'grouped_ep\.json: "checksums" is .* does not know')
    bad = _inspect(tmp_path)
    assert bad.returncode == 1 and '"checksums" is' in bad.stderr


@pytest.mark.parametrize("fmt", [3, 99, "2", None])
def test_newer_or_unknown_format_is_refused(tmp_path: Path, fmt) -> None:
    """The manifest's format was written but never read: a checkpoint of a newer grouped_ep,
    whatever it had changed, loaded as if this code understood it."""
    step = _saved_with(tmp_path, _model(1.0), format=fmt)
    _refused(tmp_path, rf"checkpoint format {fmt!r}.* reads formats 1 to 2")
    bad = _inspect(tmp_path)
    assert (
        bad.returncode == 1
        and "error: inspect: " in bad.stderr
        and "reads formats 1 to 2" in bad.stderr
    )
    for data in step.glob("*.distcp"):  # a newer layout: the format is named, not the files
        data.rename(data.with_suffix(".newer"))
    _refused(tmp_path, r"checkpoint format .* reads formats 1 to 2")


def test_format_1_loads(tmp_path: Path) -> None:
    saved = _model(2.0)
    _saved_with(tmp_path, saved, format=1)
    fresh = _model(0.0)
    ck.load(tmp_path, fresh)
    assert torch.equal(fresh[0].weight, saved[0].weight)


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=False))
    model[1].weight = model[0].weight
    return model


def test_untracked_tie_warns_where_a_split_tie_would_show(tmp_path: Path) -> None:
    """A save from before "tied" was recorded: a head tied to the embedding at save and split by
    `to_empty` at load resumed as a separate copy without optimizer state, silently."""
    model = _tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    step = ck.save(tmp_path, model, opt, step=1)
    manifest = json.loads((step / "grouped_ep.json").read_text())
    assert manifest["tied"] == [["0.weight", "1.weight"]]
    split = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=False))  # the tie lost
    with pytest.raises(ck.CheckpointError, match="one shared tensor when the checkpoint was saved"):
        ck.load(tmp_path, split, torch.optim.AdamW(split.parameters(), lr=0.1))
    del manifest["tied"]  # as saves before 7f1aa23 wrote it
    (step / "grouped_ep.json").write_text(json.dumps(manifest))
    with pytest.warns(
        UserWarning, match=r"recorded shared tensors, .* optimizer state in it: 1\.weight\."
    ) as seen:
        ck.load(tmp_path, split, torch.optim.AdamW(split.parameters(), lr=0.1))
    assert seen[0].filename == __file__  # points at the call of load
    retied = _tied()  # shared again: nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.load(tmp_path, retied, torch.optim.AdamW(retied.parameters(), lr=0.1))
    assert torch.equal(retied[1].weight, model[0].weight)


def test_transformers_older_than_5_21_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    """On transformers 5.7 to 5.20 (a review, 2026-11-26) a model with a prefix change was a bare
    ImportError from inside the loader, and converters that merge tensors ran one tensor at a
    time (a LoadError with self-contradicting shapes; a transformers ValueError from export_hf)."""
    from _ckpt_helpers import meta_model, save_hf, tiny_qwen3_moe_config

    from grouped_ep import LoadError, load_sharded
    from grouped_ep.moe import ExpertLoadCounter

    config = tiny_qwen3_moe_config(experts=4, layers=1)
    path = save_hf(tmp_path / "hf", config)
    model, built = meta_model(config), meta_model(config).to_empty(device="cpu")

    def installed(version: str) -> None:  # building a model can replace the module object
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)

    installed("5.20.2")
    with pytest.raises(
        LoadError, match=r"load_sharded: .* needs transformers >= 5\.21, and transformers 5\.20\.2"
    ):
        load_sharded(model, path)
    assert model.lm_head.weight.is_meta  # untouched
    with pytest.raises(ck.CheckpointError, match=r"export_hf: .* needs transformers >= 5\.21"):
        ck.export_hf(built, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    installed("5.6.2")  # parallelize and the counter had blamed the model's experts class
    for wrapped in (built, torch.compile(built)):
        with pytest.raises(ValueError, match=r"ExpertLoadCounter: .* needs transformers >= 5\.21"):
            ExpertLoadCounter(wrapped)
    installed("5.21.0")
    load_sharded(model, path)  # the version alone was the refusal
    code = "import transformers; transformers.__version__ = '5.6.2'; import grouped_ep.hf"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert (
        "ImportError: import grouped_ep.hf: grouped_ep's transformers integration needs "
        in run.stderr
    )


def test_the_state_old_saves_made_for_an_unstepped_optimizer_warns(tmp_path: Path) -> None:
    """A save before ae712ba (2026-11-25) of an optimizer that had not stepped wrote the state
    torch's get_state_dict made by a step at lr 0: step 1, zero moments. It resumed so, without
    a word, and the first update came out 0.74x (a review). It is the one state such a save
    leaves that a real step does not (but for all-zero gradients): warned of."""
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():  # what the old save's step at lr 0 left: step 1, zero moments
        p.grad = torch.zeros_like(p)
    opt.step()
    step = ck.save(tmp_path, model, opt, step=1)
    manifest = json.loads((step / "grouped_ep.json").read_text())
    del manifest["tied"]  # as saves before 7f1aa23 (after ae712ba) wrote it
    (step / "grouped_ep.json").write_text(json.dumps(manifest))
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"optimizer.state.clear\(\) after this load") as seen:
        ck.load(tmp_path, model, fresh)
    assert seen[0].filename == __file__  # points at the call of load
    # A stepped optimizer's state, or this one in a save that records "tied": no warning.
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    for record_tied, stepped in ((False, True), (True, False)):
        root = tmp_path / f"r{int(record_tied)}"
        saved = ck.save(root, model, opt if stepped else fresh, step=1)
        if not record_tied:
            meta = json.loads((saved / "grouped_ep.json").read_text())
            del meta["tied"]
            (saved / "grouped_ep.json").write_text(json.dumps(meta))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.load(root, model, torch.optim.AdamW(model.parameters(), lr=0.1))
    # SGD's momentum buffer, zero after a step of zero gradients: it resumes as a fresh one
    # would (no step count to be off by one), so no warning.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    sgd.step()
    saved = ck.save(tmp_path / "sgd", model, sgd, step=1)
    meta = json.loads((saved / "grouped_ep.json").read_text())
    del meta["tied"]
    (saved / "grouped_ep.json").write_text(json.dumps(meta))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.load(tmp_path / "sgd", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


@pytest.mark.parametrize(
    "make, warned",
    [
        (lambda ps: torch.optim.Adamax(ps, lr=0.1), True),  # exp_inf made as eps: 0.53x
        (lambda ps: torch.optim.NAdam(ps, lr=0.1), True),  # mu_product made nonzero
        (lambda ps: torch.optim.RMSprop(ps, lr=0.1), False),  # its update ignores step: 1.00x
    ],
    ids=["Adamax", "NAdam", "RMSprop"],
)
def test_made_state_warning_is_exact_and_only_where_it_changes_the_update(tmp_path, make, warned):
    """The warning had looked for step 1 and zeros: silent for Adamax (its made exp_inf is eps;
    the first update resumed 0.53x) and NAdam, and it warned for RMSprop, whose update the
    made state does not change (a review). It now runs the class itself on a scratch one."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = nn.Linear(4, 3)
    opt = make(model.parameters())
    _init_optim_state(opt)  # what torch's get_state_dict did to an unstepped optimizer
    step = ck.save(tmp_path, model, opt, step=1)
    manifest = json.loads((step / "grouped_ep.json").read_text())
    del manifest["tied"]  # a save from before ae712ba
    (step / "grouped_ep.json").write_text(json.dumps(manifest))
    steps = []  # a user's global step hook: the scratch optimizers' steps must not reach it
    hook = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: steps.append(type(opt).__name__)
    )
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ck.load(tmp_path, model, make(model.parameters()))
    finally:
        hook.remove()
    assert any("optimizer.state.clear()" in str(w.message) for w in seen) == warned
    assert len(steps) == 1, steps  # torch's own lr-0 step that builds the state to read into
