"""Property tests of the row cache and its policies: invariants under random operations, pins, admission, Belady."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiergram.cache.native import NativeRowCache
from tiergram.cache.policies import LFUPolicy, LookaheadPolicy, LRUPolicy, belady_hit_rate
from tiergram.cache.row_cache import RowCache

POLICIES = ["lru", "lfu", "lookahead"]
ROW_BYTES = 4
N_KEYS = 16
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def row_of(key: int) -> np.ndarray:
    """The bytes admitted for a key (distinct for every key in range)."""
    return ((key * 31 + np.arange(ROW_BYTES) * 7 + 1) & 0xFF).astype(np.uint8)


def rows_of(keys) -> np.ndarray:
    return np.stack([row_of(k) for k in keys]) if len(keys) else np.empty((0, ROW_BYTES), np.uint8)


def policy_keys(policy) -> set[int]:
    """The keys a policy believes are resident (white box, per policy type)."""
    if isinstance(policy, LRUPolicy):
        return set(policy._order)
    if isinstance(policy, LFUPolicy):
        return set(policy._resident)
    assert isinstance(policy, LookaheadPolicy)
    parts = [set(policy._idle), set(policy._held), set(policy._planned)]
    assert sum(map(len, parts)) == len(set().union(*parts)), "a key is in two lookahead states"
    return set().union(*parts)


@dataclass
class Harness:
    """A RowCache plus the model the test keeps of it: held pins, announced batches, admit decisions."""

    cache: RowCache
    held: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (keys, slots) of pinned probes
    announced: list[tuple[int, list[int]]] = field(default_factory=list)
    lfu_decisions: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        policy, cache = self.cache.policy, self.cache
        if not hasattr(policy, "victims"):
            self._check_victim_and_admit(policy, cache)
        else:  # LRU's one-pass form
            victims = policy.victims

            def checked_victims(count, pinned):
                vs = victims(count, pinned)
                assert len(vs) <= count and len(set(vs)) == len(vs)
                for v in vs:
                    assert cache.pins[cache.index[v]] == 0, f"victim {v} is pinned"
                unpinned = [k for k in policy._order if not pinned(k)]
                assert vs == unpinned[:count], "not the least recently used unpinned keys"
                return vs

            policy.victims = checked_victims

    def _check_victim_and_admit(self, policy, cache) -> None:
        victim, admit = policy.victim, policy.admit

        def checked_victim(pinned):
            v = victim(pinned)
            if v is not None:
                assert cache.pins[cache.index[v]] == 0, f"victim {v} is pinned"
            return v

        def checked_admit(key, v):
            ok = admit(key, v)
            if isinstance(policy, LFUPolicy) and v is not None:
                assert ok == (policy.freq.get(key, 0) > policy.freq.get(v, 0)), "LFU admission rule broken"
                self.lfu_decisions.append(ok)
            return ok

        policy.victim, policy.admit = checked_victim, checked_admit

    def probe(self, keys: list[int], batch: int | None) -> np.ndarray:
        slots = self.cache.probe(np.array(keys, dtype=np.int64), batch)
        self.held.append((np.array(keys, dtype=np.int64), slots))
        return slots

    def admit(self, keys: list[int]) -> None:
        c = self.cache
        all_pinned = not c._free and bool((c.pins > 0).all())
        before = (dict(c.index), c.counters.rejected, c.counters.evicted)
        said_yes = sum(self.lfu_decisions)
        new = [k for k in keys if k not in c.index]
        entered = c.admit(np.array(keys, dtype=np.int64), rows_of(keys))
        assert entered <= len(keys)
        if all_pinned:  # nothing can be evicted: every new key is rejected, nothing moves
            assert c.index == before[0] and entered == 0
            assert c.counters.rejected == before[1] + len(new) and c.counters.evicted == before[2]
        if isinstance(c.policy, LFUPolicy):  # an eviction exactly when the admission rule said yes
            assert c.counters.evicted - before[2] == sum(self.lfu_decisions) - said_yes

    def check(self) -> None:
        c = self.cache
        c.check_invariants()
        assert len(c) <= c.capacity
        expected = np.zeros(c.capacity, dtype=np.int32)
        for keys, slots in self.held:
            np.add.at(expected, slots[slots >= 0], 1)
            for k, s in zip(keys.tolist(), slots.tolist(), strict=True):
                if s >= 0:  # a pinned hit still maps to its slot, with its own bytes
                    assert c.index.get(k) == s and c.slot_key[s] == k
        assert (c.pins == expected).all()
        for k, s in c.index.items():
            assert (c.rows[s] == row_of(k)).all(), f"slot {s} holds the wrong bytes for key {k}"
        assert policy_keys(c.policy) == set(c.index)


keys_st = st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=6, unique=True)
op_st = st.one_of(
    st.tuples(st.just("lookup"), keys_st, st.booleans()),  # probe (an announced batch if True), admit misses
    st.tuples(st.just("probe"), keys_st, st.booleans()),
    st.tuples(st.just("admit"), keys_st, st.just(False)),
    st.tuples(st.just("unpin"), st.integers(0, 7), st.just(False)),
    st.tuples(st.just("announce"), keys_st, st.just(False)),
    st.tuples(st.just("retire"), st.just([]), st.just(False)),
)


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(capacity=st.integers(1, 6), ops=st.lists(op_st, max_size=40))
def test_random_operations_keep_invariants(policy, capacity, ops):
    h = Harness(RowCache(capacity, ROW_BYTES, policy))
    for op, keys, use_batch in ops:
        if op in ("lookup", "probe"):
            batch = None
            if use_batch and h.announced:
                batch, keys = h.announced.pop(0)
            slots = h.probe(keys, batch)
            if op == "lookup":
                h.admit([k for k, s in zip(keys, slots.tolist(), strict=True) if s < 0])
        elif op == "admit":
            h.admit(keys)
        elif op == "unpin" and h.held:
            keys_, slots = h.held.pop(keys % len(h.held))
            h.cache.unpin(slots)
        elif op == "announce":
            batch = h.cache.announce(np.array(keys))
            if batch is not None:
                h.announced.append((batch, keys))
        elif op == "retire" and h.announced:
            h.cache.retire(h.announced.pop(0)[0])
        h.check()


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(capacity=st.integers(2, 8), n_pinned=st.integers(1, 8), data=st.data())
def test_pinned_keys_survive_a_flood(policy, capacity, n_pinned, data):
    n_pinned = min(n_pinned, capacity - 1)
    cache = RowCache(capacity, ROW_BYTES, policy)
    first = list(range(capacity))
    cache.admit(np.array(first), rows_of(first))
    pinned = data.draw(st.lists(st.sampled_from(first), min_size=n_pinned, max_size=n_pinned, unique=True))
    slots = cache.probe(np.array(pinned))
    assert (slots >= 0).all()
    before = {k: (cache.index[k], cache.rows[cache.index[k]].copy()) for k in pinned}
    for start in range(100, 400, 7):  # many new keys, each announced just before (lookahead), admitted
        flood = list(range(start, start + 7))
        batch = cache.announce(np.array(flood))
        miss = cache.probe(np.array(flood), batch)
        cache.admit(np.array(flood), rows_of(flood))
        cache.unpin(miss)
        for k, (slot, row) in before.items():
            assert cache.index[k] == slot and (cache.rows[slot] == row).all()
        cache.check_invariants()
    cache.unpin(slots)
    assert (cache.pins == 0).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_all_slots_pinned_rejects(policy):
    cache = RowCache(3, ROW_BYTES, policy)
    cache.admit(np.array([1, 2, 3]), rows_of([1, 2, 3]))
    slots = cache.probe(np.array([1, 2, 3]))
    for _ in range(3):  # make the newcomers frequent too, so LFU admission alone would let them in
        cache.probe(np.array([7, 8]))
    assert cache.admit(np.array([7, 8]), rows_of([7, 8])) == 0
    assert cache.counters.rejected == 2 and cache.counters.evicted == 0
    assert set(cache.index) == {1, 2, 3}
    cache.unpin(slots)
    assert cache.admit(np.array([7]), rows_of([7])) == 1  # (LFU: 7 was seen 3 times, its victim once)


def test_lfu_admits_only_more_frequent_keys():
    cache = RowCache(2, ROW_BYTES, "lfu")
    for _ in range(3):
        cache.probe(np.array([1, 2]))
    cache.admit(np.array([1, 2]), rows_of([1, 2]))
    cache.probe(np.array([5]))
    assert cache.admit(np.array([5]), rows_of([5])) == 0  # seen once, residents three times
    for _ in range(3):
        cache.probe(np.array([5]))
    assert cache.admit(np.array([5]), rows_of([5])) == 1  # four > three
    assert 5 in cache.index and len(cache) == 2


# ---------------------------------------------------------------- Belady


def brute_force_optimum(stream: tuple[int, ...], capacity: int) -> int:
    """Most hits any schedule can get: at every miss, try bypass, filling a free slot, or each eviction."""

    @cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(stream):
            return 0
        key = stream[i]
        if key in resident:
            return 1 + best(i + 1, resident)
        options = [best(i + 1, resident)]
        if len(resident) < capacity:
            options.append(best(i + 1, resident | {key}))
        options += [best(i + 1, (resident - {v}) | {key}) for v in resident]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=300, deadline=None)
@given(stream=st.lists(st.integers(0, 5), min_size=1, max_size=12), capacity=st.integers(1, 3))
def test_belady_equals_brute_force(stream, capacity):
    hits = round(belady_hit_rate(np.array(stream), capacity) * len(stream))
    assert hits == brute_force_optimum(tuple(stream), capacity)


def replay_one_key_batches(stream: list[int], capacity: int, policy: str, window: int | None = None) -> int:
    """Hits of a RowCache fed one key per lookup; lookahead is told `window` lookups ahead (None: all)."""
    cache = RowCache(capacity, ROW_BYTES, policy)
    window = len(stream) if window is None else window
    batches: list[int | None] = []
    for t, key in enumerate(stream):
        while policy == "lookahead" and len(batches) <= min(t + window, len(stream) - 1):
            batches.append(cache.announce(np.array([stream[len(batches)]])))
        slots = cache.probe(np.array([key]), batches[t] if batches else None)
        if slots[0] < 0:
            cache.admit(np.array([key]), rows_of([key]))
        cache.unpin(slots)
    return cache.counters.hits


@settings(max_examples=150, deadline=None)
@given(stream=st.lists(st.integers(0, 20), min_size=1, max_size=200), capacity=st.integers(1, 8),
       window=st.integers(0, 6))
def test_belady_bounds_online_policies(stream, capacity, window):
    optimum = round(belady_hit_rate(np.array(stream), capacity) * len(stream))
    for policy in POLICIES:
        assert replay_one_key_batches(stream, capacity, policy, window) <= optimum, policy


@settings(max_examples=200, deadline=None)
@given(stream=st.lists(st.integers(0, 10), min_size=1, max_size=80), capacity=st.integers(1, 5))
def test_lookahead_with_full_future_is_belady(stream, capacity):
    """One key per batch, every batch announced first: exactly Belady's MIN with bypass.

    Lookahead also fills free slots with keys never used again, but such keys are idle, and an idle key is
    evicted before anything else for any newcomer, so it behaves as a free slot: the hit counts agree.
    """
    optimum = round(belady_hit_rate(np.array(stream), capacity) * len(stream))
    assert replay_one_key_batches(stream, capacity, "lookahead") == optimum


def test_lookahead_victim_skips_pinned_idle_keys_once():
    """Regression: victim() rescanned every pinned idle key on every call, quadratic in a large admit."""
    cache = RowCache(300, ROW_BYTES, "lookahead")
    cache.admit(np.arange(300), rows_of(range(300)))  # all idle (no announced use)
    soon = cache.announce(np.arange(300, 350))  # newcomers, probed now, used again before...
    cache.announce(np.arange(300, 350))
    cache.announce(np.arange(100))  # ...keys 0..99, which become planned
    pins = cache.probe(np.arange(100, 300))  # the 200 idle keys are in use: pinned
    calls = 0
    victim = cache.policy.victim

    def counting_victim(pinned):
        def counted(key):
            nonlocal calls
            calls += 1
            return pinned(key)

        return victim(counted)

    cache.policy.victim = counting_victim
    cache.probe(np.arange(300, 350), soon)
    assert cache.admit(np.arange(300, 350), rows_of(range(300, 350))) == 50
    assert calls <= 200 + 2 * 50  # each pinned key looked at once, not once per victim() call
    assert set(cache.index) == set(range(50)) | set(range(100, 350))  # the furthest-needed keys left
    cache.unpin(pins)
    cache.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(capacity=st.integers(1, 6), admitted=st.lists(st.integers(0, N_KEYS - 1), unique=True, max_size=8),
       asked=st.lists(st.integers(0, N_KEYS - 1), max_size=12))
def test_missing_names_exactly_the_absent_keys_and_changes_nothing(policy, capacity, admitted, asked):
    cache = NativeRowCache(capacity, ROW_BYTES, policy)
    cache.admit(np.array(admitted, dtype=np.int64), rows_of(admitted))
    before = (dict(cache.index), vars(cache.counters).copy(), cache.pins.copy())
    got = cache.missing(np.array(asked, dtype=np.int64))
    assert got.tolist() == [k for k in asked if k not in cache.index]
    assert (dict(cache.index), vars(cache.counters), cache.pins.tolist()) == (before[0], before[1],
                                                                                before[2].tolist())
    cache.check_invariants()
