"""NativeRowCache: the row cache in C++ with RowCache's interface and decisions, call for call; its index costs 96
bytes a row (LRU) against RowCache's 256 (docs/placement.md, "Sizing the host cache")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tiergram import _native
from tiergram.cache.row_cache import CacheCounters, SlotCache

NATIVE_POLICIES = ("lru", "lfu", "lookahead")


class NativeRowCache(SlotCache):
    """Up to `capacity` encoded rows of `row_bytes` each under `policy`, thread-safe; the interface of RowCache."""

    def __init__(self, capacity: int, row_bytes: int, policy: str = "lru") -> None:
        if policy not in NATIVE_POLICIES:
            raise ValueError(f"the native row cache has policies {', '.join(NATIVE_POLICIES)}, not {policy!r}")
        super().__init__(capacity, row_bytes)
        self.policy = SimpleNamespace(name=policy)  # what callers read of it (policy.name): it lives in C++
        self.native = _native.RowCache(self.capacity, self.row_bytes, policy)
        # views of the native arrays (they live as long as self.native)
        self.rows: np.ndarray = self.native.rows
        self.pins: np.ndarray = self.native.pins
        self.slot_key: np.ndarray = self.native.slot_key

    def __len__(self) -> int:
        return len(self.native)

    @property
    def counters(self) -> CacheCounters:
        """A snapshot of the running totals."""
        return CacheCounters(*self.native.counters())

    @property
    def index(self) -> dict[int, int]:
        """A snapshot of key -> slot in the policy's order (LRU: least recently used first; for tests)."""
        keys, slots = self.native.order()
        return dict(zip(keys, slots, strict=True))

    def announce(self, keys: np.ndarray) -> int | None:
        """Tell a lookahead policy a batch of keys int64 [n] a later probe asks for; its batch id (else None)."""
        batch = self.native.announce(np.ascontiguousarray(keys, dtype=np.int64).reshape(-1))
        return None if batch < 0 else int(batch)

    def retire(self, batch: int | None) -> None:
        """Forget an announced batch that will not be probed (a cancelled prefetch)."""
        if batch is not None:
            self.native.retire(batch)

    def live_batches(self) -> int:
        """Announced batches not yet probed or retired."""
        return int(self.native.live_batches())

    def probe(self, keys: np.ndarray, batch: int | None = None) -> np.ndarray:
        """int64 slots [n] for keys int64 [n] (-1: miss); hits come back pinned; probing retires `batch`."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        slots = np.empty(keys.size, dtype=np.int64)
        self.native.probe(keys, slots, -1 if batch is None else batch)
        return slots

    def touch(self, keys: np.ndarray) -> int:
        """Mark the resident keys of int64 [n] used, in order (no pins, not counted); how many were resident."""
        return int(self.native.touch(np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)))

    def missing(self, keys: np.ndarray) -> np.ndarray:
        """The keys of int64 [n] not resident now (no pins taken, nothing counted)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        mask = np.empty(keys.size, dtype=np.uint8)
        self.native.missing(keys, mask)
        return keys[mask.view(bool)]

    def admit(self, keys: np.ndarray, rows: np.ndarray) -> int:
        """Offer missed keys [n] with their encoded rows uint8 [n, row_bytes]; returns how many entered."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        if rows.dtype != np.uint8 or rows.shape != (keys.size, self.row_bytes):
            raise ValueError(f"rows must be uint8 [{keys.size}, {self.row_bytes}], got {rows.dtype} {rows.shape}")
        return int(self.native.admit(keys, np.ascontiguousarray(rows)))

    def unpin(self, slots: np.ndarray) -> None:
        """Release the pins a probe took (pass the probe's slots; misses (-1) are ignored)."""
        self.native.unpin(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))

    def check_invariants(self) -> None:
        """Raise if the index, the policy's lists, slot keys or pins disagree (used by tests)."""
        self.native.check_invariants()
