"""Checkpoints: grouped_ep.checkpoint save/load (atomic commit, compact views, load into new
buffers) vs plain dcp.save/dcp.load of the same state dict, in one process. GB/s counts the
unique bytes of model + optimizer state; disk_over_unique = bytes on disk / unique bytes."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from grouped_ep import checkpoint as ck
from suites._timing import median_seconds

TITLE = "checkpoint save/load (GB/s of unique bytes; *_x = grouped_ep / plain DCP; disk_over_unique = disk / unique)"


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


def _unique_bytes(model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    if opt is not None:
        n += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    return n


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.distcp"))


def _measure(case: Case, device: str, reps: int, work: Path) -> dict:
    model = _model(case, device)
    opt = None
    if case.optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sum(p.float().sum() for p in model.parameters()).backward()
        opt.step()
    unique = _unique_bytes(model, opt)
    ours, plain = work / "ours", work / "plain"
    state = ck.dcp._state(model, opt)  # the very state dict grouped_ep saves

    def save_plain() -> None:
        shutil.rmtree(plain, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(plain)), no_dist=True)

    def load_plain() -> None:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(plain)), no_dist=True)

    with warnings.catch_warnings():  # DCP warns that it runs in one process: it does
        warnings.simplefilter("ignore", UserWarning)
        t_save = median_seconds(lambda: ck.save(ours, model, opt, step=0), device, reps, 1)
        t_save_dcp = median_seconds(save_plain, device, reps, 1)
        t_load = median_seconds(lambda: ck.load(ours, model, opt), device, reps, 1)
        t_load_dcp = median_seconds(load_plain, device, reps, 1)
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
        "disk_over_unique": _disk(ours / "step-00000000") / unique,
        "dcp_disk_over_unique": _disk(plain) / unique,
    }


def run(device: str, quick: bool, log) -> list[dict]:
    rows = []
    for case in QUICK if quick else CASES:
        work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
        try:
            row = _measure(case, device, 3 if quick else 5, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(
            f"{case.name}: save {row['save_GBps']:.2f} GB/s (dcp {row['dcp_save_GBps']:.2f}), "
            f"load {row['load_GBps']:.2f} GB/s (dcp {row['dcp_load_GBps']:.2f}), "
            f"disk {row['disk_over_unique']:.3f}x (dcp {row['dcp_disk_over_unique']:.3f}x)"
        )
        rows.append(row)
    return rows
