"""Command line: `python -m grouped_ep <command> ...`.

Commands:
    inspect DIR   list a checkpoint's tensors, shapes, dtypes, chunks and files, and check that
                  every element of every tensor is saved exactly once (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import sys


def _inspect(args: argparse.Namespace) -> int:
    from grouped_ep.checkpoint import CheckpointError, describe
    from grouped_ep.checkpoint.inspect import format_report
    from grouped_ep.checkpoint.layout import resolve

    try:
        info = describe(resolve(args.dir))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(info, chunks=not args.summary))
    if info.problems:
        print(f"error: checkpoint {info.path} has {len(info.problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouped_ep")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("inspect", help="describe and check a DCP checkpoint directory")
    p.add_argument("dir", help="a checkpoint directory, or a root with a `latest` file")
    p.add_argument("--summary", action="store_true", help="one line per tensor, no chunks")
    p.set_defaults(func=_inspect)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
