"""Training data: the corpus train split tokenized once into a cached token array, sampled as random windows."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tiergram.corpus import EOT, load_split, read_manifest


def tokenize_split(corpus: str | os.PathLike, split: str, tokenizer_path: str | os.PathLike, *,
                   progress: bool = True, batch_docs: int = 256) -> np.ndarray:
    """A split as one token stream (<|endoftext|> before each document), cached as .npy; a read-only memory map."""
    from tokenizers import Tokenizer

    tok_digest = hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()
    key = hashlib.sha256((read_manifest(corpus)["content_sha256"] + tok_digest).encode()).hexdigest()
    path = Path(corpus) / f"tokens-{split}-{key[:16]}.npy"  # keyed by the corpus and the tokenizer
    if path.is_file():
        return np.load(path, mmap_mode="r")
    tok = Tokenizer.from_file(str(tokenizer_path))
    eot = tok.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"tokenizer {tokenizer_path} has no {EOT} token")
    dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32
    pieces: list[np.ndarray] = []
    texts: list[str] = []
    n_docs = read_manifest(corpus)["splits"][split]["documents"]
    bar = tqdm(total=n_docs, desc=f"tokenizing {split}", unit="doc", disable=not progress)

    def flush() -> None:
        for enc in tok.encode_batch(texts):
            pieces.append(np.asarray([eot, *enc.ids], dtype=dtype))
        bar.update(len(texts))
        texts.clear()

    for doc in load_split(corpus, split):
        texts.append(doc.text)
        if len(texts) == batch_docs:
            flush()
    flush()
    bar.close()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


@dataclass
class WindowSampler:
    """Random windows of a token stream: next() -> (x, y) int64 [B, T], y = x shifted by one token."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.tokens) < self.seq_len + 2:
            raise ValueError(f"the token stream has {len(self.tokens)} tokens, fewer than one window of "
                             f"{self.seq_len + 1}")
        self.rng = np.random.default_rng(self.seed)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """One batch of windows starting at uniformly random offsets."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        window = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        return window[:, :-1], window[:, 1:]

    def state(self) -> dict[str, Any]:
        """The RNG state, for an exact resume."""
        return self.rng.bit_generator.state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore the RNG state saved by state()."""
        self.rng.bit_generator.state = state
