"""Host tier: a whole table in host memory, optionally one read-only /dev/shm copy shared by processes."""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import shutil
from pathlib import Path

import numpy as np
import torch

from tiergram import _native
from tiergram.format import TableFile

SHM_DIR = Path("/dev/shm")


class HostTier:
    """Every row of one table in DRAM; gathers and dequantises in the native core."""

    name = "host"

    def __init__(self, table: TableFile, *, shared: bool = False, progress: bool = False) -> None:
        self.table = table
        self.manifest = table.manifest
        self.head_offsets = table.head_offsets
        self.head_rows = table.head_rows
        self.shm_path: Path | None = None
        self._mmap: mmap.mmap | None = None
        if shared:
            self.shm_path = _shared_copy(table, progress=progress)
            self.data = self._map_shared(self.shm_path)
        else:
            self.data = table.read_data(progress=progress)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the table occupies."""
        return int(self.data.nbytes)

    def check_ids(self, ids: np.ndarray) -> None:
        """IndexError naming head and id for any id of int64 [N, H] outside its head."""
        _native.check_ids(ids, self.head_rows)

    def gather(self, ids: np.ndarray | torch.Tensor, out: np.ndarray | torch.Tensor) -> None:
        """Rows of ids int64 [N, H] into out [N, H, D] float32/bfloat16, or uint8 [N, H, row_bytes] raw."""
        m = self.manifest
        _native.gather(self.data, ids, self.head_offsets, self.head_rows, m.page_size, m.rows_per_page,
                       m.codec_id, m.dim, out)

    def _map_shared(self, path: Path) -> np.ndarray:
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        start = self.table.data_offset
        return np.frombuffer(self._mmap, dtype=np.uint8, count=self.manifest.data_bytes, offset=start)

    def close(self) -> None:
        """Drop this process's mapping (the /dev/shm file stays for other processes)."""
        self.data = np.empty(0, dtype=np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it does
                pass
            self._mmap = None


def shared_name(table: TableFile) -> str:
    """The /dev/shm file name for a table: the same source file gives the same name in every process."""
    st = table.path.resolve().stat()
    key = f"{table.path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return f"tiergram-{table.path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.tgram"


def _shared_copy(table: TableFile, *, progress: bool) -> Path:
    """The verified /dev/shm copy of `table`, made once (temp file + rename) and reused by later processes."""
    if not SHM_DIR.is_dir():
        raise OSError(f"{SHM_DIR} does not exist; shared host tables need a tmpfs there")
    dst = SHM_DIR / shared_name(table)
    if dst.exists():
        TableFile.open(dst)  # header, manifest and size still sound
        return dst
    need = table.data_offset + table.manifest.data_bytes
    free = shutil.disk_usage(SHM_DIR).free
    if free < need:
        raise OSError(f"{SHM_DIR} has {free} bytes free, the table {table.path} needs {need}")
    tmp = dst.with_name(f"{dst.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.truncate(need)
        with open(tmp, "r+b") as f:
            mm = mmap.mmap(f.fileno(), need)
            try:
                with open(table.path, "rb") as src:
                    mm[: table.data_offset] = src.read(table.data_offset)
                view = np.frombuffer(mm, dtype=np.uint8, count=table.manifest.data_bytes, offset=table.data_offset)
                table.read_data(view, progress=progress)
                del view  # the mapping cannot close while a view exports it
            finally:
                try:
                    mm.close()
                except BufferError:  # a failed read's traceback still holds the view: the error must win
                    pass
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst
