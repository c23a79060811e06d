"""DeviceTable (device / host-UVA / file tiers, HBM row cache, prefetch tickets) against the reference codecs.

Without a GPU the "device" is the CPU and the Triton kernel runs interpreted; the same tests run compiled on a GPU.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import CancelledError

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]' on Linux x86_64)")

from tiergram.codecs import get_codec  # noqa: E402
from tiergram.format import TableFile, TableManifest, create_table, random_values  # noqa: E402
from tiergram.kernels import RowLayout  # noqa: E402
from tiergram.store.device_cache import DeviceRowCache  # noqa: E402
from tiergram.store.device_table import DeviceTable  # noqa: E402
from tiergram.tiers.device import DEVICE_BYTES_ENV, device_memory_budget  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device()) if GPU else torch.device("cpu")
CODECS = ["fp32", "bf16", "int8", "fp8_e4m3"]
HEAD_ROWS = (40, 9, 70)
DIM = 64
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

CONFIGS = {  # name -> DeviceTable keyword arguments
    "device": {"tier": "device"},
    "host": {"tier": "host"},
    "file": {"tier": "file", "file_mode": "buffered"},
    "host+lru": {"tier": "host", "cache_bytes": 24 * 300, "cache_policy": "lru"},
    "file+lfu": {"tier": "file", "file_mode": "buffered", "cache_bytes": 24 * 300, "cache_policy": "lfu"},
    "host+lookahead": {"tier": "host", "cache_bytes": 24 * 300, "cache_policy": "lookahead"},
}


def check_device_tags(cache: DeviceRowCache) -> None:
    """The cache's invariants hold and its device tag array matches the host index."""
    cache.check_invariants()
    assert np.array_equal(cache.tags.cpu().numpy(), cache.slot_key), "device tags disagree with the host index"


class Table:
    """A table file and the reference decode of each of its rows."""

    def __init__(self, path, codec: str):
        self.path = path
        m = TableManifest(codec=codec, dim=DIM, head_rows=HEAD_ROWS, page_size=1024)
        create_table(path, m, random_values(DIM, seed=len(codec)), progress=False)
        t = TableFile.open(path)
        data, lay = t.read_data(), RowLayout.of(m)
        raw = np.stack([data[lay.row_offset(g):lay.row_offset(g) + lay.row_bytes] for g in range(m.total_rows)])
        self.ref = get_codec(codec).decode(raw, DIM)
        self.offsets = t.head_offsets

    def expect(self, ids: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.ref[torch.from_numpy(ids + self.offsets)].to(dtype)


def draw(shape: tuple[int, ...], seed: int, hot: int = 0) -> np.ndarray:
    """ids [*shape, 3]; with `hot`, each head draws from only its first `hot` rows (cache hits)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, min(hot, r) if hot else r, shape) for r in HEAD_ROWS], axis=-1)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.cpu(), want)


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Table]:
    d = tmp_path_factory.mktemp("device_store")
    return {c: Table(d / f"{c}.tgram", c) for c in CODECS}


def open_table(t: Table, config: str, **kw) -> DeviceTable:
    return DeviceTable(t.path, device=DEV, kernel_backend="triton", **{**CONFIGS[config], **kw})


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("codec", CODECS)
def test_lookup_and_prefetch_match_reference(tables, config, codec):
    t = tables[codec]
    dtype = torch.bfloat16 if codec in ("int8", "bf16") else torch.float32
    with open_table(t, config, dtype=dtype) as dt:
        assert (dt.num_heads, dt.dim) == (3, DIM)
        a, b = draw((2, 5), seed=1, hot=8), draw((7,), seed=2, hot=8)
        assert same(dt.lookup(a), t.expect(a, dtype))
        tickets = [dt.prefetch(x) for x in (b, a, b)]  # in flight together, served in order
        for x, tk in zip((b, a, b), tickets, strict=True):
            assert same(tk.wait(), t.expect(x, dtype)) and tk.done()
        for shape in [(0, 3), (2, 0, 3)]:
            assert tuple(dt.lookup(np.zeros(shape, np.int64)).shape) == (*shape, DIM)
        s = dt.stats()
        assert s["lookups"] == 6 and s["ids"] == (10 + 7 + 10 + 7) * 3
        if dt.cache is not None:
            assert s["hits"] > 0 and s["cache"]["rows"] > 0
            check_device_tags(dt.cache)


@pytest.mark.parametrize("config", ["host+lru", "file+lfu"])
def test_small_cache_churn_stays_correct(tables, config):
    """More misses per call than slots: rows admitted and evicted within one call are never served stale."""
    t = tables["fp8_e4m3"]
    with open_table(t, config, cache_bytes=5 * 66) as dt:
        for seed in range(4):
            ids = draw((6,), seed=seed, hot=12)
            assert same(dt.lookup(ids), t.expect(ids))
            check_device_tags(dt.cache)
        assert dt.stats()["cache"]["evicted"] > 0


def test_repeated_lookup_hits_the_cache(tables):
    t = tables["int8"]
    with open_table(t, "host+lru") as dt:
        ids = draw((4,), seed=3)
        dt.lookup(ids)
        before = dt.stats()
        assert same(dt.lookup(ids), t.expect(ids))
        after = dt.stats()
        assert after["hits"] - before["hits"] == after["unique_ids"] - before["unique_ids"]
        assert after["misses"] == before["misses"]


def test_cancel_pending_prefetch_retires_lookahead_batch(tables):
    t = tables["bf16"]
    with open_table(t, "host+lookahead") as dt:
        gate = threading.Event()
        original = dt._fetch
        dt._fetch = lambda *a: (gate.wait(5), original(*a))[1]
        first = dt.prefetch(draw((3,), seed=1))
        second = dt.prefetch(draw((3,), seed=2))
        assert second.cancel() and second.cancelled
        gate.set()
        assert same(first.wait(), t.expect(draw((3,), seed=1)))
        assert dt.cache.policy._batches == {}  # both announced batches retired
        with pytest.raises(CancelledError):
            second.wait()


@pytest.mark.parametrize("config", ["host", "host+lru"])
def test_out_of_range_refused_in_caller(tables, config):
    t = tables["fp32"]
    with open_table(t, config) as dt:
        ids = np.zeros((4, 3), np.int64)
        ids[2, 1] = 9
        with pytest.raises(IndexError, match="row id 9 out of range for head 1 .*at position 2"):
            dt.prefetch(ids)
        with pytest.raises(IndexError, match="row id -1 out of range for head 0"):
            dt.lookup(torch.tensor([[-1, 0, 0]]))
        with pytest.raises(ValueError, match="one id per head"):
            dt.lookup(np.zeros((2, 2), np.int64))
        with pytest.raises(ValueError, match="integers"):
            dt.lookup(np.zeros((2, 3), np.float32))
        assert dt.stats()["lookups"] == 0


def test_staging_buffers_have_stable_addresses(tables):
    t = tables["fp8_e4m3"]
    with open_table(t, "host", staging_tokens=8, n_staging=2) as dt:
        rows = [dt.prefetch(draw((5,), seed=s)).wait() for s in range(3)]
        assert rows[0].data_ptr() == rows[2].data_ptr() != rows[1].data_ptr()
        assert same(rows[2], t.expect(draw((5,), seed=2)))
        big = dt.prefetch(draw((9,), seed=4)).wait()  # more positions than staged: a fresh buffer
        assert big.data_ptr() not in (rows[0].data_ptr(), rows[1].data_ptr())
        out = torch.full((2, 3, DIM), 7.0, device=DEV)
        assert dt.lookup(draw((2,), seed=5), out=out) is out and same(out, t.expect(draw((2,), seed=5)))
        with pytest.raises(ValueError, match="out must be"):
            dt.lookup(draw((2,), seed=5), out=torch.empty(2, 3, DIM + 1, device=DEV))


def test_bad_configuration_refused(tables):
    t = tables["fp32"]
    with pytest.raises(ValueError, match="unknown tier"):
        DeviceTable(t.path, device=DEV, tier="ssd")
    with pytest.raises(ValueError, match="already in device memory"):
        DeviceTable(t.path, device=DEV, tier="device", cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="dtype"):
        DeviceTable(t.path, device=DEV, dtype=torch.float16)


def test_device_row_cache_plan():
    c = DeviceRowCache(2, 8, DEV, "lru")
    slots, fill = c.plan(np.array([10, 11, 12]))
    assert slots.tolist() == [-1, -1, -1]
    assert fill.tolist() == [-1, 1, 0]  # 10 was admitted, then evicted for 12 in the same call
    c.set_tags(fill[fill >= 0], np.array([11, 12]))
    c.unpin(slots)
    check_device_tags(c)
    slots, fill = c.plan(np.array([11, 12, 13]))
    assert slots.tolist()[:2] == [1, 0] and fill.tolist()[:2] == [-1, -1]
    assert fill[2] == -1  # every slot pinned by this call's hits: 13 stays out
    c.unpin(slots)
    assert c.nbytes == 16 and tuple(c.slots.shape) == (2, 8)


def test_device_memory_budget_on_cpu(monkeypatch):
    monkeypatch.delenv(DEVICE_BYTES_ENV, raising=False)
    assert device_memory_budget("cpu") == 0
    assert device_memory_budget("cpu", cpu_bytes=123) == 123
    monkeypatch.setenv(DEVICE_BYTES_ENV, str(1 << 30))
    assert device_memory_budget("cpu") == 1 << 30
    with pytest.raises(ValueError, match=">= 0"):
        device_memory_budget("cpu", cpu_bytes=-1)


# --- GPU only -------------------------------------------------------------------------------------------


@gpu_only
def test_gpu_budget_and_resident_table(tables):
    free, _ = torch.cuda.mem_get_info(DEV)
    assert 0 < device_memory_budget(DEV) <= free + (64 << 20)
    t = tables["fp8_e4m3"]
    with open_table(t, "device") as dt:
        assert dt.data.is_cuda and dt.data.numel() == TableFile.open(t.path).manifest.data_bytes


@gpu_only
def test_gpu_prefetch_overlaps_on_a_side_stream(tables):
    """The fetch runs on the table's stream; wait() orders the caller's stream after it, without a host sync."""
    t = tables["fp8_e4m3"]
    with open_table(t, "host+lru", staging_tokens=64) as dt:
        ids = draw((64,), seed=7)
        tk = dt.prefetch(ids)
        rows = tk.wait()
        assert rows.is_cuda and dt._stream != torch.cuda.current_stream(DEV)
        doubled = rows * 2  # queued on the caller's stream after the event
        assert same(doubled, t.expect(ids) * 2)
        assert dt.pinned.registered and dt.pinned.tensor.is_pinned()


@gpu_only
def test_gpu_ids_on_the_device_may_be_dropped_after_prefetch(tables, monkeypatch):
    """The side stream reads GPU ids after prefetch returns: the caller's stream must not get their memory back
    (and overwrite it) before then. A sleep queued before the launch holds the read back."""
    import tiergram.kernels.gather as gather

    launch = gather.launch_unchecked

    def late_launch(*a, **kw):
        torch.cuda._sleep(200_000_000)  # on the side stream, the current one in the worker
        launch(*a, **kw)

    monkeypatch.setattr(gather, "launch_unchecked", late_launch)
    t = tables["fp8_e4m3"]
    with open_table(t, "host") as dt:
        ids = draw((512,), seed=9)
        dev_ids = torch.from_numpy(ids).to(DEV)
        tk = dt.prefetch(dev_ids)
        tk._future.result()  # enqueued; the worker dropped its reference
        time.sleep(0.05)
        del dev_ids
        junk = torch.zeros(ids.shape, dtype=torch.int64, device=DEV)  # same size, the caller's stream: id 0
        assert same(tk.wait(), t.expect(ids))
        del junk


@gpu_only
def test_gpu_shared_host_table_registers_read_only_mapping(tables):
    t = tables["int8"]
    with DeviceTable(t.path, device=DEV, tier="host", shared=True) as dt:
        assert not dt.pinned.array.flags.writeable and dt.pinned.registered
        ids = draw((16,), seed=8)
        assert same(dt.lookup(ids), t.expect(ids))


def test_gpu_bench_code_paths_on_cpu(tmp_path):
    """The GPU benchmark's code, tiny and on the CPU with the torch kernel path: figures are not checked."""
    from tiergram.bench import gpu

    cfg = gpu.GpuBenchConfig(device="cpu", backend="torch", **gpu.SMALL)
    report = gpu.run(cfg)
    for key in ("uva_row_copy", "uva_gather", "device_gather", "hbm_cache_gather", "hbm_cache_mixed"):
        assert report[key]["GBps"] > 0
    uva = report["uva_gather"]  # judged against the raw copy of the same rows measured in the same run
    assert uva["ratio_to_row_copy"] == pytest.approx(uva["GBps"] / report["uva_row_copy"]["GBps"])
    assert uva["meets_target"] == (uva["ratio_to_row_copy"] >= gpu.UVA_TARGET)
    assert report["store_step"]["ms_per_step"] > 0 and not report["errors"]
    d = report["decode"]  # the engine with each placement, on a random model of the tiny geometry
    assert d["model"] == "tiny (random)" and 0 < d["file_cache_bytes"]
    assert all(d[p]["tok_s"] > 0 for p in ("device", "host", "file")) and d["file"]["cache_hit_rate"] is not None
    assert d["host_vs_device"] == pytest.approx(d["host"]["tok_s"] / d["device"]["tok_s"])
    assert d["host_meets_target"] == (d["host_vs_device"] >= 0.97)
    assert d["file"]["file_mode"] == "direct" and "file_mode" not in d["host"]  # the mode the file tier read in
    assert "pinned H2D" in gpu.summary(report)
    assert gpu.main(["--device", "cpu", "--small", "--backend", "torch", "--out", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.json").is_file()


def test_gpu_bench_reports_a_failed_measurement_and_goes_on(tmp_path, monkeypatch):
    """One call on a GPU machine: a measurement that raises (e.g. registration refused) must not lose the others,
    and the JSON is written after every measurement (a run killed by its timeout keeps what it measured)."""
    import json

    from tiergram.bench import gpu

    def refuse(*a, **kw):
        raise RuntimeError("cudaHostRegister failed")

    monkeypatch.setattr(gpu, "PinnedHost", refuse)
    monkeypatch.setattr(gpu, "store_step", refuse)
    seen = []
    cfg = gpu.GpuBenchConfig(device="cpu", table_mib=1, positions=16, copy_mib=1, cache_rows=256, reps=1,
                             store_rows=64, store_steps=2, backend="torch")
    monkeypatch.setattr(gpu, "decode_throughput", refuse)
    report = gpu.run(cfg, progress=lambda r: seen.append(sorted(r)))
    assert report["device_gather"]["GBps"] > 0 and report["pinned_h2d_GBps"] > 0
    assert set(report["errors"]) == {"uva_row_copy", "uva_gather", "hbm_cache_gather", "hbm_cache_mixed",
                                     "store_step", "decode"}
    assert "cudaHostRegister failed" in report["uva_gather"]["error"] and len(seen) >= 3
    assert "uva_gather: registering the table failed" in gpu.summary(report)
    out = tmp_path / "r.json"
    assert gpu.main(["--device", "cpu", "--small", "--backend", "torch", "--out", str(out)]) == 1
    assert "store_step" in json.loads(out.read_text())["errors"]


@gpu_only
def test_gpu_engine_gives_the_cpu_engines_tokens_from_every_placement(tmp_path, monkeypatch):
    """LLMEngine on the GPU, which no CPU test runs: tables resident, in pinned host memory (UVA) and on file behind
    an HBM cache give the CPU engine's greedy tokens (the same fp8 rows), also with the degrade policy skipping
    decode reads; the KV pool is capped at what the sequences can use although the budget is the free GPU memory."""
    from test_engine import PROMPTS, make_model_dir

    from tiergram.engine import DegradePolicy, EngineConfig, LLMEngine, Placement, SamplingParams

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the short conv in full fp32, as on the CPU
    model_dir = make_model_dir(tmp_path / "model")
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(device: str, placement: Placement, degrade: DegradePolicy | None = None):
        cfg = EngineConfig(str(model_dir), placement, device=device, max_num_seqs=4, max_num_batched_tokens=16,
                           degrade=degrade)
        with LLMEngine(cfg) as eng:
            return eng.generate(PROMPTS, greedy), eng.metrics(), eng

    want = run("cpu", Placement("device"))[0]
    for name, placement in {"device": Placement("device"), "host": Placement("host"),
                            "file": Placement("file", cache_bytes=8192)}.items():
        got, m, eng = run("cuda", placement)
        assert got == want, name
        assert eng.device == DEV and eng.runner.k_cache.device == DEV
        assert m.budget["kv_blocks"] == 4 * m.budget["blocks_per_seq"] < m.budget["kv_blocks_affordable"]
        assert set(m.engram["bytes_read"]) == ({"cache", "file"} if name == "file" else {name}), name
        assert (m.engram["cache_hit_rate"] is not None) == (name == "file"), name
    skip = DegradePolicy(stall_bound_s=0.0)  # always over the bound: decode positions read no rows
    cpu_tokens, (gpu_tokens, m, _) = run("cpu", Placement("host"), skip)[0], run("cuda", Placement("host"), skip)
    assert gpu_tokens == cpu_tokens and m.skipped_rows > 0
    sampled = SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=7, ignore_eos=True)
    with LLMEngine(EngineConfig(str(model_dir), Placement("host"), device="cuda")) as eng:
        assert eng.generate(PROMPTS[:2], sampled) == eng.generate(PROMPTS[:2], sampled)
