"""Child processes in their own process group, so that a timeout kills all of them.

torchrun starts one process per rank; killing only torchrun's pid on a timeout can leave ranks
that hold gloo ports and CPU. `run` starts the command as the leader of a new session (its own
process group) and, on a timeout or an interrupt, kills the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole process group (it leads one: started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run(
    cmd: Sequence[str], *, timeout: float, capture: bool = False, **kwargs
) -> subprocess.CompletedProcess:
    """`subprocess.run` in a new process group; on a timeout (or Ctrl-C) the group is killed.

    Returns the CompletedProcess (stdout and stderr as text when `capture`). Raises
    `subprocess.TimeoutExpired` after killing the group.
    """
    if capture:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(list(cmd), start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # TimeoutExpired, KeyboardInterrupt: nothing of the group survives
        kill_group(proc)
        raise
    # Ranks that outlived their launcher (they should not) go with the group too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
