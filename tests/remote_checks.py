"""Checks of the mooncake tier against a real Mooncake cluster; tests/test_remote.py runs this file with pytest
inside a private network namespace (Mooncake's clients listen on every interface). Not collected on its own
(the name does not match test_*.py): run it through test_remote.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tiergram.bench.mooncake_cluster import LocalCluster, private_netns
from tiergram.format import TableFile, TableManifest, create_table, random_values
from tiergram.store import TieredTable
from tiergram.tiers.mooncake import (
    OBJECT_NOT_FOUND,
    MooncakeTier,
    PageReadError,
    connect,
    ensure_pushed,
    manifest_blob,
    manifest_key,
    page_key,
    push_table,
    pushed_name,
    remove_table,
)

BOUND_S = 15.0  # every fault must surface within this (the tier's timeout is 10 s; a dead master answers in ~4.3 s)


@pytest.fixture(scope="module", autouse=True)
def _in_namespace():
    assert private_netns(), "run through tests/test_remote.py (a private network namespace)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("mooncake-logs"), holders=1, segment_bytes=64 << 20) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    store = connect(cluster.master_addr)
    yield store
    store.close()


def _table(path: Path, *, codec: str = "fp8_e4m3", rows: tuple[int, ...] = (700, 523, 301), dim: int = 64,
           seed: int = 0) -> Path:
    m = TableManifest(codec=codec, dim=dim, head_rows=rows)
    return create_table(path, m, random_values(dim, seed=seed), progress=False)


def _ids(rows: tuple[int, ...], n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, r, n) for r in rows], axis=1).astype(np.int64)


def test_push_then_lookup_matches_host_tier(cluster, client, tmp_path):
    path = _table(tmp_path / "a.tgram")
    uri = push_table(path, cluster.master_addr, progress=False, store=client)
    assert uri == f"mooncake://{cluster.master_addr}/a"
    host = TieredTable(path, tier="host")
    ids = _ids((700, 523, 301), 200).reshape(4, 50, 3)
    for cache in (0, 64 * 1024):
        remote = TieredTable(uri, tier="mooncake", cache_bytes=cache)
        try:
            for _ in range(3):
                assert torch.equal(remote.lookup(ids), host.lookup(ids))
                ticket = remote.prefetch(ids[:2])
                assert torch.equal(ticket.wait(timeout=BOUND_S), host.lookup(ids[:2]))
            if cache:
                warm = remote.warm(ids[2:])
                warm.wait(timeout=BOUND_S)
                assert torch.equal(remote.lookup(ids[2:]), host.lookup(ids[2:]))
            st = remote.stats()
            assert st["tier"] == "mooncake" and st["pipeline"] == "native"
            # one registered staging buffer per reading thread (caller, prefetch and read-ahead queues), not per call
            assert len(remote.tier._registered) <= 3
            r = st["remote"]
            assert r["calls"] >= 1 and r["pages_read"] > 0 and r["bytes_read"] == r["pages_read"] * 4096
            assert r["latency_ms_p50"] > 0 and r["errors"] == 0
            # every store call on the worker, which waits at SCHED_IDLE (or nice 19)
            assert r["waiter_priority"] in ("idle", "nice")
            # remote bytes are counted as the mooncake tier's, not the file tier's
            assert st["bytes_read"]["mooncake"] == r["bytes_read"] and "file" not in st["bytes_read"]
            assert st["read_amplification"] >= 1.0
            if cache:
                assert st["hits"] > 0
        finally:
            remote.close()
    host.close()


def test_push_refuses_a_copy_and_replaces_it_whole(cluster, client, tmp_path):
    first = _table(tmp_path / "b.tgram", seed=1)
    second = _table(tmp_path / "b2.tgram", rows=(50, 60), seed=2)
    push_table(first, cluster.master_addr, "b", progress=False, store=client)
    with pytest.raises(FileExistsError, match="already holds table 'b'"):
        push_table(second, cluster.master_addr, "b", progress=False, store=client)
    push_table(second, cluster.master_addr, "b", replace=True, progress=False, store=client)
    t = TieredTable(f"mooncake://{cluster.master_addr}/b", tier="mooncake")
    host = TieredTable(second, tier="host")
    try:
        assert t.manifest == host.manifest
        ids = _ids((50, 60), 30)
        assert torch.equal(t.lookup(ids), host.lookup(ids))
    finally:
        t.close()
        host.close()
    # the first table had more pages than the second: replace removed them
    old_pages = TableFile.open(first).manifest.n_pages
    new_pages = host.manifest.n_pages
    assert all(client.is_exist(page_key("b", p)) == 0 for p in range(new_pages, old_pages))


def test_a_push_without_its_marker_is_invisible_and_a_new_push_cleans_it(cluster, client, tmp_path):
    path = _table(tmp_path / "c.tgram")
    push_table(path, cluster.master_addr, "c", progress=False, store=client)
    assert client.remove(manifest_key("c"), True) == 0  # as if the push died before its last write
    with pytest.raises(FileNotFoundError, match="no table 'c'"):
        TieredTable(f"mooncake://{cluster.master_addr}/c", tier="mooncake")
    push_table(path, cluster.master_addr, "c", progress=False, store=client)  # stale pages do not block it
    t = TieredTable(f"mooncake://{cluster.master_addr}/c", tier="mooncake")
    t.close()
    assert remove_table(client, "c") and not remove_table(client, "c")


def test_a_foreign_table_under_the_pushed_name_is_refused_not_served(cluster, client, tmp_path):
    """Someone who can write to the store put another table (same geometry) under the name ensure_pushed gives
    ours: it is refused naming both; pushed again with --replace, it is reused."""
    ours, foreign = _table(tmp_path / "ours.tgram", seed=5), _table(tmp_path / "foreign.tgram", seed=6)
    name = pushed_name(ours, manifest_blob(TableFile.open(ours)))
    push_table(foreign, cluster.master_addr, name, progress=False, store=client)
    with pytest.raises(ValueError, match=f"holds table '{name}' .* which is not .*ours.tgram"):
        ensure_pushed(ours, cluster.master_addr)
    push_table(ours, cluster.master_addr, name, replace=True, progress=False, store=client)
    assert ensure_pushed(ours, cluster.master_addr) == f"mooncake://{cluster.master_addr}/{name}"
    assert remove_table(client, name)


def test_missing_page_raises_naming_table_page_and_code(cluster, client, tmp_path):
    path = _table(tmp_path / "d.tgram")
    push_table(path, cluster.master_addr, "d", progress=False, store=client)
    t = TieredTable(f"mooncake://{cluster.master_addr}/d", tier="mooncake")
    try:
        m = t.manifest
        assert client.remove(page_key("d", 3), True) == 0
        ids = np.zeros((1, 3), dtype=np.int64)
        ids[0, 0] = 3 * m.rows_per_page  # head 0 starts at row 0: this row lives on page 3
        t0 = time.monotonic()
        with pytest.raises(PageReadError, match=r"table 'd': page 3 .*-704 OBJECT_NOT_FOUND") as e:
            t.lookup(ids)
        assert time.monotonic() - t0 < BOUND_S
        assert (e.value.table, e.value.page, e.value.mooncake_code) == ("d", 3, OBJECT_NOT_FOUND)
        assert t.stats()["remote"]["errors"] == 1
    finally:
        t.close()


def test_corrupt_page_is_refused_or_served_from_the_fallback_file(cluster, client, tmp_path):
    path = _table(tmp_path / "e.tgram")
    push_table(path, cluster.master_addr, "e", progress=False, store=client)
    table = TableFile.open(path)
    ps = table.manifest.page_size
    page = bytearray(path.read_bytes()[table.data_offset + 2 * ps: table.data_offset + 3 * ps])
    page[100] ^= 0x10  # one bit flipped in the store's copy
    assert client.remove(page_key("e", 2), True) == 0
    assert client.put(page_key("e", 2), bytes(page)) == 0
    ids = np.zeros((1, 3), dtype=np.int64)
    ids[0, 0] = 2 * table.manifest.rows_per_page
    uri = f"mooncake://{cluster.master_addr}/e"
    t = TieredTable(uri, tier="mooncake")
    try:
        with pytest.raises(PageReadError, match=r"page 2 .*CHECKSUM_MISMATCH"):
            t.lookup(ids)
        r = t.stats()["remote"]
        assert r["checksum_failures"] == 2 and r["retries"] == 1  # re-read once, failed again
    finally:
        t.close()
    host = TieredTable(path, tier="host")
    t = TieredTable(uri, tier="mooncake", remote_options={"fallback": path})
    try:
        assert torch.equal(t.lookup(ids), host.lookup(ids))
        assert t.stats()["remote"]["fallback_pages"] == 1
    finally:
        t.close()
        host.close()


def test_holder_killed_raises_within_bound_never_wrong_rows(tmp_path):
    with LocalCluster(tmp_path / "logs", holders=1, segment_bytes=32 << 20) as c:
        path = _table(tmp_path / "f.tgram")
        push_table(path, c.master_addr, progress=False)
        t = TieredTable(f"mooncake://{c.master_addr}/f", tier="mooncake")
        try:
            ids = _ids((700, 523, 301), 40)
            good = t.lookup(ids)
            c.kill_holder(0)
            t0 = time.monotonic()
            with pytest.raises(PageReadError, match=r"table 'f': page \d+ .*Mooncake error -\d+") as e:
                t.lookup(ids + 1)
            assert time.monotonic() - t0 < BOUND_S
            assert isinstance(e.value.mooncake_code, int) and e.value.mooncake_code < 0
            del good
        finally:
            t.close()


def test_with_two_replicas_a_killed_holder_costs_reads_only_until_the_master_expires_it(tmp_path):
    with LocalCluster(tmp_path / "logs", holders=2, segment_bytes=32 << 20) as c:
        path = _table(tmp_path / "r.tgram")
        push_table(path, c.master_addr, replicas=2, progress=False)
        host = TieredTable(path, tier="host")
        t = TieredTable(f"mooncake://{c.master_addr}/r", tier="mooncake")
        try:
            ids = _ids((700, 523, 301), 40)
            assert torch.equal(t.lookup(ids), host.lookup(ids))
            c.kill_holder(0)
            deadline = time.monotonic() + 30.0  # the master's client TTL is 10 s
            while True:
                try:
                    got = t.lookup(ids)
                    break
                except PageReadError as e:  # the replica on the dead holder was chosen: an error, never wrong rows
                    assert e.mooncake_code in (-800, -704)
                    assert time.monotonic() < deadline, "reads did not move to the surviving replica"
                    time.sleep(1.0)
            assert torch.equal(got, host.lookup(ids))
        finally:
            t.close()
            host.close()


def test_master_killed_then_restarted_raises_within_bound(tmp_path):
    with LocalCluster(tmp_path / "logs", holders=1, segment_bytes=32 << 20) as c:
        path = _table(tmp_path / "g.tgram")
        push_table(path, c.master_addr, progress=False)
        t = TieredTable(f"mooncake://{c.master_addr}/g", tier="mooncake", remote_options={"timeout_s": 8.0})
        try:
            ids = _ids((700, 523, 301), 40)
            t.lookup(ids)
            c.kill_master()
            t0 = time.monotonic()
            with pytest.raises(PageReadError, match=r"table 'g': page \d+") as e:
                t.lookup(ids + 1)
            assert time.monotonic() - t0 < BOUND_S
            assert e.value.mooncake_code in (-900, -901, "TIMEOUT")
            c.start_master()  # a restarted master has lost every key: reads fail, never return stale rows
            t0 = time.monotonic()
            with pytest.raises(PageReadError, match=r"table 'g': page \d+"):
                t.lookup(ids + 2)
            assert time.monotonic() - t0 < BOUND_S
        finally:
            t.close()


def test_cli_push_prints_the_uri_and_refuses_a_second_push(cluster, tmp_path):
    path = _table(tmp_path / "h.tgram")
    cmd = [sys.executable, "-m", "tiergram", "table", "push", str(path), "--master", cluster.master_addr, "--quiet"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.strip().splitlines()[-1] == f"mooncake://{cluster.master_addr}/h"
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert second.returncode != 0 and "already holds table 'h'" in second.stderr
    third = subprocess.run(cmd + ["--replace"], capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr[-2000:]


def test_mooncake_tier_object_reads_pages_directly(cluster, client, tmp_path):
    path = _table(tmp_path / "i.tgram", codec="fp32", rows=(400,), dim=16)  # 63 rows per page
    push_table(path, cluster.master_addr, "i", progress=False, store=client)
    tier = MooncakeTier.open(f"mooncake://{cluster.master_addr}/i", store=client)
    try:
        table = TableFile.open(path)
        pages = np.array([1, 0], dtype=np.int64)
        got = tier.read_pages(pages)
        raw = path.read_bytes()[table.data_offset:]
        ps = table.manifest.page_size
        assert bytes(got[:ps]) == raw[ps:2 * ps] and bytes(got[ps:]) == raw[:ps]
    finally:
        tier.close()


def test_compat_engramstore_matches_mooncakes_own_on_every_tier(cluster, client, tmp_path):
    from mooncake.store import EngramStore as MooncakeEngramStore
    from mooncake.store import EngramStoreConfig as MooncakeConfig

    from tiergram.compat.mooncake import EngramStore, EngramStoreConfig

    vocab, dim, layer = [97, 61, 130], 24, 7
    rng = np.random.default_rng(3)
    tables = [rng.standard_normal((v, dim)).astype(np.float32) for v in vocab]
    ids = np.stack([rng.integers(0, v, (2, 33)) for v in vocab], axis=-1).astype(np.int64)  # [B, L, H]
    mcfg = MooncakeConfig()
    mcfg.embedding_dim, mcfg.table_vocab_sizes = dim, vocab
    theirs = MooncakeEngramStore(layer, mcfg, client)
    theirs.populate(tables)
    want = theirs.lookup(ids)
    cfg = EngramStoreConfig(dim, vocab)
    ours = [EngramStore(layer, cfg, client, cache_bytes=4096),
            EngramStore(layer, cfg, str(tmp_path), tier="host"),
            EngramStore(layer + 1, cfg, str(tmp_path), tier="file", cache_bytes=8192)]
    try:
        for store in ours:
            assert store.get_num_heads() == 3 and store.get_embedding_dim() == dim
            assert store.get_table_vocab_sizes() == vocab
            store.populate(tables)
            got = store.lookup(ids)
            assert got.dtype == np.float32 and got.shape == want.shape == (2, 33, 3, dim)
            assert np.array_equal(got, want)
            assert np.array_equal(store.lookup(ids.tolist()), want)  # lists are taken, as Mooncake's does
            with pytest.raises(RuntimeError):
                store.populate(tables)  # both refuse a layer that is already stored
            for bad in (np.array([[[97, 0, 0]]]), np.array([[[-1, 0, 0]]]), np.zeros((2, 3), dtype=np.int64)):
                with pytest.raises(RuntimeError):
                    theirs.lookup(bad)
                with pytest.raises(RuntimeError):
                    store.lookup(bad)
            with pytest.raises(RuntimeError):
                store.populate(tables[:2])
        keys = ours[0].get_store_keys()
        assert keys[0] == manifest_key(f"engram-l{layer}") and all(client.is_exist(k) == 1 for k in keys)
        for store in ours:
            assert store.remove_from_store(force=True) == 3
            assert store.remove_from_store(force=True) == 0
            with pytest.raises(RuntimeError):
                store.lookup(ids)
        assert all(client.is_exist(k) == 0 for k in keys)
    finally:
        for store in ours:
            store.close()
        theirs.remove_from_store(force=True)
    assert theirs.remove_from_store(force=True) == 0


def test_engine_serves_a_layer_from_mooncake_with_the_same_tokens(cluster, tmp_path):
    from test_engine import GREEDY, PROMPTS, engine, expected, make_model_dir

    from tiergram.engine.config import Placement

    model_dir = make_model_dir(tmp_path / "model")
    placement = {0: Placement("mooncake", codec="fp32", master=cluster.master_addr, cache_bytes=4096),
                 1: Placement("mooncake", codec="fp32", master=cluster.master_addr)}
    with engine(model_dir, placement, max_num_batched_tokens=16) as eng:
        assert eng.generate(PROMPTS, GREEDY) == expected(model_dir, PROMPTS)
        per_layer = eng.metrics().engram["per_layer"]
        assert all(s["bytes_read"].get("mooncake", 0) > 0 and "file" not in s["bytes_read"] for s in per_layer.values())
        # the engine's mooncake tables wait at the lowest CPU priority (Mooncake's client spins while it waits)
        priorities = [eng.sources[layer].stats()["remote"]["waiter_priority"] for layer in sorted(eng.sources)]
        assert all(p in ("idle", "nice") for p in priorities), priorities
    with engine(model_dir, placement, max_num_batched_tokens=16) as eng:  # the pushed tables are reused
        assert eng.generate(PROMPTS[:1], GREEDY) == expected(model_dir, PROMPTS[:1])


def test_side_by_side_bench_runs_on_a_tiny_table(tmp_path, monkeypatch):
    from tiergram.bench.remote import RemoteLookupConfig, lookup_to_text, run_lookup

    monkeypatch.setenv("TIERGRAM_CACHE", str(tmp_path / "cache"))
    cfg = RemoteLookupConfig(rows=3000, dim=64, batches=(1, 64), dists=("uniform", "zipf"), calls=2,
                             warmup_calls=1, cache_warm_rows=2048)
    res = run_lookup(cfg, tmp_path, progress=False)  # checks every system's rows against EngramStore's first
    assert set(res["per_dist"]) == {"uniform", "zipf"}
    # the cached table was opened fresh for the last stream (zipf) and warmed on it: its hits are that stream's
    assert res["config"]["cache_warm_rows"] == 2048
    assert res["cache_stats"]["tiergram_mooncake_cache10"]["hit_rate"] > 0.2
    for per in res["per_dist"].values():
        assert {"mooncake_engramstore", "tiergram_mooncake", "tiergram_mooncake_cache10", "tiergram_file",
                "file_limit", "tiergram_host", "mooncake_raw"} <= set(per)
        assert all(d["rows_per_s"] > 0 and d["p99_ms"] >= d["p50_ms"] > 0 for b in per.values() for d in b.values())
    assert res["mooncake_engramstore_rows_per_s"] is None  # no 1,024-row batch in this run
    assert "tiergram mooncake vs EngramStore" in lookup_to_text(res)


def test_an_unreachable_master_fails_fast(tmp_path):
    from tiergram.bench.mooncake_cluster import free_port

    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"{addr} is not reachable"):
        TieredTable(f"mooncake://{addr}/x", tier="mooncake")
    assert time.monotonic() - t0 < BOUND_S


def test_any_ids_read_remotely_equal_the_host_tier(cluster, client, tmp_path_factory):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.extra.numpy import arrays

    rows = (211, 97)
    path = _table(tmp_path_factory.mktemp("prop") / "prop.tgram", codec="bf16", rows=rows, dim=40)
    push_table(path, cluster.master_addr, "prop", progress=False, store=client)
    host = TieredTable(path, tier="host")
    remote = TieredTable(f"mooncake://{cluster.master_addr}/prop", tier="mooncake", cache_bytes=2048,
                         remote_options={"store": client})

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(arrays(np.int64, st.tuples(st.integers(1, 40), st.just(2)), elements=st.integers(0, 96)))
    def check(ids):
        assert torch.equal(remote.lookup(ids), host.lookup(ids))

    try:
        check()
        assert remote.stats()["remote"]["errors"] == 0
    finally:
        remote.close()
        host.close()


def test_tables_of_one_master_share_one_client(cluster, client, tmp_path):
    path = _table(tmp_path / "s.tgram")
    uri = push_table(path, cluster.master_addr, "s", progress=False, store=client)
    a = TieredTable(uri, tier="mooncake")
    b = TieredTable(uri, tier="mooncake", cache_bytes=4096)
    try:
        assert a.tier.store is b.tier.store
        ids = _ids((700, 523, 301), 10)
        assert torch.equal(a.lookup(ids), b.lookup(ids))
    finally:
        a.close()
        b.close()


def test_bench_serve_sweeps_the_mooncake_placement_on_a_local_cluster(tmp_path):
    from test_server import make_tiny_model

    from tiergram.bench.serve import SweepConfig, run

    model = make_tiny_model(tmp_path / "model")
    cfg = SweepConfig(str(model), placements=("host", "mooncake"), input_len=24, output_len=6, max_concurrency=1,
                      requests_per_user=2, warmup_per_user=1, rounds=1, source="stdlib")
    res = run(cfg, progress=False)  # starts its own master and holder (this namespace is private)
    by = {p.placement: p for p in res.points}
    assert set(by) == {"host", "mooncake"}
    moon = by["mooncake"]
    assert moon.throughput_tok_s > 0 and moon.exposed_stall_s >= 0 and moon.engram_cache_hit_rate is not None
    assert res.servers["mooncake"]["cache_bytes"] > 0


def test_a_hung_holder_or_master_fails_within_bound(tmp_path):
    """SIGSTOPped processes (alive, silent): a call is abandoned after the tier's timeout_s (TIMEOUT), or, with the
    default timeout_s above the bound of the timeouts connect() sets, fails with Mooncake's own code first. Both raise
    PageReadError in time."""
    with LocalCluster(tmp_path / "logs", holders=1, segment_bytes=32 << 20) as c:
        path = _table(tmp_path / "k.tgram")
        push_table(path, c.master_addr, progress=False)
        uri = f"mooncake://{c.master_addr}/k"
        bounded = TieredTable(uri, tier="mooncake")
        worker = TieredTable(uri, tier="mooncake", remote_options={"timeout_s": 2.0})
        rpp = bounded.manifest.rows_per_page

        def on_page(p: int) -> np.ndarray:  # a lookup whose head-0 row is on page p (the client may cache where
            return np.array([[p * rpp, 0, 0]], dtype=np.int64)  # a key it read lives; a fresh page must ask)

        try:
            good = bounded.lookup(on_page(1))
            assert torch.equal(worker.lookup(on_page(1)), good)
            # the master first: a frozen holder misses its heartbeats and loses its objects
            for which, page, codes in (("master", 2, (-900, -901)), ("holder", 4, (-800, -704))):
                c.freeze(which)
                try:
                    t0 = time.monotonic()
                    with pytest.raises(PageReadError, match=r"TIMEOUT") as e:
                        worker.lookup(on_page(page))
                    assert time.monotonic() - t0 < 2.0 + 1.0 and e.value.mooncake_code == "TIMEOUT"
                    t0 = time.monotonic()
                    with pytest.raises(PageReadError, match=rf"table 'k': page {page + 1} ") as e:
                        bounded.lookup(on_page(page + 1))
                    assert time.monotonic() - t0 < BOUND_S
                    assert e.value.mooncake_code in codes, e.value
                finally:
                    c.freeze(which, resume=True)
        finally:
            bounded.close()
            worker.close()
