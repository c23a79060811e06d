"""One row-id validator (tiergram.format.ids): every reader refuses the same ids with the same error and message."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.engram import TrainableTable
from tiergram.format import TableManifest, create_table, random_values
from tiergram.format.ids import check_row_ids
from tiergram.kernels import RowLayout, gather_dequant
from tiergram.store import TieredTable

HEAD_ROWS = [7, 3, 11]
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def expected(ids: np.ndarray) -> tuple[type, str] | None:
    """The error (type, message) the contract demands for integer ids [N, 3], or None when they are valid."""
    for pos, row in enumerate(ids.tolist()):
        for head, v in enumerate(row):
            if v < 0 or v >= HEAD_ROWS[head]:
                return IndexError, (f"row id {v} out of range for head {head} (rows 0..{HEAD_ROWS[head] - 1}) "
                                    f"at position {pos}")
    return None


@st.composite
def id_arrays(draw) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    info = np.iinfo(dtype)
    n = draw(st.integers(0, 5))
    # mostly in range, sometimes anywhere in the dtype's range (uint64 >= 2^63 included)
    value = st.one_of(st.integers(0, 12), st.integers(int(info.min), int(info.max)))
    return np.array(draw(st.lists(st.lists(value, min_size=3, max_size=3), min_size=n, max_size=n)),
                    dtype=dtype).reshape(n, 3)


@given(id_arrays(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_validator_contract(ids, as_tensor):
    """Valid ids come back as int64 with the same values; invalid ones raise the documented error and message."""
    if as_tensor and ids.dtype in (np.uint16, np.uint32, np.uint64):
        as_tensor = False  # torch has no general unsigned integer tensors
    arg = torch.from_numpy(ids) if as_tensor else ids
    want = expected(ids)
    if want is None:
        got = check_row_ids(arg, HEAD_ROWS)
        assert isinstance(got, torch.Tensor) == as_tensor
        got = got.numpy() if as_tensor else got
        assert got.dtype == np.int64 and got.flags.c_contiguous
        assert np.array_equal(got, ids.astype(np.int64))
    else:
        with pytest.raises(want[0]) as err:
            check_row_ids(arg, HEAD_ROWS)
        assert str(err.value) == want[1]


@pytest.mark.parametrize("bad,kind,message", [
    (np.zeros((2, 3), np.float32), ValueError, "row ids must be integers, got float32"),
    (torch.zeros(2, 3), ValueError, "row ids must be integers, got float32"),
    (np.zeros((2, 3), bool), ValueError, "row ids must be integers, got bool"),
    (np.zeros((2, 2), np.int64), ValueError, "row ids must have shape [..., 3] (one id per head), got [2, 2]"),
    (np.int64(0), ValueError, "row ids must have shape [..., 3] (one id per head), got []"),
    (np.array([[0, 0, 2**64 - 1]], np.uint64), IndexError,
     f"row id {2**64 - 1} out of range for head 2 (rows 0..10) at position 0"),
    (np.array([[0, 0, 0], [0, -1, 0]], np.int64), IndexError,
     "row id -1 out of range for head 1 (rows 0..2) at position 1"),
])
def test_every_reader_raises_the_same(tmp_path, bad, kind, message):
    """The store, the kernel launcher and the Engram table refuse the same ids with the same error and message."""
    path = tmp_path / "t.tgram"
    create_table(path, TableManifest(codec="fp32", dim=8, head_rows=HEAD_ROWS), random_values(8), progress=False)
    table = TieredTable(path, tier="host")
    data = torch.from_numpy(table.tier.data)
    layout = RowLayout.of(table.manifest)
    offsets = np.concatenate([[0], np.cumsum(HEAD_ROWS)[:-1]])
    readers = {
        "validator": lambda ids: check_row_ids(ids, HEAD_ROWS),
        "store.lookup": table.lookup,
        "store.prefetch": lambda ids: table.prefetch(ids).wait(),
        "kernel": lambda ids: gather_dequant(data, ids, layout, offsets, np.array(HEAD_ROWS), backend="torch"),
    }
    if isinstance(bad, torch.Tensor) or bad.dtype.kind == "f" or bad.dtype in (np.int64, bool):
        readers["engram"] = lambda ids: TrainableTable(HEAD_ROWS, 8)(torch.as_tensor(ids))
    try:
        for name, read in readers.items():
            with pytest.raises(kind) as err:
                read(bad)
            assert str(err.value) == message, name
    finally:
        table.close()
