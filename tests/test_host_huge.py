"""The host tier at scale: tables on transparent huge pages (2 MiB-aligned, MADV_HUGEPAGE, reported by stats()),
the native fp8 gather's every path (AVX-512 / AVX2, normal or non-temporal stores) against the reference decode,
and the same-bytes limit the lookup benchmark measures against."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram import _native
from tiergram.bench import lookup
from tiergram.codecs import get_codec
from tiergram.format import TableManifest, create_random_table
from tiergram.store import TieredTable
from tiergram.tiers.host import HUGE_PAGE, huge_page_buffer, huge_page_bytes, thp_mode


def test_huge_page_buffer_is_aligned_zeroed_and_sized():
    mm, buf = huge_page_buffer(5 * HUGE_PAGE + 123)
    assert buf.ctypes.data % HUGE_PAGE == 0 and buf.size == 5 * HUGE_PAGE + 123 and buf.dtype == np.uint8
    assert not buf[:: 4096].any()
    buf[:] = 7
    got = huge_page_bytes(buf.ctypes.data, buf.nbytes)
    assert 0 <= got <= buf.nbytes  # how many the kernel grants depends on its free 2 MiB pages
    del buf
    mm.close()


def test_huge_page_bytes_counts_only_the_given_range():
    mm = mmap.mmap(-1, 4 * HUGE_PAGE)
    base = np.frombuffer(mm, dtype=np.uint8)
    assert huge_page_bytes(base.ctypes.data, 4096) <= 4096  # capped at the range
    assert huge_page_bytes(1, 4096) == 0  # no mapping there
    del base
    mm.close()


@pytest.mark.parametrize("shared", [False, True])
def test_host_table_reports_its_memory_and_serves_the_same_rows(tmp_path, shared):
    m = TableManifest(codec="fp8_e4m3", dim=256, head_rows=(3000, 2000, 1000))
    path = create_random_table(tmp_path / "t.tgram", m, seed=2, std=0.02, progress=False)
    ids = np.stack([np.arange(0, 3000, 7)[:400] % n for n in (3000, 2000, 1000)], axis=1).astype(np.int64)
    host = TieredTable(path, tier="host", shared=shared)
    file = TieredTable(path, tier="file")
    try:
        s = host.tier.stats()
        assert s["bytes"] == m.data_bytes and s["shared"] == shared
        assert 0 <= s["huge_page_bytes"] <= s["bytes"] and s["huge_pages"] == (s["huge_page_bytes"] >= s["bytes"] // 2
                                                                             and s["huge_page_bytes"] > 0)
        assert s["thp"] == thp_mode(shared=shared)
        if not shared:
            assert host.tier.data.ctypes.data % HUGE_PAGE == 0
        assert torch.equal(host.lookup(ids), file.lookup(ids))
    finally:
        host.close()
        file.close()
        if shared:
            from tiergram.tiers.host import remove_shared_copies

            remove_shared_copies()


def test_bench_lookup_table_gib_sizes_the_table_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERGRAM_CACHE", str(tmp_path))
    cfg = lookup.LookupBenchConfig(table_gib=0.01, positions=64, rounds=1, seconds=0.01, dists=("uniform",))
    assert cfg.rows_per_head == int(0.01 * 2**30) // 4096 * 15 // 24
    res = lookup.run(cfg, progress=False)
    d = res.per_dist["uniform"]
    assert d["limit_rows_per_s"] > 0 and d["tiergram_rows_per_s"] > 0
    assert d["vs_limit"] == d["tiergram_rows_per_s"] / d["limit_rows_per_s"]
    assert d["limit_variant"].startswith("prefetch ") and d["limit_variant"].endswith(" stores")
    assert res.memory["bytes"] == res.table_bytes
    text = lookup.to_text(res)
    assert "same-bytes limit" in text and "264 B read, 1024 B written" in text and "on huge pages" in text
    assert not list((tmp_path / "bench").glob("*.tgram"))  # the --table-gib table does not stay behind
    with pytest.raises(ValueError, match="table-gib must be > 0"):
        lookup.LookupBenchConfig(table_gib=0)


# --- the native fp8 gather's paths and the same-bytes limit -----------------------------------------------------

FP8 = get_codec("fp8_e4m3")
PAGE = 4096
# scales around every branch of the decode: 2^-127 (subnormal results), the last inexact bf16 exponent (9) and the
# first exact one (10), the AVX2 path's one-multiply limit (134) and beyond (135), the AVX-512 path's (246, 247),
# overflow to inf (254), NaN (255)
EDGE_SCALES = [0, 1, 9, 10, 127, 134, 135, 246, 247, 254, 255]


class Fp8Rows:
    """Random fp8 rows (every code, NaN codes included) for `heads` heads, laid out in 4 KiB pages."""

    def __init__(self, dim: int, head_rows: tuple[int, ...], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dim, self.rb = dim, FP8.row_bytes(dim)
        self.rpp = (PAGE - 8) // self.rb
        self.head_rows = np.asarray(head_rows, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.head_rows)[:-1]]).astype(np.int64)
        n = int(self.head_rows.sum())
        self.rows = rng.integers(0, 256, (n, self.rb), dtype=np.uint8)
        self.rows[:, dim:] = rng.choice(EDGE_SCALES + list(range(110, 140)), (n, dim // 32))
        self.rows[1::2, :dim] &= 0x7E  # every other row without NaN codes: blocks with and without them
        self.rows[0, dim - 1] = 0x7F  # a NaN code in the last value (the tail of a row that is not whole 64 B)
        self.data = np.zeros(-(-n // self.rpp) * PAGE, np.uint8)
        for g in range(n):
            o = (g // self.rpp) * PAGE + (g % self.rpp) * self.rb
            self.data[o:o + self.rb] = self.rows[g]

    def args(self, ids: np.ndarray) -> tuple:
        return (self.data, ids, self.offsets, self.head_rows, PAGE, self.rpp, FP8.codec_id, self.dim)

    def expect(self, ids: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        g = (ids + self.offsets).reshape(-1)
        return FP8.decode(self.rows[g], self.dim, dtype).reshape(*ids.shape, self.dim)

    def ids(self, positions: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        ids = np.stack([rng.integers(0, r, positions) for r in self.head_rows], axis=-1).astype(np.int64)
        ids[0] = 0
        ids[-1] = self.head_rows - 1
        return ids


def native_gather(rows: Fp8Rows, ids: np.ndarray, dtype: torch.dtype, stream: bool | None) -> torch.Tensor:
    out = torch.empty((*ids.shape, rows.dim), dtype=dtype)
    view = (out.view(torch.uint16) if dtype == torch.bfloat16 else out).numpy()
    _native.gather(*rows.args(ids), view, stream)
    return out


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact, signed zeros and subnormals included; NaN where the reference has NaN."""
    iview = torch.int32 if got.dtype == torch.float32 else torch.int16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(iview)[~nan], want.view(iview)[~nan])


@pytest.mark.parametrize("dim", [32, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("stream", [None, False, True], ids=["auto", "normal", "streamed"])
def test_fp8_gather_every_store_path_matches_the_reference(dim, dtype, stream):
    rows = Fp8Rows(dim, (70, 33, 101), seed=dim)
    ids = rows.ids(200, seed=1)
    assert_same(native_gather(rows, ids, dtype, stream), rows.expect(ids, dtype))


def test_fp8_gather_streams_a_large_output_correctly():
    rows = Fp8Rows(256, (500, 300, 400), seed=3)
    ids = rows.ids(5500, seed=2)  # 16.1 MiB of float32, larger than the caches: the fence must cover every row
    assert_same(native_gather(rows, ids, torch.float32, True), rows.expect(ids, torch.float32))


def test_fp8_gather_default_stores_on_an_output_larger_than_the_last_level_cache():
    """The default (stream=None) streams outputs of at least the last-level cache's size: 40 MiB of float32 here,
    above the 32 MiB most machines' sysfs reports; every row must still equal the reference once the call returns."""
    rows = Fp8Rows(256, (500, 300, 400), seed=5)
    ids = rows.ids(13_700, seed=3)  # 13,700 x 3 rows x 1 KiB = 40.1 MiB
    assert_same(native_gather(rows, ids, torch.float32, None), rows.expect(ids, torch.float32))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), scales=st.lists(st.integers(0, 255), min_size=8, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), stream=st.booleans())
def test_fp8_gather_equals_reference_for_any_codes_and_scales(seed, scales, dtype, stream):
    rows = Fp8Rows(256, (9, 5), seed=seed)
    rows.rows[:, 256:] = scales
    for g in range(rows.rows.shape[0]):
        o = (g // rows.rpp) * PAGE + (g % rows.rpp) * rows.rb
        rows.data[o:o + rows.rb] = rows.rows[g]
    ids = rows.ids(12, seed=seed)
    assert_same(native_gather(rows, ids, dtype, stream), rows.expect(ids, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_gather_every_code_at_every_scale(dtype):
    """Exhaustive: row e holds the 256 codes in order (block b: codes 32b..32b+31), every block at scale e."""
    rows = Fp8Rows(256, (256,), seed=0)
    rows.rows[:, :256] = np.arange(256, dtype=np.uint8)
    rows.rows[:, 256:] = np.arange(256, dtype=np.uint8)[:, None]
    for g in range(256):
        o = (g // rows.rpp) * PAGE + (g % rows.rpp) * rows.rb
        rows.data[o:o + rows.rb] = rows.rows[g]
    ids = np.arange(256, dtype=np.int64)[:, None]
    for stream in (False, True):
        assert_same(native_gather(rows, ids, dtype, stream), rows.expect(ids, dtype))


def cyclic(row: np.ndarray, out_bytes: int) -> np.ndarray:
    """What the limit writes for one row: its 16-byte chunks in turn, the last one ending at the row's end."""
    starts = [min(16 * c, row.size - 16) for c in range(-(-row.size // 16))]
    return np.concatenate([row[starts[j % len(starts)]:][:16] for j in range(out_bytes // 16)])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ahead", [0, 8, 64])
def test_gather_limit_reads_every_row_byte_and_writes_the_output_bytes(stream, ahead):
    rows = Fp8Rows(256, (70, 33, 101), seed=4)
    ids = rows.ids(300, seed=5)
    out = np.zeros((*ids.shape, 1024), np.uint8)
    _native.gather_limit(*rows.args(ids), out, stream, ahead)
    g = (ids + rows.offsets).reshape(-1)
    want = np.stack([cyclic(rows.rows[i], 1024) for i in g]).reshape(out.shape)
    assert np.array_equal(out, want)
    assert set(np.unique(want[0, 0, :264])) <= set(np.unique(rows.rows[g[0]]))


def test_gather_limit_checks_every_id_and_its_arguments():
    rows = Fp8Rows(256, (70, 33, 101), seed=4)
    ids = rows.ids(10, seed=5)
    out = np.zeros((*ids.shape, 1024), np.uint8)
    bad = ids.copy()
    bad[7, 1] = 33
    with pytest.raises(IndexError, match=r"row id 33 out of range for head 1 \(rows 0..32\) at position 7"):
        _native.gather_limit(*rows.args(bad), out, False, 8)
    bad[7, 1] = -1
    with pytest.raises(IndexError, match="row id -1 out of range for head 1"):
        _native.gather_limit(*rows.args(bad), out, False, 8)
    with pytest.raises(ValueError, match="16-byte chunks"):
        _native.gather_limit(*rows.args(ids), np.zeros((*ids.shape, 1000), np.uint8), False, 8)
    with pytest.raises(ValueError, match="prefetch distance 65 above the maximum 64"):
        _native.gather_limit(*rows.args(ids), out, False, 65)
