"""Shared benchmark helpers: timing, id distributions, progress lines, cached bench tables, acceptance targets."""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

import numpy as np

from tiergram.format import TableFile, TableManifest

# serving acceptance: tokens/s of a placement as a fraction of the reference placement's, in the same run
HOST_TARGET = 0.97  # host tables (DRAM; UVA on a GPU) against tables resident in device memory
FILE_TARGET = 0.90  # file tables (SSD) against host tables


def log(progress: bool, msg: str) -> None:
    """A progress line on stderr (stdout stays for the result, e.g. --json), when progress is on."""
    if progress:
        print(msg, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (q in 0..100, linear interpolation, as numpy) of values; NaN when there are none."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def stdlib_files(exclude: Collection[str] = ("site-packages", "dist-packages")) -> list[Path]:
    """The Python standard library's .py files, sorted, leaving out those under a folder named in `exclude`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not set(exclude) & set(p.relative_to(root).parts) and p.is_file())


def rates_interleaved(fns: dict[str, Callable[[], object]], items: int, *, rounds: int = 5,
                      seconds: float = 0.2) -> dict[str, float]:
    """Best items/s of each fn over `rounds` interleaved segments of about `seconds` (round 1 of every fn,
    then round 2, ...): load from other processes then hits every fn alike instead of whichever ran last."""
    best = dict.fromkeys(fns, 0.0)
    for fn in fns.values():
        fn()  # warm-up: page faults, caches
    for _ in range(rounds):
        for name, fn in fns.items():
            deadline = time.perf_counter() + seconds
            while time.perf_counter() <= deadline:
                t0 = time.perf_counter()
                fn()
                best[name] = max(best[name], items / (time.perf_counter() - t0))
    return best


def python_calls(fn: Callable[[], object]) -> int:
    """Function calls (Python and C, as `sys.setprofile` sees them) of fn() run once: work no other process skews."""
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls - 1  # the setprofile(None) call itself


def draw_ids(dist: str, shape: tuple[int, ...], rows: np.ndarray, rng: np.random.Generator,
             zipf_a: float = 1.1) -> np.ndarray:
    """int64 ids of `shape` [..., H] for heads of `rows` [H] rows: 'uniform', or 'zipf' (rank-permuted)."""
    u = rng.random(shape)
    if dist == "uniform":
        return (u * rows).astype(np.int64)
    if dist == "zipf":
        ranks = rng.zipf(zipf_a, size=shape) - 1
        ranks = np.minimum(ranks, rows - 1)
        # scatter ranks over the table so hot rows are not adjacent (n-gram hashes are spread out)
        return ((ranks * 2654435761 + 12345) % rows).astype(np.int64)
    raise ValueError(f"unknown id distribution {dist!r} (valid: uniform, zipf)")


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to forget the file's cached pages (clean pages go; O_DIRECT and mmap then read the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_table(path: Path, manifest: TableManifest, create: Callable[[Path], object]) -> TableFile:
    """The bench table at `path` when it has `manifest`'s geometry, else (stale or damaged) made by create(path)."""
    try:
        table = TableFile.open(path)
        if replace(table.manifest, provenance=manifest.provenance) == manifest:
            return table
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    create(path)
    return TableFile.open(path)
