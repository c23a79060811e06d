"""Hot rows: counting the rows a corpus reads (chunked = whole, ranked), the file format and its checks, the
engine preloading a cold cache with them (the hottest rows hit from the first step; tokens unchanged), the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import fixture_corpus
from test_engine import GREEDY, PROMPTS, drain, engine, expected, make_model_dir

import tiergram.model.hot_rows as hot_rows_module
from tiergram.cli import main
from tiergram.engine import Placement
from tiergram.hashing import NgramHasher
from tiergram.model.hot_rows import HotRows, count_hot_rows, load_hot_rows, save_hot_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hasher(seed: int = 0) -> NgramHasher:
    return NgramHasher([211, 223], 3, 2, [1, 4], pad_id=0, seed=seed, compressed_vocab_size=40)


def brute_counts(h: NgramHasher, tokens: np.ndarray) -> dict[int, np.ndarray]:
    """Every layer's per-key read count, from one hashing call over the whole stream."""
    out = {}
    for layer, ids in h.row_ids(tokens[None]).items():
        offsets = np.cumsum([0, *h.head_sizes(layer)])[:-1]
        out[layer] = np.bincount((ids[0] + offsets).reshape(-1), minlength=sum(h.head_sizes(layer)))
    return out


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 39), min_size=1, max_size=300), chunk=st.integers(1, 64),
       fraction=st.sampled_from([0.01, 0.1, 1.0]), dense=st.booleans())
def test_chunked_counting_equals_one_pass_and_ranks_most_read_first(tokens, chunk, fraction, dense,
                                                                   monkeypatch_module):
    monkeypatch_module.setattr(hot_rows_module, "CHUNK_TOKENS", chunk)  # chunk borders carry the n-gram history
    monkeypatch_module.setattr(hot_rows_module, "DENSE_ROWS", 1 << 26 if dense else 0)  # bincount or unique keys
    h, stream = hasher(), np.asarray(tokens, dtype=np.int64)
    hot = count_hot_rows(h, stream, max_fraction=fraction, progress=False)
    for layer, counts in brute_counts(h, stream).items():
        keys, got = hot.keys[layer], hot.counts[layer]
        assert np.array_equal(got, counts[keys])  # the counts are the rows' true read counts
        assert keys.size == min(np.count_nonzero(counts), max(1, int(fraction * counts.size)))
        assert np.all(got > 0) and np.all(np.diff(got) <= 0)  # most read first
        ties = np.diff(got) == 0
        assert np.all(np.diff(keys)[ties] > 0)  # equal counts: by key, so the file is deterministic
        read = np.flatnonzero(counts)
        ranked = read[np.lexsort((read, -counts[read]))]  # by count, then key
        assert np.array_equal(keys, ranked[:keys.size])  # the most read rows, ties at the cut by lowest key
        assert hot.reads[layer] == stream.size * h.num_heads


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_file_round_trips_and_refuses_other_hashing_and_other_files(tmp_path):
    h = hasher()
    hot = count_hot_rows(h, np.arange(500) % 37, progress=False, source="a test stream")
    path = save_hot_rows(hot, tmp_path / "hot.npz")
    back = load_hot_rows(path, h)
    assert (back.digest, back.tokens, back.source, back.reads) == (hot.digest, 500, "a test stream", hot.reads)
    for layer in hot.keys:
        assert np.array_equal(back.keys[layer], hot.keys[layer])
        assert np.array_equal(back.counts[layer], hot.counts[layer])
    with pytest.raises(ValueError, match="other hashing"):
        load_hot_rows(path, hasher(seed=1))
    with pytest.raises(FileNotFoundError, match="missing.npz: count one with `tiergram hot-rows"):
        load_hot_rows(tmp_path / "missing.npz")
    (tmp_path / "other.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="other.npz is not a hot-rows file"):
        load_hot_rows(tmp_path / "other.npz")
    with pytest.raises(ValueError, match="max_fraction"):
        count_hot_rows(h, np.arange(10), max_fraction=0, progress=False)


def test_per_head_splits_keys_into_row_ids_and_refuses_keys_outside_the_layer():
    h = hasher()
    hot = count_hot_rows(h, np.arange(400) % 31, progress=False)
    sizes = h.head_sizes(1)
    heads = hot.per_head(1, sizes, 50)
    offsets = np.cumsum([0, *sizes])[:-1]
    assert sorted(np.concatenate([r + offsets[i] for i, r in enumerate(heads)]).tolist()) == \
        sorted(hot.keys[1][:50].tolist())
    assert all(r.size == 0 or (r.min() >= 0 and r.max() < sizes[i]) for i, r in enumerate(heads))
    # keys on the head borders: the first and last row of every head land in that head
    ends = np.cumsum([0, *sizes])
    border = np.array(sorted({*ends[:-1].tolist(), *(ends[1:] - 1).tolist()}), dtype=np.int64)
    edge = HotRows(hot.digest, 1, "", {1: border}, {1: np.ones_like(border)}, {1: 1})
    assert [r.tolist() for r in edge.per_head(1, sizes, border.size)] == [[0, s - 1] for s in sizes]
    with pytest.raises(ValueError, match="outside the layer"):
        hot.per_head(1, [s // 100 for s in sizes], 50)
    with pytest.raises(ValueError, match="no Engram layer 7"):
        hot.per_head(7, sizes, 5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("hot") / "model")


def test_the_engine_preloads_the_hottest_rows_and_serves_the_same_tokens(model_dir, tmp_path):
    from tiergram.model.checkpoint import load_pretrained

    model, _ = load_pretrained(model_dir, tier="memory")
    stream = np.concatenate([np.asarray(p) for p in PROMPTS] * 3)
    path = save_hot_rows(count_hot_rows(model.hasher, stream, max_fraction=1.0, progress=False), tmp_path / "h.npz")
    hot = load_hot_rows(path)
    placement = Placement("file", codec="fp32", cache_bytes=40 * 128)  # fp32 rows of 32 values: 40 rows
    with engine(model_dir, placement, hot_rows=str(path)) as eng:
        for layer, src in eng.sources.items():
            capacity = src.stats()["cache"]["capacity_rows"]
            assert eng.hot_rows_preloaded[layer] == min(capacity, hot.keys[layer].size) == src.stats()["cache"]["rows"]
            # the hottest rows are in: looking them up reads no page
            sizes = model.hasher.head_sizes(layer)
            heads = hot.per_head(layer, sizes, capacity)
            n = min(r.size for r in heads)
            before = src.stats()["pages_read"]
            src.lookup(np.stack([r[:n] for r in heads], axis=1))
            assert src.stats()["pages_read"] == before
        m = eng.metrics()
        assert m.hot_rows_preloaded == sum(eng.hot_rows_preloaded.values()) > 0 and m.hot_rows_preload_s > 0
        from tiergram.server.metrics import ServerMetrics

        text = ServerMetrics(lambda: (m, 0, False, (0, 0, 0))).render()  # /metrics of this snapshot
        assert f"tiergram_engram_hot_rows_preloaded {float(m.hot_rows_preloaded)}" in text
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), p, GREEDY)
        got = drain(eng)
        assert [sum((o.new_token_ids for o in got[str(i)]), []) for i in range(len(PROMPTS))] == \
            expected(model_dir, PROMPTS)
    with pytest.raises(ValueError, match="other hashing"):  # counted for another model: refused at start
        other = save_hot_rows(count_hot_rows(hasher(), stream % 40, progress=False), tmp_path / "o.npz")
        engine(model_dir, placement, hot_rows=str(other))


def test_a_gpu_tables_hbm_cache_is_preloaded_too(model_dir, tmp_path):
    """On a GPU, host / file tables are DeviceTables with an HBM cache: the same preload fills it (here on the CPU)."""
    import torch

    from tiergram.engine.tables import export_dir_for, preload_hot_rows
    from tiergram.model.checkpoint import hasher_of, load_tokenizer_of
    from tiergram.model.model_dir import ModelDir
    from tiergram.store.device_table import DeviceTable

    src = export_dir_for(ModelDir.open(model_dir), [0, 1], {"fp32"}).path
    h = hasher_of(json.loads((model_dir / "config.json").read_text()), load_tokenizer_of(model_dir))
    stream = np.concatenate([np.asarray(p) for p in PROMPTS] * 2)
    path = save_hot_rows(count_hot_rows(h, stream, max_fraction=1.0, progress=False), tmp_path / "h.npz")
    hot = load_hot_rows(path)
    tables = {layer: DeviceTable(ModelDir.open(src).table_path(layer, "fp32"), device=torch.device("cpu"), tier="host",
                                 cache_bytes=30 * 128) for layer in (0, 1)}  # 30 fp32 rows of 32 values
    try:
        loaded = preload_hot_rows(tables, str(path), h)
        for layer, t in tables.items():
            cache = t.stats()["cache"]
            assert loaded[layer] == cache["rows"] == min(cache["capacity_rows"], hot.keys[layer].size)
            heads = hot.per_head(layer, h.head_sizes(layer), cache["capacity_rows"])
            n = min(r.size for r in heads)
            before = t.stats()["cache"]["hits"]
            t.lookup(np.stack([r[:n] for r in heads], axis=1))
            assert t.stats()["cache"]["hits"] - before == n * len(heads)  # every preloaded row hits
    finally:
        for t in tables.values():
            t.close()


def test_the_cli_counts_a_corpus_split_into_the_model_directory(model_dir, tmp_path, capsys):
    corpus = fixture_corpus(tmp_path / "cache", vocab_size=None)
    out = tmp_path / "rows.npz"
    assert main(["hot-rows", str(model_dir), "--corpus", str(corpus), "--tokens", "2k", "--max-fraction", "0.5",
                 "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "layer 0: the" in text and "layer 1: the" in text and str(out) in text
    from tiergram.model.checkpoint import hasher_of, load_tokenizer_of

    h = hasher_of(json.loads((model_dir / "config.json").read_text()), load_tokenizer_of(model_dir))
    hot = load_hot_rows(out, h)  # counted under the model's own hashing
    assert hot.tokens == 2000 and "train split" in hot.source
    assert all(hot.keys[layer].size <= 0.5 * sum(h.head_sizes(layer)) for layer in hot.keys)


def test_the_sweep_preloads_its_file_servers_and_compares_one_cold(model_dir, tmp_path):
    """--hot-rows: the file and mooncake servers' configurations name the model's hot-rows file; a variant with
    hot_rows = false is the same server started cold."""
    from tiergram.bench.serve_config import SweepConfig, Variant
    from tiergram.bench.serve_process import cache_budgets, server_settings
    from tiergram.model.export import export_model

    cold = {"file-cold": Variant("file", {"hot_rows": False})}
    cfg = SweepConfig(str(model_dir), placements=("host", "file"), hot_rows=True, variants=cold)
    assert cfg.labels() == ["host", "file", "file-cold"]
    remote = SweepConfig(str(model_dir), placements=("host", "file", "mooncake"), hot_rows=True,
                         variants={**cold, "mooncake-cold": Variant("mooncake", {"hot_rows": False})})
    assert remote.labels() == ["host", "file", "file-cold", "mooncake", "mooncake-cold"]
    assert remote.kind_of("mooncake-cold") == "mooncake" and remote.kind_of("file-cold") == "file"
    with pytest.raises(FileNotFoundError, match="tiergram hot-rows"):  # no MODEL_DIR/hot_rows.npz yet
        server_settings(cfg, "file", 4096, 256)
    tables = sorted(export_model(model_dir, "fp8_e4m3", tmp_path / "export", progress=False).glob("*.tgram"))
    caches = cache_budgets(cfg, tables)
    assert caches["file-cold"] == caches["file"] > 0  # the same cache, only not preloaded
    (model_dir / "hot_rows.npz").write_bytes(b"")  # the sweep passes the path; the server checks the file
    try:
        hot = {label: server_settings(cfg, label, caches[label], 256).engine.hot_rows for label in cfg.labels()}
    finally:
        (model_dir / "hot_rows.npz").unlink()
    assert hot == {"file": str(model_dir / "hot_rows.npz"), "file-cold": None, "host": None}
