"""Checkpoints: grouped_ep.checkpoint save/load vs plain DCP on the same model, in one process.

Plain DCP, as a training script uses it: save = `get_state_dict` -> `dcp.save`; load =
`get_state_dict` -> `dcp.load` -> `set_state_dict` (`load_state_dict` without an optimizer). Times are medians with the two sides
alternating rep by rep (the machine is shared). GB/s counts the unique bytes of model +
optimizer state; disk_over_unique = bytes on disk / unique bytes. Peak RSS growth of a load is
measured in a fresh process per side (peak reset through /proc/self/clear_refs just before the
load). blocked_*: how long `save` keeps the training loop waiting, sync vs `async_save=True`
(the async save's total time until `result()` is async_total_s). load_x includes the check of
every chunk's CRC32C (the default); load_unchecked_x is the same load with `verify=False`."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict

from grouped_ep import checkpoint as ck
from suites._timing import interleaved_medians

TITLE = "checkpoint save/load vs plain DCP (*_x = grouped_ep speed / plain DCP speed; peak RSS growth of a load in MB; blocked_* = seconds a save holds the training loop)"


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    hidden: int
    inter: int
    dtype: torch.dtype
    views: bool  # params are views of one padded flat buffer (as FSDP2 shards are)
    optimizer: bool


CASES = [
    Case("moe-fp32-adam", 16, 512, 512, torch.float32, False, True),
    Case("moe-fp32-views", 16, 512, 512, torch.float32, True, False),
    Case("moe-bf16-views-adam", 32, 1024, 512, torch.bfloat16, True, True),
]
QUICK = CASES[:2]


def _model(case: Case, device: str) -> nn.Module:
    """Stacked experts gate_up_proj [E, 2I, H], down_proj [E, H, I], and a dense [H, H]."""
    shapes = {
        "gate_up_proj": (case.experts, 2 * case.inter, case.hidden),
        "down_proj": (case.experts, case.hidden, case.inter),
        "dense": (case.hidden, case.hidden),
    }
    model = nn.Module()
    total = sum(torch.Size(s).numel() for s in shapes.values())
    flat = torch.randn(total + 4096, device=device).to(case.dtype) if case.views else None
    start = 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        t = flat[start : start + n].view(shape) if case.views else torch.randn(shape, device=device)
        start += n
        setattr(model, name, nn.Parameter(t.to(case.dtype) if flat is None else t))
    return model


def _model_and_opt(case: Case, device: str) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    torch.manual_seed(0)
    model = _model(case, device)
    opt = None
    if case.optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sum(p.float().sum() for p in model.parameters()).backward()
        opt.step()
    return model, opt


def _unique_bytes(model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    if opt is not None:
        n += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    return n


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.distcp"))


def plain_load(path: Path, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """The plain DCP resume: get_state_dict -> dcp.load -> set_state_dict."""
    state = ck.state.state_dicts(model, opt)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    if opt is None:
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _alternating(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Median wall seconds of each fn, run in turn rep by rep after one warm-up each."""
    got = interleaved_medians({str(i): fn for i, fn in enumerate(fns)}, "cpu", reps=reps, warmup=1)
    for v in got.values():
        if isinstance(v, Exception):
            raise v
    return list(got.values())


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_of_load(case_name: str, side: str, path: str) -> float:
    """Peak RSS growth (MB) of one load in this (fresh) process: model built, peak reset, load."""
    case = next(c for c in CASES if c.name == case_name)
    model, opt = _model_and_opt(case, "cpu")
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if side == "ours":
            ck.load(path, model, opt)
        else:
            plain_load(Path(path), model, opt)
    return (_status_kb("VmHWM") - base) / 1024


def _rss_in_subprocess(case: Case, side: str, path: Path) -> float:
    code = (
        "import json, sys; from suites.checkpoint import rss_of_load; "
        "print(json.dumps(rss_of_load(*sys.argv[1:])))"
    )
    bench_dir = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([bench_dir, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code, case.name, side, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_load(path: Path, model: nn.Module, opt) -> None:
    """What is timed must work: a load into a changed model gives back the saved values (the
    timed loads read into the model that holds them, where a load that did nothing would pass;
    a review)."""
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.load(path, model, opt)
    wrong = [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])]
    if wrong:
        raise RuntimeError(f"checkpoint: a load of {path} did not restore {wrong[:3]}: not timed")


def _measure(case: Case, device: str, reps: int, work: Path) -> dict:
    model, opt = _model_and_opt(case, device)
    unique = _unique_bytes(model, opt)
    ours, plain = work / "ours", work / "plain"

    def save_plain() -> None:
        shutil.rmtree(plain, ignore_errors=True)
        state = ck.state.state_dicts(model, opt)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(plain)), no_dist=True)

    def save_ours() -> None:
        ck.save(ours, model, opt, step=0)

    def save_async_blocked() -> None:
        handle = ck.save(work / "async", model, opt, step=0, async_save=True)
        blocked.append(time.perf_counter() - t_call[0])
        handle.result()

    blocked: list[float] = []
    t_call = [0.0]

    def save_async() -> None:
        t_call[0] = time.perf_counter()
        save_async_blocked()

    with warnings.catch_warnings():  # DCP warns that it runs in one process: it does
        warnings.simplefilter("ignore", UserWarning)
        t_save, t_save_dcp, t_async = _alternating([save_ours, save_plain, save_async], reps)
        _check_load(ours, model, opt)
        t_load, t_load_dcp, t_load_unchecked = _alternating(
            [
                lambda: ck.load(ours, model, opt),
                lambda: plain_load(plain, model, opt),
                lambda: ck.load(ours, model, opt, verify=False),
            ],
            reps,
        )
    rss_ours = _rss_in_subprocess(case, "ours", ours)
    rss_plain = _rss_in_subprocess(case, "plain", plain)
    gb = unique / 1e9
    return {
        "case": case.name,
        "unique_MB": unique / 1e6,
        "save_GBps": gb / t_save,
        "dcp_save_GBps": gb / t_save_dcp,
        "save_x": t_save_dcp / t_save,
        "load_GBps": gb / t_load,
        "dcp_load_GBps": gb / t_load_dcp,
        "load_x": t_load_dcp / t_load,
        "load_unchecked_x": t_load_dcp / t_load_unchecked,  # verify=False: no CRC32C pass
        "load_rss_MB": rss_ours,
        "dcp_load_rss_MB": rss_plain,
        "load_rss_over_dcp": rss_ours / max(rss_plain, 1e-9),
        "blocked_sync_s": t_save,
        "blocked_async_s": statistics.median(blocked[1:]),  # [0] was the warm-up
        "async_total_s": t_async,
        "disk_over_unique": _disk(ours / "step-00000000") / unique,
        "dcp_disk_over_unique": _disk(plain) / unique,
    }


def run(device: str, quick: bool, log, rows: list | None = None) -> list[dict]:
    rows = [] if rows is None else rows  # the runner's list: rows finished so far survive a stop
    for case in QUICK if quick else CASES:
        work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
        try:
            row = _measure(case, device, 3 if quick else 5, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(
            f"{case.name}: save {row['save_x']:.2f}x dcp, load {row['load_x']:.2f}x dcp "
            f"({row['load_GBps']:.2f} vs {row['dcp_load_GBps']:.2f} GB/s), load peak RSS "
            f"+{row['load_rss_MB']:.0f} MB (dcp +{row['dcp_load_rss_MB']:.0f} MB), save blocks "
            f"{row['blocked_sync_s']:.3f} s sync, {row['blocked_async_s']:.3f} s async"
        )
        rows.append(row)
    return rows
