"""Render every command's --help as markdown: docs/cli.md is this module's output (a test keeps them equal)."""

from __future__ import annotations

import argparse
import io
import sys
from contextlib import redirect_stdout

from tiergram.cli import build_parser

HEADER = """# The `tiergram` command

Every command and its options, as `--help` prints them. Regenerate with
`COLUMNS=100 python -m tiergram.cli.docs > docs/cli.md`.
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    yield path, parser
    for name, child in _subparsers(parser).items():
        yield from _walk(child, [*path, name])


def render() -> str:
    """The markdown text of docs/cli.md."""
    out = [HEADER]
    for path, parser in _walk(build_parser(), ["tiergram"]):
        parser.prog = " ".join(path)
        buf = io.StringIO()
        with redirect_stdout(buf):
            parser.print_help()
        out.append(f"## `{' '.join(path)}`\n\n```text\n{buf.getvalue().rstrip()}\n```\n")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
