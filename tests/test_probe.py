"""The gate probe's evidence against chance: between-n-gram variance share vs its shuffle null, category gaps."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import tiny_saved_model

from tiergram.analysis.probe import between_share, gate_evidence, ngram_table
from tiergram.analysis.trace import load_windows, trace
from tiergram.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(corpus, model dir, trace of the validation split) of a tiny random-init Engram model."""
    corpus, tok, model, out = tiny_saved_model(tmp_path_factory)
    return corpus, out, trace(model, load_windows(model, corpus, "validation", tok, 1500)[1])


def test_between_share():
    groups = np.array([0, 0, 1, 1, 2, 2])
    assert between_share(np.array([1.0, 1.0, 2.0, 2.0, 5.0, 5.0]), groups) == pytest.approx(1.0)
    assert between_share(np.array([1.0, 2.0, 1.0, 2.0, 1.0, 2.0]), groups) == pytest.approx(0.0)
    assert np.isnan(between_share(np.ones(6), groups))
    g = np.array([1.0, 2.0, 2.0, 2.0, 5.0, 7.0])
    # counting a position twice is the same as listing it twice
    twice = between_share(np.append(g, g[0]), np.append(groups, groups[0]))
    assert between_share(g, groups, np.array([2, 1, 1, 1, 1, 1])) == pytest.approx(twice)


def test_evidence_separates_ngram_gates_from_shuffled_ones(setup):
    _, _, tr = setup
    layer = tr.layers[0]
    inverse = ngram_table(tr, 2).inverse
    rng = np.random.default_rng(0)
    by_ngram = rng.random(inverse.max() + 1)
    for gates, expect_signal in ((by_ngram[inverse], True), (rng.random(tr.n), False)):
        tr.gates[layer] = np.repeat(gates[:, None], tr.gates[layer].shape[1], axis=1).astype(np.float32)
        ev = next(e for e in gate_evidence(tr, min_count=3, permutations=50) if e.layer == layer and e.order == 2)
        assert ev.ngrams > 10 and ev.shuffle_null[0] <= ev.shuffle_null[1]
        if expect_signal:
            assert ev.between_share.value == pytest.approx(1.0) and ev.between_share.ci95[0] > ev.shuffle_null[1]
        else:
            assert ev.between_share.value < 2 * ev.shuffle_null[1]
        assert ev.between_share.ci95[0] <= ev.between_share.value + 1e-9 <= ev.between_share.ci95[1] + 2e-9
        assert ev.mean_gate.ci95[0] <= ev.mean_gate.value <= ev.mean_gate.ci95[1]
        assert abs(ev.mean_gate.value - gates.mean()) < 0.05  # a ratio over documents, close to the plain mean
        cats = ev.category_gate
        if "code" in cats and "prose" in cats:
            assert ev.code_minus_prose.value == pytest.approx(cats["code"].value - cats["prose"].value)


def test_cli_probe_writes_trained_and_null_evidence(setup, tmp_path, capsys):
    corpus, model_dir, _ = setup
    out = tmp_path / "p.json"
    assert main(["probe", str(model_dir), "--max-tokens", "600", "--min-count", "2", "--top", "2",
                 "--permutations", "20", "--json", str(out), "--corpus", str(corpus), "--quiet"]) == 0
    assert "| random-init | 1 | 2 |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert set(data["evidence"]) == {"trained", "random-init"}
    assert main(["probe", str(model_dir), "--permutations", "-1", "--corpus", str(corpus), "--quiet"]) == 2
