"""Mooncake tier: a table's pages as objects in Mooncake Store, fetched into registered buffers and verified.

One object per page (`tiergram/<name>/p<page>`), the header and manifest in `tiergram/<name>/manifest`, written
last by `push_table` as the commit marker. A read fetches every distinct page it needs in one `batch_get_into`
into a registered, page-aligned staging buffer, then checks each page's trailer (index and CRC-32C) with the
same native check the file reader uses: a remote store is trusted less than a local disk. Any page that cannot
be read correctly raises `PageReadError` naming the table, the page and Mooncake's error code, within the
tier's timeout — never wrong rows. docs/remote.md explains the deployment and the measurements behind the
object granularity.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tiergram import _native
from tiergram.format import TableFile, TableFormatError
from tiergram.format.header import unpack_header
from tiergram.format.manifest import PAGE_TRAILER_BYTES
from tiergram.tiers.aligned import aligned_empty
from tiergram.tiers.file import FileTier

PageReadError = _native.PageReadError
URI_SCHEME = "mooncake://"
KEY_PREFIX = "tiergram"
DEFAULT_TIMEOUT_S = 10.0  # a dead master blocks a call ~4.3 s before Mooncake answers -900
MAX_KEYS_PER_CALL = 4096  # keys per batch call (bounds one call's time and its buffer)
PUSH_CHUNK_PAGES = 1024
DIGEST_BYTES = 32  # the page digest ending a manifest object (SHA-256 of every page's trailer)
DIGEST_CHUNK_PAGES = 1 << 16  # pages whose trailers are hashed at a time
ABANDON_GRACE_S = 300.0  # a buffer a failed transfer may still write is reused only after this long
_UNSAFE_BUFFERS: list[np.ndarray] = []  # abandoned buffers of closed tiers: never freed (see MooncakeTier.close)
# Set in this process (unless already set) before a client is created. The first two: without them a batch of more
# than ~1,024 keys wedges the client for 60 s and breaks it. The last three bound every call by Mooncake itself
# (measured, 0.3.13): a hung (SIGSTOPped) holder answers -800 after 2 x the TCP status/progress timeout (6 s at 3; 60 s
# by default), a hung master -901 after MC_RPC_TIMEOUT_MS (30 s by default). With them a small batch can call
# Mooncake on the caller's thread (no worker hop) and still fail within a bounded time; see MooncakeTier.
ENV_DEFAULTS = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
                "MC_TCP_STATUS_TIMEOUT_SEC": "3", "MC_TCP_PROGRESS_TIMEOUT_SEC": "3", "MC_RPC_TIMEOUT_MS": "5000"}
INLINE_MAX_KEYS = 64  # batches of at most this many keys call Mooncake on the caller's thread (see MooncakeTier)
# Mooncake's ErrorCode values (mooncake-store types.h); the Python binding returns them as plain ints.
MOONCAKE_ERRORS = {
    -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
}
OBJECT_NOT_FOUND = -704
CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"  # our own 'code' for a page that arrived but fails its trailer
TIMEOUT = "TIMEOUT"  # our own 'code' for a call that did not return in time


def error_name(code: int | str) -> str:
    """'-704 OBJECT_NOT_FOUND' for a Mooncake code, the name itself for tiergram's own codes."""
    if isinstance(code, str):
        return code
    return f"{code} {MOONCAKE_ERRORS.get(code, 'UNKNOWN')}"


def manifest_key(name: str) -> str:
    """The key of a table's manifest object (the commit marker)."""
    return f"{KEY_PREFIX}/{name}/manifest"


def page_key(name: str, page: int) -> str:
    """The key of one page object."""
    return f"{KEY_PREFIX}/{name}/p{page}"


def parse_uri(uri: str, *, allow_no_master: bool = False) -> tuple[str, str]:
    """('HOST:PORT', name) of 'mooncake://HOST:PORT/NAME' ('mooncake:///NAME' when allow_no_master: a client
    is at hand); ValueError names what is wrong."""
    if not uri.startswith(URI_SCHEME):
        raise ValueError(f"{uri!r} is not a Mooncake table URI (expected mooncake://HOST:PORT/NAME)")
    rest = uri[len(URI_SCHEME):]
    master, _, name = rest.partition("/")
    if master or not allow_no_master:
        check_master(master)
    if not name or "/" in name:
        raise ValueError(f"{uri!r}: the table name must be one non-empty path segment")
    return master, name


def check_master(master: str) -> None:
    """ValueError unless master is HOST:PORT with a port in 1..65535."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master address {master!r} must be HOST:PORT")


def table_uri(master: str, name: str) -> str:
    """'mooncake://HOST:PORT/NAME'."""
    return f"{URI_SCHEME}{master}/{name}"


def _import_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"the mooncake tier needs Mooncake Store: pip install 'tiergram[remote]' "
                          f"(and apt-get install libibverbs1); import failed: {e}") from None
    return MooncakeDistributedStore


def mooncake_bound_s(env: Mapping[str, str] = os.environ) -> float | None:
    """Longest a store call can take before Mooncake itself fails it, by the timeouts in env; None when one is unset
    (then Mooncake's defaults allow a 60-s hang). A hung holder fails after 2 x the TCP timeout (measured)."""
    try:
        tcp = max(float(env["MC_TCP_STATUS_TIMEOUT_SEC"]), float(env["MC_TCP_PROGRESS_TIMEOUT_SEC"]))
        rpc = float(env["MC_RPC_TIMEOUT_MS"]) / 1e3
    except (KeyError, ValueError):
        return None
    return max(2 * tcp, rpc)


_BOUNDS: dict[int, tuple[Any, float | None]] = {}  # id(client) -> (client, its bound): the clients connect() made


def client_bound_s(store: Any) -> float | None:
    """mooncake_bound_s of the environment a client was created in, when `connect` created it; None otherwise."""
    entry = _BOUNDS.get(id(store))
    return entry[1] if entry is not None and entry[0] is store else None


def connect(master: str, *, local_hostname: str = "127.0.0.1", segment_bytes: int = 0,
            buffer_bytes: int = 16 << 20, protocol: str = "tcp", metadata: str = "P2PHANDSHAKE",
            timeout_s: float = 20.0) -> Any:
    """A set-up `MooncakeDistributedStore` client of the master at HOST:PORT.

    segment_bytes is the memory this process lends the store (0: it only reads and writes, holds nothing).
    ConnectionError names the master and Mooncake's code when setup fails, or says it did not answer in time.
    """
    check_master(master)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    host, _, port = master.rpartition(":")
    try:  # setup holds the GIL while it retries an unreachable master for ~90 s: fail fast here instead
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 5.0)).close()
    except OSError as e:
        raise ConnectionError(f"Mooncake master {master} is not reachable: {e}") from None
    store = _import_store()()
    caller = _Caller(timeout_s)
    try:  # an unreachable master makes setup retry for ~90 s
        rc = caller(store.setup, local_hostname, metadata, int(segment_bytes), int(buffer_bytes), protocol, "",
                    master)
    except TimeoutError:
        raise ConnectionError(f"Mooncake master {master} did not answer within {timeout_s:g} s") from None
    finally:
        caller.close()
    if rc != 0:
        raise ConnectionError(f"Mooncake setup against master {master} failed: {error_name(rc)}")
    _BOUNDS[id(store)] = (store, mooncake_bound_s())  # Mooncake read the timeouts at setup
    return store


_CLIENTS: dict[tuple[str, str], list] = {}  # (master, local_hostname) -> [client, tiers using it]
_CLIENTS_LOCK = threading.Lock()


def shared_client(master: str, local_hostname: str = "127.0.0.1") -> Any:
    """This process's client of master, shared by every table read from it (a client costs threads, ports and
    its local buffer); give it back with release_client."""
    key = (master, local_hostname)
    with _CLIENTS_LOCK:
        entry = _CLIENTS.get(key)
        if entry is None:
            entry = _CLIENTS[key] = [connect(master, local_hostname=local_hostname), 0]
        entry[1] += 1
        return entry[0]


def release_client(store: Any) -> None:
    """One user fewer of a shared client; the last one closes it."""
    with _CLIENTS_LOCK:
        for key, entry in list(_CLIENTS.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] == 0:
                    del _CLIENTS[key]
                    _BOUNDS.pop(id(store), None)
                    store.close()
                return


def replicate_config(replicas: int = 1, *, hard_pin: bool = True) -> Any:
    """A ReplicateConfig with `replicas` copies, hard-pinned so the master never evicts a table's pages."""
    from mooncake.store import ReplicateConfig
    cfg = ReplicateConfig()
    cfg.replica_num = int(replicas)
    cfg.with_hard_pin = hard_pin
    return cfg


def lower_thread_priority() -> str:
    """Put the calling thread at the lowest CPU priority the kernel grants it: SCHED_IDLE, else nice 19; returns
    which ("idle", "nice" or "" when neither was allowed). Linux applies both to the thread alone."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return "nice"
    except OSError:
        return ""


class _Caller:
    """Runs store calls on a worker thread so that each returns or fails within `timeout_s` (TimeoutError).

    A call that overruns is abandoned: its worker, a daemon thread (it never holds up interpreter exit), is
    left to finish alone (Mooncake cannot cancel it) and a fresh worker serves the next call. `low_priority`: the
    worker runs at the lowest CPU priority (see MooncakeTier).
    """

    def __init__(self, timeout_s: float, low_priority: bool = False) -> None:
        self.timeout_s = timeout_s
        self.low_priority = low_priority
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._stuck: list[_Worker] = []  # workers still inside an abandoned call

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._worker is None or self._worker.stuck:
                if self._worker is not None:
                    self._stuck.append(self._worker)
                self._worker = _Worker(self.low_priority)
            worker = self._worker
        return worker.run(fn, args, self.timeout_s)

    def priority(self) -> str:
        """The current worker's priority: "idle", "nice", "" (lowering refused), "starting" (no call yet ran) or
        "normal"."""
        worker = self._worker
        return worker.priority if worker is not None and self.low_priority else "normal"

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop the worker; True when no abandoned call is still running after waiting up to wait_s for them (the
        client must not be closed under a running call: Mooncake would free what it is using)."""
        with self._lock:
            if self._worker is not None:
                if self._worker.stuck:
                    self._stuck.append(self._worker)
                self._worker.stop()
                self._worker = None
            stuck = list(self._stuck)
        deadline = time.monotonic() + wait_s
        return all(w.exited.wait(max(0.0, deadline - time.monotonic())) for w in stuck)


class _Worker:
    """One daemon thread running submitted calls in order."""

    def __init__(self, low_priority: bool = False) -> None:
        self.stuck = False
        self.exited = threading.Event()  # set when the thread has left its last call
        self.priority = "starting"  # then what lower_thread_priority got, when low_priority
        self._low_priority = low_priority
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="tiergram-mooncake", daemon=True).start()

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        done = threading.Event()
        box: list[Any] = []
        self._jobs.put((fn, args, box, done))
        if not done.wait(timeout_s):
            self.stuck = True
            self._jobs.put(None)  # the thread exits once the stuck call returns
            raise TimeoutError(f"the Mooncake call did not return within {timeout_s:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        if self._low_priority:
            self.priority = lower_thread_priority()
        while (job := self._jobs.get()) is not None:
            fn, args, box, done = job
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()
        self.exited.set()


def fetch_manifest(store: Any, name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Any, int]:
    """(TableManifest, data_offset) of the table `name` in the store; FileNotFoundError when it is not there."""
    return parse_manifest_blob(fetch_manifest_blob(store, name, timeout_s=timeout_s), f"mooncake:{name}")


def fetch_manifest_blob(store: Any, name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
    """The manifest object of the table `name` in the store, as stored; FileNotFoundError when it is not there."""
    caller = _Caller(timeout_s)
    try:
        key = manifest_key(name)
        try:
            size = caller(store.get_size, key)
        except TimeoutError:
            raise TimeoutError(f"Mooncake did not answer for {key} within {timeout_s:g} s") from None
        if size == OBJECT_NOT_FOUND or size == 0:
            raise FileNotFoundError(f"Mooncake holds no table {name!r} (no {key}; push it with "
                                    f"`tiergram table push`)")
        if size < 0:
            raise ConnectionError(f"Mooncake could not size {key}: {error_name(size)}")
        blob = caller(store.get, key)
    finally:
        caller.close()
    return bytes(blob)


def page_digest(table: TableFile) -> bytes:
    """SHA-256 of every page's trailer (its index and CRC-32C) in page order: the pages' contents in 32 bytes."""
    m = table.manifest
    digest = hashlib.sha256()
    pages = np.memmap(table.path, np.uint8, "r", offset=table.data_offset, shape=(m.n_pages, m.page_size))
    for lo in range(0, m.n_pages, DIGEST_CHUNK_PAGES):
        digest.update(np.ascontiguousarray(pages[lo:lo + DIGEST_CHUNK_PAGES, -PAGE_TRAILER_BYTES:]).tobytes())
    return digest.digest()


def manifest_blob(table: TableFile) -> bytes:
    """The manifest object of a table: its file size (u64 LE), the file's bytes up to data_offset, its
    page_digest."""
    with open(table.path, "rb") as f:
        head = f.read(table.data_offset)
    return struct.pack("<Q", table.data_offset + table.manifest.data_bytes) + head + page_digest(table)


def describe_blob(blob: bytes) -> str:
    """'N bytes, pages digest HEX' of a manifest object (what tells two tables of one manifest apart)."""
    try:
        _, data_offset = parse_manifest_blob(blob, "manifest object")
    except TableFormatError:
        return f"a {len(blob)}-byte object that is no table's manifest"
    digest = blob[8 + data_offset:]
    return f"{struct.unpack_from('<Q', blob)[0]} bytes, pages digest {digest.hex()[:16] if digest else 'none'}"


def parse_manifest_blob(blob: bytes, where: str) -> tuple[Any, int]:
    """(TableManifest, data_offset) of a manifest object, with every check a table file gets at open."""
    if len(blob) < 8:
        raise TableFormatError(f"{where}: manifest object of {len(blob)} bytes is too short")
    (file_bytes,) = struct.unpack_from("<Q", blob)
    fd = os.memfd_create("tiergram-manifest")
    try:
        os.write(fd, blob[8:])
        manifest, data_offset = unpack_header(fd, where, file_bytes)
    finally:
        os.close(fd)
    if len(blob) - 8 - data_offset not in (0, DIGEST_BYTES):  # (a push before the digest has none)
        raise TableFormatError(f"{where}: manifest object holds {len(blob) - 8} header bytes, data_offset "
                               f"says {data_offset}")
    return manifest, data_offset


@dataclass
class RemoteCounters:
    """Running totals of one mooncake tier's reads."""

    rows: int = 0
    calls: int = 0  # batch_get_into calls
    inline_calls: int = 0  # of them, made on the caller's thread (no worker hop)
    pages_read: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    errors: int = 0  # pages that failed (after the retry), whether or not a fallback served them
    checksum_failures: int = 0
    retries: int = 0
    fallback_pages: int = 0  # pages the local fallback file served
    latencies: deque = field(default_factory=lambda: deque(maxlen=4096))  # seconds per call, the latest


class MooncakeTier:
    """Rows of a table held in Mooncake Store, one object per page; offers the FileTier interface.

    `fallback`: a local copy of the same table file; pages Mooncake cannot serve are read from it (counted in
    stats as fallback_pages) instead of raising.

    A store call of at most `inline_max_keys` keys runs on the caller's thread when the client's own timeouts
    (`client_bound_s`, set by `connect`) fail it within `timeout_s`: a worker-thread hop costs about as much as a
    one-page read over loopback. Larger calls, and every call of a client whose timeouts are unknown, run on a
    worker thread abandoned after `timeout_s`.

    `low_priority_waits`: Mooncake's client (the PyPI wheel, built without its event-driven completion) spins on
    a CPU until a batch's transfers complete, tens of ms for a large batch. With True every store call runs on the
    worker thread at the lowest CPU priority (SCHED_IDLE, else nice 19), so that spin only takes CPU time nothing
    else wants: a server's model keeps its cores while a prefetch waits, and the waiter runs once the model itself
    waits for the rows.
    """

    name = "mooncake"

    def __init__(self, store: Any, table_name: str, *, manifest: Any, data_offset: int, master: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S, fallback: str | os.PathLike | None = None,
                 owns_store: bool = False, inline_max_keys: int = INLINE_MAX_KEYS,
                 low_priority_waits: bool = False) -> None:
        self.store = store
        self.table_name = table_name
        self.master = master
        self.manifest = m = manifest
        self.table = TableFile(Path(table_uri(master, table_name) if master else table_name), m, data_offset)
        self.head_offsets = self.table.head_offsets
        self.head_rows = self.table.head_rows
        self.timeout_s = timeout_s
        self.counters = RemoteCounters()
        self._owns_store = owns_store
        self._prefix = f"{KEY_PREFIX}/{table_name}/p"
        self._lock = threading.Lock()
        # each thread's registered staging buffer, by thread id: the native pipeline's C++ threads call read_pages
        # with a Python thread state made afresh for each call, which a threading.local would not outlive
        self._staging: dict[int, np.ndarray] = {}
        self._registered: list[np.ndarray] = []  # every staging buffer registered with the store
        # (time, buffer) a failed or abandoned transfer may still write into: reused only after ABANDON_GRACE_S
        self._abandoned: list[tuple[float, np.ndarray]] = []
        self._caller = _Caller(timeout_s, low_priority=low_priority_waits)
        bound = client_bound_s(store)
        inline = bound is not None and bound < timeout_s and not low_priority_waits
        self.inline_max_keys = inline_max_keys if inline else 0
        self.fallback: FileTier | None = None
        if fallback is not None:
            local = TableFile.open(fallback)
            if local.manifest != m:
                raise ValueError(f"fallback {fallback} is not the table {table_name!r}: manifests differ")
            self.fallback = FileTier(local, mode="buffered")
        # the native fetch pipeline reads through this: one call of read_pages per batch of missed pages (dedup,
        # cache, admission, decode and the sharing of rows in flight stay native); it adds rows and pages into
        # native_counts, which stats() leaves out: the remote counters count pages and bytes at the store call
        self.reader = _native.CallbackPageSource(self.read_pages, m.page_size, m.n_pages)
        self.native_counts = np.zeros(2, dtype=np.int64)

    @classmethod
    def open(cls, uri: str, *, local_hostname: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S,
             fallback: str | os.PathLike | None = None, store: Any = None,
             inline_max_keys: int = INLINE_MAX_KEYS, low_priority_waits: bool = False) -> MooncakeTier:
        """Open 'mooncake://HOST:PORT/NAME' (connecting a client unless `store` is given: then the master may be
        left out, 'mooncake:///NAME')."""
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
                   fallback=fallback, owns_store=owns, inline_max_keys=inline_max_keys,
                   low_priority_waits=low_priority_waits)

    @property
    def backend(self) -> str:
        return "mooncake"

    def check_ids(self, ids: np.ndarray) -> None:
        """IndexError naming head and id for any id of int64 [N, H] outside its head."""
        _native.check_ids(ids, self.head_rows)

    def read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(source buffer, int64 byte offsets [n], pages read) for the encoded global rows [n] (ids checked).

        The buffer is this thread's registered staging buffer: decode from it before this thread's next call.
        """
        m = self.manifest
        rows = np.asarray(rows, dtype=np.int64)
        page_of_row, slot_in_page = np.divmod(rows, m.rows_per_page)
        pages, which = np.unique(page_of_row, return_inverse=True)
        buf = self.read_pages(pages)
        with self._lock:
            self.counters.rows += rows.size
        return buf, which.reshape(-1) * m.page_size + slot_in_page * m.row_bytes, int(pages.size)

    # the same dedup + one read_rows + decode as the file tier: it needs only check_ids, read_rows and the geometry
    gather = FileTier.gather

    def read_pages(self, pages: np.ndarray) -> np.ndarray:
        """The verified pages int64 [M] (distinct) as uint8 [M * page_size], page i at i * page_size."""
        ps = self.manifest.page_size
        pages = np.asarray(pages, dtype=np.int64)
        buf = self.staging(pages.size * ps)
        failed: dict[int, int | str] = {}  # position in pages -> code
        for lo in range(0, pages.size, MAX_KEYS_PER_CALL):
            failed.update(self._get(pages, lo, min(lo + MAX_KEYS_PER_CALL, pages.size), buf))
        retry = [i for i, code in failed.items() if code in (CHECKSUM_MISMATCH, -703)]
        if retry and threading.get_ident() in self._staging:
            # one more try for a page that may come right (a transient fault, a bit flipped in flight), unless a
            # transfer may still write into this buffer (it was abandoned) or the call timed out
            with self._lock:
                self.counters.retries += len(retry)
            again = self._get_positions(pages, sorted(retry), buf)
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

    def stats(self) -> dict:
        """Remote reads: calls, pages, bytes, seconds, latency p50/p99 (ms) of the recent calls, faults."""
        with self._lock:
            c = self.counters
            lat = np.asarray(c.latencies, dtype=np.float64)
            return {"master": self.master, "table": self.table_name, "calls": c.calls, "inline_calls": c.inline_calls,
                    "waiter_priority": self._caller.priority(),
                    "pages_read": c.pages_read,
                    "bytes_read": c.bytes_read, "seconds": c.seconds,
                    "latency_ms_p50": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
                    "latency_ms_p99": float(np.percentile(lat, 99) * 1e3) if lat.size else None,
                    "errors": c.errors, "checksum_failures": c.checksum_failures, "retries": c.retries,
                    "fallback_pages": c.fallback_pages}

    def close(self) -> None:
        """Unregister the staging buffers, close the fallback and (when this tier made it) the client.

        A call abandoned after timeout_s may still be running inside Mooncake: close waits for it up to the client's
        own bound, and if it is still running leaves the client open (closing it under the call could crash)."""
        self.reader.close()  # later native reads raise; lets go of read_pages (and this tier)
        bound = client_bound_s(self.store)
        if not self._caller.close(wait_s=bound + 1.0 if bound is not None else self.timeout_s):
            self._owns_store = False  # never released: the shared client stays open for the process's life
        for buf in self._registered:
            if not any(buf is a for _, a in self._abandoned):
                try:
                    self.store.unregister_buffer(buf.ctypes.data)
                except Exception:  # noqa: BLE001 - a dead client cannot unregister; the process frees the memory
                    pass
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

    # -- internals -------------------------------------------------------------------------------------

    def _get(self, pages: np.ndarray, lo: int, hi: int, buf: np.ndarray) -> dict[int, int | str]:
        """Fetch pages[lo:hi] into their slots of buf and verify them; {position: code} of the failures."""
        return self._get_positions(pages, list(range(lo, hi)), buf)

    def _get_positions(self, pages: np.ndarray, positions: Sequence[int], buf: np.ndarray) -> dict[int, int | str]:
        ps = self.manifest.page_size
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            return {}
        keys = [f"{self._prefix}{p}" for p in pages[pos].tolist()]
        ptrs = (buf.ctypes.data + pos * ps).tolist()
        inline = len(keys) <= self.inline_max_keys
        t0 = time.perf_counter()
        try:
            if inline:  # bounded by Mooncake's own timeouts (client_bound_s < timeout_s)
                codes = self.store.batch_get_into(keys, ptrs, [ps] * len(keys))
            else:
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
        # Every page that arrived is checked in one native call over the span of positions (a retry's positions
        # are scattered: the span's other pages are checked again, harmlessly, and ignored).
        lo, hi = int(pos.min()), int(pos.max()) + 1
        bad = _native.verify_pages(buf[lo * ps:hi * ps], ps, np.ascontiguousarray(pages[lo:hi]))
        corrupt = 0
        if bad:
            asked = np.zeros(hi - lo, dtype=bool)
            asked[pos - lo] = True
            for k in np.flatnonzero(np.isin(pages[lo:hi], bad) & asked).tolist():
                if lo + k not in failed:
                    failed[lo + k] = CHECKSUM_MISMATCH
                    corrupt += 1
        ok_pages = pos.size - len(failed)
        with self._lock:
            c = self.counters
            c.calls += 1
            c.inline_calls += inline
            c.pages_read += ok_pages
            c.bytes_read += ok_pages * ps
            c.checksum_failures += corrupt
            c.seconds += dt
            c.latencies.append(dt)
        return failed

    def _from_fallback(self, pages: np.ndarray, positions: list[int], buf: np.ndarray) -> None:
        assert self.fallback is not None and self.fallback.reader is not None
        ps = self.manifest.page_size
        want = pages[positions]
        tmp = aligned_empty(want.size * ps)
        self.fallback.reader.read_pages(np.ascontiguousarray(want), tmp)  # verified; raises PageReadError itself
        for k, i in enumerate(positions):
            buf[i * ps:(i + 1) * ps] = tmp[k * ps:(k + 1) * ps]
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
                self._release(old)
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

    def _release(self, buf: np.ndarray) -> None:
        with self._lock:
            self._registered = [b for b in self._registered if b is not buf]
        self.store.unregister_buffer(buf.ctypes.data)

    def _abandon(self, buf: np.ndarray) -> None:
        """Never hand this thread's staging buffer out again: a transfer may still be writing into it."""
        staging = self._staging.pop(threading.get_ident(), None)
        if staging is not None:
            with self._lock:
                self._abandoned.append((time.monotonic(), staging))


def push_table(path: str | os.PathLike, master: str, name: str | None = None, *, replace: bool = False,
               replicas: int = 1, progress: bool = True, store: Any = None,
               timeout_s: float = 60.0) -> str:
    """Put a table file into Mooncake Store as `name` (default: the file's stem); returns its URI.

    Each page is verified before it is sent. The data objects go first and the manifest object last, as the
    commit marker: a reader never sees a half-written table. An existing copy is refused (FileExistsError)
    unless replace=True, which removes its marker first, then its pages.
    """
    table = TableFile.open(path)
    m = table.manifest
    name = name or Path(path).stem
    if "/" in name or not name:
        raise ValueError(f"table name {name!r} must be one non-empty path segment")
    owns = store is None
    if store is None:
        store = connect(master)
    caller = _Caller(timeout_s)
    try:
        mk = manifest_key(name)
        exists = caller(store.is_exist, mk)
        if exists < 0:
            raise ConnectionError(f"Mooncake could not check {mk}: {error_name(exists)}")
        if exists == 1:
            if not replace:
                raise FileExistsError(f"Mooncake at {master} already holds table {name!r} "
                                      f"(pass --replace to overwrite it)")
            old, _ = fetch_manifest(store, name, timeout_s=timeout_s)
            rc = caller(store.remove, mk, True)  # the marker goes first: readers stop opening the old copy
            if rc not in (0, OBJECT_NOT_FOUND):
                raise ConnectionError(f"could not remove {mk}: {error_name(rc)}")
            _remove_pages(store, caller, name, old.n_pages)
        # pages left by an interrupted push (no marker) would make every put fail with OBJECT_ALREADY_EXISTS
        _remove_pages(store, caller, name, m.n_pages)
        _put_pages(store, caller, table, name, replicas, progress)
        rc = caller(store.put, mk, manifest_blob(table), replicate_config(replicas))
        if rc != 0:
            _remove_pages(store, caller, name, m.n_pages)
            raise ConnectionError(f"could not write {mk}: {error_name(rc)}")
    finally:
        caller.close()
        if owns:
            store.close()
    return table_uri(master, name)


def pushed_name(path: str | os.PathLike, blob: bytes) -> str:
    """The name ensure_pushed gives table file `path` of manifest object `blob`: its stem and a digest of the
    object, its size and modification time (a re-exported table gets a new name instead of the old copy)."""
    st = Path(path).stat()
    return f"{Path(path).stem}-{hashlib.sha256(blob + f'{st.st_size}:{st.st_mtime_ns}'.encode()).hexdigest()[:12]}"


def ensure_pushed(path: str | os.PathLike, master: str, *, progress: bool = False) -> str:
    """The URI of table file `path` in the store at master, pushing it first when the store lacks it.

    A table already stored under its name (pushed_name) is reused only when its manifest object -- size, header,
    pages digest -- equals the file's; ValueError names both otherwise (anyone who can write to the store can put
    a table under a name that is easy to guess). Push before starting several engines on one table: two first
    pushes of the same name at once would race.
    """
    table = TableFile.open(path)
    local = manifest_blob(table)
    name = pushed_name(path, local)
    store = shared_client(master)  # the table opened next reuses it
    try:
        try:
            stored = fetch_manifest_blob(store, name)
        except FileNotFoundError:
            push_table(path, master, name, progress=progress, store=store)
        else:
            if stored != local:
                raise ValueError(f"Mooncake at {master} holds table {name!r} ({describe_blob(stored)}), which is not "
                                 f"{path} ({describe_blob(local)}): not reused; replace it with `tiergram table push "
                                 f"{path} --master {master} --name {name} --replace`")
    finally:
        release_client(store)
    return table_uri(master, name)


def remove_table(store: Any, name: str, *, timeout_s: float = 60.0) -> bool:
    """Remove table `name` (marker first, then pages); False when it was not there."""
    caller = _Caller(timeout_s)
    try:
        try:
            manifest, _ = fetch_manifest(store, name, timeout_s=timeout_s)
        except FileNotFoundError:
            return False
        caller(store.remove, manifest_key(name), True)
        _remove_pages(store, caller, name, manifest.n_pages)
        return True
    finally:
        caller.close()


def table_keys(name: str, n_pages: int) -> list[str]:
    """Every key of a table: the manifest first, then the pages."""
    return [manifest_key(name)] + [page_key(name, p) for p in range(n_pages)]


def _remove_pages(store: Any, caller: _Caller, name: str, n_pages: int) -> None:
    for lo in range(0, n_pages, MAX_KEYS_PER_CALL):
        keys = [page_key(name, p) for p in range(lo, min(lo + MAX_KEYS_PER_CALL, n_pages))]
        codes = caller(store.batch_remove, keys, True)
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            raise ConnectionError(f"could not remove {bad[0][0]}: {error_name(bad[0][1])}")


def _put_pages(store: Any, caller: _Caller, table: TableFile, name: str, replicas: int, progress: bool) -> None:
    m = table.manifest
    ps = m.page_size
    buf = aligned_empty(PUSH_CHUNK_PAGES * ps)
    rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise ConnectionError(f"could not register the push buffer: {error_name(rc)}")
    cfg = replicate_config(replicas)
    try:
        with open(table.path, "rb", buffering=0) as f, tqdm(total=m.n_pages, unit="page", unit_scale=True,
                                                             disable=not progress, desc=f"pushing {name}") as bar:
            f.seek(table.data_offset)
            for p0 in range(0, m.n_pages, PUSH_CHUNK_PAGES):
                n = min(PUSH_CHUNK_PAGES, m.n_pages - p0)
                chunk = buf[: n * ps]
                if f.readinto(memoryview(chunk)) != chunk.size:
                    raise TableFormatError(f"{table.path}: short read at page {p0}")
                bad = _native.verify_pages(chunk, ps, p0)
                if bad:
                    raise TableFormatError(f"{table.path}: page {bad[0]} fails its checksum; not pushed")
                keys = [page_key(name, p) for p in range(p0, p0 + n)]
                codes = caller(store.batch_put_from, keys, [buf.ctypes.data + i * ps for i in range(n)],
                               [ps] * n, cfg)
                failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
                if failed:
                    _remove_pages(store, caller, name, m.n_pages)
                    raise ConnectionError(f"could not write {failed[0][0]} ({len(failed)} page(s) failed): "
                                          f"Mooncake {error_name(failed[0][1])}")
                bar.update(n)
    finally:
        store.unregister_buffer(buf.ctypes.data)
