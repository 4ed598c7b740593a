"""The oldest transformers release grouped_ep's transformers paths work with, checked where they
start (`import grouped_ep.hf`, `load_sharded` and `export_hf` of a transformers model).

5.21.0 is the first with `core_model_loading.apply_renamings` and `apply_converters`, which the
loader and `export_hf` call. A review (2026-11-26, torch 2.14.1, CPU) ran the README's path and
the family tests on transformers 5.0.0 to 5.24.0: on 5.7 to 5.20 four families failed to load
their own checkpoints (a bare ImportError for models with a prefix change; converters that merge
tensors applied one tensor at a time: a LoadError whose shapes contradicted themselves), and
below 5.7 the experts interface `grouped_ep.hf` registers in is missing. No release before 5.21
is supported: each is refused with the version needed, not left to fail inside.
"""

from __future__ import annotations

import re

MIN_TRANSFORMERS = (5, 21)


def transformers_too_old() -> str | None:
    """Why the installed transformers cannot serve grouped_ep's transformers paths, or None."""
    import transformers

    version = getattr(transformers, "__version__", "")
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) >= MIN_TRANSFORMERS:
        return None
    need = ".".join(map(str, MIN_TRANSFORMERS))
    return (
        f"grouped_ep's transformers integration needs transformers >= {need}, and "
        f"transformers {version or '(no version)'} is installed: pip install 'transformers>={need}'"
    )


def require_transformers(error: type[Exception], where: str) -> None:
    """Raise `error` naming `where` if the installed transformers is too old."""
    problem = transformers_too_old()
    if problem is not None:
        raise error(f"{where}: {problem}")
