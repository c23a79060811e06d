"""docs/findings.md section 2 comes from result files: `tiergram ablate --json` on the three training seeds of share40
(docs/findings/data/ablation/); both tables are rebuilt from the per-document and per-task loss sums in those files
and compared with the doc's text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import doc_block

from tiergram.analysis.ablate import (
    SETTINGS,
    LossSums,
    generation_seeds_markdown,
    loss_seeds_markdown,
    seed_delta,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "findings" / "data" / "ablation"
SEEDS = (0, 1, 2)  # training seeds of the share40 model


def block(name: str) -> str:
    """The text of docs/findings.md between its `data:NAME` markers."""
    return doc_block(ROOT / "docs" / "findings.md", name)


def runs() -> list[dict[str, Any]]:
    return [json.loads((DATA / f"share40-s{seed}.json").read_text()) for seed in SEEDS]


def test_the_results_are_the_documented_setting() -> None:
    for seed, r in zip(SEEDS, runs(), strict=True):
        assert r["model"] == f"runs/pred/share40-s{seed}" and r["split"] == "test"
        assert r["tasks"] == len(r["doctest_tasks"]) == len(r["answer_tokens"]) == 34
        assert [g["setting"] for g in r["generation"]] == [s.name for s in SETTINGS] == list(r["doc_sums"])
        assert len(r["doc_category"]) == len(r["doc_counts"][0]) == 38


def test_loss_table_is_rebuilt_from_the_per_document_sums() -> None:
    assert block("ablation/loss").strip() == loss_seeds_markdown(runs()).strip()


def test_generation_table_is_rebuilt_from_the_per_task_sums() -> None:
    assert block("ablation/generation").strip() == generation_seeds_markdown(runs()).strip()


def test_each_files_estimates_are_its_sums() -> None:
    """The per-model estimates `tiergram ablate` printed follow from the sums stored beside them."""
    for r in runs():
        sums = LossSums({k: np.array(v) for k, v in r["doc_sums"].items()}, np.array(r["doc_counts"]),
                        r["doc_category"])
        for got, stored in zip(sums.results(), r["loss"], strict=True):
            for key in ("decode_positions", "delta_decode", "all_positions", "delta_all"):
                assert getattr(got, key)["all"].value == pytest.approx(stored[key]["all"]["value"])
                assert getattr(got, key)["all"].ci95 == pytest.approx(stored[key]["all"]["ci95"])
        for g in r["generation"]:  # exact match is the share of answers equal to their task's expected output
            hits = sum(a == t["expected"] for a, t in zip(g["answers"], r["doctest_tasks"], strict=True))
            assert g["exact_match"]["value"] == pytest.approx(hits / r["tasks"])


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(3, 12), st.integers(0, 2**31 - 1))
def test_seed_mean_delta_is_the_mean_of_the_seeds(models: int, units: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 50, units).astype(np.float64)
    a = [rng.random(units) * counts for _ in range(models)]
    b = [rng.random(units) * counts for _ in range(models)]
    delta, per, ci = seed_delta(a, b, counts)
    assert len(per) == models and delta.value == pytest.approx(np.mean(per))
    assert ci is not None and ci[0] <= np.mean(per) <= ci[1]


def test_identical_seeds_have_a_zero_width_seed_interval() -> None:
    counts = np.array([3.0, 4.0, 5.0])
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 4.0])
    delta, per, ci = seed_delta([a, a], [b, b], counts)
    assert per == pytest.approx([2 / 12, 2 / 12]) and ci == pytest.approx([2 / 12, 2 / 12])
    assert delta.value == pytest.approx(2 / 12)


def test_results_of_different_documents_are_refused() -> None:
    first, second = runs()[:2]
    second = second | {"doc_counts": [c[:-1] for c in second["doc_counts"]]}
    with pytest.raises(ValueError, match="doc_counts"):
        loss_seeds_markdown([first, second])
