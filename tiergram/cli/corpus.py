"""`tiergram corpus build|tokenizer|info`: the offline training corpus and its tokenizer."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tiergram.cli.common import add_common
from tiergram.corpus.build import build_corpus, corpus_dir, read_manifest
from tiergram.corpus.sources import DEFAULT_SOURCES, SOURCES


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def summary(manifest: dict) -> str:
    """A human-readable table of a corpus manifest."""
    lines = [f"content sha256 {manifest['content_sha256'][:16]}..., built in {manifest['build_seconds']} s"]
    for name, s in manifest["sources"].items():
        lines.append(f"  {name:14} {s['version']:>22}  {s['documents']:6d} docs {_mb(s['bytes']):>8} MB"
                     f"  [{s['licence']}]")
    for name, why in manifest["missing"].items():
        lines.append(f"  {name:14} MISSING: {why}")
    if manifest.get("fallback_used"):
        lines.append(f"  fallback sources used: {', '.join(manifest['fallback_used'])}")
    lines.append(f"  dropped: {', '.join(f'{k} {v}' for k, v in manifest['dropped'].items())}")
    for title, table in (("split", {"all": manifest["splits"]}), ("source", manifest["by_source"]),
                         ("category", manifest["by_category"])):
        lines.append(f"MB by {title}:" + "".join(f"{s:>12}" for s in ("train", "validation", "test")))
        for key, row in table.items():
            lines.append(f"  {key:16}" + "".join(f"{_mb(row[s]['bytes']):>12}" for s in row))
    return "\n".join(lines)


def _build(args: argparse.Namespace) -> int:
    return _show(build_corpus(args.cache, args.sources, progress=not args.no_progress, force=args.force), args.json)


def _tokenizer(args: argparse.Namespace) -> int:
    from tiergram.corpus.tokenizer import load_tokenizer, train_tokenizer

    t0 = time.perf_counter()
    path = train_tokenizer(corpus_dir(args.cache), args.vocab_size, force=args.force, progress=not args.no_progress)
    info = {"path": str(path), "vocab_size": load_tokenizer(path).get_vocab_size(),
            "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(info) if args.json else f"tokenizer at {path}: {info['vocab_size']} tokens")
    return 0


def _show(out: Path, as_json: bool) -> int:
    """Print the manifest of the corpus at out, as JSON or as the summary table."""
    manifest = read_manifest(out)
    print(json.dumps(manifest, indent=1) if as_json else f"corpus at {out}\n{summary(manifest)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `corpus` command group."""
    p = subparsers.add_parser("corpus", help="build the offline training corpus and its tokenizer")
    sub = p.add_subparsers(dest="corpus_command", metavar="SUBCOMMAND", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--cache", default=None, help="cache folder (default $TIERGRAM_CACHE or ~/.cache/tiergram)")
        add_common(q, "--json")

    b = sub.add_parser("build", help="fetch, clean, de-duplicate and split the corpus")
    common(b)
    b.add_argument("--sources", default=None,
                   help=f"comma list or 'all' (known: {', '.join(SOURCES)}; default {','.join(DEFAULT_SOURCES)})")
    b.add_argument("--force", action="store_true", help="rebuild even if a current corpus exists")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(func=_build)

    t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the train split")
    common(t)
    t.add_argument("--vocab-size", type=int, default=16384)
    t.add_argument("--force", action="store_true", help="retrain even if a current tokenizer exists")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=_tokenizer)

    i = sub.add_parser("info", help="summarise the built corpus")
    common(i)
    i.set_defaults(func=lambda args: _show(corpus_dir(args.cache), args.json))
