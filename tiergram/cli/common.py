"""Options many commands take, each defined once so that it reads and behaves the same in every command."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

COMMON: dict[str, dict[str, Any]] = {
    "--corpus": {"help": "corpus folder (default: the tiergram cache)"},
    "--device": {"default": "auto", "help": "compute device: auto (cuda if available), cpu, cuda, cuda:1, ..."},
    "--seed": {"type": int, "default": 0, "help": "random seed (default 0)"},
    "--plot": {"default": None, "metavar": "PATH", "help": "PNG path (default: in the bench cache folder)"},
    "--dir": {"default": None, "help": "folder on the disk to measure (default: the bench cache folder)"},
    "--json": {"action": "store_true", "help": "print one JSON object"},
    "--quiet": {"action": "store_true", "help": "no progress bars"},
}


def add_common(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, **helps: str) -> None:
    """Add the COMMON options `flags` to p in order; `helps` replaces one's help, by name (plot="heat map PNG")."""
    for flag in flags:
        name = flag.removeprefix("--")
        p.add_argument(flag, **COMMON[flag] | ({"help": helps[name]} if name in helps else {}))


def config_from(cls: type, args: argparse.Namespace) -> Any:
    """cls built from the options named as its fields (a benchmark's options are its config's; lists as tuples)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names})
