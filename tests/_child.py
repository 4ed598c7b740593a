"""Code run in a fresh interpreter: for what a process fixes at its start (the string hash
seed) or what a failure leaves behind in it (torch's forward-AD level after a failed compile)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def child_error(code: str, *args: str, env: dict | None = None, timeout: int = 120) -> str:
    """What `code` prints, then the message of the exception it raises ("" if none), run as
    `python -c` with `args` in `sys.argv[1:]`."""
    wrapped = f"try:\n{textwrap.indent(code, '    ')}\nexcept Exception as e:\n    print(e)\n"
    return subprocess.run(
        [sys.executable, "-c", wrapped, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout
