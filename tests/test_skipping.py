"""The matched-rate skip comparison: equal skip shares, training-split row statistics, the paired verdict."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import tiny_saved_model

from tiergram.analysis.skipping import (
    config_name,
    lowest_share,
    matched_rows,
    seeds_markdown,
    skip_study,
    spread_documents,
)
from tiergram.analysis.trace import load_windows, trace
from tiergram.analysis.training_rows import training_rows
from tiergram.cli import main
from tiergram.model.data import WindowSampler, tokenize_split
from tiergram.model.evaluate import EvalDoc


def training_settings(run, batch_size: int, seed: int, steps: int) -> None:
    """The files of a `tiergram train` run that training_rows replays."""
    (run / "train_config.json").write_text(json.dumps({"batch_size": batch_size, "seed": seed}))
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(corpus, model dir, model, tokenizer): a tiny random-init Engram model, with the settings of a short run."""
    corpus, tok, model, out = tiny_saved_model(tmp_path_factory)
    training_settings(out, 4, 0, 2)
    return corpus, out, model, tok


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.floats(0.01, 0.99), st.integers(0, 2**31))
def test_lowest_share_skips_exactly_the_lowest(scores, rate, seed):
    score = np.asarray(scores, dtype=np.float64)
    skip = lowest_share(score, rate, np.random.default_rng(seed))
    assert skip.sum() == int(round(rate * len(score)))
    if skip.any() and (~skip).any():
        assert score[skip].max() <= score[~skip].min()


def test_spread_documents_caps_each_document_and_category():
    docs = [EvalDoc(c, np.arange(n + 1)) for c, n in [("code", 900), ("prose", 50), ("code", 700), ("code", 300),
                                                       ("prose", 0), ("prose", 600)]]
    out = spread_documents(docs, 256, 600)
    assert [(d.category, len(d.tokens) - 1) for d in out] == [("code", 256), ("prose", 50), ("code", 256),
                                                               ("code", 88), ("prose", 256)]
    assert all(np.array_equal(d.tokens, np.arange(len(d.tokens))) for d in out)  # the first tokens, <eot> kept
    with pytest.raises(ValueError, match="doc_tokens"):
        spread_documents(docs, 0, None)


def test_training_rows_replay_the_runs_batches(setup, tmp_path):
    corpus, model_dir, model, _ = setup
    run = tmp_path / "run"
    run.mkdir()
    training_settings(run, 3, 7, 4)
    stats = training_rows(model, run, corpus, gate_tokens=1)
    assert stats.source.startswith("replay") and stats.tokens_counted == 4 * 3 * model.config.max_seq
    assert stats.tokens_gated == 3 * model.config.max_seq  # the first batch reaches gate_tokens
    sampler = WindowSampler(tokenize_split(corpus, "train", corpus / "tokenizer.json", progress=False), 3,
                            model.config.max_seq, 7)
    expected = {layer: 0 for layer in model.engram_layers}
    for _ in range(4):
        rows = model.engram_row_ids(torch.from_numpy(sampler.next()[0]))
        for layer, r in rows.items():
            flat = r.numpy() + np.asarray(model.hasher.head_offsets(layer))
            expected[layer] = expected[layer] + np.bincount(flat.ravel(), minlength=len(stats.counts[layer]))
    for layer in model.engram_layers:
        np.testing.assert_array_equal(stats.counts[layer], expected[layer])
        h = len(model.hasher.head_offsets(layer))
        assert stats.gate_n[layer].sum() == stats.tokens_gated * h
        assert 0 < stats.gate_sum[layer].sum() <= stats.gate_n[layer].sum()
    with pytest.raises(ValueError, match="train_config.json"):
        training_rows(model, tmp_path, corpus)


def test_matched_rows_pick_the_best_fair_baseline_and_pair_by_document():
    rng = np.random.default_rng(0)
    counts = np.full(40, 100.0)
    none = rng.normal(500, 50, 40)
    sums = {"none": none}
    for rate in (0.2, 0.5):
        sums[config_name("predictor", rate)] = none + 1.0 + rng.normal(0, 0.1, 40)
        sums[config_name("train-rare", rate)] = none + 3.0 + rng.normal(0, 0.1, 40)
        sums[config_name("oracle", rate)] = none  # a reference: never the "best baseline"
        for seed in (0, 1):
            sums[config_name("random", rate, seed)] = none + 2.0 + seed
    rows = matched_rows({k: list(v) for k, v in sums.items()}, list(counts), [0.2, 0.5], [0, 1],
                        ["predictor", "train-rare", "oracle", "random"])
    for row in rows:
        assert row.best_baseline == "random" and row.random_spread == pytest.approx([0.02, 0.03])
        assert row.delta["random"].value == pytest.approx(0.025)
        assert row.predictor_minus_best.value == pytest.approx(-0.015, abs=1e-3)
        assert row.predictor_minus_best.ci95[1] < 0  # paired: the shared per-document noise cancels
        assert set(row.predictor_minus) == {"train-rare", "random"}
    table = seeds_markdown({"s0": rows, "s1": rows})
    assert table.count("vs random") == 4 and table.splitlines()[0] == "| reads skipped | s0 | s1 |"
    with pytest.raises(ValueError, match="different skip rates"):
        seeds_markdown({"s0": rows, "s1": rows[:1]})
    with pytest.raises(ValueError, match="needs at least one"):
        matched_rows({k: list(v) for k, v in sums.items()}, list(counts), [0.2], [], ["predictor", "oracle"])


def test_skip_study_skips_the_same_share_for_every_method(setup):
    corpus, model_dir, model, tok = setup
    traces = {s: trace(model, load_windows(model, corpus, s, tok, 1200)[1]) for s in ("validation", "test")}
    train = training_rows(model, model_dir, corpus, gate_tokens=512)
    report, _ = skip_study(model, traces["validation"], traces["test"], train, rates=(0.25, 0.5),
                           random_seeds=3, sketch_width=1024)
    assert report.methods == ["predictor", "train-rare", "train-gate", "oracle", "random"]
    n = traces["test"].n
    for rate in (0.25, 0.5):
        pts = [p for p in report.curve if p.rate == rate]
        assert len(pts) == 4 + 3 and {p.skipped_reads for p in pts} == {round(rate * n) / n}
    assert [r.rate for r in report.matched] == [0.25, 0.5]
    again = matched_rows(report.doc_sums, report.doc_counts, report.rates, report.random_seeds, report.methods)
    assert again == report.matched  # the JSON's per-document sums are enough to rebuild the comparison
    with pytest.raises(ValueError, match="training-split"):
        skip_study(model, traces["validation"], traces["test"], None, rates=(0.5,), methods=("predictor", "train-rare"))


def test_cli_predictor_compares_at_matched_rates(setup, tmp_path, capsys):
    corpus, model_dir, _, _ = setup
    out = tmp_path / "s.json"
    assert main(["predictor", str(model_dir), "--max-tokens", "600", "--doc-tokens", "100", "--fit-tokens", "800",
                 "--rates", "0.2,0.6", "--random-seeds", "2", "--train-gate-tokens", "256", "--sketch-width", "1024",
                 "--json", str(out), "--corpus", str(corpus), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "| reads skipped | predictor Δ | train-rare Δ | train-gate Δ | oracle Δ | random Δ" in text
    data = json.loads(out.read_text())
    assert data["training_rows"]["source"].startswith("replay") and len(data["matched"]) == 2
    assert main(["predictor", str(model_dir), "--doc-tokens", "-1", "--corpus", str(corpus), "--quiet"]) == 2
