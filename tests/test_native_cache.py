"""The native LRU row cache makes the Python reference's decisions, bit for bit.

Hypothesis drives `NativeRowCache` and `RowCache(policy="lru")` with the same operations — probes (with
duplicates), admits (with duplicates and resident keys), unpins of held probes, `missing` — and after every step
checks the same slots, hits, admitted counts, victims (the key -> slot index and the LRU order), pins, counters and
the whole slot array.
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


def rows_of(keys: list[int], salt: int) -> np.ndarray:
    """Distinct encoded bytes per (key, salt): a wrong slot or a stale row shows up as different bytes."""
    k = np.asarray(keys, dtype=np.int64).reshape(-1, 1)
    return ((k * 131 + salt * 7 + np.arange(ROW_BYTES)) % 251).astype(np.uint8)


def assert_same_state(py: RowCache, nat: NativeRowCache) -> None:
    py.check_invariants()
    nat.check_invariants()
    assert list(py.policy._order) == list(nat.index)  # LRU order, least recent first
    assert py.index == nat.index
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
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 9), ops=ops_st)
def test_native_lru_equals_reference(capacity, ops):
    py, nat = RowCache(capacity, ROW_BYTES, "lru"), NativeRowCache(capacity, ROW_BYTES, "lru")
    held: list[tuple[np.ndarray, np.ndarray]] = []
    for step, (op, arg) in enumerate(ops):
        if op == "probe":
            keys = np.array(arg, dtype=np.int64)
            a, b = py.probe(keys), nat.probe(keys)
            assert np.array_equal(a, b)
            hit = a >= 0
            assert np.array_equal(py.rows[a[hit]], nat.rows[b[hit]])  # the rows a lookup would decode
            held.append((a, b))
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
            assert np.array_equal(py.missing(keys), nat.missing(keys))
        assert_same_state(py, nat)
    for a, b in held:
        py.unpin(a)
        nat.unpin(b)
    assert_same_state(py, nat)
    assert not nat.pins.any()


@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 40), stream=st.lists(st.integers(0, 60), min_size=1, max_size=300),
       batch=st.integers(1, 12))
def test_lookup_shaped_streams_match(capacity, stream, batch):
    """What a lookup does: probe the sorted distinct keys, admit the misses, unpin; many lookups in a row."""
    py, nat = RowCache(capacity, ROW_BYTES, "lru"), NativeRowCache(capacity, ROW_BYTES, "lru")
    for i in range(0, len(stream), batch):
        keys = np.unique(np.array(stream[i:i + batch], dtype=np.int64))
        a, b = py.probe(keys), nat.probe(keys)
        assert np.array_equal(a, b)
        miss = keys[a < 0]
        assert py.admit(miss, rows_of(miss.tolist(), 0)) == nat.admit(miss, rows_of(miss.tolist(), 0))
        py.unpin(a)
        nat.unpin(b)
    assert_same_state(py, nat)


def test_refusals():
    with pytest.raises(ValueError, match="at least one row"):
        NativeRowCache(0, ROW_BYTES)
    with pytest.raises(ValueError, match="not 'lfu'"):
        NativeRowCache(4, ROW_BYTES, "lfu")
    c = NativeRowCache(4, ROW_BYTES)
    with pytest.raises(ValueError, match=r"rows must be uint8 \[2, 12\]"):
        c.admit(np.array([1, 2]), np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(IndexError, match="slot 9 at index 0 is outside the cache's 4 slots"):
        c.unpin(np.array([9]))


def test_all_slots_pinned_rejects():
    c = NativeRowCache(3, ROW_BYTES)
    c.admit(np.array([1, 2, 3]), rows_of([1, 2, 3], 0))
    slots = c.probe(np.array([1, 2, 3]))
    assert c.admit(np.array([7, 8]), rows_of([7, 8], 0)) == 0
    assert c.counters.rejected == 2 and c.counters.evicted == 0 and set(c.index) == {1, 2, 3}
    c.unpin(slots)
    assert c.admit(np.array([7]), rows_of([7], 0)) == 1 and 1 not in c.index  # 1 was the least recently used


def test_concurrent_use_keeps_invariants():
    """Threads probing, admitting and unpinning at once (the native calls run without the GIL)."""
    c = NativeRowCache(16, ROW_BYTES)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                keys = np.unique(rng.integers(0, 64, 6))
                slots = c.probe(keys)
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
    assert not c.pins.any()
