"""RowCache: encoded rows of one table held in a faster tier — a slot array, a key -> slot index, pins."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from tiergram.cache.policies import make_policy


@dataclass
class CacheCounters:
    """Running totals of one cache."""

    probes: int = 0
    hits: int = 0
    admitted: int = 0
    rejected: int = 0  # misses the policy kept out (admission) or that found every slot pinned
    evicted: int = 0


class SlotCache:
    """What every row cache shares: `capacity` slots of `row_bytes` encoded bytes, sized in rows or in bytes."""

    rows: np.ndarray  # uint8 [capacity, row_bytes]

    def __init__(self, capacity: int, row_bytes: int) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be at least one row, got {capacity}")
        self.capacity = int(capacity)
        self.row_bytes = int(row_bytes)

    @classmethod
    def from_bytes(cls, capacity_bytes: int, row_bytes: int, policy: str = "lru", **kw: Any) -> Self:
        """A cache of as many rows as `capacity_bytes` of row storage holds (at least one)."""
        return cls(max(1, int(capacity_bytes) // int(row_bytes)), row_bytes, policy=policy, **kw)

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)


class RowCache(SlotCache):
    """Up to `capacity` encoded rows, thread-safe, pins kept: the native cache's reference, the HBM cache's index."""

    def __init__(self, capacity: int, row_bytes: int, policy: str = "lru") -> None:
        super().__init__(capacity, row_bytes)
        self.rows = np.zeros((self.capacity, self.row_bytes), dtype=np.uint8)
        self.policy = make_policy(policy)
        self.index: dict[int, int] = {}
        self.slot_key = np.full(self.capacity, -1, dtype=np.int64)
        self.pins = np.zeros(self.capacity, dtype=np.int32)
        self._free = list(range(self.capacity - 1, -1, -1))
        self.counters = CacheCounters()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def announce(self, keys: np.ndarray) -> int | None:
        """Tell a lookahead policy a batch of keys that a later probe will ask for; returns the batch id."""
        extend = getattr(self.policy, "extend_future", None)
        if extend is None:
            return None
        with self._lock:
            return extend(np.asarray(keys).reshape(-1).tolist())

    def live_batches(self) -> int:
        """Announced batches not yet probed or retired (0 for policies without announcements)."""
        with self._lock:
            live = getattr(self.policy, "live_batches", None)
            return live() if live is not None else 0

    def retire(self, batch: int | None) -> None:
        """Forget an announced batch that will not be probed (a cancelled prefetch)."""
        if batch is not None:
            with self._lock:
                self.policy.finish(batch)

    def probe(self, keys: np.ndarray, batch: int | None = None) -> np.ndarray:
        """int64 slots [n] for unique keys [n] (-1: miss); hits come back pinned; probing retires `batch`."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        slots = np.full(keys.size, -1, dtype=np.int64)
        policy, index = self.policy, self.index
        with self._lock:
            for i, key in enumerate(keys.tolist()):
                policy.observe(key)
                slot = index.get(key)
                if slot is not None:
                    policy.touch(key)
                    slots[i] = slot
            if batch is not None:
                policy.finish(batch)
            hit = slots >= 0
            np.add.at(self.pins, slots[hit], 1)
            self.counters.probes += keys.size
            self.counters.hits += int(hit.sum())
        return slots

    def admit(self, keys: np.ndarray, rows: np.ndarray) -> int:
        """Offer missed keys [n] with their encoded rows uint8 [n, row_bytes]; returns how many entered."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if rows.shape != (keys.size, self.row_bytes):
            raise ValueError(f"rows must be uint8 [{keys.size}, {self.row_bytes}], got {rows.dtype} {rows.shape}")
        policy, index = self.policy, self.index
        with self._lock:
            fresh: dict[int, int] = {}  # key -> its position in keys: new keys, first occurrence (another lookup
            for i, key in enumerate(keys.tolist()):  # may have admitted some meanwhile)
                if key not in index:
                    fresh.setdefault(key, i)
            placed: dict[int, int] = {}  # slot -> position of the row it gets (copied at the end, in one go)
            todo = list(fresh.items())
            for key, i in todo[:len(self._free)]:
                slot = self._free.pop()
                index[key], placed[slot] = slot, i
                policy.insert(key)
            rest = todo[len(placed):]
            # pins only change in probe/unpin (under the lock), so one look serves the whole call
            pinned_keys = set(self.slot_key[self.pins > 0].tolist()) if rest else set()
            pinned = pinned_keys.__contains__
            if rest and len(pinned_keys) == self.capacity:  # no victim can exist
                self.counters.rejected += len(rest)
            elif rest and hasattr(policy, "victims"):  # LRU: every victim in one pass, none of this call's keys
                victims = policy.victims(len(rest), pinned)
                self.counters.rejected += len(rest) - len(victims)
                for (key, i), victim in zip(rest, victims, strict=False):
                    self._replace(victim, key, i, placed)
            else:
                for key, i in rest:
                    victim = policy.victim(pinned)
                    if victim is None or not policy.admit(key, victim):
                        self.counters.rejected += 1
                    else:
                        self._replace(victim, key, i, placed)
            if placed:
                slots = np.fromiter(placed, dtype=np.int64, count=len(placed))
                pos = np.fromiter(placed.values(), dtype=np.int64, count=len(placed))
                self.rows[slots] = rows[pos]
                self.slot_key[slots] = keys[pos]
            entered = sum(1 for key in fresh if key in index)
            self.counters.admitted += entered
        return entered

    def _replace(self, victim: int, key: int, i: int, placed: dict[int, int]) -> None:
        """Evict victim and give its slot to key (whose row is at position i); lock held."""
        slot = self.index.pop(victim)
        self.policy.remove(victim)
        self.counters.evicted += 1
        self.index[key], placed[slot] = slot, i
        self.policy.insert(key)

    def unpin(self, slots: np.ndarray) -> None:
        """Release the pins a probe took (pass the probe's slots; misses (-1) are ignored)."""
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            np.subtract.at(self.pins, slots[slots >= 0], 1)

    def check_invariants(self) -> None:
        """Assert the index, slot keys, free list and pins agree (used by tests)."""
        with self._lock:
            assert len(self.index) + len(self._free) == self.capacity
            for key, slot in self.index.items():
                assert self.slot_key[slot] == key
            assert not set(self._free) & set(self.index.values())
            assert (self.pins >= 0).all()
