"""tiergram.hashing: reference vectors from DeepSeek's Engram demo, chunked equivalence, validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.hashing import (
    NgramHasher,
    build_compression,
    engram_head_table_sizes,
    engram_normalizer,
    isprime,
    next_prime,
)

VECTORS = json.loads((Path(__file__).parent / "data" / "engram_hash_v1.json").read_text())
CASES = VECTORS["cases"]
GEOMETRY = VECTORS["geometry"]


def _from_case(case: dict) -> NgramHasher:
    cfg = case["config"]
    return NgramHasher(
        cfg["engram_vocab_size"], cfg["max_ngram_size"], cfg["n_head_per_ngram"], cfg["layer_ids"],
        cfg["pad_id"], cfg["seed"], compression=np.array(case["compression_lookup"]),
    )


# --- reference vectors ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_case(case: dict) -> None:
    h = _from_case(case)
    exp = case["expected"]
    assert h.compressed_vocab_size == case["compressed_vocab_size"]
    assert h.compressed_pad_id == case["compressed_pad_id"]
    assert h.compress(case["input_ids"]).tolist() == exp["compressed_input_ids"]
    rows = h.row_ids(np.array(case["input_ids"]))
    assert sorted(rows) == sorted(int(k) for k in exp["row_ids"])
    for key, want in exp["row_ids"].items():
        layer = int(key)
        assert h.multipliers[layer].dtype == np.int64
        assert h.multipliers[layer].tolist() == exp["multipliers"][key]
        assert h.head_table_sizes[layer] == exp["head_table_sizes"][key]
        assert rows[layer].dtype == np.int64
        assert rows[layer].shape == (*np.shape(case["input_ids"]), h.num_heads)
        np.testing.assert_array_equal(rows[layer], np.array(want))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_case_torch_input(case: dict) -> None:
    h = _from_case(case)
    rows = h.row_ids(torch.tensor(case["input_ids"], dtype=torch.int32))
    for key, want in case["expected"]["row_ids"].items():
        np.testing.assert_array_equal(rows[int(key)], np.array(want))


@pytest.mark.parametrize("geo", GEOMETRY, ids=[g["name"] for g in GEOMETRY])
@pytest.mark.parametrize("how", ["lookup", "size"])
def test_deepseek_geometry(geo: dict, how: str) -> None:
    cfg, c = geo["config"], geo["compressed_vocab_size"]
    source = {"compression": np.arange(c)} if how == "lookup" else {"compressed_vocab_size": c}
    h = NgramHasher(cfg["engram_vocab_size"], cfg["max_ngram_size"], cfg["n_head_per_ngram"],
                    cfg["layer_ids"], 0, cfg["seed"], **source)
    assert h.compressed_vocab_size == c
    assert {str(k): v.tolist() for k, v in h.multipliers.items()} == geo["expected"]["multipliers"]
    assert {str(k): v for k, v in h.head_table_sizes.items()} == geo["expected"]["head_table_sizes"]
    assert h.num_heads == 16 and len(h.head_sizes(cfg["layer_ids"][0])) == 16


# --- primes --------------------------------------------------------------------------------------


def test_isprime_matches_sieve() -> None:
    n = 20000
    sieve = np.ones(n, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p:: p] = False
    assert [isprime(i) for i in range(n)] == sieve.tolist()


def test_isprime_large_and_pseudoprimes() -> None:
    assert isprime(2**61 - 1) and isprime(646403) and isprime(1_000_000_007)
    assert not isprime((2**31 - 1) * 1_000_000_007) and not isprime(2**61 + 1)
    # Carmichael numbers and strong pseudoprimes to several small bases must be rejected.
    for composite in (561, 41041, 3215031751, 3825123056546413051, 318665857834031151167461):
        assert not isprime(composite)
    with pytest.raises(ValueError, match="exact only below"):
        isprime(10**25)


def test_next_prime_skips_taken() -> None:
    assert next_prime(7) == 11 and next_prime(10) == 11 and next_prime(10, {11, 13}) == 17


def test_head_table_sizes_distinct_and_above_vocab() -> None:
    sizes = engram_head_table_sizes([50, 50, 80], 4, 5, [0, 3, 9])
    flat = [p for layer in sizes.values() for order in layer for p in order]
    assert len(flat) == len(set(flat)) == 3 * 3 * 5
    assert all(isprime(p) for p in flat)
    for layer in sizes.values():
        assert min(layer[0]) > 49 and min(layer[2]) > 79


# --- streaming and chunking -----------------------------------------------------------------------

SMALL = NgramHasher([31, 37, 41], 4, 2, [1, 5], pad_id=3, seed=11,
                    compression=np.arange(64) // 2)  # 64 ids -> 32 compressed: every pair collides


def _reference_rows(h: NgramHasher, ids: np.ndarray) -> dict[int, np.ndarray]:
    """Straight transcription of the demo's hashing (np.pad shifts, per-head loop) for comparison."""
    x = h.lookup[ids]
    t = x.shape[1]
    shifts = [x] + [np.pad(x, ((0, 0), (k, 0)), constant_values=h.compressed_pad_id)[:, :t]
                    for k in range(1, h.max_ngram_size)]
    out = {}
    for layer in h.layer_ids:
        m, heads = h.multipliers[layer], []
        for n in range(2, h.max_ngram_size + 1):
            mix = shifts[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * m[k])
            heads += [mix % size for size in h.head_table_sizes[layer][n - 2]]
        out[layer] = np.stack(heads, axis=2)
    return out


seqs = st.lists(st.integers(0, 63), min_size=0, max_size=24)
batches = st.integers(1, 3).flatmap(
    lambda b: st.integers(0, 16).flatmap(
        lambda t: st.lists(st.lists(st.integers(0, 63), min_size=t, max_size=t), min_size=b, max_size=b)
    )
)


def _whole(ids: list[int]) -> dict[int, np.ndarray]:
    return {k: v[0] for k, v in SMALL.row_ids(np.array([ids], dtype=np.int64).reshape(1, -1)).items()}


@settings(max_examples=60, deadline=None)
@given(batches)
def test_row_ids_match_reference_deterministic_in_range(ids: list[list[int]]) -> None:
    arr = np.array(ids, dtype=np.int64).reshape(len(ids), -1)
    rows = SMALL.row_ids(arr)
    ref = _reference_rows(SMALL, arr)
    again = SMALL.row_ids(arr.copy())
    for layer in SMALL.layer_ids:
        assert rows[layer].shape == (*arr.shape, SMALL.num_heads)
        np.testing.assert_array_equal(rows[layer], ref[layer])
        np.testing.assert_array_equal(rows[layer], again[layer])
        sizes = np.array(SMALL.head_sizes(layer))
        assert (rows[layer] >= 0).all() and (rows[layer] < sizes).all()


@settings(max_examples=60, deadline=None)
@given(seqs)
def test_token_by_token_equals_whole(ids: list[int]) -> None:
    whole = _whole(ids)
    k = SMALL.max_ngram_size - 1
    stepped = [SMALL.row_ids_with_history([[tok]], [ids[max(0, i - k):i]]) for i, tok in enumerate(ids)]
    for layer in SMALL.layer_ids:
        got = np.array([r[layer][0, 0] for r in stepped]).reshape(len(ids), SMALL.num_heads)
        np.testing.assert_array_equal(got, whole[layer])


@settings(max_examples=60, deadline=None)
@given(seqs, st.data())
def test_random_chunks_equal_whole(ids: list[int], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=5)))
    bounds = [0, *cuts, len(ids)]
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    parts = [SMALL.row_ids_with_history([ids[a:b]], [ids[:a]]) for a, b in spans]
    whole = _whole(ids)
    for layer in SMALL.layer_ids:
        np.testing.assert_array_equal(np.concatenate([p[layer][0] for p in parts]), whole[layer])


@settings(max_examples=60, deadline=None)
@given(seqs, st.data())
def test_row_ids_with_history_equals_whole_suffix(ids: list[int], data: st.DataObject) -> None:
    split = data.draw(st.integers(0, len(ids)))
    # Any history length works: longer than max_ngram_size-1 is trimmed, shorter is pad-extended.
    k = data.draw(st.integers(0, split))
    arr = np.array(ids, dtype=np.int64)
    chunk = SMALL.row_ids_with_history(arr[None, split:], arr[None, split - k: split])
    whole = _whole(ids)
    # With k < split the true history is longer than given, so only k >= max_ngram_size-1 must match.
    if k >= SMALL.max_ngram_size - 1 or k == split:
        for layer in SMALL.layer_ids:
            np.testing.assert_array_equal(chunk[layer][0], whole[layer][split:])


def test_short_history_is_pad_equivalent() -> None:
    ids = np.array([[5, 9, 12, 40, 41]])
    padded = np.array([[SMALL.pad_id, SMALL.pad_id, 7]])
    a = SMALL.row_ids_with_history(ids, np.array([[7]]))
    b = SMALL.row_ids_with_history(ids, padded)
    c = SMALL.row_ids(np.array([[7, 5, 9, 12, 40, 41]]))
    for layer in SMALL.layer_ids:
        np.testing.assert_array_equal(a[layer], b[layer])
        np.testing.assert_array_equal(a[layer], c[layer][:, 1:])


def test_empty_sequence() -> None:
    rows = SMALL.row_ids(np.zeros((2, 0), dtype=np.int64))
    assert rows[1].shape == (2, 0, SMALL.num_heads)


# --- config ---------------------------------------------------------------------------------------


def test_config_round_trip() -> None:
    cfg = json.loads(json.dumps(SMALL.config()))
    back = NgramHasher.from_config(cfg, compression=np.arange(64) // 2)
    ids = np.array([[1, 2, 3, 60, 61, 0]])
    for layer in SMALL.layer_ids:
        np.testing.assert_array_equal(back.row_ids(ids)[layer], SMALL.row_ids(ids)[layer])
    other = np.arange(64) // 2
    other[[10, 20]] = other[[20, 10]]  # same sizes and pad, different grouping
    with pytest.raises(ValueError, match="compression_sha256"):
        NgramHasher.from_config(cfg, compression=other)
    with pytest.raises(ValueError, match="pass compression"):
        NgramHasher.from_config(cfg)
    bad = dict(cfg, multipliers={"1": [1, 3, 5, 7], "5": cfg["multipliers"]["5"]})
    with pytest.raises(ValueError, match="multipliers"):
        NgramHasher.from_config(bad, compression=np.arange(64) // 2)


def test_config_identity_needs_no_lookup() -> None:
    h = NgramHasher([100, 100], 3, 2, [0], pad_id=0, compressed_vocab_size=90)
    cfg = json.loads(json.dumps(h.config()))
    assert cfg["compression"] == "identity"
    back = NgramHasher.from_config(cfg)
    assert back.head_table_sizes == h.head_table_sizes and back.vocab_size == 90


def test_config_head_table_sizes_must_match() -> None:
    cfg = json.loads(json.dumps(SMALL.config()))
    bad = dict(cfg, head_table_sizes={**cfg["head_table_sizes"], "1": [[7, 11, 13, 17], [19, 23, 29, 31]]})
    with pytest.raises(ValueError, match="head_table_sizes"):
        NgramHasher.from_config(bad, compression=np.arange(64) // 2)


# --- validation -----------------------------------------------------------------------------------

GOOD = dict(engram_vocab_size=[100, 100], max_ngram_size=3, n_head_per_ngram=2, layer_ids=[0, 4], pad_id=0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"engram_vocab_size": []}, "engram_vocab_size has 0 entries"),
        ({"engram_vocab_size": [100]}, "needs 2"),
        ({"max_ngram_size": 1, "engram_vocab_size": [100]}, "max_ngram_size must be >= 2"),
        ({"pad_id": 50}, "pad_id 50 is outside"),
        ({"pad_id": -1}, "pad_id -1 is outside"),
        ({"n_head_per_ngram": 0}, "n_head_per_ngram"),
        ({"layer_ids": []}, "layer_ids is empty"),
        ({"layer_ids": [1, 1]}, "distinct"),
    ],
)
def test_constructor_errors(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NgramHasher(**{**GOOD, **change}, compressed_vocab_size=50)


def test_compression_source_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        NgramHasher(**GOOD)
    with pytest.raises(ValueError, match="exactly one"):
        NgramHasher(**GOOD, compression=np.arange(5), compressed_vocab_size=5)
    with pytest.raises(ValueError, match="negative"):
        NgramHasher(**GOOD, compression=np.array([0, -1, 2]))
    with pytest.raises(ValueError, match="1-D"):
        NgramHasher(**GOOD, compression=np.zeros((2, 2), dtype=np.int64))


@pytest.mark.parametrize(
    "ids, match",
    [
        (np.array([[1, -2, 3]]), "negative id"),
        (np.array([[1, 64, 3]]), "id 64 >= vocabulary size 64"),
        (np.array([1, 2, 3]), "2-D"),
        (np.zeros((1, 2, 3), dtype=np.int64), "2-D"),
        (np.array([[1.0, 2.0]]), "integers"),
    ],
)
def test_row_ids_input_errors(ids: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SMALL.row_ids(ids)


def test_stream_and_history_errors() -> None:
    with pytest.raises(ValueError, match="history must be 2-D"):
        SMALL.row_ids_with_history(np.array([[1, 2]]), np.array([1]))
    with pytest.raises(ValueError, match="history must be 2-D"):
        SMALL.row_ids_with_history(np.array([[1, 2]]), np.array([[1], [2]]))
    with pytest.raises(ValueError, match="id 64"):
        SMALL.row_ids_with_history(np.array([[1, 2]]), np.array([[64]]))
    with pytest.raises(ValueError, match="not an Engram layer"):
        SMALL.head_sizes(2)


# --- tokenizer compression ------------------------------------------------------------------------

_WORDS = ("the The THE café cafe Café naïve naive résumé resume tea teapot over under cat dog "
          "runs ran Running quick brown fox jumps lazy and or but not a an of to in on").split()


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    lines = []
    for i in range(400):
        words = rng.choice(_WORDS, size=int(rng.integers(4, 12))).tolist()
        words[0] = ("The", "the", "Café", "café")[i % 4]  # line-initial forms without a leading space
        lines.append(" ".join(words) + ("\n" if i % 3 else "  \t\n"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return tok


def test_build_compression_on_bpe(bpe) -> None:
    lookup, c = build_compression(bpe)
    v = bpe.get_vocab_size(with_added_tokens=True)
    assert lookup.dtype == np.int64 and lookup.shape == (v,)
    assert sorted(set(lookup.tolist())) == list(range(c)) and c < v
    # ids are handed out in order of first appearance
    assert (lookup <= np.maximum.accumulate(np.concatenate([[-1], lookup[:-1]])) + 1).all()

    def same(*tokens: str) -> bool:
        ids = [bpe.token_to_id(t) for t in tokens]
        assert None not in ids, f"test corpus lacks one of {tokens}"
        return len({int(lookup[i]) for i in ids}) == 1

    assert same("The", "the", "THE", "Ġthe", "ĠThe")  # case and leading space fold together
    # byte-level forms of "café", "naïve", "résumé": accents stripped
    assert same("cafÃ©", "ĠcafÃ©", "Ġcafe")
    assert same("ĠnaÃ¯ve", "Ġnaive") and same("ĠrÃ©sumÃ©", "Ġresume")
    assert same("Ġ", "Ċ", "ĉ")  # lone whitespace tokens all become " "
    assert not same("the", "Ġ")
    assert lookup[bpe.token_to_id("<pad>")] != lookup[bpe.token_to_id("<s>")]

    # The grouping equals the spec applied one token at a time.
    norm = engram_normalizer()

    def key(tid: int) -> str:
        text = bpe.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            return bpe.id_to_token(tid)
        return norm.normalize_str(text) or text

    keys = [key(t) for t in range(v)]
    first = {}
    for k in keys:
        first.setdefault(k, len(first))
    assert lookup.tolist() == [first[k] for k in keys]
    assert any("\ufffd" in bpe.decode([t]) for t in range(v))  # the raw-token branch is exercised


def test_hasher_from_tokenizer(bpe) -> None:
    pad = bpe.token_to_id("<pad>")
    h = NgramHasher([200, 200], 3, 2, [1], pad_id=pad, tokenizer=bpe)
    lookup, c = build_compression(bpe)
    assert h.compressed_vocab_size == c and h.compressed_pad_id == lookup[pad]
    ids = np.array([bpe.encode("The quick brown fox").ids])
    ids2 = np.array([bpe.encode("the quick brown fox").ids])
    if ids.shape == ids2.shape:
        np.testing.assert_array_equal(h.row_ids(ids)[1], h.row_ids(ids2)[1])
