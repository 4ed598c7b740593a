"""The package layout's rules: public names defined where they are exported, no import circles,
files of one size a reader can hold."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "grouped_ep"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """grouped_ep modules that `name` imports when it is imported (module-level statements)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def test_no_import_circles():
    mods = _modules()
    graph = {n: _top_level_imports(p, n, set(mods)) for n, p in mods.items()}
    # A submodule importing its own parent package's __init__ (or an ancestor's) is a circle
    # whenever that __init__ imports the submodule back; the DFS below finds every such loop.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m) :] + [m]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


@pytest.mark.parametrize(
    "package", ["grouped_ep", "grouped_ep.moe", "grouped_ep.loading", "grouped_ep.checkpoint"]
)
def test_public_names_are_defined_inside_the_package_that_exports_them(package):
    mod = importlib.import_module(package)
    for name in mod.__all__:
        obj = getattr(mod, name)
        home = getattr(obj, "__module__", None)
        if home is None:  # a value such as __version__
            continue
        assert home == package or home.startswith(package + "."), (package, name, home)


def test_old_import_paths_are_the_new_modules():
    import grouped_ep.hf
    import grouped_ep.integrations.hf
    import grouped_ep.moe
    import grouped_ep.nn

    assert grouped_ep.hf is grouped_ep.integrations.hf
    assert grouped_ep.nn is grouped_ep.moe
    from grouped_ep.checkpoint import export_hf, load, save  # noqa: F401


@pytest.mark.parametrize("name", sorted(_modules()))
def test_files_stay_readable(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concern"
