"""Linear CKA: hand-computed cases, invariances, a model against itself, and `tiergram compare-layers`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from support import fixture_corpus, offline_default_sources, tiny_config_for

from tiergram.analysis.cka import LayerComparison, alignment, collect_states, compare_layers, linear_cka, verdict
from tiergram.analysis.trace import load_windows
from tiergram.cli import main
from tiergram.corpus import load_tokenizer
from tiergram.model import EngramLM
from tiergram.model.checkpoint import save_pretrained
from tiergram.model.model import make_hasher

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_hand_computed_cases():
    # 1-d: CKA is the squared correlation; centred x = (-1, 0, 1), y = (0, -1, 1): corr 1/2
    assert linear_cka(np.array([[1.0], [2.0], [3.0]]), np.array([[1.0], [0.0], [2.0]])) == pytest.approx(0.25)
    # x: four points on the axes (centred, X^T X = 2 I, norm 2 sqrt 2); y: x's first coordinate (Y^T Y = 2);
    # Y^T X = (2, 0): CKA = 4 / (2 sqrt 2 * 2) = 1 / sqrt 2
    x = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    assert linear_cka(x, x[:, :1]) == pytest.approx(1 / math.sqrt(2))
    assert linear_cka(x[:, :1], x[:, 1:]) == pytest.approx(0.0)  # orthogonal features
    assert linear_cka(x, x) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same positions"):
        linear_cka(x, x[:3])


def test_invariances():
    g = np.random.default_rng(0)
    x = g.normal(size=(300, 8))
    y = x @ g.normal(size=(8, 5)) + 0.5 * g.normal(size=(300, 5))
    q, _ = np.linalg.qr(g.normal(size=(8, 8)))
    base = linear_cka(x, y)
    assert 0.1 < base < 0.99
    assert linear_cka(x @ q, y) == pytest.approx(base, abs=1e-12)  # orthogonal transform
    assert linear_cka(3.7 * x, y) == pytest.approx(base, abs=1e-12)  # isotropic scale
    assert linear_cka(x + 5.0, y) == pytest.approx(base, abs=1e-12)  # a constant shift (centring)
    assert linear_cka(x, y) == pytest.approx(linear_cka(y, x), abs=1e-12)  # symmetric
    assert linear_cka(x, 2.5 * x @ q) == pytest.approx(1.0, abs=1e-12)
    # not invariant to an anisotropic scaling
    assert linear_cka(x, x * np.array([10.0, 1, 1, 1, 1, 1, 1, 0.1])) < 0.9


def test_alignment_summary():
    cka = np.array([[1.0, 0.2, 0.1], [0.1, 0.3, 0.9], [0.0, 0.5, 0.5]])
    best, soft = alignment(cka, top=2)
    assert best == [0, 2, 1]
    assert soft[0] == pytest.approx((1.0 * 0 + 0.2 * 1) / 1.2)
    assert soft[1] == pytest.approx((0.9 * 2 + 0.3 * 1) / 1.2)


def test_verdict_needs_a_margin_beyond_the_sampling_spread():
    cka = [[1.0, 0.6, 0.5], [0.6, 0.70, 0.80], [0.5, 0.7, 0.9]]  # A's block 1 looks like B's block 2

    def result(spread: float) -> LayerComparison:
        best, soft = alignment(np.array(cka))
        return LayerComparison("a", "b", "validation", 100, cka, spread, best, soft)

    assert verdict(result(0.05)).endswith("A's early layers look like deeper layers of B")
    assert "no sign, beyond noise" in verdict(result(0.2))  # a 0.1 margin inside a 0.2 spread is not evidence


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(corpus, tokenizer, {name: (dir, model)}): a tiny Engram model and a no-Engram twin, random init."""
    corpus = fixture_corpus(tmp_path_factory.mktemp("cache"))
    tok = load_tokenizer(corpus / "tokenizer.json")
    cfg = tiny_config_for(tok)
    out = {}
    for name, c, seed in (("engram", cfg, 0), ("base", cfg.without_engram(), 1)):
        torch.manual_seed(seed)
        model = EngramLM(c, make_hasher(c, tokenizer=tok) if c.engram else None).eval()
        out[name] = (save_pretrained(model, tmp_path_factory.mktemp(name) / name, tokenizer=tok), model)
    return corpus, tok, out


def test_a_model_with_itself_is_one_on_the_diagonal(models):
    corpus, tok, m = models
    model = m["engram"][1]
    _, windows = load_windows(model, corpus, "train", tok, 400)
    result = compare_layers(model, model, windows)
    cka = np.array(result.cka)
    assert cka.shape == (3, 3) and np.allclose(np.diag(cka), 1.0, atol=1e-9) and np.allclose(cka, cka.T)
    assert result.best_match == [0, 1, 2] and 0 <= result.half_spread < 0.1
    states, owner = collect_states(model, windows)
    assert len(states) == 3 and all(s.shape == (len(owner), 64) for s in states)
    assert len(owner) == sum(len(w.inputs) for w in windows)


def test_cli_compare_layers(models, tmp_path, capsys):
    corpus, _, m = models
    png, js = tmp_path / "cka.png", tmp_path / "cka.json"
    assert main(["compare-layers", str(m["engram"][0]), str(m["base"][0]), "--corpus", str(corpus), "--split",
                 "validation", "--max-tokens", "300", "--plot", str(png), "--json", str(js), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "linear CKA" in out and png.stat().st_size > 1000
    result = json.loads(js.read_text())
    cka = np.array(result["cka"])
    assert cka.shape == (3, 3) and ((0 <= cka) & (cka <= 1 + 1e-9)).all() and result["positions"] > 0
    assert len(result["soft_index"]) == 3


def test_cli_compare_layers_builds_a_missing_corpus(models, tmp_path, monkeypatch, capsys):
    """With no --corpus and an empty cache, compare-layers builds the default corpus first (as probe etc. do)."""
    corpus = offline_default_sources(monkeypatch, tmp_path)
    _, _, m = models
    assert main(["compare-layers", str(m["engram"][0]), str(m["base"][0]), "--max-tokens", "200", "--quiet"]) == 0
    assert (corpus / "manifest.json").is_file() and "linear CKA" in capsys.readouterr().out
