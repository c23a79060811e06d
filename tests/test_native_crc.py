"""The native CRC-32C (three hardware streams joined by a tabulated shift) equals a bytewise reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram import _native

_TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    _TABLE.append(c)


def crc32c_ref(data: bytes, crc: int = 0) -> int:
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), start=st.integers(0, 15), seed=st.integers(0, 2**32 - 1), crc=st.integers(0, 2**32 - 1))
def test_crc32c_equals_reference(n, start, seed, crc):
    buf = np.random.default_rng(seed).integers(0, 256, n + start, dtype=np.uint8)
    view = buf[start:]  # unaligned starts too
    assert _native.crc32c(view, crc) == crc32c_ref(view.tobytes(), crc)


def test_crc32c_page_lengths():
    rng = np.random.default_rng(0)
    for n in (767, 768, 769, 1536, 2304, 4088, 4092, 8188, 3 * 8192 + 5):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert _native.crc32c(data) == crc32c_ref(data.tobytes()), n
