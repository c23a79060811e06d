"""Writing table files crash-safely at disk speed: temp file, sealed pages, fsync, rename, fsync the directory."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import re
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tiergram import _native
from tiergram.format.header import pack_header
from tiergram.format.manifest import TableManifest

# Produces the encoded rows [start, start + n) of the global row space: uint8 [n, row_bytes].
RowSource = Callable[[int, int], np.ndarray]
# Writes the row bytes of pages [first, first + n) into pages uint8 [n, page_size] (padding and trailers are the
# writer's); a page buffer is reused between chunks, so a filler writes every row byte of every page it is given.
PageFiller = Callable[[np.ndarray, int, int], None]

_CHUNK_PAGES: int | None = None  # pages per write; None: _CHUNK_BYTES worth (tests set small values)
_CHUNK_BYTES = 32 << 20  # large O_DIRECT writes: the disk's sequential rate needs MiBs in flight
_DIRECT_ALIGN = 4096  # O_DIRECT needs block-aligned buffers, offsets and sizes; 4 KiB covers 512 B and 4 KiB disks
# seconds of the last write_pages call: writer idle (filling behind), writing, filler waiting (the disk behind)
LAST_WRITE_STATS: dict[str, float] = {}
_BUFFERS = 4  # one being filled, one being sealed, one being written, one spare so no stage waits on another


def chunk_pages(page_size: int) -> int:
    """Pages per chunk the writer and the reader move at once."""
    return _CHUNK_PAGES or max(1, _CHUNK_BYTES // page_size)


def write_table(path: str | os.PathLike, manifest: TableManifest, rows: RowSource, *,
                progress: bool = True) -> Path:
    """Write a table file whose rows come from `rows(start, n)`; the file appears whole or not at all."""
    rpp, rb = manifest.rows_per_page, manifest.row_bytes

    def fill(pages: np.ndarray, p0: int, n_pages: int) -> None:
        g0 = p0 * rpp
        n_rows = min(n_pages * rpp, manifest.total_rows - g0)
        encoded = np.asarray(rows(g0, n_rows))
        if encoded.dtype != np.uint8 or encoded.shape != (n_rows, rb):
            raise ValueError(f"row source returned {encoded.dtype} {encoded.shape} for rows "
                             f"{g0}..{g0 + n_rows - 1}, expected uint8 ({n_rows}, {rb})")
        # [n_pages, rpp, rb] only splits the last axis, so it stays a view of `pages`; flattening the
        # page and row axes together would silently copy (pages are ps bytes apart, not rpp * rb)
        slots = pages[:, : rpp * rb].reshape(n_pages, rpp, rb)
        full, rest = divmod(n_rows, rpp)
        slots[:full] = encoded[: full * rpp].reshape(full, rpp, rb)
        if rest:
            slots[full, :rest] = encoded[full * rpp:]
            slots[full, rest:] = 0  # the buffer held an earlier chunk's rows there

    return write_pages(path, manifest, fill, progress=progress)


def write_pages(path: str | os.PathLike, manifest: TableManifest, fill: PageFiller, *,
                progress: bool = True) -> Path:
    """Write a table file of pages filled by `fill(pages, first, n)`, whole or not at all (space checked first)."""
    path = Path(path)
    head, data_offset = pack_header(manifest)
    need, free = data_offset + manifest.data_bytes, free_bytes(path.parent)
    if need > free:  # an existing file of that name is replaced only once the new one is whole: its bytes do not help
        raise OSError(errno.ENOSPC, f"{path}: the table needs {need:,} bytes ({_human(need)}) but {path.parent} has "
                                    f"{free:,} bytes ({_human(free)}) free; nothing was written")
    _remove_stale_temps(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with _terminate_as_exit():
            _write_file(fd, manifest, head, fill, progress, path.name)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)  # fails e.g. when `path` is a directory: the temp file must not stay behind
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged writer can still put on the file system holding `directory`."""
    return shutil.disk_usage(directory).free


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _remove_stale_temps(path: Path) -> None:
    """Delete temp files of this name left by writers that were killed (kill -9 cannot clean up after itself)."""
    pattern = re.compile(re.escape(path.name) + r"\.tmp-(\d+)-[0-9a-f]+$")
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            m = pattern.match(entry.name)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit while a table is written from the main thread, so the temp file is removed."""
    def on_term(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread of the main interpreter: not ours to set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def aligned_pages(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned uint8 buffer of nbytes (an anonymous mapping: O_DIRECT can DMA into it)."""
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


def open_direct(fd: int) -> bool:
    """Turn O_DIRECT on for an open file; False where the file system refuses it (tmpfs, some FUSE)."""
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def _write_file(fd: int, manifest: TableManifest, head: bytes, fill: PageFiller, progress: bool,
                name: str) -> None:
    ps, n_pages = manifest.page_size, manifest.n_pages
    per = chunk_pages(ps)
    hb = len(head)  # data_offset: a whole number of pages
    direct = ps % _DIRECT_ALIGN == 0 and hb % _DIRECT_ALIGN == 0 and open_direct(fd)
    # The header shares the first chunk's buffer and write, so that every write starts at a multiple of the chunk
    # size in the file: requests misaligned by the header's 4 KiB would straddle the device's request boundaries.
    lead = max(0, per - hb // ps) if direct and hb < per * ps else 0  # pages in the first chunk, behind the header
    size = max(hb + min(lead, n_pages) * ps, min(per, n_pages) * ps)
    starts = ([0] if lead else []) + list(range(min(lead, n_pages) if lead else 0, n_pages, per))
    bufs = [aligned_pages(size) for _ in range(min(_BUFFERS, len(starts) + 1))]
    if not lead:  # a header longer than a chunk: written on its own
        first = aligned_pages(hb)
        first[:] = np.frombuffer(head, dtype=np.uint8)
        _write_all(fd, first, direct, 0)
    free: queue.Queue = queue.Queue()
    for b in bufs:
        free.put(b)
    sealing: queue.Queue = queue.Queue(maxsize=len(bufs))
    todo: queue.Queue = queue.Queue(maxsize=len(bufs))
    failed: list[BaseException] = []

    def sealer() -> None:  # page trailers (CRC-32C, native, GIL released) while the next chunk is filled
        while True:
            item = sealing.get()
            if item is None:
                todo.put(None)
                return
            buf, lo, hi, p0, offset = item
            try:
                if not failed:
                    _native.seal_pages(buf[lo:hi], ps, p0)
            except BaseException as e:  # reported to the filling thread
                failed.append(e)
            todo.put((buf, lo, hi, offset))

    waits = {"writer_idle_s": 0.0, "write_s": 0.0, "fill_wait_s": 0.0}

    def writer() -> None:
        while True:
            t0 = time.perf_counter()
            item = todo.get()
            t1 = time.perf_counter()
            waits["writer_idle_s"] += t1 - t0
            if item is None:
                return
            buf, lo, hi, offset = item
            try:
                if not failed:
                    _write_all(fd, buf[:hi] if offset == 0 else buf[lo:hi], direct, 0 if offset == 0 else offset)
                waits["write_s"] += time.perf_counter() - t1
                if offset == 0 and lo:
                    buf[:lo] = 0  # the header's bytes: the buffer goes back to holding pages, whose padding is zero
            except BaseException as e:  # reported to the filling thread
                failed.append(e)
            free.put(buf)

    threads = [threading.Thread(target=sealer, name="tiergram-table-sealer", daemon=True),
               threading.Thread(target=writer, name="tiergram-table-writer", daemon=True)]
    for t in threads:
        t.start()
    bar = tqdm(total=manifest.data_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               desc=f"writing {name}", miniters=1)
    try:
        for i, p0 in enumerate(starts):
            first = lead and i == 0
            n = min(lead if first else per, n_pages - p0)
            t0 = time.perf_counter()
            buf = free.get()
            waits["fill_wait_s"] += time.perf_counter() - t0
            if failed:
                raise failed[0]
            lo = hb if first else 0
            if first:
                buf[:hb] = np.frombuffer(head, dtype=np.uint8)
            fill(buf[lo:lo + n * ps].reshape(n, ps), p0, n)
            sealing.put((buf, lo, lo + n * ps, p0, 0 if first else hb + p0 * ps))
            bar.update(n * ps)
    finally:
        sealing.put(None)
        for t in threads:
            t.join()
        bar.close()
        LAST_WRITE_STATS.clear()
        LAST_WRITE_STATS.update(waits, direct=float(direct))
    if failed:
        raise failed[0]


def _write_all(fd: int, data: np.ndarray, direct: bool, offset: int) -> None:
    """pwrite all of `data` at offset; an O_DIRECT write the file system refuses is done buffered instead."""
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            direct = False
            continue
        view = view[n:]
        offset += n
