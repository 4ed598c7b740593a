"""Ranks that pass `checkpoint.save` / `checkpoint.load` different things: each one's own
directory, different modes, different checkpoints or models. Every rank gets the same error
(no hang, nothing committed that a load would take as valid), and the same save read from
each rank's own copy still loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _ckpt_helpers import interrupt_outcome
from _dist import run_ranks
from test_checkpoint_dist import W_SHAPE, OneWeight
from torch import nn

from grouped_ep import checkpoint as ck


def _sharded() -> OneWeight:
    from torch.distributed.tensor import Shard

    return OneWeight((Shard(0),))


def _own_roots(rank: int, world: int, base: str) -> tuple[str, list[str]]:
    model = _sharded()
    ck.save(f"{base}/shared", model, keep_last=1)  # a good step first
    try:  # a node-local disk per rank: the same path names another directory on each
        ck.save(f"{base}/node{rank}", model, keep_last=1)
        error = ""
    except ck.CheckpointError as e:
        error = str(e)
    own = Path(f"{base}/node{rank}")  # only rank 0 makes the root
    return error, sorted(p.name for p in own.iterdir()) if own.exists() else []


def test_save_into_a_root_each_rank_sees_elsewhere_commits_nothing(tmp_path: Path) -> None:
    """Rank 0 made the step directory, each rank joined its name to its own root and wrote
    there; rank 0 committed a step holding its own data alone (and keep_last removed the last
    good one): a step load refused."""
    results = run_ranks(_own_roots, 2, str(tmp_path), timeout=120)
    for rank, (error, left) in enumerate(results):
        assert "the ranks do not share" in error and "failed on rank" in error, error
        assert "is not there on this rank" in error, error
        assert left == [], (rank, left)  # rank 0 removed its partial step; rank 1's was empty
    model = OneWeight(None)
    ck.load(tmp_path / "shared", model)  # the good step stays
    assert torch.equal(model.w, torch.arange(float(torch.Size(W_SHAPE).numel())).reshape(W_SHAPE))


def _mixed_modes(rank: int, world: int, root: str) -> list[str]:
    model = _sharded()
    errors = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs in (
        {"async_save": rank == 0},
        {"optimizer": opt if rank == 1 else None},
        {"step": 5 + rank},  # rank 0's was taken, silently (a review)
        {"keep_last": 1 if rank == 1 else None},
    ):
        try:
            handle = ck.save(root, model, **kwargs)
            if hasattr(handle, "result"):
                handle.result()
        except ck.CheckpointError as e:
            errors.append(str(e))
    ck.save(root, model)  # the ranks are still in step
    ck.save(root, model, opt)
    # load: these hung until the process group's timeout, then a bare gloo error (a review)
    for kwargs in ({"optimizer": opt if rank == 0 else None}, {"verify": rank == 0}):
        try:
            ck.load(root, model, **kwargs)
        except ck.CheckpointError as e:
            errors.append(str(e))
    ck.load(root, model)  # still in step
    # extra on rank 0 alone names the step there, as documented (refused for a while: a review)
    named = ck.save(root, model, extra={"step": 100} if rank == 0 else None).name
    return errors + [named]


def test_ranks_that_save_in_different_modes_are_refused(tmp_path: Path) -> None:
    """async_save on one rank and not another hung until the process group's timeout (their
    collectives run on different groups); an optimizer on one rank only failed in DCP."""
    for errors in run_ranks(_mixed_modes, 2, str(tmp_path), timeout=120):
        errors, named = errors[:-1], errors[-1]
        assert named == "step-00000100"
        assert len(errors) == 6, errors
        assert all("differ between ranks" in e for e in errors), errors
        assert "rank 0: (True, False, None, None); rank 1: (False, False, None, None)" in errors[0]
        assert "rank 0: (False, False, 5, None); rank 1: (False, False, 6, None)" in errors[2]
        assert "rank 0: (False, False, None, None); rank 1: (False, False, None, 1)" in errors[3]
        assert "load: whether an optimizer is given and verify" in errors[4]
        assert "rank 0: (True, True); rank 1: (False, True)" in errors[4]
        assert "rank 0: (False, True); rank 1: (False, False)" in errors[5]
    assert ck.resolve(tmp_path) == tmp_path / "step-00000100"


def _different_checkpoints(rank: int, world: int, root: str) -> tuple[str, bool]:
    model = _sharded()
    ck.save(root, model)
    with torch.no_grad():
        model.w.mul_(2)
    ck.save(root, model)
    torch.distributed.barrier()
    if rank == 1:  # the same save, copied to a node's own disk
        shutil.copytree(f"{root}/step-00000001", f"{root}-copy")
    torch.distributed.barrier()
    fresh = _sharded()
    try:
        ck.load(f"{root}/step-0000000{rank}", fresh)  # rank 0 step 0, rank 1 step 1
        error = ""
    except ck.CheckpointError as e:
        error = str(e)
    ck.load(f"{root}/step-00000001" if rank == 0 else f"{root}-copy", fresh)
    return error, torch.equal(fresh.w.full_tensor(), model.w.full_tensor())


def test_ranks_must_load_the_same_save_but_may_read_their_own_copy(tmp_path: Path) -> None:
    """Rank 0 resolved the path and every rank read rank 0's checkpoint: another rank's path
    was dropped without a word. Each rank now reads its own; they must be one save."""
    root = str(tmp_path / "ckpt")
    for error, equal in run_ranks(_different_checkpoints, 2, root, timeout=120):
        assert "load: the checkpoints that path names differ between ranks" in error, error
        assert "step-00000000" in error and "step-00000001" in error, error
        assert equal


def _other_model_on_rank_1(rank: int, world: int, root: str) -> tuple[str, bool]:
    from torch.distributed.tensor import DTensor

    ck.save(root, _sharded())
    model = _sharded()
    if rank == 1:
        model.w = torch.nn.Parameter(torch.zeros(3, 3))  # another shape on this rank only
    mine = model.w.to_local() if isinstance(model.w, DTensor) else model.w
    before = mine.detach().clone()
    try:
        ck.load(root, model)
        error = ""
    except ck.CheckpointError as e:
        error = str(e)
    return error, torch.equal(before, mine)


def test_a_rank_whose_model_does_not_fit_is_named_before_anything_is_read(tmp_path) -> None:
    """Only rank 0's model was checked: another rank's mismatch came from DCP's read, worded
    'the model and optimizer may be partly loaded'."""
    for error, untouched in run_ranks(_other_model_on_rank_1, 2, str(tmp_path), timeout=120):
        assert "checking the model against the checkpoint failed on rank" in error, error
        assert "partly loaded" not in error and untouched


def test_ctrl_c_during_a_save_is_a_keyboard_interrupt(tmp_path: Path, monkeypatch) -> None:
    """DCP wraps every rank's failure, Ctrl-C included, into a CheckpointException; it came
    out as a CheckpointError (a ValueError), which a loop that logs failed saves swallows."""
    import grouped_ep.checkpoint.dcp as dcp_module

    model = OneWeight(None)
    ck.save(tmp_path, model)

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp_module.ChecksumWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save(tmp_path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000000"]
    monkeypatch.undo()


def test_ctrl_c_during_a_load_is_a_keyboard_interrupt(tmp_path: Path, monkeypatch) -> None:
    """It came out as a CheckpointError: a resume loop that starts afresh when no checkpoint
    loads then trained a partly loaded model on (a review: 3 of 8 tensors loaded)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ck.save(tmp_path, saved)
    commit = DefaultLoadPlanner.commit_tensor

    def interrupted_after_one(self, read_item, tensor):
        commit(self, read_item, tensor)
        raise KeyboardInterrupt

    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        ck.load(tmp_path, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def _interrupt_inside_torch_save(self, plan, planner):
    try:  # as torch.save's zip writer turned it: a RuntimeError, the Ctrl-C its context
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None


@pytest.mark.parametrize("where", ["inside_torch_save", "write_extra", "commit"])
def test_ctrl_c_anywhere_in_a_save_leaves_no_partial_step(tmp_path: Path, monkeypatch, where):
    """A review: Ctrl-C while `extra` was written or while rank 0 committed left the partial
    `.tmp-step-N` on disk (a whole checkpoint's worth, in the commit), and one inside torch.save
    came back as a CheckpointError, its KeyboardInterrupt only the RuntimeError's context."""
    import grouped_ep.checkpoint.dcp as dcp_module

    model = OneWeight(None)
    ck.save(tmp_path, model, extra={"step": 0})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "inside_torch_save":
        monkeypatch.setattr(dcp_module.ChecksumWriter, "write_data", _interrupt_inside_torch_save)
    else:
        monkeypatch.setattr(
            dcp_module, "write_extra" if where == "write_extra" else "describe", interrupted
        )
    with pytest.raises(KeyboardInterrupt):
        ck.save(tmp_path, model, extra={"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000000"]


def _unreadable_on_rank_1(rank: int, world: int, root: str) -> str:
    from unittest import mock

    ck.save(root, _sharded())
    is_file = Path.is_file

    def denied(self: Path) -> bool:  # rank 1 may not look inside the step directory
        if rank == 1 and self.name == "grouped_ep.json":
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    with mock.patch.object(Path, "is_file", denied):
        try:
            ck.load(root, _sharded())
        except ck.CheckpointError as e:
            return str(e)
    return ""


def test_a_step_one_rank_cannot_read_is_an_error_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's PermissionError escaped before the collective check: rank 0 waited in it until
    the process group's timeout (30 minutes on gloo by default)."""
    for error in run_ranks(_unreadable_on_rank_1, 2, str(tmp_path), timeout=120):
        assert "finding the checkpoint" in error and "failed on rank" in error, error
        assert "grouped_ep.json" in error and "Permission denied" in error, error


def _interrupted_commit_rank(rank: int, world: int, root: str) -> str:
    from unittest import mock

    import grouped_ep.checkpoint.dcp as dcp_module

    model = _sharded()
    ck.save(root, model)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with mock.patch.object(dcp_module, "describe", interrupted):  # rank 0's commit
        return interrupt_outcome(lambda: ck.save(root, model), "saved")


def test_ctrl_c_while_rank_0_commits_reaches_every_rank(tmp_path: Path) -> None:
    """Rank 0 removed the partial step and raised the KeyboardInterrupt without telling the
    others: they waited in the broadcast until its process died, then failed with gloo's bare
    "Connection closed by peer" (newcode11 review)."""
    got = run_ranks(_interrupted_commit_rank, 2, str(tmp_path), timeout=120)
    assert got[0] == "KeyboardInterrupt"
    assert "KeyboardInterrupt on rank 0 (interrupted)" in got[1], got[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000000"]


def _dtensor_in_extra(rank: int, world: int, root: str) -> tuple[str, bool, bool]:
    import grouped_ep.checkpoint.save_args as save_args

    model = _sharded()
    ema = {"w": model.w.detach().clone()}  # a DTensor, as the parameters are
    try:
        ck.save(f"{root}/refused", model, step=1, extra={"ema": ema})
        error = ""
    except ck.CheckpointError as e:
        error = str(e)
    # A checkpoint an earlier version let through: its load failed in torch.load ("Callable
    # map_location not supported"), the weights included.
    keep, save_args._refuse_dtensors = save_args._refuse_dtensors, lambda obj, where: None
    try:
        ck.save(f"{root}/old", model, step=1, extra={"ema": ema})
    finally:
        save_args._refuse_dtensors = keep
    extra = ck.load(f"{root}/old", model)
    back = extra["ema"]["w"]
    return (
        error,
        torch.equal(back.to_local(), ema["w"].to_local()),
        Path(f"{root}/refused").exists(),
    )


def test_a_dtensor_in_extra_is_refused_and_an_old_checkpoint_holding_one_loads(tmp_path: Path):
    """An EMA of a sharded model's parameters in `extra` saved, then no load of that step worked
    (torch.load refused the callable map_location for a DTensor; a review). save refuses one,
    naming it, before anything is written; a step that holds one loads."""
    for error, equal, made in run_ranks(_dtensor_in_extra, 2, str(tmp_path), timeout=120):
        assert "save: extra['ema']['w'] is a DTensor" in error, error
        assert equal and not (made and any((tmp_path / "refused").glob("step-*")))
