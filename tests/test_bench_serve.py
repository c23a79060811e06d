"""`tiergram bench serve`: a tiny real sweep (subprocess servers, streaming HTTP clients) and its pieces."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import fixture_corpus, offline_default_sources
from test_server import make_tiny_model

from tiergram.bench.common import percentile
from tiergram.bench.load import Timing, Trace, trace_tokens
from tiergram.bench.serve_config import SweepConfig
from tiergram.bench.serve_process import ServeSubprocess
from tiergram.bench.serve_report import checks_text
from tiergram.bench.serve_stats import Point, Round, SweepResult, checks, pareto, summarize
from tiergram.cli import main
from tiergram.plan.model import levels


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sweep-model"))


def point(c: int, tput: float, inter: float) -> Point:
    nan = float("nan")
    return Point("host", c, 10, 1.0, tput, tput, nan, nan, nan, nan, 1000 / inter, nan, nan, nan, nan, inter, inter,
                 None, 0.0)


def test_levels_and_pareto():
    assert levels(64, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert levels(6, 64) == [1, 2, 4, 6] and levels(64, 3) == [1, 2, 3] and levels(0, 8) == [1]
    pts = [point(1, 100, 50), point(2, 180, 45), point(4, 170, 30), point(8, 300, 20)]
    assert [p.concurrency for p in pareto(pts)] == [1, 2, 8]  # c=4 is beaten by c=2 on both axes


def test_trace_lengths_and_windows():
    tokens = np.arange(10_000)
    reqs = Trace(tokens, 50, 10, seed=0).take(20)
    assert all(40 <= len(r.prompt) <= 50 and 8 <= len(r.output) <= 10 for r in reqs)
    assert reqs[0].output[0] == reqs[0].prompt[-1] + 1  # the output continues the text the prompt cut
    assert reqs[1].prompt[0] == reqs[0].output[-1] + 1
    again = Trace(tokens, 50, 10, seed=0).take(20)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # every placement replays the same requests


def test_conversations_reuse_their_document_and_history():
    from tiergram.bench.load import Conversations

    tokens = np.arange(50_000)
    conv = Conversations(tokens, 64, 8, seed=0, turns=3, docs=4)
    sessions = conv.take(7)
    assert len(sessions) == 3 and all(len(s) == 3 for s in sessions)  # ceil(7 / 3) sessions of 3 turns
    assert conv.max_len == 64 + 3 * (8 + 8)
    for s in sessions:
        assert s[0].prompt[:64] in conv.docs and len(s[0].prompt) == 64 + 8  # a shared document, then a question
        for before, turn in zip(s[:-1], s[1:], strict=True):  # a turn: all before it, answers too
            assert turn.prompt[:len(before.prompt) + 8] == before.prompt + before.output
            assert len(turn.prompt) == len(before.prompt) + 8 + 8 and len(turn.output) == 8
    again = Conversations(tokens, 64, 8, seed=0, turns=3, docs=4).take(7)
    assert [[r.prompt for r in s] for s in again] == [[r.prompt for r in s] for s in sessions]


def test_tiny_sweep_writes_json_markdown_and_plot(model_dir, tmp_path, capsys):
    from tiergram.model.checkpoint import hasher_of, load_tokenizer_of
    from tiergram.model.hot_rows import count_hot_rows, save_hot_rows

    png, md = tmp_path / "fronts.png", tmp_path / "table.md"
    h = hasher_of(json.loads((model_dir / "config.json").read_text()), load_tokenizer_of(model_dir))
    hot = save_hot_rows(count_hot_rows(h, np.arange(600) % 41, progress=False), model_dir / "hot_rows.npz")
    try:
        rc = main(["bench", "serve", str(model_dir), "--placements", "device,host,file", "--input-len", "24",
                   "--output-len", "6", "--max-concurrency", "2", "--requests-per-user", "3", "--warmup-per-user",
                   "1", "--rounds", "2", "--hot-rows",
                   "--source", "stdlib", "--plot", str(png), "--markdown", str(md), "--json"])
    finally:
        hot.unlink()
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["servers"]["file"]["hot_rows_preloaded"] > 0 and res["servers"]["file"]["hot_rows_preload_s"] > 0
    assert "hot_rows_preloaded" not in res["servers"]["host"]  # nothing to preload: the table is in DRAM
    assert {(p["placement"], p["concurrency"]) for p in res["points"]} == {
        (pl, c) for pl in ("device", "host", "file") for c in (1, 2)}
    for p in res["points"]:
        for key in ("throughput_tok_s", "ttft_p90_ms", "itl_p90_ms", "interactivity_p90", "e2e_p99_ms"):
            assert p[key] > 0, (key, p)
        assert p["requests"] == 3 * p["concurrency"] * 2  # 3 per user in each of 2 rounds
        assert len(p["throughput_rounds"]) == 2 and p["throughput_tok_s"] == pytest.approx(
            float(np.median(p["throughput_rounds"])), rel=1e-3)
        assert (p["engram_cache_hit_rate"] is not None) == (p["placement"] == "file")
        assert (p["file_pages_per_s"] > 0) == (p["placement"] == "file")  # a 10% cache misses: pages are read
        if p["placement"] == "file":  # the share of them its server had never read before
            assert 0 <= p["file_first_read_share"] <= 1
        else:
            assert p["file_first_read_share"] is None
        assert p["cpu_ms_per_token"] > 0  # the server's process_cpu_seconds_total moved
        assert p["prompt_rows_timeouts"] <= p["prompt_rows_waits"] and p["prompt_rows_wait_s"] >= 0
        assert p["cpu_speed_ms"] > 0 and len(p["cpu_speed_rounds"]) == 2  # the speed probes beside its rounds
        by_thread = p["cpu_ms_per_token_by_thread"]
        assert "tiergram-engine" in by_thread  # the step thread (and torch's workers it started)
        # the threads' sum is the process's CPU less threads that ended mid-round (read just after /metrics); both
        # come from /proc in whole clock ticks, so each round's difference of two readings is under a tick off per
        # thread and for the process: on a tiny sweep's ~200 tokens a tick is ~0.05 ms per token (still well under
        # a thread counted twice)
        tokens = p["throughput_tok_s"] * p["duration_s"]  # the median round's rate over every round: about right
        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK") / tokens
        slack = len(p["throughput_rounds"]) * (len(by_thread) + 1) * tick_ms
        assert 0 < sum(by_thread.values()) <= 1.25 * p["cpu_ms_per_token"] + slack
    assert set(res["fronts"]) == {"device", "host", "file"} and all(res["fronts"].values())
    checks = res["checks"]
    assert set(checks["host_vs_device"]["ratios"]) == {"1", "2"} and "passed" in checks["host_vs_device"]
    assert set(checks["file_vs_host"]["ratios"]) == {"1", "2"} and checks["file_vs_host"]["cache_fraction"] == 0.1
    assert checks["budget"]["binds"] is False
    assert set(res["disk_pages_per_s"]) == {"before", "after"} and min(res["disk_pages_per_s"].values()) > 0
    assert res["servers"]["file"]["file_mode"] == checks["file_vs_host"]["file_mode"] == "direct"  # limits measured
    assert set(checks["file_vs_host"]["file_pages_per_s"]) == {"1", "2"}
    assert set(checks["file_vs_host"]["cpu_per_token_vs_host"]) == {"1", "2"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = md.read_text()
    assert table.startswith("| placement | concurrency | throughput tok/s") and table.count("\n") == 2 + 6


def test_conversations_sweep_reports_prefix_hits(model_dir, tmp_path, capsys):
    """A tiny conversations sweep: a host server without and with a host K/V tier under one host budget; the
    prefix cache is hit (turns reuse their history) and the host tier moves blocks back."""
    variants = tmp_path / "split.toml"
    variants.write_text('[variants.host-kv]\nbase = "host"\nkv_host_fraction = 0.5\n')
    budget = tmp_path / "budget.toml"
    budget.write_text("[engine]\nhost_memory = 8388608\n")
    rc = main(["bench", "serve", str(model_dir), "--placements", "host", "--variants", str(variants), "--config",
               str(budget), "--workload", "conversations", "--input-len", "16", "--output-len", "4",
               "--max-concurrency", "2", "--requests-per-user", "4", "--warmup-per-user", "0", "--rounds", "1",
               "--source", "stdlib", "--plot", str(tmp_path / "p.png"), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["workload"] == "conversations"
    for p in res["points"]:
        assert p["requests"] == 4 * p["concurrency"]  # sessions of 4 turns
        assert 0 < p["prefix_hit_rate"] <= 1, p  # turn 2 on reuses turn 1's blocks
        if p["placement"] == "host":
            assert p["prefix_host_hit_rate"] == 0  # no host K/V tier: host_memory is all the tables'
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(res))
    assert main(["bench", "split", str(sweep), "--plot", str(tmp_path / "split.png"), "--json"]) == 0
    split = json.loads(capsys.readouterr().out)
    shares = {(s["server"], s["concurrency"]): (s["kv_host_bytes"], s["engram_host_bytes"]) for s in split["points"]}
    assert shares[("host", 1)] == (0, 8 << 20) and shares[("host-kv", 2)] == (4 << 20, 4 << 20)
    assert set(split["best"]) == {"1", "2"} and (tmp_path / "split.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "split", str(tmp_path / "split.png")]) == 1  # not a sweep: said, not a traceback


def test_summarize_takes_the_median_round_and_pools_the_rest():
    def timings(n: int, prompt: int, out: int) -> list[Timing]:
        return [Timing(0.01, [0.002] * (out - 1), 0.05, prompt, out) for _ in range(n)]

    def metrics(probes: float, hits: float, file_bytes: float, cpu: float = 0.0) -> dict[str, float]:
        return {"tiergram_engram_cache_probes_total": probes, "tiergram_engram_cache_hits_total": hits,
                'tiergram_engram_bytes_read_total{tier="file"}': file_bytes, "process_cpu_seconds_total": cpu,
                "tiergram_engram_pages_read_total": file_bytes / 4096,
                "tiergram_engram_pages_first_read_total": file_bytes / 4096 / 5,  # a fifth of them first reads
                "tiergram_engine_prompt_rows_waits_total": probes / 100,
                "tiergram_engine_prompt_rows_wait_seconds_total": probes / 1000,
                "tiergram_engine_prompt_rows_timeouts_total": float(probes > 100)}

    zero = metrics(0, 0, 0)
    rounds = [Round(timings(4, 20, 5), 1.0, zero, metrics(100, 30, 4096 * 10, cpu=0.6), 9.0),  # 100 tok/s
              Round(timings(4, 20, 5), 0.5, zero, metrics(100, 50, 4096 * 20), 7.0),  # 200 tok/s
              Round(timings(4, 20, 5), 2.0, zero, metrics(200, 40, 4096 * 5), 12.0)]  # 50 tok/s
    p = summarize("file", 4, rounds)
    assert p.throughput_rounds == [100.0, 200.0, 50.0] and p.throughput_tok_s == 100.0  # the median, not the mean
    assert p.output_tok_s == pytest.approx(20.0)  # the output share (5 of 25 tokens) of that throughput
    assert p.requests == 12 and p.duration_s == 3.5
    assert p.engram_cache_hit_rate == pytest.approx(120 / 400)  # counters summed over the rounds
    assert p.file_pages_per_s == pytest.approx(35 / 3.5)
    assert p.file_first_read_share == pytest.approx(0.2)  # first reads over pages read, both summed
    assert p.itl_p90_ms == pytest.approx(2.0) and p.ttft_p50_ms == pytest.approx(10.0)
    assert p.cpu_ms_per_token == pytest.approx(1e3 * 0.6 / 300)  # CPU over every round's 3 x 100 tokens
    assert p.cpu_speed_rounds == [9.0, 7.0, 12.0] and p.cpu_speed_ms == 9.0  # the rounds' speed probes, median
    assert (p.prompt_rows_waits, p.prompt_rows_timeouts) == (4, 1) and p.prompt_rows_wait_s == pytest.approx(0.4)
    assert summarize("file", 4, [Round(timings(4, 20, 5), 1.0, zero, zero)]).cpu_speed_ms is None  # no probe
    assert p.server_step_ms is None and p.steps_per_request is None  # no engine counters scraped


def test_summarize_gives_the_servers_own_step_and_steps_per_request():
    timing = Timing(0.01, [0.002] * 4, 0.05, 20, 5)
    zero = {"tiergram_engine_steps_total": 0.0, "tiergram_engine_step_seconds_total": 0.0}
    rounds = [Round([timing] * 4, 1.0, zero, {"tiergram_engine_steps_total": 30.0,
                                              "tiergram_engine_step_seconds_total": 0.6}),
              Round([timing] * 4, 2.0, zero, {"tiergram_engine_steps_total": 10.0,
                                              "tiergram_engine_step_seconds_total": 1.4})]
    p = summarize("host", 4, rounds)
    assert p.server_step_ms == pytest.approx(1e3 * 2.0 / 40)  # seconds stepping over steps, both summed
    assert p.steps_per_request == pytest.approx(40 * 4 / 8)  # each step serves the c = 4 users' requests


def test_page_cache_reads_get_no_disk_limit():
    """A file server reading buffered (O_DIRECT refused) is labelled so, and no disk limit is printed beside it."""
    cfg = SweepConfig(model_dir="m", placements=("host", "file"))
    servers = {"host": {"concurrency_limit": 2, "cache_bytes": 0},
               "file": {"concurrency_limit": 2, "cache_bytes": 100, "file_mode": "buffered"}}
    points = [point(1, 100, 50), point(1, 90, 45)]
    points[1].placement = "file"
    res = SweepResult(cfg, "test", points, {}, servers, {}, 1.0, disk_pages_per_s={})
    res.checks = checks(res)
    assert res.checks["file_vs_host"]["file_mode"] == "buffered"
    text = checks_text(res)
    assert "file tier reads (buffered)" in text and "no disk limit (O_DIRECT refused" in text
    assert "the disk's limit" not in text


def test_a_server_that_cannot_start_says_why(tmp_path):
    """The server's own error reaches the caller, and its process is gone (bench serve and bench soak share this)."""
    server = ServeSubprocess(tmp_path / "no-model", startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="did not start(.|\n)*no config.json"):
        server.start()
    assert server.proc.poll() is not None


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_numpys_and_monotone(values, q1, q2):
    lo, hi = sorted((q1, q2))
    assert min(values) <= percentile(values, lo) <= percentile(values, hi) <= max(values)
    assert percentile(values, hi) == float(np.percentile(values, hi))
    assert np.isnan(percentile([], 50))


def test_trace_from_the_corpus_builds_a_missing_one(tmp_path, monkeypatch):
    """--source corpus on a fresh machine: the corpus is built first, and the trace is its test split."""
    from tiergram.corpus import load_tokenizer

    tok = load_tokenizer(fixture_corpus(tmp_path / "fixture") / "tokenizer.json")
    corpus = offline_default_sources(monkeypatch, tmp_path)
    tokens, what = trace_tokens(tok, 100, "corpus")
    assert (corpus / "test.jsonl").is_file() and what == f"corpus test split ({corpus})" and len(tokens) >= 100
