"""TieredTable: the store contract — per-head row ids [B, L, H] in, rows [B, L, H, D] out, prefetchable."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tiergram import _native
from tiergram.cache.native import NativeRowCache
from tiergram.codecs import check_out_dtype
from tiergram.format import TableFile
from tiergram.format.ids import check_row_ids
from tiergram.store.contract import TableBase
from tiergram.store.stats import StoreStats, per_head_counts
from tiergram.store.ticket import NativeTicket, Ticket
from tiergram.tiers import FileTier, HostTier
from tiergram.tiers.file import STAGING_KEEP_BYTES

TIERS = ("host", "file", "mooncake")
# What a host-memory budget keeps from the cache (docs/placement.md): the staging buffer of each reading thread
# (prefetch, warm-up, one caller) and each cached row's index (native LRU: key -> slot table, links, slot key, pins;
# lookahead and LFU add their heaps; the Python RowCache's dicts ~256 B, a safe bound).
STAGING_RESERVE_BYTES = 3 * STAGING_KEEP_BYTES
PRELOAD_PARTS = 4  # a page-by-page preload's warm-up calls: progress between them, coldest part first
# a preload reads the whole file in order from this share of its pages (sequential reads: 1.5-10x the bytes/s)
PRELOAD_SCAN_SHARE = 0.5
INDEX_BYTES_PER_ROW = {"native": 96, "python": 256}
NATIVE_POLICY_EXTRA_BYTES_PER_ROW = {"lru": 0, "lookahead": 32, "lfu": 96}


class TieredTable(TableBase):
    """One Engram layer's table served from tier 'host' (DRAM; shared=True: one /dev/shm copy), 'file' (file_mode
    direct, buffered or mmap) or 'mooncake' (path 'mooncake://HOST:PORT/NAME', remote_options for MooncakeTier.open),
    with an optional native hot-row cache of `cache_bytes` or what `host_memory_bytes` leaves (docs/placement.md)."""

    def __init__(self, path: str | os.PathLike, *, tier: str = "host", dtype: torch.dtype = torch.float32,
                 shared: bool = False, cache_bytes: int | None = None, cache_policy: str = "lru",
                 file_mode: str = "direct", queue_depth: int = 128, backend: str = "auto", progress: bool = False,
                 remote_options: dict | None = None, host_memory_bytes: int | None = None) -> None:
        check_out_dtype(dtype)
        if host_memory_bytes is not None and host_memory_bytes <= 0:
            raise ValueError(f"host_memory_bytes must be positive, got {host_memory_bytes}")
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r} (valid: {', '.join(TIERS)})")
        if tier == "host" and cache_bytes:
            raise ValueError("a host-tier table is already in DRAM: cache_bytes applies to the file tier")
        self._closed = False
        self.host_memory_bytes = host_memory_bytes
        self.dtype = dtype
        if tier == "mooncake":  # path is mooncake://HOST:PORT/NAME; the manifest lives beside the pages
            from tiergram.tiers.mooncake import MooncakeTier  # optional dependency (the remote extra)

            self.tier: HostTier | FileTier | MooncakeTier = MooncakeTier.open(str(path), **(remote_options or {}))
        elif tier == "file":
            self.tier = FileTier(TableFile.open(Path(path)), mode=file_mode, queue_depth=queue_depth, backend=backend)
        else:
            table = TableFile.open(Path(path))
            if host_memory_bytes is not None and table.manifest.data_bytes > host_memory_bytes:
                raise ValueError(f"{path}: a host-tier table needs {table.manifest.data_bytes} bytes of host memory, "
                                 f"more than the budget of {host_memory_bytes} bytes (use tier='file')")
            self.tier = HostTier(table, shared=shared, progress=progress)
        self.table = self.tier.table
        self.manifest = m = self.table.manifest
        if cache_bytes is None and host_memory_bytes is not None and tier != "host":
            cache_bytes = budget_cache_bytes(host_memory_bytes, m.row_bytes, "native", cache_policy)
        self.cache = NativeRowCache.from_bytes(cache_bytes, m.row_bytes, cache_policy) if cache_bytes else None
        self._reader = self.tier.reader
        if self._reader is None and self.cache is not None:  # mmap: the cache's misses are copied from the mapping
            self._reader = _native.CallbackPageSource(self.tier.read_pages, m.page_size, m.n_pages)
        self.pipeline = "python" if self._reader is None else "native"
        self.stats_ = StoreStats(m.n_heads, m.row_bytes, page_size=m.page_size, cached=self.cache is not None,
                                 tier=self.tier.name)
        self._offsets = self.table.head_offsets
        self._head_rows = self.table.head_rows
        if self.pipeline == "python":
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergram-prefetch")
            return
        self._native_table = (m.rows_per_page, m.codec_id, m.dim)
        self._native_cache = self.cache.native if self.cache is not None else None
        # read-aheads on a queue of their own, never in front of a step's fetch (and yielding to it at the device)
        self._queue = _native.FetchQueue()
        self._warm_queue = _native.FetchQueue(background=True) if self.cache is not None else None

    def lookup(self, row_ids: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for per-head ids int64 [..., H] as [..., H, D] in self.dtype; IndexError names head and id."""
        self._check_open()
        ids = check_row_ids(row_ids, self._head_rows, host=True, check_range=False)
        shape = (*ids.shape, self.dim)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype)
        elif (tuple(out.shape), out.dtype, out.device.type) != (shape, self.dtype, "cpu") or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU {self.dtype} tensor of shape {list(shape)}")
        self._fetch(ids.reshape(-1, self.num_heads), out.view(-1, self.num_heads, self.dim))
        return out

    def prefetch(self, row_ids: np.ndarray | torch.Tensor) -> Ticket | NativeTicket:
        """Start fetching rows in the background; `ticket.wait()` returns what `lookup` would."""
        self._check_open()
        ids = check_row_ids(row_ids, self._head_rows, host=True, check_range=False)
        flat = ids.reshape(-1, self.num_heads)
        out = torch.empty((*ids.shape, self.dim), dtype=self.dtype)
        if self.pipeline == "native":  # the queue checks the ids in this call (a bad id fails here, not in wait())
            return NativeTicket(self._native(self._queue.fetch, flat, _native_out(out), self.stats_.native), out)
        self.tier.check_ids(flat)  # a bad id fails here, in the caller, not later in wait()

        def run() -> torch.Tensor:
            self._fetch(flat, out.view(-1, self.num_heads, self.dim))
            return out

        try:
            future = self._executor.submit(run)
        except RuntimeError:  # close() ran meanwhile
            self._check_open()
            raise
        return Ticket(future, threading.Event(), lambda: None)

    def warm(self, row_ids: np.ndarray | torch.Tensor, *, urgent: bool = False) -> NativeTicket | None:
        """Read the uncached rows of ids int64 [..., H] into the cache in the background (advisory; None: no cache)."""
        self._check_open()
        if self.cache is None:
            return None
        flat = check_row_ids(row_ids, self._head_rows, host=True, check_range=False).reshape(-1, self.num_heads)
        queue = self._queue if urgent else self._warm_queue  # the queue checks the ids in this call
        return NativeTicket(self._native(queue.warm, flat, self.stats_.native_warm), None)

    def preload(self, row_ids: np.ndarray | torch.Tensor, *, progress: bool = False) -> int:
        """Fill the cache with the rows of per-head ids int64 [n, H] (at most its capacity of distinct rows), coldest
        first; how many entered. Read whole, in order, when the pages needed are PRELOAD_SCAN_SHARE of the file."""
        self._check_open()
        if self.cache is None:
            return 0
        flat = check_row_ids(row_ids, self._head_rows, host=True).reshape(-1, self.num_heads)
        m, before = self.manifest, len(self.cache)
        keys = (flat + self._offsets).reshape(-1)
        distinct = np.unique(keys)
        if distinct.size > self.cache.capacity:  # which would stay would depend on the order of the reads
            raise ValueError(f"{self.table.path}: preload of {distinct.size:,} distinct rows into a cache of "
                             f"{self.cache.capacity:,} rows; pass at most the cache's capacity")
        wanted = self.cache.missing(distinct)  # sorted
        page_of = wanted // m.rows_per_page
        if not isinstance(self._reader, _native.PageReader) or np.unique(page_of).size < PRELOAD_SCAN_SHARE * m.n_pages:
            for part in np.array_split(flat, PRELOAD_PARTS):
                if part.size:
                    self.warm(part).wait()
            self.cache.touch(keys)  # each warm-up admits in key order: the recency order comes from the ids
            return len(self.cache) - before
        failed: list[np.ndarray] = []

        def admit(p0: int, buf: np.ndarray, bad: list[int]) -> None:
            lo, hi = np.searchsorted(page_of, [p0, p0 + buf.size // m.page_size])
            rows, pages = wanted[lo:hi], page_of[lo:hi]
            if bad:  # re-read below through the tier's reader, which retries once and names file and page
                sound = ~np.isin(pages, bad)
                failed.append(rows[~sound])
                rows, pages = rows[sound], pages[sound]
            if rows.size:
                self.cache.admit(rows, self._raw_at(buf, (pages - p0) * m.page_size
                                                    + rows % m.rows_per_page * m.row_bytes))

        # 16 MiB reads: the three buffers fit the staging reserve of a host-memory budget, at the same rate as 32 MiB
        self.table.scan(admit, verb="preloading", progress=progress, chunk_bytes=STAGING_KEEP_BYTES)
        self._reader.mark_read(0, m.n_pages)  # the scan read every page: later reads of them are re-reads
        again = np.concatenate(failed) if failed else wanted[:0]
        pages_read = m.n_pages
        if again.size:
            buf, offsets, n = self.tier.read_rows(again)
            self.cache.admit(again, self._raw_at(buf, offsets))
            pages_read += n
        self.cache.touch(keys)  # admitted in file order: the recency order comes from the ids
        self.stats_.record_warm(len(self.cache) - before, {self.tier.name: pages_read * m.page_size}, pages_read)
        return len(self.cache) - before

    def drain_warm(self, timeout: float | None = None) -> None:
        """Wait (TimeoutError after `timeout` s) until the read-aheads queued so far have ended; errors are theirs."""
        self._check_open()
        if self.cache is None:
            return
        for queue in (self._warm_queue, self._queue):
            NativeTicket(queue.marker(), None).wait(timeout)

    def stats(self) -> dict:
        """Lookups, unique ids, hits, misses per head; bytes read per tier; pages read; read amplification."""
        snap = self.stats_.snapshot()
        snap.update(tier=self.tier.name, pipeline=self.pipeline, host_memory_bytes=self.host_memory_bytes)
        if isinstance(self.tier, FileTier):  # its mode in use ('buffered' where O_DIRECT was refused), its reads
            snap.update(self.tier.stats())
        if self.tier.name == "mooncake":  # remote reads: calls, pages, bytes, latency, faults, fallback pages
            snap["remote"] = self.tier.stats()
        if self.cache is not None:
            snap["cache"] = self.cache_stats()
        return snap

    def close(self) -> None:
        """Stop the prefetch workers (running fetches finish, queued ones are cancelled) and release the tier."""
        self._closed = True
        if self.pipeline == "python":
            self._executor.shutdown(wait=True, cancel_futures=True)
        else:
            self._queue.shutdown(True)
            if self._warm_queue is not None:
                self._warm_queue.shutdown(True)
            if self._reader is not self.tier.reader:
                self._reader.close()
        self.tier.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TieredTable for {self.table.path} is closed")

    def _raw_at(self, buf: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Copies of the encoded rows at byte offsets int64 [n] of buf: uint8 [n, row_bytes]."""
        m = self.manifest
        raw = np.empty((offsets.size, m.row_bytes), dtype=np.uint8)
        _native.decode_at(buf, offsets, m.codec_id, m.dim, raw)  # uint8 out: a raw copy
        return raw

    def _fetch(self, flat: np.ndarray, out: torch.Tensor) -> None:
        """Fill out [N, H, D] with the rows of flat ids [N, H]."""
        if self.pipeline == "native":  # the whole lookup in one call without the GIL, statistics counted there
            self._native(_native.fetch, flat, _native_out(out), self.stats_.native)
            return
        m = self.manifest
        per_head_ids = np.full(self.num_heads, flat.shape[0], dtype=np.int64)
        uniq, pages = self.tier.gather(flat, out)
        if isinstance(self.tier, HostTier):  # it reads every id as it comes: no distinct rows to count
            self.stats_.record(ids=per_head_ids, tier_bytes={"host": uniq.size * m.row_bytes})
            return
        counts = per_head_counts(uniq, self._offsets)  # mmap without a cache: every distinct row is a miss
        self.stats_.record(ids=per_head_ids, unique=counts, misses=counts,
                           tier_bytes={self.tier.name: pages * m.page_size}, pages=pages)

    def _native(self, call, flat: np.ndarray, *args: object) -> object:
        """A native fetch or warm-up `call` of flat ids [N, H] and *args (ValueError after close() says closed)."""
        try:
            return call(self._reader, self._native_cache, flat, self._offsets, self._head_rows,
                        *self._native_table, *args, self.tier.native_counts)
        except ValueError:
            self._check_open()
            raise


def _native_out(out: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A float32 tensor passes to the native core as numpy (cheaper than DLPack); bfloat16 has no numpy dtype."""
    return out.numpy() if out.dtype == torch.float32 else out


def budget_cache_bytes(budget: int, row_bytes: int, pipeline: str, policy: str = "lru") -> int:
    """Cache bytes a host-memory budget leaves: (budget - staging) rows of row_bytes + index; ValueError if none."""
    per_row = row_bytes + INDEX_BYTES_PER_ROW[pipeline]
    if pipeline == "native":
        per_row += NATIVE_POLICY_EXTRA_BYTES_PER_ROW.get(policy, 0)
    rows = (budget - STAGING_RESERVE_BYTES) // per_row
    if rows < 1:
        raise ValueError(f"host_memory_bytes={budget} leaves no room for a cache: staging takes "
                         f"{STAGING_RESERVE_BYTES} bytes and one cached row {per_row} bytes")
    return int(rows) * row_bytes
