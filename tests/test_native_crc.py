"""The native CRC-32C (three hardware streams joined by a tabulated shift) equals a bytewise reference."""

from __future__ import annotations

import numpy as np
import pytest
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


@settings(max_examples=60, deadline=None)
@given(indices=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40, unique=True), seed=st.integers(0, 2**16),
       data=st.data())
def test_verify_pages_at_indices(indices, seed, data):
    """Pages gathered from anywhere (a remote batch): each must carry its own expected index and an intact CRC."""
    ps = 512
    pages = np.random.default_rng(seed).integers(0, 256, len(indices) * ps, dtype=np.uint8)
    for i, index in enumerate(indices):
        _native.seal_pages(pages[i * ps:(i + 1) * ps], ps, index)
    want = np.array(indices, dtype=np.int64)
    assert _native.verify_pages(pages, ps, want) == []
    k = data.draw(st.integers(0, len(indices) - 1))
    if len(indices) > 1:  # a page delivered to the wrong position fails by its index alone
        other = (k + 1) % len(indices)
        swapped = want.copy()
        swapped[[k, other]] = swapped[[other, k]]
        assert sorted(_native.verify_pages(pages, ps, swapped)) == sorted({int(want[k]), int(want[other])})
    pages[k * ps + data.draw(st.integers(0, ps - 1))] ^= 1 << data.draw(st.integers(0, 7))  # a flipped bit
    assert _native.verify_pages(pages, ps, want) == [int(want[k])]


def test_verify_pages_at_indices_errors():
    pages = np.zeros(2 * 512, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"indices must be int64 \[2\]"):
        _native.verify_pages(pages, 512, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="page index -1 at position 1 is negative"):
        _native.verify_pages(pages, 512, np.array([0, -1]))
