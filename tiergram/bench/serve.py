"""`tiergram bench serve` (docs/serving.md): runs the sweep that `serve_config` describes with the servers of
`serve_process` and the load of `load`; `serve_stats` and `serve_report` make its figures and report."""

from __future__ import annotations

import asyncio
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from tiergram.bench.common import log
from tiergram.bench.load import Conversations, Trace, closed_loop, trace_tokens
from tiergram.bench.serve_config import SweepConfig, load_variants, round_order
from tiergram.bench.serve_process import (
    ServerProcess,
    cache_budgets,
    layer_table_bytes,
    layer_tables,
    peak_rss,
    scrape,
    thread_cpu_seconds,
)
from tiergram.bench.serve_report import plot, to_json, to_markdown, to_text
from tiergram.bench.serve_stats import Point, Round, SweepResult, checks, pareto, summarize
from tiergram.machine import cpu_speed_ms
from tiergram.paths import cache_dir
from tiergram.plan.model import levels

__all__ = ["ServerProcess", "SweepConfig", "load_variants", "run", "scrape", "to_json", "to_text"]


def workload(cfg: SweepConfig, tokens: Any, max_model_len: int) -> Trace | Conversations:
    """The sweep's load: one-shot requests, or conversations (refused if their last turn exceeds the model)."""
    if cfg.workload == "requests":
        return Trace(tokens, cfg.input_len, cfg.output_len, cfg.seed)
    sessions = Conversations(tokens, cfg.input_len, cfg.output_len, cfg.seed, cfg.turns, cfg.docs)
    if sessions.max_len > max_model_len:
        raise ValueError(f"conversations of {cfg.turns} turns reach {sessions.max_len} tokens (a {cfg.input_len}-token "
                         f"document, questions of {sessions.question_len}, answers of {cfg.output_len}), more than "
                         f"the servers' max_model_len {max_model_len}: lower --input-len, --output-len or turns")
    return sessions


def disk_limit(path: Path, seconds: float = 1.0) -> float | None:
    """Random page reads/s the disk gives the native reader at QD 128 on new pages; None without O_DIRECT."""
    from tiergram.bench.file_lookup import LimitReader
    from tiergram.format import TableFile

    with LimitReader(TableFile.open(path), 128) as reader:
        return reader.segment(seconds).figures()["pages_per_s"] if reader.reader.direct else None


def run(cfg: SweepConfig, progress: bool = True) -> SweepResult:
    """Sweep every server (all running from the start, taking turns round by round): points, fronts, checks."""
    import httpx

    from tiergram.model.checkpoint import load_tokenizer_of

    t_start = time.perf_counter()
    tables = layer_tables(cfg.model_dir)  # (exports when needed)
    labels = cfg.labels()
    caches = cache_budgets(cfg, tables)
    tokenizer = load_tokenizer_of(cfg.model_dir)
    if tokenizer is None:
        raise ValueError(f"{cfg.model_dir} has no tokenizer.json to tokenize the trace with")
    max_levels = levels(cfg.max_num_seqs, cfg.max_concurrency)
    per_user = cfg.requests_per_user * cfg.rounds + cfg.warmup_per_user
    need = sum(per_user * c for c in max_levels) * (cfg.input_len + cfg.output_len)
    if cfg.workload == "conversations":  # the shared documents come first, then the turns' text
        need += cfg.docs * cfg.input_len
    tokens, source = trace_tokens(tokenizer, need, cfg.source, cfg.corpus)
    log(progress, f"trace: {len(tokens)} tokens of the {source}")
    # the disk's limit on each model's own tables (a cache under this VM's disk makes one file's rate not another's)
    limit_tables = {"": tables[0]}
    if cfg.big_model_dir and any(cfg.kind_of(lb) == "file" for lb in labels):
        limit_tables["big"] = layer_tables(cfg.big_model_dir)[0]
    disk: dict[str, dict[str, float]] = {which: {} for which in limit_tables}  # before/after, pages/s
    points: list[Point] = []
    servers: dict[str, dict[str, Any]] = {}
    live: dict[str, tuple[str, str, list[int]]] = {}  # label -> (url, model name, its concurrency levels)
    procs: dict[str, int] = {}  # label -> server pid
    with ExitStack() as stack:
        if "mooncake" in labels and not cfg.mooncake_master:
            from tiergram.bench.mooncake_cluster import LocalCluster

            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tiergram-serve-mooncake-")))
            segment = 2 * sum(path.stat().st_size for path in tables) + (64 << 20)  # pages + per-object room
            cluster = stack.enter_context(LocalCluster(logs, segment_bytes=segment))
            log(progress, f"[mooncake] local cluster: master {cluster.master_addr}, one holder of {segment} bytes")
            cfg = replace(cfg, mooncake_master=cluster.master_addr)
        for placement in labels:
            cb = caches[placement]
            log(progress, f"[{placement}] starting the server" + (f" (host cache {cb} bytes)" if cb else ""))
            model_dir = cfg.big_model_dir if placement == "file-big" else cfg.model_dir
            waiting = max(256, 2 * cfg.max_concurrency)
            server = stack.enter_context(ServerProcess(cfg, placement, cb, max_waiting=waiting, model_dir=model_dir))
            procs[placement] = server.proc.pid
            health = httpx.get(f"{server.url}/health", timeout=30).json()
            per_seq = -(-(cfg.input_len + cfg.output_len) // cfg.block_size)  # K/V blocks of one request
            limit = min(cfg.max_num_seqs, int(health["kv_blocks_total"]) // per_seq)
            servers[placement] = {"kv_blocks_total": health["kv_blocks_total"], "concurrency_limit": limit,
                                  "max_model_len": health["max_model_len"], "cache_bytes": cb, "model": health["model"],
                                  "kind": cfg.kind_of(placement), "base": cfg.base_of(placement),
                                  "settings": server.settings.to_dict(),
                                  "model_dir": model_dir, "table_bytes": sum(layer_table_bytes(model_dir))}
            started = scrape(server.url)
            if started.get("tiergram_engram_hot_rows_preloaded"):  # the start's cost of the preload
                servers[placement]["hot_rows_preloaded"] = int(started["tiergram_engram_hot_rows_preloaded"])
                servers[placement]["hot_rows_preload_s"] = started.get("tiergram_engram_hot_rows_preload_seconds", 0.0)
            if limit < 1:
                log(progress, f"[{placement}] the K/V budget holds no {cfg.input_len + cfg.output_len}-token "
                               "sequence; skipped")
                continue
            live[placement] = (server.url, health["model"], levels(limit, cfg.max_concurrency))
        # measured once the servers have started: after any hot-rows preload, the disk is as the rounds read it
        if any(cfg.kind_of(lb) == "file" for lb in labels):
            for which, table in limit_tables.items():
                before = disk_limit(table)
                for lb in labels:  # the file servers of these tables read as the probe did
                    if cfg.kind_of(lb) == "file" and (cfg.base_of(lb) == "file-big") == bool(which):
                        servers[lb]["file_mode"] = "buffered" if before is None else "direct"
                if before is None:
                    log(progress, f"{table}: the filesystem refuses O_DIRECT; the file servers read through the "
                                   "page cache and no disk limit is measured")
                    continue
                disk[which]["before"] = before
                log(progress, f"disk limit on {table.name}{' (big model)' if which else ''} (native reader, QD128, "
                              f"O_DIRECT, new pages): {before:.0f} pages/s")
        trace = workload(cfg, tokens, max_model_len=min(s["max_model_len"] for s in servers.values()))
        think = cfg.think_time_s if cfg.workload == "conversations" else 0.0
        for c in sorted({c for _, _, lv in live.values() for c in lv}):
            members = [pl for pl, (_, _, lv) in live.items() if c in lv]
            warm = trace.take(cfg.warmup_per_user * c)
            rounds: dict[str, list[Round]] = {pl: [] for pl in members}
            for pl in members:
                asyncio.run(closed_loop(live[pl][0], live[pl][1], warm, c, think, cfg.seed))
            for r in range(cfg.rounds):
                requests = trace.take(cfg.requests_per_user * c)  # every placement serves the same ones
                speed = cpu_speed_ms(cfg.speed_probe_s) if cfg.speed_probe_s else None
                for pl in round_order(members, r):
                    url, model, _ = live[pl]
                    before = scrape(url) | thread_cpu_seconds(procs[pl])
                    timings, wall = asyncio.run(closed_loop(url, model, requests, c, think, cfg.seed + r))
                    after = scrape(url) | thread_cpu_seconds(procs[pl])
                    speed_after = cpu_speed_ms(cfg.speed_probe_s) if cfg.speed_probe_s else None  # the next's before
                    around = None if speed is None or speed_after is None else (speed + speed_after) / 2
                    rounds[pl].append(Round(timings, wall, before, after, around))
                    speed = speed_after
            for pl in members:
                p = summarize(pl, c, rounds[pl])
                p.server_peak_rss_bytes = peak_rss(procs[pl])
                points.append(p)
                log(progress, f"[{pl}] c={c:<3} {p.throughput_tok_s:8.1f} tok/s  TTFT p90 {p.ttft_p90_ms:7.1f} ms  "
                               f"ITL p90 {p.itl_p90_ms:6.1f} ms  stall {p.exposed_stall_s:.3f} s  CPU "
                               f"{p.cpu_ms_per_token:.2f} ms/token")
        for pl, pid in procs.items():
            servers[pl]["peak_rss_bytes"] = peak_rss(pid)
    for which, table in limit_tables.items():
        if disk[which] and (after := disk_limit(table)) is not None:
            disk[which]["after"] = after
            log(progress, f"disk limit on {table.name}{' (big model)' if which else ''} after the sweep: "
                          f"{after:.0f} pages/s")
    points.sort(key=lambda p: (labels.index(p.placement), p.concurrency))
    fronts = {pl: [p.concurrency for p in pareto([q for q in points if q.placement == pl])] for pl in labels}
    res = SweepResult(cfg, source, points, fronts, servers, {}, 0.0, disk_pages_per_s=disk[""],
                      big_disk_pages_per_s=disk.get("big", {}))
    res.checks = checks(res)
    res.seconds = round(time.perf_counter() - t_start, 1)
    res.plot = str(plot(res, Path(cfg.plot) if cfg.plot else cache_dir("bench") / "serve-sweep.png"))
    if cfg.markdown:
        Path(cfg.markdown).write_text(to_markdown(res))
    return res
