"""`tiergram plan calibrate`: measure this machine's ingredients briefly and write them as a hardware spec.

What runs (each a few seconds): the engine's steps over a model with device-resident tables at several batch
sizes (step = overhead + per token + per sequence, least squares), the host tier's gather + dequant of step-sized
lookups (per call and per row), the disk's random 4 KiB page rate at queue depths 1-128 with the native O_DIRECT
reader and its CPU per page, host memory bandwidth (a large copy) and host memory size.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

QUEUE_DEPTHS = (1, 8, 32, 128)
SPEED_SPREAD = 1.25  # the CPU speed probes of one calibration differing by more: a warning


@dataclass
class Calibration:
    """The measured figures, in the units the spec file uses, and how each was measured."""

    values: dict[str, Any] = field(default_factory=dict)
    disk: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


# tables up to this size are timed resident ("device" on a CPU: a torch tensor); larger ones, e.g. the 8 GiB
# V4.1-geometry tables, with the host tier, which loads them just as fast and is what a sweep serves them with
RESIDENT_STEP_TABLE_BYTES = 1 << 30


def step_placement(table_bytes: int) -> str:
    """The placement calibrate times the engine's steps with: device for small tables, host for large ones."""
    return "device" if table_bytes <= RESIDENT_STEP_TABLE_BYTES else "host"


def step_costs(model_dir: str, batches: tuple[int, ...] = (1, 2, 4, 8, 16), input_len: int = 128,
               output_len: int = 32, progress: bool = True, placement: str = "device",
               gather_s_per_row: float = 0.0, gather_s_per_step: float = 0.0) -> dict[str, float]:
    """Fit step seconds = overhead + per_token x tokens + per_seq x sequences over the engine's real steps.

    With `placement="host"` each step's host-tier gather (`gather_s_per_step` + rows x `gather_s_per_row`, measured
    beforehand on the same table) is taken off before the fit: the step model adds it back for the host and file
    placements, so it must not be in the backbone's cost too.
    The engine runs on the torch threads `tiergram serve` gives it (`serving_torch_threads`).
    """
    import torch

    from tiergram.engine import EngineConfig, serving_torch_threads
    from tiergram.plan.specs import model_from_dir

    rows_per_token = model_from_dir(Path(model_dir)).engram.rows_per_token
    threads_before = torch.get_num_threads()
    torch.set_num_threads(serving_torch_threads())
    if placement == "device":
        cfg = EngineConfig(model_dir, "device", device_memory_bytes=8 << 30, max_num_seqs=max(batches))
    else:
        cfg = EngineConfig(model_dir, placement, max_num_seqs=max(batches))
    try:
        rows = _engine_steps(cfg, batches, input_len, output_len, progress, placement, rows_per_token,
                             gather_s_per_row, gather_s_per_step)
    finally:
        torch.set_num_threads(threads_before)
    # one sample per batch shape (its median step), weighted by how often it ran: a loaded machine's slow
    # outliers then move the fit far less than in a fit over every step
    shapes = sorted({(t, s) for t, s, _ in rows})
    med = [(t, s, float(np.median([d for tt, ss, d in rows if (tt, ss) == (t, s)])),
            sum(1 for tt, ss, _ in rows if (tt, ss) == (t, s))) for t, s in shapes]
    w = np.sqrt([n for *_, n in med])
    a = np.array([[1.0, t, s] for t, s, _, _ in med])
    y = np.array([d for _, _, d, _ in med])
    coef = _nonneg_lstsq(a * w[:, None], y * w)
    pred = a @ coef
    return {"step_overhead_s": float(coef[0]), "per_token_s": float(coef[1]), "per_seq_s": float(coef[2]),
            "steps": len(rows), "samples": rows, "placement": placement,
            "r2": float(1 - ((y - pred) ** 2).sum() / max(1e-12, ((y - y.mean()) ** 2).sum()))}


def _engine_steps(cfg: Any, batches: tuple[int, ...], input_len: int, output_len: int, progress: bool,
                  placement: str, rows_per_token: int, gather_s_per_row: float,
                  gather_s_per_step: float) -> list[tuple[float, float, float]]:
    """(tokens, sequences, seconds) of each timed engine step, the host gather taken off where there is one."""
    from tqdm import tqdm

    from tiergram.engine import LLMEngine, SamplingParams

    rng = np.random.default_rng(0)
    rows: list[tuple[float, float, float]] = []  # (tokens, seqs, seconds)
    with LLMEngine(cfg) as engine:
        vocab = engine.model.config.vocab_size
        for n in tqdm(batches, desc="engine steps", disable=not progress):
            for rep in range(3):  # the first pass warms up this batch shape
                for i in range(n):
                    prompt = rng.integers(2, vocab, input_len).tolist()
                    engine.add_request(f"cal-{n}-{rep}-{i}", prompt, SamplingParams(max_tokens=output_len,
                                                                                   ignore_eos=True))
                while engine.has_unfinished():
                    t0 = time.perf_counter()
                    engine.step()
                    dt = time.perf_counter() - t0
                    last = engine.scheduler.last
                    if rep and last:
                        tok = float(sum(t for _, t, _ in last))
                        if placement != "device":
                            dt -= gather_s_per_step + tok * rows_per_token * gather_s_per_row
                        rows.append((tok, float(len(last)), dt))
    return rows


# the step stretch jumps between 1 and 2 users and is not monotone past 4: measure every level a default sweep runs
SERVE_CONCURRENCIES = (1, 2, 4, 8, 16)
SERVE_PASSES = 3  # each level's stretch is its fastest pass: three chances to catch the machine's own speed


def serve_costs(model_dir: str, concurrencies: tuple[int, ...] = SERVE_CONCURRENCIES, input_len: int = 128,
                output_len: int = 32, requests_per_user: int = 4, passes: int = SERVE_PASSES,
                engine_step: Callable[[float, float], float] | None = None) -> dict[str, Any]:
    """What the HTTP path adds to the engine's steps: a fixed cost per request and a cost per sequence per step.

    A real `tiergram serve` (host placement) and the closed-loop streaming client of `bench serve` on held-out
    text (starting 400K tokens into the trace, past the requests a default sweep replays) at each concurrency,
    `passes` times (up the levels, then down, ...); the time the server's engine sat idle (wall less its own step
    seconds, from /metrics) per request cycle is split into t_req + S·c·t_http by least squares over every level
    of every pass. The server's own step counters, not the engine-only step model: the model was fitted a minute
    earlier, and a shared machine's speed moves more than that in a minute (the gaps against the model were
    6 / 378 / 485 ms at c = 1 / 4 / 16 in one such run, against a server that stepped 97-98% of the time).

    `engine_step(tokens, sequences)`: the engine's own step seconds (the fit above); the server's mean step over
    it at each concurrency is `server_step_curve`: the server's steps run beside its HTTP loop on the same cores
    (measured on 2 cores, alternating server and in-process engine on the same requests at c = 2 and 4:
    1.35-1.45x with torch's 2 threads, 1.1-1.15x with one; about 1.0 at c = 1); the curve is each level's
    fastest pass: another tenant's load on a shared machine only ever adds to a pass (one pair's passes read
    2.01 / 1.27 at c = 1). Over five calibrate + sweep pairs the fastest pass validated 86 of 125
    points within ±15% against 65 with the passes' median (docs/planner.md). (Scaling each level by the CPU speed
    probe around it over the probe around the fit was tried: the two passes then agreed less, mean |log ratio|
    0.13 against 0.08 as measured, and pair h validated 22/30 within
    ±15% with it against 23/30 without.)
    """
    import asyncio

    import httpx

    from tiergram.bench import serve as sweep
    from tiergram.model.checkpoint import load_tokenizer_of
    from tiergram.plan.model import Workload, steps_per_request

    cfg = sweep.SweepConfig(model_dir=model_dir, placements=("host",), input_len=input_len, output_len=output_len)
    tokenizer = load_tokenizer_of(model_dir)
    need = 400_000  # start far past what a default sweep replays, so calibration and sweep see different text
    tokens, _ = sweep.trace_tokens(tokenizer, need + passes * sum(c * (requests_per_user + 1) for c in concurrencies)
                                   * (input_len + output_len))
    trace = sweep.Trace(tokens[min(need, len(tokens) // 2):], input_len, output_len, seed=1)
    lo_in, lo_out = max(1, int(0.8 * input_len)), max(1, int(0.8 * output_len))
    wl = Workload(input_len=(lo_in + input_len) / 2, output_len=(lo_out + output_len) / 2)
    gaps: list[tuple[int, float, float]] = []
    ratios: dict[int, list[float]] = {c: [] for c in concurrencies}
    lived: dict[int, list[float]] = {c: [] for c in concurrencies}  # steps x c / requests over the steps needed
    with sweep.ServerProcess(cfg, "host", 0, max_waiting=256) as server:
        model = httpx.get(f"{server.url}/health", timeout=30).json()["model"]
        for k in range(passes):
            for c in (concurrencies if k % 2 == 0 else concurrencies[::-1]):
                asyncio.run(sweep.closed_loop(server.url, model, trace.take(c), c))  # warm-up
                before = sweep.scrape(server.url)
                timings, wall = asyncio.run(sweep.closed_loop(server.url, model, trace.take(requests_per_user * c),
                                                              c))
                after = sweep.scrape(server.url)
                busy, steps, tokens = (after[k_] - before[k_] for k_ in ("tiergram_engine_step_seconds_total",
                                                                         "tiergram_engine_steps_total",
                                                                         "tiergram_engine_computed_tokens_total"))
                # c users each wait out the engine's idle time: per request, idle x c / requests
                gaps.append((c, steps_per_request(wl, c), max(0.0, wall - busy) * c / max(1, len(timings))))
                if timings and steps > 0:
                    lived[c].append(steps * c / len(timings) / steps_per_request(wl, c))
                if engine_step is not None and steps > 0:
                    ratios[c].append(busy / steps / engine_step(tokens / steps, float(c)))
    # g = t_req + S·c·t_http at every concurrency (least squares over them, both terms >= 0)
    a = np.array([[1.0, s * c] for c, s, _ in gaps])
    coef = _nonneg_lstsq(a, np.array([g for _, _, g in gaps]))
    return {"request_overhead_s": float(coef[0]), "per_seq_http_s": float(coef[1]),
            "gaps_s": [round(float(np.median([g for cc, _, g in gaps if cc == c])), 5) for c in concurrencies],
            "server_step_curve": [[c, round(min(ratios[c]), 3)] for c in concurrencies if ratios[c]],
            "server_step_passes": {c: [round(x, 3) for x in ratios[c]] for c in concurrencies if ratios[c]},
            # the passes' median, and never below 1: a request needs its steps (fewer is its sampled lengths' noise)
            "request_steps_curve": [[c, round(max(1.0, float(np.median(lived[c]))), 3)] for c in concurrencies
                                    if lived[c]],
            "request_steps_passes": {c: [round(x, 3) for x in lived[c]] for c in concurrencies if lived[c]}}


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop a negative one and refit; three terms, so brute force)."""
    best, best_err = np.zeros(a.shape[1]), float("inf")
    for mask in range(1, 1 << a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        c, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (c < 0).any():
            continue
        full = np.zeros(a.shape[1])
        full[cols] = c
        err = float(((a @ full - y) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    return best


def gather_costs(table_path: Path, heads: int, tokens: tuple[int, ...] = (8, 32, 128, 512),
                 seconds: float = 0.5) -> dict[str, float]:
    """The host tier's lookup of [1, T, H] row ids: seconds = per_call + rows / rate, fitted over T."""
    from tiergram.store import TieredTable

    table = TieredTable(str(table_path), tier="host")
    rng = np.random.default_rng(1)
    n_rows = min(table.manifest.head_rows)  # ids are per head
    pts = []
    try:
        for t in tokens:
            ids = rng.integers(0, n_rows, (1, t, heads), dtype=np.int64)
            table.lookup(ids)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                table.lookup(rng.integers(0, n_rows, (1, t, heads), dtype=np.int64))
                n += 1
            pts.append((t * heads, (time.perf_counter() - t0) / n))
    finally:
        table.close()
    a = np.array([[1.0, r] for r, _ in pts])
    coef = _nonneg_lstsq(a, np.array([s for _, s in pts]))
    if coef[1] <= 0:  # a noisy machine can leave no per-row slope: then the largest lookup's rate, call cost and all
        rows, secs = pts[-1]
        return {"per_call_s": 0.0, "rows_per_s": rows / secs}
    return {"per_call_s": float(coef[0]), "rows_per_s": 1.0 / coef[1]}


def file_costs(table_path: Path, heads: int, cache_fraction: float = 0.1, seconds: float = 0.5) -> dict[str, float]:
    """The file tier's own costs behind a host cache: rows/s of the all-hit path, CPU seconds per page read.

    Hits: the same ids looked up again and again (all cached). Misses: fresh random ids over the whole table
    (a 10% cache catches about 10% of them); the process's CPU time over the pages read, less the hit path's
    share, is the CPU a page read costs on the real path (checksum, copy, cache admission included).
    """
    import resource

    from tiergram.store import TieredTable

    def cpu() -> float:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    size = table_path.stat().st_size
    table = TieredTable(str(table_path), tier="file", cache_bytes=max(1 << 20, int(cache_fraction * size)))
    rng = np.random.default_rng(2)
    n_rows = min(table.manifest.head_rows)
    pts = []
    try:
        for t in (8, 128):
            ids = rng.integers(0, n_rows, (1, t, heads), dtype=np.int64)
            table.lookup(ids)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                table.lookup(ids)
                n += 1
            pts.append((t * heads, (time.perf_counter() - t0) / n))
        (r1, s1), (r2, s2) = pts
        per_row = max(1e-12, (s2 - s1) / (r2 - r1))
        per_call = max(0.0, s1 - r1 * per_row)
        pages0, c0, n, t0 = table.stats()["pages_read"], cpu(), 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            table.lookup(rng.integers(0, n_rows, (1, 64, heads), dtype=np.int64))
            n += 1
        pages = table.stats()["pages_read"] - pages0
        spent = cpu() - c0 - n * (per_call + 64 * heads * per_row)
    finally:
        table.close()
    return {"hit_rows_per_s": 1.0 / per_row, "per_call_s": per_call,
            "cpu_s_per_page": max(0.0, spent) / max(1, pages), "pages": pages}


def disk_curve(table_path: Path, seconds: float = 1.0) -> dict[str, Any]:
    """Random 4 KiB page reads per second at each queue depth (native O_DIRECT reader, pages no earlier probe chose)
    and CPU seconds per page; and at QD 128 new pages against the same pages read again (a cache under the disk)."""
    from tiergram.bench.file_lookup import LimitReader, reread_rates
    from tiergram.format import TableFile

    curve, cpu = [], []
    for qd in QUEUE_DEPTHS:
        reader = LimitReader(TableFile.open(table_path), qd)
        try:
            reader.segment(0.2)  # warm-up
            f = reader.segment(seconds).figures()
        finally:
            reader.close()
        curve.append([qd, round(f["pages_per_s"])])
        if f.get("cpu_us_per_page") is not None:
            cpu.append(f["cpu_us_per_page"])
    fresh, again = reread_rates(TableFile.open(table_path), pages=max(2048, int(curve[-1][1] * seconds)))
    return {"iops_curve": curve, "cpu_us_per_page": float(np.median(cpu)) if cpu else 3.0,
            "cpu_measured": bool(cpu), "new_pages_per_s": round(fresh), "reread_pages_per_s": round(again)}


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


def host_memory_bytes() -> int:
    """MemTotal from /proc/meminfo (or the physical pages sysconf reports)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(model_dir: str, progress: bool = True, disk_seconds: float = 1.0, gather_seconds: float = 0.5,
              batches: tuple[int, ...] = (1, 2, 4, 8, 16), serve: bool = True) -> Calibration:
    """Run the measurements over model_dir (its exported FP8 tables) and return them as spec fields."""
    from tiergram.bench.serve import layer_tables
    from tiergram.machine import cpu_speed_ms
    from tiergram.model.checkpoint import read_config
    from tiergram.paths import cache_dir
    from tiergram.plan.specs import model_from_dir

    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    how = f"measured by `tiergram plan calibrate` on {when}"
    levels = ", ".join(map(str, SERVE_CONCURRENCIES))  # the HTTP path's closed-loop concurrencies
    cal = Calibration()
    spec = model_from_dir(Path(model_dir))
    tables = layer_tables(model_dir)
    n_layers = len(spec.engram.layers)
    _log(progress, f"calibrating on {model_dir}: {n_layers} Engram layers x {spec.engram.heads} rows per token, "
                   f"{spec.engram.row_bytes}-byte rows, {spec.engram.table_bytes / 2**30:.2f} GiB of tables")
    probe_s = min(1.0, 2 * gather_seconds)
    speed = [cpu_speed_ms(probe_s)]  # how fast the machine ran around the CPU measurements (a moving one: a warning)
    _log(progress, f"[1/5] host tier lookups (CPU speed probe {speed[0]:.2f} ms)")
    g = gather_costs(tables[0], spec.engram.heads, seconds=gather_seconds)
    _log(progress, f"      {g['per_call_s'] * 1e6:.0f} us per lookup call + {g['rows_per_s'] / 1e6:.1f} M rows/s")
    where = step_placement(spec.engram.table_bytes)
    _log(progress, f"[2/5] engine steps ({where} tables"
                   + (", less each step's host gather measured above)" if where != "device" else ")"))
    max_seq = int(read_config(model_dir)["model"].get("max_seq", 256))
    st = step_costs(model_dir, batches, input_len=min(128, max_seq // 2), output_len=min(32, max_seq // 4),
                    progress=progress, placement=where, gather_s_per_row=1.0 / g["rows_per_s"],
                    gather_s_per_step=g["per_call_s"] * n_layers)
    speed.append(cpu_speed_ms(probe_s))
    _log(progress, f"      overhead {st['step_overhead_s'] * 1e3:.2f} ms/step, {st['per_token_s'] * 1e6:.0f} us/token, "
                   f"{st['per_seq_s'] * 1e6:.0f} us/sequence (R^2 {st['r2']:.2f} over {st['steps']} steps; CPU "
                   f"speed probe {speed[1]:.2f} ms)")
    _log(progress, "[3/5] disk: random 4 KiB reads at queue depths " + ", ".join(map(str, QUEUE_DEPTHS))
         + "; the file tier's hit and miss paths")
    d = disk_curve(tables[0], disk_seconds)
    fc = file_costs(tables[0], spec.engram.heads, seconds=gather_seconds)
    _log(progress, f"      file tier: hits at {fc['hit_rows_per_s'] / 1e6:.1f} M rows/s, "
                   f"{fc['cpu_s_per_page'] * 1e6:.1f} us CPU per page read ({fc['pages']:,} pages)")
    _log(progress, "      " + ", ".join(f"QD{q} {p:,} pages/s" for q, p in d["iops_curve"])
         + f"; {d['cpu_us_per_page']:.1f} us CPU per page")
    _log(progress, f"      QD128 new pages {d['new_pages_per_s']:,} pages/s, the same pages read again "
                   f"{d['reread_pages_per_s']:,} ({d['reread_pages_per_s'] / max(1, d['new_pages_per_s']):.1f}x: above "
                   "1 a cache under this disk serves what it served recently; the curve is new pages)")
    speed.append(cpu_speed_ms(probe_s))
    _log(progress, "[4/5] host memory bandwidth and size")
    bw = host_bandwidth()
    mem = host_memory_bytes()
    srv: dict[str, Any] = {"request_overhead_s": 0.0, "per_seq_http_s": 0.0, "server_step_curve": [],
                           "request_steps_curve": []}
    # the step model's CPU compute is FLOPs per token / FLOP/s: this gives the calibrated model its measured cost
    flops = spec.flops_per_token / st["per_token_s"] if st["per_token_s"] > 0 else 1e9
    if serve:
        _log(progress, "[5/5] the HTTP path: `tiergram serve` (host placement) under a closed loop at c = "
             + levels)

        def engine_step(tokens: float, seqs: float) -> float:
            """The engine's own step: the fit, plus the host tier's gather it was fitted without."""
            own = st["step_overhead_s"] + st["per_token_s"] * tokens + st["per_seq_s"] * seqs
            if where != "device":
                own += g["per_call_s"] * n_layers + tokens * spec.engram.rows_per_token / g["rows_per_s"]
            return own

        srv = serve_costs(model_dir, input_len=min(128, max_seq // 2), output_len=min(32, max_seq // 4),
                          engine_step=engine_step)
        _log(progress, f"      {srv['request_overhead_s'] * 1e3:.1f} ms per request, "
                       f"{srv['per_seq_http_s'] * 1e6:.0f} us per sequence per step on top of the engine (the "
                       "engine's idle time per request: " + ", ".join(f"{1e3 * g:.1f}" for g in srv["gaps_s"])
                       + " ms)")
        _log(progress, "      the server's steps over the engine's alone (the fastest of the passes): " + ", ".join(
            f"{r:.2f} at c = {c} ({'/'.join(f'{x:.2f}' for x in srv['server_step_passes'][c])})"
            for c, r in srv["server_step_curve"]))
        _log(progress, "      the steps a request lived through over the steps it needs (the passes' median; "
                       "users between requests leave seats empty): " + ", ".join(
            f"{r:.2f} at c = {c} ({'/'.join(f'{x:.2f}' for x in srv['request_steps_passes'][c])})"
            for c, r in srv["request_steps_curve"]))
        speed.append(cpu_speed_ms(probe_s))
    _log(progress, "CPU speed probe around the measurements: " + ", ".join(f"{x:.2f}" for x in speed) + " ms")
    if max(speed) > SPEED_SPREAD * min(speed):
        print(f"warning: the machine's speed moved by {max(speed) / min(speed):.1f}x during calibration (the "
                   "probe's median is kept); on a quiet machine the figures are more trustworthy", file=sys.stderr)
    cal.values = {
        "name": f"this machine ({os.cpu_count()} CPUs)", "kind": "cpu",
        "device_memory_gb": round(2 * 2**30 / 1e9, 6),
        "device_bw_gbps": round(bw / 1e9, 3), "compute_tflops": round(flops / 1e12, 6),
        # one lookup call per Engram layer per step: its fixed cost is per step
        "step_overhead_us": round((st["step_overhead_s"]) * 1e6, 1),
        "per_seq_us": round((st["per_seq_s"] + srv["per_seq_http_s"]) * 1e6, 1),
        "per_token_us": round(st["per_token_s"] * 1e6, 2),
        "request_overhead_ms": round(srv["request_overhead_s"] * 1e3, 3),
        "host_memory_gb": round(mem / 1e9, 3), "host_bw_gbps": round(bw / 1e9, 3),
        "gather_mrows_s": round(g["rows_per_s"] / 1e6, 3), "gather_call_us": round(g["per_call_s"] * 1e6 * n_layers, 1),
        "file_gather_mrows_s": round(fc["hit_rows_per_s"] / 1e6, 3),
        "file_call_us": round(fc["per_call_s"] * 1e6 * n_layers, 1),
        "link_gbps": 0.0, "cores": os.cpu_count() or 1, "cpu_speed_ms": round(float(np.median(speed)), 3),
        **({"server_step_curve": srv["server_step_curve"]} if srv["server_step_curve"] else {}),
        **({"request_steps_curve": srv["request_steps_curve"]} if srv["request_steps_curve"] else {}),
    }
    cal.disk = {"drives": 1, "page_bytes": 4096, "cpu_us_per_page": round(fc["cpu_s_per_page"] * 1e6, 2), "threads": 1,
                "iops_curve": d["iops_curve"], "cache_pages_per_s": d["reread_pages_per_s"]}
    src = {
        "device_memory_gb": "the engine's default device budget on a CPU (2 GiB); `plan validate` uses the sweep's "
                            "--device-memory when it had one",
        "device_bw_gbps": f"{how}: a {256} MiB numpy copy (no separate device memory on a CPU)",
        "compute_tflops": f"{how}: the model's FLOPs per token / the fitted seconds per token",
        "step_overhead_us": f"{how}: least-squares fit over {st['steps']} engine steps of {Path(model_dir).name} "
                            f"({where} tables; R^2 {st['r2']:.2f})",
        "per_seq_us": f"{how}: the same fit" + (", plus the HTTP path's cost per sequence per step (`tiergram serve` "
                                                 f"under a closed loop at c = {levels}: the server's idle time, "
                                                 "wall less its own step seconds)" if serve else ""),
        "per_token_us": f"{how}: the same fit",
        "request_overhead_ms": f"{how}: the HTTP path's fixed cost per request (same closed loop)" if serve else
                               "not measured (calibrate --no-serve)",
        "host_memory_gb": f"{how}: MemTotal", "host_bw_gbps": f"{how}: a 256 MiB numpy copy, read + write",
        "gather_mrows_s": f"{how}: TieredTable host lookups of [1, T, {spec.engram.heads}] ids, T = 8..512",
        "gather_call_us": f"{how}: the same fit, per call, x {n_layers} Engram layers",
        "link_gbps": "a CPU-only machine has no host-to-device link",
        "cores": "os.cpu_count()",
        "server_step_curve": f"{how}: a `tiergram serve`'s mean step (its own counters) over the engine's alone "
                             f"(the fit above) at c = {levels}, the fastest of {SERVE_PASSES} passes up and down the "
                             "levels (interpolated in log c)"
                             if serve else "not measured (calibrate --no-serve)",
        "request_steps_curve": f"{how}: the same closed loop's steps x c / requests (from the server's counters) over "
                               "the steps a request needs, the passes' median at each level, at least 1: the steps "
                               "that run while a user is between requests (interpolated in log c)"
                               if serve else "not measured (calibrate --no-serve)",
        "cpu_speed_ms": f"{how}: the median of `machine.cpu_speed_ms` before the host lookups and after the "
                        "engine steps, the file tier and the HTTP path (" + ", ".join(f"{x:.2f}" for x in speed)
                        + " ms); `plan validate` scales the CPU costs by a sweep's own probes over this figure",
        "file_gather_mrows_s": f"{how}: TieredTable file lookups of cached rows ([1, T, {spec.engram.heads}] ids, "
                               "T = 8 and 128, 10% cache)",
        "file_call_us": f"{how}: the same, per call, x {n_layers} Engram layers",
        "disk.drives": "this machine's table volume", "disk.page_bytes": "the table file's page size",
        "disk.cpu_us_per_page": f"{how}: the file tier's CPU time over the pages it read on lookups of random rows "
                                f"behind a 10% cache (the bare reader: {d['cpu_us_per_page']:.1f} us)",
        "disk.threads": "the file tier's single reader thread",
        "disk.iops_curve": f"{how}: the native O_DIRECT io_uring reader, {disk_seconds:g} s per queue depth, "
                           "pages no earlier probe read",
        "disk.cache_pages_per_s": f"{how}: the same pages read again at QD 128 (a cache under the disk serves them "
                                  "at its rate; about the curve's QD-128 figure where there is none)",
    }
    cal.sources = src
    st.pop("samples", None)
    cal.detail = {"model_dir": str(model_dir), "step": st, "gather": g, "disk": d, "serve": srv, "file": fc,
                  "cache": str(cache_dir("plan"))}
    return cal


def to_toml(cal: Calibration) -> str:
    """The calibration as a hardware spec file."""
    def val(v: Any) -> str:
        if isinstance(v, np.floating | np.integer):
            v = v.item()
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    lines = ["# This machine, measured by `tiergram plan calibrate` (rerun it to refresh; figures drift with load).",
             "", "[hardware]"]
    lines += [f"{k} = {val(v)}" for k, v in cal.values.items()]
    lines += ["", "[hardware.disk]"] + [f"{k} = {val(v)}" for k, v in cal.disk.items()]
    lines += ["", "[sources]"] + [f'"{k}" = {val(v)}' for k, v in cal.sources.items()]
    return "\n".join(lines) + "\n"
