"""A count-min sketch of per-row access counts and observed gate sums, keyed by flat row ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CountMinSketch:
    """depth x width cells of (count, gate sum); a key's estimate is read from its least-collided cell."""

    width: int  # a power of two
    depth: int = 2
    seed: int = 0
    counts: np.ndarray = field(default=None, repr=False)  # uint32 [depth, width]
    sums: np.ndarray = field(default=None, repr=False)  # float32 [depth, width]
    mults: np.ndarray = field(default=None, repr=False)  # odd uint64 [depth]

    def __post_init__(self) -> None:
        if self.width < 2 or self.width & (self.width - 1) or self.depth < 1:
            raise ValueError(f"sketch width must be a power of two >= 2 and depth >= 1, got {self.width}, {self.depth}")
        if self.counts is None:
            self.counts = np.zeros((self.depth, self.width), dtype=np.uint32)
            self.sums = np.zeros((self.depth, self.width), dtype=np.float32)
        if self.mults is None:
            rng = np.random.default_rng(self.seed)
            self.mults = rng.integers(1, 2**63, size=self.depth, dtype=np.uint64) | np.uint64(1)
        self._shift = np.uint64(64 - int(self.width).bit_length() + 1)

    @property
    def nbytes(self) -> int:
        """Memory of the cells."""
        return int(self.counts.nbytes + self.sums.nbytes)

    def cells(self, keys: np.ndarray) -> np.ndarray:
        """Cell index [depth, n] of each key (multiplicative hashing, high bits)."""
        k = np.asarray(keys, dtype=np.int64).reshape(-1).astype(np.uint64)
        k = k ^ (k >> np.uint64(17))
        return ((k[None, :] * self.mults[:, None]) >> self._shift).astype(np.int64)

    def add(self, keys: np.ndarray, gates: np.ndarray) -> None:
        """Record one access of each key with its observed gate."""
        c = self.cells(keys)
        g = np.asarray(gates, dtype=np.float64).reshape(-1)
        for d in range(self.depth):
            self.counts[d] += np.bincount(c[d], minlength=self.width).astype(np.uint32)
            self.sums[d] += np.bincount(c[d], weights=g, minlength=self.width).astype(np.float32)

    def query(self, keys: np.ndarray, own_gates: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(count, gate sum) float64 [n] per key; own_gates removes one access of each key (leave-one-out)."""
        c = self.cells(keys)
        depth_idx = np.arange(self.depth)[:, None]
        counts = self.counts[depth_idx, c].astype(np.float64)
        best = counts.argmin(0)
        col = np.arange(c.shape[1])
        count = counts[best, col]
        total = self.sums[depth_idx, c].astype(np.float64)[best, col]
        if own_gates is not None:
            count = count - 1
            total = total - np.asarray(own_gates, dtype=np.float64).reshape(-1)
        return count, total
