"""Ctrl-C held back while work that must not stop halfway runs."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Within, a SIGINT (Ctrl-C) is held back; on leaving, it takes effect as it would have
    (a KeyboardInterrupt under Python's default handler, the caller's own handler otherwise).
    For a loop whose every step must run once the first has (swapping loaded tensors into a
    model: stopped between two, the model would be part old, part new, with nothing to say
    which). Python runs signal handlers in the main thread only: elsewhere this does nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # a handler installed outside Python cannot be put back: leave it be
        return
    caught: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if not caught:
        return
    if callable(previous):
        previous(signal.SIGINT, caught[0])
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)
