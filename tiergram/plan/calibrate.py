"""The fitting half of `tiergram plan calibrate`: a hardware spec from the measurements `tiergram.bench.calibrate`
kept as JSON, by least squares, each figure with how it was measured (docs/planner.md, "Calibration")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.plan.model import steps_per_request
from tiergram.plan.predict import sweep_workload

MEASUREMENT_SCHEMA = 1  # the layout of the measurement dict; bench.calibrate writes it, fit reads it


@dataclass
class Calibration:
    """The fitted figures, in the units the spec file uses, how each was measured, and the fits behind them."""

    values: dict[str, Any]
    disk: dict[str, Any]
    sources: dict[str, str]
    fits: dict[str, Any]


def read_measurements(path: Path) -> dict[str, Any]:
    """The measurement JSON `plan calibrate` wrote beside its spec, its schema checked."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the calibration measurements ({e})") from None
    got = raw.get("schema") if isinstance(raw, dict) else None
    if got != MEASUREMENT_SCHEMA:
        raise ValueError(f"{path}: calibration measurements of schema {got!r}; this tiergram reads schema "
                         f"{MEASUREMENT_SCHEMA} (measure again with `tiergram plan calibrate`)")
    return raw


def nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
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


def fit_lookups(points: list[list[float]]) -> dict[str, float]:
    """The host tier's lookups, [rows, seconds] per call: seconds = per_call + rows / rate."""
    a = np.array([[1.0, r] for r, _ in points])
    coef = nonneg_lstsq(a, np.array([s for _, s in points]))
    if coef[1] <= 0:  # a noisy machine can leave no per-row slope: then the largest lookup's rate, call cost and all
        rows, secs = points[-1]
        return {"per_call_s": 0.0, "rows_per_s": rows / secs}
    return {"per_call_s": float(coef[0]), "rows_per_s": 1.0 / coef[1]}


def fit_steps(steps: dict[str, Any], gather: dict[str, float], rows_per_token: int, n_layers: int) -> dict[str, Any]:
    """step seconds = overhead + per_token x tokens + per_seq x sequences, over each batch shape's median step
    (weighted by how often it ran; host-table steps less their gather, which the step model adds back)."""
    rows = [(t, s, d) for t, s, d in steps["samples"]]
    if not rows:
        raise ValueError("calibration measurements: no engine steps to fit")
    if steps["placement"] != "device":
        rows = [(t, s, d - gather["per_call_s"] * n_layers - t * rows_per_token / gather["rows_per_s"])
                for t, s, d in rows]
    shapes = sorted({(t, s) for t, s, _ in rows})
    med = [(t, s, float(np.median([d for tt, ss, d in rows if (tt, ss) == (t, s)])),
            sum(1 for tt, ss, _ in rows if (tt, ss) == (t, s))) for t, s in shapes]
    w = np.sqrt([n for *_, n in med])
    a = np.array([[1.0, t, s] for t, s, _, _ in med])
    y = np.array([d for _, _, d, _ in med])
    coef = nonneg_lstsq(a * w[:, None], y * w)
    pred = a @ coef
    return {"step_overhead_s": float(coef[0]), "per_token_s": float(coef[1]), "per_seq_s": float(coef[2]),
            "steps": len(rows), "placement": steps["placement"],
            "r2": float(1 - ((y - pred) ** 2).sum() / max(1e-12, ((y - y.mean()) ** 2).sum()))}


def fit_file(file: dict[str, Any]) -> dict[str, float]:
    """The file tier's all-hit path (rows/s, seconds per call) and the CPU seconds per page its misses cost."""
    (r1, s1), (r2, s2) = file["hits"]
    per_row = max(1e-12, (s2 - s1) / (r2 - r1))
    per_call = max(0.0, s1 - r1 * per_row)
    m = file["misses"]
    spent = m["cpu_s"] - m["calls"] * (per_call + m["rows_per_call"] * per_row)
    return {"hit_rows_per_s": 1.0 / per_row, "per_call_s": per_call,
            "cpu_s_per_page": max(0.0, spent) / max(1, m["pages"]), "pages": m["pages"]}


def fit_serve(serve: dict[str, Any], engine_step: Callable[[float, float], float] | None = None) -> dict[str, Any]:
    """The HTTP path's cost per request and per sequence per step (from the server's idle time), σ(c), φ(c) and
    the server's own tok/s at each concurrency (docs/planner.md, "Calibration")."""
    conc, wl = serve["concurrencies"], sweep_workload(serve)  # the closed loop's lengths, as in a sweep
    gaps: list[tuple[int, float, float]] = []
    ratios: dict[int, list[float]] = {c: [] for c in conc}
    lived: dict[int, list[float]] = {c: [] for c in conc}
    tput: dict[int, list[float]] = {c: [] for c in conc}
    for r in serve["runs"]:
        if r["wall_s"] > 0:
            tput[r["c"]].append(r["tokens"] / r["wall_s"])
        c, need = r["c"], steps_per_request(wl, r["c"])
        gaps.append((c, need, max(0.0, r["wall_s"] - r["busy_s"]) * c / max(1, r["requests"])))
        if r["steps"] > 0 and r["requests"]:
            lived[c].append(r["steps"] * c / r["requests"] / need)
        if r["steps"] > 0 and engine_step is not None:
            ratios[c].append(r["busy_s"] / r["steps"] / engine_step(r["tokens"] / r["steps"], float(c)))
    coef = nonneg_lstsq(np.array([[1.0, s * c] for c, s, _ in gaps]), np.array([g for _, _, g in gaps]))
    return {"request_overhead_s": float(coef[0]), "per_seq_http_s": float(coef[1]),
            "gaps_s": [round(float(np.median([g for cc, _, g in gaps if cc == c])), 5) for c in conc],
            "server_step_curve": [[c, round(min(ratios[c]), 3)] for c in conc if ratios[c]],
            "server_step_passes": {c: [round(x, 3) for x in ratios[c]] for c in conc if ratios[c]},
            # never below 1: a request needs its steps (fewer is its sampled lengths' noise)
            "request_steps_curve": [[c, round(max(1.0, float(np.median(lived[c]))), 3)] for c in conc if lived[c]],
            "request_steps_passes": {c: [round(x, 3) for x in lived[c]] for c in conc if lived[c]},
            # what the server itself served at each concurrency: `plan validate --naive`'s baseline
            "serve_tok_s_curve": [[c, round(float(np.median(tput[c])), 1)] for c in conc if tput[c]]}


def fit(raw: dict[str, Any]) -> Calibration:
    """The hardware spec's figures from the measurement dict (`bench.calibrate.measure`, or `read_measurements`)."""
    m = raw["model"]
    n_layers = m["engram_layers"]
    g = fit_lookups(raw["lookups"])
    st = fit_steps(raw["steps"], g, m["rows_per_token"], n_layers)
    fc = fit_file(raw["file"])
    d = raw["disk"]
    serve = raw.get("serve")
    srv: dict[str, Any] = {"request_overhead_s": 0.0, "per_seq_http_s": 0.0}
    if serve:
        def engine_step(tokens: float, seqs: float) -> float:
            """The engine's own step: the fit, plus the host tier's gather it was fitted without."""
            own = st["step_overhead_s"] + st["per_token_s"] * tokens + st["per_seq_s"] * seqs
            if st["placement"] != "device":
                own += g["per_call_s"] * n_layers + tokens * m["rows_per_token"] / g["rows_per_s"]
            return own

        srv = fit_serve(serve, engine_step)
    bw, speed = raw["host_bandwidth_bytes_s"], raw["cpu_speed_ms"]
    # the step model's CPU compute is FLOPs per token / FLOP/s: this gives the calibrated model its measured cost
    flops = m["flops_per_token"] / st["per_token_s"] if st["per_token_s"] > 0 else 1e9
    values = {
        "name": f"this machine ({raw['cpus']} CPUs)", "kind": "cpu",
        "device_memory_gb": round(2 * 2**30 / 1e9, 6),
        "device_bw_gbps": round(bw / 1e9, 3), "compute_tflops": round(flops / 1e12, 6),
        # one lookup call per Engram layer per step: its fixed cost is per step
        "step_overhead_us": round(st["step_overhead_s"] * 1e6, 1),
        "per_seq_us": round((st["per_seq_s"] + srv["per_seq_http_s"]) * 1e6, 1),
        "per_token_us": round(st["per_token_s"] * 1e6, 2),
        "request_overhead_ms": round(srv["request_overhead_s"] * 1e3, 3),
        "host_memory_gb": round(raw["host_memory_bytes"] / 1e9, 3), "host_bw_gbps": round(bw / 1e9, 3),
        "gather_mrows_s": round(g["rows_per_s"] / 1e6, 3), "gather_call_us": round(g["per_call_s"] * 1e6 * n_layers, 1),
        "file_gather_mrows_s": round(fc["hit_rows_per_s"] / 1e6, 3),
        "file_call_us": round(fc["per_call_s"] * 1e6 * n_layers, 1),
        "link_gbps": 0.0, "cores": raw["cpus"], "cpu_speed_ms": round(float(np.median(speed)), 3),
        **{k: srv[k] for k in ("server_step_curve", "request_steps_curve", "serve_tok_s_curve") if srv.get(k)},
    }
    disk = {"drives": 1, "page_bytes": 4096, "cpu_us_per_page": round(fc["cpu_s_per_page"] * 1e6, 2), "threads": 1,
            "iops_curve": d["iops_curve"], "cache_pages_per_s": d["reread_pages_per_s"]}
    return Calibration(values, disk, sources(raw, st),
                       {"lookups": g, "steps": st, "file": fc, "disk": d, "serve": srv, "cpu_speed_ms": speed})


def sources(raw: dict[str, Any], st: dict[str, Any]) -> dict[str, str]:
    """How each figure of the spec was measured (its [sources] table)."""
    how = f"measured by `tiergram plan calibrate` on {raw['when']}"
    heads, n_layers, d, serve = raw["model"]["heads"], raw["model"]["engram_layers"], raw["disk"], raw.get("serve")
    closed = f"c = {', '.join(map(str, serve['concurrencies']))}" if serve else ""
    unserved = "not measured (calibrate --no-serve)"
    bare = f" (the bare reader: {d['cpu_us_per_page']:.1f} us)" if d.get("cpu_us_per_page") is not None else ""
    return {
        "device_memory_gb": "the engine's default device budget on a CPU (2 GiB)",
        "device_bw_gbps": f"{how}: a 256 MiB numpy copy (no separate device memory on a CPU)",
        "compute_tflops": f"{how}: the model's FLOPs per token / the fitted seconds per token",
        "step_overhead_us": f"{how}: least-squares fit over {st['steps']} engine steps of "
                            f"{Path(raw['model_dir']).name} ({st['placement']} tables; R^2 {st['r2']:.2f})",
        "per_seq_us": f"{how}: the same fit" + (f", plus the HTTP path's cost per sequence per step (a `tiergram "
                                                 f"serve` closed loop at {closed})" if serve else ""),
        "per_token_us": f"{how}: the same fit",
        "request_overhead_ms": f"{how}: the HTTP path's fixed cost per request (same closed loop)"
                               if serve else unserved,
        "host_memory_gb": f"{how}: MemTotal", "host_bw_gbps": f"{how}: a 256 MiB numpy copy, read + write",
        "gather_mrows_s": f"{how}: TieredTable host lookups of [1, T, {heads}] ids, T = 8..512",
        "gather_call_us": f"{how}: the same fit, per call, x {n_layers} Engram layers",
        "link_gbps": "a CPU-only machine has no host-to-device link",
        "cores": "os.cpu_count()",
        "server_step_curve": f"{how}: the server's mean step over the engine's alone at {closed}, the fastest of "
                             f"{serve['passes']} passes" if serve else unserved,
        "request_steps_curve": f"{how}: the same loop's steps x c / requests over the steps a request needs (median "
                               "pass, at least 1)" if serve else unserved,
        "serve_tok_s_curve": f"{how}: the same loop's tokens per wall second (median pass): the naive baseline"
                             if serve else unserved,
        "cpu_speed_ms": f"{how}: the median of `machine.cpu_speed_ms` probes ("
                        + ", ".join(f"{x:.2f}" for x in raw["cpu_speed_ms"]) + " ms)",
        "file_gather_mrows_s": f"{how}: TieredTable file lookups of cached rows ([1, T, {heads}] ids, T = 8 and 128, "
                               f"{raw['file']['cache_fraction']:.0%} cache)",
        "file_call_us": f"{how}: the same, per call, x {n_layers} Engram layers",
        "disk.drives": "this machine's table volume", "disk.page_bytes": "the table file's page size",
        "disk.cpu_us_per_page": f"{how}: the file tier's CPU time over the pages it read on lookups of random rows "
                                f"behind a {raw['file']['cache_fraction']:.0%} cache{bare}",
        "disk.threads": "the file tier's single reader thread",
        "disk.iops_curve": f"{how}: O_DIRECT io_uring reads, {d['seconds']:g} s per queue depth, pages not read before",
        "disk.cache_pages_per_s": f"{how}: the same pages read again at QD 128 (a cache under the disk, if any)",
    }


def summary(cal: Calibration) -> str:
    """The fitted figures, one line each (check R^2, the disk curve and the speed probes before trusting them)."""
    g, st, fc, d, srv = (cal.fits[k] for k in ("lookups", "steps", "file", "disk", "serve"))

    def passes(curve: list[list[float]], runs: dict[int, list[float]]) -> str:
        return ", ".join(f"{r:.2f} at c = {c} ({'/'.join(f'{x:.2f}' for x in runs[c])})" for c, r in curve)

    lines = [f"host tier: {g['per_call_s'] * 1e6:.0f} us per lookup call + {g['rows_per_s'] / 1e6:.1f} M rows/s",
             f"engine steps ({st['placement']} tables): {st['step_overhead_s'] * 1e3:.2f} ms/step, "
             f"{st['per_token_s'] * 1e6:.0f} us/token, {st['per_seq_s'] * 1e6:.0f} us/sequence (R^2 {st['r2']:.2f} "
             f"over {st['steps']} steps)",
             f"file tier: hits at {fc['hit_rows_per_s'] / 1e6:.1f} M rows/s, {fc['cpu_s_per_page'] * 1e6:.1f} us CPU "
             f"per page read ({fc['pages']:,} pages)",
             "disk: " + ", ".join(f"QD{q} {p:,}" for q, p in d["iops_curve"]) + f" pages/s; the same pages read "
             f"again at QD128 {d['reread_pages_per_s'] / max(1, d['new_pages_per_s']):.1f}x as fast (above 1: a "
             "cache under the disk)"]
    if srv.get("gaps_s"):
        lines += [f"HTTP path: {srv['request_overhead_s'] * 1e3:.1f} ms per request + {srv['per_seq_http_s'] * 1e6:.0f}"
                  " us per sequence per step (the engine idle per request: "
                  + ", ".join(f"{1e3 * x:.1f}" for x in srv["gaps_s"]) + " ms)",
                  "server step / engine step (fastest pass): " + passes(srv["server_step_curve"],
                                                                         srv["server_step_passes"]),
                  "steps a request lived through / needed (median pass): " + passes(srv["request_steps_curve"],
                                                                                    srv["request_steps_passes"])]
    return "\n".join([*lines, "CPU speed probes: " + ", ".join(f"{x:.2f}" for x in cal.fits["cpu_speed_ms"]) + " ms"])


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
