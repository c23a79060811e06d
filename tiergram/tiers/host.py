"""Host tier: a whole table in host memory, optionally one read-only /dev/shm copy shared by processes."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
import shutil
import stat
from pathlib import Path

import numpy as np
import torch

from tiergram import _native
from tiergram.format import TableFile
from tiergram.tiers.base import TableTier

SHM_DIR = Path("/dev/shm")


class HostTier(TableTier):
    """Every row of one table in DRAM; gathers and dequantises in the native core."""

    name = "host"

    def __init__(self, table: TableFile, *, shared: bool = False, progress: bool = False) -> None:
        super().__init__(table)
        self.shm_path: Path | None = None
        self.reader = None  # rows are gathered in memory: the native fetch pipeline has no pages to read here
        self.native_counts = np.zeros(2, dtype=np.int64)
        self._mmap: mmap.mmap | None = None
        self._private: mmap.mmap | None = None
        if shared:
            self.shm_path = _shared_copy(table, progress=progress)
            fd = os.open(self.shm_path, os.O_RDONLY | os.O_NOFOLLOW)  # the copy just verified, not a link put there
            try:
                self._mmap = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            _advise_huge(self._mmap, 0, len(self._mmap))  # tmpfs gives them only where shmem_enabled allows
            self.data = np.frombuffer(self._mmap, dtype=np.uint8, count=table.manifest.data_bytes,
                                      offset=table.data_offset)
        else:
            self._private, buf = huge_page_buffer(self.manifest.data_bytes)
            self.data = table.read_data(buf, progress=progress)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the table occupies."""
        return int(self.data.nbytes)

    def stats(self) -> dict[str, object]:
        """Where the rows live: bytes, shared or private, and how many sit on transparent huge pages."""
        huge = huge_page_bytes(self.data.ctypes.data, self.data.nbytes) if self.data.nbytes else 0
        return {"bytes": self.nbytes, "shared": self.shm_path is not None, "huge_page_bytes": huge,
                "huge_pages": huge >= self.nbytes // 2 and huge > 0, "thp": thp_mode(shared=self.shm_path is not None)}

    def gather(self, ids: np.ndarray, out: np.ndarray | torch.Tensor) -> tuple[np.ndarray, int]:
        """Rows of ids int64 [N, H] into out [N, H, D] or uint8 [N, H, row_bytes]; (global rows read, 0 pages)."""
        m = self.manifest
        if isinstance(out, torch.Tensor) and out.device.type == "cpu":
            # a numpy view crosses into the native call ~4 us faster than a tensor through DLPack (the whole
            # call for one position is ~9 us); bf16 goes as its uint16 bits, which the native gather accepts
            out = (out.view(torch.uint16) if out.dtype == torch.bfloat16 else out).numpy()
        _native.gather(self.data, ids, self.head_offsets, self.head_rows, m.page_size, m.rows_per_page,
                       m.codec_id, m.dim, out)
        return (ids + self.head_offsets).reshape(-1), 0

    def close(self) -> None:
        """Drop this process's mapping (the /dev/shm file stays for other processes)."""
        self.data = np.empty(0, dtype=np.uint8)
        for mapping in (self._private, self._mmap):
            if mapping is not None:
                with contextlib.suppress(BufferError):  # a caller still holds a view; the memory goes when it does
                    mapping.close()
        self._private = self._mmap = None


HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size


def huge_page_buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """(mapping, zeroed uint8 [nbytes] view) on a 2 MiB boundary, advised MADV_HUGEPAGE before first touch."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to slide the start to a boundary
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(mm, dtype=np.uint8)
    start = -base.ctypes.data % HUGE_PAGE
    _advise_huge(mm, start, size - start)
    view = base[start:start + nbytes]
    del base
    return mm, view


def _advise_huge(mm: mmap.mmap, start: int, length: int) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or length <= 0:
        return
    with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages, as before
        mm.madvise(advice, start, length)


def thp_mode(*, shared: bool = False) -> str:
    """The kernel's transparent huge page mode for anonymous (or, shared=True, tmpfs) memory, e.g. 'madvise'."""
    name = "shmem_enabled" if shared else "enabled"
    try:
        text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
    except OSError:
        return "unavailable"
    chosen = [w for w in text.split() if w.startswith("[")]
    return chosen[0].strip("[]") if chosen else text.strip()


def huge_page_bytes(address: int, length: int) -> int:
    """Bytes of [address, address + length) on huge pages, by /proc/self/smaps (capped at length)."""
    end, total, inside = address + length, 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    inside = lo < end and hi > address
                elif inside and first in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return min(total, length)


SHM_PREFIX = "tiergram-"


def shared_name(table: TableFile) -> str:
    """The /dev/shm file name of a table, the same in every process of a user (whose id it holds)."""
    st = table.path.resolve().stat()
    key = f"{table.path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return f"{SHM_PREFIX}{os.getuid()}-{table.path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.tgram"


def shared_copies(directory: Path = SHM_DIR) -> list[Path]:
    """This user's shared table copies (and leftover temporary files) in `directory`, owned by this user."""
    if not directory.is_dir():
        return []
    mine = f"{SHM_PREFIX}{os.getuid()}-"
    out = []
    for entry in sorted(directory.iterdir()):
        try:
            if entry.name.startswith(mine) and entry.lstat().st_uid == os.getuid():
                out.append(entry)
        except FileNotFoundError:  # removed meanwhile
            continue
    return out


def remove_shared_copies(directory: Path = SHM_DIR) -> list[Path]:
    """Remove this user's shared copies; a process still mapping one keeps its mapping until it exits."""
    removed = shared_copies(directory)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def _open_verified(dst: Path, table: TableFile, need: int) -> bool:
    """Whether dst is a sound private copy of `table` to reuse (size, header, every page); a bad one is removed."""
    try:
        fd = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as e:  # a symlink planted under our name (ELOOP), or not ours to open
        raise OSError(f"{dst} exists but cannot be used as a shared table copy ({e}); remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{dst} is not a private file of this user (mode {st.st_mode & 0o7777:o}, uid "
                          f"{st.st_uid}); refusing to use it as a shared table copy")
        sound = st.st_size == need
        if sound:
            with open(table.path, "rb") as src:
                sound = os.pread(fd, table.data_offset, 0) == src.read(table.data_offset)
        if sound:
            mm = mmap.mmap(fd, need, prot=mmap.PROT_READ)
            try:
                view = np.frombuffer(mm, dtype=np.uint8, count=table.manifest.data_bytes, offset=table.data_offset)
                sound = not _native.verify_pages(view, table.manifest.page_size, 0)
                del view
            finally:
                mm.close()
    finally:
        os.close(fd)
    if not sound:  # e.g. left half-written by a process killed mid-copy before the rename, or since damaged
        dst.unlink(missing_ok=True)
    return sound


def _shared_copy(table: TableFile, *, progress: bool) -> Path:
    """The verified /dev/shm copy of `table`, made once (owner-only temp file + rename) and reused after a check."""
    if not SHM_DIR.is_dir():
        raise OSError(f"{SHM_DIR} does not exist; shared host tables need a tmpfs there")
    dst = SHM_DIR / shared_name(table)
    need = table.data_offset + table.manifest.data_bytes
    if _open_verified(dst, table, need):
        return dst
    free = shutil.disk_usage(SHM_DIR).free
    if free < need:
        raise OSError(f"{SHM_DIR} has {free} bytes free, the table {table.path} needs {need}")
    tmp = dst.with_name(f"{dst.name}.tmp-{secrets.token_hex(4)}")
    try:
        # O_EXCL | O_NOFOLLOW: never write through a file or link someone else put there; 0600: only this user
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+b") as f:
            f.truncate(need)
            mm = mmap.mmap(f.fileno(), need)
            try:
                with open(table.path, "rb") as src:
                    mm[: table.data_offset] = src.read(table.data_offset)
                view = np.frombuffer(mm, dtype=np.uint8, count=table.manifest.data_bytes, offset=table.data_offset)
                table.read_data(view, progress=progress)
                del view  # the mapping cannot close while a view exports it
            finally:
                with contextlib.suppress(BufferError):  # a failed read's traceback still holds the view: the error wins
                    mm.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst
