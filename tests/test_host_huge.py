"""Host tables on transparent huge pages: 2 MiB-aligned buffers advised MADV_HUGEPAGE, reported by stats()."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from tiergram.bench import lookup
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
    assert d["limit_rows_per_s"] > 0 and d["raw_copy_rows_per_s"] >= d["limit_rows_per_s"]
    assert res.memory["bytes"] == res.table_bytes
    assert "same-bytes limit" in lookup.to_text(res)
    assert not list((tmp_path / "bench").glob("*.tgram"))  # the --table-gib table does not stay behind
    with pytest.raises(ValueError, match="table-gib must be > 0"):
        lookup.LookupBenchConfig(table_gib=0)
