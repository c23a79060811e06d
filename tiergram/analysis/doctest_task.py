"""Generation tasks from the held-out standard-library doctests (docs/findings.md section 2): predict a short `>>>`
example's printed output, prompted with the example and the ones before it in its session."""

from __future__ import annotations

import doctest
import os
from dataclasses import dataclass

from tiergram.corpus import load_split

SOURCES = ("python-stdlib", "python-docs")
HELD_OUT = ("validation", "test")


@dataclass
class DoctestTask:
    """One example: the prompt text, the expected output (no trailing newline), where it came from."""

    split: str
    origin: str  # the corpus source: python-stdlib or python-docs
    path: str
    line: int  # 0-based line of the example in the document
    code: str  # the example's source code
    prompt: str  # ends with the example's last source line, without its newline (the model writes it)
    expected: str
    indent: int  # the example's indentation (output lines carry it too)


def _render(example: doctest.Example, with_output: bool) -> str:
    """An example as it appears in a file, indented."""
    pad = " " * example.indent
    src = example.source.rstrip("\n").split("\n")
    lines = [pad + ">>> " + src[0]] + [pad + "... " + s for s in src[1:]]
    if with_output and example.want:
        lines += [pad + w for w in example.want.rstrip("\n").split("\n")]
    return "\n".join(lines) + "\n"


def sessions(text: str) -> list[list[doctest.Example]]:
    """The document's examples, grouped into sessions: runs with only blank text between them."""
    try:
        parts = doctest.DocTestParser().parse(text)
    except ValueError:  # malformed examples somewhere in the document: skip it
        return []
    out: list[list[doctest.Example]] = [[]]
    for part in parts:
        if isinstance(part, doctest.Example):
            out[-1].append(part)
        elif part.strip() and out[-1]:
            out.append([])
    return [s for s in out if s]


def document_tasks(text: str, split: str, origin: str, path: str, *, max_output_chars: int = 20,
                   max_context_examples: int = 4) -> list[DoctestTask]:
    """The tasks of one document."""
    tasks = []
    for session in sessions(text):
        for i, ex in enumerate(session):
            want = ex.want.rstrip("\n")
            if not want.strip() or len(want) > max_output_chars or ex.exc_msg is not None:
                continue
            context = "".join(_render(e, True) for e in session[max(0, i - max_context_examples):i])
            tasks.append(DoctestTask(split=split, origin=origin, path=path, line=ex.lineno, code=ex.source.strip(),
                                     prompt=context + _render(ex, False).rstrip("\n"), expected=want,
                                     indent=ex.indent))
    return tasks


def extract_tasks(corpus: str | os.PathLike) -> list[DoctestTask]:
    """Doctest tasks from the held-out splits' standard-library documents (never the training split)."""
    tasks = [t for split in HELD_OUT for doc in load_split(corpus, split) if doc.source in SOURCES
             for t in document_tasks(doc.text, split, doc.source, doc.path)]
    if tasks:  # an example whose source and output the training split holds too would test recall
        seen = {(e.source.strip(), e.want.strip()) for doc in load_split(corpus, "train") if doc.source in SOURCES
                for session in sessions(doc.text) for e in session}
        tasks = [t for t in tasks if (t.code, t.expected.strip()) not in seen]
    return tasks


def answer_of(text: str, indent: int) -> str:
    """The output in generated text: the lines after the source line up to a blank or `>>>` line, unindented."""
    lines = []
    for line in text.split("\n")[1:]:  # the prompt stops before the source line's newline
        if not line.strip() or line.lstrip().startswith(">>>"):
            break
        lines.append(line[indent:] if line[:indent].strip() == "" else line)
    return "\n".join(lines).rstrip()


def is_finished(text: str) -> bool:
    """Whether generated text has reached the end of the output: a finished blank line, or a `>>>` line."""
    lines = text.split("\n")[1:]
    return any(not s.strip() for s in lines[:-1]) or any(s.lstrip().startswith(">>>") for s in lines)
