"""Mooncake Store access: URIs and keys, error codes, the ref-counted client, bounded calls, manifest objects."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tiergram.format import TableFormatError
from tiergram.format.header import unpack_header

URI_SCHEME = "mooncake://"
KEY_PREFIX = "tiergram"
DEFAULT_TIMEOUT_S = 10.0  # a dead master blocks a call ~4.3 s before Mooncake answers -900
MAX_KEYS_PER_CALL = 4096  # keys per batch call (bounds one call's time and its buffer)
DIGEST_BYTES = 32  # the page digest ending a manifest object (SHA-256 of every page's trailer)
# Set (unless set) before a client is created: the first two keep a batch of over ~1,024 keys from wedging the client;
# the last three make Mooncake fail a call to a hung holder (-800, after 2 x the TCP timeout) or master (-901) with
# its own code before the tier's timeout_s abandons it (measured, 0.3.13; docs/remote.md).
ENV_DEFAULTS = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
                "MC_TCP_STATUS_TIMEOUT_SEC": "3", "MC_TCP_PROGRESS_TIMEOUT_SEC": "3", "MC_RPC_TIMEOUT_MS": "5000"}
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
    """('HOST:PORT', name) of 'mooncake://HOST:PORT/NAME' ('mooncake:///NAME' too when allow_no_master)."""
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


def mooncake_bound_s(env: Mapping[str, str] = os.environ) -> float | None:
    """Longest a store call can take before Mooncake fails it, by the timeouts in env (None: one is unset)."""
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


def connect(master: str, *, local_hostname: str = "127.0.0.1", buffer_bytes: int = 16 << 20,
            timeout_s: float = 20.0) -> Any:
    """A set-up `MooncakeDistributedStore` client of the master at HOST:PORT; ConnectionError says why not."""
    check_master(master)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    host, _, port = master.rpartition(":")
    try:  # setup holds the GIL while it retries an unreachable master for ~90 s: fail fast here instead
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 5.0)).close()
    except OSError as e:
        raise ConnectionError(f"Mooncake master {master} is not reachable: {e}") from None
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"the mooncake tier needs Mooncake Store: pip install 'tiergram[remote]' "
                          f"(and apt-get install libibverbs1); import failed: {e}") from None
    store = MooncakeDistributedStore()
    caller = Caller(timeout_s)
    try:  # an unreachable master makes setup retry for ~90 s; segment 0: this client lends the store nothing
        rc = caller(store.setup, local_hostname, "P2PHANDSHAKE", 0, int(buffer_bytes), "tcp", "", master)
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
    """This process's client of master, shared by its tables; give it back with release_client."""
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


def replicate_config(replicas: int = 1) -> Any:
    """A ReplicateConfig with `replicas` copies, hard-pinned so the master never evicts a table's pages."""
    from mooncake.store import ReplicateConfig
    cfg = ReplicateConfig()
    cfg.replica_num = int(replicas)
    cfg.with_hard_pin = True
    return cfg


def lower_thread_priority() -> str:
    """Put the calling thread at SCHED_IDLE, else nice 19; returns "idle", "nice" or "" (neither allowed)."""
    tid = threading.get_native_id()
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return "nice"
    except OSError:
        return ""


class Caller:
    """Runs store calls on a daemon worker, each within `timeout_s` (TimeoutError); an overrun one is left behind."""

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
        """The worker's priority: "idle", "nice", "" (refused), "starting" (no call yet) or "normal"."""
        worker = self._worker
        return worker.priority if worker is not None and self.low_priority else "normal"

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop the worker; True when no abandoned call still runs after waiting up to wait_s for them."""
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
    caller = Caller(timeout_s)
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
