"""tiergram._native.PageReader: batched O_DIRECT page reads (io_uring and thread-pool backends)."""

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

from tiergram import _native
from tiergram.tiers.aligned import aligned_empty

PS = 4096
OFFSET = 8192


def write_table(path, n_pages, data_offset=OFFSET, page_size=PS, seed=0):
    """A file of `data_offset` filler bytes then `n_pages` random pages with valid trailers."""
    pages = np.random.default_rng(seed).integers(0, 256, n_pages * page_size, dtype=np.uint8)
    _native.seal_pages(pages, page_size, 0)
    with open(path, "wb") as f:
        f.write(b"H" * data_offset)
        f.write(pages.tobytes())
    return pages.reshape(n_pages, page_size)


def uring_available():
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "probe.bin")
        write_table(p, 1)
        with _native.PageReader(p, OFFSET, PS, 1, direct=False) as r:
            return r.backend == "io_uring"


BACKENDS = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here")),
    "threads",
]


# The repository's disk (ext4 here) and, where present, tmpfs (O_DIRECT since Linux 6.6, else buffered).
@pytest.fixture(params=["disk", "tmpfs"])
def table_dir(request, tmp_path):
    if request.param == "disk":
        return tmp_path
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="tiergram-test-")
    request.addfinalizer(lambda: shutil.rmtree(d))
    return d


@pytest.fixture
def table(tmp_path):
    path = str(tmp_path / "table.bin")
    return path, write_table(path, 64)


def read(reader, ids, verify=True, background=False):
    ids = np.asarray(ids, dtype=np.int64)
    out = aligned_empty(len(ids) * reader.page_size)
    reader.read_pages(ids, out, verify=verify, background=background)
    return out.reshape(len(ids), reader.page_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qd", [1, 32, 128])
def test_reads_exact_pages(table_dir, backend, qd):
    path = os.path.join(table_dir, "t.bin")
    pages = write_table(path, 200, seed=qd)
    with _native.PageReader(path, OFFSET, PS, 200, queue_depth=qd, backend=backend) as r:
        assert r.backend == backend and r.queue_depth == qd
        rng = np.random.default_rng(1)
        ids = np.concatenate([rng.integers(0, 200, 300), [5, 5, 5, 0, 199], np.arange(200)])
        np.testing.assert_array_equal(read(r, ids), pages[ids])
        np.testing.assert_array_equal(read(r, [7]), pages[[7]])
        r.read_pages(np.zeros(0, np.int64), aligned_empty(0))  # an empty request is fine


def test_backends_agree(table):
    path, pages = table
    ids = np.random.default_rng(2).integers(0, 64, 500)
    got = []
    for backend in ("auto", "threads"):
        with _native.PageReader(path, OFFSET, PS, 64, queue_depth=16, backend=backend) as r:
            got.append(read(r, ids))
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], pages[ids])


def test_buffered_mode_and_odd_offset(tmp_path):
    path = str(tmp_path / "odd.bin")
    pages = write_table(path, 10, data_offset=100)
    with pytest.raises(ValueError, match="multiple of 512"):
        _native.PageReader(path, 100, PS, 10)
    with _native.PageReader(path, 100, PS, 10, direct=False) as r:
        assert not r.direct
        out = np.empty(3 * PS + 1, np.uint8)[1:]  # misaligned on purpose: fine without O_DIRECT
        r.read_pages(np.array([9, 0, 4], np.int64), out)
        np.testing.assert_array_equal(out.reshape(3, PS), pages[[9, 0, 4]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_checked_before_any_read(table, backend):
    path, _ = table
    with _native.PageReader(path, OFFSET, PS, 64, backend=backend) as r:
        out = aligned_empty(3 * PS)
        out[:] = 0xAB
        for bad in (64, -1, 10**12):
            with pytest.raises(IndexError, match=f"page id {bad} "):
                r.read_pages(np.array([0, 1, bad], np.int64), out)
        assert (out == 0xAB).all()  # nothing was read


def test_argument_errors(table):
    path, _ = table
    with _native.PageReader(path, OFFSET, PS, 64) as r:
        ids = np.array([0, 1], np.int64)
        buf = aligned_empty(2 * PS + 64)
        with pytest.raises(ValueError, match="aligned"):
            r.read_pages(ids, buf[64:])
        with pytest.raises(ValueError, match="expected 2 pages"):
            r.read_pages(ids, buf[:PS])
        for bad_ids in (ids.astype(np.int32), ids.astype(np.float64), np.arange(4)[::2]):
            with pytest.raises(TypeError):  # no silent conversion of ids
                r.read_pages(bad_ids, buf[: 2 * PS])
        for bad_out in (buf[: 2 * PS].view(np.int8), aligned_empty(4 * PS).reshape(2, 2 * PS)[:, :PS]):
            with pytest.raises(TypeError):  # a converted copy would swallow the pages
                r.read_pages(ids, bad_out)
        with pytest.raises(ValueError, match="1-D"):
            r.read_pages(ids.reshape(1, 2), buf[: 2 * PS])
        with pytest.raises(ValueError, match="fault kind"):
            r.inject_fault("melt", 0)
        with pytest.raises(IndexError):
            r.inject_fault("eio", 64)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        _native.PageReader(path + ".missing.bin", OFFSET, PS, 64)
    with pytest.raises(ValueError, match="backend"):
        _native.PageReader(path, OFFSET, PS, 64, backend="aio")
    with pytest.raises(ValueError, match="page_size"):
        _native.PageReader(path, OFFSET, 3000, 64)
    with pytest.raises(ValueError, match="queue_depth"):
        _native.PageReader(path, OFFSET, PS, 64, queue_depth=0)


def test_closed_reader_refuses(table):
    path, _ = table
    r = _native.PageReader(path, OFFSET, PS, 64)
    r.close()
    r.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        read(r, [0])


CAUSES = {"eio": "Input/output error", "short": "short read: got 2048 of 4096 bytes", "flip": "checksum mismatch"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(CAUSES))
def test_injected_fault_retried_once(table, backend, kind):
    path, pages = table
    ids = np.array([1, 30, 2, 30, 63], np.int64)
    with _native.PageReader(path, OFFSET, PS, 64, queue_depth=4, backend=backend) as r:
        r.inject_fault(kind, 2, times=1)
        np.testing.assert_array_equal(read(r, ids), pages[ids])  # the retry hides one failure

        r.inject_fault(kind, 2, times=2)
        with pytest.raises(_native.PageReadError) as e:
            read(r, ids)
        msg = str(e.value)
        assert isinstance(e.value, OSError) and e.value.errno == errno.EIO
        assert path in msg and "page 2 " in msg and CAUSES[kind] in msg

        np.testing.assert_array_equal(read(r, ids), pages[ids])  # faults used up: healthy again
        r.inject_fault(kind, 2, times=5)
        r.clear_faults()
        np.testing.assert_array_equal(read(r, ids), pages[ids])


def test_flip_without_verify_is_delivered(table):
    path, pages = table
    with _native.PageReader(path, OFFSET, PS, 64) as r:
        r.inject_fault("flip", 5)
        got = read(r, [5], verify=False)[0]
        assert (got != pages[5]).sum() == 1
        assert _native.verify_pages(got, PS, 5) == [5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_file_detected(tmp_path, backend):
    path = str(tmp_path / "bad.bin")
    pages = write_table(path, 16)
    with open(path, "r+b") as f:
        f.seek(OFFSET + 11 * PS + 100)
        f.write(bytes([pages[11, 100] ^ 0x01]))
    with _native.PageReader(path, OFFSET, PS, 16, backend=backend) as r:
        np.testing.assert_array_equal(read(r, [10, 12]), pages[[10, 12]])
        with pytest.raises(OSError, match=rf"page 11 of {path} .*checksum mismatch"):
            read(r, [10, 11, 12])
        assert (read(r, [11], verify=False)[0] != pages[11]).sum() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_misdirected_page_detected(tmp_path, backend):
    """A page that is intact but sits at the wrong index fails the trailer's page-index check."""
    path = str(tmp_path / "swap.bin")
    pages = write_table(path, 4)
    with open(path, "r+b") as f:
        f.seek(OFFSET + 3 * PS)
        f.write(pages[1].tobytes())
    with _native.PageReader(path, OFFSET, PS, 4, backend=backend) as r:
        with pytest.raises(OSError, match="page 3 .*checksum mismatch"):
            read(r, [3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_file(tmp_path, backend):
    path = str(tmp_path / "short.bin")
    pages = write_table(path, 8)
    os.truncate(path, OFFSET + 6 * PS + PS // 2)  # page 6 half there, page 7 gone
    with _native.PageReader(path, OFFSET, PS, 8, backend=backend) as r:
        np.testing.assert_array_equal(read(r, [0, 5]), pages[[0, 5]])
        with pytest.raises(OSError, match="page 7 .*short read: got 0 of 4096 bytes"):
            read(r, [0, 7])
        with pytest.raises(OSError, match="page 6 .*short read: got 2048 of 4096 bytes"):
            read(r, [6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_callers(tmp_path, backend):
    """Several threads at once (each call takes a ring of its own)."""
    path = str(tmp_path / "conc.bin")
    pages = write_table(path, 256)
    errors = []
    with _native.PageReader(path, OFFSET, PS, 256, queue_depth=32, backend=backend) as r:

        def worker(seed):
            try:
                rng = np.random.default_rng(seed)
                for _ in range(20):
                    ids = rng.integers(0, 256, int(rng.integers(1, 200)))
                    if not np.array_equal(read(r, ids), pages[ids]):
                        errors.append(f"thread {seed}: wrong bytes")
            except Exception as e:  # reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_aligned_empty():
    assert aligned_empty(0).shape == (0,)
    for n in (1, 4096, 12345):
        a = aligned_empty(n)
        assert a.dtype == np.uint8 and a.shape == (n,) and a.ctypes.data % 4096 == 0
    assert aligned_empty(100, alignment=512).ctypes.data % 512 == 0
    with pytest.raises(ValueError):
        aligned_empty(10, alignment=3000)
    with pytest.raises(ValueError):
        aligned_empty(-1)


# Run in a child: a seccomp filter makes io_uring_setup (syscall 425 on every architecture) fail with
# ENOSYS, as container runtimes' default profiles do; "auto" must fall back to threads and say so once.
SECCOMP_CHILD = r"""
import ctypes, sys
class Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
insns = (Insn * 4)(Insn(0x20, 0, 0, 0), Insn(0x15, 0, 1, 425), Insn(0x06, 0, 0, 0x00050000 | 38),
                   Insn(0x06, 0, 0, 0x7FFF0000))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(Prog(4, insns)), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
import numpy as np
from tiergram import _native
from tiergram.tiers.aligned import aligned_empty
path, n = sys.argv[1], int(sys.argv[2])
for _ in range(2):
    with _native.PageReader(path, 8192, 4096, n) as r:
        out = aligned_empty(2 * 4096)
        r.read_pages(np.array([1, 0], np.int64), out)
        print(r.backend, bytes(out[:4]).hex())
try:
    _native.PageReader(path, 8192, 4096, n, backend="io_uring")
except OSError as e:
    print("refused", e.errno)
"""


def test_io_uring_blocked_falls_back_to_threads(table):
    path, pages = table
    proc = subprocess.run([sys.executable, "-c", SECCOMP_CHILD, path, "64"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first = bytes(pages[1, :4]).hex()
    assert proc.stdout.split("\n")[:3] == [f"threads {first}", f"threads {first}", "refused 38"]
    assert proc.stderr.count("io_uring unavailable") == 1 and "using thread-pool pread" in proc.stderr


@pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here")
@pytest.mark.parametrize("qd", [1, 32])
def test_a_stalled_read_is_cancelled_and_read_again(table, qd):
    """A read the kernel never completes (the 'stall' fault: a real io_uring read of an empty pipe) does not hang the
    call: once no read has completed for stall_timeout_s the ring cancels the reads in flight and the call reads
    them with pread. The ring stays healthy for the next call."""
    path, pages = table
    ids = np.array([1, 30, 2, 30, 63, *range(20)], np.int64)
    with _native.PageReader(path, OFFSET, PS, 64, queue_depth=qd, backend="io_uring", stall_timeout_s=0.5) as r:
        assert r.stall_timeout_s == 0.5
        r.inject_fault("stall", 2, times=1)
        np.testing.assert_array_equal(read(r, ids), pages[ids])
        # at depth 1 the reads queued behind the stalled one were never offered: the call reads those with pread too
        assert r.stalled_reads == (ids.size - 2 if qd == 1 else 1)
        np.testing.assert_array_equal(read(r, ids), pages[ids])
        assert r.stalled_reads == (ids.size - 2 if qd == 1 else 1)  # the fault is spent: nothing stalls

        r.stall_timeout_s = 0.2  # settable; every read of page 5 stalls, each is recovered
        r.inject_fault("stall", 5, times=3)
        before = r.stalled_reads
        for _ in range(3):
            np.testing.assert_array_equal(read(r, [5, 6]), pages[[5, 6]])
        assert r.stalled_reads - before >= 3


def test_stall_timeout_and_fault_errors(table):
    path, _ = table
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="stall_timeout_s must be > 0"):
            _native.PageReader(path, OFFSET, PS, 64, stall_timeout_s=bad)
    with _native.PageReader(path, OFFSET, PS, 64, stall_timeout_s=float("inf")) as r:
        with pytest.raises(ValueError, match="stall_timeout_s must be > 0"):
            r.stall_timeout_s = 0
        assert r.stall_timeout_s == float("inf")
    with _native.PageReader(path, OFFSET, PS, 64, backend="threads") as r:
        with pytest.raises(ValueError, match="'stall' fault needs the io_uring backend"):
            r.inject_fault("stall", 0)


@pytest.mark.skipif(not uring_available(), reason="io_uring unavailable here")
def test_a_background_read_gives_way_to_a_foreground_one(table):
    """While a foreground read is in flight (held there by a stalled read), a background read (a read-ahead) offers
    its reads at yield_depth and counts them in yielded_reads; with no foreground read it does not give way. Every
    page is read right either way."""
    path, pages = table
    # pages the foreground read never touches: the stall injected for it (page 40) must not hit a background read
    # that the main thread starts before the foreground thread gets going
    ids = np.random.default_rng(3).integers(0, 40, 200)
    with _native.PageReader(path, OFFSET, PS, 64, queue_depth=32, backend="io_uring", stall_timeout_s=1.0) as r:
        assert r.yield_depth == 8
        np.testing.assert_array_equal(read(r, ids, background=True), pages[ids])
        assert r.yielded_reads == 0  # nothing to give way to
        r.inject_fault("stall", 40, times=1)
        fg = threading.Thread(target=lambda: read(r, [40, 41]))
        fg.start()
        # background reads while the foreground call's stalled read is in flight (1 s): no sleep to guess when the
        # thread got there -- read until it has given way, or until the foreground call ends
        while True:
            np.testing.assert_array_equal(read(r, ids, background=True), pages[ids])
            if r.yielded_reads > 0 or not fg.is_alive():
                break
        fg.join()
        assert r.yielded_reads > 0

