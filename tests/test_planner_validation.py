"""docs/planner-validation.md's out-of-sample tables are what `plan validate` wrote for the committed sweeps: each
table is recomputed from its result file, and the inputs frozen before the sweeps ran are there and load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import doc_block

from tiergram.plan.predict import validate_markdown
from tiergram.plan.specs import load_hardware

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "docs" / "planner" / "validation"
NAMES = sorted(p.stem for p in (VALIDATION / "results").glob("*.json") if "." not in p.stem)


def block(name: str) -> str:
    """The text of docs/planner-validation.md between its `data:NAME` markers."""
    return doc_block(ROOT / "docs" / "planner-validation.md", name)


def test_every_validated_sweep_has_its_result_and_table() -> None:
    assert len(NAMES) >= 3
    for name in NAMES:
        assert (VALIDATION / "results" / f"{name}.sweep.json").is_file(), name
        assert (VALIDATION / "results" / f"{name}.speed-spec.json").is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_tables_are_their_results(name: str) -> None:
    res = json.loads((VALIDATION / "results" / f"{name}.json").read_text())
    assert block(f"validation/{name}").strip() == validate_markdown(res).strip()
    assert all(p["naive_tok_s"] for p in res["points"])  # the baseline beside every point


def test_frozen_inputs_load() -> None:
    hw = load_hardware(VALIDATION / "this-machine.toml")
    assert hw.kind == "cpu" and hw.serve_tok_s_curve
    for hit in VALIDATION.glob("hit-*.json"):
        assert json.loads(hit.read_text())["config"]["capacity_of"] == "table", hit
