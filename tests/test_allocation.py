"""The allocation sweep: the geometry keeps the sparse budget, and a tiny two-share sweep trains, scores and plots."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import fixture_corpus

from tiergram.analysis.allocation import AllocationConfig, ShareResult, plan, verdict
from tiergram.analysis.stats import Estimate
from tiergram.cli import main
from tiergram.model import EngramLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_share_spends_the_same_sparse_budget():
    cfg = AllocationConfig(out="unused")
    points = plan(cfg, 16384, 1)
    assert [p.share for p, _ in points] == [0.0, 0.2, 0.4, 0.6, 0.8]
    assert cfg.budget == 3 * 16 * 3 * 128 * 128
    for p, mconfig in points:
        total = p.expert_params + p.table_params
        assert abs(total - cfg.budget) / cfg.budget < 0.06, (p.share, total)  # whole experts, prime rows
        assert abs(p.actual_share - p.share) < 0.06
        assert mconfig.moe.top_k == 2 and mconfig.moe.n_experts == p.n_experts >= 2
        assert (mconfig.engram is None) == (p.share == 0)
    counts = EngramLM(points[2][1]).num_params()
    assert counts["tables"] == points[2][0].table_params  # the planned table size is the built one
    dense = [EngramLM(m).num_params()["backbone"] - p.expert_params for p, m in points]
    # the dense part barely moves: routers, and the Engram modules' projections (2.7% with Engram)
    assert max(dense) - min(dense) < 0.03 * min(dense)


def est(v: float, lo: float, hi: float) -> Estimate:
    return Estimate(v, [lo, hi], 10)


def test_verdict():
    def share(s: float, loss: float, dlo: float) -> ShareResult:
        return ShareResult(s, s, 4, est(loss, loss - 0.1, loss + 0.1), [loss], est(dlo + 0.01, dlo, dlo + 0.02))

    u = [share(0.0, 5.2, 0.05), share(0.4, 5.0, -0.01), share(0.8, 5.3, 0.1)]
    assert verdict(u, 2).startswith("a U appears")
    flat = [share(0.0, 5.2, -0.05), share(0.4, 5.0, -0.01), share(0.8, 5.3, 0.1)]
    assert verdict(flat, 1).startswith("no clear U") and "one seed" in verdict(flat, 1)
    assert verdict([share(0.0, 5.0, -0.01), share(0.4, 5.1, 0.02), share(0.8, 5.3, 0.1)], 1).startswith("no U")
    assert "cannot show" in verdict(u[:2], 1)


def test_tiny_sweep_trains_scores_and_plots(tmp_path, capsys):
    corpus = fixture_corpus(tmp_path / "cache", vocab_size=None)  # the sweep trains the missing tokenizer first
    out, png, md = tmp_path / "sweep", tmp_path / "sweep.png", tmp_path / "sweep.md"
    args = ["sweep-allocation", "--out", str(out), "--shares", "0,50", "--tokens", str(3 * 4 * 32), "--d-model", "32",
            "--layers", "2", "--max-seq", "32", "--experts", "4", "--expert-ffn", "16", "--batch-size", "4",
            "--warmup-steps", "1", "--eval-tokens", "200", "--corpus", str(corpus), "--device", "cpu", "--quiet"]
    assert main(args + ["--plot", str(png), "--markdown", str(md)]) == 0
    assert (corpus / "tokenizer.json").is_file()
    result = json.loads((out / "sweep.json").read_text())
    assert [p["run"] for p in result["points"]] == ["share00-s0", "share50-s0"]
    assert all(p["steps"] == 3 and np.isfinite(p["loss"]["value"]) for p in result["points"])
    half = result["points"][1]
    assert half["n_experts"] == 2 and half["rows_per_head"] > 0 and 0.4 < half["actual_share"] < 0.6
    assert [s["share"] for s in result["shares"]] == [0.0, 0.5]
    assert min(s["delta_vs_best"]["value"] for s in result["shares"]) == 0.0
    assert "cannot show a U" in result["verdict"] and png.stat().st_size > 1000 and "| 50%" in md.read_text()
    first = (out / "share50-s0" / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0  # finished runs are reused, not retrained
    assert (out / "share50-s0" / "model.safetensors").stat().st_mtime_ns == first
    assert "Allocation sweep" in capsys.readouterr().out
