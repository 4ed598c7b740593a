"""bench/run.py's summary: the geomeans the README's targets are read from."""

import importlib.util
import math
from pathlib import Path

import pytest

_RUN = Path(__file__).resolve().parents[1] / "bench" / "run.py"


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("bench_run", _RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_per_dtype_pass_and_per_dtype(run):
    rows = [
        {"dtype": "bfloat16", "pass": "fwd", "vs_dense_x": 0.8, "note_x": "n/a"},
        {"dtype": "bfloat16", "pass": "fwd", "vs_dense_x": 0.9},
        {"dtype": "bfloat16", "pass": "fwd+bwd", "vs_dense_x": 1.25},
        {"dtype": "float32", "pass": "fwd", "vs_dense_x": float("nan")},
        {"dtype": "float32", "pass": "fwd", "vs_dense_x": 2.0},
    ]
    s = run.summary(rows)
    fwd = s["vs_dense_x [bfloat16 fwd]"]
    assert math.isclose(fwd["geomean"], math.sqrt(0.8 * 0.9))
    assert (fwd["min"], fwd["max"]) == (0.8, 0.9)
    both = s["vs_dense_x [bfloat16 all]"]
    assert math.isclose(both["geomean"], (0.8 * 0.9 * 1.25) ** (1 / 3))
    assert (both["min"], both["max"]) == (0.8, 1.25)
    # A NaN ratio (a baseline that refused the inputs) is left out, not averaged in.
    assert s["vs_dense_x [float32 fwd]"] == {"geomean": 2.0, "min": 2.0, "max": 2.0}
    assert s["vs_dense_x [float32 all]"]["geomean"] == 2.0
    # Only ratio columns (`*_x` with numbers) are summarised.
    assert not any(k.startswith("note_x") for k in s)


def test_summary_without_dtype_or_pass(run):
    s = run.summary([{"case": "a", "speed_x": 2.0}, {"case": "b", "speed_x": 8.0}])
    assert list(s) == ["speed_x"]
    assert math.isclose(s["speed_x"]["geomean"], 4.0)


def test_a_stopped_suite_keeps_its_finished_rows(run, tmp_path, monkeypatch):
    # Ctrl-C inside a suite: the rows it finished are written, the suite is marked interrupted,
    # and the run exits with 130 instead of losing them.
    import json
    import sys
    import types

    def stopped_run(device, quick, log, rows):
        rows.append({"case": "a", "dtype": "float32", "pass": "fwd", "vs_dense_x": 1.5})
        rows.append({"case": "b", "dtype": "float32", "pass": "fwd", "vs_dense_x": 0.5})
        raise KeyboardInterrupt

    fake = types.SimpleNamespace(TITLE="fake suite", run=stopped_run)
    import suites  # noqa: F401  (the real package; its `gemm` module is replaced below)

    monkeypatch.setitem(sys.modules, "suites.gemm", fake)
    monkeypatch.setattr(run, "plot", lambda *a, **k: False)
    code = run.main(["--suite", "gemm", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 130
    (saved,) = tmp_path.glob("*.json")
    report = json.loads(saved.read_text())["suites"]["gemm"]
    assert report["interrupted"] is True
    assert [r["case"] for r in report["rows"]] == ["a", "b"]
    assert math.isclose(report["summary"]["vs_dense_x [float32 fwd]"]["geomean"], math.sqrt(0.75))
    assert "interrupted after 2 rows" in saved.with_suffix(".md").read_text()


def test_a_wrong_product_fails_the_run_before_it_is_timed(run, tmp_path, monkeypatch):
    """The CPU rows were never checked: a grouped_ep.gemm returning twice the product was timed
    and reported with ratios, exit status 0 (a review)."""
    import json
    import signal

    import grouped_ep

    real = grouped_ep.gemm
    monkeypatch.setattr(grouped_ep, "gemm", lambda *a, **k: real(*a, **k) * 2)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        rc = run.main(["--suite", "gemm", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert rc == 1
    (saved,) = tmp_path.glob("*.json")
    gemm = json.loads(saved.read_text())["suites"]["gemm"]
    assert gemm["rows"] == [] and "differs from the per-expert loop by 1" in gemm["error"]
    assert "FAILED" in saved.with_suffix(".md").read_text()


@pytest.mark.parametrize("device", ["meta", "cpu:1"])
def test_devices_that_run_nothing_are_refused(run, tmp_path, device):
    """--device meta ran nothing and was reported as the CPU's numbers (a review)."""
    with pytest.raises(SystemExit):
        run.main(["--suite", "gemm", "--device", device, "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
