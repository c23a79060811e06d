"""bench serve at scale: file servers at several cache fractions and on a second model, their checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiergram.bench.serve_config import SweepConfig, Variant, load_variants, round_order
from tiergram.bench.serve_process import ServerProcess, cache_budgets, server_settings
from tiergram.bench.serve_report import checks_text, to_json, to_markdown
from tiergram.bench.serve_stats import Point, SweepResult, checks


def point(label: str, c: int, tok_s: float, cpu: float = 1.0) -> Point:
    return Point(placement=label, concurrency=c, requests=4, duration_s=1.0, throughput_tok_s=tok_s,
                    output_tok_s=tok_s / 5, ttft_p50_ms=1, ttft_p90_ms=2, ttft_p99_ms=3, itl_p50_ms=1, itl_p90_ms=2,
                    itl_p99_ms=3, e2e_p50_ms=1, e2e_p90_ms=2, e2e_p99_ms=3, interactivity_p50=1, interactivity_p90=1,
                    engram_cache_hit_rate=0.5, exposed_stall_s=0.1, cpu_ms_per_token=cpu, file_pages_per_s=100.0,
                    server_peak_rss_bytes=1 << 30)


def test_labels_expand_the_file_placement_per_cache_fraction():
    cfg = SweepConfig(model_dir="m", placements=("host", "file"), cache_fractions=(0.01, 0.1), big_model_dir="b")
    assert cfg.labels() == ["host", "file-1%", "file-10%", "file-big"]
    assert [cfg.kind_of(lb) for lb in cfg.labels()] == ["host", "file", "file", "file"]
    assert SweepConfig(model_dir="m", placements=("host", "file")).labels() == ["host", "file"]
    with pytest.raises(ValueError, match="cache_fractions"):
        SweepConfig(model_dir="m", cache_fractions=(0.5, 1.5))


def test_checks_compare_every_file_server_with_host():
    cfg = SweepConfig(model_dir="m", placements=("host", "file"), cache_fractions=(0.01, 0.1))
    servers = {lb: {"concurrency_limit": 4, "cache_bytes": 10, "table_bytes": 1000, "peak_rss_bytes": 2 << 30}
               for lb in cfg.labels()}
    servers["file-10%"] |= {"hot_rows_preloaded": 1_500_000, "hot_rows_preload_s": 5.31}
    points = [point("host", 1, 100.0, 2.0), point("host", 2, 200.0, 2.0), point("file-1%", 1, 80.0, 2.2),
              point("file-1%", 2, 150.0, 2.4), point("file-10%", 1, 95.0), point("file-10%", 2, 190.0)]
    res = SweepResult(cfg, "test", points, {}, servers, {}, 1.0, disk_pages_per_s={"before": 1000.0})
    ck = checks(res)
    assert ck["file-1%_vs_host"]["ratios"] == {1: 0.8, 2: 0.75} and not ck["file-1%_vs_host"]["passed"]
    assert ck["file-10%_vs_host"]["ratios"] == {1: 0.95, 2: 0.95} and ck["file-10%_vs_host"]["passed"]
    assert ck["file-1%_vs_host"]["cache_fraction"] == 0.01 and ck["file-10%_vs_host"]["cache_fraction"] == 0.1
    assert ck["file-1%_vs_host"]["cpu_per_token_vs_host"] == {1: pytest.approx(1.1), 2: pytest.approx(1.2)}
    # pages per token (100 pages/s over 80 tok/s) x 0.9 x host's 100 tok/s, over the disk's 1,000 pages/s
    assert ck["file-1%_vs_host"]["disk_share_needed"] == {1: pytest.approx(100 / 80 * 0.9 * 100 / 1000),
                                                          2: pytest.approx(100 / 150 * 0.9 * 200 / 1000)}
    res.checks = ck
    text = checks_text(res)
    assert "share of the disk's limit file-1% needs to reach 90% of host" in text
    assert "file-1%" in text and "file-10%" in text and "peak RSS: host 2.00 GiB" in text
    assert "hot-rows preload at start: file-10% 1,500,000 rows in 5.3 s" in text
    assert "peak RSS GiB" in to_markdown(res)


def test_throughput_ratios_pair_the_rounds():
    """A round's placements run back to back: the check is the median of the ratios within a round, not the ratio
    of two medians that may come from different rounds (here a slow third round for both)."""
    cfg = SweepConfig(model_dir="m", placements=("host", "file"))
    servers = {lb: {"concurrency_limit": 1, "cache_bytes": 10, "table_bytes": 1000, "peak_rss_bytes": 1}
               for lb in cfg.labels()}
    host, file = point("host", 1, 100.0), point("file", 1, 90.0)
    host.throughput_rounds, file.throughput_rounds = [100.0, 110.0, 60.0], [97.0, 108.0, 59.0]
    unequal = point("file", 2, 50.0)
    unequal.throughput_rounds = [50.0]
    host2 = point("host", 2, 100.0)
    host2.throughput_rounds = [100.0, 100.0]
    res = SweepResult(cfg, "test", [host, file, host2, unequal], {}, servers, {}, 1.0)
    ck = checks(res)["file_vs_host"]
    assert ck["ratios"] == {1: pytest.approx(108 / 110), 2: pytest.approx(0.5)}  # 2: no pairs, the fields' ratio
    assert ck["median_ratios"] == {1: pytest.approx(0.9), 2: pytest.approx(0.5)}
    assert ck["round_ratios"][1] == [0.97, pytest.approx(0.9818, abs=1e-4), pytest.approx(0.9833, abs=1e-4)]
    assert ck["round_ratios"][2] == [] and ck["passed"] is False
    res.checks = checks(res)
    assert "c=1 0.97/0.98/0.98 (medians' ratio 0.900)" in checks_text(res)


def test_file_big_is_set_against_the_disk_limit_measured_on_its_own_tables(monkeypatch):
    """The volume serves recently read extents faster than cold ones: file-big's share of the disk is taken against
    the limit measured on the big model's tables, the others' against their own model's."""
    cfg = SweepConfig(model_dir="m", placements=("host", "file"), big_model_dir="b", big_cache_bytes=10)
    servers = {lb: {"concurrency_limit": 1, "cache_bytes": 10, "table_bytes": 1000, "peak_rss_bytes": 1,
                    "model_dir": "b"} for lb in cfg.labels()}
    monkeypatch.setattr("tiergram.bench.serve_stats.layer_table_bytes", lambda d: [500, 500])  # b's two tables
    points = [point(lb, 1, 100.0) for lb in cfg.labels()]
    res = SweepResult(cfg, "test", points, {}, servers, {}, 1.0, disk_pages_per_s={"before": 1000.0},
                         big_disk_pages_per_s={"before": 100.0, "after": 300.0})
    ck = checks(res)
    assert ck["file_vs_host"]["disk_pages_per_s"] == {"before": 1000.0}
    assert ck["file_vs_host"]["disk_share_needed"] == {1: pytest.approx(100 / 100 * 0.9 * 100 / 1000)}
    assert ck["file-big_vs_host"]["disk_pages_per_s"] == {"before": 100.0, "after": 300.0}
    assert ck["file-big_vs_host"]["disk_share_needed"] == {1: pytest.approx(100 / 100 * 0.8 * 100 / 200)}
    assert json.loads(to_json(res))["big_disk_pages_per_s"] == {"before": 100.0, "after": 300.0}
    assert ck["file-big_vs_host"]["above_disk_limit"] == ck["file_vs_host"]["above_disk_limit"] == []


def test_a_server_reading_past_the_disks_new_page_limit_is_flagged():
    """A cache under the disk serves pages an earlier run read far faster than new ones: a file server reading
    more than 1.25x the higher limit measured on new pages is flagged, and the report says those points are not
    the disk's."""
    cfg = SweepConfig(model_dir="m", placements=("host", "file"))
    servers = {lb: {"concurrency_limit": 4, "cache_bytes": 10, "table_bytes": 1000, "peak_rss_bytes": 1}
               for lb in cfg.labels()}
    points = [point(lb, c, 100.0) for lb in cfg.labels() for c in (1, 2, 4)]
    for p in points:
        p.file_pages_per_s = {1: 100.0, 2: 125.0, 4: 126.0}[p.concurrency]  # the limit: 100 before, 80 after
    res = SweepResult(cfg, "test", points, {}, servers, {}, 1.0, disk_pages_per_s={"before": 100.0, "after": 80.0})
    res.checks = checks(res)
    assert res.checks["file_vs_host"]["above_disk_limit"] == [4]
    text = checks_text(res)
    assert "WARNING: file read faster than 1.25x the disk's limit for new pages at c=4" in text
    res.disk_pages_per_s = {}
    assert checks(res)["file_vs_host"]["above_disk_limit"] == []  # no limit measured: nothing claimed


def test_default_sweep_starts_no_mooncake_cluster():
    """The demo's sweep uses the defaults: Mooncake (which needs a master or a private namespace) is opt-in."""
    assert "mooncake" not in SweepConfig(model_dir="m").labels()


VARIANTS = Path(__file__).parent.parent / "docs" / "variants.toml"


def test_the_example_variants_file_adds_each_server_after_its_base(tmp_path):
    """docs/variants.toml: each [variants.NAME] is a server right after the one it copies, with its base's cache
    and kind; its [engine] changes reach the server's typed configuration, nothing else does."""
    variants = load_variants(VARIANTS)
    cfg = SweepConfig(model_dir="m", placements=("host", "file"), hot_rows=True, variants=variants)
    assert cfg.labels() == ["host", "host-process", "host-t1", "file", "file-cold", "file-no-read-ahead", "file-t1"]
    assert [cfg.kind_of(lb) for lb in cfg.labels()] == ["host"] * 3 + ["file"] * 4
    tables = [tmp_path / "a.tgram"]
    tables[0].write_bytes(b"x" * 1000)
    caches = cache_budgets(cfg, tables)
    assert caches["file-t1"] == caches["file-cold"] == caches["file"] == 100 and caches["host-t1"] == 0
    (tmp_path / "hot_rows.npz").write_bytes(b"")
    cfg.model_dir = str(tmp_path)
    settings = {lb: server_settings(cfg, lb, caches[lb], 16).engine for lb in cfg.labels()}
    assert settings["host-process"].engine_process and not settings["host"].engine_process
    assert settings["file"].hot_rows == str(tmp_path / "hot_rows.npz") and settings["file-cold"].hot_rows is None
    assert settings["host"].hot_rows is None  # a host server has no cache to preload
    assert not settings["file-no-read-ahead"].read_ahead and settings["file"].read_ahead
    assert settings["file-t1"].torch_threads == 1 and settings["file"].torch_threads == 0
    assert settings["file-t1"].cache_bytes == 100 and settings["file-t1"].placement == "file"
    servers = {lb: {"concurrency_limit": 2, "cache_bytes": caches[lb], "table_bytes": 1000, "peak_rss_bytes": 1}
               for lb in cfg.labels()}
    tok = {"host": 100.0, "host-process": 120.0, "host-t1": 110.0, "file": 80.0, "file-cold": 72.0,
           "file-no-read-ahead": 60.0, "file-t1": 99.0}
    res = SweepResult(cfg, "test", [point(lb, 1, t) for lb, t in tok.items()], {}, servers, {}, 1.0)
    ck = checks(res)
    assert ck["host-process_vs_host"]["ratios"] == {1: pytest.approx(1.2)}
    assert ck["file-cold_vs_file"]["ratios"] == {1: pytest.approx(0.9)}
    assert ck["file-t1_vs_host-t1"]["ratios"] == {1: pytest.approx(0.9)} and "file-t1_vs_host" not in ck
    assert ck["file-cold_vs_host"]["ratios"] == {1: pytest.approx(0.72)}
    assert ck["file-cold_vs_host"]["cache_fraction"] == 0.1
    res.checks = ck
    text = checks_text(res)
    assert "host-process / host (the same server, engine_process True changed)" in text
    assert ">= 90% of host-t1 at every concurrency" in text


def test_a_server_runs_from_a_typed_config_file(monkeypatch, tmp_path):
    """A sweep's server gets its settings as a --config file (no flags for its engine), the sweep's [engine]
    settings under its variant's."""
    seen = {}

    class Popen:
        def __init__(self, cmd, **kw):
            seen["cmd"] = cmd
            seen["config"] = json.loads(Path(cmd[cmd.index("--config") + 1]).read_text())
            raise OSError("not started in this test")

    monkeypatch.setattr("subprocess.Popen", Popen)
    cfg = SweepConfig(model_dir="m", placements=("host", "file"), max_num_seqs=8, engine={"codec": "fp32"},
                         variants={"file-lfu": Variant("file", {"cache_policy": "lfu"})})
    with pytest.raises(OSError):
        ServerProcess(cfg, "file-lfu", 4096, 16).start()
    assert "--placement" not in seen["cmd"] and "--max-num-seqs" not in seen["cmd"]
    engine = seen["config"]["engine"]
    assert (engine["placement"], engine["cache_bytes"], engine["cache_policy"], engine["codec"]) == \
        ("file", 4096, "lfu", "fp32")
    assert (engine["max_num_seqs"], engine["max_waiting"]) == (8, 16)


@pytest.mark.parametrize(("text", "error"), [
    ('[variants.x]\nbase = "file"\ntorch_threads = "two"', r"\[variants.x\]: torch_threads: expected an integer"),
    ('[variants.x]\nbase = "file"\nspeed = 3', r"\[variants.x\]: unknown key 'speed'"),
    ('[variants.x]\ntorch_threads = 1', r"\[variants.x\]: needs base"),
    ('[variants.x]\nbase = "file"\nplacement = "host"', r"placement is the base server's"),
    ('[variants."a b"]\nbase = "file"', r"a name is letters"),
    ('[other]\nx = 1', r"expected only \[variants.NAME\] tables"),
])
def test_a_variants_file_is_checked_key_by_key(tmp_path, text, error):
    path = tmp_path / "v.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_variants(path)


def test_a_variant_of_a_server_the_sweep_does_not_run_is_refused():
    with pytest.raises(ValueError, match="base 'mooncake' is not a server of this sweep"):
        SweepConfig(model_dir="m", placements=("host", "file"), variants={"m2": Variant("mooncake")}).labels()
    with pytest.raises(ValueError, match="reference 'host-t1' is not a server"):
        SweepConfig(model_dir="m", variants={"f": Variant("file", reference="host-t1")}).labels()
    with pytest.raises(ValueError, match="has the name of another server"):
        SweepConfig(model_dir="m", variants={"host": Variant("file")}).labels()


def test_thread_cpu_seconds_names_each_threads_time():
    """The per-thread CPU a sweep records: a thread named by the OS is counted under its name."""
    import os
    import threading
    import time

    from tiergram import _native
    from tiergram.bench.serve_process import thread_cpu_seconds

    def burn() -> None:
        _native.name_thread("tiergram-burn")
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        done.wait()

    done = threading.Event()
    t = threading.Thread(target=burn)
    t.start()
    key = 'thread_cpu_seconds{name="tiergram-burn"}'
    for _ in range(200):
        got = thread_cpu_seconds(os.getpid())
        if got.get(key, 0.0) >= 0.09:
            break
        time.sleep(0.01)
    done.set()
    t.join()
    assert 0.09 <= got[key] < 5  # clock ticks of 10 ms
    assert sum(got.values()) >= got[key]


def _rounds_sweep(file_rounds: dict[int, list[float]]) -> SweepResult:
    """host at 100 tok/s in every round; file's rounds as given (ratios to host)."""
    cfg = SweepConfig(model_dir="m", placements=("host", "file"))
    servers = {lb: {"concurrency_limit": 4, "cache_bytes": 10, "table_bytes": 1000, "peak_rss_bytes": 1}
               for lb in cfg.labels()}
    points = []
    for c, rounds in file_rounds.items():
        host, file = point("host", c, 100.0), point("file", c, 100.0 * sorted(rounds)[len(rounds) // 2])
        host.throughput_rounds, file.throughput_rounds = [100.0] * len(rounds), [100.0 * r for r in rounds]
        points += [host, file]
    return SweepResult(cfg, "test", points, {}, servers, {}, 1.0)


def test_a_shortfall_within_the_rounds_noise_is_not_called_a_failure():
    """A median under the target by less than two standard errors of the rounds (the spread pooled over the
    points) is "within noise"; well under it, "fail"; the strict median test stays in `passed`."""
    noisy = _rounds_sweep({1: [0.80, 1.00, 1.20], 2: [0.85, 0.88, 1.05], 4: [1.0, 1.0, 1.0]})
    ck = checks(noisy)["file_vs_host"]
    assert ck["passed"] is False and ck["verdict"] == "within noise"
    assert ck["within_noise"] == [2] and ck["below"] == []
    assert ck["sigma_log"] == pytest.approx(0.134, abs=0.002)
    assert ck["rounds_to_resolve"] == 7  # (2 x 0.134 / -ln 0.9)^2 = 6.5
    noisy.checks = checks(noisy)
    text = checks_text(noisy)
    assert ">= 90% of host at every concurrency: WITHIN NOISE" in text
    assert "below the target within that: c=2 (about 7 rounds would resolve the 10% margin)" in text

    short = _rounds_sweep({1: [0.80, 1.00, 1.20], 2: [0.50, 0.52, 0.51], 4: [1.0, 1.0, 1.0]})
    ck = checks(short)["file_vs_host"]
    assert ck["verdict"] == "fail" and ck["below"] == [2] and ck["within_noise"] == []

    steady = _rounds_sweep({1: [0.95, 0.97, 0.99], 2: [0.93, 0.95, 0.97]})
    assert checks(steady)["file_vs_host"]["verdict"] == "pass"
    single = _rounds_sweep({1: [0.85], 2: [0.95]})  # one round each: no noise estimate, the medians decide
    ck = checks(single)["file_vs_host"]
    assert ck["sigma_log"] is None and ck["verdict"] == "fail"


def test_pool_gathers_one_checks_rounds_over_runs(tmp_path, capsys):
    """`tiergram bench pool`: a check's paired round ratios of several runs as one sample per concurrency, with
    bootstrap intervals around its median and geometric mean; a run without the check is a clear error."""
    from tiergram.bench.serve_stats import pool_rounds
    from tiergram.cli import main

    runs = [_rounds_sweep({1: [0.8, 1.0, 1.2], 2: [0.9, 0.9, 0.9]}), _rounds_sweep({1: [1.1, 0.9, 1.0]})]
    paths = []
    for i, res in enumerate(runs):
        res.checks = checks(res)
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(to_json(res))
    sweeps = [json.loads(p.read_text()) for p in paths]
    pooled = pool_rounds(sweeps, "file_vs_host")
    assert pooled[1]["rounds"] == 6 and pooled[1]["median"] == pytest.approx(1.0)
    assert pooled[1]["median_lo"] <= pooled[1]["median"] <= pooled[1]["median_hi"]
    assert pooled[1]["geomean"] == pytest.approx(float(np.exp(np.log([0.8, 1.0, 1.2, 1.1, 0.9, 1.0]).mean())))
    assert pooled[2]["rounds"] == 3 and pooled[2]["median_lo"] == pooled[2]["median_hi"] == pytest.approx(0.9)
    assert main(["bench", "pool", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "file_vs_host, paired round ratios pooled over 2 runs (target 0.9)" in out
    assert "c=1     6 rounds  median 1.000" in out
    assert main(["bench", "pool", str(paths[0]), "--check", "host_vs_device"]) == 1
    assert "has no check 'host_vs_device' (it has: file_vs_host)" in capsys.readouterr().err


@given(st.integers(min_value=1, max_value=8))
def test_round_order_balances_who_goes_first_and_who_goes_before_whom(n):
    """Over 2n rounds every server goes first twice and before each other server in n rounds: a file server reading
    pages another has just read (a cache under the disk returns them faster) is not always the same one."""
    members = [f"s{i}" for i in range(n)]
    orders = [round_order(members, r) for r in range(2 * n)]
    assert all(sorted(o) == members for o in orders)
    assert all(sum(o[0] == m for o in orders) == 2 for m in members)
    for a in members:
        for b in members:
            if a != b:
                assert sum(o.index(a) < o.index(b) for o in orders) == n
