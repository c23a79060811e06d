"""Render every command's --help as markdown: docs/cli.md is this module's output (a test keeps them equal)."""

from __future__ import annotations

import argparse
import sys

from tiergram.cli import build_parser

HEADER = """# The `tiergram` command

Every command and its options, as `--help` prints them. Regenerate with
`COLUMNS=100 python -m tiergram.cli.docs > docs/cli.md`.
"""


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    """(command words, parser) of this parser and of every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, [*path, name])


def render() -> str:
    """The markdown text of docs/cli.md."""
    out = [HEADER]
    for path, parser in _walk(build_parser(), ["tiergram"]):
        parser.prog = " ".join(path)
        out.append(f"## `{' '.join(path)}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
