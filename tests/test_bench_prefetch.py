"""`tiergram bench prefetch` on a tiny table: JSON structure, stalls >= 0, overlapped rows equal synchronous ones."""

from __future__ import annotations

import json

import pytest
import torch

from tiergram.bench import prefetch
from tiergram.cli import main

TINY = ["--heads", "3", "--dim", "64", "--rows-per-head", "2000", "--positions", "4", "--steps", "6",
        "--warmup", "2", "--hidden", "32"]


@pytest.fixture(autouse=True)
def bench_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERGRAM_CACHE", str(tmp_path))
    return tmp_path


def test_prefetch_bench_json(capsys):
    threads = torch.get_num_threads()
    assert main(["bench", "prefetch", *TINY, "--json"]) == 0
    assert torch.get_num_threads() == threads  # the compute's setting is undone
    obj = json.loads(capsys.readouterr().out)
    assert set(obj["stores"]) == {"host", "file", "file+cache"}
    assert set(obj["exposed_ratio"]) == set(obj["stores"])
    for kind, d in obj["stores"].items():
        for key in ("stall_ms", "sync_stall_ms"):
            assert set(d[key]) == {"mean", "p50", "p90"}, (kind, key)
            assert all(v >= 0 for v in d[key].values()), (kind, key)
            assert d[key]["p50"] <= d[key]["p90"], (kind, key)
        assert d["sync_stall_ms"]["mean"] > 0 and d["compute_ms"] > 0 and d["layers"] >= 1
        assert d["exposed_ratio"] == pytest.approx(d["stall_ms"]["mean"] / d["sync_stall_ms"]["mean"])
        assert obj["exposed_ratio"][kind] == d["exposed_ratio"] >= 0
        assert d["rows_match"] is True, kind
    assert obj["stores"]["host"]["pages_per_step"] == 0
    assert obj["stores"]["file"]["pages_per_step"] > 0
    assert obj["stores"]["host"]["file_mode"] is None and obj["stores"]["file"]["file_mode"] == "direct"
    cached = obj["stores"]["file+cache"]
    assert 0 <= cached["hit_rate"] <= 1
    assert obj["config"]["torch_threads"] == 1 and obj["config"]["steps"] == 6


def test_prefetch_bench_text_and_fixed_compute(capsys):
    assert main(["bench", "prefetch", *TINY, "--stores", "file", "--compute-ms", "2", "--dist", "uniform"]) == 0
    out = capsys.readouterr().out
    assert "exposed stall" in out and "file" in out and "ROWS DIFFER" not in out
    assert "file reads: file direct" in out


def test_prefetch_bench_compute_sized():
    c = prefetch.Compute(8, 64)
    took = c.size_to(0.003)
    assert c.layers >= 1 and took > 0


@pytest.mark.parametrize("change,match", [({"stores": ("ssd",)}, "unknown store"),
                                          ({"cache_fraction": 0.0}, "cache_fraction"),
                                          ({"steps": 0}, "steps")])
def test_prefetch_bench_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        prefetch.run(prefetch.PrefetchBenchConfig(**change), progress=False)
