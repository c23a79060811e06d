"""The measuring half of `tiergram plan calibrate`: this machine's raw figures, as one JSON-able dict.

Nothing here fits: `tiergram.plan.calibrate.fit` turns the dict (`schema` MEASUREMENT_SCHEMA) into a hardware spec
(docs/planner.md).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.bench.common import log
from tiergram.plan.calibrate import MEASUREMENT_SCHEMA

QUEUE_DEPTHS = (1, 8, 32, 128)
SPEED_SPREAD = 1.25  # the CPU speed probes of one calibration differing by more: a warning
# tables up to this size are timed resident ("device" on a CPU: a torch tensor); larger ones, e.g. the 8 GiB
# V4.1-geometry tables, with the host tier, which loads them just as fast and is what a sweep serves them with
RESIDENT_STEP_TABLE_BYTES = 1 << 30
# the step stretch jumps between 1 and 2 users and is not monotone past 4: measure every level a default sweep runs
SERVE_CONCURRENCIES = (1, 2, 4, 8, 16)
SERVE_PASSES = 3  # each level's stretch is its fastest pass: three chances to catch the machine's own speed


def step_placement(table_bytes: int) -> str:
    """The placement the engine's steps are timed with: device for small tables, host for large ones."""
    return "device" if table_bytes <= RESIDENT_STEP_TABLE_BYTES else "host"


def engine_steps(model_dir: str, batches: tuple[int, ...] = (1, 2, 4, 8, 16), input_len: int = 128,
                 output_len: int = 32, progress: bool = True, placement: str = "device") -> dict[str, Any]:
    """Every engine step as [tokens, sequences, seconds] (3 runs per batch size, 1 warm-up) on serve's torch threads."""
    import torch
    from tqdm import tqdm

    from tiergram.engine import EngineConfig, LLMEngine, SamplingParams, serving_torch_threads

    memory = {"device_memory_bytes": 8 << 30} if placement == "device" else {}
    cfg = EngineConfig(model_dir, placement, max_num_seqs=max(batches), **memory)
    rng = np.random.default_rng(0)
    samples: list[list[float]] = []
    threads_before = torch.get_num_threads()
    torch.set_num_threads(serving_torch_threads())
    threads = torch.get_num_threads()
    try:
        with LLMEngine(cfg) as engine:
            vocab = engine.model.config.vocab_size
            for n in tqdm(batches, desc="engine steps", disable=not progress):
                for rep in range(3):
                    for i in range(n):
                        engine.add_request(f"cal-{n}-{rep}-{i}", rng.integers(2, vocab, input_len).tolist(),
                                           SamplingParams(max_tokens=output_len, ignore_eos=True))
                    while engine.has_unfinished():
                        t0 = time.perf_counter()
                        engine.step()
                        seconds = time.perf_counter() - t0
                        last = engine.scheduler.last
                        if rep and last:
                            samples.append([float(sum(t for _, t, _ in last)), float(len(last)), seconds])
    finally:
        torch.set_num_threads(threads_before)
    return {"placement": placement, "torch_threads": threads, "samples": samples}


def mean_call_s(call: Callable[[], object], seconds: float) -> tuple[float, int]:
    """(mean seconds per call, calls) of `call` run again and again for about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        call()
        n += 1
    return (time.perf_counter() - t0) / max(1, n), n


def lookup_times(table_path: Path, heads: int, tokens: tuple[int, ...] = (8, 32, 128, 512),
                 seconds: float = 0.5) -> list[list[float]]:
    """The host tier's lookups of [1, T, H] random row ids: [rows, seconds per call] at each T."""
    from tiergram.store import TieredTable

    rng = np.random.default_rng(1)
    with TieredTable(str(table_path), tier="host") as table:
        n_rows = min(table.manifest.head_rows)  # ids are per head
        out = []
        for t in tokens:
            def call(t: int = t) -> object:
                return table.lookup(rng.integers(0, n_rows, (1, t, heads), dtype=np.int64))

            call()
            out.append([t * heads, mean_call_s(call, seconds)[0]])
    return out


def file_tier_times(table_path: Path, heads: int, cache_fraction: float = 0.1, seconds: float = 0.5) -> dict[str, Any]:
    """The file tier behind a host cache: `hits`, [rows, seconds per call] of cached ids at T = 8 and 128;
    `misses`, the process's CPU seconds and pages read over `calls` lookups of fresh random ids."""
    from tiergram.store import TieredTable

    rng = np.random.default_rng(2)
    cache_bytes = max(1 << 20, int(cache_fraction * table_path.stat().st_size))
    with TieredTable(str(table_path), tier="file", cache_bytes=cache_bytes) as table:
        n_rows = min(table.manifest.head_rows)
        hits = []
        for t in (8, 128):
            ids = rng.integers(0, n_rows, (1, t, heads), dtype=np.int64)
            table.lookup(ids)
            hits.append([t * heads, mean_call_s(lambda ids=ids: table.lookup(ids), seconds)[0]])
        pages, spent = table.stats()["pages_read"], time.process_time()
        _, calls = mean_call_s(lambda: table.lookup(rng.integers(0, n_rows, (1, 64, heads), dtype=np.int64)), seconds)
        misses = {"calls": calls, "rows_per_call": 64 * heads, "pages": table.stats()["pages_read"] - pages,
                  "cpu_s": time.process_time() - spent}
    return {"cache_fraction": cache_fraction, "hits": hits, "misses": misses}


def disk_curve(table_path: Path, seconds: float = 1.0) -> dict[str, Any]:
    """Fresh random 4 KiB page reads/s per queue depth, CPU per page, and `reread_rates` at QD 128."""
    from tiergram.bench.file_lookup import LimitReader, reread_rates
    from tiergram.format import TableFile

    curve, cpu = [], []
    for qd in QUEUE_DEPTHS:
        with LimitReader(TableFile.open(table_path), qd) as reader:
            reader.segment(0.2)  # warm-up
            f = reader.segment(seconds).figures()
        curve.append([qd, round(f["pages_per_s"])])
        if f.get("cpu_us_per_page") is not None:
            cpu.append(f["cpu_us_per_page"])
    fresh, again = reread_rates(TableFile.open(table_path), pages=max(2048, int(curve[-1][1] * seconds)))
    return {"seconds": seconds, "iops_curve": curve, "cpu_us_per_page": float(np.median(cpu)) if cpu else None,
            "new_pages_per_s": round(fresh), "reread_pages_per_s": round(again)}


def host_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Host DRAM bytes/s of a large copy (read + write counted), best of a few."""
    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0))
    return best


def serve_runs(model_dir: str, concurrencies: tuple[int, ...] = SERVE_CONCURRENCIES, input_len: int = 128,
               output_len: int = 32, requests_per_user: int = 4, passes: int = SERVE_PASSES) -> dict[str, Any]:
    """A real `tiergram serve` (host) under `bench serve`'s closed loop, `passes` times up and down the levels: per
    run its wall seconds, requests, and the engine's busy seconds, steps and tokens (`plan.calibrate.fit_serve`)."""
    import asyncio

    import httpx

    from tiergram.bench import serve as sweep
    from tiergram.model.checkpoint import load_tokenizer_of

    cfg = sweep.SweepConfig(model_dir=model_dir, placements=("host",), input_len=input_len, output_len=output_len)
    need = 400_000  # start far past what a default sweep replays, so calibration and sweep see different text
    tokens, _ = sweep.trace_tokens(load_tokenizer_of(model_dir), need + passes * (input_len + output_len)
                                   * sum(c * (requests_per_user + 1) for c in concurrencies))
    trace = sweep.Trace(tokens[min(need, len(tokens) // 2):], input_len, output_len, seed=1)
    counters = ("tiergram_engine_step_seconds_total", "tiergram_engine_steps_total",
                "tiergram_engine_computed_tokens_total")
    runs = []
    with sweep.ServerProcess(cfg, "host", 0, max_waiting=256) as server:
        model = httpx.get(f"{server.url}/health", timeout=30).json()["model"]
        for k in range(passes):
            for c in (concurrencies if k % 2 == 0 else concurrencies[::-1]):
                asyncio.run(sweep.closed_loop(server.url, model, trace.take(c), c))  # warm-up
                before = sweep.scrape(server.url)
                timings, wall = asyncio.run(sweep.closed_loop(server.url, model, trace.take(requests_per_user * c),
                                                              c))
                after = sweep.scrape(server.url)
                busy, steps, computed = (after[key] - before[key] for key in counters)
                runs.append({"pass": k, "c": c, "wall_s": wall, "requests": len(timings), "busy_s": busy,
                             "steps": steps, "tokens": computed})
    return {"input_len": input_len, "output_len": output_len, "concurrencies": list(concurrencies),
            "passes": passes, "runs": runs}


def measure(model_dir: str, progress: bool = True, disk_seconds: float = 1.0, gather_seconds: float = 0.5,
            batches: tuple[int, ...] = (1, 2, 4, 8, 16), serve: bool = True) -> dict[str, Any]:
    """Run every measurement over model_dir (its exported FP8 tables): the dict `plan calibrate` fits."""
    from tiergram.bench.serve import layer_tables
    from tiergram.machine import cpu_speed_ms
    from tiergram.model.checkpoint import read_config
    from tiergram.plan.specs import model_from_dir

    spec = model_from_dir(Path(model_dir))
    tables = layer_tables(model_dir)
    heads = spec.engram.heads
    log(progress, f"calibrating on {model_dir}: {len(spec.engram.layers)} Engram layers x {heads} rows per token, "
                  f"{spec.engram.row_bytes}-byte rows, {spec.engram.table_bytes / 2**30:.2f} GiB of tables")
    max_seq = int(read_config(model_dir)["model"].get("max_seq", 256))
    input_len, output_len = min(128, max_seq // 2), min(32, max_seq // 4)
    probe_s = min(1.0, 2 * gather_seconds)
    speed = [cpu_speed_ms(probe_s)]  # how fast the machine ran around the CPU measurements (a moving one: a warning)
    log(progress, "[1/5] host tier lookups")
    lookups = lookup_times(tables[0], heads, seconds=gather_seconds)
    where = step_placement(spec.engram.table_bytes)
    log(progress, f"[2/5] engine steps ({where} tables)")
    steps = engine_steps(model_dir, batches, input_len, output_len, progress, where)
    speed.append(cpu_speed_ms(probe_s))
    log(progress, "[3/5] disk: random 4 KiB reads at queue depths " + ", ".join(map(str, QUEUE_DEPTHS))
        + "; the file tier's hit and miss paths")
    disk = disk_curve(tables[0], disk_seconds)
    file = file_tier_times(tables[0], heads, seconds=gather_seconds)
    speed.append(cpu_speed_ms(probe_s))
    log(progress, "[4/5] host memory bandwidth and size")
    bandwidth, memory = host_bandwidth(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # MemTotal
    runs = None
    if serve:
        log(progress, "[5/5] the HTTP path: `tiergram serve` (host placement) under a closed loop at c = "
            + ", ".join(map(str, SERVE_CONCURRENCIES)))
        runs = serve_runs(model_dir, input_len=input_len, output_len=output_len)
        speed.append(cpu_speed_ms(probe_s))
    if max(speed) > SPEED_SPREAD * min(speed):
        print(f"warning: the machine's speed moved by {max(speed) / min(speed):.1f}x during calibration (probes "
              + ", ".join(f"{x:.2f}" for x in speed) + " ms; their median is kept); on a quiet machine the figures "
              "are more trustworthy", file=sys.stderr)
    return {"schema": MEASUREMENT_SCHEMA, "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "model_dir": str(model_dir), "cpus": os.cpu_count() or 1,
            "model": {"engram_layers": len(spec.engram.layers), "heads": heads,
                      "rows_per_token": spec.engram.rows_per_token, "flops_per_token": spec.flops_per_token},
            "cpu_speed_ms": speed, "lookups": lookups, "steps": steps, "file": file, "disk": disk,
            "host_bandwidth_bytes_s": bandwidth, "host_memory_bytes": memory, "serve": runs}
