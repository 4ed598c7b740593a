"""`make demo` in short form: the whole journey on 4 ranks (dp 2 x ep 2), resumed on 1, exported,
compared."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from grouped_ep._subprocess import run as run_group
from grouped_ep.demo.model import GLOBAL_BATCH, SEQ

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_end_to_end_short(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU demo, as in CI, also on a GPU machine
    cmd = [sys.executable, "-m", "grouped_ep.demo", "--steps", "3", "--resume-steps", "2"]
    proc = run_group(
        [*cmd, "--out", str(out), "--device", "cpu"],
        cwd=tmp_path,
        env=env,
        capture=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "logits max |diff| vs transformers" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    loads = summary["train"]["load"]
    assert [r["rank"] for r in loads] == [0, 1, 2, 3]
    for r in loads:  # each rank read exactly the bytes it owns
        assert r["bytes_read"] == r["bytes_owned"] > 0
    assert (summary["train"]["dp"], summary["train"]["ep"]) == (2, 2)
    assert summary["resume"]["world"] == 1
    losses = summary["train"]["losses"] + summary["resume"]["losses"]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # it trains, across the resume
    assert summary["export"]["logits_max_abs_diff"] <= 1e-4
    # Per-expert load: every routed copy of every step and rank counted once per layer.
    assert "layer 0 tokens per expert min / max" in proc.stdout
    for phase, steps in (("train", 3), ("resume", 2)):
        counts = summary[phase]["tokens_per_expert"]
        assert len(counts) == 3 and all(len(c) == 8 for c in counts)
        assert all(sum(c) == steps * GLOBAL_BATCH * SEQ * 2 for c in counts), (phase, counts)
    assert (out / "hf_export" / "model.safetensors.index.json").exists()


def test_demo_out_replaces_only_what_the_demo_made(tmp_path):
    # `--out` is emptied at the start: a directory holding anything else (the user's checkpoint
    # above all) is refused before anything is deleted.
    from grouped_ep.demo.__main__ import _MARK, _fresh_out

    mine = tmp_path / "work"
    (mine / "hf").mkdir(parents=True)
    (mine / "hf" / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(SystemExit, match="holds files the demo did not write"):
        _fresh_out(mine, None)
    with pytest.raises(SystemExit, match="is inside --out"):
        _fresh_out(mine, mine / "hf")
    assert (mine / "hf" / "model.safetensors").read_bytes() == b"weights"
    with pytest.raises(SystemExit, match="not a directory"):
        _fresh_out(mine / "hf" / "model.safetensors", None)
    demo = tmp_path / "demo"
    _fresh_out(demo, None)
    (demo / "summary.json").write_text("{}")
    (demo / "ckpt").mkdir()
    _fresh_out(demo, None)  # a directory of an earlier run: replaced
    assert sorted(p.name for p in demo.iterdir()) == [_MARK]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: no config.json there"),
        (["--steps", "0"], "--steps must be > 0"),
        (["--world-size", "0"], "--world-size must be > 0"),
        (["--world-size", "3"], "--world-size 3 must divide the global batch"),
        (["--world-size", "2", "--ep", "3"], "--ep 3 must divide the world size 2 and the 8"),
    ],
)
def test_demo_refuses_bad_arguments_before_touching_out(tmp_path, capsys, args, message):
    """They ended in a traceback on every rank, an IndexError in the summary, or a bare
    AssertionError, some after --out had been emptied."""
    from grouped_ep.demo.__main__ import main

    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as exit:
        main(["--out", str(out), *args])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
