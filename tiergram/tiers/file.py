"""File tier: rows read from the table file on demand — O_DIRECT batched page reads, or mmap as a baseline."""

from __future__ import annotations

import contextlib
import mmap
import threading

import numpy as np

from tiergram import _native
from tiergram.format import TableFile
from tiergram.tiers.aligned import aligned_empty
from tiergram.tiers.base import PageTier

FILE_MODES = ("direct", "buffered", "mmap")
# Staging a reading thread keeps between calls (4,096 pages of 4 KiB: a 170-position x 24-head lookup that misses
# everything); larger reads get a buffer of their own. The native pipeline keeps the same (pipeline.cpp).
STAGING_KEEP_BYTES = 16 << 20


class FileTier(PageTier):
    """Rows straight from the table file, one batched verified read per lookup: mode 'direct' (O_DIRECT; `mode`
    says 'buffered' where refused), 'buffered', or 'mmap' (page faults, unverified: the baseline other engines use)."""

    name = "file"

    def __init__(self, table: TableFile, *, mode: str = "direct", queue_depth: int = 128,
                 backend: str = "auto") -> None:
        if mode not in FILE_MODES:
            raise ValueError(f"unknown file mode {mode!r} (valid: {', '.join(FILE_MODES)})")
        super().__init__(table)
        m = self.manifest
        self.requested_mode = mode
        self.native_counts = np.zeros(2, dtype=np.int64)  # rows, pages: the native fetch pipeline adds here
        self._local = threading.local()  # per-thread staging buffer for page reads
        self._mmap: mmap.mmap | None = None
        self.reader = None
        if mode == "mmap":
            with open(table.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            self._mmap.madvise(mmap.MADV_RANDOM)
            self.data = np.frombuffer(self._mmap, dtype=np.uint8, count=m.data_bytes, offset=table.data_offset)
        else:
            self.reader = _native.PageReader(str(table.path), table.data_offset, m.page_size, m.n_pages,
                                             queue_depth=queue_depth, backend=backend, direct=mode == "direct")

    @property
    def mode(self) -> str:
        """The read mode in use: 'direct', 'buffered' (asked for, or O_DIRECT refused) or 'mmap'."""
        if self.requested_mode == "direct" and self.reader is not None and not self.reader.direct:
            return "buffered"
        return self.requested_mode

    @property
    def backend(self) -> str:
        """How pages are read: 'io_uring', 'threads' or 'mmap'."""
        return "mmap" if self.reader is None else self.reader.backend

    def read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """As PageTier.read_rows; mmap: (the mapping, the rows' offsets in it, 0 pages)."""
        if self.reader is not None:
            return super().read_rows(rows)
        page, slot = np.divmod(np.asarray(rows, dtype=np.int64), self.manifest.rows_per_page)
        return self.data, page * self.manifest.page_size + slot * self.manifest.row_bytes, 0

    def read_pages(self, pages: np.ndarray) -> np.ndarray:
        """The pages int64 [M] as uint8 [M * page_size]: verified in staging, or (mmap) copied unverified."""
        if self.reader is None:
            return self.data.reshape(-1, self.manifest.page_size)[pages].reshape(-1)
        buf = self._staging(pages.size * self.manifest.page_size)
        self.reader.read_pages(pages, buf)
        return buf

    def _staging(self, nbytes: int) -> np.ndarray:
        """An aligned buffer of nbytes, reused by this thread up to STAGING_KEEP_BYTES (saves its page faults)."""
        if nbytes > STAGING_KEEP_BYTES:
            return aligned_empty(nbytes)
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.size < nbytes:
            grown = min(STAGING_KEEP_BYTES, 2 * buf.size) if buf is not None else 0
            buf = self._local.staging = aligned_empty(max(nbytes, grown))
        return buf[:nbytes]

    def stats(self) -> dict[str, object]:
        """How pages are read: backend, mode, and the reader's counts of its kinds of reads."""
        out: dict[str, object] = {"backend": self.backend, "file_mode": self.mode}
        if self.reader is not None:
            out.update(registered_buffer_reads=self.reader.fixed_reads,  # into io_uring-registered staging buffers
                       # pages its reader had never read before: a cache under the disk may hold the others
                       pages_first_read=self.reader.first_reads,
                       # reads a stalled io_uring call cancelled and re-read with pread (a lost completion, no error)
                       pages_stalled=self.reader.stalled_reads, buffer_registration_errno=self.reader.buffer_refused)
        return out

    def close(self) -> None:
        """Close the reader or the mapping."""
        if self.reader is not None:
            self.reader.close()
        self.data = np.empty(0, dtype=np.uint8)
        self._local = threading.local()  # this thread's staging buffer goes (the prefetch worker's with it)
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view; the memory goes when it does
                self._mmap.close()
            self._mmap = None
