"""Multi-head n-gram hashing of compressed token ids into per-head table rows (DeepSeek Engram demo)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .compression import as_lookup, build_compression, check_ids, lookup_digest, to_numpy
from .primes import engram_head_table_sizes

SCHEME = "engram-v1"
_LAYER_SEED_STRIDE = 10007  # seed + 10007 * layer_id, as in the demo


def engram_multipliers(
    seed: int, layer_id: int, max_ngram_size: int, compressed_vocab_size: int
) -> np.ndarray:
    """Odd per-position multipliers int64 [max_ngram_size] for one layer."""
    # Bounded by int64 max // C so no product id * m overflows int64 and every XOR stays non-negative.
    m_max = int(np.iinfo(np.int64).max // compressed_vocab_size)
    half_bound = max(1, m_max // 2)
    g = np.random.default_rng(seed + _LAYER_SEED_STRIDE * layer_id)
    r = g.integers(low=0, high=half_bound, size=(max_ngram_size,), dtype=np.int64)
    return r * 2 + 1


def _int(value: Any, what: str, low: int | None = None) -> int:
    """value as an int (bools refused), at least `low` when given; ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    return int(value)


class NgramHasher:
    """Token ids -> Engram row ids for each layer: int64 [B, T, H], H = (max_ngram_size - 1) * heads."""

    def __init__(self, engram_vocab_size: Sequence[int], max_ngram_size: int, n_head_per_ngram: int,
                 layer_ids: Sequence[int], pad_id: int, seed: int = 0, *, compression: Any = None,
                 tokenizer: Any = None, compressed_vocab_size: int | None = None) -> None:
        """Exactly one of compression (lookup [V]), tokenizer, compressed_vocab_size (identity)."""
        self.max_ngram_size = _int(max_ngram_size, "max_ngram_size", 2)
        self.engram_vocab_size = [_int(v, "an engram_vocab_size entry", 1) for v in engram_vocab_size]
        if len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise ValueError(f"engram_vocab_size has {len(self.engram_vocab_size)} entries but max_ngram_size="
                             f"{self.max_ngram_size} needs {self.max_ngram_size - 1} (orders 2..{self.max_ngram_size})")
        self.n_head_per_ngram = _int(n_head_per_ngram, "n_head_per_ngram", 1)
        self.layer_ids = [_int(layer, "a layer id", 0) for layer in layer_ids]
        if not self.layer_ids:
            raise ValueError("layer_ids is empty")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be distinct, got {self.layer_ids}")
        self.seed = _int(seed, "seed", 0)
        self.num_heads = (self.max_ngram_size - 1) * self.n_head_per_ngram

        given = [name for name, v in (("compression", compression), ("tokenizer", tokenizer),
                                      ("compressed_vocab_size", compressed_vocab_size)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of compression, tokenizer, compressed_vocab_size; got "
                             f"{given or 'none'}")
        if tokenizer is not None:
            lookup, c = build_compression(tokenizer)
        elif compression is not None:
            lookup, c = as_lookup(compression)
        else:
            c = _int(compressed_vocab_size, "compressed_vocab_size", 1)
            lookup = np.arange(c, dtype=np.int64)
        self.lookup: np.ndarray = lookup
        self.vocab_size = len(lookup)
        self.compressed_vocab_size = c

        self.pad_id = _int(pad_id, "pad_id")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id {self.pad_id} is outside the vocabulary [0, {self.vocab_size})")
        self.compressed_pad_id = int(lookup[self.pad_id])

        self.multipliers: dict[int, np.ndarray] = {layer: engram_multipliers(self.seed, layer, self.max_ngram_size, c)
                                                   for layer in self.layer_ids}
        self.head_table_sizes = engram_head_table_sizes(self.engram_vocab_size, self.max_ngram_size,
                                                        self.n_head_per_ngram, self.layer_ids)
        self._sizes = {layer: [np.asarray(s, dtype=np.int64) for s in self.head_table_sizes[layer]]
                       for layer in self.layer_ids}

    def head_sizes(self, layer_id: int) -> list[int]:
        """Table size (rows) of each head of a layer, length H, order-2 heads first."""
        if layer_id not in self.head_table_sizes:
            raise ValueError(f"layer {layer_id} is not an Engram layer of this hasher ({self.layer_ids})")
        return [s for order in self.head_table_sizes[layer_id] for s in order]

    def head_offsets(self, layer_id: int) -> np.ndarray:
        """int64 [H]: each head's first row in the layer's rows laid end to end (a row's key = offset + row id)."""
        return np.cumsum([0, *self.head_sizes(layer_id)[:-1]], dtype=np.int64)

    def compress(self, input_ids: Any) -> np.ndarray:
        """Original token ids (any shape) -> compressed ids int64, same shape."""
        ids = check_ids(to_numpy(input_ids), self.vocab_size)
        return self.lookup[ids]

    def _hash_compressed(self, full: np.ndarray) -> dict[int, np.ndarray]:
        """full: compressed int64 [B, K + T], K = max_ngram_size-1 context ids -> {layer: int64 [B, T, H]}."""
        k = self.max_ngram_size - 1
        batch, t = full.shape[0], full.shape[1] - k
        # shift_j(x)[:, i] is the id j positions before position i: a slice of the context-prefixed row.
        shifts = [full[:, k - j: k - j + t] for j in range(self.max_ngram_size)]
        out: dict[int, np.ndarray] = {}
        for layer in self.layer_ids:
            m = self.multipliers[layer]
            rows = np.empty((batch, t, self.num_heads), dtype=np.int64)
            mix = shifts[0] * m[0]
            h = 0
            for oi, sizes in enumerate(self._sizes[layer]):
                n = oi + 2
                # Order n mixes ids 0..n-1 back, so it extends order n-1's mix by one term.
                mix = np.bitwise_xor(mix, shifts[n - 1] * m[n - 1])  # int64 arithmetic, as in the demo
                np.remainder(mix[..., None], sizes, out=rows[..., h: h + len(sizes)])
                h += len(sizes)
            out[layer] = rows
        return out

    def row_ids(self, input_ids: Any) -> dict[int, np.ndarray]:
        """Whole sequences [B, T] (numpy or torch ints) -> {layer_id: row ids int64 [B, T, H]}."""
        return self.row_ids_with_history(input_ids, None)

    def row_ids_with_history(self, input_ids: Any, history: Any) -> dict[int, np.ndarray]:
        """Chunk [B, T] after original ids history [B, K] (None: sequence start) -> {layer: int64 [B, T, H]}."""
        x = self.compress(input_ids)
        if x.ndim != 2:
            raise ValueError(f"input_ids must be 2-D [batch, seq_len], got shape {x.shape}")
        k = self.max_ngram_size - 1
        hist = np.empty((x.shape[0], 0), dtype=np.int64) if history is None else self.compress(history)
        if hist.ndim != 2 or hist.shape[0] != x.shape[0]:
            raise ValueError(f"history must be 2-D [batch={x.shape[0]}, K], got shape {hist.shape}")
        hist = hist[:, max(0, hist.shape[1] - k):]
        pad = np.full((x.shape[0], k - hist.shape[1]), self.compressed_pad_id, dtype=np.int64)
        return self._hash_compressed(np.concatenate([pad, hist, x], axis=1))

    def config(self) -> dict[str, Any]:
        """JSON-serialisable hashing parameters for table manifests (layer keys as strings)."""
        identity = bool(np.array_equal(self.lookup, np.arange(self.vocab_size)))
        return {"scheme": SCHEME, "engram_vocab_size": list(self.engram_vocab_size),
                "max_ngram_size": self.max_ngram_size, "n_head_per_ngram": self.n_head_per_ngram,
                "layer_ids": list(self.layer_ids), "pad_id": self.pad_id, "seed": self.seed,
                "vocab_size": self.vocab_size, "compressed_vocab_size": self.compressed_vocab_size,
                "compressed_pad_id": self.compressed_pad_id, "compression": "identity" if identity else "lookup",
                "compression_sha256": lookup_digest(self.lookup),
                "multipliers": {str(k): [int(v) for v in m] for k, m in self.multipliers.items()},
                "head_table_sizes": {str(k): [list(o) for o in v] for k, v in self.head_table_sizes.items()}}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, compression: Any = None, tokenizer: Any = None) -> NgramHasher:
        """Rebuild from config(); verifies compression digest, vocab sizes, multipliers and head sizes match."""
        if config.get("scheme", SCHEME) != SCHEME:
            raise ValueError(f"unknown hashing scheme {config.get('scheme')!r}, expected {SCHEME!r}")
        kwargs: dict[str, Any] = {"compression": compression, "tokenizer": tokenizer}
        if compression is None and tokenizer is None:
            if config.get("compression") != "identity":
                raise ValueError("config uses a compression lookup; pass compression= or tokenizer=")
            kwargs = {"compressed_vocab_size": config["compressed_vocab_size"]}
        hasher = cls(config["engram_vocab_size"], config["max_ngram_size"], config["n_head_per_ngram"],
                     config["layer_ids"], config["pad_id"], config.get("seed", 0), **kwargs)
        mine = hasher.config()
        # The multipliers check catches a numpy whose default_rng stream differs: rows would silently move.
        for key in ("vocab_size", "compressed_vocab_size", "compressed_pad_id", "compression_sha256",
                    "multipliers", "head_table_sizes"):
            if key in config and config[key] != mine[key]:
                raise ValueError(f"config {key} does not match: stored {config[key]!r}, got {mine[key]!r}")
        return hasher

    def __repr__(self) -> str:
        return (f"NgramHasher(orders=2..{self.max_ngram_size}, heads/order={self.n_head_per_ngram}, "
                f"layers={self.layer_ids}, vocab={self.vocab_size}->{self.compressed_vocab_size})")
