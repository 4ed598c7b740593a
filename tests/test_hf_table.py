"""tools/hf_table.py: junit results -> the README's compatibility table, and its --check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "hf_table", Path(__file__).resolve().parent.parent / "tools" / "hf_table.py"
)
hf_table = importlib.util.module_from_spec(_spec)
sys.modules["hf_table"] = hf_table  # dataclasses look their module up there
_spec.loader.exec_module(hf_table)

FAMILIES = [
    hf_table.FamilyRow("mixtral", "MixtralForCausalLM"),
    hf_table.FamilyRow("qwen2_moe", "Qwen2MoeForCausalLM"),
    hf_table.FamilyRow("broken", "BrokenExperts", "ValueError: head_dim | 3 must divide"),
]
TESTS = [t for t, _ in hf_table.COLUMNS if t != "test_dp2_ep2_load_sharded_logits"]


def _junit(path: Path, cases: dict[tuple[str, str], str]) -> Path:
    body = {
        "passed": "",
        "failed": '<failure message="boom">trace</failure>',
        "xfailed": '<skipped type="pytest.xfail" message="reason: known">r</skipped>',
        "skipped": '<skipped type="pytest.skip" message="no gpu">r</skipped>',
    }
    rows = "".join(
        f'<testcase classname="tests.test_hf_families" name="{t}[{f}]" time="0.1">{body[o]}'
        "</testcase>"
        for (t, f), o in cases.items()
    )
    other = '<testcase classname="tests.test_gemm" name="test_x[a]" time="0"/>'
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}{other}'
        "</testsuite></testsuites>"
    )
    return path


def _all(outcome: str = "passed") -> dict[tuple[str, str], str]:
    return {(t, f): outcome for t in TESTS for f in ("mixtral", "qwen2_moe")}


def test_outcomes_are_read_per_test_and_family(tmp_path: Path) -> None:
    cases = _all() | {
        ("test_ep2_adamw_step", "mixtral"): "failed",
        ("test_checkpoint_resume_world1", "qwen2_moe"): "xfailed",
        ("test_dp2_ep2_load_sharded_logits", "mixtral"): "passed",
    }
    assert hf_table.read_junit(_junit(tmp_path / "r.xml", cases)) == cases


def test_table_rows_cells_and_unbuildable_families(tmp_path: Path) -> None:
    cases = _all() | {
        ("test_ep2_adamw_step", "mixtral"): "failed",
        ("test_checkpoint_resume_world1", "qwen2_moe"): "xfailed",
        ("test_dp2_ep2_load_sharded_logits", "mixtral"): "passed",
    }
    reasons = {}
    assert hf_table.read_junit(_junit(tmp_path / "r.xml", cases), reasons) == cases
    assert reasons == {("test_checkpoint_resume_world1", "qwen2_moe"): "known"}
    table = hf_table.render(cases, FAMILIES, reasons)
    assert "- qwen2_moe (resume 2 → 1 ranks): known" in table
    lines = table.splitlines()
    mixtral = next(line for line in lines if line.startswith("| mixtral |"))
    qwen = next(line for line in lines if line.startswith("| qwen2_moe |"))
    # family, class, experts, ep2 logits, adamw, resume, export, dp2ep2
    assert [c.strip() for c in mixtral.split("|")[1:-1]] == [
        "mixtral", "`MixtralForCausalLM`", "pass", "pass", "**FAIL**", "pass", "pass", "pass"
    ]  # fmt: skip
    assert [c.strip() for c in qwen.split("|")[3:-1]] == [
        "pass", "pass", "pass", "known fail", "pass", hf_table.NOT_RUN
    ]  # fmt: skip
    assert "3 families use the experts interface, 2 build tiny, 0 pass every column" in table
    broken = next(line for line in lines if line.startswith("| broken |"))
    assert "ValueError: head_dim \\| 3 must divide" in broken  # a '|' cannot split the cell
    assert "| broken | `BrokenExperts` | pass" not in table


def test_a_family_without_results_is_refused() -> None:
    cases = _all()
    del cases[("test_export_hf_from_pretrained", "qwen2_moe")]
    with pytest.raises(SystemExit, match=r"test_export_hf_from_pretrained\[qwen2_moe\]"):
        hf_table.render(cases, FAMILIES)


def test_readme_block_is_replaced_between_markers_only() -> None:
    text = f"# t\nbefore\n{hf_table.BEGIN}\nold table\n{hf_table.END}\nafter\n"
    new = hf_table.replace_block(text, "new table\n")
    assert new == f"# t\nbefore\n{hf_table.BEGIN}\nnew table\n{hf_table.END}\nafter\n"
    assert hf_table.replace_block(new, "new table\n") == new
    with pytest.raises(SystemExit, match="hf-table:begin"):
        hf_table.replace_block("no markers here", "x")
    with pytest.raises(SystemExit, match="hf-table:begin"):
        hf_table.replace_block(f"{hf_table.END}\n{hf_table.BEGIN}\n", "x")


def test_check_mode_fails_on_a_stale_readme(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(hf_table, "installed_families", lambda: FAMILIES)
    report = _junit(tmp_path / "r.xml", _all())
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{hf_table.BEGIN}\nstale\n{hf_table.END}\n")
    args = ["--junitxml", str(report), "--readme", str(readme)]
    assert hf_table.main([*args, "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert hf_table.main(args) == 0
    assert "| mixtral | `MixtralForCausalLM` | pass" in readme.read_text()
    assert readme.read_text().startswith("intro\n")
    assert hf_table.main([*args, "--check"]) == 0
    with pytest.raises(SystemExit, match="holds no results"):
        hf_table.main(["--junitxml", str(_junit(tmp_path / "empty.xml", {})), "--readme",
                       str(readme)])  # fmt: skip
