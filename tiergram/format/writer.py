"""Writing table files crash-safely: temp file, page trailers, fsync, rename, fsync the directory."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tiergram import _native
from tiergram.format.header import pack_header
from tiergram.format.manifest import TableManifest

# Produces the encoded rows [start, start + n) of the global row space: uint8 [n, row_bytes].
RowSource = Callable[[int, int], np.ndarray]

_CHUNK_PAGES = 4096  # 16 MiB per write with 4 KiB pages


def write_table(path: str | os.PathLike, manifest: TableManifest, rows: RowSource, *,
                progress: bool = True) -> Path:
    """Write a table file whose rows come from `rows(start, n)`; the file appears whole or not at all."""
    path = Path(path)
    head, data_offset = pack_header(manifest)
    ps, rpp, rb = manifest.page_size, manifest.rows_per_page, manifest.row_bytes
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, head)
        bar = tqdm(total=manifest.total_rows, unit="row", unit_scale=True, disable=not progress,
                   desc=f"writing {path.name}")
        for p0 in range(0, manifest.n_pages, _CHUNK_PAGES):
            n_pages = min(_CHUNK_PAGES, manifest.n_pages - p0)
            g0 = p0 * rpp
            n_rows = min(n_pages * rpp, manifest.total_rows - g0)
            encoded = np.asarray(rows(g0, n_rows))
            if encoded.dtype != np.uint8 or encoded.shape != (n_rows, rb):
                raise ValueError(f"row source returned {encoded.dtype} {encoded.shape} for rows "
                                 f"{g0}..{g0 + n_rows - 1}, expected uint8 ({n_rows}, {rb})")
            pages = np.zeros((n_pages, ps), dtype=np.uint8)
            # [n_pages, rpp, rb] only splits the last axis, so it stays a view of `pages`; flattening the
            # page and row axes together would silently copy (pages are ps bytes apart, not rpp * rb)
            slots = pages[:, : rpp * rb].reshape(n_pages, rpp, rb)
            full, rest = divmod(n_rows, rpp)
            slots[:full] = encoded[: full * rpp].reshape(full, rpp, rb)
            if rest:
                slots[full, :rest] = encoded[full * rpp:]
            _native.seal_pages(pages.reshape(-1), ps, p0)
            _write_all(fd, pages.data)
            bar.update(n_rows)
        bar.close()
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


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]
