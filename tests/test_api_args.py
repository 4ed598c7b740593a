"""The public API called the way users mistype it: each mistake is an error naming the function
and the argument, raised before any work, never an AttributeError or pathlib's TypeError from
inside (a review of the API surface, 2026-11-28)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from grouped_ep import LoadError, load_sharded
from grouped_ep.checkpoint import CheckpointError, describe, export_hf, load, save
from grouped_ep.moe import ExpertLoadCounter, MoE, set_aux_loss_scale, update_expert_bias
from grouped_ep.moe.dispatch import LocalDispatcher, Routing


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def test_functions_taking_a_model_name_it_when_given_something_else(tmp_path):
    opt = _optimizer()
    with pytest.raises(CheckpointError, match=r"export_hf: model must be an nn.Module, got str"):
        export_hf(str(tmp_path / "hf"), nn.Linear(2, 2))  # the arguments swapped
    with pytest.raises(CheckpointError, match="export_hf: model must be an nn.Module, got SGD"):
        export_hf(opt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    for call, name in (
        (lambda: set_aux_loss_scale(opt, 0.5), "set_aux_loss_scale"),
        (lambda: update_expert_bias(opt), "update_expert_bias"),
        (lambda: ExpertLoadCounter(opt), "ExpertLoadCounter"),
    ):
        with pytest.raises(TypeError, match=rf"{name}: model must be an nn.Module, got SGD"):
            call()


def test_parallelize_names_a_model_that_is_not_a_module():
    pytest.importorskip("transformers")
    import grouped_ep.hf

    with pytest.raises(TypeError, match="parallelize: model must be an nn.Module, got SGD"):
        grouped_ep.hf.parallelize(_optimizer(), None)


def test_empty_and_mistyped_paths_are_refused_naming_the_argument(tmp_path, monkeypatch):
    # "" is the working directory: an unset CKPT_DIR saved step-N and `latest` there, and load
    # and load_sharded read from it.
    monkeypatch.chdir(tmp_path)
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"save: root is empty"):
        save("", model)
    with pytest.raises(CheckpointError, match=r"checkpoint path is empty"):
        load("", model)
    with pytest.raises(CheckpointError, match=r"checkpoint path is empty"):
        describe("")
    with pytest.raises(LoadError, match=r"load_sharded: checkpoint is empty"):
        load_sharded(model, "")
    with pytest.raises(CheckpointError, match=r"export_hf: dir is empty"):
        export_hf(model, "")
    assert os.listdir(tmp_path) == []  # nothing written into the working directory
    with pytest.raises(CheckpointError, match=r"save: root must be a str or os.PathLike, got None"):
        save(None, model)
    with pytest.raises(TypeError, match=r"load_sharded: checkpoint must be a str or os.PathLike"):
        load_sharded(model, b"hf")
    with pytest.raises(TypeError, match=r"checkpoint path must be a str or os.PathLike, got None"):
        describe(None)
    with pytest.raises(TypeError, match=r"export_hf: dir must be a str or os.PathLike, got None"):
        export_hf(model, None)


def test_max_shard_size_takes_no_float(tmp_path):
    # 1.5 was str(1.5) read as 1.5 bytes: a file per tensor.
    with pytest.raises(ValueError, match=r"max_shard_size must be a size like '5GB' or an int"):
        export_hf(nn.Linear(2, 2), tmp_path / "hf", max_shard_size=1.5)
    assert not (tmp_path / "hf").exists()


def test_moe_arguments_of_the_wrong_kind_are_named():
    with pytest.raises(TypeError, match=r"MoE: dtype must be a floating torch.dtype or None"):
        MoE(16, 32, 4, 2, dtype="bfloat16")
    with pytest.raises(TypeError, match=r"MoE: dtype must be a floating torch.dtype or None"):
        MoE(16, 32, 4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"MoE: dispatcher must be an object with dispatch"):
        MoE(16, 32, 4, 2, dispatcher=LocalDispatcher)  # the class, not an instance
    moe = MoE(16, 32, 4, 2, dispatcher=LocalDispatcher())
    with pytest.raises(TypeError, match=r"MoE: x must be a Tensor \[..., H\], got list"):
        moe([[0.0] * 16])


def test_routing_takes_int32_expert_ids():
    ids = torch.tensor([[0, 2], [1, 2], [3, 0]])
    weights = torch.rand(3, 2)
    want = Routing.from_topk(ids, weights, 4)
    got = Routing.from_topk(ids.int(), weights, 4)  # failed inside scatter
    assert got.expert_ids.dtype == torch.int64
    assert torch.equal(got.counts, want.counts) and torch.equal(got.expert_ids, want.expert_ids)
    with pytest.raises(TypeError, match=r"Routing: expert_ids must be integers, got torch.float32"):
        Routing.from_topk(ids.float(), weights, 4)


def test_subpackages_are_attributes_of_the_package():
    # The README writes grouped_ep.checkpoint.save, grouped_ep.parallel.clip_grad_norm_: after
    # `import grouped_ep` alone they were AttributeErrors. They load on first use, so the
    # import itself still pulls in neither transformers nor DCP.
    from _child import child_error

    out = child_error(
        "import sys, grouped_ep\n"
        "assert 'transformers' not in sys.modules\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules\n"
        "assert {'checkpoint', 'parallel', 'nn', 'moe'} <= set(dir(grouped_ep))\n"
        "print(grouped_ep.checkpoint.save.__name__, grouped_ep.parallel.clip_grad_norm_.__name__,"
        " grouped_ep.nn.MoE.__name__)\n"
        "grouped_ep.no_such_thing\n"
    ).splitlines()
    assert out == [
        "save clip_grad_norm_ MoE",
        "module 'grouped_ep' has no attribute 'no_such_thing'",
    ]


def test_introspection_works_without_transformers():
    """With transformers missing, hasattr(grouped_ep, "hf"), help() and inspect.getmembers
    raised ModuleNotFoundError through the lazy attributes (a review)."""
    from _child import child_error

    out = child_error(
        "import sys, inspect\n"
        "sys.modules['transformers'] = None\n"
        "import grouped_ep\n"
        "print(hasattr(grouped_ep, 'hf'), 'hf' in dir(grouped_ep), len(inspect.getmembers(grouped_ep)) > 10)\n"
        "print(grouped_ep.checkpoint.save.__name__)\n"
    ).splitlines()
    assert out == ["False False True", "save"], out


def test_the_default_progress_bar_is_drawn_by_local_rank_0_only(monkeypatch):
    """torchrun gives every local rank its terminal: at 8 ranks a node, 8 bars wrote over each
    other on one line (a review)."""
    from grouped_ep.loading import read

    monkeypatch.setattr(read.sys.stderr, "isatty", lambda: True, raising=False)
    shown = {}
    for local in ("0", "1", "7"):
        monkeypatch.setenv("LOCAL_RANK", local)
        shown[local] = read.Progress(10, None).on
    assert shown == {"0": True, "1": False, "7": False}
    monkeypatch.delenv("LOCAL_RANK")
    assert read.Progress(10, None).on  # one process, no process group
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert read.Progress(10, True).on and not read.Progress(10, False).on  # as asked


def test_saves_loads_and_exports_are_logged_at_info(tmp_path, caplog):
    """Nothing went to the log: an operator could not see when a save finished, what keep_last
    removed, or which step a resume read (a review). INFO records under "grouped_ep", silent
    unless logging is configured."""
    import logging

    model = nn.Linear(4, 3)
    with caplog.at_level(logging.INFO, logger="grouped_ep"):
        for _ in range(3):
            save(tmp_path / "ck", model, keep_last=2)
        load(tmp_path / "ck", model)
        export_hf(model, tmp_path / "hf")
        load_sharded(model, tmp_path / "hf")
    got = [(r.name, r.getMessage()) for r in caplog.records if r.name.startswith("grouped_ep")]
    assert [n for n, _ in got] == [
        "grouped_ep.checkpoint.dcp",
        "grouped_ep.checkpoint.dcp",
        "grouped_ep.checkpoint.dcp",
        "grouped_ep.checkpoint.resume",
        "grouped_ep.checkpoint.export",
        "grouped_ep.loading.load",
    ], got
    assert "save: step 2 committed as" in got[2][1] and "removed step-00000000" in got[2][1]
    assert "step-00000002 read into the model" in got[3][1]
    assert "export_hf: 2 tensors" in got[4][1] and "load_sharded: 2 tensors" in got[5][1]
