"""docs/cli.md matches the commands as built."""

from pathlib import Path

from tiergram.cli.docs import render

ROOT = Path(__file__).resolve().parents[1]


def test_cli_docs_up_to_date(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    got = (ROOT / "docs" / "cli.md").read_text()
    assert got == render(), "docs/cli.md is stale: run `COLUMNS=100 python -m tiergram.cli.docs > docs/cli.md`"
