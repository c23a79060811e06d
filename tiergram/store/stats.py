"""Lookup statistics of one table: per head and per tier."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StoreStats:
    """Counters of a TieredTable; `snapshot()` gives a JSON-ready dict with derived rates."""

    n_heads: int
    row_bytes: int
    lookups: int = 0  # lookup calls
    ids: np.ndarray = field(init=False)  # ids requested, per head
    unique: np.ndarray = field(init=False)  # distinct ids per call, summed, per head
    hits: np.ndarray = field(init=False)  # unique ids served from the cache, per head
    misses: np.ndarray = field(init=False)  # unique ids read from the tier below, per head
    bytes_by_tier: Counter[str] = field(default_factory=Counter)
    pages_read: int = 0
    warmed_rows: int = 0  # rows read into the cache ahead of their lookup (TieredTable.warm)
    page_size: int = 0  # bytes per page read (for the native counters' tier bytes)
    tier: str = "file"  # the tier the native pipeline reads pages from (its bytes_read key)
    cached: bool = False  # whether lookups go through a cache (the native counters' cache bytes)
    # the native pipeline's atomic counts: ids, distinct, hits, misses per head [4 * H]; lookups, pages, hit/miss rows
    native: np.ndarray = field(init=False, repr=False)
    native_warm: np.ndarray = field(init=False, repr=False)  # native read-aheads: rows admitted, pages read
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for name in ("ids", "unique", "hits", "misses"):
            setattr(self, name, np.zeros(self.n_heads, dtype=np.int64))
        self.native = np.zeros(4 * self.n_heads + 4, dtype=np.int64)
        self.native_warm = np.zeros(2, dtype=np.int64)

    def record(self, *, ids: np.ndarray, unique: np.ndarray | None = None, hits: np.ndarray | None = None,
               misses: np.ndarray | None = None, tier_bytes: dict[str, int] | None = None, pages: int = 0) -> None:
        """Add one lookup: per-head int64 [H] counts, bytes per tier, pages read."""
        with self._lock:
            self.lookups += 1
            self.ids += ids
            for name, value in (("unique", unique), ("hits", hits), ("misses", misses)):
                if value is not None:
                    getattr(self, name).__iadd__(value)
            self.bytes_by_tier.update({tier: int(n) for tier, n in (tier_bytes or {}).items()})
            self.pages_read += pages

    def record_warm(self, rows: int, tier_bytes: dict[str, int], pages: int) -> None:
        """Add one read-ahead: rows admitted to the cache, bytes per tier and pages it read."""
        with self._lock:
            self.warmed_rows += rows
            self.bytes_by_tier.update({tier: int(n) for tier, n in tier_bytes.items()})
            self.pages_read += pages

    def snapshot(self) -> dict:
        """Totals, per-head lists and derived ratios (hit rate, read amplification)."""
        with self._lock:
            nat, h = self.native.copy(), self.n_heads  # a copy: native calls may add to it meanwhile
            per_head = {name: getattr(self, name) + nat[i * h:(i + 1) * h]
                        for i, name in enumerate(("ids", "unique", "hits", "misses"))}
            lookups, pages, hit_rows, _ = (int(v) for v in nat[4 * h:])
            warmed, warm_pages = (int(v) for v in self.native_warm)
            pages += warm_pages
            by_tier = dict(self.bytes_by_tier)
            if lookups or warm_pages:
                by_tier[self.tier] = by_tier.get(self.tier, 0) + pages * self.page_size
                if self.cached and lookups:
                    by_tier["cache"] = by_tier.get("cache", 0) + hit_rows * self.row_bytes
            hits, misses = int(per_head["hits"].sum()), int(per_head["misses"].sum())
            file_bytes = by_tier.get(self.tier, 0)
            return {
                "lookups": self.lookups + lookups,
                "ids": int(per_head["ids"].sum()),
                "unique_ids": int(per_head["unique"].sum()),
                "hits": hits,
                "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                "pages_read": self.pages_read + pages,
                "warmed_rows": self.warmed_rows + warmed,
                "bytes_read": by_tier,
                # None without page reads to count (mmap: the kernel's page faults are not seen)
                "read_amplification": file_bytes / (misses * self.row_bytes) if misses and file_bytes else None,
                "per_head": {name: v.tolist() for name, v in per_head.items()},
            }


def per_head_counts(global_rows: np.ndarray, head_offsets: np.ndarray) -> np.ndarray:
    """int64 [H]: how many of the global rows [n] fall in each head."""
    heads = np.searchsorted(head_offsets, global_rows, side="right") - 1
    return np.bincount(heads, minlength=head_offsets.size).astype(np.int64)
