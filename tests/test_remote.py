"""The mooncake tier: pure parts here, and tests/remote_checks.py run against a real Mooncake cluster inside a
private network namespace (`unshare -n`, only loopback up), since Mooncake's clients listen on every interface."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from tiergram.bench.mooncake_cluster import LocalCluster, private_netns, run_in_netns
from tiergram.format import TableFile, TableFormatError, TableManifest, create_table, random_values
from tiergram.tiers import mooncake
from tiergram.tiers.mooncake import (
    Caller,
    error_name,
    lower_thread_priority,
    manifest_blob,
    manifest_key,
    page_digest,
    parse_manifest_blob,
    parse_uri,
    pushed_name,
)

HERE = Path(__file__).parent


def test_uri_parsing_names_the_problem():
    assert parse_uri("mooncake://127.0.0.1:50051/layer1") == ("127.0.0.1:50051", "layer1")
    for bad in ("layer1.tgram", "mooncake://127.0.0.1/x", "mooncake://127.0.0.1:50051/", "mooncake://h:1/a/b",
                "mooncake://h:99999/a"):
        with pytest.raises(ValueError):
            parse_uri(bad)


def test_a_low_priority_worker_runs_at_sched_idle_and_leaves_the_caller_alone():
    """The waiter for Mooncake's busy-polling calls: its own thread goes to SCHED_IDLE (else nice 19), the calling
    thread keeps its policy, and calls still return their values and raise their errors."""
    before = os.sched_getscheduler(0)
    caller = Caller(5.0, low_priority=True)
    try:
        policy = caller(lambda: os.sched_getscheduler(threading.get_native_id()))
        nice = caller(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert caller.priority() in ("idle", "nice")
        assert policy == os.SCHED_IDLE if caller.priority() == "idle" else nice == 19
        with pytest.raises(ZeroDivisionError):
            caller(lambda: 1 / 0)
    finally:
        caller.close()
    assert os.sched_getscheduler(0) == before
    normal = Caller(5.0)
    try:
        assert normal(lambda: os.sched_getscheduler(threading.get_native_id())) == before
        assert normal.priority() == "normal"
    finally:
        normal.close()
    result = []
    t = threading.Thread(target=lambda: result.append(lower_thread_priority()))
    t.start()
    t.join()
    assert result[0] in ("idle", "nice", "")


def test_error_names():
    assert error_name(-704) == "-704 OBJECT_NOT_FOUND"
    assert error_name(-900) == "-900 RPC_FAIL"
    assert error_name(-12345) == "-12345 UNKNOWN"


def test_manifest_object_round_trips_and_is_checked(tmp_path):
    m = TableManifest(codec="int8", dim=32, head_rows=(100, 7))
    path = create_table(tmp_path / "t.tgram", m, random_values(32, seed=0), progress=False)
    blob = manifest_blob(TableFile.open(path))
    assert parse_manifest_blob(blob, "mooncake:t") == (m, TableFile.open(path).data_offset)
    bad = bytearray(blob)
    bad[40] ^= 1
    with pytest.raises(TableFormatError, match="mooncake:t"):
        parse_manifest_blob(bytes(bad), "mooncake:t")
    with pytest.raises(TableFormatError, match="too short"):
        parse_manifest_blob(b"abc", "mooncake:t")


def test_the_manifest_object_ends_with_a_digest_of_the_pages(tmp_path):
    """Two tables of one manifest (same geometry, other values) differ in their manifest objects; an object pushed
    before the digest (none at its end) still opens."""
    m = TableManifest(codec="int8", dim=32, head_rows=(100, 7))
    a = TableFile.open(create_table(tmp_path / "a.tgram", m, random_values(32, seed=0), progress=False))
    b = TableFile.open(create_table(tmp_path / "b.tgram", m, random_values(32, seed=1), progress=False))
    blob_a, blob_b = manifest_blob(a), manifest_blob(b)
    assert blob_a[-32:] == page_digest(a) and page_digest(a) != page_digest(b) and blob_a[:-32] == blob_b[:-32]
    assert parse_manifest_blob(blob_a[:-32], "old") == parse_manifest_blob(blob_a, "new") == (m, a.data_offset)
    with pytest.raises(TableFormatError, match="header bytes"):
        parse_manifest_blob(blob_a + b"x", "mooncake:a")


class FakeStore:
    """The two calls fetch_manifest_blob makes, over a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def get_size(self, key: str) -> int:
        return len(self.objects[key]) if key in self.objects else -704

    def get(self, key: str) -> bytes:
        return self.objects[key]


def test_a_stored_table_is_reused_only_when_it_is_the_local_one(tmp_path, monkeypatch):
    """ensure_pushed finds a table under the name it would give the file: the same manifest object is reused, a
    foreign one (same geometry, other rows) is refused naming both, before any row is served."""
    m = TableManifest(codec="int8", dim=32, head_rows=(100, 7))
    ours = create_table(tmp_path / "layer.tgram", m, random_values(32, seed=0), progress=False)
    foreign = create_table(tmp_path / "other.tgram", m, random_values(32, seed=1), progress=False)
    store, pushes = FakeStore(), []
    monkeypatch.setattr(mooncake.push, "shared_client", lambda master: store)
    monkeypatch.setattr(mooncake.push, "release_client", lambda s: None)

    def push(path, master, name, *, progress, store):
        pushes.append(name)
        store.objects[manifest_key(name)] = manifest_blob(TableFile.open(path))

    monkeypatch.setattr(mooncake.push, "push_table", push)
    name = pushed_name(ours, manifest_blob(TableFile.open(ours)))
    store.objects[manifest_key(name)] = manifest_blob(TableFile.open(foreign))
    with pytest.raises(ValueError, match=rf"holds table '{name}' \(\d+ bytes, pages digest "
                                         rf"{page_digest(TableFile.open(foreign)).hex()[:16]}\), which is not "
                                         rf".*layer.tgram \(\d+ bytes, pages digest "
                                         rf"{page_digest(TableFile.open(ours)).hex()[:16]}\)"):
        mooncake.ensure_pushed(ours, "127.0.0.1:1")
    store.objects[manifest_key(name)] = b"\0" * 40
    with pytest.raises(ValueError, match="no table's manifest"):
        mooncake.ensure_pushed(ours, "127.0.0.1:1")
    del store.objects[manifest_key(name)]
    assert mooncake.ensure_pushed(ours, "127.0.0.1:1") == f"mooncake://127.0.0.1:1/{name}" and pushes == [name]
    assert mooncake.ensure_pushed(ours, "127.0.0.1:1") == f"mooncake://127.0.0.1:1/{name}" and pushes == [name]


def test_a_cluster_refuses_to_start_on_a_shared_network(tmp_path):
    if private_netns():
        pytest.fail("this check runs outside a private network namespace")
    with pytest.raises(RuntimeError, match="private network namespace"):
        LocalCluster(tmp_path)


def test_remote_checks_in_a_private_network_namespace():
    """tests/remote_checks.py against real master and holder processes (killed by pid in its fixtures)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the remote tests need Mooncake: pip install -e '.[remote]' and apt-get install libibverbs1 ({e})")
    r = run_in_netns([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                      str(HERE / "remote_checks.py")], capture=True, timeout=600)
    summary = "\n".join(line for line in r.stdout.splitlines() if not line.startswith(("I1", "W1", "E1")))
    assert r.returncode == 0, f"remote checks failed (exit {r.returncode}):\n{summary[-8000:]}\n{r.stderr[-4000:]}"
    assert " passed" in summary and "skipped" not in summary


def test_mooncake_placement_needs_a_master():
    from tiergram.engine.config import Placement

    assert Placement("mooncake", master="127.0.0.1:50051", cache_bytes=4096).cache_bytes == 4096
    with pytest.raises(ValueError, match="needs master"):
        Placement("mooncake")
    with pytest.raises(ValueError, match="needs master"):
        Placement("file", master="127.0.0.1:50051")
