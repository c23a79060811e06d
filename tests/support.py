"""Helpers several test modules share (imported as `from support import ...`; pytest puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tiergram.corpus import PAD, SOURCES, Source, build_corpus, directory_source, train_tokenizer
from tiergram.corpus.sources import python_group, stdlib_root
from tiergram.model import EngramLM, ModelConfig, tiny_config

FIXTURE = Path(__file__).parent / "data" / "corpus_fixture"
STDLIB_FILES = {"bisect.py", "colorsys.py", "heapq.py", "textwrap.py", "json/__init__.py", "json/decoder.py"}


def fixture_source() -> Source:
    """The fixture folder as a source."""
    return directory_source("fixture", FIXTURE, "CC0-1.0")


def stdlib_source() -> Source:
    """A handful of real stdlib modules, named like the real stdlib source."""
    return directory_source(
        "python-stdlib", stdlib_root(), "PSF-2.0", keep=lambda r: r in STDLIB_FILES, group=python_group
    )


def fixture_corpus(cache: Path, vocab_size: int | None = 512) -> Path:
    """The fixture corpus plus STDLIB_FILES built under `cache`, with a BPE of vocab_size (None: no tokenizer)."""
    corpus = build_corpus(cache, [fixture_source(), stdlib_source()], progress=False)
    if vocab_size is not None:
        train_tokenizer(corpus, vocab_size, progress=False)
    return corpus


def word_tokenizer(path: Path, words: list[str]) -> Path:
    """A whitespace WordLevel tokenizer over <|endoftext|>, <|pad|> (ids 0, 1) and words, saved at path."""
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["<|endoftext|>", PAD, *words])}, unk_token=PAD))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path))
    return path


def tiny_config_for(tok: Tokenizer) -> ModelConfig:
    """tiny_config sized to a tokenizer's vocabulary, Engram padding with its <|pad|> id."""
    cfg = tiny_config(tok.get_vocab_size())
    cfg.engram.pad_id = tok.token_to_id(PAD)
    return cfg


@torch.no_grad()
def spread(model: EngramLM, seed: int) -> EngramLM:
    """Re-draw the dense weights larger than the training init (and the convs and biases non-zero), in eval mode.

    Greedy tokens then vary and depend on the Engram rows, their top-2 logit gaps (and MoE expert choices) are far
    above float rounding, so a test comparing two paths' tokens can fail when one path reads a wrong row.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 2 and "table" not in name and p is not model.tok_emb.weight or "short_conv.conv" in name \
                or name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        elif "table" in name:
            p.copy_(torch.randn(p.shape, generator=g))  # rows of unit scale, so fp8 rounding visibly matters
    model.tok_emb.weight.mul_(10)
    return model.eval()


def tiny_saved_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer, EngramLM, Path]:
    """(corpus, tokenizer, model, model dir): a tiny random-init Engram model (seed 0, eval mode), saved."""
    from tiergram.corpus.tokenizer import load_tokenizer
    from tiergram.model.checkpoint import save_pretrained
    from tiergram.model.model import make_hasher

    corpus = fixture_corpus(tmp_path_factory.mktemp("cache"))
    tok = load_tokenizer(corpus / "tokenizer.json")
    cfg = tiny_config_for(tok)
    torch.manual_seed(0)
    model = EngramLM(cfg, make_hasher(cfg, tokenizer=tok)).eval()
    return corpus, tok, model, save_pretrained(model, tmp_path_factory.mktemp("model") / "tiny", tokenizer=tok)


def offline_default_sources(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """Point the tiergram cache at root/cache and the default corpus sources at local folders (no network), so a
    command that builds the default corpus on a fresh machine can be run; returns where that corpus will be."""
    monkeypatch.setenv("TIERGRAM_CACHE", str(root / "cache"))
    notes = root / "notes"
    notes.mkdir(parents=True, exist_ok=True)
    (notes / "notes.txt").write_text("Plain notes on hashing n-grams into rows of a table, long enough to keep.\n")
    monkeypatch.setitem(SOURCES, "python-stdlib", stdlib_source())
    monkeypatch.setitem(SOURCES, "python-docs", directory_source("python-docs", FIXTURE, "CC0-1.0"))
    for name in ("linux-docs", "perl-doc"):
        monkeypatch.setitem(SOURCES, name, directory_source(name, notes, "CC0-1.0"))
    return root / "cache" / "corpus"


def doc_block(doc: Path, name: str) -> str:
    """The text of a doc between `<!-- data:NAME begin ... -->` and `<!-- data:NAME end -->` (a table a test
    recomputes from its result file)."""
    import re

    m = re.search(rf"<!-- data:{re.escape(name)} begin[^>]*-->\n(.*?)<!-- data:{re.escape(name)} end -->",
                  doc.read_text(), re.S)
    assert m, f"{doc.name} has no data:{name} block"
    return m.group(1)
