"""The host K/V tier: evicted prefix blocks copied to host memory and back on a hit (docs/engine.md)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import torch


@dataclass
class HostKVStats:
    """Host K/V tier counters since start."""

    bytes_to_host: int = 0
    bytes_to_device: int = 0
    wait_s: float = 0.0  # time steps waited for their copies before the forward (the exposed part)


class HostKV:
    """num_slots host blocks, each holding one device block of every paged cache (K, V, the Engram conv state)."""

    def __init__(self, num_slots: int, caches: list[torch.Tensor], block_size: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.device_caches = caches  # each [layers, num_blocks * block_size, ...]
        pin = any(c.is_cuda for c in caches) and torch.cuda.is_available()
        self.host_caches = [torch.empty((num_slots, c.shape[0], block_size, *c.shape[2:]), dtype=c.dtype,
                                        pin_memory=pin) for c in caches]
        self.slot_bytes = self.slot_bytes_for(caches, block_size)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # name -> slot, least recently used first
        self._name_of: list[bytes | None] = [None] * num_slots
        self._pinned: dict[int, int] = {}  # slot -> copies still to read it
        self._free = list(range(num_slots - 1, -1, -1))
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tiergram-kv-host")
        self._stream = torch.cuda.Stream() if pin else None
        self._lock = threading.Lock()  # stats are read by /metrics from other threads
        self.stats = HostKVStats()

    @staticmethod
    def slot_bytes_for(caches: list[torch.Tensor], block_size: int) -> int:
        """Host bytes one slot takes for these device caches."""
        return sum(block_size * c[:, 0].numel() * c.element_size() for c in caches)

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def has(self, name: bytes) -> bool:
        return name in self._slot_of

    def touch(self, name: bytes) -> None:
        """Mark `name` most recently used."""
        self._slot_of.move_to_end(name)

    def get(self, name: bytes) -> int:
        """The slot holding `name`, marked most recently used and pinned until the step takes its copies."""
        self._slot_of.move_to_end(name)
        slot = self._slot_of[name]
        self._pinned[slot] = self._pinned.get(slot, 0) + 1
        return slot

    def put(self, name: bytes) -> int | None:
        """A slot for the new block `name` (free, else the LRU unpinned one); None if every slot is pinned."""
        assert name not in self._slot_of, "put() is for blocks the host does not hold (see has())"
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((n for n, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self._name_of[slot] = None
        self._slot_of[name] = slot
        self._name_of[slot] = name
        return slot

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            self._pinned[slot] -= 1
            if not self._pinned[slot]:
                del self._pinned[slot]

    def start(self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]) -> Future | None:
        """Run the copies on the worker (device -> host first, then host -> device); None if there are none."""
        if not to_host and not to_device:
            return None
        return self._worker.submit(self._copy, list(to_host), list(to_device))

    def wait(self, pending: Future | None) -> None:
        """Block until the copies are done (the step's forward reads and overwrites those blocks)."""
        if pending is None:
            return
        t0 = time.perf_counter()
        pending.result()
        with self._lock:
            self.stats.wait_s += time.perf_counter() - t0

    def forget(self, slots: list[int]) -> None:
        """Drop the names of these slots (their contents are not what the names say) and free them."""
        for slot in slots:
            name = self._name_of[slot]
            if name is not None and self._slot_of.get(name) == slot:
                del self._slot_of[name]
                self._name_of[slot] = None
                self._free.append(slot)

    def _copy(self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]) -> None:
        bs, non_blocking = self.block_size, self._stream is not None
        try:
            with torch.cuda.stream(self._stream) if non_blocking else nullcontext():
                for block, slot in to_host:
                    for dev, host in zip(self.device_caches, self.host_caches, strict=True):
                        host[slot].copy_(dev[:, block * bs:(block + 1) * bs], non_blocking=non_blocking)
                for slot, block in to_device:
                    for dev, host in zip(self.device_caches, self.host_caches, strict=True):
                        dev[:, block * bs:(block + 1) * bs].copy_(host[slot], non_blocking=non_blocking)
                if non_blocking:
                    self._stream.synchronize()
        except BaseException:
            self.forget([slot for _, slot in to_host])  # half-written slots must not be found by name
            raise
        with self._lock:
            self.stats.bytes_to_host += len(to_host) * self.slot_bytes
            self.stats.bytes_to_device += len(to_device) * self.slot_bytes

    def close(self) -> None:
        self._worker.shutdown(wait=True)
