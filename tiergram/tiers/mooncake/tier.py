"""The Mooncake tier's read path: pages into registered staging buffers, verified, retried, or read locally."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiergram import _native
from tiergram.format import TableFile
from tiergram.tiers.aligned import aligned_empty
from tiergram.tiers.base import PageTier
from tiergram.tiers.file import FileTier
from tiergram.tiers.mooncake.client import (
    CHECKSUM_MISMATCH,
    DEFAULT_TIMEOUT_S,
    KEY_PREFIX,
    MAX_KEYS_PER_CALL,
    OBJECT_NOT_FOUND,
    TIMEOUT,
    Caller,
    client_bound_s,
    error_name,
    fetch_manifest,
    parse_uri,
    release_client,
    shared_client,
    table_uri,
)

PageReadError = _native.PageReadError
ABANDON_GRACE_S = 300.0  # a buffer a failed transfer may still write is reused only after this long
_UNSAFE_BUFFERS: list[np.ndarray] = []  # abandoned buffers of closed tiers: never freed (see MooncakeTier.close)


@dataclass
class RemoteCounters:
    """Running totals of one mooncake tier's reads."""

    calls: int = 0  # batch_get_into calls
    pages_read: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    errors: int = 0  # pages that failed (after the retry), whether or not a fallback served them
    checksum_failures: int = 0
    retries: int = 0
    fallback_pages: int = 0  # pages the local fallback file served
    latencies: deque = field(default_factory=lambda: deque(maxlen=4096))  # seconds per call, the latest


class MooncakeTier(PageTier):
    """Rows of a table held in Mooncake Store, one object per page (docs/remote.md); `fallback`: a local copy
    for the pages Mooncake cannot serve. Store calls run on a low-priority worker, abandoned after `timeout_s`."""

    name = "mooncake"

    def __init__(self, store: Any, table_name: str, *, manifest: Any, data_offset: int, master: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S, fallback: str | os.PathLike | None = None,
                 owns_store: bool = False) -> None:
        self.store = store
        self.table_name = table_name
        self.master = master
        super().__init__(TableFile(Path(table_uri(master, table_name) if master else table_name), manifest,
                                   data_offset))
        m = manifest
        self.timeout_s = timeout_s
        self.counters = RemoteCounters()
        self._owns_store = owns_store
        self._prefix = f"{KEY_PREFIX}/{table_name}/p"
        self._lock = threading.Lock()
        # by thread id: the pipeline's C++ threads get a fresh Python thread state per call (no threading.local)
        self._staging: dict[int, np.ndarray] = {}
        self._registered: list[np.ndarray] = []  # every staging buffer registered with the store
        # (time, buffer) a failed or abandoned transfer may still write into: reused only after ABANDON_GRACE_S
        self._abandoned: list[tuple[float, np.ndarray]] = []
        self._caller = Caller(timeout_s, low_priority=True)
        self.fallback: FileTier | None = None
        if fallback is not None:
            local = TableFile.open(fallback)
            if local.manifest != m:
                raise ValueError(f"fallback {fallback} is not the table {table_name!r}: manifests differ")
            self.fallback = FileTier(local, mode="buffered")
        # one read_pages call per batch of missed pages; stats() counts at the store call, not native_counts
        self.reader = _native.CallbackPageSource(self.read_pages, m.page_size, m.n_pages)
        self.native_counts = np.zeros(2, dtype=np.int64)

    @classmethod
    def open(cls, uri: str, *, local_hostname: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S,
             fallback: str | os.PathLike | None = None, store: Any = None) -> MooncakeTier:
        """Open 'mooncake://HOST:PORT/NAME' (with a given `store`, 'mooncake:///NAME' will do)."""
        master, name = parse_uri(uri, allow_no_master=store is not None)
        owns = store is None
        if store is None:
            store = shared_client(master, local_hostname)
        try:
            manifest, data_offset = fetch_manifest(store, name, timeout_s=timeout_s)
        except BaseException:
            if owns:
                release_client(store)
            raise
        return cls(store, name, manifest=manifest, data_offset=data_offset, master=master, timeout_s=timeout_s,
                   fallback=fallback, owns_store=owns)

    def read_pages(self, pages: np.ndarray) -> np.ndarray:
        """The verified pages int64 [M] (distinct) as uint8 [M * page_size], page i at i * page_size."""
        ps = self.manifest.page_size
        pages = np.asarray(pages, dtype=np.int64)
        buf = self.staging(pages.size * ps)
        failed: dict[int, int | str] = {}  # position in pages -> code
        for lo in range(0, pages.size, MAX_KEYS_PER_CALL):
            failed.update(self._get(pages, range(lo, min(lo + MAX_KEYS_PER_CALL, pages.size)), buf))
        retry = [i for i, code in failed.items() if code in (CHECKSUM_MISMATCH, -703)]
        if retry and threading.get_ident() in self._staging:
            # one more try (a transient fault, a bit flipped in flight), unless a transfer may still write here
            with self._lock:
                self.counters.retries += len(retry)
            again = self._get(pages, sorted(retry), buf)
            for i in retry:
                failed.pop(i)
            failed.update(again)
        if failed:
            with self._lock:
                self.counters.errors += len(failed)
            if self.fallback is None:
                raise self._error(pages, failed)
            self._from_fallback(pages, sorted(failed), buf)
        return buf

    def _error(self, pages: np.ndarray, failed: dict[int, int | str]) -> OSError:
        """PageReadError for the first failed page, with .table, .page and .mooncake_code set."""
        pos, code = min(failed.items())
        page = int(pages[pos])
        what = {CHECKSUM_MISMATCH: "arrived but fails its checksum (CHECKSUM_MISMATCH)",
                TIMEOUT: f"Mooncake did not answer within {self.timeout_s:g} s (TIMEOUT)"}.get(
            code, f"Mooncake error {error_name(code)}")
        more = f"; {len(failed) - 1} more page(s) failed" if len(failed) > 1 else ""
        err = PageReadError(errno.ETIMEDOUT if code == TIMEOUT else errno.EIO,
                            f"mooncake table {self.table_name!r}: page {page} (key {self._prefix}{page}) could not "
                            f"be read: {what}{more}")
        err.table, err.page, err.mooncake_code = self.table_name, page, code
        return err

    def stats(self) -> dict[str, object]:
        """Remote reads: calls, pages, bytes, seconds, latency p50/p99 (ms) of the recent calls, faults."""
        with self._lock:
            c = self.counters
            lat = np.asarray(c.latencies, dtype=np.float64)
            return {"master": self.master, "table": self.table_name, "waiter_priority": self._caller.priority(),
                    **{k: v for k, v in vars(c).items() if k != "latencies"},
                    "latency_ms_p50": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
                    "latency_ms_p99": float(np.percentile(lat, 99) * 1e3) if lat.size else None}

    def close(self) -> None:
        """Unregister buffers, close the fallback and an owned client (kept open under a still-running call)."""
        self.reader.close()  # later native reads raise; lets go of read_pages (and this tier)
        bound = client_bound_s(self.store)
        if not self._caller.close(wait_s=bound + 1.0 if bound is not None else self.timeout_s):
            self._owns_store = False  # never released: the shared client stays open for the process's life
        for buf in self._registered:
            if not any(buf is a for _, a in self._abandoned):
                with contextlib.suppress(Exception):  # a dead client cannot unregister; the process frees the memory
                    self.store.unregister_buffer(buf.ctypes.data)
        self._registered.clear()
        with self._lock:  # a late transfer may still land in these: they live as long as the process
            _UNSAFE_BUFFERS.extend(buf for _, buf in self._abandoned)
            self._abandoned.clear()
        self._staging.clear()
        if self.fallback is not None:
            self.fallback.close()
        if self._owns_store:
            release_client(self.store)
            self._owns_store = False

    def _get(self, pages: np.ndarray, positions: Sequence[int], buf: np.ndarray) -> dict[int, int | str]:
        """Fetch pages[positions] into their slots of buf and verify them; {position: code} of the failures."""
        ps = self.manifest.page_size
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            return {}
        keys = [f"{self._prefix}{p}" for p in pages[pos].tolist()]
        ptrs = (buf.ctypes.data + pos * ps).tolist()
        t0 = time.perf_counter()
        try:
            codes = self._caller(self.store.batch_get_into, keys, ptrs, [ps] * len(keys))
        except TimeoutError:
            self._abandon(buf)
            return {int(i): TIMEOUT for i in pos}
        dt = time.perf_counter() - t0
        codes = np.asarray(codes, dtype=np.int64)
        if codes.shape != pos.shape:
            raise PageReadError(errno.EIO, f"mooncake table {self.table_name!r}: batch_get_into returned "
                                           f"{codes.size} codes for {pos.size} keys")
        failed: dict[int, int | str] = {}
        for k in np.flatnonzero(codes != ps).tolist():
            code = int(codes[k])
            failed[int(pos[k])] = code if code < 0 else -800  # a short object is a transfer fault
            if code < 0 and code not in (OBJECT_NOT_FOUND, -703, -900, -901, -200):
                self._abandon(buf)  # a failed transfer may still land in the buffer later
        # one native check over the span of positions (a retry's other pages in it are checked again and ignored)
        lo, hi = int(pos.min()), int(pos.max()) + 1
        bad = set(_native.verify_pages(buf[lo * ps:hi * ps], ps, np.ascontiguousarray(pages[lo:hi])))
        corrupt = [i for i in pos.tolist() if i not in failed and int(pages[i]) in bad] if bad else []
        failed.update(dict.fromkeys(corrupt, CHECKSUM_MISMATCH))
        ok_pages = pos.size - len(failed)
        with self._lock:
            c = self.counters
            c.calls += 1
            c.pages_read += ok_pages
            c.bytes_read += ok_pages * ps
            c.checksum_failures += len(corrupt)
            c.seconds += dt
            c.latencies.append(dt)
        return failed

    def _from_fallback(self, pages: np.ndarray, positions: list[int], buf: np.ndarray) -> None:
        ps = self.manifest.page_size
        got = self.fallback.read_pages(pages[positions])  # verified; raises PageReadError itself
        buf.reshape(-1, ps)[positions] = got.reshape(-1, ps)
        with self._lock:
            self.counters.fallback_pages += len(positions)

    def staging(self, nbytes: int) -> np.ndarray:
        """This thread's registered, page-aligned staging buffer of at least nbytes (grown by doubling)."""
        me = threading.get_ident()
        buf = self._staging.get(me)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 2 * buf.size if buf is not None else 1 << 20)
            old, buf = buf, self._reclaim(size)
            if buf is None:
                buf = aligned_empty(size)
                rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
                if rc != 0:
                    raise PageReadError(errno.EIO, f"mooncake table {self.table_name!r}: could not register a "
                                                   f"{size}-byte staging buffer: Mooncake {error_name(rc)}")
                with self._lock:
                    self._registered.append(buf)
            if old is not None:  # outgrown: this thread's earlier calls are done with it
                with self._lock:
                    self._registered = [b for b in self._registered if b is not old]
                self.store.unregister_buffer(old.ctypes.data)
            self._staging[me] = buf
        return buf[:nbytes]

    def _reclaim(self, size: int) -> np.ndarray | None:
        """An abandoned buffer of at least size bytes whose grace period is over, or None."""
        now = time.monotonic()
        with self._lock:
            for k, (t, buf) in enumerate(self._abandoned):
                if now - t > ABANDON_GRACE_S and buf.size >= size:
                    del self._abandoned[k]
                    return buf
        return None

    def _abandon(self, buf: np.ndarray) -> None:
        """Never hand this thread's staging buffer out again: a transfer may still be writing into it."""
        staging = self._staging.pop(threading.get_ident(), None)
        if staging is not None:
            with self._lock:
                self._abandoned.append((time.monotonic(), staging))
