"""The allocation sweep: the geometry keeps the budget, the power analysis, and a tiny sweep with its controls."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import fixture_corpus

from tiergram.analysis import allocation_report as ar
from tiergram.analysis.allocation import AllocationConfig, plan
from tiergram.analysis.stats import Estimate, seed_interval
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
    def share(s: float, loss: float, dlo: float) -> ar.ShareResult:
        return ar.ShareResult(s, s, 4, 0, est(loss, loss - 0.1, loss + 0.1), [loss], None,
                           est(dlo + 0.01, dlo, dlo + 0.02))

    u = [share(0.0, 5.2, 0.05), share(0.4, 5.0, -0.01), share(0.8, 5.3, 0.1)]
    assert ar.verdict(u, 2).startswith("a U appears")
    flat = [share(0.0, 5.2, -0.05), share(0.4, 5.0, -0.01), share(0.8, 5.3, 0.1)]
    assert ar.verdict(flat, 1).startswith("no clear U") and "one seed" in ar.verdict(flat, 1)
    assert ar.verdict([share(0.0, 5.0, -0.01), share(0.4, 5.1, 0.02), share(0.8, 5.3, 0.1)], 1).startswith("no U")
    assert "cannot show" in ar.verdict(u[:2], 1)


def test_seeds_for_power_matches_the_textbook_two_sample_t_test():
    # Cohen's d = 1 needs 17 per group, d = 0.5 needs 64 (two-sided, alpha 0.05, power 0.8)
    assert ar.seeds_for_power(0.02, 0.02) == 17 and ar.seeds_for_power(0.04, 0.02) == 64
    assert ar.seeds_for_power(0.01, 0.02) < ar.seeds_for_power(0.02, 0.02) < ar.seeds_for_power(0.02, 0.01)
    assert seed_interval([1.0]) is None and seed_interval([1.0, 1.0, 1.0]) == [1.0, 1.0]
    lo, hi = seed_interval([0.0, 1.0, 2.0])  # mean 1, sd 1, t(0.975, 2) = 4.303
    assert lo == pytest.approx(1 - 4.303 / 3 ** 0.5, abs=1e-3) and hi == pytest.approx(1 + 4.303 / 3 ** 0.5, abs=1e-3)


def test_power_pools_the_seed_spread_of_every_share():
    def share(s: float, losses: list[float]) -> ar.ShareResult:
        return ar.ShareResult(s, s, 4, 0, est(np.mean(losses), 0, 9), losses, float(np.std(losses, ddof=1)))

    shares = [share(0.0, [6.0, 6.02, 6.04]), share(0.5, [6.0, 6.04, 6.08])]  # SD 0.02 and 0.04
    p = ar.power_analysis(shares, [], delta=0.014, grid=5)
    assert p.pooled_df == 4 and p.pooled_sd == pytest.approx((0.02 ** 2 / 2 + 0.04 ** 2 / 2) ** 0.5)
    assert p.pooled_sd_upper95 > p.pooled_sd and p.seeds_needed_upper > p.seeds_needed
    assert p.seeds_needed == ar.seeds_for_power(p.pooled_sd, 0.014)
    assert p.seeds_needed_normal == pytest.approx(2 * (1.95996 + 0.84162) ** 2 * p.pooled_sd ** 2 / 0.014 ** 2,
                                                  rel=1e-4)
    assert p.seeds_needed_normal < p.seeds_needed <= p.seeds_needed_normal + 2  # the t test needs a seed or two more
    assert p.shares == 5 and p.seeds_per_share == 3
    assert p.seed_sd == {"0": pytest.approx(0.02), "50": pytest.approx(0.04)}
    assert ar.t_test_power(p.detectable_now, p.pooled_sd, 3) == pytest.approx(0.8) and p.detectable_now > 0.014
    assert ar.power_analysis([ar.ShareResult(0.0, 0.0, 4, 0, est(6, 0, 9), [6.0])], []) is None  # one seed: no spread


def test_tiny_sweep_with_controls_trains_scores_and_reports(tmp_path, capsys):
    corpus = fixture_corpus(tmp_path / "cache", vocab_size=None)  # the sweep trains the missing tokenizer first
    out, png, md, results = tmp_path / "sweep", tmp_path / "sweep.png", tmp_path / "sweep.md", tmp_path / "results"
    args = ["sweep-allocation", "--out", str(out), "--shares", "0,50", "--tokens", str(3 * 4 * 32), "--d-model", "32",
            "--layers", "2", "--max-seq", "32", "--experts", "4", "--expert-ffn", "16", "--batch-size", "4",
            "--warmup-steps", "1", "--eval-tokens", "200", "--corpus", str(corpus), "--device", "cpu", "--quiet",
            "--controls", "tokens,compute"]
    assert main(args + ["--plot", str(png), "--markdown", str(md), "--results", str(results)]) == 0
    assert (corpus / "tokenizer.json").is_file()
    result = json.loads((out / "sweep.json").read_text())
    runs = {p["run"]: p for p in result["points"]}
    assert list(runs) == ["share00-s0", "share50-s0", "moe02-s0", "moe02-compute-s0"]
    assert all(np.isfinite(p["loss"]["value"]) and p["step_s"] > 0 for p in runs.values())
    half, control, compute = runs["share50-s0"], runs["moe02-s0"], runs["moe02-compute-s0"]
    assert half["n_experts"] == 2 and half["rows_per_head"] > 0 and 0.4 < half["actual_share"] < 0.6
    assert control["n_experts"] == 2 and control["table_params"] == 0 and control["steps"] == half["steps"] == 3
    # the control has exactly the Engram model's experts and backbone, and no tables
    assert control["expert_params"] == half["expert_params"] and control["loss_off"] is None
    ratio = json.loads((out / "step_ratios.json").read_text())["0.5"]
    assert ratio["ratio"] > 0 and len(ratio["engram_step_s"]) == len(ratio["control_step_s"]) == 5
    assert compute["tokens"] == 128 * -(-int(np.ceil(384 * ratio["ratio"])) // 128)  # tokens x ratio, whole steps
    # Engram off is scored for the Engram model only, on the same documents
    assert half["loss_off"]["value"] != half["loss"]["value"] and runs["share00-s0"]["loss_off"] is None
    what = {c["what"]: c for c in result["comparisons"]}
    assert set(what) == {"engram_vs_control", "control_vs_share0", "engram_vs_share0", "engram_off",
                         "off_vs_control", "engram_vs_compute"}
    c = what["engram_vs_control"]
    assert c["subject"] == "share50" and c["reference"] == "moe02" and c["seeds"] == [0] and c["seed_ci95"] is None
    assert c["seed_deltas"][0] == pytest.approx(half["loss"]["value"] - control["loss"]["value"], abs=1e-9)
    assert c["delta"]["value"] == pytest.approx(c["seed_deltas"][0], abs=1e-9)
    assert what["engram_off"]["delta"]["value"] == pytest.approx(half["loss_off"]["value"] - half["loss"]["value"])
    assert what["off_vs_control"]["delta"]["value"] == pytest.approx(half["loss_off"]["value"]
                                                                     - control["loss"]["value"])
    assert "cannot show a U" in result["verdict"] and png.stat().st_size > 1000
    report = md.read_text()
    for name, table in ar.TABLES.items():  # every result file renders the table the report prints
        data = json.loads((results / f"{name}.json").read_text())
        assert data["config"]["out"] == "sweep" and data["config"]["corpus"] == corpus.name
        if name != "power":  # one seed: no spread to size a power analysis from
            assert table(data) in report, name
    assert json.loads((results / "power.json").read_text())["power"] is None

    stamps = {r: (out / r / "scores.npz").stat().st_mtime_ns for r in runs}
    assert main(args + ["--seeds", "0,1", "--no-train"]) == 0  # reuse, score nothing again, train nothing
    again = json.loads((out / "sweep.json").read_text())
    assert [p["run"] for p in again["points"]] == list(runs)
    assert again["missing"] == ["share00-s1", "share50-s1", "moe02-s1", "moe02-compute-s1"]
    assert all((out / r / "scores.npz").stat().st_mtime_ns == t for r, t in stamps.items())
    assert not (out / "share00-s1").exists() and "Not finished" in capsys.readouterr().out
