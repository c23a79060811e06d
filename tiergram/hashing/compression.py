"""Tokenizer compression: map token ids whose text normalises equally onto one dense compressed id."""

from __future__ import annotations

import hashlib
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tokenizers

# Private-use character that stands in for a lone-space token while Strip() runs, so " " survives.
SENTINEL = "\ue000"


def engram_normalizer() -> tokenizers.normalizers.Normalizer:
    """The Engram demo's text normaliser: NFKC, NFD, strip accents, lowercase, collapse whitespace."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
                                 normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
                                 normalizers.Replace(Regex(r"^ $"), SENTINEL), normalizers.Strip(),
                                 normalizers.Replace(SENTINEL, " ")])


def build_compression(tokenizer: Any) -> tuple[np.ndarray, int]:
    """(lookup int64 [V], C): lookup[token_id] -> compressed id in 0..C-1, ids given by first appearance."""
    tok = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers' fast tokenizers wrap a Tokenizer
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size <= 0:
        raise ValueError("tokenizer has an empty vocabulary")
    normalizer = engram_normalizer()
    texts = tok.decode_batch([[tid] for tid in range(vocab_size)], skip_special_tokens=False)
    key_to_id: dict[str, int] = {}
    lookup = np.empty(vocab_size, dtype=np.int64)
    for tid, text in enumerate(texts):
        if "\ufffd" in text:
            # A partial UTF-8 byte sequence decodes to U+FFFD; keep such tokens apart by their raw form.
            key = tok.id_to_token(tid)
            key = text if key is None else key
        else:
            norm = normalizer.normalize_str(text)
            key = norm if norm else text
        lookup[tid] = key_to_id.setdefault(key, len(key_to_id))
    return lookup, len(key_to_id)


def as_lookup(compression: Any) -> tuple[np.ndarray, int]:
    """Validate a compression table: (lookup int64 [V], C = max compressed id + 1)."""
    lookup = to_numpy(compression)
    if lookup.ndim != 1:
        raise ValueError(f"compression lookup must be 1-D [vocab_size], got shape {lookup.shape}")
    if lookup.size == 0:
        raise ValueError("compression lookup is empty")
    if not np.issubdtype(lookup.dtype, np.integer):
        raise ValueError(f"compression lookup must hold integers, got dtype {lookup.dtype}")
    if lookup.min() < 0:
        raise ValueError("compression lookup holds negative compressed ids")
    return lookup.astype(np.int64), int(lookup.max()) + 1  # the id range 0..max (a hand-made lookup may have gaps)


def lookup_digest(lookup: np.ndarray) -> str:
    """sha256 hex of the lookup as little-endian int64, to pin a table to its compression."""
    return hashlib.sha256(np.ascontiguousarray(lookup, dtype="<i8").tobytes()).hexdigest()


def to_numpy(x: Any) -> np.ndarray:
    """numpy view of an array-like or torch tensor (moved to the CPU first)."""
    torch = sys.modules.get("torch")  # avoid importing torch just to check the type
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def check_ids(ids: np.ndarray, vocab_size: int, what: str = "token ids") -> np.ndarray:
    """Validate integer ids in [0, vocab_size); returns them as int64."""
    if ids.size == 0:
        return ids.astype(np.int64)  # e.g. np.asarray([]) is float64; nothing to check
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {ids.dtype}")
    lo, hi = ids.min(), ids.max()
    if lo < 0:
        raise ValueError(f"{what} contain a negative id ({int(lo)})")
    if hi >= vocab_size:
        raise ValueError(f"{what} contain id {int(hi)} >= vocabulary size {vocab_size}")
    return ids.astype(np.int64, copy=False)
