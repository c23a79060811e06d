"""Creating table files from values: random initialisation or an existing float matrix."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tiergram.codecs import get_codec
from tiergram.format.manifest import TableManifest
from tiergram.format.writer import write_table

# Produces the float rows [start, start + n) of the global row space: float32 [n, D].
ValueSource = Callable[[int, int], np.ndarray]


def create_table(path: str | os.PathLike, manifest: TableManifest, values: ValueSource, *,
                 progress: bool = True) -> Path:
    """Encode rows from `values(start, n)` with the manifest's codec and write the table file."""
    codec = get_codec(manifest.codec)
    return write_table(path, manifest, lambda start, n: codec.encode(values(start, n)), progress=progress)


def random_values(dim: int, seed: int = 0, std: float = 1.0) -> ValueSource:
    """Deterministic N(0, std²) rows: row g's values depend only on (seed, g's chunk), not on call order."""

    def values(start: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([seed, start])
        return (rng.standard_normal((n, dim), dtype=np.float32) * np.float32(std)).astype(np.float32)

    return values


def matrix_values(matrix: np.ndarray) -> ValueSource:
    """Rows taken from a float matrix [N_total, D] (e.g. a checkpoint tensor)."""
    return lambda start, n: np.asarray(matrix[start:start + n], dtype=np.float32)
