"""Opening table files: header and manifest checks, page verification, reading the data region."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tiergram import _native
from tiergram.format.header import unpack_header
from tiergram.format.manifest import TableFormatError, TableManifest

_CHUNK_PAGES = 4096


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
            out = np.empty(m.data_bytes, dtype=np.uint8)
        if out.dtype != np.uint8 or out.size != m.data_bytes:
            raise ValueError(f"buffer must be uint8 [{m.data_bytes}], got {out.dtype} [{out.size}]")
        ps = m.page_size
        bad, missing = self._scan(lambda p0, n: out[p0 * ps:(p0 + n) * ps], "loading", progress)
        if missing is not None:
            raise TableFormatError(f"{self.path}: short read at page {missing}")
        if bad:
            raise TableFormatError(f"{self.path}: {len(bad)} corrupt page(s), checksum mismatch at "
                                   f"page {_page_list(bad)}")
        return out

    def verify(self, *, progress: bool = False) -> list[int]:
        """Check every page's trailer; returns the indices of bad pages (empty when sound)."""
        m = self.manifest
        buf = np.empty(_CHUNK_PAGES * m.page_size, dtype=np.uint8)
        bad, missing = self._scan(lambda p0, n: buf[: n * m.page_size], "verifying", progress)
        if missing is not None:  # the file shrank since open: every page from there on is bad
            bad += range(missing, m.n_pages)
        return sorted(bad)

    def _scan(self, buffer_for: Callable[[int, int], np.ndarray], verb: str,
              progress: bool) -> tuple[list[int], int | None]:
        """Read the data region a chunk at a time into buffer_for(first page, pages) and verify every page:
        (bad page indices, first page the file ended before — None when it holds them all)."""
        m = self.manifest
        bad: list[int] = []
        with open(self.path, "rb", buffering=0) as f, tqdm(
                total=m.n_pages, unit="page", unit_scale=True, disable=not progress,
                desc=f"{verb} {self.path.name}") as bar:
            f.seek(self.data_offset)
            for p0 in range(0, m.n_pages, _CHUNK_PAGES):
                n = min(_CHUNK_PAGES, m.n_pages - p0)
                chunk = buffer_for(p0, n)
                got = _read_fully(f, chunk)
                whole = got // m.page_size
                bad += _native.verify_pages(chunk[: whole * m.page_size], m.page_size, p0)
                bar.update(n)
                if got < chunk.size:
                    return bad, p0 + whole
        return bad, None


def _read_fully(f, buf: np.ndarray) -> int:
    """readinto until buf is full or the file ends; returns the bytes read."""
    view = memoryview(buf)
    got = 0
    while got < buf.size:
        more = f.readinto(view[got:])
        if not more:
            break
        got += more
    return got


def _page_list(pages: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(p) for p in pages[:limit])
    return shown + (f", ... ({len(pages) - limit} more)" if len(pages) > limit else "")
