"""docs/findings.md's allocation tables (section 6) are recomputed from their result files under
docs/findings/data/allocation/, and the files hold what the text says they hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import doc_block

from tiergram.analysis.allocation_report import TABLES

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "findings" / "data" / "allocation"


def block(name: str) -> str:
    """The text of docs/findings.md between its `data:NAME` markers."""
    return doc_block(ROOT / "docs" / "findings.md", name)


@pytest.mark.parametrize("name", list(TABLES))
def test_allocation_tables_are_their_result_files(name: str) -> None:
    data = json.loads((DATA / f"{name}.json").read_text())
    assert block(f"allocation/{name}").strip() == TABLES[name](data).strip()


def test_the_result_files_are_one_sweep_with_three_seeds() -> None:
    files = {name: json.loads((DATA / f"{name}.json").read_text()) for name in TABLES}
    configs = [f["config"] for f in files.values()]
    assert all(c == configs[0] for c in configs)  # written by one command, over one sweep folder
    c = configs[0]
    assert (c["tokens"], c["d_model"], c["max_seq"], c["experts_at_zero"], c["expert_ffn"]) == (524288, 128, 128, 16,
                                                                                                 128)
    assert sorted(c["seeds"]) == [0, 1, 2] and files["power"]["power"]["seeds_per_share"] == 3
    assert c["shares"] == [0.0, 0.2, 0.4, 0.6, 0.8]
    shares = files["sweep"]["shares"]  # the shares run so far, each with all three seeds
    assert {0.0, 0.8} <= {s["share"] for s in shares} and all(len(s["seed_losses"]) == 3 for s in shares)
    for share in shares:  # a share in the table has none of its seeds missing
        assert not [m for m in files["sweep"]["missing"] if m.startswith(f"share{share['share'] * 100:02.0f}-")]
    # every claim of section 6 rests on 3 seeds
    for comparison in files["controls"]["comparisons"] + files["equal-compute"]["comparisons"]:
        assert comparison["seeds"] == [0, 1, 2], comparison["subject"]


def test_result_files_are_small_and_name_no_local_folder() -> None:
    for path in DATA.glob("*.json"):
        assert path.stat().st_size < 200_000, path
        assert not re.search(r"/(root|home|work|tmp)/", path.read_text()), path
