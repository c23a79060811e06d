"""`_native.set_num_threads` while other threads gather: the old pool lives until the gathers on it return."""

from __future__ import annotations

import threading

import numpy as np

from tiergram import _native


def test_set_num_threads_while_gathers_run():
    rows, dim = 4096, 64
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    src = data.view(np.uint8).reshape(-1)
    offsets = (np.arange(rows, dtype=np.int64) * 4 * dim)[::-1].copy()
    want = data[::-1]
    errors: list[BaseException] = []
    stop = threading.Event()
    before = _native.num_threads()

    def gather() -> None:
        out = np.empty((rows, dim), dtype=np.float32)
        try:
            while not stop.is_set():
                _native.decode_at(src, offsets, 0, dim, out)  # codec 0: fp32
                assert np.array_equal(out, want)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=gather) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(200):  # each swap drops a pool that a gather may still be running on
            _native.set_num_threads(1 + i % 3)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        _native.set_num_threads(before)
    assert not errors, errors[0]
    assert _native.num_threads() == before


def thread_names() -> set[str]:
    import os

    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            pass
    return names


def test_threads_carry_names(tmp_path):
    """The OS shows what each native thread is (top -H, perf); a name the OS cannot take is refused."""
    import pytest

    from tiergram.format import TableManifest, create_table, matrix_values
    from tiergram.store import TieredTable

    got: list[str] = []

    def named() -> None:
        _native.name_thread("tiergram-test")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            got.append(f.read().strip())

    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert got == ["tiergram-test"]
    with pytest.raises(ValueError, match="1-15 characters, got 16"):
        _native.name_thread("x" * 16)
    path = tmp_path / "t.tgram"
    create_table(path, TableManifest(codec="fp32", dim=8, head_rows=(64,), page_size=512),
                 matrix_values(np.ones((64, 8), np.float32)), progress=False)
    with TieredTable(path, tier="file", cache_bytes=1024) as table:
        table.prefetch(np.array([[1], [2]])).wait()
        assert "tiergram-fetch" in thread_names()
