"""Issue 18: no abort at process exit after `load_sharded` (bounded stress run).

Runs tests/_exit_stress.py: jobs of 2 and 4 ranks that load a transformers Mixtral checkpoint
into an EP-sharded meta model, check every weight, destroy the process group and exit normally,
with a CPU-bound process running beside them. Every rank must exit with status 0 and never
print "terminate called". The long form (hundreds of jobs) is the same script with --jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = 4


@pytest.mark.slow
def test_ranks_exit_cleanly_after_load_sharded(tmp_path: Path) -> None:
    script = Path(__file__).with_name("_exit_stress.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--jobs", str(JOBS), "--busy"],
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # gloo ranks on CPU, as in CI
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["jobs"] == JOBS
    logs = "\n".join(Path(b["log"]).read_text(errors="replace")[-2000:] for b in result["bad"])
    assert result["bad"] == [], f"{result['bad']}\n{logs}"
