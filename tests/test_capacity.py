"""Capacity accounting's hotness-vs-gate correlation: its document-bootstrap interval and the random-init null."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import tiny_saved_model

from tiergram.analysis.capacity import basic_interval, count_rows, hotness_gate
from tiergram.analysis.trace import load_windows, trace
from tiergram.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(corpus, model dir, model, windows, trace) of a tiny random-init Engram model on the validation split."""
    corpus, tok, model, out = tiny_saved_model(tmp_path_factory)
    _, windows = load_windows(model, corpus, "validation", tok, 1500)
    return corpus, out, model, windows, trace(model, windows)


def test_hotness_gate_follows_the_gates_and_brackets_its_value(setup):
    _, _, model, windows, tr = setup
    layer = tr.layers[0]
    offsets = np.asarray(model.hasher.head_offsets(layer))
    reads = count_rows(model, windows)[layer].counts.sum(0)
    # every position's gate = a decreasing function of how often its first head's row is read: rho strongly < 0
    first = tr.row_ids[layer][:, 0] + offsets[0]
    tr.gates[layer] = np.repeat((1.0 / (1.0 + reads[first]))[:, None], tr.gates[layer].shape[1], 1).astype(np.float32)
    est = hotness_gate(reads, tr, layer, offsets, resamples=30)
    assert est.value < -0.3 and est.ci95[0] <= est.ci95[1] < 0
    assert est.n == len({w.doc for w in tr.windows})
    none = hotness_gate(reads, tr, layer, offsets, resamples=0)
    assert none.value == est.value and np.isnan(none.ci95).all()


def test_basic_interval_reflects_the_resamples_around_the_estimate():
    boot = np.linspace(0.0, 1.0, 1001)  # percentiles 2.5 and 97.5: 0.025 and 0.975
    assert basic_interval(0.4, boot) == pytest.approx([-0.175, 0.775])
    assert np.isnan(basic_interval(0.4, [])).all()


def test_cli_analyze_reports_trained_and_null(setup, tmp_path):
    corpus, model_dir, _, _, _ = setup
    out = tmp_path / "c.json"
    assert main(["analyze", str(model_dir), "--max-tokens", "800", "--gate-tokens", "400", "--resamples", "10",
                 "--json", str(out), "--markdown", str(tmp_path / "c.md"), "--corpus", str(corpus), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert set(data["hotness_gate"]) == {"trained", "random-init"}
    assert "| random-init | 1 |" in (tmp_path / "c.md").read_text()
    assert main(["analyze", str(model_dir), "--resamples", "-2", "--corpus", str(corpus), "--quiet"]) == 2
