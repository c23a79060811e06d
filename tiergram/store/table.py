"""TieredTable: the store contract — per-head row ids [B, L, H] in, rows [B, L, H, D] out, prefetchable."""

from __future__ import annotations

import os
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tiergram import _native
from tiergram.cache import RowCache
from tiergram.format import TableFile
from tiergram.format.ids import check_row_ids
from tiergram.store.stats import StoreStats, per_head_counts
from tiergram.store.ticket import Ticket
from tiergram.tiers import FileTier, HostTier

OUT_DTYPES = (torch.float32, torch.bfloat16)
TIERS = ("host", "file", "mooncake")


class TieredTable:
    """One Engram layer's table served from a tier, optionally through a hot-row cache.

    tier 'host': the whole table in DRAM (shared=True: one /dev/shm copy for all processes).
    tier 'file': rows read from the file (file_mode 'direct' O_DIRECT batched reads, 'buffered', or 'mmap'),
    with an optional host cache of `cache_bytes` encoded rows under `cache_policy` (lru, lfu, lookahead).
    tier 'mooncake': path is 'mooncake://HOST:PORT/NAME', a table pushed with `tiergram table push`; pages come
    from Mooncake Store (remote_options go to MooncakeTier.open: timeout_s, fallback, local_hostname), cached as
    for the file tier (docs/remote.md).
    """

    def __init__(self, path: str | os.PathLike, *, tier: str = "host", dtype: torch.dtype = torch.float32,
                 shared: bool = False, cache_bytes: int = 0, cache_policy: str = "lru", file_mode: str = "direct",
                 queue_depth: int = 128, backend: str = "auto", progress: bool = False,
                 remote_options: dict | None = None) -> None:
        if dtype not in OUT_DTYPES:
            raise ValueError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")
        remote = None
        if tier == "mooncake":  # path is mooncake://HOST:PORT/NAME; the manifest lives beside the pages
            from tiergram.tiers.mooncake import MooncakeTier  # optional dependency (the remote extra)

            remote = MooncakeTier.open(str(path), **(remote_options or {}))
            self.table = remote.table
        else:
            self.table = TableFile.open(Path(path))
        self.manifest = m = self.table.manifest
        self.dtype = dtype
        if tier == "host":
            if cache_bytes:
                raise ValueError("a host-tier table is already in DRAM: cache_bytes applies to the file tier")
            self.tier: HostTier | FileTier = HostTier(self.table, shared=shared, progress=progress)
        elif tier == "file":
            self.tier = FileTier(self.table, mode=file_mode, queue_depth=queue_depth, backend=backend)
        elif remote is not None:
            self.tier = remote  # the FileTier interface: check_ids, read_rows, gather, close
        else:
            raise ValueError(f"unknown tier {tier!r} (valid: {', '.join(TIERS)})")
        self.cache = RowCache.from_bytes(cache_bytes, m.row_bytes, cache_policy) if cache_bytes else None
        self.stats_ = StoreStats(m.n_heads, m.row_bytes)
        self._offsets = self.table.head_offsets
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergram-prefetch")
        # warm-ups on their own worker: a large read-ahead never queues in front of a step's fetch
        self._warm_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergram-warm") \
            if self.cache is not None else None

    @property
    def num_heads(self) -> int:
        return self.manifest.n_heads

    @property
    def dim(self) -> int:
        return self.manifest.dim

    def lookup(self, row_ids: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for per-head ids int64 [..., H] as [..., H, D] in self.dtype; IndexError names head and id."""
        ids = check_row_ids(row_ids, self.table.head_rows, host=True, check_range=False)
        out = self._output(ids.shape, out)
        self._fetch(ids.reshape(-1, self.num_heads), out.view(-1, self.num_heads, self.dim), None, None)
        return out

    def prefetch(self, row_ids: np.ndarray | torch.Tensor) -> Ticket:
        """Start fetching rows in the background; `ticket.wait()` returns what `lookup` would."""
        ids = check_row_ids(row_ids, self.table.head_rows, host=True, check_range=False)
        flat = ids.reshape(-1, self.num_heads)
        self.tier.check_ids(flat)  # a bad id fails here, in the caller, not later in wait()
        out = torch.empty((*ids.shape, self.dim), dtype=self.dtype)
        uniq = batch = None
        if self.cache is not None:
            uniq = np.unique(flat + self._offsets)
            batch = self.cache.announce(uniq)  # the lookahead policy now knows these rows are coming
        cancelled = threading.Event()

        def run() -> torch.Tensor:
            self._fetch(flat, out.view(-1, self.num_heads, self.dim), cancelled, (uniq, batch))
            return out

        retire = (lambda: self.cache.retire(batch)) if self.cache is not None else (lambda: None)
        return Ticket(self._executor.submit(run), cancelled, retire)

    def warm(self, row_ids: np.ndarray | torch.Tensor) -> Ticket | None:
        """Read the uncached rows of per-head ids int64 [..., H] into the cache in the background, on a worker of
        their own (beside the prefetches, never in front of them); None when there is no cache. Advisory: a lookup
        re-reads whatever a failed, cancelled or not yet finished warm-up left out (and raises any read error
        itself)."""
        if self.cache is None or self._warm_executor is None:
            return None
        flat = check_row_ids(row_ids, self.table.head_rows, host=True, check_range=False).reshape(-1, self.num_heads)
        self.tier.check_ids(flat)
        keys = np.unique(flat + self._offsets)
        cancelled = threading.Event()

        def run() -> None:
            if cancelled.is_set():
                raise CancelledError
            m, miss = self.manifest, self.cache.missing(keys)
            if miss.size:
                buf, offsets, pages = self.tier.read_rows(miss)
                raw = np.empty((miss.size, m.row_bytes), dtype=np.uint8)
                _native.decode_at(buf, offsets, m.codec_id, m.dim, raw)  # uint8 out: a raw copy
                self.stats_.record_warm(self.cache.admit(miss, raw), {"file": pages * m.page_size}, pages)

        return Ticket(self._warm_executor.submit(run), cancelled, lambda: None)

    def stats(self) -> dict:
        """Lookups, unique ids, hits, misses per head; bytes read per tier; pages read; read amplification."""
        snap = self.stats_.snapshot()
        snap["tier"] = self.tier.name
        if isinstance(self.tier, FileTier):
            snap["backend"] = self.tier.backend
        if self.tier.name == "mooncake":  # remote reads: calls, pages, bytes, latency, faults, fallback pages
            snap["remote"] = self.tier.stats()
        if self.cache is not None:
            snap["cache"] = {"rows": len(self.cache), "capacity_rows": self.cache.capacity,
                             "bytes": self.cache.nbytes, "policy": self.cache.policy.name,
                             **vars(self.cache.counters)}
        return snap

    def close(self) -> None:
        """Stop the prefetch worker and release the tier."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._warm_executor is not None:
            self._warm_executor.shutdown(wait=True, cancel_futures=True)
        self.tier.close()

    # -- internals -------------------------------------------------------------------------------------

    def _output(self, id_shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        shape = (*id_shape, self.dim)
        if out is None:
            return torch.empty(shape, dtype=self.dtype)
        if tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous CPU {self.dtype} tensor of shape {list(shape)}")
        return out

    def _fetch(self, flat: np.ndarray, out: torch.Tensor, cancelled: threading.Event | None,
               announced: tuple[np.ndarray | None, int | None] | None) -> None:
        """Fill out [N, H, D] with the rows of flat ids [N, H] from cache and tier."""
        m = self.manifest
        per_head_ids = np.full(self.num_heads, flat.shape[0], dtype=np.int64)
        if self.cache is None and isinstance(self.tier, HostTier):
            # DRAM gather: duplicates cost a cache-hot re-read, cheaper than deduplicating first
            self.tier.gather(flat, out)
            self.stats_.record(ids=per_head_ids, tier_bytes={"host": flat.size * m.row_bytes})
            return
        if self.cache is None:  # every distinct row is a miss of the (absent) cache
            uniq, pages = self.tier.gather(flat, out)
            counts = per_head_counts(uniq, self._offsets)
            self.stats_.record(ids=per_head_ids, unique=counts, hits=np.zeros_like(counts), misses=counts,
                               tier_bytes={"file": pages * m.page_size}, pages=pages)
            return
        self._fetch_cached(flat, out, cancelled, announced)

    def _fetch_cached(self, flat: np.ndarray, out: torch.Tensor, cancelled: threading.Event | None,
                      announced: tuple[np.ndarray | None, int | None] | None) -> None:
        m, cache = self.manifest, self.cache
        uniq, batch = announced if announced else (None, None)
        try:
            if cancelled is not None and cancelled.is_set():
                raise CancelledError
            self.tier.check_ids(flat)
            glob = (flat + self._offsets).reshape(-1)
            if uniq is None:
                uniq = np.unique(glob)
            inverse = np.searchsorted(uniq, glob)
            slots = cache.probe(uniq, batch)
            batch = None  # probing retired it
        finally:
            if batch is not None:
                cache.retire(batch)
        try:
            hit = slots >= 0
            raw = np.empty((uniq.size, m.row_bytes), dtype=np.uint8)
            raw[hit] = cache.rows[slots[hit]]
            miss_keys = uniq[~hit]
            pages = 0  # this call's reads (the tier's counters also count concurrent calls')
            if miss_keys.size:
                if cancelled is not None and cancelled.is_set():
                    raise CancelledError
                buf, offsets, pages = self.tier.read_rows(miss_keys)
                miss_raw = np.empty((miss_keys.size, m.row_bytes), dtype=np.uint8)
                _native.decode_at(buf, offsets, m.codec_id, m.dim, miss_raw)  # uint8 out: a raw copy
                raw[~hit] = miss_raw
                cache.admit(miss_keys, miss_raw)
            _native.decode_at(raw.reshape(-1), inverse * m.row_bytes, m.codec_id, m.dim, out)
        finally:
            cache.unpin(slots)
        self.stats_.record(
            ids=np.full(self.num_heads, flat.shape[0], dtype=np.int64),
            unique=per_head_counts(uniq, self._offsets), hits=per_head_counts(uniq[hit], self._offsets),
            misses=per_head_counts(miss_keys, self._offsets),
            tier_bytes={"cache": int(hit.sum()) * m.row_bytes, "file": pages * m.page_size}, pages=pages)

