"""`tiergram bench cache`: hit rate of each cache policy on a real token stream, against the offline optimum.

The corpus's held-out text is cut into requests, scheduled in continuous-batching steps (chunked prefill) and hashed
into one Engram layer's rows; each step's unique rows are replayed through the production native row cache under
every policy, and `belady` (offline optimum with bypass) bounds them all. Workload and geometry:
docs/benchmarks.md, "Cache policies".
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.bench.common import log
from tiergram.cache.native import NativeRowCache
from tiergram.cache.policies import POLICIES, belady_hit_rate
from tiergram.hashing import NgramHasher, build_compression
from tiergram.paths import cache_dir
from tiergram.plots import save_figure, subplots

ONLINE = tuple(POLICIES)  # every policy a cache can run (Belady needs the whole future: offline)
# LRU whose cache starts full of the rows the corpus's train split reads most (the engine's --hot-rows): opt-in, it
# needs the corpus and counts its train split under the bench's hashing
HOT = "lru-hot"
HOT_MAX_ROWS = 128 << 20  # lru-hot replays no larger cache: ~100 bytes a row of index and 1-byte rows (~13 GB)
DEFAULT_POLICIES = (*ONLINE, "belady")
ALL_POLICIES = (*ONLINE, HOT, "belady")


@dataclass
class CacheBenchConfig:
    """Workload, hashing geometry and cache sizes of the cache benchmark."""

    corpus: str | None = None  # corpus folder (default: the cache's corpus)
    split: str = "validation"
    max_tokens: int = 65536  # tokens of text replayed (~1.3M accesses with the defaults)
    prompt_len: int = 192
    decode_len: int = 64
    max_seqs: int = 32
    step_tokens: int = 512
    max_ngram_size: int = 4
    n_head_per_ngram: int = 8
    table_factor: int = 64  # rows per head ~ table_factor x compressed vocabulary
    rows_per_head: int | None = None  # rows per head (each head the next distinct prime); overrides table_factor
    capacity_of: str = "touched"  # capacities as fractions of the distinct rows "touched", or of the "table"
    layer_id: int = 1
    capacities: tuple[float, ...] = (0.01, 0.05, 0.10, 0.25)  # fractions of the distinct rows touched
    policies: tuple[str, ...] = DEFAULT_POLICIES
    window: int = 64  # steps announced ahead of the one being probed (lookahead)
    seed: int = 0
    target_points: float = 5.0  # lookahead should be within this many points of belady
    plot: str | None = None  # PNG path (default: in the bench cache folder); "" for no plot


@dataclass
class TokenDocs:
    """Tokenized documents, in the order requests arrive, and what the hasher needs of their vocabulary."""

    source: str
    docs: list[np.ndarray]
    vocab_size: int
    pad_id: int
    tokenizer: Any = None  # a tokenizers.Tokenizer for compression, or None for identity


@dataclass
class CacheBenchResult:
    """Hit rates per policy and capacity, and facts about the replayed stream."""

    config: CacheBenchConfig
    stream: dict[str, object]
    capacity_rows: dict[str, int]
    hit_rate: dict[str, dict[str, float]] = field(default_factory=dict)
    plot: str | None = None

    @property
    def gap_points(self) -> dict[str, float]:
        """Belady minus lookahead, in percentage points, per capacity."""
        if "belady" not in self.hit_rate or "lookahead" not in self.hit_rate:
            return {}
        return {c: 100 * (self.hit_rate["belady"][c] - self.hit_rate["lookahead"][c]) for c in self.capacity_rows}

    @property
    def target_met(self) -> bool | None:
        """Whether lookahead is within target_points of belady at every capacity (None: not measured)."""
        gaps = self.gap_points
        return all(g <= self.config.target_points for g in gaps.values()) if gaps else None


def cap_key(frac: float) -> str:
    """A capacity fraction as a JSON key: 0.01 -> "0.01", 0.0001 -> "0.0001"."""
    return f"{frac:g}" if frac >= 0.1 or frac < 0.01 else f"{frac:.2f}".rstrip("0")


def load_docs(cfg: CacheBenchConfig) -> TokenDocs:
    """The corpus split's documents in a seeded order, tokenized until max_tokens (the corpus built when missing)."""
    from tiergram.corpus import PAD, ensure_corpus, iter_texts, load_tokenizer

    folder = ensure_corpus(cfg.corpus)
    tok = load_tokenizer(folder)
    texts = list(iter_texts(folder, cfg.split))
    random.Random(cfg.seed).shuffle(texts)  # requests from many documents, as a server sees them
    docs: list[np.ndarray] = []
    for i in range(0, len(texts), 64):
        docs += [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts[i:i + 64])]
        if sum(d.size for d in docs) >= cfg.max_tokens:
            break
    return TokenDocs(f"corpus {cfg.split} split ({folder})", docs, tok.get_vocab_size(), tok.token_to_id(PAD), tok)


# ---------------------------------------------------------------- the access stream


def make_requests(docs: list[np.ndarray], cfg: CacheBenchConfig) -> list[np.ndarray]:
    """Documents in order cut into requests of prompt_len + decode_len tokens, up to max_tokens in all."""
    size, out, total = cfg.prompt_len + cfg.decode_len, [], 0
    for ids in docs:
        for start in range(0, ids.size, size):
            piece = ids[start:start + min(size, cfg.max_tokens - total)]
            if piece.size >= 2:
                out.append(piece)
                total += piece.size
            if total >= cfg.max_tokens:
                return out
    return out


def request_rows(requests: list[np.ndarray], hasher: NgramHasher, layer: int) -> list[np.ndarray]:
    """Global row ids int64 [T, H] of every request (each request starts its own sequence)."""
    return [hasher.row_ids(r[None, :])[layer][0] + hasher.head_offsets(layer) for r in requests]


def schedule(rows: list[np.ndarray], cfg: CacheBenchConfig) -> list[np.ndarray]:
    """Continuous batching (decodes first, then prompt chunks): per step the sorted unique rows of its tokens."""
    waiting = deque(range(len(rows)))
    running: list[list[int]] = []  # [request, tokens done]
    steps: list[np.ndarray] = []
    while waiting or running:
        while waiting and len(running) < cfg.max_seqs:
            running.append([waiting.popleft(), 0])
        budget = cfg.step_tokens
        take = [0] * len(running)
        for i, (r, done) in enumerate(running):  # decode first: one token per sequence past its prompt
            if done >= min(cfg.prompt_len, rows[r].shape[0]) and budget > 0:
                take[i], budget = 1, budget - 1
        for i, (r, done) in enumerate(running):  # then prompt chunks
            prompt = min(cfg.prompt_len, rows[r].shape[0])
            if done < prompt and budget > 0:
                take[i] = min(budget, prompt - done)
                budget -= take[i]
        parts = [rows[r][done:done + n].reshape(-1) for (r, done), n in zip(running, take, strict=True) if n]
        steps.append(np.unique(np.concatenate(parts)))
        for state, n in zip(running, take, strict=True):
            state[1] += n
        running = [s for s in running if s[1] < rows[s[0]].shape[0]]
    return steps


# ---------------------------------------------------------------- replay


def replay(steps: list[np.ndarray], capacity: int, policy: str, window: int = 64,
           hot: np.ndarray | None = None) -> float:
    """Hit rate of a row cache with `policy` over the steps (lookahead told `window` ahead; starting full of
    `hot`[:capacity], hottest first); a row is its key's low byte, checked on every hit."""
    def rows(keys: np.ndarray) -> np.ndarray:
        return (keys & 0xFF).astype(np.uint8)[:, None]

    cache = NativeRowCache(capacity, 1, policy)
    if hot is not None:
        first = np.asarray(hot[:capacity], dtype=np.int64)[::-1]
        cache.admit(first, rows(first))
    start = cache.counters
    lookahead = policy == "lookahead"
    batches: list[int | None] = []
    for t, keys in enumerate(steps):
        while lookahead and len(batches) <= min(t + window, len(steps) - 1):
            batches.append(cache.announce(steps[len(batches)]))
        slots = cache.probe(keys, batches[t] if lookahead else None)
        hit = slots >= 0
        if hit.any() and not (cache.rows[slots[hit], 0] == (keys[hit] & 0xFF)).all():
            raise AssertionError(f"{policy} cache returned another key's row")
        cache.admit(keys[~hit], rows(keys[~hit]))
        cache.unpin(slots)
    probes, hits = cache.counters.probes - start.probes, cache.counters.hits - start.hits
    return hits / probes if probes else 0.0


def run_steps(steps: list[np.ndarray], cfg: CacheBenchConfig, stream: dict[str, object] | None = None,
              progress: bool = False, hot: np.ndarray | None = None) -> CacheBenchResult:
    """Replay the steps through every policy and capacity of cfg (lru-hot: from `hot`); plots unless cfg.plot == ""."""
    for name in cfg.policies:
        if name not in ALL_POLICIES:
            raise ValueError(f"unknown cache policy {name!r} (valid: {', '.join(ALL_POLICIES)})")
    for frac in cfg.capacities:
        if not 0 < frac <= 1:
            raise ValueError(f"capacity fractions must be in (0, 1], got {frac}")
    flat = np.concatenate(steps) if steps else np.empty(0, dtype=np.int64)
    distinct = int(np.unique(flat).size)
    facts = {**(stream or {}), "steps": len(steps), "accesses": int(flat.size), "distinct_rows": distinct,
             "reuse": 1 - distinct / flat.size if flat.size else 0.0}
    if cfg.capacity_of not in ("touched", "table"):
        raise ValueError(f"capacity_of must be 'touched' or 'table', got {cfg.capacity_of!r}")
    if cfg.capacity_of == "table" and not (stream or {}).get("table_rows"):
        raise ValueError("capacities as fractions of the table need the table's rows (a hashed stream)")
    base = int(stream["table_rows"]) if cfg.capacity_of == "table" else distinct
    caps = {cap_key(f): max(1, round(f * base)) for f in cfg.capacities}
    res = CacheBenchResult(cfg, facts, caps)
    if HOT in cfg.policies and hot is None:
        raise ValueError("lru-hot needs the hot rows (run() counts them from the corpus's train split)")
    for name in cfg.policies:
        res.hit_rate[name] = {}
        for key, cap in caps.items():
            # a cache of at least every row the stream touches never evicts: the same hits at that size, without
            # allocating a slot array for a whole V4.1 table
            eff = min(cap, max(1, distinct))
            if name == HOT:  # starts full of rows the stream may never touch: every slot counts
                if cap > HOT_MAX_ROWS:
                    res.hit_rate[name][key] = None
                    continue
                res.hit_rate[name][key] = replay(steps, cap, "lru", hot=hot)
            elif name == "belady":
                res.hit_rate[name][key] = belady_hit_rate(flat, eff)
            else:
                res.hit_rate[name][key] = replay(steps, eff, name, cfg.window)
            if res.hit_rate[name][key] is not None:
                log(progress, f"  {name:<10} {key:>5} ({cap} rows): {100 * res.hit_rate[name][key]:6.2f}%")
    if cfg.plot != "":
        res.plot = str(plot(res, Path(cfg.plot) if cfg.plot else cache_dir("bench") / "cache_hit_rate.png"))
    return res


def run(cfg: CacheBenchConfig, docs: TokenDocs | None = None, progress: bool = True) -> CacheBenchResult:
    """Tokenize, hash, schedule and replay; `docs` overrides the text source (tests pass tiny ones)."""
    if min(cfg.prompt_len, cfg.step_tokens, cfg.max_tokens, cfg.max_seqs) < 1 or cfg.decode_len < 0:
        raise ValueError("prompt_len, step_tokens, max_tokens and max_seqs must be >= 1, decode_len >= 0")
    if cfg.window < 0:
        raise ValueError(f"lookahead window must be >= 0, got {cfg.window}")
    t0 = time.perf_counter()
    docs = docs or load_docs(cfg)
    if docs.tokenizer is not None:
        lookup, compressed = build_compression(docs.tokenizer)
        compression: dict[str, object] = {"compression": lookup}
    else:
        compression = {"compressed_vocab_size": docs.vocab_size}
        compressed = docs.vocab_size
    if cfg.rows_per_head is not None and cfg.rows_per_head < 1:
        raise ValueError(f"rows_per_head must be >= 1, got {cfg.rows_per_head}")
    rows = cfg.rows_per_head or cfg.table_factor * compressed
    hasher = NgramHasher([rows] * (cfg.max_ngram_size - 1), cfg.max_ngram_size,
                         cfg.n_head_per_ngram, [cfg.layer_id], docs.pad_id, cfg.seed, **compression)
    requests = make_requests(docs.docs, cfg)
    if not requests:
        raise ValueError(f"the token source ({docs.source}) yielded no request of 2 or more tokens")
    steps = schedule(request_rows(requests, hasher, cfg.layer_id), cfg)
    hot = hot_keys(cfg, docs, hasher, progress) if HOT in cfg.policies else None
    table_rows = sum(hasher.head_sizes(cfg.layer_id))
    stream = {"source": docs.source, "tokens": int(sum(r.size for r in requests)), "requests": len(requests),
              "vocab_size": docs.vocab_size, "compressed_vocab_size": compressed, "heads": hasher.num_heads,
              "orders": f"2..{cfg.max_ngram_size}", "table_rows": table_rows,
              "prepare_s": round(time.perf_counter() - t0, 2)}
    log(progress, f"stream: {stream['tokens']} tokens of {docs.source}, {len(requests)} requests, {len(steps)} steps, "
                  f"prepared in {stream['prepare_s']} s")
    return run_steps(steps, cfg, stream, progress, hot)


def hot_keys(cfg: CacheBenchConfig, docs: TokenDocs, hasher: NgramHasher, progress: bool) -> np.ndarray:
    """The layer's keys the corpus's train split reads, most read first (the replayed split must be another)."""
    from tiergram.corpus import corpus_dir
    from tiergram.model.data import tokenize_split
    from tiergram.model.hot_rows import count_hot_rows

    if not docs.source.startswith("corpus") or cfg.split == "train":
        raise ValueError(f"lru-hot counts the corpus's train split: replay another split of the corpus (source "
                         f"{docs.source!r}, split {cfg.split!r})")
    folder = Path(cfg.corpus) if cfg.corpus else corpus_dir()
    tokens = tokenize_split(folder, "train", folder / "tokenizer.json", progress=progress)
    caps = max(cfg.capacities) if cfg.capacity_of == "table" else 1.0
    counted = count_hot_rows(hasher, tokens, max_fraction=min(1.0, caps), progress=progress,
                             source=f"train split of {folder}")
    return counted.keys[cfg.layer_id]


# ---------------------------------------------------------------- output


def plot(res: CacheBenchResult, path: Path) -> Path:
    """Hit rate against capacity fraction, one line per policy, as a PNG."""
    fracs = [float(k) for k in res.capacity_rows]
    fig, ax = subplots(figsize=(6.4, 4.2))
    for name, rates in res.hit_rate.items():
        shown = [(float(k), 100 * rates[k]) for k in res.capacity_rows if rates[k] is not None]
        ax.plot([x for x, _ in shown], [y for _, y in shown], marker="o",
                linestyle="--" if name == "belady" else "-", label=name)
    ax.axhline(100 * float(res.stream["reuse"]), color="gray", linestyle=":", label="every reuse a hit")
    ax.set_xscale("log")
    ax.set_xticks(fracs, [f"{100 * f:g}%" for f in fracs])
    ax.set_xlabel("cache capacity (fraction of the table)" if res.config.capacity_of == "table"
                  else "cache capacity (fraction of distinct rows touched)")
    ax.set_ylabel("hit rate (%)")
    s = res.stream
    ax.set_title(f"{s['accesses'] / 1e6:.2f}M accesses, {s['distinct_rows']} rows, lookahead window "
                 f"{res.config.window}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def to_json(res: CacheBenchResult) -> str:
    """One JSON object: hit_rate {policy: {capacity fraction: rate}}, the gap, the stream facts, the config."""
    obj = {"hit_rate": res.hit_rate, "capacity_rows": res.capacity_rows, "lookahead_gap_points": res.gap_points,
           "target_points": res.config.target_points, "target_met": res.target_met, "stream": res.stream,
           "plot": res.plot, "config": asdict(res.config)}
    return json.dumps(obj, indent=2)


def to_text(res: CacheBenchResult) -> str:
    """A policy x capacity table of hit rates, lookahead's gap to belady, and whether the target is met."""
    s, c = res.stream, res.config
    lines = [f"source: {s.get('source', 'given steps')}",
             f"stream: {s['accesses']} accesses ({s['distinct_rows']} distinct rows, at most "
             f"{100 * float(s['reuse']):.2f}% hits, {s['steps']} steps"
             + (f", {s['tokens']} tokens, {s['requests']} requests, {s['heads']} heads orders {s['orders']}, "
                f"table {s['table_rows']} rows" if "tokens" in s else "") + ")",
             f"{'policy':<16}" + "".join(f"{100 * float(k):>8g}%" for k in res.capacity_rows),
             f"{'(rows)':<16}" + "".join(f"{n:>9}" for n in res.capacity_rows.values())]
    for name, rates in res.hit_rate.items():
        label = f"{name} (w={c.window})" if name == "lookahead" else name
        lines.append(f"{label:<16}" + "".join(f"{100 * r:>8.2f}%" if r is not None else f"{'-':>9}"
                                              for r in rates.values()))
    gaps = res.gap_points
    if gaps:
        lines.append(f"{'belady gap':<16}" + "".join(f"{g:>9.2f}" for g in gaps.values()))
        verdict = "MET" if res.target_met else "NOT MET"
        lines.append(f"target: lookahead within {c.target_points:g} points of belady at every capacity: {verdict} "
                     f"(worst gap {max(gaps.values()):.2f} points)")
    if res.plot:
        lines.append(f"plot: {res.plot}")
    return "\n".join(lines)
