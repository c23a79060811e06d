"""The file tier, the row cache and prefetch through the store contract (TieredTable).

- tier="file" (direct / buffered / mmap, with and without a cache, every policy) returns bit-for-bit what
  tier="host" returns, across consecutive lookups and through prefetch tickets waited out of order;
- a lookup's cache hits stay pinned (unevictable) while it runs; cancelled tickets raise CancelledError, leave
  no pins and retire their announced batch;
- injected read faults are retried once and fail loudly the second time; a page corrupted on disk is never
  served; a failed read leaves nothing in the cache;
- the statistics add up.
"""

from __future__ import annotations

import errno
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiergram import _native
from tiergram.bench.common import python_calls
from tiergram.format import TableManifest, create_table, matrix_values
from tiergram.format import reader as reader_module
from tiergram.store import TieredTable
from tiergram.store import table as table_module
from tiergram.tiers.aligned import aligned_empty

MODES = ["direct", "buffered", "mmap"]
POLICIES = [None, "lru", "lfu", "lookahead"]
CASES = [(mode, policy) for mode in MODES for policy in POLICIES]
CODEC_DIMS = {"fp32": (8, 32, 100), "bf16": (8, 64, 130), "int8": (8, 64, 250), "fp8_e4m3": (32, 64, 256)}


def make_table(path: Path, codec: str, head_rows: tuple[int, ...], dim: int, page_size: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    n = sum(head_rows)
    x = rng.standard_normal((n, dim)) * np.exp2(rng.integers(-8, 8, (n, 1)))
    x[0] = 0.0
    create_table(path, TableManifest(codec=codec, dim=dim, head_rows=head_rows, page_size=page_size),
                 matrix_values(x.astype(np.float32)), progress=False)
    return path


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(bits(got), bits(want))


def assert_clean(store: TieredTable) -> None:
    """No pins left, the cache's own invariants hold, and no announced lookahead batch is still live."""
    cache = store.cache
    if cache is None:
        return
    cache.check_invariants()
    assert int(cache.pins.sum()) == 0, "pins left behind"
    assert cache.live_batches() == 0, "an announced batch was never retired"


def open_file_store(path, mode="direct", policy=None, cache_rows=0, row_bytes=0, **kw) -> TieredTable:
    if policy is None:
        store = TieredTable(path, tier="file", file_mode=mode, **kw)
    else:
        store = TieredTable(path, tier="file", file_mode=mode, cache_bytes=cache_rows * row_bytes,
                            cache_policy=policy, **kw)
    assert store.pipeline == ("python" if mode == "mmap" and policy is None else "native")
    return store


# --- the file tier equals the host tier ----------------------------------------------------------------


@st.composite
def table_specs(draw):
    codec = draw(st.sampled_from(sorted(CODEC_DIMS)))
    dim = draw(st.sampled_from(CODEC_DIMS[codec]))
    heads = draw(st.integers(1, 4))
    head_rows = tuple(draw(st.lists(st.integers(1, 300), min_size=heads, max_size=heads)))
    row_bytes = {"fp32": 4 * dim, "bf16": 2 * dim, "int8": dim + 4, "fp8_e4m3": dim + dim // 32}[codec]
    page_size = draw(st.sampled_from([p for p in (512, 1024, 4096) if p >= row_bytes + 8]))
    return codec, head_rows, dim, page_size


def draw_batches(data, head_rows: tuple[int, ...], n: int) -> list[np.ndarray]:
    """n id batches [B, L, H]: some uniform, some from a small hot set (cache hits, duplicates)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    rows = np.asarray(head_rows)
    hot = rng.integers(0, rows, (6, len(rows)))
    out = []
    for _ in range(n):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 9)))
        if rng.random() < 0.5:
            ids = rng.integers(0, rows, (*shape, len(rows)))
        else:
            ids = hot[rng.integers(0, len(hot), shape)]
        out.append(ids.astype(np.int64))
    out.append(np.stack([np.zeros_like(rows), rows - 1]))  # both ends of every head
    return out


@pytest.mark.parametrize(("mode", "policy"), CASES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=table_specs(), data=st.data())
def test_file_tier_bit_equal_to_host(mode, policy, spec, data):
    codec, head_rows, dim, page_size = spec
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="dtype")
    cache_rows = data.draw(st.integers(1, 40), label="cache_rows")
    queue_depth = data.draw(st.sampled_from([1, 3, 128]), label="queue_depth")
    backend = data.draw(st.sampled_from(["auto", "threads"]), label="backend")
    with tempfile.TemporaryDirectory() as d:
        path = make_table(Path(d) / "t.tgram", codec, head_rows, dim, page_size)
        host = TieredTable(path, tier="host", dtype=dtype)
        store = open_file_store(path, mode, policy, cache_rows, host.manifest.row_bytes, dtype=dtype,
                                queue_depth=queue_depth, backend=backend)
        try:
            batches = draw_batches(data, head_rows, 8)
            want = [host.lookup(ids) for ids in batches]
            for _ in range(2):  # cold, then with whatever the cache kept
                for ids, w in zip(batches, want, strict=True):
                    assert_same(store.lookup(ids), w)
            tickets = [store.prefetch(ids) for ids in batches]  # several in flight
            order = data.draw(st.permutations(range(len(batches))), label="wait order")
            for i in order:
                assert_same(tickets[i].wait(timeout=30), want[i])
            # prefetches in flight while the caller looks up other batches
            tickets = [store.prefetch(ids) for ids in batches[::2]]
            for ids, w in zip(batches[1::2], want[1::2], strict=True):
                assert_same(store.lookup(ids), w)
            for t, w in zip(tickets[::-1], want[::2][::-1], strict=True):
                assert_same(t.wait(timeout=30), w)
            assert_clean(store)
        finally:
            store.close()
            host.close()


# --- a shared table for the targeted tests ---------------------------------------------------------------

HEAD_ROWS = (97, 50, 201)
DIM = 64  # fp8: 66-byte rows, 15 per 1 KiB page


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return make_table(tmp_path_factory.mktemp("store_file") / "fp8.tgram", "fp8_e4m3", HEAD_ROWS, DIM, 1024)


@pytest.fixture(scope="module")
def host(table):
    h = TieredTable(table, tier="host")
    yield h
    h.close()


def geometry(store: TieredTable):
    m = store.manifest
    return m.row_bytes, m.rows_per_page, m.page_size, store.table.head_offsets


def page_of(store: TieredTable, head: int, row: int) -> int:
    _, rpp, _, offsets = geometry(store)
    return int((offsets[head] + row) // rpp)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", [None, "lru", "lookahead"])
def test_empty_batches_and_bad_ids(table, host, mode, policy):
    store = open_file_store(table, mode, policy, cache_rows=10, row_bytes=host.manifest.row_bytes)
    try:
        for shape in [(0, 3), (2, 0, 3)]:
            empty = np.zeros(shape, np.int64)
            assert tuple(store.lookup(empty).shape) == (*shape, DIM)
            assert tuple(store.prefetch(empty).wait(30).shape) == (*shape, DIM)
        bad = np.array([[1, 2, 3], [4, 50, 6]])  # head 1 has rows 0..49
        with pytest.raises(IndexError, match="row id 50 out of range for head 1"):
            store.lookup(bad)
        with pytest.raises(IndexError, match="row id 50 out of range for head 1"):
            store.prefetch(bad)  # refused in the caller, before anything is announced or queued
        assert_clean(store)
        assert_same(store.lookup(bad % np.array(HEAD_ROWS)), host.lookup(bad % np.array(HEAD_ROWS)))
        assert_clean(store)
    finally:
        store.close()


# --- pinning ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
def test_hit_rows_stay_pinned_while_the_lookup_runs(table, host, policy):
    """Between a lookup's probe and its copy of the hit rows, another thread's misses must not evict them."""
    rb = host.manifest.row_bytes
    store = open_file_store(table, "direct", policy, cache_rows=6, row_bytes=rb)
    try:
        warm = np.array([[1, 2, 3], [4, 5, 6]])  # 6 distinct rows: fills the cache exactly
        assert_same(store.lookup(warm), host.lookup(warm))
        assert len(store.cache) == 6
        intruder = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])  # 9 rows, all misses
        if policy == "lfu":  # make them frequent enough that LFU's admission would let them in
            keys = np.unique(intruder + store.table.head_offsets)
            for _ in range(10):
                store.cache.unpin(store.cache.probe(keys))  # each probe counts a use
        seen = {}
        # the probe runs inside the native call: hold that call after its probe
        store.cache.native.hold_next_fetch()
        t = threading.Thread(target=lambda: seen.setdefault("warm", store.lookup(warm)))
        t.start()
        assert store.cache.native.wait_held(30)
        assert int(store.cache.pins.sum()) == 6  # every hit is pinned now
        seen["intruder"] = store.lookup(intruder)
        store.cache.native.release_held()
        t.join(30)
        assert not t.is_alive()
        assert_same(seen["warm"], host.lookup(warm))  # its hit rows were not overwritten meanwhile
        assert_same(seen["intruder"], host.lookup(intruder))
        c = store.cache.counters
        assert c.evicted == 0 and c.rejected >= 9  # every resident row was pinned: nothing could enter
        assert_clean(store)
        assert_same(store.lookup(intruder), host.lookup(intruder))  # unpinned: now rows can be replaced
        assert_same(store.lookup(warm), host.lookup(warm))
        assert_clean(store)
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
def test_concurrent_lookups_and_prefetches_on_a_tiny_cache(table, host, policy):
    rb = host.manifest.row_bytes
    store = open_file_store(table, "direct", policy, cache_rows=8, row_bytes=rb, queue_depth=4)
    rows = np.asarray(HEAD_ROWS)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        hot = rng.integers(0, rows, (5, 3))
        try:
            for _ in range(25):
                ids = hot[rng.integers(0, 5, (2, 4))] if rng.random() < 0.6 else rng.integers(0, rows, (2, 4, 3))
                if rng.random() < 0.5:
                    got = store.lookup(ids)
                else:
                    tickets = [store.prefetch(ids), store.prefetch(ids[:, :2])]
                    got = tickets[0].wait(30)
                    assert_same(tickets[1].wait(30), host.lookup(ids[:, :2]))
                assert_same(got, host.lookup(ids))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        assert store.cache.counters.evicted > 0  # the cache was really contended
        assert_clean(store)
    finally:
        store.close()


# --- cancellation ----------------------------------------------------------------------------------------


class _QueueHold:
    """gate/entered over the native fetch queue's test hook: its next job waits, running, until released."""

    def __init__(self, queue) -> None:
        self.queue = queue
        queue.hold_next()

    def set(self) -> None:
        self.queue.release_held()

    def wait(self, timeout: float) -> bool:
        return self.queue.wait_held(timeout)


def gate_first_fetch(store: TieredTable, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the worker's first fetch wait for `gate` (so later tickets queue behind it); `entered` when it waits.

    The native pipeline's prefetches run on its C++ queue (no Python `_fetch`): its hook holds the first job.
    """
    if store.pipeline == "native":
        hold = _QueueHold(store._queue)
        return hold, hold
    gate, entered = threading.Event(), threading.Event()
    real = store._fetch
    first = [True]

    def gated(*args):
        if first[0]:
            first[0] = False
            entered.set()
            assert gate.wait(30)
        return real(*args)

    monkeypatch.setattr(store, "_fetch", gated)
    return gate, entered


@pytest.mark.parametrize(("mode", "policy"), [("direct", None), ("mmap", None), ("direct", "lru"),
                                             ("mmap", "lru"), ("direct", "lookahead")])
def test_cancel_pending_ticket(table, host, mode, policy, monkeypatch):
    store = open_file_store(table, mode, policy, cache_rows=30, row_bytes=host.manifest.row_bytes)
    try:
        gate, entered = gate_first_fetch(store, monkeypatch)
        batches = [np.array([[i, i + 1, i + 2], [i + 3, 7, i]]) for i in (0, 10, 20, 30)]
        tickets = [store.prefetch(batches[0])]
        assert entered.wait(30)
        tickets += [store.prefetch(b) for b in batches[1:]]
        assert not tickets[2].done()
        assert tickets[2].cancel() is True and tickets[2].cancelled and tickets[2].done()
        with pytest.raises(CancelledError):
            tickets[2].wait()
        if policy == "lookahead":
            assert store.cache.live_batches() == 3  # the cancelled one's announcement is retired
        gate.set()
        for i in (3, 1, 0):
            assert_same(tickets[i].wait(30), host.lookup(batches[i]))
        with pytest.raises(CancelledError):
            tickets[2].wait()
        assert_same(store.lookup(batches[2]), host.lookup(batches[2]))
        assert_clean(store)
    finally:
        store.close()


@pytest.mark.parametrize(("mode", "policy"), [("direct", None), ("mmap", None), ("direct", "lru"),
                                             ("mmap", "lru"), ("direct", "lookahead")])
def test_cancel_running_ticket(table, host, mode, policy, monkeypatch):
    """A running fetch with a cache stops at its next phase; without one it completes (cancel() says False)."""
    store = open_file_store(table, mode, policy, cache_rows=30, row_bytes=host.manifest.row_bytes)
    try:
        gate, entered = gate_first_fetch(store, monkeypatch)
        ids = np.array([[1, 2, 3], [40, 41, 42]])
        ticket, later = store.prefetch(ids), None
        assert entered.wait(30)
        later = store.prefetch(ids[::-1])
        threading.Timer(0.1, gate.set).start()
        if policy is None:
            assert ticket.cancel() is False and not ticket.cancelled  # the rows were delivered
            assert_same(ticket.wait(30), host.lookup(ids))
        else:
            assert ticket.cancel() is True and ticket.cancelled
            with pytest.raises(CancelledError):
                ticket.wait(30)
        assert_same(later.wait(30), host.lookup(ids[::-1]))
        if policy is not None:  # the cancelled fetch stopped before reading anything: only `later` read pages
            # (the cache is no witness: `later`, same rows, may already have filled it when cancel() returns)
            fresh = open_file_store(table, mode, policy, cache_rows=30, row_bytes=host.manifest.row_bytes)
            try:
                fresh.lookup(ids[::-1])
                assert store.stats()["pages_read"] == fresh.stats()["pages_read"] > 0
            finally:
                fresh.close()
        assert_clean(store)
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
def test_close_with_tickets_in_flight(table, host, policy, monkeypatch):
    store = open_file_store(table, "direct", policy, cache_rows=30, row_bytes=host.manifest.row_bytes)
    gate, entered = gate_first_fetch(store, monkeypatch)
    first = store.prefetch(np.array([[1, 2, 3]]))
    assert entered.wait(30)
    pending = store.prefetch(np.array([[4, 5, 6]]))
    threading.Timer(0.1, gate.set).start()
    store.close()  # waits for the running fetch, drops the pending one
    assert_same(first.wait(30), host.lookup(np.array([[1, 2, 3]])))
    with pytest.raises(CancelledError):
        pending.wait(30)
    assert int(store.cache.pins.sum()) == 0


def test_close_while_a_native_fetch_is_inside_its_reads(table, host):
    """close() waits for a fetch held inside the native call (hits pinned, reads not yet done), drops the queued one,
    and leaves no pins; the held fetch delivers its rows."""
    store = open_file_store(table, "direct", "lru", cache_rows=30, row_bytes=host.manifest.row_bytes)
    ids, queued_ids = np.array([[1, 2, 3], [40, 41, 42]]), np.array([[4, 5, 6]])
    store.lookup(ids[:1])  # some hits to pin
    store.cache.native.hold_next_fetch()
    running = store.prefetch(ids)
    assert store.cache.native.wait_held(30)
    queued = store.prefetch(queued_ids)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the fetch inside the native call
    assert int(store.cache.pins.sum()) == 3
    store.cache.native.release_held()
    closer.join(30)
    assert not closer.is_alive()
    assert_same(running.wait(30), host.lookup(ids))
    with pytest.raises(CancelledError):
        queued.wait(30)
    assert_clean(store)


# --- read faults and corruption --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "buffered"])
@pytest.mark.parametrize("policy", [None, "lru"])
@pytest.mark.parametrize("kind", ["flip", "eio", "short"])
def test_injected_fault_retried_once_then_raised(table, host, mode, policy, kind):
    store = open_file_store(table, mode, policy, cache_rows=40, row_bytes=host.manifest.row_bytes)
    try:
        cached = np.array([[0, 0, 0]])
        store.lookup(cached)  # some rows already in the cache
        before = set(store.cache.index) if store.cache is not None else set()
        ids = np.array([[5, 6, 150], [60, 7, 199]])
        page = page_of(store, 2, 150)
        reads = store.stats()["pages_read"]

        store.tier.reader.inject_fault(kind, page, 1)  # transient: the retry reads it
        assert_same(store.lookup(ids), host.lookup(ids))
        pages = len({page_of(store, h, r) for h, r in ((0, 5), (1, 6), (2, 150), (0, 60), (1, 7), (2, 199))})
        assert store.stats()["pages_read"] == reads + pages  # a retried page is counted once
        before = set(store.cache.index) if store.cache is not None else set()

        # rows 151 and 152 of head 2 share the faulty page and were never read: misses even with the cache
        assert page_of(store, 2, 151) == page_of(store, 2, 152) == page
        other = np.array([[8, 9, 151], [61, 10, 100]])
        store.tier.reader.inject_fault(kind, page, 2)  # fails the read and its retry
        with pytest.raises(OSError, match=rf"page {page} of {store.tier.table.path}"):
            store.lookup(other)
        if store.cache is not None:
            assert set(store.cache.index) == before  # nothing of the failed read was admitted
        assert_clean(store)

        more = np.array([[11, 12, 152]])
        store.tier.reader.inject_fault(kind, page, 2)
        ticket = store.prefetch(more)
        with pytest.raises(OSError, match=rf"page {page}\b"):
            ticket.wait(30)
        if store.cache is not None:
            assert set(store.cache.index) == before
        assert_clean(store)
        for batch in (other, more):  # the faults are spent: served again
            assert_same(store.lookup(batch), host.lookup(batch))
        assert_clean(store)
    finally:
        store.close()


@pytest.fixture
def corrupt_copy(table, tmp_path):
    """A copy of the table with one byte flipped in the row area of the page holding head 2's row 150."""
    path = tmp_path / "corrupt.tgram"
    shutil.copy(table, path)
    probe = TieredTable(path, tier="file")
    page, rb, (_, rpp, ps, offsets) = page_of(probe, 2, 150), probe.manifest.row_bytes, geometry(probe)
    slot = int((offsets[2] + 150) % rpp)
    at = probe.table.data_offset + page * ps + slot * rb + 3
    probe.close()
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    return path, page


@pytest.mark.parametrize(("mode", "policy"), [c for c in CASES if c[0] != "mmap"])
def test_corrupt_page_on_disk_is_never_served(host, corrupt_copy, mode, policy):
    path, page = corrupt_copy
    store = open_file_store(path, mode, policy, cache_rows=40, row_bytes=host.manifest.row_bytes)
    try:
        good = np.array([[0, 1, 2], [90, 49, 200]])
        assert_same(store.lookup(good), host.lookup(good))
        before = set(store.cache.index) if store.cache is not None else set()
        bad = np.array([[3, 4, 149], [5, 6, 150]])  # row 150 of head 2 is on the corrupt page
        out = torch.full((2, 3, DIM), 7.0)
        for _ in range(2):  # every time, not just once
            with pytest.raises(OSError, match=rf"cannot read page {page} of {path}.*checksum mismatch"):
                store.lookup(bad, out=out)
            with pytest.raises(OSError, match=rf"page {page}\b"):
                store.prefetch(bad).wait(30)
        if store.cache is not None:
            assert set(store.cache.index) == before  # no row of the failed reads entered the cache
        assert_clean(store)
        assert_same(store.lookup(good), host.lookup(good))  # other pages are still served
        assert_clean(store)
    finally:
        store.close()


# --- preload: the whole file in order, or page by page --------------------------------------------------


def preload_ids(rows_per_head: int, seed: int = 3) -> np.ndarray:
    """[n, H] distinct per-head ids in a random order (coldest first, as a hot-rows file lists them)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(r)[:rows_per_head] for r in HEAD_ROWS], axis=1)


@pytest.mark.parametrize("chunk_pages", [None, 3])  # the whole test table in one read, or in 3-page reads
@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
def test_preload_scan_equals_page_by_page(host, table, monkeypatch, policy, chunk_pages):
    """Reading the whole table in order fills the cache with the rows, the recency and the counters page-by-page
    warm-ups give, and a lookup of them then reads nothing."""
    monkeypatch.setattr(reader_module, "_CHUNK_PAGES", chunk_pages)
    ids = preload_ids(40)
    rb = host.manifest.row_bytes
    seen = []
    for share, scanned in ((0.0, True), (2.0, False)):  # 0: always read the whole file, 2: never
        monkeypatch.setattr(table_module, "PRELOAD_SCAN_SHARE", share)
        store = open_file_store(table, "direct", policy, cache_rows=120, row_bytes=rb)
        try:
            with pytest.raises(ValueError, match="preload of 123 distinct rows into a cache of 120 rows"):
                store.preload(np.concatenate([ids, [[90, 45, 190]]]))
            assert store.preload(ids) == 120
            snap = store.stats()
            assert (snap["pages_read"] == store.manifest.n_pages) is scanned
            if scanned:  # the scan read every page: it counts as read, so later reads of them are re-reads
                assert snap["pages_first_read"] == store.manifest.n_pages
            cache, index = store.cache, store.cache.index
            rows = {k: cache.rows[slot].tobytes() for k, slot in index.items()}
            keys = (ids + store.table.head_offsets).reshape(-1)
            if policy == "lru":  # least recently used first: the ids' order
                assert list(index) == keys.tolist()
            seen.append((rows, dict(vars(cache.counters))))
            resident = np.array([[k in index for k in row] for row in keys.reshape(ids.shape)])
            kept = ids[resident.all(axis=1)]
            before = store.stats()["pages_read"]
            assert_same(store.lookup(kept), host.lookup(kept))
            assert store.stats()["pages_read"] == before  # every preloaded row is a hit
            assert_clean(store)
        finally:
            store.close()
    (rows_a, counters_a), (rows_b, counters_b) = seen
    assert rows_a == rows_b
    assert counters_a["probes"] == counters_b["probes"] == 0  # a preload is not a lookup


def test_preload_scan_rereads_a_corrupt_page_and_names_it(corrupt_copy, monkeypatch, host):
    """A page failing its checksum in the scan is read again by the tier's reader: it fails loudly, naming the file
    and page, when a preloaded row is on it, and costs nothing when none is."""
    path, page = corrupt_copy
    monkeypatch.setattr(table_module, "PRELOAD_SCAN_SHARE", 0.0)
    monkeypatch.setattr(reader_module, "_CHUNK_PAGES", 4)  # the bad page inside one of several reads
    rb = host.manifest.row_bytes
    with open_file_store(path, "direct", "lru", cache_rows=200, row_bytes=rb) as store:
        on_page = np.array([[0, 0, 150]])
        with pytest.raises(OSError, match=rf"cannot read page {page} of {path}.*checksum mismatch"):
            store.preload(on_page)
        assert 150 + int(store.table.head_offsets[2]) not in store.cache.index
        elsewhere = np.array([[1, 2, 3], [4, 5, 6]])
        assert store.preload(elsewhere) == 6
        assert_same(store.lookup(elsewhere), host.lookup(elsewhere))
        with pytest.raises(IndexError, match="head 1"):
            store.preload(np.array([[0, 50, 0]]))  # head 1 has 50 rows


# --- statistics ------------------------------------------------------------------------------------------


def expected_counts(store: TieredTable, batches: list[np.ndarray]):
    """Per call: distinct global rows; summed: per-head distinct counts and distinct pages."""
    _, rpp, _, offsets = geometry(store)
    unique_per_head = np.zeros(len(HEAD_ROWS), np.int64)
    pages = 0
    for ids in batches:
        glob = np.unique(ids.reshape(-1, len(HEAD_ROWS)) + offsets)
        unique_per_head += np.bincount(np.searchsorted(offsets, glob, side="right") - 1, minlength=len(HEAD_ROWS))
        pages += np.unique(glob // rpp).size
    return unique_per_head, pages


def stat_batches(seed: int, n: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = np.asarray(HEAD_ROWS)
    return [rng.integers(0, np.minimum(rows, 40), (int(rng.integers(1, 5)), 6, 3)) for _ in range(n)]


def test_stats_without_cache(table):
    store = TieredTable(table, tier="file")
    try:
        batches = stat_batches(1)
        for ids in batches:
            store.lookup(ids)
        s = store.stats()
        rb, rpp, ps, _ = geometry(store)
        unique_per_head, pages = expected_counts(store, batches)
        positions = sum(ids.size // 3 for ids in batches)
        assert s["lookups"] == len(batches) and s["ids"] == 3 * positions
        assert s["per_head"]["ids"] == [positions] * 3
        assert s["per_head"]["unique"] == unique_per_head.tolist() == s["per_head"]["misses"]
        assert s["hits"] == 0 and s["misses"] == s["unique_ids"] == int(unique_per_head.sum())
        assert s["pages_read"] == pages == int(store.tier.native_counts[1])
        assert s["bytes_read"] == {"file": pages * ps}
        amp = s["read_amplification"]
        assert amp == pytest.approx(pages * ps / (s["misses"] * rb))
        assert 1 <= amp <= ps / rb and amp < ps / rb  # several rows shared a page
        assert s["tier"] == "file" and s["backend"] in ("io_uring", "threads")
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
def test_stats_with_cache(table, policy):
    store = open_file_store(table, "direct", policy, cache_rows=50, row_bytes=66)
    try:
        batches = stat_batches(2)
        for i, ids in enumerate(batches):
            (store.lookup(ids) if i % 2 else store.prefetch(ids).wait(30))
        s = store.stats()
        rb, rpp, ps, _ = geometry(store)
        unique_per_head, _ = expected_counts(store, batches)
        h = s["per_head"]
        assert h["unique"] == unique_per_head.tolist()
        assert [a + b for a, b in zip(h["hits"], h["misses"], strict=True)] == h["unique"]
        assert s["hits"] + s["misses"] == s["unique_ids"] == int(unique_per_head.sum()) and s["hits"] > 0
        assert sum(h["hits"]) == s["hits"] and sum(h["misses"]) == s["misses"]
        c = s["cache"]
        assert c["probes"] == s["unique_ids"] and c["hits"] == s["hits"] and c["policy"] == policy
        assert c["capacity_rows"] == 50 and c["rows"] == len(store.cache) <= 50
        assert s["hit_rate"] == pytest.approx(s["hits"] / s["unique_ids"])
        assert s["bytes_read"]["cache"] == s["hits"] * rb
        assert s["bytes_read"]["file"] == s["pages_read"] * ps and 0 < s["pages_read"] <= s["misses"]
        assert s["pages_read"] == int(store.tier.native_counts[1])
        assert 1 <= s["read_amplification"] <= ps / rb
        assert_clean(store)
    finally:
        store.close()


def test_stats_mmap(table):
    store = TieredTable(table, tier="file", file_mode="mmap")
    try:
        batches = stat_batches(3, 4)
        for ids in batches:
            store.lookup(ids)
        s = store.stats()
        unique_per_head, _ = expected_counts(store, batches)
        assert s["misses"] == s["unique_ids"] == int(unique_per_head.sum())
        assert s["pages_read"] == 0 and s["read_amplification"] is None and s["backend"] == "mmap"
    finally:
        store.close()


def test_stats_exact_under_concurrent_lookups_and_prefetches(table, host):
    """Each call accounts for its own reads: concurrent calls must not count each other's pages."""
    store = TieredTable(table, tier="file", queue_depth=2)
    batches = stat_batches(4, 30)
    errors: list[BaseException] = []

    def worker(part: list[np.ndarray]) -> None:
        try:
            for ids in part:
                assert_same(store.lookup(ids), host.lookup(ids))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(batches[i::3],)) for i in range(2)]
        for t in threads:
            t.start()
        tickets = [(store.prefetch(ids), ids) for ids in batches[2::3]]
        for t, ids in tickets:
            assert_same(t.wait(30), host.lookup(ids))
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        s = store.stats()
        _, pages = expected_counts(store, batches)
        assert s["lookups"] == len(batches)
        assert s["pages_read"] == pages == int(store.tier.native_counts[1])
        assert s["bytes_read"]["file"] == pages * store.manifest.page_size
    finally:
        store.close()


def test_staging_buffer_is_per_thread(table, host):
    """Two threads reading at once each decode from their own staging buffer."""
    store = TieredTable(table, tier="file")
    barrier = threading.Barrier(2)
    results: dict[int, list[bool]] = {0: [], 1: []}

    def worker(k: int) -> None:
        rng = random.Random(k)
        for _ in range(20):
            ids = np.array([[rng.randrange(r) for r in HEAD_ROWS] for _ in range(8)])
            barrier.wait(10)
            results[k].append(torch.equal(bits(store.lookup(ids)), bits(host.lookup(ids))))

    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results[0] == [True] * 20 and results[1] == [True] * 20
    finally:
        store.close()



@pytest.mark.parametrize("policy", [None, "lru"])
def test_reads_go_into_registered_staging_buffers(table, host, policy):
    """The native pipeline's page reads are READ_FIXED into each thread's registered staging buffer, and the
    rows stay bit-equal to host while that buffer grows (a new allocation is registered anew, never the old)."""
    store = open_file_store(table, "direct", policy, cache_rows=30, row_bytes=host.manifest.row_bytes)
    try:
        if store.stats()["backend"] != "io_uring":
            pytest.skip("io_uring unavailable here")
        rng = np.random.default_rng(3)

        def worker(seed: int, out: list[bool]) -> None:
            r = np.random.default_rng(seed)
            for positions in (1, 2, 8, 32, 64, 1, 128, 3):  # growing batches reallocate the staging buffer
                ids = np.stack([r.integers(0, n, positions) for n in HEAD_ROWS], axis=1)
                out.append(torch.equal(bits(store.lookup(ids)), bits(host.lookup(ids))))
                out.append(torch.equal(bits(store.prefetch(ids).wait(30)), bits(host.lookup(ids))))

        results: list[list[bool]] = [[], []]
        threads = [threading.Thread(target=worker, args=(int(rng.integers(1 << 30)), results[k])) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results[0] == [True] * 16 and results[1] == [True] * 16
        s = store.stats()
        if s["buffer_registration_errno"] == 0:
            assert 0 < s["registered_buffer_reads"] <= s["pages_read"]
        else:  # refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK): plain reads, said in stats
            assert s["buffer_registration_errno"] in (errno.ENOMEM, errno.EPERM, errno.EFAULT)
    finally:
        store.close()


@pytest.fixture
def tiny_staging():
    """Threads keep 4 KiB of staging (4 of the test table's 1 KiB pages): larger reads go in chunks."""
    old = _native.set_staging_keep_bytes(4096)
    yield
    _native.set_staging_keep_bytes(old)


@pytest.mark.parametrize("policy", [None, "lru", "lookahead"])
def test_reads_larger_than_the_staging_buffer_go_in_chunks(table, host, policy, tiny_staging):
    """Lookups, prefetches and read-aheads of many more pages than a thread's staging buffer holds return the
    host tier's rows, and the cache ends in the same state (same hits, misses, pages) as with one read per call."""
    rng = np.random.default_rng(11)
    steps = [np.stack([rng.integers(0, n, positions) for n in HEAD_ROWS], axis=1)
             for positions in (1, 3, 40, 7, 90, 40, 2, 120)]
    stats = []
    for keep in (4096, 16 << 20):
        _native.set_staging_keep_bytes(keep)
        store = open_file_store(table, "direct", policy, cache_rows=60, row_bytes=host.manifest.row_bytes)
        try:
            for k, ids in enumerate(steps):
                if policy and k % 3 == 2:
                    store.warm(steps[(k + 1) % len(steps)])
                    store.drain_warm(30)
                got = store.prefetch(ids).wait(30) if k % 2 else store.lookup(ids)
                assert torch.equal(bits(got), bits(host.lookup(ids))), (keep, k)
            s = store.stats()
            stats.append({k: s[k] for k in ("hits", "misses", "pages_read", "per_head")})
        finally:
            store.close()
    assert stats[0] == stats[1]
    assert stats[0]["pages_read"] > 4 * 2  # several calls read more pages than one chunk


def test_the_reader_counts_the_pages_it_reads_for_the_first_time(table):
    """Re-reads are not first reads (a cache under the disk may hold them); the table's stats carry the count."""
    store = TieredTable(table, tier="file")
    try:
        reader = store.tier.reader
        out = aligned_empty(4 * store.manifest.page_size)
        reader.read_pages(np.array([0, 1, 1, 2], dtype=np.int64), out)
        assert reader.first_reads == 3
        reader.read_pages(np.array([2, 3, 0, 4], dtype=np.int64), out)
        assert reader.first_reads == 5
        pages = store.manifest.n_pages
        store.lookup(np.zeros((1, store.num_heads), dtype=np.int64))  # row 0 of each head: pages read again or new
        s = store.stats()
        assert 5 <= s["pages_first_read"] <= min(pages, 5 + s["pages_read"])
        before = reader.first_reads
        reader.mark_read(3, 0)  # nothing
        assert reader.first_reads == before
        reader.mark_read(0, pages)  # another path (a whole-table scan) read them all
        assert reader.first_reads == pages
        reader.mark_read(1, pages - 1)  # all read already: nothing new
        assert reader.first_reads == pages
        reader.read_pages(np.array([pages - 1], dtype=np.int64), out[: store.manifest.page_size])
        assert reader.first_reads == pages
        with pytest.raises(IndexError, match="out of range"):
            reader.mark_read(1, pages)
        with pytest.raises(IndexError, match="out of range"):
            reader.mark_read(-1, 2)
    finally:
        store.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=8))
def test_mark_read_counts_each_page_once_across_bitmap_words(tmp_path_factory, ranges):
    """mark_read sets the bitmap a 64-page word at a time: the count is the pages of the ranges' union, as a set
    of page numbers gives it (ranges clipped to the table's 300 pages, across word boundaries)."""
    path = tmp_path_factory.mktemp("marks") / "pages.bin"
    path.write_bytes(b"\0" * 4096)  # mark_read reads nothing: the file only has to open
    reader = _native.PageReader(str(path), 0, 4096, 300, direct=False)
    try:
        seen: set[int] = set()
        for first, count in ranges:
            count = min(count, 300 - first)
            reader.mark_read(first, count)
            seen.update(range(first, first + count))
            assert reader.first_reads == len(seen)
    finally:
        reader.close()


def test_read_pages_into_a_callers_buffer_never_registers_it(table):
    """A caller's buffer may be freed and its address reused: read_pages must read into it plainly."""
    store = TieredTable(table, tier="file")
    try:
        reader = store.tier.reader
        out = aligned_empty(2 * store.manifest.page_size)
        reader.read_pages(np.array([0, 1], dtype=np.int64), out)
        assert reader.fixed_reads == 0
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
def test_warm_reads_rows_into_the_cache_ahead_of_their_lookup(table, host, policy):
    store = open_file_store(table, "direct", policy, cache_rows=200, row_bytes=66)
    try:
        ids = stat_batches(7, 1)[0]
        n_unique = np.unique(ids + store.table.head_offsets).size
        assert store.warm(ids).wait(30) is None
        s = store.stats()
        assert s["warmed_rows"] == n_unique and s["lookups"] == 0 and store.cache.counters.probes == 0
        assert s["pages_read"] > 0 and s["bytes_read"]["file"] == s["pages_read"] * store.manifest.page_size
        pages = s["pages_read"]
        assert store.warm(ids).wait(30) is None and store.stats()["pages_read"] == pages  # all resident: no reads
        assert_same(store.lookup(ids), host.lookup(ids))
        s = store.stats()
        assert s["hits"] == n_unique and s["misses"] == 0 and s["pages_read"] == pages  # every row from the cache
        with pytest.raises(IndexError, match="head 1"):  # a bad id fails in the caller, as prefetch does
            store.warm(np.array([[0, HEAD_ROWS[1], 0]]))
        assert_clean(store)
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
def test_a_fetch_waits_for_rows_a_read_ahead_has_in_flight(table, host, policy):
    """A prefetch of rows a read-ahead is reading waits for them to land instead of reading their pages again; rows
    the read-ahead does not cover are read by the fetch itself, beside it."""
    store = open_file_store(table, "direct", policy, cache_rows=300, row_bytes=host.manifest.row_bytes)
    try:
        ids = stat_batches(11, 1)[0]
        extra = np.array([[90, 45, 190]])  # rows the read-ahead does not read
        pages_warm = len({page_of(store, h, int(r)) for h in range(3) for r in ids[..., h].ravel()})
        store.cache.native.hold_next_fetch()
        warm = store.warm(ids)
        assert store.cache.native.wait_held(30)  # the read-ahead's keys are in flight, nothing read yet
        ticket = store.prefetch(np.concatenate([ids.reshape(-1, 3), extra]))
        time.sleep(0.2)
        assert not ticket.done()  # it waits for the held read-ahead's rows
        store.cache.native.release_held()
        assert warm.wait(30) is None
        want = host.lookup(np.concatenate([ids.reshape(-1, 3), extra]))
        assert_same(ticket.wait(30), want)
        extra_pages = {page_of(store, h, int(extra[0, h])) for h in range(3)}
        extra_pages -= {page_of(store, h, int(r)) for h in range(3) for r in ids[..., h].ravel()}
        s = store.stats()
        assert s["pages_read"] == pages_warm + len(extra_pages)  # no page read twice
        assert s["lookups"] == 1 and s["hits"] + s["misses"] == np.unique(
            np.concatenate([ids.reshape(-1, 3), extra]) + store.table.head_offsets).size
        assert_clean(store)
    finally:
        store.cache.native.release_held()  # a failed assertion must not leave close() waiting
        store.close()


def test_an_urgent_warm_runs_on_the_prefetch_worker_not_behind_read_aheads(table, host):
    """warm(urgent=True) (the next step's decode rows) does not queue behind a read-ahead on the warm-up worker; it
    runs on the prefetch worker, so a prefetch of the same rows queued after it finds every row read, once."""
    store = open_file_store(table, "direct", "lru", cache_rows=300, row_bytes=host.manifest.row_bytes)
    try:
        hold = _QueueHold(store._warm_queue)
        ahead = store.warm(np.array([[1, 2, 3]]))  # held by the warm-up worker
        assert hold.wait(30)
        ids = np.array([[40, 41, 42], [90, 30, 190]])
        urgent = store.warm(ids, urgent=True)
        ticket = store.prefetch(ids)  # behind the urgent warm, on the same worker
        assert urgent.wait(30) is None  # done while the warm-up worker is still held
        assert not ahead.done()
        assert_same(ticket.wait(30), host.lookup(ids))
        s = store.stats()
        pages = len({page_of(store, h, int(r)) for h in range(3) for r in ids[..., h].ravel()})
        assert s["pages_read"] == pages  # the prefetch read nothing: the urgent warm had read its rows
        assert s["lookups"] == 1 and s["misses"] == 0
    finally:
        hold.set()
        store.close()


@pytest.mark.parametrize("policy", [None, "lru"])
def test_a_stalled_page_read_is_recovered(table, host, policy):
    """A page read the kernel never completes (io_uring, the 'stall' fault) is cancelled after the reader's stall
    timeout and read with pread: lookups and prefetches still serve the right rows, and stats() counts it."""
    store = open_file_store(table, "direct", policy, cache_rows=40, row_bytes=host.manifest.row_bytes)
    try:
        if store.tier.backend != "io_uring":
            pytest.skip("io_uring unavailable here")
        store.tier.reader.stall_timeout_s = 0.3
        ids = np.array([[5, 6, 150], [60, 7, 199]])
        store.tier.reader.inject_fault("stall", page_of(store, 2, 150), 1)
        assert_same(store.lookup(ids), host.lookup(ids))
        assert store.stats()["pages_stalled"] == 1
        more = np.array([[11, 12, 152], [61, 10, 100]])
        store.tier.reader.inject_fault("stall", page_of(store, 0, 61), 1)
        assert_same(store.prefetch(more).wait(30), host.lookup(more))
        assert store.stats()["pages_stalled"] == 2
        assert_clean(store)
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["eio", "flip"])
def test_a_fetch_reads_itself_what_a_failed_read_ahead_did_not_land(table, host, kind):
    """A read-ahead whose read fails lands nothing: the fetch that waited for its rows reads them itself and serves
    them right; the read-ahead's ticket raises the error naming the page."""
    store = open_file_store(table, "direct", "lru", cache_rows=300, row_bytes=host.manifest.row_bytes)
    try:
        ids = np.array([[5, 6, 150], [60, 7, 151]])
        page = page_of(store, 2, 150)
        store.cache.native.hold_next_fetch()
        warm = store.warm(ids)
        assert store.cache.native.wait_held(30)
        store.tier.reader.inject_fault(kind, page, 2)  # fails the read-ahead's read and its retry
        ticket = store.prefetch(ids)
        store.cache.native.release_held()
        with pytest.raises(OSError, match=rf"page {page}\b"):
            warm.wait(30)
        assert_same(ticket.wait(30), host.lookup(ids))  # read again by the fetch: the fault is spent
        assert_clean(store)
    finally:
        store.cache.native.release_held()  # a failed assertion must not leave close() waiting
        store.close()


def test_a_python_page_source_serves_the_native_pipeline(table, host):
    """The native pipeline reading through a Python callable (what the remote tier does): the same rows as the host
    tier, one call per batch of missed pages, and a callable's error or bad answer reaches the caller named."""
    store = open_file_store(table, "direct", "lru", cache_rows=100, row_bytes=host.manifest.row_bytes)
    reader, ps, n_pages = store.tier.reader, store.manifest.page_size, store.manifest.n_pages
    calls: list[np.ndarray] = []
    answer: dict = {}

    def read_pages(pages: np.ndarray) -> np.ndarray:
        calls.append(pages.copy())
        if "raise" in answer:
            raise answer["raise"]
        out = aligned_empty(pages.size * ps)
        reader.read_pages(pages, out)
        return answer.get("bytes", out)

    store._reader = store.tier.reader = _native.CallbackPageSource(read_pages, ps, n_pages)
    try:
        ids = stat_batches(5, 1)[0]
        assert_same(store.lookup(ids), host.lookup(ids))
        assert len(calls) == 1 and calls[0].dtype == np.int64 and np.all(np.diff(calls[0]) > 0)
        assert_same(store.prefetch(ids).wait(30), host.lookup(ids))  # every row cached now: no call
        assert len(calls) == 1
        fresh = np.array([[90, 45, 190]])
        answer["raise"] = OSError(5, "remote page 7 is gone")
        with pytest.raises(OSError, match="remote page 7 is gone"):
            store.prefetch(fresh).wait(30)
        answer.clear()
        answer["bytes"] = np.zeros(10, dtype=np.uint8)
        with pytest.raises(ValueError, match=r"read_pages returned 10 bytes for \d+ pages of 1024 bytes"):
            store.lookup(fresh)
        answer["bytes"] = np.zeros(4 * ps, dtype=np.float32)
        with pytest.raises(ValueError, match="read_pages must return a contiguous uint8 array"):
            store.lookup(fresh)
        answer.clear()
        assert_same(store.lookup(fresh), host.lookup(fresh))  # nothing of the failures was admitted
        store.tier.reader.close()
        with pytest.raises(ValueError, match="the page source is closed"):
            store.lookup(np.array([[91, 46, 191]]))
        assert_clean(store)
    finally:
        store._reader = store.tier.reader = reader
        store.close()


def test_warm_without_a_cache_does_nothing(table):
    store = open_file_store(table, "direct")
    try:
        assert store.warm(stat_batches(7, 1)[0]) is None and store.stats()["pages_read"] == 0
    finally:
        store.close()


# --- closing, the context manager, the host-memory budget, the mode in use ---------------------------------


@pytest.mark.parametrize(("mode", "policy"), [("direct", None), ("mmap", None), ("direct", "lru"),
                                             ("mmap", "lru"), ("direct", "lookahead")])
def test_calls_after_close_raise_and_leak_nothing(table, host, mode, policy):
    with open_file_store(table, mode, policy, cache_rows=30, row_bytes=host.manifest.row_bytes) as store:
        ids = np.array([[1, 2, 3]])
        assert_same(store.lookup(ids), host.lookup(ids))
    for call in (store.lookup, store.prefetch, store.warm):
        with pytest.raises(ValueError, match=r"TieredTable for .*fp8.tgram is closed"):
            call(ids)
    assert_clean(store)  # no announced batch left live, no pins


def test_budget_sizes_the_cache(table, host):
    from tiergram.store.table import INDEX_BYTES_PER_ROW, NATIVE_POLICY_EXTRA_BYTES_PER_ROW, STAGING_RESERVE_BYTES

    rb = host.manifest.row_bytes
    budget = STAGING_RESERVE_BYTES + 1000 * (rb + INDEX_BYTES_PER_ROW["native"])
    with TieredTable(table, tier="file", host_memory_bytes=budget) as store:
        s = store.stats()
        assert s["cache"]["capacity_rows"] == 1000 and s["cache"]["bytes"] == 1000 * rb
        assert s["host_memory_bytes"] == budget and s["pipeline"] == "native"
        ids = np.array([[1, 2, 3], [4, 5, 6]])
        assert_same(store.lookup(ids), host.lookup(ids))
        assert_same(store.lookup(ids), host.lookup(ids))
        assert store.stats()["hits"] == 6
    with TieredTable(table, tier="file", host_memory_bytes=budget, cache_policy="lookahead") as store:
        assert store.stats()["cache"]["capacity_rows"] == (budget - STAGING_RESERVE_BYTES) // (
            rb + INDEX_BYTES_PER_ROW["native"] + NATIVE_POLICY_EXTRA_BYTES_PER_ROW["lookahead"])
    with TieredTable(table, tier="file", host_memory_bytes=budget, cache_bytes=10 * rb) as store:
        assert store.stats()["cache"]["capacity_rows"] == 10  # an explicit cache_bytes wins
    with TieredTable(table, tier="file") as store:
        assert store.cache is None and store.stats()["host_memory_bytes"] is None  # neither: no cache
    with pytest.raises(ValueError, match=rf"host_memory_bytes=1000 leaves no room for a cache: staging takes "
                                         rf"{STAGING_RESERVE_BYTES} bytes"):
        TieredTable(table, tier="file", host_memory_bytes=1000)
    with pytest.raises(ValueError, match=r"needs \d+ bytes of host memory, more than the budget of 1000 bytes"):
        TieredTable(table, tier="host", host_memory_bytes=1000)


@pytest.mark.parametrize("mode", MODES)
def test_stats_report_the_mode_in_use(table, mode):
    with TieredTable(table, tier="file", file_mode=mode) as store:
        s = store.stats()
        direct = store.tier.reader.direct if store.tier.reader is not None else False
        assert s["file_mode"] == store.tier.mode == ("buffered" if mode == "direct" and not direct else mode)


def test_direct_refused_reports_buffered(tmp_path):
    """On a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6) the tier says it reads buffered."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.fail("this test needs /dev/shm (tmpfs)")
    d = Path(tempfile.mkdtemp(dir=shm))
    try:
        path = make_table(d / "t.tgram", "fp8_e4m3", HEAD_ROWS, DIM, 1024)
        with TieredTable(path, tier="file", file_mode="direct") as store:
            assert store.tier.requested_mode == "direct"
            assert store.stats()["file_mode"] == ("direct" if store.tier.reader.direct else "buffered")
    finally:
        shutil.rmtree(d)



@pytest.mark.parametrize("mode", ["direct", "mmap"])
def test_tickets_dropped_unwaited_still_run(table, host, mode):
    """The engine fires read-aheads and forgets them: a dropped ticket's fetch runs to the end (its arrays kept
    alive meanwhile), as a dropped Future's does."""
    import gc

    with open_file_store(table, mode, "lru", cache_rows=200, row_bytes=66) as store:
        ids = stat_batches(5, 1)[0]
        n_unique = np.unique(ids + store.table.head_offsets).size
        store.warm(ids.copy())  # neither the ticket nor the ids array is kept
        gc.collect()
        store.drain_warm(30)
        assert store.stats()["warmed_rows"] == n_unique
        for _ in range(3):
            store.prefetch(ids.copy())
        gc.collect()
        assert_same(store.prefetch(ids).wait(30), host.lookup(ids))  # queued behind the dropped ones
        assert store.stats()["lookups"] == 4
        assert_clean(store)


@pytest.mark.parametrize("policy", [None, "lru"])
def test_python_work_per_call_does_not_grow_with_the_rows(table, policy):
    """The native pipeline's lookup and prefetch make the same Python calls for 1 position as for 256 (the rows
    are handled in one native call; statistics are counted natively): counted, not timed."""
    store = open_file_store(table, "direct", policy, cache_rows=4096, row_bytes=66)
    rng = np.random.default_rng(0)
    try:
        counts = {}
        for positions in (1, 256):
            ids = np.stack([rng.integers(0, r, positions) for r in HEAD_ROWS], axis=-1).astype(np.int64)
            out = torch.empty((positions, len(HEAD_ROWS), DIM))
            store.lookup(ids, out=out)  # first calls (imports, buffers) are not the steady state
            tickets: list = []
            lookup = python_calls(lambda ids=ids, out=out: store.lookup(ids, out=out))
            prefetch = python_calls(lambda ids=ids, tickets=tickets: tickets.append(store.prefetch(ids)))
            tickets[0].wait()
            counts[positions] = (lookup, prefetch)
        assert counts[1] == counts[256], counts
    finally:
        store.close()
