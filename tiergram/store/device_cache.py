"""DeviceRowCache: a hot-row cache whose encoded rows live in accelerator memory, filled by the gather kernel."""

from __future__ import annotations

import numpy as np
import torch

from tiergram.cache import RowCache
from tiergram.kernels import ids_to_device
from tiergram.tiers.device import resolve_device


class _DeviceRows:
    """Stands in for RowCache.rows: the encoded rows live on the device and the gather kernel writes them."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self.shape = tuple(slots.shape)
        self.nbytes = int(slots.numel())

    def __setitem__(self, key, value) -> None:
        """RowCache.admit's host-side row copy: nothing to do, the kernel fills the slot."""

    def __getitem__(self, key):
        raise TypeError("a device cache's rows live on the device: read DeviceRowCache.slots")


class DeviceRowCache(RowCache):
    """Slots uint8 [S, row_bytes] and tags int64 [S] (-1 empty) on the device; index and policy on the host."""

    def __init__(self, capacity: int, row_bytes: int, device: torch.device | str, policy: str = "lru") -> None:
        super().__init__(capacity, row_bytes, policy)
        self.device = resolve_device(device)
        self.slots = torch.zeros((self.capacity, self.row_bytes), dtype=torch.uint8, device=self.device)
        self.tags = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.rows = _DeviceRows(self.slots)  # replaces the host slot array RowCache allocated (never touched)

    def plan(self, keys: np.ndarray, batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(slots, fill) int64 [n] of unique keys [n]: pinned hit slots, and the slot each miss must fill (-1: none)."""
        slots = self.probe(keys, batch)
        fill = np.full(slots.size, -1, dtype=np.int64)
        miss = np.flatnonzero(slots < 0)
        if miss.size:
            mk = np.asarray(keys, dtype=np.int64).reshape(-1)[miss]
            self.admit(mk, np.broadcast_to(np.zeros(self.row_bytes, np.uint8), (mk.size, self.row_bytes)))
            with self._lock:  # a key admitted and then evicted within the same admit call gets no slot
                fill[miss] = [self.index.get(k, -1) for k in mk.tolist()]
        return slots, fill

    def set_tags(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Record on the device which key each filled slot holds (call on the stream of the filling launch)."""
        if slots.size:  # through pinned memory: a non_blocking copy from pageable memory may wait for the stream
            self.tags.index_copy_(0, ids_to_device(slots, self.device), ids_to_device(keys, self.device))
