"""Command line: `python -m grouped_ep <command> ...`.

Commands:
    check         run every built grouped GEMM backend on this device against an fp64
                  reference and print backend, dtype, layout, max error, pass/fail (exit code 1
                  on a failure). Builds nothing, needs no network: run it first on a new node.
    inspect DIR   list a checkpoint's tensors, shapes, dtypes, chunks and files, and check that
                  every element of every tensor is saved exactly once and that every chunk's
                  bytes match the CRC32C saved with them (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import os
import sys


def _inspect(args: argparse.Namespace) -> int:
    from grouped_ep.checkpoint import CheckpointError, describe
    from grouped_ep.checkpoint.checksum import (
        checksum_kind,
        checksum_name,
        missing_file,
        read_manifest,
        recorded_files,
        verify_file,
        verify_share,
    )
    from grouped_ep.checkpoint.fit import check_format
    from grouped_ep.checkpoint.inspect import format_report
    from grouped_ep.checkpoint.layout import resolve

    try:
        info = describe(resolve(args.dir))
        manifest = read_manifest(info.path)
        check_format(info.path, manifest, "inspect")
        kind = checksum_kind(info.path, manifest)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    crc, name = kind is not None, checksum_name(kind)
    checked = crc and not args.no_verify and not info.problems
    save_id = manifest.get("save_id")
    listed = recorded_files(info.path, save_id)  # each rank's `extra`, as its table lists it
    if checked:  # reads every data file
        info.problems += verify_share(info, save_id=save_id, kind=kind)
        extras = set(listed)  # and the ones there, listed or not
        for extra in info.path.glob("extra-rank*.pt"):
            owner = extra.stem.removeprefix("extra-rank")
            if owner.isdigit():
                extras.add((extra.name, int(owner)))
        info.problems += filter(None, (verify_file(info.path, *e, save_id) for e in sorted(extras)))
    elif crc and args.no_verify:  # presence needs no reading: a listed file that is gone
        info.problems += filter(None, (missing_file(info.path, *e) for e in sorted(listed)))
    print(format_report(info, chunks=not args.summary))
    print(_saved(manifest, args.dir, info.path))
    if checked and not info.problems:
        print(f"OK: every chunk's bytes match the {name} saved with them")
    elif not crc:
        print("(saved without checksums: values not verified)")
    elif args.no_verify:
        print(f"(--no-verify: the {name}s saved with the data were not checked)")
    if info.problems:
        print(f"error: checkpoint {info.path} has {len(info.problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


def _saved(manifest: dict, given: str, ckpt) -> str:
    """What the manifest says of the save, and, for a root, its complete steps."""
    import time
    from pathlib import Path

    from grouped_ep.checkpoint.layout import complete_steps

    keys = ("step", "world_size", "has_optimizer", "has_extra", "torch")
    fields = [f"{k}={manifest[k]}" for k in keys if k in manifest]
    when = manifest.get("saved_at")
    if isinstance(when, (int, float)):
        fields.append(f"saved_at={time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}")
    writer = manifest.get("writer")
    if isinstance(writer, dict):
        fields.append(f"by=pid {writer.get('pid')} on {writer.get('host')}")
    lines = [f"saved: {', '.join(fields) if fields else '(no grouped_ep manifest)'}"]
    root = Path(given)
    if root.resolve() != Path(ckpt).resolve():
        steps = complete_steps(root)
        names = [
            p.name + (" (latest)" if p.name == Path(ckpt).name else "")
            for _, p in sorted(steps.items())
        ]
        lines.append(f"steps in {root}: {', '.join(names)}")
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> int:
    import torch

    import grouped_ep
    from grouped_ep.selfcheck import format_rows, run_checks

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        print(f"error: --device {args.device!r}: {e}", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda"):
        print(f"error: --device {args.device!r}: only cpu and cuda devices", file=sys.stderr)
        return 2
    if device.type == "cuda" and not (
        torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    ):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(
            f"error: --device {args.device!r}: this machine has {have} CUDA device(s)",
            file=sys.stderr,
        )
        return 2
    print(grouped_ep.backend_info())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, device {device} ({name})\n")
    rows = run_checks(device)
    print(format_rows(rows))
    failed = [r for r in rows if not r.passed]
    if failed:
        print(f"error: {len(failed)} of {len(rows)} checks failed", file=sys.stderr)
        return 1
    print(f"all {len(rows)} checks passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouped_ep")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("check", help="check every built GEMM backend on this device")
    p.add_argument(
        "--device", help="e.g. cuda:1 or cpu (default: the current CUDA device, else cpu)"
    )
    p.set_defaults(func=_check)

    p = commands.add_parser("inspect", help="describe and check a DCP checkpoint directory")
    p.add_argument("dir", help="a checkpoint directory, or a root with a `latest` file")
    p.add_argument("--summary", action="store_true", help="one line per tensor, no chunks")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the CRC32C check (it reads every data file)"
    )
    p.set_defaults(func=_inspect)

    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe would print a traceback
        return code
    except BrokenPipeError:  # `| head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
