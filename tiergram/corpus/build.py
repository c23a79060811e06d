"""Build the corpus: fetch sources, clean, de-duplicate, categorise, split by document, write JSONL (the layout:
docs/model.md, "The corpus")."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from tiergram import paths
from tiergram.corpus.clean import CATEGORIES, SPLITS, categorise, clean_text, split_for
from tiergram.corpus.sources import (
    DEFAULT_SOURCES,
    FALLBACK_SOURCES,
    Fetched,
    Source,
    SourceUnavailable,
    resolve_sources,
)

FORMAT = "tiergram-corpus/1"
STDLIB = "python-stdlib"


class CorpusError(ValueError):
    """The corpus cannot be built or read; the message says why."""


@dataclass(frozen=True)
class BuildConfig:
    """Parameters of a build; any change invalidates the cached corpus."""

    max_doc_bytes: int = 2_000_000
    min_chars: int = 32
    validation: float = 0.05
    test: float = 0.05
    boilerplate_threshold: float = 0.25


@dataclass
class Document:
    """One corpus document as stored in a split file."""

    id: str
    source: str
    path: str
    licence: str
    category: str
    text: str


def corpus_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the corpus of a cache folder lives (default: tiergram's, `paths.cache_dir`)."""
    return Path(cache_dir).expanduser() / "corpus" if cache_dir else paths.cache_dir("corpus")


def read_manifest(corpus: str | Path) -> dict:
    """The manifest of a built corpus; CorpusError if there is none."""
    path = Path(corpus) / "manifest.json"
    if not path.is_file():
        raise CorpusError(f"no corpus at {corpus} (run `tiergram corpus build` first)")
    return json.loads(path.read_text())


def _is_current(out: Path, params: dict) -> bool:
    """Whether a complete corpus built with `params` is already at `out`."""
    try:
        manifest = read_manifest(out)
    except ValueError:  # no manifest (CorpusError) or a broken one
        return False
    return manifest.get("params") == params and all(
        (out / s["file"]).is_file() and (out / s["file"]).stat().st_size == s["file_bytes"]
        for s in manifest["splits"].values())


def _fetch_all(sources: list[Source], downloads: Path, progress: bool) -> tuple[dict, dict]:
    """Fetch each source, collecting (fetched by name, reason by missing name)."""
    fetched: dict[str, Fetched] = {}
    missing: dict[str, str] = {}
    bar = tqdm(sources, desc="fetching sources", unit="src", disable=not progress, file=sys.stderr)
    for src in bar:
        bar.set_postfix_str(src.name)
        try:
            fetched[src.name] = src.fetch(downloads / src.name)
        except (SourceUnavailable, OSError) as e:
            missing[src.name] = str(e) or type(e).__name__
            warnings.warn(f"corpus source {src.name!r} unavailable: {missing[src.name]}", stacklevel=3)
    return fetched, missing


def _count(table: dict, key: str, split: str, nbytes: int) -> None:
    """Add one document of `nbytes` to table[key][split]."""
    cell = table.setdefault(key, {s: {"documents": 0, "bytes": 0} for s in SPLITS})[split]
    cell["documents"] += 1
    cell["bytes"] += nbytes


def build_corpus(cache_dir: str | Path | None = None, sources: Sequence[str | Source] | str | None = None,
                 progress: bool = True, *, force: bool = False, config: BuildConfig | None = None) -> Path:
    """Build (or reuse) the corpus under `<cache>/corpus/`; returns that folder."""
    t0 = time.perf_counter()
    config = config or BuildConfig()
    chosen = resolve_sources(sources)
    out = corpus_dir(cache_dir)
    params = {"format": FORMAT, "sources": [s.name for s in chosen],
              "fallback": list(FALLBACK_SOURCES) if sources is None else [], **asdict(config)}
    if not force and _is_current(out, params):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)

    fetched, missing = _fetch_all(chosen, out / "downloads", progress)
    used_fallback: list[str] = []
    if sources is None and missing.keys() & set(DEFAULT_SOURCES):
        fallback = resolve_sources(FALLBACK_SOURCES)
        more, more_missing = _fetch_all(fallback, out / "downloads", progress)
        fetched.update(more)
        missing.update(more_missing)
        used_fallback = list(more)
        chosen = chosen + fallback
    if not fetched:
        reasons = "; ".join(f"{k}: {v}" for k, v in missing.items())
        raise CorpusError(f"no corpus source available ({reasons})")

    by_name = {s.name: s for s in chosen}
    seen: set[bytes] = set()  # content hashes: a duplicate keeps its first (source, path)
    dropped = {"binary": 0, "empty": 0, "huge": 0, "duplicate": 0}
    by_source: dict = {}
    by_category: dict = {}
    stdlib_splits: dict[str, list[str]] = {s: [] for s in SPLITS}
    handles = {s: open(out / f"{s}.jsonl.tmp", "wb") for s in SPLITS}  # noqa: SIM115
    hashes = {s: hashlib.sha256() for s in SPLITS}
    try:
        total = sum(len(f.files) for f in fetched.values())
        bar = tqdm(total=total, desc="processing documents", unit="doc", disable=not progress, file=sys.stderr)
        for name, fet in fetched.items():
            src = by_name[name]
            for sf in sorted(fet.files, key=lambda f: f.path):
                bar.update(1)
                text, reason = clean_text(sf.read(), config.max_doc_bytes, config.min_chars)
                digest = hashlib.sha256(text.encode("utf-8")).digest() if text is not None else None
                if text is None or digest in seen:
                    dropped[reason or "duplicate"] += 1
                    continue
                seen.add(digest)
                split = split_for(src.split_key(sf.path), config.validation, config.test)
                category = categorise(sf.path, text, config.boilerplate_threshold)
                doc = Document(f"{name}/{sf.path}", name, sf.path, src.licence, category, text)
                line = (json.dumps(asdict(doc), ensure_ascii=False) + "\n").encode("utf-8")
                handles[split].write(line)
                hashes[split].update(line)
                nbytes = len(text.encode("utf-8"))
                _count(by_source, name, split, nbytes)
                _count(by_category, category, split, nbytes)
                if name == STDLIB:
                    stdlib_splits[split].append(sf.path)
        bar.close()
    finally:
        for h in handles.values():
            h.close()
    for s in SPLITS:
        os.replace(out / f"{s}.jsonl.tmp", out / f"{s}.jsonl")

    splits = {}
    for s in SPLITS:
        cells = [t[s] for t in by_source.values()]
        splits[s] = {"file": f"{s}.jsonl", "file_bytes": (out / f"{s}.jsonl").stat().st_size,
                     "sha256": hashes[s].hexdigest(), "documents": sum(c["documents"] for c in cells),
                     "bytes": sum(c["bytes"] for c in cells)}
    manifest = {
        "format": FORMAT,
        "params": params,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.perf_counter() - t0, 2),
        "content_sha256": hashlib.sha256("".join(splits[s]["sha256"] for s in SPLITS).encode()).hexdigest(),
        "sources": {n: {"licence": by_name[n].licence, "description": by_name[n].description, "version": f.version,
                        "origin": f.origin, "download_bytes": f.download_bytes, "files": len(f.files),
                        "documents": sum(c["documents"] for c in by_source.get(n, {}).values()),
                        "bytes": sum(c["bytes"] for c in by_source.get(n, {}).values())}
                    for n, f in fetched.items()},
        "missing": missing,
        "fallback_used": used_fallback,
        "dropped": dropped,
        "splits": splits,
        "by_source": by_source,
        "by_category": {c: by_category[c] for c in CATEGORIES if c in by_category},
    }
    if STDLIB in fetched:
        manifest["python_stdlib"] = {"splits": stdlib_splits}  # the doctest task's held-out files
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    return out


def load_split(corpus: str | Path, split: str) -> Iterator[Document]:
    """The documents of one split, in file order."""
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    path = Path(corpus) / f"{split}.jsonl"
    if not path.is_file():
        raise CorpusError(f"no {split} split at {path} (run `tiergram corpus build` first)")
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield Document(**json.loads(line))


def iter_texts(corpus: str | Path, split: str = "train") -> Iterator[str]:
    """The texts of a split, in file order."""
    return (doc.text for doc in load_split(corpus, split))
