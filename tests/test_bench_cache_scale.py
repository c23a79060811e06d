"""`bench cache` at real table sizes: V4.1 rows per head, capacities as fractions of the table."""

from __future__ import annotations

import numpy as np
import pytest

from tiergram.bench import cache as cb


def docs() -> cb.TokenDocs:
    rng = np.random.default_rng(3)
    return cb.TokenDocs("synthetic zipf", [np.minimum(rng.zipf(1.3, 300), 499).astype(np.int64) for _ in range(8)],
                        500, pad_id=0)


def test_rows_per_head_and_table_capacities():
    cfg = cb.CacheBenchConfig(max_tokens=2000, prompt_len=48, decode_len=16, rows_per_head=16_000_000,
                              capacity_of="table", capacities=(0.0001, 0.01), policies=("lru", "belady"), plot="")
    res = cb.run(cfg, docs=docs(), progress=False)
    table = res.stream["table_rows"]
    assert 24 * 16_000_000 <= table < 24 * 16_000_000 + 24 * 2000  # 24 distinct primes just above 16M
    assert res.capacity_rows == {"0.0001": round(1e-4 * table), "0.01": round(0.01 * table)}
    # a cache of 1% of a V4.1 table holds every row a short stream touches: only first touches miss
    assert res.hit_rate["lru"]["0.01"] == pytest.approx(res.stream["reuse"])
    assert res.hit_rate["belady"]["0.0001"] <= res.stream["reuse"] + 1e-12


def test_bad_capacity_base_is_refused():
    with pytest.raises(ValueError, match="capacity_of must be 'touched' or 'table'"):
        cb.run(cb.CacheBenchConfig(max_tokens=200, capacity_of="rows", plot=""), docs=docs(), progress=False)
