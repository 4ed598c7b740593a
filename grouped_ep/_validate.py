"""Argument checks shared across the package."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An int, and not a bool (True is an int to Python: `step=True` must not mean step 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
