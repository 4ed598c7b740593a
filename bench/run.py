"""grouped_ep microbenchmarks.

    python bench/run.py                      # every suite on the default device (cuda if present)
    python bench/run.py --suite gemm --quick # one suite, short
    python bench/run.py --device cpu

Each suite lives in bench/suites/<name>.py and defines `TITLE` and
`run(device, quick, log, rows) -> list[dict]` (one flat row per case appended to `rows`, ratios
against baselines measured in the same run). Results go to bench/results/<device>-<date>.{json,md}
and one PNG per suite, written after every suite (`-2`, `-3`, ... added when a run of the same
minute has the name); a run stopped with Ctrl-C (or SIGTERM: `timeout`, `kill`) writes the rows
finished so far, its suite marked interrupted, and exits with status 130 (143). What is timed is
checked first: grouped_ep's GEMM output and gradients against the per-expert loop in fp32, a
checkpoint load against the values saved; a wrong result, or grouped_ep failing, fails its suite
(marked FAILED in the results) and the run exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import platform
import re
import signal
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SUITES = ["gemm", "loader", "moe", "checkpoint"]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def cpu_capability() -> str:
    """torch's CPU capability (the ATen kernel level, e.g. AVX512) and the low-precision matrix
    features cpuinfo reports, e.g. "AVX512; avx512_bf16"."""
    cap = torch.backends.cpu.get_cpu_capability()
    try:
        flags = torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):  # older torch: no feature map
        return cap
    names = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16")
    have = [n for n in names if flags.get(n) is True]
    return f"{cap}; {', '.join(have) if have else 'no amx/avx512 bf16/fp16'}"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def geomean(values: list[float]) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def summary(rows: list[dict]) -> dict:
    """Geometric mean, min and max of every ratio column (`*_x`), per (dtype, pass) group where
    rows have those keys, so one slow baseline dtype does not colour the fp32 headline; where
    rows have both, also per dtype over all its passes (`[bfloat16 all]`: forward and
    forward+backward rows together)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        key = " ".join(str(r[k]) for k in ("dtype", "pass") if k in r) or "all"
        groups.setdefault(key, []).append(r)
    for r in rows:
        if "dtype" in r and "pass" in r:
            groups.setdefault(f"{r['dtype']} all", []).append(r)
    out = {}
    for key, members in groups.items():
        for col in dict.fromkeys(k for r in members for k in r):
            if not col.endswith("_x"):
                continue
            vals = [r[col] for r in members if isinstance(r.get(col), (int, float))]
            vals = [v for v in vals if math.isfinite(v)]
            if vals:
                name = col if key == "all" else f"{col} [{key}]"
                out[name] = {"geomean": geomean(vals), "min": min(vals), "max": max(vals)}
    return out


def plot(suite: str, rows: list[dict], path: Path, title: str) -> bool:
    """A bar chart of the ratio columns per case. Returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ratio_cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c.endswith("_x")]
    if not rows or not ratio_cols:
        return False
    keys = ("case", "routing", "dtype", "pass", "ranks")
    labels = [" ".join(str(r[k]) for k in keys if k in r) or str(i) for i, r in enumerate(rows)]
    width = 0.8 / len(ratio_cols)
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows) + 3), 5))
    for i, col in enumerate(ratio_cols):
        vals = [float(r.get(col, float("nan"))) for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], vals, width, label=col)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(rows))], labels, rotation=60, ha="right", fontsize=7
    )
    ax.set_ylabel("ratio, log scale (> 1: grouped_ep faster)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--suite", choices=SUITES + ["all"], default="all")
    ap.add_argument("--quick", action="store_true", help="a short run: fewer cases and repeats")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    ap.add_argument("--replot", type=Path, help="redraw the PNGs of a saved results .json")
    args = ap.parse_args(argv)
    if args.replot:
        try:
            saved = json.loads(args.replot.read_text())
            suites_saved = saved["suites"].items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            ap.error(f"--replot {args.replot}: not a results .json of bench/run.py ({e})")
        for suite, data in suites_saved:
            png = args.replot.with_name(args.replot.stem + f"-{suite}.png")
            plot(suite, data["rows"], png, f"{data['title']} — {saved['device']}")
            print(f"wrote {png}")
        return 0
    try:
        index = torch.device(args.device).index
        kind = torch.device(args.device).type
    except RuntimeError as e:
        ap.error(f"--device {args.device}: {e}")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index is not None):
        # meta ran nothing and was reported as the CPU (a review)
        ap.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device is visible")
        if index is not None:
            if index >= torch.cuda.device_count():
                ap.error(f"--device {args.device}: {torch.cuda.device_count()} CUDA device(s)")
            # The timing events, the device name and the backend query use the current device.
            torch.cuda.set_device(index)

    suites = SUITES if args.suite == "all" else [args.suite]
    name = device_name(args.device)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    report = {
        "device": name,
        "device_type": args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_capability": cpu_capability(),
        "date": stamp.strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "suites": {},
    }
    if args.device.startswith("cuda"):
        import grouped_ep

        # GROUPED_EP_BACKEND (or auto): which CUDA kernels the grouped_ep rows ran.
        requested = report["gemm_backend_requested"] = grouped_ep.backend.get_backend()
        report["device"] = f"{name}; grouped_ep backend requested: {requested}"
    base = _reserve(
        ap, args.out, f"{slug(name)}-{stamp:%Y%m%d-%H%M}{'-quick' if args.quick else ''}"
    )
    md = [
        f"# grouped_ep benchmarks\n\ndevice: {report['device']}; torch {torch.__version__}; "
        f"CPU capability: {report['cpu_capability']}; "
        f"date: {report['date']}; quick: {args.quick}\n"
    ]
    print(f"device: {name}; torch {torch.__version__}; CPU capability: {report['cpu_capability']}")
    # `timeout` and `kill` stop it as Ctrl-C does: the finished rows are written (a review).
    signal.signal(signal.SIGTERM, _terminated)
    failed = []
    for suite in suites:
        module = importlib.import_module(f"suites.{suite}")
        print(f"== {suite}: {module.TITLE}", flush=True)
        t0 = time.perf_counter()
        rows: list[dict] = []
        interrupted = error = None
        try:
            module.run(
                args.device,
                args.quick,
                lambda msg, s=suite: print(f"[{s}] {msg}", flush=True),
                rows,
            )
        except KeyboardInterrupt as e:
            interrupted = 143 if isinstance(e, _Terminated) else 130
            print(f"\n[{suite}] interrupted after {len(rows)} rows; writing them", flush=True)
        except Exception as e:  # noqa: BLE001 (a wrong result, a failed kernel: the run fails)
            error = f"{type(e).__name__}: {e}"
            failed.append(suite)
            print(f"\n[{suite}] FAILED after {len(rows)} rows: {error}", flush=True)
        seconds = time.perf_counter() - t0
        summ = summary(rows)
        report["suites"][suite] = {
            "title": module.TITLE,
            "rows": rows,
            "summary": summ,
            "seconds": seconds,
            "interrupted": interrupted is not None,
            "error": error,
        }
        table = markdown_table(rows)
        print(table)
        for col, s in summ.items():
            print(f"{col}: geomean {s['geomean']:.3f}, min {s['min']:.3f}, max {s['max']:.3f}")
        png = base.with_name(base.name + f"-{suite}.png")
        stopped = f" (interrupted after {len(rows)} rows)" if interrupted else ""
        stopped = f" (FAILED after {len(rows)} rows: {error})" if error else stopped
        md.append(f"\n## {suite}: {module.TITLE}{stopped}\n\n{table}")
        if summ:
            md.append(
                "\n"
                + "\n".join(
                    f"- `{c}`: geomean {s['geomean']:.3f}, min {s['min']:.3f}, max {s['max']:.3f}"
                    for c, s in summ.items()
                )
                + "\n"
            )
        # Written after every suite (the tables first, the optional plot last): a run stopped
        # in a later suite keeps the finished ones.
        base.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        base.with_suffix(".md").write_text("".join(md))
        if plot(suite, rows, png, f"{module.TITLE} — {name}"):
            md.append(f"\n![{suite}]({png.name})\n")
            base.with_suffix(".md").write_text("".join(md))
        if interrupted:
            print(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.md')} (interrupted)")
            return interrupted
    print(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.md')}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (see above)")
        return 1
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (exit status 143)."""


def _terminated(signum, frame) -> None:
    raise _Terminated


def _reserve(ap: argparse.ArgumentParser, out: Path, stem: str) -> Path:
    """The results path of this run: `out/stem` (`-2`, `-3`, ... when a run of the same minute
    has it: the later one replaced the other's files; a review), its .json created now, so that
    an `out` that cannot be written is said at once, not after the first suite."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            base = out / (stem if n == 1 else f"{stem}-{n}")
            try:
                with open(base.with_suffix(".json"), "x") as f:
                    f.write("{}\n")
                return base
            except FileExistsError:
                continue
    except OSError as e:
        ap.error(f"--out {out}: cannot write results there ({e})")
    ap.error(f"--out {out}: {stem}.json and 999 numbered copies exist")


if __name__ == "__main__":
    sys.exit(main())
