"""`tiergram bench cache` on a tiny synthetic stream: JSON shape, belady bounds, the plot, the scheduler."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import offline_default_sources

from tiergram.bench import cache as cb
from tiergram.cli import build_parser

CAPS = ("0.01", "0.05", "0.1", "0.25")


def zipf_docs(n_docs: int = 12, length: int = 300, vocab: int = 300, seed: int = 0) -> cb.TokenDocs:
    """Synthetic 'text': Zipfian token ids with repeated phrases, so n-grams recur like real text."""
    rng = np.random.default_rng(seed)
    phrases = [rng.zipf(1.3, size=rng.integers(3, 8)) % vocab for _ in range(40)]
    docs = []
    for _ in range(n_docs):
        parts, total = [], 0
        while total < length:
            part = phrases[rng.zipf(1.5) % len(phrases)] if rng.random() < 0.6 else rng.zipf(1.2, size=4) % vocab
            parts.append(part)
            total += part.size
        docs.append(np.concatenate(parts)[:length].astype(np.int64))
    return cb.TokenDocs("synthetic zipf", docs, vocab, pad_id=0)


def tiny_config(tmp_path, **kw) -> cb.CacheBenchConfig:
    base = dict(max_tokens=2400, prompt_len=48, decode_len=16, max_seqs=4, step_tokens=64, max_ngram_size=3,
                n_head_per_ngram=2, table_factor=16, plot=str(tmp_path / "hit.png"))
    return cb.CacheBenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache_bench")
    return cb.run(tiny_config(tmp), docs=zipf_docs(), progress=False)


def test_json_structure(tiny_result):
    obj = json.loads(cb.to_json(tiny_result))
    assert set(obj["hit_rate"]) == set(cb.DEFAULT_POLICIES)  # lru-hot is opt-in: it needs the corpus
    for rates in obj["hit_rate"].values():
        assert list(rates) == list(CAPS)
        assert all(0.0 <= r <= 1.0 for r in rates.values())
    s = obj["stream"]
    assert s["source"] == "synthetic zipf"
    assert s["accesses"] > s["distinct_rows"] > 0
    assert s["steps"] > 0 and s["tokens"] == 2400
    assert set(obj["lookahead_gap_points"]) == set(CAPS)
    assert isinstance(obj["target_met"], bool)
    assert list(obj["capacity_rows"].values()) == sorted(obj["capacity_rows"].values())


def test_belady_bounds_every_online_policy(tiny_result):
    hr = tiny_result.hit_rate
    for cap in CAPS:
        for name in cb.ONLINE:
            assert hr["belady"][cap] >= hr[name][cap] - 1e-12, (name, cap)


def test_belady_non_decreasing_in_capacity(tiny_result):
    rates = [tiny_result.hit_rate["belady"][c] for c in CAPS]
    assert rates == sorted(rates)
    assert rates[-1] > 0  # the synthetic stream has reuse


def test_plot_written_and_text(tiny_result, tmp_path):
    png = tiny_result.plot
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = cb.to_text(tiny_result)
    assert "synthetic zipf" in text and "belady gap" in text and png in text
    assert ("NOT MET" in text) == (not tiny_result.target_met)


def test_full_window_lookahead_close_to_belady(tmp_path):
    """Told the whole future, lookahead differs from the optimum only by batching (pins within a step)."""
    cfg = tiny_config(tmp_path, policies=("lookahead", "belady"), window=10**6, plot="")
    res = cb.run(cfg, docs=zipf_docs(), progress=False)
    assert res.plot is None
    for cap in CAPS:
        assert 0 <= res.hit_rate["belady"][cap] - res.hit_rate["lookahead"][cap] < 0.02


def test_schedule_covers_every_token_in_budget():
    cfg = cb.CacheBenchConfig(prompt_len=5, decode_len=3, max_seqs=2, step_tokens=4)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 10**6, size=(n, 2)) for n in (8, 8, 3, 1)]
    steps = cb.schedule(rows, cfg)
    assert set(np.concatenate(steps).tolist()) == set(np.concatenate([r.reshape(-1) for r in rows]).tolist())
    assert all(s.size <= 2 * cfg.step_tokens and (np.diff(s) > 0).all() for s in steps)
    # two sequences, each 5 prompt tokens and 3 decode steps: decoding alone takes 3 steps per request
    assert len(steps) >= 2 * cfg.decode_len


def test_make_requests_respects_budget():
    cfg = cb.CacheBenchConfig(prompt_len=6, decode_len=4, max_tokens=25)
    reqs = cb.make_requests([np.arange(23), np.arange(9)], cfg)
    assert [r.size for r in reqs] == [10, 10, 3, 2]
    assert sum(r.size for r in reqs) == 25


def test_cap_keys():
    assert [cb.cap_key(f) for f in (0.01, 0.05, 0.10, 0.25, 1.0)] == ["0.01", "0.05", "0.1", "0.25", "1"]


def test_bad_config_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown cache policy"):
        cb.run(tiny_config(tmp_path, policies=("mru",)), docs=zipf_docs(), progress=False)
    with pytest.raises(ValueError, match="capacity fractions"):
        cb.run(tiny_config(tmp_path, capacities=(0.0,)), docs=zipf_docs(), progress=False)
    with pytest.raises(ValueError, match="window"):
        cb.run(tiny_config(tmp_path, window=-1), docs=zipf_docs(), progress=False)


def test_cli_registers_cache_bench():
    args = build_parser().parse_args(["bench", "cache", "--window", "8", "--capacities", "0.1", "0.5", "--json"])
    assert args.func.__name__ == "cmd_cache"
    assert args.window == 8 and args.capacities == [0.1, 0.5] and args.json


def test_corpus_source_builds_a_missing_corpus(tmp_path, monkeypatch):
    """On a fresh machine the bench builds the corpus and its tokenizer first."""
    corpus = offline_default_sources(monkeypatch, tmp_path)
    docs = cb.load_docs(cb.CacheBenchConfig(max_tokens=500))
    assert (corpus / "tokenizer.json").is_file() and docs.source.startswith("corpus validation split")
    assert sum(len(d) for d in docs.docs) > 0


def test_lru_hot_never_hits_less_than_lru_and_hits_first_touches(tiny_result, tmp_path):
    """LRU is a stack algorithm: a preloaded prefix can only add hits (first touches of preloaded rows)."""
    docs = zipf_docs()
    cfg = tiny_config(tmp_path, policies=("lru", cb.HOT), plot="")
    hasher = cb.NgramHasher([16 * 300] * 2, 3, 2, [cfg.layer_id], 0, 0, compressed_vocab_size=300)
    steps = cb.schedule(cb.request_rows(cb.make_requests(docs.docs, cfg), hasher, cfg.layer_id), cfg)
    flat = np.concatenate(steps)
    keys, counts = np.unique(flat, return_counts=True)
    hot = keys[np.argsort(-counts, kind="stable")]  # the stream's own most read rows, hottest first
    res = cb.run_steps(steps, cfg, {"table_rows": 6 * 16 * 300}, hot=hot)
    for cap in res.capacity_rows:
        assert res.hit_rate[cb.HOT][cap] >= res.hit_rate["lru"][cap]
    # a cache holding every row the stream reads hits all but nothing: only the preload can hit a first touch
    full = cb.replay(steps, keys.size, "lru", hot=hot)
    assert full == 1.0 > res.hit_rate["lru"]["0.25"]
    assert cb.replay(steps, keys.size, "lru", hot=hot[::-1][:0]) == pytest.approx(cb.replay(steps, keys.size, "lru"))
    with pytest.raises(ValueError, match="needs the hot rows"):
        cb.run_steps(steps, cfg, {})


def test_lru_hot_counts_the_corpus_train_split(tmp_path):
    from support import fixture_corpus

    corpus = fixture_corpus(tmp_path / "cache")
    cfg = cb.CacheBenchConfig(corpus=str(corpus), max_tokens=3000, prompt_len=48, decode_len=16,
                              max_seqs=4, step_tokens=64, max_ngram_size=3, n_head_per_ngram=2, table_factor=16,
                              capacities=(0.05, 0.25), policies=("lru", cb.HOT), plot="")
    res = cb.run(cfg, progress=False)
    assert all(res.hit_rate[cb.HOT][c] >= res.hit_rate["lru"][c] for c in res.capacity_rows)
    assert "lru-hot" in cb.to_text(res)
    with pytest.raises(ValueError, match="train split"):
        cb.run(cb.CacheBenchConfig(**{**cfg.__dict__, "split": "train"}), progress=False)
    with pytest.raises(ValueError, match="train split"):
        cb.run(tiny_config(tmp_path, policies=(cb.HOT,)), docs=zipf_docs(), progress=False)
