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
