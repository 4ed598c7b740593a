"""What a checkpoint's files must agree on before `load` reads them, and how a save that fails
or half-succeeds is reported: the manifest, the checksum tables and the per-rank `extra` files
come from one save; a failed save removes its partial step; a committed save whose pruning
failed says it was committed; an async commit failure reaches every rank."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn

import grouped_ep.checkpoint.dcp as dcp_module
from grouped_ep import checkpoint as ck


def _model(fill: float) -> nn.Linear:
    model = nn.Linear(16, 8)
    with torch.no_grad():
        model.weight.fill_(fill)
        model.bias.fill_(fill)
    return model


def _inspect(path: Path) -> subprocess.CompletedProcess:
    cli = [sys.executable, "-m", "grouped_ep", "inspect", str(path), "--summary"]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120)


def test_deleted_manifest_does_not_turn_the_checks_off(tmp_path: Path) -> None:
    """Without the manifest, nothing said to check the CRCs: zeros written into a tensor's bytes
    loaded silently. A step with checksum tables but no manifest is now refused."""
    step = ck.save(tmp_path, _model(1.0), step=1)
    (step / "grouped_ep.json").unlink()
    fresh = _model(0.0)
    with pytest.raises(ck.CheckpointError, match=r"grouped_ep\.json is missing, but .* checksum"):
        ck.load(tmp_path, fresh)
    assert torch.equal(fresh.weight, torch.zeros(8, 16))
    bad = _inspect(tmp_path)
    assert bad.returncode == 1 and "grouped_ep.json is missing" in bad.stderr


def test_manifest_without_its_checksums_entry_is_still_checked(tmp_path: Path) -> None:
    step = ck.save(tmp_path, _model(1.0), step=1)
    manifest = json.loads((step / "grouped_ep.json").read_text())
    del manifest["checksums"]
    (step / "grouped_ep.json").write_text(json.dumps(manifest))
    chunk = ck.describe(step).tensors["model.weight"].chunks[0]
    with open(step / chunk.file, "r+b") as f:
        f.seek(chunk.file_offset + chunk.length - 64)
        f.write(bytes(64))
    with pytest.raises(ck.CheckpointError, match=r"'model\.weight' .* do not match the CRC32C"):
        ck.load(tmp_path, _model(0.0))


def test_files_of_another_save_are_refused(tmp_path: Path) -> None:
    """A data file with its checksum table, or an `extra` file, copied in from another
    checkpoint matched their own checksums and loaded as this checkpoint's."""
    a = ck.save(tmp_path / "a", _model(1.0), extra={"samples": 1000}, step=1)
    b = ck.save(tmp_path / "b", _model(2.0), extra={"samples": 2000}, step=1)
    mixed = tmp_path / "mixed"
    shutil.copytree(a, mixed)
    for name in ("__0_0.distcp", "__0_crc32c.json"):
        shutil.copy(b / name, mixed / name)
    fresh = _model(0.0)
    with pytest.raises(ck.CheckpointError, match=r"__0_crc32c\.json: written by another save"):
        ck.load(mixed, fresh)
    assert torch.equal(fresh.weight, torch.zeros(8, 16))
    assert _inspect(mixed).returncode == 1

    mixed = tmp_path / "mixed_extra"
    shutil.copytree(a, mixed)
    shutil.copy(b / "extra-rank00000.pt", mixed / "extra-rank00000.pt")
    with pytest.raises(ck.CheckpointError, match=r"extra-rank00000\.pt: its bytes do not match"):
        ck.load(mixed, fresh)
    bad = _inspect(mixed)
    assert bad.returncode == 1 and "extra-rank00000.pt" in bad.stdout
    assert ck.load(a, fresh) == {"samples": 1000}
    assert torch.equal(fresh.weight, torch.ones(8, 16))


def test_a_job_whose_root_another_job_saved_into_since_is_refused(tmp_path) -> None:
    """Two jobs into one root whose saves do not overlap (a requeued job beside its first
    instance): each replaced the other's steps, both reported success, and a resume loaded the
    other job's weights (a review). A process that saved into a root refuses to save again
    once another process's step is the latest; a process's first save takes the root over."""
    ck.save(tmp_path, _model(1.0), step=1)
    other = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from grouped_ep import checkpoint as ck\n"
        "m = nn.Linear(16, 8)\n"
        "torch.nn.init.constant_(m.weight, 2.0)\n"
        "print(ck.save(sys.argv[1], m, step=2).name)\n"  # its first save there: taken over
    )
    run = subprocess.run(
        [sys.executable, "-c", other, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "step-00000002", run.stderr
    with pytest.raises(ck.CheckpointError, match=r"another job saved .*step-00000002 after this"):
        ck.save(tmp_path, _model(1.0), step=2)  # would have replaced the other job's step 2
    assert ck.resolve(tmp_path).name == "step-00000002"
    fresh = _model(0.0)
    ck.load(tmp_path, fresh)
    assert torch.equal(fresh.weight, torch.full((8, 16), 2.0))  # the other job's, untouched
    manifest = json.loads((tmp_path / "step-00000002" / "grouped_ep.json").read_text())
    assert {"run", "host", "pid"} <= manifest["writer"].keys()
    # Having loaded that step, this process continues it: not a second writer (a review).
    ck.save(tmp_path, _model(3.0), step=3)
    assert ck.resolve(tmp_path).name == "step-00000003"


def test_a_forked_job_is_a_writer_of_its_own() -> None:
    """The writer's identity was made at import: jobs forked from one parent shared it, and
    their manifests named the parent's pid (a review)."""
    import multiprocessing as mp
    import os

    from grouped_ep.checkpoint import writer

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put((dict(writer.WRITER), os.getpid())))
    child.start()
    got, pid = queue.get(timeout=60)
    child.join(timeout=60)
    assert got["pid"] == pid != writer.WRITER["pid"]
    assert got["run"] != writer.WRITER["run"]


def test_a_second_writer_into_one_root_is_refused_while_the_first_saves(tmp_path) -> None:
    """Two saves into one root at once (a requeued job whose first instance still runs): the
    second removed the first's step directory under it, and both reported saves that `load`
    then refused (crash review). The first holds the root's lock until its commit."""
    import fcntl

    ck.save(tmp_path, _model(1.0), step=1)
    with open(tmp_path / ".save-lock", "w") as held:  # another process's save, in flight
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ck.CheckpointError, match=r"another save into .* is in progress"):
            ck.save(tmp_path, _model(2.0), step=2)
        with pytest.raises(ck.CheckpointError, match=r"another save into"):
            ck.save(tmp_path, _model(2.0), step=2, async_save=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            ".save-lock",
            "latest",
            "step-00000001",
        ]
    # The holder gone (a process that dies drops it too), the next save takes it and removes it.
    (tmp_path / "latest.tmp-12345").write_text("step-0000")  # a `latest` write that died
    ck.save(tmp_path, _model(2.0), step=2, async_save=True).result()
    ck.save(tmp_path, _model(3.0), step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        *(f"step-0000000{i}" for i in (1, 2, 3)),
    ]
    fresh = _model(0.0)
    ck.load(tmp_path, fresh)
    assert torch.equal(fresh.weight, torch.full((8, 16), 3.0))


def test_a_full_disk_behind_the_zip_writers_error_is_named(tmp_path, monkeypatch) -> None:
    """torch.save's zip writer on a full disk says "unexpected pos 704 vs 598", the ENOSPC only
    in its context: the message names it (crash review)."""

    def full(self, plan, planner):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        except OSError:
            raise RuntimeError(  # noqa: B904 (torch's writer: the OSError only as context)
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )

    monkeypatch.setattr(dcp_module.ChecksumWriter, "write_data", full)
    with pytest.raises(
        ck.CheckpointError,
        match=r"unexpected pos 704 vs 598 \(caused by OSError: \[Errno 28\] No space",
    ):
        ck.save(tmp_path, _model(2.0), step=2)


def test_a_latest_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    import grouped_ep.checkpoint.layout as layout

    ck.save(tmp_path, _model(1.0), step=1)
    real = layout.os.replace

    def full(src, dst):
        if Path(dst).name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(layout.os, "replace", full)
    with pytest.raises(ck.CheckpointError, match=r"step-00000001 is complete and holds this save"):
        ck.save(tmp_path, _model(2.0), step=1)  # the same step again: the new copy is in place
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    fresh = _model(0.0)
    ck.load(tmp_path, fresh)
    assert torch.equal(fresh.weight, torch.full((8, 16), 2.0))


def test_failed_save_removes_its_partial_step_and_says_the_space(tmp_path, monkeypatch) -> None:
    """A save that hit a full disk left its partial `.tmp-step-N` behind (the disk stayed full
    until the next save) with the writer's message only."""
    ck.save(tmp_path, _model(1.0), step=1)

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(dcp_module.ChecksumWriter, "write_data", full)
    with pytest.raises(
        ck.CheckpointError,
        match=r"failed \(the partial step was removed; \d+ MiB free .*latest.*No space left",
    ):
        ck.save(tmp_path, _model(2.0), step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    monkeypatch.undo()
    fresh = _model(0.0)
    ck.load(tmp_path, fresh)
    assert torch.equal(fresh.weight, torch.ones(8, 16))


def test_committed_save_whose_pruning_fails_says_it_was_committed(tmp_path, monkeypatch) -> None:
    """The save raised a bare PermissionError although `latest` already named the new step."""
    ck.save(tmp_path, _model(1.0), step=1)

    def denied(root, keep_last):
        raise PermissionError(errno.EACCES, "Permission denied", str(root / "step-00000001"))

    monkeypatch.setattr(dcp_module, "prune", denied)
    with pytest.warns(
        UserWarning, match=r"step-00000002 is committed .* keep_last=1 failed"
    ) as seen:
        path = ck.save(tmp_path, _model(2.0), step=2, keep_last=1)
    assert seen[0].filename == __file__  # points at the call of save
    assert path == tmp_path / "step-00000002" and ck.resolve(tmp_path) == path
    with pytest.warns(UserWarning, match="is committed"):
        ck.save(tmp_path, _model(3.0), step=3, keep_last=1, async_save=True).result()
    monkeypatch.undo()
    ck.save(tmp_path, _model(4.0), step=4)  # nothing of the async save is raised again
    fresh = _model(0.0)
    ck.load(tmp_path / "step-00000003", fresh)
    assert torch.equal(fresh.weight, torch.full((8, 16), 3.0))


def _two_ranks(rank: int, world: int, root: str) -> dict:
    import grouped_ep.checkpoint.layout as layout

    out = {}
    # One replicated tensor on two ranks: rank 1 writes an empty data file with no checksums,
    # which every load refused ("no well-formed checksums for __1_0.distcp").
    single = nn.Linear(4, 4, bias=False)
    ck.save(Path(root) / "single", single, step=1)
    ck.load(Path(root) / "single", single)
    out["single_sizes"] = sorted(
        p.stat().st_size for p in (Path(root) / "single/step-00000001").glob("*.distcp")
    )
    model = _model(float(rank + 1))
    ck.save(root, model, extra={"rank": rank}, step=1)
    # A missing `extra` file of a rank the saving run had: rank 1 was handed rank 0's.
    dist.barrier()
    if rank == 0:
        (Path(root) / "step-00000001" / "extra-rank00001.pt").unlink()
    dist.barrier()
    try:
        ck.load(root, model)
        out["missing_extra"] = "loaded"
    except ck.CheckpointError as e:
        out["missing_extra"] = str(e)
    # An async save whose commit fails on rank 0: rank 1's result() returned the step as saved.
    real = layout.write_text_atomic

    def failing(path, text):
        if path.name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    layout.write_text_atomic = failing
    handle = ck.save(root, model, step=2, async_save=True)
    try:
        out["async"] = f"returned {handle.result()}"
    except ck.CheckpointError as e:
        out["async"] = str(e)
    layout.write_text_atomic = real
    out["step2_in_place"] = ck.resolve(Path(root) / "step-00000002").name  # complete, loadable
    ck.save(root, model, step=3)  # the failure was read: nothing is raised again
    out["latest"] = ck.resolve(root).name
    # `extra` given on rank 0 only: every rank gets rank 0's (the last change made this
    # checkpoint unloadable: "extra-rank00001.pt is missing").
    ck.save(root, model, extra={"step": 4} if rank == 0 else None, step=4)
    out["rank0_extra"] = ck.load(root, model)
    # A save failing on rank 1, retried at once: each rank removed the partial step, and rank
    # 1's removal took the retry's new directory from under rank 0.
    from grouped_ep.checkpoint.checksum import ChecksumWriter

    write = ChecksumWriter.write_data

    def full(self, plan, planner):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write(self, plan, planner)

    ChecksumWriter.write_data = full
    rmtree = shutil.rmtree
    if rank == 1:  # a rank slower to remove a large step: the race every time

        def slow_rmtree(path, *args, **kwargs):
            time.sleep(1.0)
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = slow_rmtree
    try:
        ck.save(root, model, extra={"step": 5}, step=5)
    except ck.CheckpointError as e:
        out["failed_save"] = str(e)
    ChecksumWriter.write_data = write
    out["retry"] = ck.save(root, model, extra={"step": 5}, step=5).name
    shutil.rmtree = rmtree
    return out


def test_two_ranks_missing_extra_and_async_commit_failure(tmp_path: Path) -> None:
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout=180)
    assert results[0]["single_sizes"][0] == 0  # the case is still the one described
    for r in results:
        assert "extra-rank00001.pt is missing" in r["missing_extra"], r
        # The step went in place before `latest` failed: said so (it said "the partial step
        # was removed", and a same-step save had lost the previous copy; crash review).
        assert "step-00000002 is complete and holds this save" in r["async"], r
        assert "pointing `latest` at it failed" in r["async"] and "No space left" in r["async"]
        assert "`latest` still names 'step-00000001'" in r["async"], r
        assert r["step2_in_place"] == "step-00000002"
        assert r["latest"] == "step-00000003"
        assert r["rank0_extra"] == {"step": 4}, r
        assert "No space left" in r["failed_save"] and r["retry"] == "step-00000005", r


def test_inspect_no_verify_says_the_checksums_were_not_checked(tmp_path: Path, capsys) -> None:
    from grouped_ep.__main__ import main as cli

    ck.save(tmp_path, _model(1.0), step=1)
    assert cli(["inspect", str(tmp_path), "--summary", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "--no-verify: the CRC32Cs saved with the data were not checked" in out
    assert "match the CRC32C" not in out


def test_inspect_reports_an_extra_file_that_is_gone(tmp_path: Path, capsys) -> None:
    """`load` refuses a checkpoint whose rank's `extra-rank<r>.pt` is gone while its checksum
    table lists it; `inspect` said OK (exit 0), checking only the files that were there."""
    from grouped_ep.__main__ import main as cli

    step = ck.save(tmp_path, _model(1.0), extra={"step": 1}, step=1)
    (step / "extra-rank00000.pt").unlink()
    for flags in ([], ["--no-verify"]):  # presence needs no reading
        assert cli(["inspect", str(tmp_path), "--summary", *flags]) == 1
        assert "extra-rank00000.pt is missing (rank 0's checksum table lists it)" in (
            capsys.readouterr().out
        )
    with pytest.raises(ck.CheckpointError, match="extra-rank00000.pt is missing"):
        ck.load(tmp_path, _model(0.0))


def test_inspect_into_a_closed_pipe_prints_no_traceback(tmp_path: Path) -> None:
    """`inspect ... | head -2` printed a BrokenPipeError traceback on a healthy checkpoint."""
    ck.save(tmp_path, _model(1.0), step=1)
    script = (  # stdout is a pipe whose reader has gone: every write fails
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); "
        "from grouped_ep.__main__ import main; "
        f"sys.exit(main(['inspect', {str(tmp_path)!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


def test_damaged_metadata_is_refused_by_its_crc_before_unpickling(tmp_path: Path) -> None:
    """`.metadata` had no checksum: a flipped bit gave a bare AttributeError or TypeError, or
    made unpickling ask for many GB (a review: 4 of 28,817 single-bit flips; 21.8 GB before the
    OOM killer). Its [length, CRC32C] is in the manifest now, checked before it is unpickled."""
    model = _model(1.0)
    step = ck.save(tmp_path, model, step=1)
    md = step / ".metadata"
    raw = bytearray(md.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    md.write_bytes(bytes(raw))
    with pytest.raises(
        ck.CheckpointError, match=r"\.metadata: its \[length, CRC32C\] is .*changed"
    ):
        ck.load(tmp_path, _model(0.0))
    assert "changed since the save" in _inspect(tmp_path).stderr + _inspect(tmp_path).stdout


def test_dangling_data_file_link_is_a_missing_file(tmp_path: Path) -> None:
    """A data file that is a symlink to nothing (a mount that is gone) gave a bare
    FileNotFoundError from load and a traceback from inspect."""
    step = ck.save(tmp_path, _model(1.0), step=1)
    data = next(step.glob("*.distcp"))
    data.unlink()
    data.symlink_to(tmp_path / "gone")
    (step / "__7_0.distcp").symlink_to(tmp_path / "gone-too")  # one .metadata does not name
    with pytest.raises(ck.CheckpointError, match=rf"data file {data.name} is missing"):
        ck.load(tmp_path, _model(0.0))
    result = _inspect(tmp_path)
    assert "Traceback" not in result.stderr and f"data file {data.name} is missing" in (
        result.stdout + result.stderr
    )


def test_latest_and_manifest_of_the_wrong_kind_are_named(tmp_path: Path) -> None:
    """A `latest` that is not text gave a bare UnicodeDecodeError, a manifest whose "tied" is
    not lists of names a bare TypeError (a review)."""
    model = _model(1.0)
    step = ck.save(tmp_path, model, step=1)
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(ck.CheckpointError, match=r"latest: expected a checkpoint directory name"):
        ck.load(tmp_path, _model(0.0))
    ck.save(tmp_path, model, step=2)  # a save replaces it
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    manifest = json.loads((step / "grouped_ep.json").read_text())
    (step / "grouped_ep.json").write_text(json.dumps(manifest | {"tied": [1, 2]}))
    with pytest.raises(ck.CheckpointError, match=r'"tied" is \[1, 2\], expected lists of key'):
        ck.load(step, _model(0.0))


def test_export_into_a_folder_with_a_directory_named_as_its_files(tmp_path: Path) -> None:
    """A directory named model.safetensors (or the index) made export_hf fail part-way with a
    bare IsADirectoryError, leaving its .tmp- files, which load_sharded then read as the
    folder's single .safetensors file."""
    from grouped_ep import LoadError, load_sharded

    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(ck.CheckpointError, match="holds directories named as files it writes"):
        ck.export_hf(_model(1.0), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    (tmp_path / "model.safetensors").rmdir()
    from safetensors.torch import save_file

    save_file(_model(2.0).state_dict(), str(tmp_path / ".tmp-model-00001-of-00001.safetensors"))
    with pytest.raises(LoadError, match="found 0 index files and 0 .safetensors files"):
        load_sharded(_model(0.0), tmp_path)
