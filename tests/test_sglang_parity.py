"""tiergram's hashing is exact against SGLang's Engram (DeepSeek-V4.1) on the same token streams.

SGLang's own functions come from the installed wheel (tests/sglang_reference.py); tiergram's row ids, placed in
the table by head offsets, must equal SGLang's hash ids for whole sequences, chunked prefill, prefix hits and
token-by-token decode, and the compressed token maps, multipliers and head primes must be identical.
Images (multimodal pad ids) are out of scope: V4.1's text path only.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import sglang_reference as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_reference import HFTokenizer, Request

from tiergram.format import TableManifest
from tiergram.hashing import NgramHasher, build_compression, engram_head_table_sizes, engram_multipliers

# DeepSeek-V4.1's Engram config.
V41 = SimpleNamespace(engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
                      engram_vocab_size=16_000_000, engram_num_embeddings=[384006168, 384016682])
PAD_ID = 2  # engram_pad_token_id: an original id, mapped through the token map
N1 = V41.engram_max_ngram_size - 1
SLOTS = 8
IDENTITY_VOCAB = 129_280  # DeepSeek-V3/V4's tokenizer size, for identity compression at a realistic vocabulary

# Text that makes the normaliser merge ids: accents, case, full-width and compatibility forms (NFKC), whitespace
# runs, multi-byte scripts and emoji (whose partial UTF-8 byte tokens decode to U+FFFD).
CORPUS = [
    "Café café CAFE cafe CAFÉ", "naïve NAÏVE naive résumé Résumé RESUME",
    "Ｆｕｌｌ　ｗｉｄｔｈ ＡＢＣ ａｂｃ １２３ 123", "ﬁne fine ﬂow flow ① 1 ㎏ kg ™ tm ½",
    "tabs\t\tand  spaces   \n\n\nnew\r\nlines\t \n", "Straße STRASSE Ελληνικά ΕΛΛΗΝΙΚΆ",
    "日本語のテキスト 中文 한국어 😀🚀🎉 ñandú Ñandú", "The the THE tHe", "   ", "\t", "\n\n",
]
SETTINGS = settings(max_examples=40, deadline=None)


def small_bpe() -> Any:
    """A byte-level BPE of ~500 ids with DeepSeek-style special tokens (pad = id 2) and added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"])
    tok.train_from_iterator(CORPUS * 20, trainer)
    # Full-width bars fold under NFKC, so "<｜User｜>" and "<|user|>" share a compressed id; so do the two hellos.
    tok.add_special_tokens(["<｜User｜>", "<｜Assistant｜>", "<|user|>"])
    tok.add_tokens([AddedToken(" ", normalized=False), AddedToken("ＴＨＥ", normalized=False), "Hello", "HELLO"])
    return tok


class IdentityTokenizer:
    """Every id decodes to its own lowercase text, so SGLang's token map is the identity."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.backend_tokenizer = self

    def __len__(self) -> int:
        return self.size

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return f"t{ids[0]}"

    def id_to_token(self, token_id: int) -> str:
        return f"t{token_id}"


@pytest.fixture(scope="module")
def sglang() -> SimpleNamespace:
    """SGLang's hashing code from the installed wheel; a missing install fails (never skips) with the fix."""
    try:
        return ref.load()
    except ref.SGLangMissing as err:
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def layout(sglang):
    return sglang.EngramLayout.from_config(V41)


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return HFTokenizer(small_bpe())


def _tiergram(**compression: Any) -> NgramHasher:
    return NgramHasher([V41.engram_vocab_size] * N1, V41.engram_max_ngram_size, V41.engram_n_heads,
                       V41.engram_layer_ids, PAD_ID, 0, **compression)


def head_offsets(hasher: NgramHasher) -> np.ndarray:
    """Each layer's head offsets in its table file, [layers, H]."""
    return np.array([TableManifest(codec="fp32", dim=8, head_rows=tuple(hasher.head_sizes(layer))).head_offsets
                     for layer in hasher.layer_ids])


@pytest.fixture(scope="module", params=["bpe", "identity"])
def pair(request, sglang, layout, bpe) -> SimpleNamespace:
    """(SGLang's EngramHasher, tiergram's NgramHasher, table offsets, token strategy) for one compression."""
    if request.param == "bpe":
        hasher, tokenizer = _tiergram(tokenizer=bpe), bpe
        cid = hasher.lookup
        merged = [t for t in range(len(cid)) if (cid == cid[t]).sum() > 1]
        special = [PAD_ID, *range(len(cid) - 7, len(cid))]  # pad, and the special and added tokens
        tokens = st.one_of(st.integers(0, len(cid) - 1), st.sampled_from(merged + special))
    else:
        hasher, tokenizer = _tiergram(compressed_vocab_size=IDENTITY_VOCAB), IdentityTokenizer(IDENTITY_VOCAB)
        tokens = st.one_of(st.integers(0, IDENTITY_VOCAB - 1), st.sampled_from([0, 1, PAD_ID, IDENTITY_VOCAB - 1]))
    engine = sglang.EngramHasher(layout, tokenizer, PAD_ID, hasher.compressed_vocab_size)
    return SimpleNamespace(engine=engine, hasher=hasher, offsets=head_offsets(hasher), tokens=tokens)


def fresh(engine: Any, stale: int) -> None:
    """New request-slot history, filled with a stale token that the position mask must hide."""
    engine.init_history(SLOTS, "cpu")
    engine.history.fill_(stale)


def table_rows(p: SimpleNamespace, ids: dict[int, np.ndarray]) -> np.ndarray:
    """tiergram's head-local ids {layer: [T, H]} -> table rows [T, layers, H], SGLang's hash id layout."""
    return np.stack([ids[layer] + p.offsets[i] for i, layer in enumerate(p.hasher.layer_ids)], axis=1)


def assert_same(sglang_ids: torch.Tensor, tiergram_rows: np.ndarray) -> None:
    assert sglang_ids.dtype == torch.int64
    np.testing.assert_array_equal(sglang_ids.numpy(), tiergram_rows)


# --- parameters ------------------------------------------------------------------------------------


def test_v41_layout(layout) -> None:
    """Head primes, per-layer table sizes and head offsets of V4.1 agree with SGLang's EngramLayout."""
    sizes = engram_head_table_sizes([V41.engram_vocab_size] * N1, V41.engram_max_ngram_size, V41.engram_n_heads,
                                    V41.engram_layer_ids)
    assert layout.primes == tuple(tuple(tuple(o) for o in sizes[layer]) for layer in V41.engram_layer_ids)
    hasher = _tiergram(compressed_vocab_size=IDENTITY_VOCAB)
    for i, layer in enumerate(V41.engram_layer_ids):
        bounds = layout.column_bounds(i)
        assert sum(hasher.head_sizes(layer)) == bounds[-1] == V41.engram_num_embeddings[i]
        assert tuple(head_offsets(hasher)[i]) == bounds[:-1]


@given(vocab=st.integers(2, 5000), n=st.integers(2, 5), heads=st.integers(1, 4),
       layers=st.lists(st.integers(0, 60), min_size=1, max_size=3, unique=True))
@SETTINGS
def test_head_primes(sglang, vocab, n, heads, layers) -> None:
    """engram_head_table_sizes draws SGLang's primes for any geometry (one vocab size for every order)."""
    cfg = SimpleNamespace(engram_layer_ids=layers, engram_max_ngram_size=n, engram_n_heads=heads,
                          engram_vocab_size=vocab, engram_num_embeddings=[0] * len(layers), engram_head_dim=1)
    sizes = engram_head_table_sizes([vocab] * (n - 1), n, heads, layers)
    assert sglang.EngramLayout.from_config(cfg).primes == tuple(
        tuple(tuple(o) for o in sizes[layer]) for layer in layers)


@given(c=st.one_of(st.integers(1, 2**20), st.integers(1, 2**62)), layer=st.integers(0, 200))
@SETTINGS
def test_multipliers(sglang, c, layer) -> None:
    """engram_multipliers (seed 0) equals SGLang's compute_hash_multipliers for any compressed vocabulary."""
    got = sglang.compute_hash_multipliers((layer,), V41.engram_max_ngram_size, c)
    np.testing.assert_array_equal(got[0].numpy(), engram_multipliers(0, layer, V41.engram_max_ngram_size, c))


def test_token_map(sglang, bpe) -> None:
    """The compressed token map of a locally built tokenizer is SGLang's, and it does merge ids."""
    want, c = sglang.build_compressed_token_map(bpe)
    lookup, got_c = build_compression(bpe)
    assert (lookup.tolist(), got_c) == (want, c)
    backend = bpe.backend_tokenizer
    assert got_c < len(bpe)  # the normaliser merged ids
    assert any("\ufffd" in backend.decode([t], skip_special_tokens=False) for t in range(len(bpe)))
    same = [backend.token_to_id(t) for t in ("<｜User｜>", "<|user|>")]
    assert want[same[0]] == want[same[1]]
    hasher = _tiergram(tokenizer=bpe)
    assert hasher.lookup.tolist() == want and hasher.compressed_vocab_size == c
    assert hasher.compressed_pad_id == want[PAD_ID]


def test_engine_buffers(pair) -> None:
    """SGLang's EngramHasher, built from the same tokenizer, holds tiergram's map, pad, multipliers, primes, offsets."""
    e, h = pair.engine, pair.hasher
    assert e.token_map.tolist() == h.lookup.tolist() and e.pad_id == h.compressed_pad_id
    np.testing.assert_array_equal(e.multipliers.numpy(), np.stack([h.multipliers[layer] for layer in h.layer_ids]))
    assert e.primes.tolist() == [h.head_table_sizes[layer] for layer in h.layer_ids]
    np.testing.assert_array_equal(e.offsets.numpy(), pair.offsets)


def test_identity_map_at_large_vocab(sglang) -> None:
    """The identity tokenizer gives SGLang an identity map: the large-vocabulary case is uncompressed on both sides."""
    assert sglang.build_compressed_token_map(IdentityTokenizer(IDENTITY_VOCAB)) == (
        list(range(IDENTITY_VOCAB)), IDENTITY_VOCAB)


# --- row ids on token streams ----------------------------------------------------------------------


def streams(p: SimpleNamespace, min_len: int, max_len: int, max_reqs: int = 4) -> st.SearchStrategy:
    return st.lists(st.lists(p.tokens, min_size=min_len, max_size=max_len), min_size=1, max_size=max_reqs)


@given(data=st.data())
@SETTINGS
def test_whole_sequences(pair, data) -> None:
    """Requests of different lengths (shorter than n - 1 too) packed in one extend from position 0 equal tiergram's
    row_ids, both per request and as one right-padded batch."""
    p = pair
    reqs = data.draw(streams(p, 1, 20))
    fresh(p.engine, data.draw(p.tokens))
    got = ref.extend(p.engine, [Request(i, s, 0) for i, s in enumerate(reqs)])
    width = max(map(len, reqs))
    padded = np.array([s + [PAD_ID] * (width - len(s)) for s in reqs])
    batch = p.hasher.row_ids(padded)
    for i, s in enumerate(reqs):
        assert_same(got[i], table_rows(p, {k: v[0] for k, v in p.hasher.row_ids(np.array([s])).items()}))
        assert_same(got[i], table_rows(p, {k: v[i, :len(s)] for k, v in batch.items()}))


@st.composite
def chunked(draw, p: SimpleNamespace) -> list[list[list[int]]]:
    """Requests, each split into non-empty chunks at arbitrary points."""
    out = []
    for s in draw(streams(p, 1, 30, 3)):
        cuts = sorted(draw(st.sets(st.integers(1, len(s) - 1), max_size=4))) if len(s) > 1 else []
        out.append([s[a:b] for a, b in zip([0, *cuts], [*cuts, len(s)], strict=True)])
    return out


@given(data=st.data())
@SETTINGS
def test_chunked_prefill(pair, data) -> None:
    """Chunked prefill, each round one extend holding every unfinished request's next chunk (history from the
    slots SGLang committed) equals tiergram's row_ids_with_history and whole-sequence ids."""
    p = pair
    reqs = data.draw(chunked(p))
    fresh(p.engine, data.draw(p.tokens))
    got: list[list[torch.Tensor]] = [[] for _ in reqs]
    for r in range(max(map(len, reqs))):
        live = [i for i, chunks in enumerate(reqs) if r < len(chunks)]
        batch = [Request(i, reqs[i][r], sum(map(len, reqs[i][:r]))) for i in live]
        for i, ids in zip(live, ref.extend(p.engine, batch), strict=True):
            got[i].append(ids)
    for chunks, ids in zip(reqs, got, strict=True):
        prefix = []
        for chunk, chunk_ids in zip(chunks, ids, strict=True):
            with_history = p.hasher.row_ids_with_history([chunk], [prefix] if prefix else None)
            assert_same(chunk_ids, table_rows(p, {k: v[0] for k, v in with_history.items()}))
            prefix += chunk
        whole = p.hasher.row_ids(np.array([prefix]))
        assert_same(torch.cat(ids), table_rows(p, {k: v[0] for k, v in whole.items()}))


@given(data=st.data())
@SETTINGS
def test_prefix_hit(pair, data) -> None:
    """An extend after a cached prefix, with the scheduler-supplied history rows (history_row), equals tiergram's
    row_ids_with_history."""
    p = pair
    pairs = data.draw(st.lists(st.tuples(st.lists(p.tokens, min_size=1, max_size=8),
                                         st.lists(p.tokens, min_size=1, max_size=10)), min_size=1, max_size=4))
    fresh(p.engine, data.draw(p.tokens))
    history = [p.engine.history_row(prefix[-N1:]) for prefix, _ in pairs]
    got = ref.extend(p.engine, [Request(i, rest, len(prefix)) for i, (prefix, rest) in enumerate(pairs)], history)
    for (prefix, rest), ids in zip(pairs, got, strict=True):
        assert_same(ids, table_rows(p, {k: v[0] for k, v in p.hasher.row_ids_with_history([rest], [prefix]).items()}))
        whole = p.hasher.row_ids(np.array([prefix + rest]))
        assert_same(ids, table_rows(p, {k: v[0, len(prefix):] for k, v in whole.items()}))


@given(data=st.data())
@SETTINGS
def test_decode(pair, data) -> None:
    """Prefill then token-by-token decode (SGLang's MODE_DECODE with its history commit, requests finishing at
    different steps) equals tiergram's row_ids_with_history, a token at a time after its prompt."""
    p = pair
    reqs = data.draw(st.lists(st.tuples(st.lists(p.tokens, min_size=1, max_size=8),
                                        st.lists(p.tokens, min_size=1, max_size=12)), min_size=1, max_size=4))
    fresh(p.engine, data.draw(p.tokens))
    prefill = ref.extend(p.engine, [Request(i, prompt, 0) for i, (prompt, _) in enumerate(reqs)])
    for (prompt, _), ids in zip(reqs, prefill, strict=True):
        assert_same(ids, table_rows(p, {k: v[0] for k, v in p.hasher.row_ids_with_history([prompt], None).items()}))
    for step in range(max(len(out) for _, out in reqs)):
        live = [i for i, (_, out) in enumerate(reqs) if step < len(out)]
        batch = [Request(i, [reqs[i][1][step]], len(reqs[i][0]) + step) for i in live]
        for i, ids in zip(live, ref.decode(p.engine, batch), strict=True):
            seen = reqs[i][0] + reqs[i][1][:step]
            pushed = p.hasher.row_ids_with_history([[reqs[i][1][step]]], [seen[-N1:]])
            assert_same(ids, table_rows(p, {k: v[0] for k, v in pushed.items()}))
