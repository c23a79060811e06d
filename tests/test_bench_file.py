"""`tiergram bench lookup --tier file` on a tiny table: the JSON it prints, and the table it creates."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiergram.bench import file_lookup
from tiergram.cli import main
from tiergram.format import TableFile
from tiergram.store import TieredTable

TINY = ["--heads", "3", "--dim", "64", "--rows-per-head", "2000", "--positions", "4", "--min-time", "0.6",
        "--rounds", "2", "--queue-depths", "1,4,8", "--py-threads", "2,3", "--queue-depth", "8"]


@pytest.fixture
def bench_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERGRAM_CACHE", str(tmp_path))
    return tmp_path


def test_file_bench_json(bench_home, capsys):
    assert main(["bench", "lookup", "--tier", "file", *TINY, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    for key in ("tiergram_pages_per_s", "tiergram_rows_per_s", "python_threads_pages_per_s", "vs_limit",
                "vs_python_threads"):
        assert obj[key] > 0, key
    assert set(obj["limit_pages_per_s"]) == {"1", "4", "8"}
    assert all(v > 0 for v in obj["limit_pages_per_s"].values())
    assert set(obj["python_threads"]) == {"2", "3"}
    assert obj["python_threads_pages_per_s"] == max(d["pages_per_s"] for d in obj["python_threads"].values())
    assert set(obj["tiergram"]) == {"uniform", "zipf", "uniform +10% cache"}
    for d in obj["tiergram"].values():
        assert d["pages_per_s"] > 0 and d["rows_per_s"] > 0 and d["rows_per_call"] == 12
        assert 0 < d["pages_per_call"] <= 12 and d["cpu_us_per_row"] > 0
        # the per-round CPU figures behind the median (paired ratios in the text report)
        assert d["cpu_us_per_row"] == pytest.approx(float(np.median(d["cpu_us_per_row_rounds"])))
    assert set(obj["all_hits"]) == {"1", "64", "256"}
    for d in obj["all_hits"].values():
        assert d["vs_host"] == pytest.approx(d["tiergram_us_per_call"] / d["host_us_per_call"])
        assert d["python_calls_per_lookup"] > 0 and d["python_calls_per_prefetch"] > 0
    # the headline is the worst distribution without a cache, and the ratios are computed
    # from the figures printed
    worst = min(obj["tiergram"][k]["pages_per_s"] for k in ("uniform", "zipf"))
    assert obj["tiergram_pages_per_s"] == worst
    best_deep = max(obj["limit_pages_per_s"][q] for q in ("4", "8"))
    assert obj["vs_limit"] == pytest.approx(worst / best_deep)
    assert obj["vs_python_threads"] == pytest.approx(worst / obj["python_threads_pages_per_s"])
    for name, target in (("vs_limit", 0.85), ("vs_python_threads", 2.0)):
        t = obj["targets"][name]
        assert t["target"] == target and t["met"] == (t["value"] >= target) and t["value"] == obj[name]
    # what the disk allows: its best limit over the Python threads' pages/s (no queue depth >= 32 here: the best)
    assert obj["targets"]["vs_python_threads"]["reachable"] == pytest.approx(
        max(obj["limit_pages_per_s"].values()) / obj["python_threads_pages_per_s"])
    table = obj["table"]
    assert table["path"].startswith(str(bench_home)) and table["rows"] == 6000
    assert table["provenance"]["init"] == "normal(0, 1), seed 0"
    assert obj["config"]["positions"] == 4 and obj["backend"] in ("io_uring", "threads")


def test_file_bench_text(bench_home, capsys):
    assert main(["bench", "lookup", "--tier", "file", *TINY]) == 0
    out = capsys.readouterr().out
    for needle in ("limit: native reader QD8", "python threads os.preadv x3", "tiergram lookup, uniform",
                   "tiergram lookup, zipf", "target vs_limit >= 85%", "target vs_python_threads",
                   "uniform +10% cache / no cache:", "x CPU per row (median of the rounds' ratios: ",
                   "x CPU per page read, i.e. per miss (median of the rounds' ratios: "):
        assert needle in out, needle


def test_cached_reader_starts_with_a_full_cache(bench_home):
    """The cache reader measures a serving cache's state: full before its first segment, so every miss evicts."""
    cfg = file_lookup.FileLookupBenchConfig(heads=3, dim=64, rows_per_head=2000, positions=4)
    table = file_lookup.bench_file_table(cfg, progress=False)
    reader = file_lookup.TiergramLookup(table, cfg, "uniform", cache_rows=600)
    try:
        cache = reader.store.cache
        assert cache.capacity == 600 and len(cache) == 600
        before = reader.store.stats()
        seg = reader.segment(0.2)
        after = reader.store.stats()
        assert seg.pages > 0 and after["cache"]["evicted"] > before["cache"]["evicted"]
    finally:
        reader.close()


def test_bench_table_is_valid_and_reused(bench_home):
    cfg = file_lookup.FileLookupBenchConfig(heads=2, dim=64, rows_per_head=3000)
    table = file_lookup.bench_file_table(cfg, progress=False)
    m = table.manifest
    assert table.verify() == [] and m.codec == "fp8_e4m3" and m.head_rows == (3000, 3000)
    mtime = table.path.stat().st_mtime_ns
    assert file_lookup.bench_file_table(cfg, progress=False).path.stat().st_mtime_ns == mtime  # created once
    # every row decodes to finite values of N(0, 1)
    store = TieredTable(table.path, tier="file")
    try:
        rows = store.lookup(np.arange(3000).reshape(1500, 2))
    finally:
        store.close()
    assert torch.isfinite(rows).all() and rows.abs().max() < 10 and 0.8 < rows.std() < 1.2
    assert TableFile.open(table.path).manifest == m


def test_sizes_from_gib():
    m = file_lookup.table_manifest(file_lookup.FileLookupBenchConfig(table_gib=0.5))
    assert m.n_heads == 24 and m.row_bytes == 264
    assert abs(m.data_bytes - 2**29) <= m.page_size * m.n_heads
    with pytest.raises(ValueError, match="holds no rows"):
        file_lookup.table_manifest(file_lookup.FileLookupBenchConfig(table_gib=1e-9))


def test_bad_options(bench_home):
    with pytest.raises(SystemExit):
        main(["bench", "lookup", "--tier", "file", "--queue-depths", "0,32"])
    with pytest.raises(ValueError, match="rounds"):
        file_lookup.run(file_lookup.FileLookupBenchConfig(rounds=0), progress=False)



def test_readers_draw_pages_no_earlier_probe_or_round_chose(bench_home):
    """This VM's volume serves blocks it served recently from a cache: a probe that repeats an earlier probe's
    pages, or a round that repeats an earlier round's ids, would measure that cache, not the disk: every reader draws
    new pages."""
    cfg = file_lookup.FileLookupBenchConfig(heads=2, dim=64, rows_per_head=3000, positions=4, store_queue_depth=8)
    table = file_lookup.bench_file_table(cfg, progress=False)
    n = table.manifest.n_pages
    a, b = (file_lookup.LimitReader(table, 4) for _ in range(2))
    try:
        assert not np.array_equal(a.rng.integers(0, n, 64), b.rng.integers(0, n, 64))
    finally:
        for r in (a, b):
            r.close()
    look = file_lookup.TiergramLookup(table, cfg, "uniform")
    threads = file_lookup.PythonThreads(table, 2)
    try:
        first = [x.copy() for x in look.batches]
        assert look.segment(0.05).pages > 0
        assert not all(np.array_equal(x, y) for x, y in zip(first, look.batches, strict=True))
        threads.segment(0.02)
        offsets = threads.offsets.copy()
        threads.segment(0.02)
        assert not np.array_equal(offsets, threads.offsets)
    finally:
        look.close()
        threads.close()


def test_reread_probe_reads_new_pages_then_the_same_ones(bench_home):
    """The probe behind `plan calibrate`: both passes read the same pages (O_DIRECT) and give a rate each."""
    cfg = file_lookup.FileLookupBenchConfig(heads=2, dim=64, rows_per_head=3000)
    table = file_lookup.bench_file_table(cfg, progress=False)
    fresh, again = file_lookup.reread_rates(table, pages=300, qd=8)
    assert fresh > 0 and again > 0
