"""Page-aligned host buffers, as O_DIRECT reads need."""

import numpy as np


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """An uninitialised uint8 [nbytes] on an `alignment` boundary, as O_DIRECT needs (a view; see `.base`)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]
