"""Opening table files: header and manifest checks, page verification, reading the data region."""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tiergram import _native
from tiergram.format.header import unpack_header
from tiergram.format.manifest import TableFormatError, TableManifest
from tiergram.format.writer import _CHUNK_BYTES, _DIRECT_ALIGN, aligned_pages, open_direct

_CHUNK_PAGES: int | None = None  # pages per read; None: the writer's chunk size in bytes (tests set small values)


@dataclass(frozen=True)
class TableFile:
    """An opened, header-checked table file. Pages are checked when read, not at open."""

    path: Path
    manifest: TableManifest
    data_offset: int

    @classmethod
    def open(cls, path: str | os.PathLike) -> TableFile:
        """Open and check header, manifest and size; TableFormatError names the file and the problem."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such table file") from None
        try:
            size = os.fstat(fd).st_size
            manifest, data_offset = unpack_header(fd, str(path), size)
        finally:
            os.close(fd)
        return cls(path, manifest, data_offset)

    @property
    def head_offsets(self) -> np.ndarray:
        """int64 [H] first global row of each head."""
        return np.asarray(self.manifest.head_offsets, dtype=np.int64)

    @property
    def head_rows(self) -> np.ndarray:
        """int64 [H] rows of each head."""
        return np.asarray(self.manifest.head_rows, dtype=np.int64)

    def read_data(self, out: np.ndarray | None = None, *, progress: bool = False) -> np.ndarray:
        """Read and verify every page into uint8 [n_pages * page_size]; TableFormatError lists bad pages."""
        m = self.manifest
        if out is None:
            out = aligned_pages(m.data_bytes)  # page-aligned: the reads go straight in with O_DIRECT
        if out.dtype != np.uint8 or out.size != m.data_bytes:
            raise ValueError(f"buffer must be uint8 [{m.data_bytes}], got {out.dtype} [{out.size}]")
        bad, missing = self._scan(out, "loading", progress)
        if missing is not None:
            raise TableFormatError(f"{self.path}: short read at page {missing}")
        if bad:
            more = f", ... ({len(bad) - 20} more)" if len(bad) > 20 else ""
            raise TableFormatError(f"{self.path}: {len(bad)} corrupt page(s), checksum mismatch at "
                                   f"page {', '.join(map(str, bad[:20]))}{more}")
        return out

    def verify(self, *, progress: bool = False) -> list[int]:
        """Check every page's trailer; returns the indices of bad pages (empty when sound)."""
        m = self.manifest
        bad, missing = self._scan(None, "verifying", progress)
        if missing is not None:  # the file shrank since open: every page from there on is bad
            bad += range(missing, m.n_pages)
        return sorted(bad)

    def scan(self, on_chunk: Callable[[int, np.ndarray, list[int]], None], *, verb: str = "scanning",
             progress: bool = False, chunk_bytes: int | None = None) -> None:
        """Read and verify every page in order, handing each chunk to on_chunk(first page, uint8 [n * page_size], bad
        pages) (buffer reused after the call; three of `chunk_bytes`); TableFormatError when the file ends early."""
        _, missing = self._scan(None, verb, progress, on_chunk, chunk_bytes)
        if missing is not None:
            raise TableFormatError(f"{self.path}: short read at page {missing}")

    def _scan(self, out: np.ndarray | None, verb: str, progress: bool,
              on_chunk: Callable[[int, np.ndarray, list[int]], None] | None = None,
              chunk_bytes: int | None = None) -> tuple[list[int], int | None]:
        """Read the data region by chunks (into `out`, else recycled buffers) while this thread verifies the last one:
        (bad pages, first page the file ended before or None); `on_chunk` sees each verified chunk."""
        m = self.manifest
        ps = m.page_size
        per = _CHUNK_PAGES or max(1, (chunk_bytes or _CHUNK_BYTES) // ps)
        chunks = [(p0, min(per, m.n_pages - p0)) for p0 in range(0, m.n_pages, per)]
        pool: queue.Queue | None = None
        if out is None:
            pool = queue.Queue()
            for _ in range(min(3, len(chunks))):
                pool.put(aligned_pages(min(per, m.n_pages) * ps))
        done: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()
        fd = os.open(self.path, os.O_RDONLY)
        direct_fd = -1
        if ps % _DIRECT_ALIGN == 0 and self.data_offset % _DIRECT_ALIGN == 0:
            direct_fd = os.open(self.path, os.O_RDONLY)
            if not open_direct(direct_fd):
                os.close(direct_fd)
                direct_fd = -1

        def reader() -> None:
            try:
                for p0, n in chunks:
                    if stop.is_set():
                        return
                    buf = pool.get()[: n * ps] if pool is not None else out[p0 * ps:(p0 + n) * ps]
                    aligned = buf.ctypes.data % _DIRECT_ALIGN == 0
                    use = direct_fd if direct_fd >= 0 and aligned else fd
                    got = _pread_fully(use, buf, self.data_offset + p0 * ps, fd)
                    done.put((p0, n, buf, got, None))
                    if got < buf.size:
                        return
            except BaseException as e:  # handed to the checking thread
                done.put((0, 0, None, 0, e))

        thread = threading.Thread(target=reader, name="tiergram-table-reader", daemon=True)
        bad: list[int] = []
        try:
            with tqdm(total=m.data_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                      desc=f"{verb} {self.path.name}", miniters=1) as bar:
                thread.start()
                for _ in chunks:
                    p0, n, buf, got, err = done.get()
                    if err is not None:
                        raise err
                    whole = got // ps
                    chunk_bad = _native.verify_pages(buf[: whole * ps], ps, p0)
                    bad += chunk_bad
                    if on_chunk is not None:
                        on_chunk(p0, buf[: whole * ps], chunk_bad)
                    if pool is not None:
                        pool.put(buf.base if buf.base is not None else buf)
                    bar.update(n * ps)
                    if got < buf.size:
                        return bad, p0 + whole
        finally:
            stop.set()
            if pool is not None:  # a reader waiting for a buffer must see the stop
                pool.put(aligned_pages(min(per, m.n_pages) * ps))
            while thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    done.get(timeout=0.05)
            os.close(fd)
            if direct_fd >= 0:
                os.close(direct_fd)
        return bad, None


def _pread_fully(fd: int, buf: np.ndarray, offset: int, fallback_fd: int) -> int:
    """pread until buf is full or the file ends (bytes read); an O_DIRECT read refused is redone buffered."""
    view = memoryview(buf).cast("B")
    got = 0
    while got < buf.size:
        try:
            more = os.preadv(fd, [view[got:]], offset + got)
        except OSError as e:
            if fd == fallback_fd or e.errno != errno.EINVAL:
                raise
            fd = fallback_fd
            continue
        if not more:
            break
        got += more
    return got

