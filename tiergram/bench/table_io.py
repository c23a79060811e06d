"""`tiergram bench table`: creating, verifying and opening a large table against this disk's sequential limits.

The limits (plain O_DIRECT writes of random bytes and of zeros, as `dd` writes, and a plain O_DIRECT read of the
table) are measured before and after the operations, every byte written for real (docs/benchmarks.md, "Opening,
creating and verifying large tables").
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tiergram.format import TableFile, TableManifest, create_random_table
from tiergram.format.writer import LAST_WRITE_STATS, aligned_pages, free_bytes
from tiergram.model.init_model import CODEC, GEOMETRIES, PAGE_SIZE

BLOCK = 32 << 20  # bytes per O_DIRECT request of the limits, as the table writer and reader use


def _sequential(desc: str, nbytes: int, step: Callable[[int], int], progress: bool) -> tuple[int, float]:
    """(bytes done, seconds) of step(offset) -> bytes it moved, called from offset 0 until nbytes (or it moves none)."""
    done, t0 = 0, time.perf_counter()
    with tqdm(total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress, desc=desc) as bar:
        while done < nbytes and (n := step(done)) > 0:
            done += n
            bar.update(n)
    return done, time.perf_counter() - t0


def disk_write_limit(directory: Path, nbytes: int, *, zeros: bool = False, progress: bool = False) -> float:
    """Bytes/s of a plain O_DIRECT write of nbytes of random bytes (or zeros) in 32 MiB requests, fsync, removed."""
    path = directory / f".tiergram-disk-limit-{os.getpid()}"
    buf = aligned_pages(BLOCK)
    if not zeros:
        buf[:] = np.frombuffer(np.random.default_rng(0).bytes(BLOCK), dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        t0 = time.perf_counter()
        _sequential(f"disk write limit ({'zeros' if zeros else 'random'})", nbytes,
                    lambda at: os.pwrite(fd, memoryview(buf)[:min(BLOCK, nbytes - at)], at), progress)
        os.fsync(fd)
        return nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def disk_read_limit(path: Path, *, progress: bool = False) -> float:
    """Bytes/s of a plain O_DIRECT sequential read of the whole file (32 MiB requests, nothing checked)."""
    buf = aligned_pages(BLOCK)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        done, seconds = _sequential("disk read limit", path.stat().st_size, lambda at: os.preadv(fd, [buf], at),
                                    progress)
        return done / seconds
    finally:
        os.close(fd)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(table_gib: float, directory: Path, *, progress: bool = True, keep: bool = False) -> dict[str, Any]:
    """Measure create / verify / open of a V4.1-geometry table of table_gib GiB in directory."""
    from tiergram.store import TieredTable

    geo = GEOMETRIES["deepseek-v4.1"]
    rows = geo.rows_per_head(int(table_gib * 2**30)) * geo.n_layers  # one file holding both layers' bytes
    m = TableManifest(codec=CODEC, dim=geo.dim, head_rows=(rows,) * geo.n_heads, page_size=PAGE_SIZE, layer_id=1,
                      provenance={"tool": "tiergram bench table"})
    size = m.encode()[1] + m.data_bytes
    directory.mkdir(parents=True, exist_ok=True)
    if 2 * size > free_bytes(directory):  # the table and the zeros file of the write limit
        raise OSError(f"{directory}: bench table needs {2 * size:,} bytes free (the table and the write limit's "
                      f"file), the disk has {free_bytes(directory):,}")
    path = directory / f"bench-table-{table_gib:g}g.tgram"
    try:
        z0 = disk_write_limit(directory, size, zeros=True, progress=progress)
        w0 = disk_write_limit(directory, size, progress=progress)
        t0, c0 = time.perf_counter(), time.process_time()
        create_random_table(path, m, progress=progress)
        create, create_cpu = size / (time.perf_counter() - t0), time.process_time() - c0
        waits = dict(LAST_WRITE_STATS)
        r0 = disk_read_limit(path, progress=progress)
        t0, c0 = time.perf_counter(), time.process_time()
        bad = TableFile.open(path).verify(progress=progress)
        verify, verify_cpu = m.data_bytes / (time.perf_counter() - t0), time.process_time() - c0
        if bad:
            raise RuntimeError(f"{path}: freshly written table has bad pages {bad[:10]}")
        rss0, rchar0 = _rss(), _rchar()
        t0 = time.perf_counter()
        table = TieredTable(path, tier="file")
        open_s = time.perf_counter() - t0
        open_read, open_rss = _rchar() - rchar0, _rss() - rss0
        ids = np.zeros((1, m.n_heads), dtype=np.int64)
        table.lookup(ids)  # it serves
        table.close()
        w1 = disk_write_limit(directory, size, progress=progress)
        z1 = disk_write_limit(directory, size, zeros=True, progress=progress)
        r1 = disk_read_limit(path, progress=progress)
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    gib = size / 2**30
    return {"table_bytes": size, "zeros_limit": (z0 + z1) / 2, "write_limit_before": w0, "write_limit_after": w1,
            "read_limit_before": r0, "read_limit_after": r1, "create": create, "verify": verify,  # bytes/s
            "create_ratio": create / ((w0 + w1) / 2), "verify_ratio": verify / ((r0 + r1) / 2),
            "create_cpu_s_per_gib": create_cpu / gib, "verify_cpu_s_per_gib": verify_cpu / gib,
            "create_waits": waits,  # the writer idle (disk starved), writing, the filler waiting for a buffer
            "open_s": open_s, "open_read_bytes": open_read, "open_rss_bytes": max(0, open_rss)}


def report(r: dict[str, Any]) -> str:
    """A readable summary with the ratios against the limits."""
    gib, w = 2**30, r["create_waits"]
    return "\n".join([
        f"table {r['table_bytes'] / gib:.2f} GiB (V4.1 rows, 24 heads, fp8_e4m3), peak RSS of this process "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
        f"  disk sequential write, O_DIRECT zeros   {r['zeros_limit'] / gib:6.2f} GiB/s (dd's figure; before/after "
        "mean)",
        f"  disk sequential write, O_DIRECT data    {r['write_limit_before'] / gib:6.2f} / "
        f"{r['write_limit_after'] / gib:.2f} GiB/s (before / after)",
        f"  table create                            {r['create'] / gib:6.2f} GiB/s  = {r['create_ratio']:.2f} x the "
        f"data write limit, {r['create'] / r['zeros_limit']:.2f} x zeros (target >= 0.80); "
        f"{r['create_cpu_s_per_gib']:.2f} CPU-s/GiB",
        f"    create's writer thread: idle {w.get('writer_idle_s', 0):.2f} s (waiting for filled pages), writing "
        f"{w.get('write_s', 0):.2f} s; the filler waited {w.get('fill_wait_s', 0):.2f} s for a free buffer",
        f"  disk sequential read (O_DIRECT)         {r['read_limit_before'] / gib:6.2f} / "
        f"{r['read_limit_after'] / gib:.2f} GiB/s (before / after)",
        f"  table verify                            {r['verify'] / gib:6.2f} GiB/s  = {r['verify_ratio']:.2f} x the "
        f"read limit (target >= 0.80); {r['verify_cpu_s_per_gib']:.2f} CPU-s/GiB",
        f"  TieredTable(tier='file') open           {r['open_s'] * 1e3:6.1f} ms, read {r['open_read_bytes']:,} B, "
        f"RSS +{r['open_rss_bytes'] / 2**20:.1f} MiB",
    ])
