"""docs/cli.md matches the commands as built."""

from pathlib import Path

from tiergram.cli.docs import render

ROOT = Path(__file__).resolve().parents[1]


def test_cli_docs_up_to_date(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    got = (ROOT / "docs" / "cli.md").read_text()
    assert got == render(), "docs/cli.md is stale: run `COLUMNS=100 python -m tiergram.cli.docs > docs/cli.md`"


OUTSIDE = ("../shared", "/work/", "/tmp/study")  # paths that exist only on the machine the project was built on


def test_repository_stands_on_its_own() -> None:
    """README, docs and the package point only inside the repository: no machine paths, no outside design doc."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*")), *sorted((ROOT / "tiergram").rglob("*"))]
    bad = []
    for path in files:
        if not path.is_file() or path.suffix in (".so", ".pyc", ".png"):
            continue
        text = path.read_text(errors="replace")
        for needle in OUTSIDE:
            for n, line in enumerate(text.splitlines(), 1):
                if needle in line:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {needle!r}")
    assert not bad, "files name paths outside the repository:\n" + "\n".join(bad)


def test_design_doc_is_linked() -> None:
    """docs/design.md exists and the README points to it."""
    assert (ROOT / "docs" / "design.md").is_file()
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every `tiergram ...` line of a shell block and every inline `tiergram ... --flag` span in
    README.md and docs/, up to the first shell operator; template lines ([opt], A|B, ...) and commands a page
    records as run at a named commit (history: a ```text block, or a span followed by a commit hash) left out."""
    import re
    import shlex

    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "cli.md":  # generated from the parser itself
            continue
        text = path.read_text()
        lines = []
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):  # a ```text block records history
            lines += [ln.strip() for ln in block.replace("\\\n", " ").splitlines()]
        for m in re.finditer(r"`(tiergram [^`\n]*--[^`\n]*)`", text):
            if not re.search(r"\b[0-9a-f]{7,40}\b", text[m.end():m.end() + 160]):  # a command run at a named commit
                lines.append(m.group(1))
        for line in lines:
            if not line.startswith("tiergram ") or any(t in line for t in ("[", "|", "…", "...", "{", "<")):
                continue
            words = []
            for w in shlex.split(line.split(" #")[0]):
                if w in ("&&", ";", ">", ">>", "2>"):
                    break
                words.append(w)
            found.append((path.name, words))
    return found


def test_every_command_in_the_docs_parses() -> None:
    """Each documented `tiergram` command line is accepted by the parser as written (flags and subcommands exist)."""
    import contextlib
    import io

    from tiergram.cli import build_parser

    commands = doc_commands()
    assert len(commands) > 30
    bad = []
    for name, words in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(words[1:])
        except SystemExit as e:
            message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ""
            if e.code and "the following arguments are required" not in message:
                bad.append(f"{name}: {' '.join(words)}\n    {message}")
    assert not bad, "documented commands the CLI refuses:\n" + "\n".join(bad)
