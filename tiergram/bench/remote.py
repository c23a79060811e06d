"""`tiergram bench lookup --tier mooncake`: tiergram's tiers against Mooncake's EngramStore and raw page fetches."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.bench.common import cached_table
from tiergram.bench.mooncake_cluster import LocalCluster, private_netns, run_in_netns

BATCHES = (1, 256, 1024, 4096)


@dataclass
class RemoteLookupConfig:
    """Geometry of the side-by-side benchmark: one head (a batch of n rows is n ids), fp32 rows as EngramStore's."""

    rows: int = 65536
    dim: int = 256
    batches: tuple[int, ...] = BATCHES
    dists: tuple[str, ...] = ("uniform", "zipf", "stream")  # stream: 2-gram row ids of real text, in order
    calls: int = 12  # timed calls per system, batch size and distribution (interleaved)
    warmup_calls: int = 4  # untimed calls first (they fill tiergram's cache)
    cache_fraction: float = 0.10
    # the cached table opens fresh for each id stream and first looks up this many of its rows, untimed: a warm cache
    cache_warm_rows: int = 65536
    seed: int = 0


def run_lookup(cfg: RemoteLookupConfig, work_dir: Path, progress: bool = True) -> dict:
    """Every system on the same ids, interleaved, in a local cluster: rows/s, p50, p99 ms by batch and ids."""
    from mooncake.store import EngramStore, EngramStoreConfig
    from tqdm import tqdm

    from tiergram.bench.common import draw_ids
    from tiergram.format import TableManifest, create_table
    from tiergram.paths import cache_dir
    from tiergram.store import TieredTable
    from tiergram.tiers.aligned import aligned_empty
    from tiergram.tiers.mooncake import connect, push_table

    values = np.random.default_rng(cfg.seed).standard_normal((cfg.rows, cfg.dim)).astype(np.float32)
    m = TableManifest(codec="fp32", dim=cfg.dim, head_rows=(cfg.rows,),
                      provenance={"tool": "tiergram bench lookup --tier mooncake", "init": f"normal, seed {cfg.seed}"})
    path = cached_table(cache_dir("bench") / f"bench-remote-fp32-{cfg.rows}x{cfg.dim}-s{cfg.seed}.tgram", m,
                        lambda p: create_table(p, m, lambda s, n: values[s:s + n], progress=progress)).path
    table_bytes = cfg.rows * cfg.dim * 4
    # EngramStore's copy and tiergram's pages (4 KiB per 3 rows at D=256), with room
    segment = 3 * table_bytes + (64 << 20)
    with LocalCluster(work_dir / "mooncake-logs", holders=1, segment_bytes=segment) as cluster:
        store = connect(cluster.master_addr, buffer_bytes=256 << 20)
        ecfg = EngramStoreConfig()
        ecfg.embedding_dim, ecfg.table_vocab_sizes = cfg.dim, [cfg.rows]
        engram = EngramStore(0, ecfg, store)
        engram.populate([values])
        uri = push_table(path, cluster.master_addr, "bench", progress=progress, store=store)
        cache_bytes = int(cfg.cache_fraction * table_bytes)
        tables = {
            "tiergram_mooncake": TieredTable(uri, tier="mooncake", remote_options={"store": store}),
            "tiergram_mooncake_cache10": TieredTable(uri, tier="mooncake", cache_bytes=cache_bytes,
                                                     remote_options={"store": store}),
            "tiergram_file": TieredTable(path, tier="file"),
            "tiergram_host": TieredTable(path, tier="host"),
        }
        raw_tier = tables["tiergram_mooncake"].tier
        limit_buf = aligned_empty(max(cfg.batches) * m.page_size)
        reader = tables["tiergram_file"].tier.reader

        def pages_of(ids: np.ndarray) -> np.ndarray:
            return np.unique(ids.reshape(-1) // m.rows_per_page)

        def raw_get(ids: np.ndarray) -> None:  # Mooncake's batch_get_into of the same pages, unverified
            pages = pages_of(ids)
            buf = raw_tier.staging(pages.size * m.page_size)
            ps = m.page_size
            keys = [f"tiergram/bench/p{p}" for p in pages]
            store.batch_get_into(keys, [buf.ctypes.data + i * ps for i in range(pages.size)], [ps] * pages.size)

        def read_limit(ids: np.ndarray) -> None:  # the native reader's O_DIRECT reads of the same pages
            pages = pages_of(ids)
            reader.read_pages(pages, limit_buf[: pages.size * m.page_size])

        calls: dict[str, Any] = {
            "mooncake_engramstore": lambda ids: engram.lookup(ids.reshape(1, -1, 1)),
            "mooncake_raw": raw_get,
            "file_limit": read_limit,
            **{name: (lambda ids, name=name: tables[name].lookup(ids.reshape(-1, 1))) for name in tables},
        }
        # the outputs agree before anything is timed
        probe = np.arange(0, cfg.rows, max(1, cfg.rows // 97), dtype=np.int64)
        want = engram.lookup(probe.reshape(1, -1, 1)).reshape(-1, cfg.dim)
        for name, t in tables.items():
            got = t.lookup(probe.reshape(-1, 1)).reshape(-1, cfg.dim).numpy()
            if not np.array_equal(got, want):
                raise AssertionError(f"{name} returned rows that differ from Mooncake's EngramStore")
        rng = np.random.default_rng(cfg.seed + 1)
        heads = np.array([cfg.rows], dtype=np.int64)
        stream = _token_stream(cfg.rows, cfg.seed) if "stream" in cfg.dists else np.zeros(0, dtype=np.int64)
        cursor = 0

        def draw(dist: str, batch: int) -> np.ndarray:
            nonlocal cursor
            if dist != "stream":
                return draw_ids(dist, (batch, 1), heads, rng)
            if cursor + batch > stream.size:
                cursor = 0
            cursor += batch
            return stream[cursor - batch:cursor].reshape(batch, 1)

        total = len(cfg.dists) * len(cfg.batches) * (cfg.calls + cfg.warmup_calls)
        bar = tqdm(total=total, unit="round", disable=not progress, desc="mooncake lookup")
        times: dict[tuple[str, int, str], list[float]] = {}
        for dist in cfg.dists:
            tables["tiergram_mooncake_cache10"].close()  # a fresh cache for each stream, warmed on it
            tables["tiergram_mooncake_cache10"] = cached = TieredTable(uri, tier="mooncake", cache_bytes=cache_bytes,
                                                                        remote_options={"store": store})
            warmed = 0
            while warmed < cfg.cache_warm_rows:
                ids = draw(dist, min(1024, cfg.cache_warm_rows - warmed))
                cached.lookup(ids.reshape(-1, 1))
                warmed += ids.size
            for batch in cfg.batches:
                for k in range(cfg.warmup_calls + cfg.calls):
                    ids = draw(dist, batch)
                    order = list(calls) if k % 2 == 0 else list(calls)[::-1]  # interleaved, alternating order
                    for name in order:
                        t0 = time.perf_counter()
                        calls[name](ids)
                        dt = time.perf_counter() - t0
                        if k >= cfg.warmup_calls:
                            times.setdefault((name, batch, dist), []).append(dt)
                    bar.update(1)
        bar.close()

        def summary(batch: int, seconds: list[float]) -> dict[str, float]:
            ts = np.asarray(seconds)
            return {"rows_per_s": batch * ts.size / ts.sum(), "p50_ms": float(np.percentile(ts, 50) * 1e3),
                    "p99_ms": float(np.percentile(ts, 99) * 1e3)}

        results = {dist: {name: {str(b): summary(b, times[(name, b, dist)]) for b in cfg.batches} for name in calls}
                   for dist in cfg.dists}
        stats = {name: t.stats() for name, t in tables.items() if name.startswith("tiergram_mooncake")}
        for t in tables.values():
            t.close()
        engram.remove_from_store(force=True)
        store.close()
    u, has_1024 = results[cfg.dists[0]], 1024 in cfg.batches
    return {
        "mooncake_engramstore_rows_per_s": u["mooncake_engramstore"]["1024"]["rows_per_s"] if has_1024 else None,
        "tiergram_rows_per_s": u["tiergram_mooncake"]["1024"]["rows_per_s"] if has_1024 else None,
        "headline_dist": cfg.dists[0],
        "at_1024": {dist: {name: per[name]["1024"]["rows_per_s"] for name in
                           ("mooncake_engramstore", "tiergram_mooncake", "tiergram_mooncake_cache10")}
                    for dist, per in results.items()} if has_1024 else None,
        "per_dist": results,
        "cache_stats": {k: {"hit_rate": v.get("hit_rate"), "remote": v.get("remote")} for k, v in stats.items()},
        "config": asdict(cfg),
    }


def _token_stream(rows: int, seed: int, tokens: int = 200_000) -> np.ndarray:
    """Row ids int64 [n]: one head's 2-gram hashes of the corpus validation split folded into `rows` rows."""
    from tiergram.bench.cache import CacheBenchConfig, load_docs
    from tiergram.hashing import NgramHasher, build_compression

    docs = load_docs(CacheBenchConfig(max_tokens=tokens, seed=seed))
    lookup, compressed = build_compression(docs.tokenizer)
    hasher = NgramHasher([64 * compressed], 2, 1, [1], docs.pad_id, seed, compression=lookup)
    ids = hasher.row_ids(np.concatenate(docs.docs)[None, :])[1].reshape(-1)
    return (ids % rows).astype(np.int64)


def lookup_to_text(res: dict) -> str:
    """One table per distribution: rows/s and p50/p99 ms of each system at each batch size."""
    cfg = res["config"]
    lines = [f"lookup side by side: one head x {cfg['rows']} rows, D={cfg['dim']} fp32, {cfg['calls']} timed calls per "
             f"point (interleaved), Mooncake over loopback in a private network namespace; the 10% cache fresh for "
             f"each id stream and warmed with {cfg['cache_warm_rows']:,} of its rows first (untimed)"]
    for dist, per in res["per_dist"].items():
        lines.append(f"\n{dist} ids: rows/s (p50 / p99 ms)")
        lines.append(f"{'system':<28}" + "".join(f"{b:>24}" for b in cfg["batches"]))
        for name, by_batch in per.items():
            cells = "".join(f"{d['rows_per_s']:>10,.0f} ({d['p50_ms']:6.2f}/{d['p99_ms']:6.2f})"
                            for d in by_batch.values())
            lines.append(f"{name:<28}{cells}")
        eng = per["mooncake_engramstore"]
        def ratio(name: str, b: int, per=per, eng=eng) -> float:
            return per[name][str(b)]["rows_per_s"] / eng[str(b)]["rows_per_s"]

        ratios = "  ".join(f"{b}: {ratio('tiergram_mooncake', b):.2f}x / {ratio('tiergram_mooncake_cache10', b):.2f}x"
                           for b in cfg["batches"])
        lines.append(f"tiergram mooncake vs EngramStore (no cache / 10% cache): {ratios}")
    lines.append("file_limit: the native reader's O_DIRECT reads of the same pages (the disk's limit for "
                 "tiergram_file); mooncake_raw: Mooncake's batch_get_into of the same pages (one object per page), "
                 "unverified")
    return "\n".join(lines)


def cmd_lookup(args: Any) -> int:
    """`tiergram bench lookup --tier mooncake`: re-run inside a private network namespace when not in one."""
    import json
    import tempfile

    if not private_netns():
        return run_in_netns([sys.executable, "-m", "tiergram", *sys.argv[1:]]).returncode
    cfg = RemoteLookupConfig(rows=args.rows_per_head or 65536, dim=args.dim, calls=max(2, args.rounds * 3))
    with tempfile.TemporaryDirectory(prefix="tiergram-bench-remote-") as tmp:
        res = run_lookup(cfg, Path(tmp), progress=not args.json)
    print(json.dumps(res, indent=2) if args.json else lookup_to_text(res))
    return 0
