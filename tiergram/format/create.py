"""Creating table files from values: random initialisation or an existing float matrix."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from tiergram.codecs import get_codec
from tiergram.format.manifest import TableManifest
from tiergram.format.writer import write_pages, write_table

# Produces the float rows [start, start + n) of the global row space: float32 [n, D].
ValueSource = Callable[[int, int], np.ndarray]


def create_table(path: str | os.PathLike, manifest: TableManifest, values: ValueSource, *,
                 progress: bool = True) -> Path:
    """Encode rows from `values(start, n)` with the manifest's codec and write the table file."""
    codec = get_codec(manifest.codec)
    return write_table(path, manifest, lambda start, n: codec.encode(values(start, n)), progress=progress)


def create_random_table(path: str | os.PathLike, manifest: TableManifest, *, seed: int = 0, std: float = 1.0,
                        progress: bool = True) -> Path:
    """A random-init table: N(0, std^2) values, at disk speed for fp8_e4m3 (codes drawn without a float pass)."""
    if manifest.codec == "fp8_e4m3":
        return write_pages(path, manifest, random_fp8_pages(manifest, seed=seed, std=std), progress=progress)
    return create_table(path, manifest, random_values(manifest.dim, seed=seed, std=std), progress=progress)


FP8_POOL_PAGES = 4096  # pages a block's window may start at: rows of different blocks come from different windows
_FP8_BLOCK_PAGES = 256  # pages that share one window: the unit the offsets are drawn for (independent of chunking)


def normal_fp8_codes(std: float) -> tuple[np.ndarray, int]:
    """(uint8 [65536]: 16-bit uniform u -> e4m3 code of the N(0, std^2) quantile at (u + 0.5) / 2^16 over the
    scale, ue8m0 scale byte): one block scale for the table, keeping 4.3 std under e4m3's 448."""
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    t = int(np.ceil(np.log2(4.3 * std / 448.0)))
    scale_byte = int(np.clip(t + 127, 1, 254))
    u = (torch.arange(65536, dtype=torch.float64) + 0.5) / 65536.0
    x = torch.special.ndtri(u) * std / 2.0 ** (scale_byte - 127)
    codes = x.float().to(torch.float8_e4m3fn).view(torch.uint8).numpy().copy()
    return codes, scale_byte


def random_fp8_pages(manifest: TableManifest, *, seed: int = 0, std: float = 1.0):
    """A write_pages filler of N(0, std^2) fp8_e4m3 rows without a float per value, at the disk's rate.

    Each 256-page block is the XOR of windows of two ~17 MiB page pools (codes of normal quantiles, random sign bits) at
    offsets drawn per block from `seed`: values are N(0, std^2) and blocks do not repeat, but rows are not independent
    draws — a serving/benchmark init, not a training one."""
    d, rb, rpp, ps = manifest.dim, manifest.row_bytes, manifest.rows_per_page, manifest.page_size
    lut, scale_byte = normal_fp8_codes(std)
    rng = np.random.default_rng([seed, 0xF8])
    span = min(FP8_POOL_PAGES, manifest.n_pages)
    pool_pages = span + _FP8_BLOCK_PAGES
    codes = np.zeros((pool_pages, ps), dtype=np.uint8)
    signs = np.zeros((pool_pages, ps), dtype=np.uint8)
    crow = codes[:, : rpp * rb].reshape(pool_pages, rpp, rb)
    crow[:, :, :d] = lut[rng.integers(0, 65536, size=(pool_pages, rpp, d), dtype=np.uint16)]
    crow[:, :, d:] = scale_byte
    signs[:, : rpp * rb].reshape(pool_pages, rpp, rb)[:, :, :d] = rng.integers(0, 2, size=(pool_pages, rpp, d),
                                                                               dtype=np.uint8) << 7
    n_blocks = -(-manifest.n_pages // _FP8_BLOCK_PAGES)
    offsets = np.random.default_rng([seed, 0x0FF5E7]).integers(0, span, size=(n_blocks, 2))
    total = manifest.total_rows

    def fill(pages: np.ndarray, p0: int, n: int) -> None:
        p = p0
        while p < p0 + n:
            b = p // _FP8_BLOCK_PAGES
            q = min(p0 + n, (b + 1) * _FP8_BLOCK_PAGES)  # this block's pages inside the chunk
            skip = p - b * _FP8_BLOCK_PAGES  # a chunk may start inside a block
            oa, ob = int(offsets[b, 0]) + skip, int(offsets[b, 1]) + skip
            np.bitwise_xor(codes[oa:oa + q - p], signs[ob:ob + q - p], out=pages[p - p0:q - p0])
            p = q
        last = total - (p0 + n - 1) * rpp  # rows on the chunk's last page
        if last < rpp:  # the table's last page: slots after its last row stay zero
            pages[n - 1, last * rb:] = 0

    return fill


def random_values(dim: int, seed: int = 0, std: float = 1.0) -> ValueSource:
    """Deterministic N(0, std²) rows: row g's values depend only on (seed, g's chunk), not on call order."""

    def values(start: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([seed, start])
        return (rng.standard_normal((n, dim), dtype=np.float32) * np.float32(std)).astype(np.float32)

    return values


def stacked_values(rows: Sequence[int], read: Callable[[int, int, int], np.ndarray]) -> ValueSource:
    """The row space of parts of rows[i] rows end to end, read(i, lo, hi) giving part i's rows [lo, hi)."""
    starts = np.cumsum([0, *rows])

    def values(start: int, n: int) -> np.ndarray:
        parts, g = [], start
        while g < start + n:
            i = int(np.searchsorted(starts, g, side="right") - 1)
            hi = min(start + n, int(starts[i + 1]))
            parts.append(np.asarray(read(i, g - int(starts[i]), hi - int(starts[i])), dtype=np.float32))
            g = hi
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    return values


def matrix_values(matrix: np.ndarray) -> ValueSource:
    """Rows taken from a float matrix [N_total, D] (e.g. a checkpoint tensor)."""
    return lambda start, n: np.asarray(matrix[start:start + n], dtype=np.float32)
