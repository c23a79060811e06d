"""docs/findings.md sections 1, 3 and 4: each table between `<!-- data:NAME begin -->` and `end` is rebuilt from
its result file under docs/findings/data/ (the skip comparison from the per-document loss sums themselves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import doc_block

from tiergram.analysis.capacity import hotness_markdown
from tiergram.analysis.probe import GateEvidence, evidence_markdown
from tiergram.analysis.skipping import BASELINES, matched_markdown, matched_rows, seeds_markdown
from tiergram.analysis.stats import Estimate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "findings" / "data"
MODEL = "share40-s0"
SEEDS = (0, 1, 2)  # training seeds of the share40 model


def block(name: str) -> str:
    """The text of docs/findings.md between its `data:NAME` markers."""
    return doc_block(ROOT / "docs" / "findings.md", name)


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def estimate(d: dict[str, Any]) -> Estimate:
    return Estimate(d["value"], d["ci95"], d["n"])


def test_skip_table_is_rebuilt_from_the_per_document_sums() -> None:
    data = load(f"predictor/{MODEL}")
    rows = matched_rows(data["doc_sums"], data["doc_counts"], data["rates"], data["random_seeds"], data["methods"])
    assert block(f"predictor/{MODEL}").strip() == matched_markdown(rows).strip()
    # the stored comparison is the one the sums give, and the setting is the documented one
    assert [r["predictor_minus_best"]["ci95"] for r in data["matched"]] == [r.predictor_minus_best.ci95 for r in rows]
    assert data["rates"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    assert set(BASELINES) <= set(data["methods"]) and len(data["random_seeds"]) >= 3
    assert data["training_rows"]["source"].startswith("replay")
    counts = {p["method"]: 0 for p in data["curve"]}
    for p in data["curve"]:
        counts[p["method"]] += 1
    assert counts["random"] == 8 * len(data["random_seeds"]) and counts["predictor"] == 8


def test_seed_table_is_rebuilt_from_each_seeds_sums() -> None:
    runs = {}
    for seed in (0, 1, 2):
        data = load(f"predictor/share40-s{seed}")
        assert data["training_rows"]["source"].endswith(f"(seed {seed})")  # each run's own training batches
        runs[f"seed {seed}"] = matched_rows(data["doc_sums"], data["doc_counts"], data["rates"],
                                            data["random_seeds"], data["methods"])
    assert block("predictor/seeds").strip() == seeds_markdown(runs).strip()


def gate_evidence_of(data: dict[str, Any], name: str) -> list[GateEvidence]:
    """The GateEvidence rows of one model ("trained" / "random-init") from a probe result file."""
    return [GateEvidence(**(e | {"mean_gate": estimate(e["mean_gate"]), "between_share": estimate(e["between_share"]),
                                 "code_minus_prose": estimate(e["code_minus_prose"]),
                                 "category_gate": {c: estimate(v) for c, v in e["category_gate"].items()}}))
            for e in data["evidence"][name]]


def test_probe_table_is_its_result_files() -> None:
    files = {seed: load(f"probe/share40-s{seed}") for seed in SEEDS}
    evidence = {f"seed {seed}": gate_evidence_of(data, "trained") for seed, data in files.items()}
    evidence["random-init"] = gate_evidence_of(files[0], "random-init")
    assert all(data["evidence"]["random-init"] == files[0]["evidence"]["random-init"] for data in files.values())
    assert block("probe/seeds").strip() == evidence_markdown(evidence).strip()


def test_capacity_table_is_its_result_files() -> None:
    files = {seed: load(f"capacity/share40-s{seed}") for seed in SEEDS}

    def hot(data: dict[str, Any], name: str) -> dict[int, Estimate]:
        return {int(layer): estimate(e) for layer, e in data["hotness_gate"][name].items()}

    table = {f"seed {seed}": hot(data, "trained") for seed, data in files.items()} | {
        "random-init": hot(files[0], "random-init")}
    assert block("capacity/seeds").strip() == hotness_markdown(table).strip()
