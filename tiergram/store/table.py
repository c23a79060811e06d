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
from tiergram.cache.native import NATIVE_POLICIES, NativeRowCache
from tiergram.codecs import check_out_dtype
from tiergram.format import TableFile
from tiergram.format.ids import check_row_ids
from tiergram.store.contract import TableBase
from tiergram.store.stats import StoreStats, per_head_counts
from tiergram.store.ticket import NativeTicket, Ticket
from tiergram.tiers import FileTier, HostTier, Tier
from tiergram.tiers.file import STAGING_KEEP_BYTES

TIERS = ("host", "file", "mooncake")
PIPELINES = ("auto", "native", "python")
# Host-memory budget (host_memory_bytes without cache_bytes): what the cache does not get. Staging: the buffer each
# reading thread keeps (the prefetch worker, the warm-up worker and one caller thread). Index: per cached row, the
# native cache's key -> slot table (2-4 buckets of 16 B), LRU links (16 B), slot key (8 B) and pins (4 B); the
# Python reference cache's dict and ordered dict take about 256 B. The native lookahead policy adds a state byte,
# a next use (8 B) and its heap entries (16 B each); native LFU its heap (up to 4 entries of 16 B) and the counts.
STAGING_RESERVE_BYTES = 3 * STAGING_KEEP_BYTES
PRELOAD_PARTS = 4  # a page-by-page preload's warm-up calls: progress between them, coldest part first
# a preload reads the whole file in order when the pages it needs are at least this share of it: this project's
# cloud disk reads 2.5-10x more bytes per second sequentially than in random pages, a local NVMe drive ~1.5-2x
PRELOAD_SCAN_SHARE = 0.5
INDEX_BYTES_PER_ROW = {"native": 96, "python": 256}
NATIVE_POLICY_EXTRA_BYTES_PER_ROW = {"lru": 0, "lookahead": 32, "lfu": 96}


class TieredTable(TableBase):
    """One Engram layer's table served from a tier, optionally through a hot-row cache.

    tier 'host': the whole table in DRAM (shared=True: one /dev/shm copy for all processes).
    tier 'file': rows read from the file (file_mode 'direct' O_DIRECT batched reads, 'buffered', or 'mmap'),
    with an optional host cache of `cache_bytes` encoded rows under `cache_policy` (lru, lfu, lookahead).
    tier 'mooncake': path is 'mooncake://HOST:PORT/NAME', a table pushed with `tiergram table push`; pages come
    from Mooncake Store (remote_options go to MooncakeTier.open: timeout_s, fallback, local_hostname), cached as
    for the file tier (docs/remote.md).

    Without `cache_bytes`, a `host_memory_bytes` budget sizes the file tier's cache: what is left after the staging
    buffers and the cache's index (docs/placement.md); with neither there is no cache. pipeline 'auto' serves the
    file tier's O_DIRECT/buffered reads and the Mooncake tier through the native fetch pipeline (one call without
    the GIL per lookup: dedup, cache probe, page reads, checksums, admission, decode; a native cache of any policy),
    and the host tier and mmap through the Python reference path; 'python' forces the reference path, 'native'
    refuses a table it cannot serve natively. The native pipeline reads pages into io_uring-registered staging
    buffers (READ_FIXED), and its read-ahead gives way to a fetch at the device (`PageReader.yield_depth`).
    """

    def __init__(self, path: str | os.PathLike, *, tier: str = "host", dtype: torch.dtype = torch.float32,
                 shared: bool = False, cache_bytes: int | None = None, cache_policy: str = "lru",
                 file_mode: str = "direct", queue_depth: int = 128, backend: str = "auto", progress: bool = False,
                 remote_options: dict | None = None, host_memory_bytes: int | None = None,
                 pipeline: str = "auto") -> None:
        check_out_dtype(dtype)
        if pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {pipeline!r} (valid: {', '.join(PIPELINES)})")
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

            self.tier: Tier = MooncakeTier.open(str(path), **(remote_options or {}))
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
        wants_cache = bool(cache_bytes) or (cache_bytes is None and host_memory_bytes is not None and tier != "host")
        # a tier with a native page source: the file tier's reads (not mmap) and the remote tier's
        native_ok = (self.tier.reader is not None
                     and (cache_policy in NATIVE_POLICIES or not wants_cache))
        if pipeline == "native" and not native_ok:
            raise ValueError(f"the native fetch pipeline serves tier='file' with file_mode 'direct' or 'buffered', "
                             f"and the mooncake tier, with a cache policy of {', '.join(NATIVE_POLICIES)} (or no "
                             f"cache), not tier={tier!r} file_mode={file_mode!r} cache_policy={cache_policy!r}")
        self.pipeline = "native" if native_ok and pipeline != "python" else "python"
        if cache_bytes is None and host_memory_bytes is not None and tier != "host":
            cache_bytes = budget_cache_bytes(host_memory_bytes, m.row_bytes, self.pipeline, cache_policy)
        cache_cls = NativeRowCache if self.pipeline == "native" else RowCache
        self.cache = cache_cls.from_bytes(cache_bytes, m.row_bytes, cache_policy) if cache_bytes else None
        self.stats_ = StoreStats(m.n_heads, m.row_bytes, page_size=m.page_size, cached=self.cache is not None,
                                 tier=self.tier.name)
        self._offsets = self.table.head_offsets
        self._head_rows = self.table.head_rows
        if self.pipeline == "native":  # the native call's constant arguments, looked up once
            self._native_table = (m.rows_per_page, m.codec_id, m.dim)
            self._native_cache = self.cache.native if self.cache is not None else None
            # prefetches and read-aheads run on C++ threads of their own (read-aheads never queue in front of a
            # step's fetch); tickets wait on them without the GIL
            self._queue = _native.FetchQueue()
            # the read-ahead queue gives way to fetches at the device (PageReader.yield_depth)
            self._warm_queue = _native.FetchQueue(background=True) if self.cache is not None else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergram-prefetch")
        # warm-ups on their own worker: a large read-ahead never queues in front of a step's fetch
        self._warm_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergram-warm") \
            if self.cache is not None else None

    def lookup(self, row_ids: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for per-head ids int64 [..., H] as [..., H, D] in self.dtype; IndexError names head and id."""
        self._check_open()
        ids = check_row_ids(row_ids, self._head_rows, host=True, check_range=False)
        out = self._output(ids.shape, out)
        self._fetch(ids.reshape(-1, self.num_heads), out.view(-1, self.num_heads, self.dim), None, None)
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
        uniq = batch = None
        if self.cache is not None and self.pipeline == "python":
            uniq = np.unique(flat + self._offsets)
            batch = self.cache.announce(uniq)  # the lookahead policy now knows these rows are coming
        cancelled = threading.Event()

        def run() -> torch.Tensor:
            self._fetch(flat, out.view(-1, self.num_heads, self.dim), cancelled, (uniq, batch))
            return out

        retire = (lambda: self.cache.retire(batch)) if batch is not None else (lambda: None)
        try:
            future = self._executor.submit(run)
        except RuntimeError:  # close() ran meanwhile: nothing will probe the announced batch
            retire()
            self._check_open()
            raise
        return Ticket(future, cancelled, retire)

    def warm(self, row_ids: np.ndarray | torch.Tensor, *, urgent: bool = False) -> Ticket | NativeTicket | None:
        """Read the uncached rows of per-head ids int64 [..., H] into the cache in the background, on a worker of
        their own (beside the prefetches, never in front of them) or, `urgent`, on the prefetch worker (the next
        step's rows: its prefetch then queues behind them instead of reading them again); None when there is no
        cache. Advisory: a lookup re-reads whatever a failed, cancelled or not yet finished warm-up left out (and
        raises any read error itself)."""
        self._check_open()
        if self.cache is None or self._warm_executor is None:
            return None
        flat = check_row_ids(row_ids, self._head_rows, host=True, check_range=False).reshape(-1, self.num_heads)
        if self.pipeline == "native":  # the queue checks the ids in this call
            queue = self._queue if urgent else self._warm_queue
            return NativeTicket(self._native(queue.warm, flat, self.stats_.native_warm), None)
        self.tier.check_ids(flat)
        cancelled = threading.Event()
        keys = np.unique(flat + self._offsets)

        def run() -> None:
            if cancelled.is_set():
                raise CancelledError
            miss = self.cache.missing(keys)
            if miss.size:
                raw, pages = self._read_raw(miss)
                self.stats_.record_warm(self.cache.admit(miss, raw), {self.tier.name: pages * self.manifest.page_size},
                                        pages)

        return Ticket((self._executor if urgent else self._warm_executor).submit(run), cancelled, lambda: None)

    def preload(self, row_ids: np.ndarray | torch.Tensor, *, progress: bool = False) -> int:
        """Fill the cache with the rows of per-head ids int64 [n, H], the coldest first (the last ends the most
        recently used), at most the cache's capacity of distinct rows; returns how many entered. A file tier
        whose pages holding them are at least PRELOAD_SCAN_SHARE of the table is read whole, in order (large
        reads, every page verified); otherwise the rows are read page by page through warm(). Read errors
        raise."""
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
        if not isinstance(self.tier, FileTier) or np.unique(page_of).size < PRELOAD_SCAN_SHARE * m.n_pages:
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
        if self.tier.reader is not None:  # the scan read every page: later reads of them are re-reads
            self.tier.reader.mark_read(0, m.n_pages)
        again = np.concatenate(failed) if failed else wanted[:0]
        self.tier.count(int(wanted.size - again.size), m.n_pages)
        pages_read = m.n_pages
        if again.size:  # read_rows counts its own reads
            raw, n = self._read_raw(again)
            self.cache.admit(again, raw)
            pages_read += n
        self.cache.touch(keys)  # admitted in file order: the recency order comes from the ids
        self.stats_.record_warm(len(self.cache) - before, {self.tier.name: pages_read * m.page_size}, pages_read)
        return len(self.cache) - before

    def drain_warm(self, timeout: float | None = None) -> None:
        """Wait until the read-aheads queued so far, urgent ones included, have ended (TimeoutError after `timeout`
        s); their errors are theirs (read-aheads are advisory)."""
        self._check_open()
        if self.cache is None:
            return
        if self.pipeline == "native":
            for queue in (self._warm_queue, self._queue):
                NativeTicket(queue.marker(), None).wait(timeout)
        elif self._warm_executor is not None:
            for pool in (self._warm_executor, self._executor):
                pool.submit(lambda: None).result(timeout)

    def stats(self) -> dict:
        """Lookups, unique ids, hits, misses per head; bytes read per tier; pages read; read amplification."""
        snap = self.stats_.snapshot()
        snap.update(tier=self.tier.name, pipeline=self.pipeline, host_memory_bytes=self.host_memory_bytes)
        if isinstance(self.tier, FileTier):  # its mode in use ('buffered' where O_DIRECT was refused), its reads
            snap.update(self.tier.stats())
        if self.tier.name == "mooncake":  # remote reads: calls, pages, bytes, latency, faults, fallback pages
            snap["remote"] = self.tier.stats()
            remote_bytes = snap["bytes_read"].get("mooncake", 0)  # counted apart from the file tier's
            miss_bytes = snap["misses"] * self.manifest.row_bytes
            snap["read_amplification"] = remote_bytes / miss_bytes if miss_bytes and remote_bytes else None
        if self.cache is not None:
            snap["cache"] = self.cache_stats()
        return snap

    def close(self) -> None:
        """Stop the prefetch worker (running fetches finish, queued ones are cancelled) and release the tier."""
        self._closed = True
        if self.pipeline == "native":
            self._queue.shutdown(True)
            if self._warm_queue is not None:
                self._warm_queue.shutdown(True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._warm_executor is not None:
            self._warm_executor.shutdown(wait=True, cancel_futures=True)
        self.tier.close()

    # -- internals -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TieredTable for {self.table.path} is closed")


    def _output(self, id_shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        shape = (*id_shape, self.dim)
        if out is None:
            return torch.empty(shape, dtype=self.dtype)
        if tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous CPU {self.dtype} tensor of shape {list(shape)}")
        return out

    def _raw_at(self, buf: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Copies of the encoded rows at byte offsets int64 [n] of buf: uint8 [n, row_bytes]."""
        m = self.manifest
        raw = np.empty((offsets.size, m.row_bytes), dtype=np.uint8)
        _native.decode_at(buf, offsets, m.codec_id, m.dim, raw)  # uint8 out: a raw copy
        return raw

    def _read_raw(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """(encoded rows uint8 [n, row_bytes] of the global keys [n], read from the tier; pages read)."""
        buf, offsets, pages = self.tier.read_rows(keys)
        return self._raw_at(buf, offsets), pages

    def _fetch(self, flat: np.ndarray, out: torch.Tensor, cancelled: threading.Event | None,
               announced: tuple[np.ndarray | None, int | None] | None) -> None:
        """Fill out [N, H, D] with the rows of flat ids [N, H] from cache and tier."""
        if self.pipeline == "native":  # the whole lookup in one call without the GIL, statistics counted there
            if self._native_cache is not None and cancelled is not None and cancelled.is_set():
                raise CancelledError  # as the reference path: a cached fetch stops before it reads (no cache: it runs)
            self._native(_native.fetch, flat, _native_out(out), self.stats_.native)
            return
        if self.cache is not None:
            self._fetch_cached(flat, out, cancelled, announced)
            return
        m = self.manifest
        per_head_ids = np.full(self.num_heads, flat.shape[0], dtype=np.int64)
        uniq, pages = self.tier.gather(flat, out)
        if isinstance(self.tier, HostTier):  # it reads every id as it comes: no distinct rows to count
            self.stats_.record(ids=per_head_ids, tier_bytes={"host": uniq.size * m.row_bytes})
            return
        counts = per_head_counts(uniq, self._offsets)  # every distinct row is a miss of the (absent) cache
        self.stats_.record(ids=per_head_ids, unique=counts, hits=np.zeros_like(counts), misses=counts,
                           tier_bytes={self.tier.name: pages * m.page_size}, pages=pages)

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
                miss_raw, pages = self._read_raw(miss_keys)
                raw[~hit] = miss_raw
                cache.admit(miss_keys, miss_raw)
            _native.decode_at(raw.reshape(-1), inverse * m.row_bytes, m.codec_id, m.dim, out)
        finally:
            cache.unpin(slots)
        self.stats_.record(
            ids=np.full(self.num_heads, flat.shape[0], dtype=np.int64),
            unique=per_head_counts(uniq, self._offsets), hits=per_head_counts(uniq[hit], self._offsets),
            misses=per_head_counts(miss_keys, self._offsets),
            tier_bytes={"cache": int(hit.sum()) * m.row_bytes, self.tier.name: pages * m.page_size}, pages=pages)

    def _native(self, call, flat: np.ndarray, *args: object) -> object:
        """call(reader, cache, flat ids [N, H], offsets, head rows, rows per page, codec, dim, *args, tier counts): a
        native fetch or warm-up (a ValueError after close() says the table is closed)."""
        try:
            return call(self.tier.reader, self._native_cache, flat, self._offsets, self._head_rows,
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
