"""Streaming hash state for decode: carries the last max_ngram_size-1 compressed ids across steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .compression import to_numpy

if TYPE_CHECKING:
    from .ngram import NgramHasher


class HashState:
    """Lookback of ONE sequence: the last max_ngram_size-1 compressed ids (compressed pad id at start)."""

    def __init__(self, hasher: NgramHasher, history: Any = None) -> None:
        """history: original token ids [K] that precede the first pushed token (None: sequence start)."""
        self.hasher = hasher
        self.position = 0  # tokens consumed through push/extend
        k = hasher.max_ngram_size - 1
        if history is None:
            self._context = np.full(k, hasher.compressed_pad_id, dtype=np.int64)
        else:
            hist = hasher.compress(history)
            if hist.ndim != 1:
                raise ValueError(f"history must be 1-D [K] for one sequence, got shape {hist.shape}")
            self._context = hasher._pad_history(hist[None, :], 1)[0].copy()

    @property
    def context(self) -> np.ndarray:
        """Copy of the carried compressed ids, int64 [max_ngram_size - 1], oldest first."""
        return self._context.copy()

    def copy(self) -> HashState:
        """Independent state with the same lookback (e.g. to fork a sequence)."""
        clone = HashState.__new__(HashState)
        clone.hasher, clone.position, clone._context = self.hasher, self.position, self._context.copy()
        return clone

    def extend(self, token_ids: Any) -> dict[int, np.ndarray]:
        """A prefill chunk of original ids [T] -> {layer_id: row ids int64 [T, H]}; advances the state."""
        x = self.hasher.compress(token_ids)
        if x.ndim != 1:
            raise ValueError(f"token_ids must be 1-D [T] for one sequence, got shape {x.shape}")
        full = np.concatenate([self._context, x])
        rows = self.hasher._hash_compressed(full[None, :])
        self._context = full[len(full) - len(self._context):].copy()
        self.position += len(x)
        return {layer: r[0] for layer, r in rows.items()}

    def push(self, token_id: int) -> dict[int, np.ndarray]:
        """One decoded token -> {layer_id: row ids int64 [H]} for its position; advances the state."""
        h = self.hasher
        if isinstance(token_id, (int, np.integer)) and not isinstance(token_id, bool):
            if not 0 <= token_id < h.vocab_size:  # fast path of compress()'s checks for a plain int
                raise ValueError(f"token id {int(token_id)} outside the vocabulary [0, {h.vocab_size})")
            cid = int(h.lookup[token_id])
        else:
            arr = to_numpy(token_id)
            if arr.ndim != 0:
                raise ValueError(f"push takes one token id, got shape {arr.shape}; use extend for a chunk")
            cid = int(h.compress(arr))
        # Decode is latency-bound and one position is tiny, so use Python ints rather than numpy calls.
        # This is exact: ids < C and multipliers < int64 max // C, so no product reaches 2**63 and
        # numpy's int64 arithmetic would not have wrapped either.
        back = [cid, *reversed(self._context.tolist())]  # back[k] = id k positions before this one
        out: dict[int, np.ndarray] = {}
        for layer, mults in h._push_params.items():
            rows: list[int] = []
            mix = back[0] * mults[0]
            for k, sizes in enumerate(h._push_sizes[layer], start=1):
                mix ^= back[k] * mults[k]
                rows.extend(mix % s for s in sizes)
            out[layer] = np.array(rows, dtype=np.int64)
        self._context[:-1] = self._context[1:]
        self._context[-1] = cid
        self.position += 1
        return out

    def __repr__(self) -> str:
        return f"HashState(position={self.position}, context={self._context.tolist()})"
