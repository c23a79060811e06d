"""TieredTable.lookup on the host tier against the reference codecs; the native gather's own checks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram import _native
from tiergram.codecs import get_codec
from tiergram.format import TableFile, TableFormatError, TableManifest, create_table, matrix_values
from tiergram.store import TieredTable
from tiergram.tiers import HostTier
from tiergram.tiers.host import SHM_DIR, shared_name

CODECS = ["fp32", "bf16", "int8", "fp8_e4m3"]
HEAD_ROWS = (97, 50, 201)
DIM = 64
PAGE_SIZE = 1024


def table_values(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)) * np.exp2(rng.integers(-12, 12, (n, 1)))
    x[3] = 0.0
    x[5, :7] = -0.0
    return x.astype(np.float32)


def bits(t: torch.Tensor) -> np.ndarray:
    """Bit patterns of a float tensor: the comparison is exact, signed zeros included."""
    t = t.contiguous()
    return (t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)).numpy()


class Table:
    """A table file plus its reference decode ref[g] (float32 [N_total, D]) from the reference codec."""

    def __init__(self, path: Path, codec: str, head_rows=HEAD_ROWS, dim=DIM, page_size=PAGE_SIZE, seed=0):
        self.path, self.codec, self.head_rows, self.dim = path, codec, head_rows, dim
        values = table_values(sum(head_rows), dim, seed)
        m = TableManifest(codec=codec, dim=dim, head_rows=head_rows, page_size=page_size)
        create_table(path, m, matrix_values(values), progress=False)
        c = get_codec(codec)
        self.encoded = c.encode(values)
        self.ref = c.decode(self.encoded, dim)
        self.offsets = np.asarray(m.head_offsets)
        self.manifest = m

    def expect(self, ids: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """The rows `lookup(ids)` must give: reference fp32 decode, cast to bf16 when asked."""
        ref = self.ref[torch.from_numpy(np.asarray(ids, dtype=np.int64) + self.offsets)]
        return ref if dtype == torch.float32 else ref.to(torch.bfloat16)

    def random_ids(self, shape: tuple[int, ...], seed: int) -> np.ndarray:
        """ids [*shape, H] with many duplicates and both ends of every head."""
        rng = np.random.default_rng(seed)
        ids = np.stack([rng.integers(0, min(r, 9), shape) * (r // 9) for r in self.head_rows], axis=-1)
        flat = ids.reshape(-1, len(self.head_rows))
        flat[0] = 0
        flat[-1] = np.asarray(self.head_rows) - 1
        if len(flat) >= 4:
            flat[-2] = flat[1]  # at least one whole position repeated
        return ids


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Table]:
    d = tmp_path_factory.mktemp("store")
    return {c: Table(d / f"{c}.tgram", c) for c in CODECS}


@pytest.fixture(scope="module")
def opened(tables) -> dict[tuple[str, torch.dtype], TieredTable]:
    out = {(c, dt): TieredTable(t.path, dtype=dt) for c, t in tables.items() for dt in (torch.float32, torch.bfloat16)}
    yield out
    for tt in out.values():
        tt.close()


DTYPES = [torch.float32, torch.bfloat16]
ID_KINDS = ["numpy-int64", "torch-int64", "numpy-int32", "torch-int32", "numpy-uint16"]


def as_kind(ids: np.ndarray, kind: str):
    lib, dt = kind.split("-")
    arr = ids.astype(dt)
    return torch.from_numpy(arr) if lib == "torch" else arr


# --- lookup against the reference ------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 7), (53,), (1, 1), (2, 3, 5)], ids=["BxL", "N", "1x1", "3d"])
def test_lookup_matches_reference(tables, opened, codec, dtype, shape):
    t, tt = tables[codec], opened[(codec, dtype)]
    assert (tt.num_heads, tt.dim, tt.dtype) == (3, DIM, dtype)
    ids = t.random_ids(shape, seed=len(shape))
    if ids.size >= 12:
        assert len(np.unique(ids.reshape(-1, 3), axis=0)) < ids.size // 3  # duplicate positions
    want = t.expect(ids, dtype)
    for kind in ID_KINDS:
        got = tt.lookup(as_kind(ids, kind))
        assert got.dtype == dtype and tuple(got.shape) == (*shape, 3, DIM)
        assert np.array_equal(bits(got), bits(want)), kind


def test_lookup_single_position_and_empty(tables, opened):
    t, tt = tables["fp8_e4m3"], opened[("fp8_e4m3", torch.float32)]
    got = tt.lookup(np.array([96, 49, 200]))
    assert tuple(got.shape) == (3, DIM) and np.array_equal(bits(got), bits(t.expect(np.array([96, 49, 200]),
                                                                                    torch.float32)))
    for shape in [(0, 3), (2, 0, 3)]:
        assert tuple(tt.lookup(np.zeros(shape, np.int64)).shape) == (*shape, DIM)


def test_lookup_non_contiguous_ids(tables, opened):
    t, tt = tables["int8"], opened[("int8", torch.float32)]
    ids = t.random_ids((6, 10), seed=3)
    strided = torch.from_numpy(ids).transpose(0, 1)  # [10, 6, 3], not contiguous
    assert not strided.is_contiguous()
    assert np.array_equal(bits(tt.lookup(strided)), bits(t.expect(strided.numpy(), torch.float32)))
    assert np.array_equal(bits(tt.lookup(ids[::2])), bits(t.expect(ids[::2], torch.float32)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_lookup_into_out(tables, opened, dtype):
    t, tt = tables["bf16"], opened[("bf16", dtype)]
    ids = t.random_ids((5, 4), seed=9)
    out = torch.full((5, 4, 3, DIM), 7.0, dtype=dtype)
    assert tt.lookup(ids, out=out) is out
    assert np.array_equal(bits(out), bits(t.expect(ids, dtype)))


@pytest.mark.parametrize("bad_out", ["shape", "dims", "dtype", "other_dtype", "strided"])
def test_out_validation(tables, opened, bad_out):
    tt = opened[("fp32", torch.float32)]
    ids = np.zeros((5, 4, 3), np.int64)
    out = {"shape": torch.empty(5, 4, 3, DIM + 1), "dims": torch.empty(20, 3, DIM),
           "dtype": torch.empty(5, 4, 3, DIM, dtype=torch.bfloat16),
           "other_dtype": torch.empty(5, 4, 3, DIM, dtype=torch.float64),
           "strided": torch.empty(4, 5, 3, DIM).transpose(0, 1)}[bad_out]
    out.fill_(7.0)
    with pytest.raises(ValueError, match=r"out must be a contiguous CPU torch.float32 tensor of shape \[5, 4, 3, 64\]"):
        tt.lookup(ids, out=out)
    assert bool((out == 7.0).all())  # left as it was


OUT_OF_RANGE = [  # (head, id) placed at position 2 of a [4, 3] batch
    (0, -1), (0, 97), (1, 50), (2, 201), (2, -201), (1, 2**40), (0, 2**63 - 1), (1, -(2**63)),
]


@pytest.mark.parametrize("head,bad", OUT_OF_RANGE)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_out_of_range_id_raises_index_error(opened, head, bad, lib):
    tt = opened[("fp8_e4m3", torch.float32)]
    ids = np.zeros((4, 3), np.int64)
    ids[2, head] = bad
    with pytest.raises(IndexError) as e:
        tt.lookup(torch.from_numpy(ids) if lib == "torch" else ids)
    msg = str(e.value)
    assert f"row id {bad} out of range for head {head}" in msg and "position 2" in msg
    if bad >= 0 and bad < 2**40:
        assert f"rows 0..{HEAD_ROWS[head] - 1}" in msg


def test_out_of_range_uint64_id_is_reported_as_given(opened):
    """A uint64 id above 2^63 must not wrap to a negative id in the message."""
    tt = opened[("int8", torch.float32)]
    ids = np.zeros((2, 3), np.uint64)
    ids[1, 2] = 2**64 - 1
    want = rf"row id {2**64 - 1} out of range for head 2 \(rows 0\.\.{HEAD_ROWS[2] - 1}\) at position 1"
    with pytest.raises(IndexError, match=want):
        tt.lookup(ids)
    ids[1, 2] = 200  # in range again: uint64 ids are fine
    assert tuple(tt.lookup(ids).shape) == (2, 3, DIM)


def test_first_bad_id_reported(opened):
    tt = opened[("fp32", torch.float32)]
    ids = np.zeros((6, 3), np.int64)
    ids[3, 1], ids[5, 0] = 50, -5
    with pytest.raises(IndexError, match="row id 50 out of range for head 1 .* at position 3"):
        tt.lookup(ids)


@pytest.mark.parametrize("ids,match", [
    (np.zeros((4, 2), np.int64), r"shape \[..., 3\] \(one id per head\), got \[4, 2\]"),
    (np.zeros((4, 4), np.int64), r"got \[4, 4\]"),
    (np.zeros((3, 1), np.int64), r"got \[3, 1\]"),
    (np.zeros(()), "integers"),
    (np.int64(0), "shape"),
    (np.zeros((4, 3), np.float32), "row ids must be integers, got float32"),
    (torch.zeros(4, 3), "row ids must be integers, got float32"),
    (np.zeros((4, 3), bool), "row ids must be integers, got bool"),
])
def test_bad_id_shapes_and_types(opened, ids, match):
    with pytest.raises(ValueError, match=match):
        opened[("fp32", torch.float32)].lookup(ids)


def test_constructor_refusals(tables, tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        TieredTable(tables["fp32"].path, dtype=torch.float16)
    with pytest.raises(ValueError, match="unknown tier 'ssd'"):
        TieredTable(tables["fp32"].path, tier="ssd")
    with pytest.raises(ValueError, match="cache_bytes applies to the file tier"):
        TieredTable(tables["fp32"].path, cache_bytes=1 << 20)
    with pytest.raises(FileNotFoundError, match="missing.tgram"):
        TieredTable(tmp_path / "missing.tgram")


def test_corrupt_table_is_never_served(tmp_path):
    t = Table(tmp_path / "c.tgram", "fp8_e4m3", head_rows=(40, 40), page_size=512)
    tf = TableFile.open(t.path)
    with open(t.path, "r+b") as f:
        f.seek(tf.data_offset + 3 * 512 + 10)
        f.write(b"\x55")
    with pytest.raises(TableFormatError, match=f"{t.path}.*page 3"):
        TieredTable(t.path)
    name = shared_name(tf)
    with pytest.raises(TableFormatError, match="page 3"):
        TieredTable(t.path, shared=True)
    assert not [p for p in os.listdir(SHM_DIR) if p.startswith(name)]  # neither the copy nor its temp file


# --- shared /dev/shm copy --------------------------------------------------------------------------


def test_shared_host_copy_is_identical_and_reused(tmp_path):
    t = Table(tmp_path / "shared.tgram", "fp8_e4m3", head_rows=(300, 120), page_size=4096, seed=4)
    shm = SHM_DIR / shared_name(TableFile.open(t.path))
    assert not shm.exists()
    first = second = None
    try:
        first = TieredTable(t.path, shared=True)
        assert first.tier.shm_path == shm and shm.is_file()
        assert shm.read_bytes() == t.path.read_bytes()  # a whole, valid table file
        assert TableFile.open(shm).verify() == []
        st = shm.stat()
        second = TieredTable(t.path, shared=True, dtype=torch.bfloat16)
        assert second.tier.shm_path == shm
        st2 = shm.stat()
        assert (st2.st_ino, st2.st_mtime_ns, st2.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)  # not re-copied
        assert not [p for p in os.listdir(SHM_DIR) if p.startswith(shm.name + ".tmp-")]

        private = TieredTable(t.path)
        ids = Table.random_ids(t, (8, 16), seed=5)
        assert np.array_equal(bits(first.lookup(ids)), bits(private.lookup(ids)))
        assert np.array_equal(bits(first.lookup(ids)), bits(t.expect(ids, torch.float32)))
        assert np.array_equal(bits(second.lookup(ids)), bits(t.expect(ids, torch.bfloat16)))
        assert first.tier.nbytes == private.tier.nbytes == t.manifest.data_bytes
        private.close()

        first.close()  # one process's close leaves the copy for the others
        assert shm.exists()
        assert np.array_equal(bits(second.lookup(ids)), bits(t.expect(ids, torch.bfloat16)))

        # a rewritten source file gets a new shared name: a stale copy is never served
        Table(t.path, "int8", head_rows=(10,), page_size=512)
        assert shared_name(TableFile.open(t.path)) != shm.name
    finally:
        for tt in (first, second):
            if tt is not None:
                tt.close()
        shm.unlink(missing_ok=True)
    assert not shm.exists()


# --- property: any ids, every codec ----------------------------------------------------------------


@st.composite
def id_batches(draw):
    codec = draw(st.sampled_from(CODECS))
    dtype = draw(st.sampled_from(DTYPES))
    positions = draw(st.lists(st.tuples(*[st.integers(0, r - 1) for r in HEAD_ROWS]), max_size=40))
    batch = draw(st.sampled_from([None, 1, 2]))
    ids = np.asarray(positions, dtype=np.int64).reshape(-1, 3)
    if batch and len(ids) % batch == 0 and len(ids):
        ids = ids.reshape(batch, -1, 3)
    return codec, dtype, ids, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(case=id_batches())
def test_lookup_equals_reference_decode(tables, opened, case):
    codec, dtype, ids, as_torch = case
    got = opened[(codec, dtype)].lookup(torch.from_numpy(ids) if as_torch else ids)
    assert tuple(got.shape) == (*ids.shape, DIM)
    assert np.array_equal(bits(got), bits(tables[codec].expect(ids, dtype)))


# --- the native gather and decode_at directly ------------------------------------------------------


def native_args(t: Table):
    m = t.manifest
    data = TableFile.open(t.path).read_data()
    return data, np.asarray(m.head_offsets, np.int64), np.asarray(m.head_rows, np.int64), m


@pytest.mark.parametrize("codec", CODECS)
def test_native_gather_raw_rows(tables, codec):
    t = tables[codec]
    data, offs, rows, m = native_args(t)
    ids = t.random_ids((30,), seed=1).astype(np.int64)
    raw = np.empty((30, 3, m.row_bytes), np.uint8)
    _native.gather(data, ids, offs, rows, m.page_size, m.rows_per_page, m.codec_id, DIM, raw)
    assert np.array_equal(raw, t.encoded[ids + offs])
    bf = np.empty((30, 3, DIM), np.uint16)  # bf16 bits in a uint16 buffer
    _native.gather(data, ids, offs, rows, m.page_size, m.rows_per_page, m.codec_id, DIM, bf)
    assert np.array_equal(bf.view(np.int16), bits(t.expect(ids, torch.bfloat16)))


@pytest.mark.parametrize("page_size,rows_per_page,match", [
    (1024, 16, "page geometry does not fit: 16 rows of 66 bytes in a 1024-byte page"),  # 16*66+8 > 1024
    (1024, 0, "page geometry does not fit"),
    (256, 1, "page geometry does not fit"),
    (66, 1, "page geometry does not fit"),
])
def test_native_gather_bad_geometry(tables, page_size, rows_per_page, match):
    data, offs, rows, m = native_args(tables["fp8_e4m3"])
    assert m.row_bytes == 66 and m.rows_per_page == 15  # 15 * 66 + 8 = 998 fits, 16 rows would not
    out = np.empty((1, 3, DIM), np.float32)
    with pytest.raises(ValueError, match=match):
        _native.gather(data, np.zeros((1, 3), np.int64), offs, rows, page_size, rows_per_page, m.codec_id, DIM, out)


def test_native_gather_argument_checks(tables):
    data, offs, rows, m = native_args(tables["int8"])
    ids = np.zeros((2, 3), np.int64)
    args = (m.page_size, m.rows_per_page, m.codec_id, DIM)
    with pytest.raises(ValueError, match="out has 383 elements, expected 384"):
        _native.gather(data, ids, offs, rows, *args, np.empty(383, np.float32))
    with pytest.raises(ValueError, match="out must be float32"):
        _native.gather(data, ids, offs, rows, *args, np.empty((2, 3, DIM), np.float64))
    with pytest.raises(ValueError, match="invalid codec 9"):
        _native.gather(data, ids, offs, rows, m.page_size, m.rows_per_page, 9, DIM, np.empty((2, 3, DIM), np.float32))
    with pytest.raises(ValueError, match="differ in length"):
        _native.gather(data, ids, offs[:2], rows, *args, np.empty((2, 3, DIM), np.float32))
    with pytest.raises(ValueError, match="head 2 extends past the table data"):
        _native.gather(data[: len(data) - m.page_size], ids, offs, rows, *args, np.empty((2, 3, DIM), np.float32))
    with pytest.raises(ValueError, match="last dimension must equal the table's 3 heads"):
        _native.gather(data, np.zeros(4, np.int64), offs, rows, *args, np.empty((4, DIM), np.float32))
    with pytest.raises(IndexError, match="row id 97 out of range for head 0"):
        _native.gather(data, np.array([[97, 0, 0]]), offs, rows, *args, np.empty((1, 3, DIM), np.float32))


@pytest.mark.parametrize("codec", CODECS)
def test_native_decode_at(tables, codec):
    t = tables[codec]
    c = get_codec(codec)
    src = np.concatenate([np.zeros(3, np.uint8), t.encoded[:20].reshape(-1)])  # rows at odd offsets
    rb = c.row_bytes(DIM)
    offsets = np.array([3 + rb * i for i in (0, 19, 7, 7)], np.int64)
    out = np.empty((4, DIM), np.float32)
    _native.decode_at(src, offsets, c.codec_id, DIM, out)
    assert np.array_equal(out.view(np.int32), bits(t.ref[[0, 19, 7, 7]]))


@pytest.mark.parametrize("bad", ["past_end", "negative", "huge"])
def test_native_decode_at_out_of_bounds(tables, bad):
    t = tables["fp8_e4m3"]
    src = np.ascontiguousarray(t.encoded[:10].reshape(-1))  # 10 rows of 66 bytes
    off = {"past_end": len(src) - 66 + 1, "negative": -1, "huge": 2**62}[bad]
    out = np.empty((2, DIM), np.float32)
    with pytest.raises(IndexError, match=f"row byte offset {off} at index 1 outside the 660-byte source"):
        _native.decode_at(src, np.array([0, off], np.int64), 3, DIM, out)
    _native.decode_at(src, np.array([0, len(src) - 66], np.int64), 3, DIM, out)  # the last row is in bounds
    assert np.array_equal(out.view(np.int32), bits(t.ref[[0, 9]]))


def test_host_tier_reports_its_size(tables):
    tier = HostTier(TableFile.open(tables["bf16"].path))
    assert tier.nbytes == tables["bf16"].manifest.data_bytes and tier.shm_path is None
    tier.close()
    assert tier.nbytes == 0
