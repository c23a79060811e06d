"""The mooncake tier: pure parts here, and tests/remote_checks.py run against a real Mooncake cluster inside a
private network namespace (`unshare -n`, only loopback up), since Mooncake's clients listen on every interface."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from tiergram.bench.remote import LocalCluster, private_netns, run_in_netns
from tiergram.format import TableFile, TableFormatError, TableManifest, create_table, random_values
from tiergram.tiers.mooncake import (
    _Caller,
    error_name,
    lower_thread_priority,
    manifest_blob,
    parse_manifest_blob,
    parse_uri,
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
    caller = _Caller(5.0, low_priority=True)
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
    normal = _Caller(5.0)
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
