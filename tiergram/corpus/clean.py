"""Cleaning, categories and the deterministic split of corpus documents (docs/model.md, "The corpus")."""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath

SPLITS = ("train", "validation", "test")
CATEGORIES = ("code", "prose", "boilerplate-heavy")
CODE_SUFFIXES = {".py", ".pl", ".pm", ".c", ".h", ".sh", ".js"}

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")
_LICENCE = re.compile(
    r"copyright|\(c\)|licen[cs]e|spdx-license|warrant|redistribut|all rights reserved|"
    r"permission is hereby granted|merchantability|general public|free software foundation|"
    r"artistic license|liable|without limitation",
    re.I,
)
_CODE_LINE = re.compile(
    r"""^\s*(?:
        import\s|from\s+\S+\s+import\b|use\s+[\w:]+|require\s|\#\s*include\b|__all__\b|
        \#!|\#.*coding[:=]|
        @(?:property|abstractmethod|staticmethod|classmethod|overload|override|functools\.wraps)\b|
        (?:pass|\.\.\.|raise\s+NotImplementedError\b.*)\s*$|
        [rbuRBU]?(?:\"\"\"|''')\s*$|
        (?:Parameters|Returns|Yields|Raises|Examples?|Notes?|See\s+Also|Attributes|Args|Arguments|
           Keyword\s+Arguments|References|Warnings?|Methods)\s*:?\s*$|
        [-=~]{3,}\s*$|
        :(?:param|type|returns?|rtype|raises?|ivar|cvar|var|arg|keyword|kwarg)\b|
        if\s+__name__\s*==\s*.__main__.\s*:
    )""",
    re.X,
)
_PROSE_LINE = re.compile(
    r"""^\s*(?:
        \.\.\s+(?:_[^:]+:|toctree::|module::|moduleauthor::|sectionauthor::|index::|include::|
              currentmodule::|highlight::|spdx-license-identifier|only::|contents::|raw::)|
        :[\w-]+:(?:\s.*)?$|
        ([=\-~^*#+`'".])\1{2,}\s*$|
        =(?:pod|cut|over|back|begin|end|for|encoding)\b
    )""",
    re.X | re.I,
)
_LICENCE_NAME = re.compile(r"licen[cs]e|copying|copyright|artistic|gpl", re.I)
_POD_HEAD = re.compile(r"^=head\d\s+(.*)$")
_POD_LEGAL = re.compile(r"copyright|licen[cs]e|authors?|maintainers?", re.I)


def clean_text(data: bytes, max_bytes: int = 2_000_000, min_chars: int = 32) -> tuple[str | None, str]:
    """(cleaned text, "") or (None, reason): reason is huge, binary or empty."""
    if len(data) > max_bytes:
        return None, "huge"
    if b"\x00" in data[:8192]:
        return None, "binary"
    text = data.decode("utf-8", errors="replace").lstrip("\ufeff")
    if text and len(_CONTROL.findall(text)) > 0.25 * len(text):
        return None, "binary"
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")
    if len(text.strip()) < min_chars:
        return None, "empty"
    return text + "\n", ""


def split_for(key: str, validation: float = 0.05, test: float = 0.05) -> str:
    """The split of a document group: a fixed function of the SHA-256 of its key."""
    u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < 1.0 - validation - test:
        return "train"
    return "validation" if u < 1.0 - test else "test"


def _legal_lines(lines: list[str]) -> set[int]:
    """Indices of lines in licence/copyright paragraphs or POD legal sections."""
    out: set[int] = set()
    start = 0
    for i in range(len(lines) + 1):
        if i == len(lines) or not lines[i].strip():
            block = range(start, i)
            hits = sum(1 for j in block if _LICENCE.search(lines[j]))
            if (hits >= 2 and hits >= 0.1 * len(block)) or (hits == 1 and len(block) == 1):
                out.update(block)
            start = i + 1
    in_legal = False
    for i, line in enumerate(lines):
        m = _POD_HEAD.match(line)
        if m:
            in_legal = bool(_POD_LEGAL.search(m.group(1)))
        if in_legal:
            out.add(i)
    return out


def boilerplate_share(text: str, code: bool) -> float:
    """Fraction of non-blank lines that are licence headers, imports or doc/markup scaffolding."""
    lines = text.split("\n")
    legal = _legal_lines(lines)
    pattern = _CODE_LINE if code else _PROSE_LINE
    total = hits = 0
    toctree_indent: int | None = None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        total += 1
        indent = len(line) - len(line.lstrip())
        if toctree_indent is not None and indent <= toctree_indent:
            toctree_indent = None
        in_toctree = toctree_indent is not None
        if not code and re.match(r"\s*\.\.\s+toctree::", line):
            toctree_indent = indent
        if i in legal or in_toctree or pattern.match(line):
            hits += 1
    return hits / total if total else 0.0


def categorise(path: str, text: str, threshold: float = 0.25) -> str:
    """`boilerplate-heavy` when the boilerplate share reaches `threshold`, else `code` or `prose`."""
    code = PurePosixPath(path).suffix.lower() in CODE_SUFFIXES
    if _LICENCE_NAME.search(PurePosixPath(path).name) or boilerplate_share(text, code) >= threshold:
        return "boilerplate-heavy"
    return "code" if code else "prose"
