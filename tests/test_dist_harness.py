"""The rank runner the multi-process tests use (tests/_dist.py) forks its ranks from a fork server
started once: each rank must still see the caller's environment as it is at the call (the
modules it imports read it, grouped_ep's GROUPED_EP_BACKEND included) and write to the caller's
stdout / stderr (where pytest shows a failing rank's output and a hung rank's stacks)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from _dist import run_ranks

import grouped_ep


def _report(rank: int, world: int, name: str) -> tuple[str | None, str]:
    print(f"rank {rank} of {world} on stdout", flush=True)
    print(f"rank {rank} of {world} on stderr", file=sys.stderr, flush=True)
    return os.environ.get(name), grouped_ep.backend_info().requested


def test_each_call_gives_the_ranks_the_callers_environment_and_output(monkeypatch, capfd):
    monkeypatch.setenv("GROUPED_EP_TEST_MARK", "first")
    monkeypatch.setenv("GROUPED_EP_BACKEND", "torch")
    assert run_ranks(_report, 2, "GROUPED_EP_TEST_MARK", timeout=120) == [("first", "torch")] * 2
    monkeypatch.setenv("GROUPED_EP_TEST_MARK", "second")
    monkeypatch.delenv("GROUPED_EP_BACKEND")
    assert run_ranks(_report, 2, "GROUPED_EP_TEST_MARK", timeout=120) == [("second", "auto")] * 2
    out, err = capfd.readouterr()
    for rank in range(2):
        assert out.count(f"rank {rank} of 2 on stdout") == 2, out
        assert err.count(f"rank {rank} of 2 on stderr") == 2, err


def _one_rank_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_hung_rank_is_killed_and_its_stack_shown(capfd):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 20 s"):
        run_ranks(_one_rank_hangs, 2, timeout=20)
    assert time.monotonic() - start < 60
    _, err = capfd.readouterr()
    assert "_one_rank_hangs" in err, err
