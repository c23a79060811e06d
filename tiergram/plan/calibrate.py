"""`tiergram plan calibrate`: measure this machine's ingredients briefly and write them as a hardware spec.

What runs (each a few seconds): the engine's steps over a model with device-resident tables at several batch
sizes (step = overhead + per token + per sequence, least squares), the host tier's gather + dequant of step-sized
lookups (per call and per row), the disk's random 4 KiB page rate at queue depths 1-128 with the native O_DIRECT
reader and its CPU per page, host memory bandwidth (a large copy) and host memory size.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

QUEUE_DEPTHS = (1, 8, 32, 128)


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


def step_costs(model_dir: str, batches: tuple[int, ...] = (1, 2, 4, 8, 16), input_len: int = 128,
               output_len: int = 32, progress: bool = True) -> dict[str, float]:
    """Fit step seconds = overhead + per_token x tokens + per_seq x sequences over the engine's real steps."""
    from tqdm import tqdm

    from tiergram.engine import EngineConfig, LLMEngine, SamplingParams

    rng = np.random.default_rng(0)
    rows: list[tuple[float, float, float]] = []  # (tokens, seqs, seconds)
    cfg = EngineConfig(model_dir, "device", device_memory_bytes=8 << 30, max_num_seqs=max(batches))
    with LLMEngine(cfg) as engine:
        vocab = engine.model.config.vocab_size
        for n in tqdm(batches, desc="engine steps", disable=not progress):
            for rep in range(2):  # the first pass warms up this batch shape
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
                        rows.append((float(sum(t for _, t, _ in last)), float(len(last)), dt))
    a = np.array([[1.0, t, s] for t, s, _ in rows])
    y = np.array([d for _, _, d in rows])
    coef = _nonneg_lstsq(a, y)
    pred = a @ coef
    return {"step_overhead_s": float(coef[0]), "per_token_s": float(coef[1]), "per_seq_s": float(coef[2]),
            "steps": len(rows), "r2": float(1 - ((y - pred) ** 2).sum() / max(1e-12, ((y - y.mean()) ** 2).sum()))}


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
    return {"per_call_s": float(coef[0]), "rows_per_s": 1.0 / coef[1] if coef[1] > 0 else float("inf")}


def disk_curve(table_path: Path, seconds: float = 1.0) -> dict[str, Any]:
    """Random 4 KiB page reads per second at each queue depth (native O_DIRECT reader) and CPU seconds per page."""
    from tiergram.bench.file_lookup import LimitReader
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
    return {"iops_curve": curve, "cpu_us_per_page": float(np.median(cpu)) if cpu else 3.0,
            "cpu_measured": bool(cpu)}


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
              batches: tuple[int, ...] = (1, 2, 4, 8, 16)) -> Calibration:
    """Run the measurements over model_dir (its exported FP8 tables) and return them as spec fields."""
    from tiergram.bench.common import cache_dir
    from tiergram.bench.serve import layer_tables
    from tiergram.model.checkpoint import read_config
    from tiergram.plan.specs import model_from_dir

    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    how = f"measured by `tiergram plan calibrate` on {when}"
    cal = Calibration()
    spec = model_from_dir(Path(model_dir))
    tables = layer_tables(model_dir)
    _log(progress, "[1/4] engine steps (device-resident tables)")
    max_seq = int(read_config(model_dir)["model"].get("max_seq", 256))
    st = step_costs(model_dir, batches, input_len=min(128, max_seq // 2), output_len=min(32, max_seq // 4),
                    progress=progress)
    _log(progress, f"      overhead {st['step_overhead_s'] * 1e3:.2f} ms/step, {st['per_token_s'] * 1e6:.0f} us/token, "
                   f"{st['per_seq_s'] * 1e6:.0f} us/sequence (R^2 {st['r2']:.2f} over {st['steps']} steps)")
    _log(progress, "[2/4] host tier lookups")
    g = gather_costs(tables[0], spec.engram.heads, seconds=gather_seconds)
    _log(progress, f"      {g['per_call_s'] * 1e6:.0f} us per lookup call + {g['rows_per_s'] / 1e6:.1f} M rows/s")
    _log(progress, "[3/4] disk: random 4 KiB reads at queue depths " + ", ".join(map(str, QUEUE_DEPTHS)))
    d = disk_curve(tables[0], disk_seconds)
    _log(progress, "      " + ", ".join(f"QD{q} {p:,} pages/s" for q, p in d["iops_curve"])
         + f"; {d['cpu_us_per_page']:.1f} us CPU per page")
    _log(progress, "[4/4] host memory bandwidth and size")
    bw = host_bandwidth()
    mem = host_memory_bytes()
    flops = spec.flops_per_token / st["per_token_s"] if st["per_token_s"] > 0 else 1e9
    n_layers = len(spec.engram.layers)
    cal.values = {
        "name": f"this machine ({os.cpu_count()} CPUs)", "kind": "cpu",
        "device_memory_gb": round(2 * 2**30 / 1e9, 6),
        "device_bw_gbps": round(bw / 1e9, 3), "compute_tflops": round(flops / 1e12, 6),
        # one lookup call per Engram layer per step: its fixed cost is per step
        "step_overhead_us": round((st["step_overhead_s"]) * 1e6, 1),
        "per_seq_us": round(st["per_seq_s"] * 1e6, 1), "per_token_us": round(st["per_token_s"] * 1e6, 2),
        "host_memory_gb": round(mem / 1e9, 3), "host_bw_gbps": round(bw / 1e9, 3),
        "gather_mrows_s": round(g["rows_per_s"] / 1e6, 3), "gather_call_us": round(g["per_call_s"] * 1e6 * n_layers, 1),
        "link_gbps": 0.0,
    }
    cal.disk = {"drives": 1, "page_bytes": 4096, "cpu_us_per_page": round(d["cpu_us_per_page"], 2), "threads": 1,
                "iops_curve": d["iops_curve"]}
    src = {
        "device_memory_gb": "the engine's default device budget on a CPU (2 GiB); `plan validate` uses the sweep's "
                            "--device-memory when it had one",
        "device_bw_gbps": f"{how}: a {256} MiB numpy copy (no separate device memory on a CPU)",
        "compute_tflops": f"{how}: the model's FLOPs per token / the fitted seconds per token",
        "step_overhead_us": f"{how}: least-squares fit over {st['steps']} engine steps (R^2 {st['r2']:.2f})",
        "per_seq_us": f"{how}: the same fit", "per_token_us": f"{how}: the same fit",
        "host_memory_gb": f"{how}: MemTotal", "host_bw_gbps": f"{how}: a 256 MiB numpy copy, read + write",
        "gather_mrows_s": f"{how}: TieredTable host lookups of [1, T, {spec.engram.heads}] ids, T = 8..512",
        "gather_call_us": f"{how}: the same fit, per call, x {n_layers} Engram layers",
        "link_gbps": "a CPU-only machine has no host-to-device link",
        "disk.drives": "this machine's table volume", "disk.page_bytes": "the table file's page size",
        "disk.cpu_us_per_page": f"{how}: the native reader's CPU time over pages read" if d["cpu_measured"] else
                                "assumed: 3 us (the reader did not report its CPU time)",
        "disk.threads": "the file tier's single reader thread",
        "disk.iops_curve": f"{how}: the native O_DIRECT io_uring reader, {disk_seconds:g} s per queue depth",
    }
    cal.sources = src
    cal.detail = {"model_dir": str(model_dir), "step": st, "gather": g, "disk": d, "cache": str(cache_dir("plan"))}
    return cal


def to_toml(cal: Calibration) -> str:
    """The calibration as a hardware spec file."""
    def val(v: Any) -> str:
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
