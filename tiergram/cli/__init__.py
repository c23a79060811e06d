"""The `tiergram` command: one module per command group, each with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ["table", "bench", "corpus", "model", "serve", "study", "demo", "plan"]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every command group registered."""
    parser = argparse.ArgumentParser(
        prog="tiergram", description="Serve, train, study and benchmark Engram memory tables from a memory hierarchy.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"tiergram.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, IndexError) as e:  # user-facing errors: message, no traceback
        print(f"tiergram: error: {e}", file=sys.stderr)
        return 2
