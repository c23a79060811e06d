"""docs/findings.md's tables that come from result files under docs/findings/data/ are recomputed from those files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import doc_block

from tiergram.bench.split import best_split, split_points, to_markdown

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "findings" / "data"


def block(name: str) -> str:
    """The text of docs/findings.md between its `data:NAME` markers."""
    return doc_block(ROOT / "docs" / "findings.md", name)


@pytest.mark.parametrize("name", ["split/demo", "split/v41"])
def test_split_tables_are_their_sweeps(name: str) -> None:
    sweep = json.loads((DATA / f"{name}.json").read_text())
    points = split_points(sweep)
    assert block(name).strip() == to_markdown(points).strip()
    assert sweep["config"]["workload"] == "conversations" and len(best_split(points)) == 4


def test_result_files_name_no_local_folder() -> None:
    """Result files keep model names, not the paths of the machine that ran them."""
    for path in DATA.rglob("*.json"):
        assert not re.search(r"/(root|home|work|tmp)/", path.read_text()), path
