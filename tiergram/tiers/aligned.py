"""Page-aligned host buffers, as O_DIRECT reads need."""

import numpy as np


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes` whose first byte sits on an `alignment` boundary.

    O_DIRECT reads DMA straight into the buffer, so the kernel refuses (EINVAL) one that is not aligned to
    the device's block size; 4096 covers both 512-byte and 4 KiB-sector disks. The result is a view into a
    slightly larger allocation, which it keeps alive through `.base`.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]
