"""The native row cache makes the Python reference's decisions, bit for bit, under every policy.

Hypothesis drives `NativeRowCache` and `RowCache` with the same policy (LRU, LFU, lookahead) through the same
operations — probes (with duplicates, and probes of announced batches), admits (with duplicates and resident keys),
unpins of held probes, `missing`, announcements and retirements — and after every step checks the same slots, hits,
admitted counts, victims (the key -> slot index), the policy's own state (LRU order; LFU counts; lookahead idle,
parked and planned keys with their next uses, live batches), pins, counters and the whole slot array.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.cache import RowCache
from tiergram.cache.native import NativeRowCache

ROW_BYTES = 12
POLICIES = ["lru", "lfu", "lookahead"]
KEYS = np.arange(0, 25, dtype=np.int64)  # every key the operations use


def rows_of(keys: list[int], salt: int) -> np.ndarray:
    """Distinct encoded bytes per (key, salt): a wrong slot or a stale row shows up as different bytes."""
    k = np.asarray(keys, dtype=np.int64).reshape(-1, 1)
    return ((k * 131 + salt * 7 + np.arange(ROW_BYTES)) % 251).astype(np.uint8)


def py_missing(py: RowCache, keys: np.ndarray) -> np.ndarray:
    """The reference of NativeRowCache.missing: the keys not resident, nothing told or counted."""
    return keys[[k not in py.index for k in keys.tolist()]] if keys.size else keys


def py_touch(py: RowCache, keys: np.ndarray) -> int:
    """The reference of NativeRowCache.touch: every key observed, the resident ones used in order, no pins."""
    resident = 0
    for k in keys.tolist():
        py.policy.observe(k)
        if k in py.index:
            py.policy.touch(k)
            resident += 1
    return resident


def assert_same_state(py: RowCache, nat: NativeRowCache) -> None:
    py.check_invariants()
    nat.check_invariants()
    assert py.index == nat.index
    policy = py.policy
    if policy.name == "lru":
        assert list(policy._order) == list(nat.index)  # LRU order, least recent first
    elif policy.name == "lfu":
        assert [policy.freq.get(k, 0) for k in KEYS.tolist()] == nat.native.frequencies(KEYS)
    else:
        idle, held, planned, next_use = nat.native.lookahead_state()
        assert list(policy._idle) == idle and list(policy._held) == held
        assert policy._planned == dict(zip(planned, next_use, strict=True))
        assert py.live_batches() == nat.live_batches()
    assert vars(py.counters) == vars(nat.counters)
    assert np.array_equal(py.pins, nat.pins)
    assert np.array_equal(py.slot_key, nat.slot_key)
    assert np.array_equal(py.rows, nat.rows)
    assert len(py) == len(nat)


keys_st = st.lists(st.integers(0, 24), min_size=0, max_size=10)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("probe"), keys_st),
        st.tuples(st.just("admit"), keys_st),
        st.tuples(st.just("unpin"), st.integers(0, 7)),
        st.tuples(st.just("missing"), keys_st),
        st.tuples(st.just("touch"), keys_st),
        st.tuples(st.just("announce"), keys_st),
        st.tuples(st.just("probe_announced"), st.integers(0, 7)),
        st.tuples(st.just("retire"), st.integers(0, 7)),
    ),
    min_size=1, max_size=60,
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 9), ops=ops_st)
def test_native_equals_reference(policy, capacity, ops):
    py, nat = RowCache(capacity, ROW_BYTES, policy), NativeRowCache(capacity, ROW_BYTES, policy)
    held: list[tuple[np.ndarray, np.ndarray]] = []
    announced: list[tuple[np.ndarray, int | None, int | None]] = []  # keys, reference batch, native batch

    def probe(keys: np.ndarray, batches: tuple[int | None, int | None] = (None, None)) -> None:
        a, b = py.probe(keys, batches[0]), nat.probe(keys, batches[1])
        assert np.array_equal(a, b)
        hit = a >= 0
        assert np.array_equal(py.rows[a[hit]], nat.rows[b[hit]])  # the rows a lookup would decode
        held.append((a, b))

    for step, (op, arg) in enumerate(ops):
        if op == "probe":
            probe(np.array(arg, dtype=np.int64))
        elif op == "admit":
            keys = np.array(arg, dtype=np.int64)
            rows = rows_of(arg, step)
            assert py.admit(keys, rows) == nat.admit(keys, rows)
        elif op == "unpin" and held:
            a, b = held.pop(arg % len(held))
            py.unpin(a)
            nat.unpin(b)
        elif op == "missing":
            keys = np.array(arg, dtype=np.int64)
            assert np.array_equal(py_missing(py, keys), nat.missing(keys))
        elif op == "touch":
            keys = np.array(arg, dtype=np.int64)
            assert py_touch(py, keys) == nat.touch(keys)
        elif op == "announce":
            keys = np.array(arg, dtype=np.int64)
            a, b = py.announce(keys), nat.announce(keys)
            assert a == b  # None for LRU and LFU
            announced.append((keys, a, b))
        elif op == "probe_announced" and announced:  # what a prefetch does: probe its batch, retiring it
            keys, a, b = announced.pop(arg % len(announced))
            probe(keys, (a, b))
        elif op == "retire" and announced:  # a cancelled prefetch
            _, a, b = announced.pop(arg % len(announced))
            py.retire(a)
            nat.retire(b)
        assert_same_state(py, nat)
    for a, b in held:
        py.unpin(a)
        nat.unpin(b)
    assert_same_state(py, nat)
    assert not nat.pins.any()


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 40), stream=st.lists(st.integers(0, 60), min_size=1, max_size=300),
       batch=st.integers(1, 12), window=st.integers(0, 4))
def test_lookup_shaped_streams_match(policy, capacity, stream, batch, window):
    """What the pipeline does: announce each lookup's sorted distinct keys `window` lookups ahead (lookahead), probe
    them (retiring the announcement), admit the misses, unpin; many lookups in a row."""
    py, nat = RowCache(capacity, ROW_BYTES, policy), NativeRowCache(capacity, ROW_BYTES, policy)
    lookups = [np.unique(np.array(stream[i:i + batch], dtype=np.int64)) for i in range(0, len(stream), batch)]
    batches: list[tuple[int | None, int | None]] = []
    for t, keys in enumerate(lookups):
        while len(batches) <= min(t + window, len(lookups) - 1):
            nxt = lookups[len(batches)]
            batches.append((py.announce(nxt), nat.announce(nxt)))
        a, b = py.probe(keys, batches[t][0]), nat.probe(keys, batches[t][1])
        assert np.array_equal(a, b)
        miss = keys[a < 0]
        assert py.admit(miss, rows_of(miss.tolist(), 0)) == nat.admit(miss, rows_of(miss.tolist(), 0))
        py.unpin(a)
        nat.unpin(b)
    assert_same_state(py, nat)
    assert nat.live_batches() == 0


def test_refusals():
    with pytest.raises(ValueError, match="at least one row"):
        NativeRowCache(0, ROW_BYTES)
    with pytest.raises(ValueError, match="not 'mru'"):
        NativeRowCache(4, ROW_BYTES, "mru")
    c = NativeRowCache(4, ROW_BYTES)
    with pytest.raises(ValueError, match=r"rows must be uint8 \[2, 12\]"):
        c.admit(np.array([1, 2]), np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(IndexError, match="slot 9 at index 0 is outside the cache's 4 slots"):
        c.unpin(np.array([9]))
    with pytest.raises(ValueError, match="not lookahead"):
        c.native.lookahead_state()


@pytest.mark.parametrize("policy", POLICIES)
def test_all_slots_pinned_rejects(policy):
    c = NativeRowCache(3, ROW_BYTES, policy)
    c.admit(np.array([1, 2, 3]), rows_of([1, 2, 3], 0))
    slots = c.probe(np.array([1, 2, 3]))
    assert c.admit(np.array([7, 8]), rows_of([7, 8], 0)) == 0
    assert c.counters.rejected == 2 and c.counters.evicted == 0 and set(c.index) == {1, 2, 3}
    c.unpin(slots)
    if policy == "lru":
        assert c.admit(np.array([7]), rows_of([7], 0)) == 1 and 1 not in c.index  # 1 was the least recently used


def test_lookahead_keeps_the_row_needed_soonest():
    """A full cache of announced rows: the one needed furthest ahead is evicted, and a row needed later than every
    resident one does not enter."""
    c = NativeRowCache(2, ROW_BYTES, "lookahead")
    c.admit(np.array([1, 2]), rows_of([1, 2], 0))
    first, second = c.announce(np.array([2])), c.announce(np.array([1, 3]))
    assert c.admit(np.array([3]), rows_of([3], 0)) == 0  # 3 is needed after both 1 and 2
    assert c.counters.rejected == 1
    c.retire(first)  # 2 has no known use now: the first victim
    assert c.admit(np.array([3]), rows_of([3], 0)) == 1 and set(c.index) == {1, 3}
    c.unpin(c.probe(np.array([1, 3]), second))
    assert c.live_batches() == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_concurrent_use_keeps_invariants(policy):
    """Threads announcing, probing, admitting and unpinning at once (the native calls run without the GIL)."""
    c = NativeRowCache(16, ROW_BYTES, policy)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                keys = np.unique(rng.integers(0, 64, 6))
                slots = c.probe(keys, c.announce(keys))
                hit = slots >= 0
                assert (c.rows[slots[hit]] == rows_of(keys[hit].tolist(), 0)).all()  # pinned rows stay put
                miss = keys[~hit]
                c.admit(miss, rows_of(miss.tolist(), 0))
                c.unpin(slots)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    c.check_invariants()
    assert not c.pins.any() and c.live_batches() == 0
