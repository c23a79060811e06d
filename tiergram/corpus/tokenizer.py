"""Byte-level BPE tokenizer trained on the corpus train split with Hugging Face `tokenizers`, saved as
`tokenizer.json` in the corpus folder (docs/model.md, "The corpus")."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tiergram.corpus.build import CorpusError, build_corpus, iter_texts, read_manifest

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(corpus: str | Path, vocab_size: int = 16384, *, force: bool = False, progress: bool = True) -> Path:
    """Train (or reuse) the tokenizer on the train split; returns the path of `tokenizer.json`."""
    corpus = Path(corpus)
    if vocab_size < MIN_VOCAB:
        raise CorpusError(f"vocab size {vocab_size} is below the minimum {MIN_VOCAB} (256 bytes + specials)")
    manifest = read_manifest(corpus)
    want = {"vocab_size": vocab_size, "corpus_sha256": manifest["content_sha256"], "special_tokens": SPECIAL_TOKENS,
            "kind": "byte-level-bpe"}
    path, meta_path = corpus / "tokenizer.json", corpus / "tokenizer.meta.json"
    if not force and path.is_file() and meta_path.is_file():
        have = json.loads(meta_path.read_text())
        if {k: have.get(k) for k in want} == want:
            return path
    t0 = time.perf_counter()
    n_docs = manifest["splits"]["train"]["documents"]
    if n_docs == 0:
        raise CorpusError(f"the train split of {corpus} is empty")
    tok = Tokenizer(models.BPE())  # no normaliser, so decoding is lossless
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tok.train_from_iterator(iter_texts(corpus, "train"), trainer=trainer, length=n_docs)
    tmp = corpus / "tokenizer.json.tmp"
    tok.save(str(tmp))
    os.replace(tmp, path)
    meta = {**want, "actual_vocab_size": tok.get_vocab_size(), "train_documents": n_docs,
            "seconds": round(time.perf_counter() - t0, 2)}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


def tokenizer_file(path: str | Path, hint: str = "run `tiergram corpus tokenizer` first") -> Path:
    """The `tokenizer.json` that path names (the file, or a folder holding it); CorpusError with the hint if none."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise CorpusError(f"no tokenizer at {path} ({hint})")
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A saved tokenizer, from its `tokenizer.json` or the corpus folder holding it."""
    return Tokenizer.from_file(str(tokenizer_file(path)))


def ensure_corpus(corpus: str | Path | None = None, *, tokenizer: bool = True, progress: bool = True) -> Path:
    """The corpus folder a command reads, what is missing built first: None is the cache's corpus (the default sources,
    a 16384-token tokenizer), a folder is used as it is but for a missing tokenizer; tokenizer=False: the text only."""
    if corpus is None:
        path = build_corpus(progress=progress)  # reuses a complete corpus
        if tokenizer:
            train_tokenizer(path, progress=progress)  # reuses a matching tokenizer
        return path
    path = Path(corpus)
    read_manifest(path)  # CorpusError naming the folder when it holds no corpus
    if tokenizer and not (path / "tokenizer.json").is_file():
        train_tokenizer(path, progress=progress)
    return path
