"""`tiergram bench serve`'s statistics: points from rounds' timings and /metrics, pareto fronts, checks as ratios."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiergram.bench.common import FILE_TARGET, HOST_TARGET, percentile
from tiergram.bench.load import Timing
from tiergram.bench.serve_config import SweepConfig
from tiergram.bench.serve_process import layer_table_bytes


@dataclass
class Point:
    """One placement at one concurrency."""

    placement: str
    concurrency: int
    requests: int
    duration_s: float
    throughput_tok_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    e2e_p99_ms: float
    interactivity_p50: float
    interactivity_p90: float
    engram_cache_hit_rate: float | None
    exposed_stall_s: float
    throughput_rounds: list[float] = field(default_factory=list)  # tok/s of each round; the point keeps the median
    file_pages_per_s: float = 0.0
    cpu_ms_per_token: float = 0.0  # all the server's processes and threads
    server_peak_rss_bytes: int = 0  # VmHWM of its processes after this point
    prefill_stall_s: float = 0.0
    cpu_ms_per_token_by_thread: dict[str, float] = field(default_factory=dict)
    file_first_read_share: float | None = None  # of the pages read, those the server never read before
    cpu_speed_rounds: list[float] = field(default_factory=list)
    cpu_speed_ms: float | None = None
    prompt_rows_waits: int = 0
    prompt_rows_wait_s: float = 0.0
    prompt_rows_timeouts: int = 0
    server_step_ms: float | None = None  # the engine's mean step, from its counters (None: no counters)
    steps_per_request: float | None = None  # steps x c / requests: c requests share each step
    prefix_hit_rate: float | None = None  # hit tokens / tokens that could hit (host: from the host K/V tier)
    prefix_host_hit_rate: float | None = None


@dataclass
class SweepResult:
    """Every point, the fronts, the per-placement server facts and the acceptance checks."""

    config: SweepConfig
    source: str
    points: list[Point]
    fronts: dict[str, list[int]]  # placement -> concurrencies on its pareto front
    servers: dict[str, dict[str, Any]]
    checks: dict[str, Any]
    seconds: float
    disk_pages_per_s: dict[str, float] = field(default_factory=dict)  # the disk's limit before/after the sweep
    big_disk_pages_per_s: dict[str, float] = field(default_factory=dict)  # the same on the big model's tables
    plot: str | None = None


@dataclass
class Round:
    """One placement's share of one round: its requests' timings, the wall time, /metrics around it."""

    timings: list[Timing]
    wall_s: float
    before: dict[str, float]
    after: dict[str, float]
    speed_ms: float | None = None  # the CPU speed probe around the round: the mean of the one before and after

    @property
    def tokens(self) -> int:
        return sum(t.output_tokens + t.prompt_tokens for t in self.timings)


def summarize(placement: str, concurrency: int, rounds: list[Round]) -> Point:
    """A point from its rounds: throughput is the median round's; latencies pool every request; counters sum."""
    timings = [t for r in rounds for t in r.timings]
    wall_s = sum(r.wall_s for r in rounds)
    ms = {"ttft": [t.ttft_s * 1e3 for t in timings], "itl": [g * 1e3 for t in timings for g in t.gaps_s],
          "e2e": [t.e2e_s * 1e3 for t in timings]}
    pct = {f"{k}_p{q}_ms": percentile(v, q) for k, v in ms.items() for q in (50, 90, 99)}
    per_round = [r.tokens / r.wall_s for r in rounds]
    out_share = sum(t.output_tokens for t in timings) / max(1, sum(r.tokens for r in rounds))

    def total(key: str) -> float:
        return sum(r.after.get(key, 0.0) - r.before.get(key, 0.0) for r in rounds)

    lookups = total("tiergram_engram_cache_probes_total")
    hit = total("tiergram_engram_cache_hits_total") / lookups if lookups > 0 else None  # None: no cache
    tokens = max(1, sum(r.tokens for r in rounds))
    file_bytes = total('tiergram_engram_bytes_read_total{tier="file"}')
    names = {k for r in rounds for k in r.after if k.startswith("thread_cpu_seconds{")}
    by_thread = {k.split('name="')[1][:-2]: round(1e3 * total(k) / tokens, 4) for k in sorted(names)}
    throughput = float(np.median(per_round))
    pages = total("tiergram_engram_pages_read_total")
    first = total("tiergram_engram_pages_first_read_total") / pages if pages > 0 else None
    speeds = [r.speed_ms for r in rounds if r.speed_ms is not None]
    steps, step_s = total("tiergram_engine_steps_total"), total("tiergram_engine_step_seconds_total")
    queried = total("tiergram_prefix_cache_queried_tokens_total")
    host_hits = total("tiergram_prefix_cache_host_hit_tokens_total")
    hits = total("tiergram_prefix_cache_device_hit_tokens_total") + host_hits
    return Point(placement=placement, concurrency=concurrency, requests=len(timings), duration_s=wall_s,
                 throughput_tok_s=throughput, output_tok_s=throughput * out_share,
                 **pct, interactivity_p50=1000 / pct["itl_p50_ms"] if pct["itl_p50_ms"] > 0 else float("nan"),
                 interactivity_p90=1000 / pct["itl_p90_ms"] if pct["itl_p90_ms"] > 0 else float("nan"),
                 engram_cache_hit_rate=hit, exposed_stall_s=total("tiergram_engram_exposed_stall_seconds_total"),
                 throughput_rounds=[round(x, 1) for x in per_round], file_first_read_share=first,
                 prefill_stall_s=total("tiergram_engram_prefill_stall_seconds_total"),
                 file_pages_per_s=file_bytes / 4096 / wall_s if wall_s > 0 else 0.0,
                 cpu_ms_per_token=1e3 * (total("process_cpu_seconds_total") +  # the engine's process, when its own
                                         total("tiergram_engine_process_cpu_seconds_total")) / tokens,
                 cpu_ms_per_token_by_thread={k: v for k, v in by_thread.items() if v > 0},
                 cpu_speed_rounds=[round(x, 3) for x in speeds],
                 cpu_speed_ms=round(float(np.median(speeds)), 3) if speeds else None,
                 prompt_rows_waits=int(total("tiergram_engine_prompt_rows_waits_total")),
                 prompt_rows_wait_s=total("tiergram_engine_prompt_rows_wait_seconds_total"),
                 prompt_rows_timeouts=int(total("tiergram_engine_prompt_rows_timeouts_total")),
                 server_step_ms=round(1e3 * step_s / steps, 3) if steps > 0 else None,
                 steps_per_request=round(steps * concurrency / len(timings), 2) if steps > 0 and timings else None,
                 prefix_hit_rate=round(hits / queried, 4) if queried > 0 else None,
                 prefix_host_hit_rate=round(host_hits / queried, 4) if queried > 0 else None)


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats on both throughput and interactivity (sorted by concurrency)."""
    def beaten(p: Point) -> bool:
        return any(q.throughput_tok_s >= p.throughput_tok_s and q.interactivity_p90 >= p.interactivity_p90
                   and (q.throughput_tok_s > p.throughput_tok_s or q.interactivity_p90 > p.interactivity_p90)
                   for q in points)
    return sorted((p for p in points if not beaten(p)), key=lambda p: p.concurrency)


# ------------------------------------------------------------------------------------------------- checks

def _by_c(res: SweepResult, placement: str) -> dict[int, Point]:
    return {p.concurrency: p for p in res.points if p.placement == placement}


def _ratios(res: SweepResult, num: str, den: str, field: str = "throughput_tok_s") -> dict[int, float]:
    """A point field of num over den's per common concurrency (throughput: median of paired rounds)."""
    a, b = _by_c(res, num), _by_c(res, den)
    out = {}
    for c in sorted(set(a) & set(b)):
        if field == "throughput_tok_s" and (paired := round_ratios(a[c], b[c])):
            out[c] = float(np.median(paired))
        elif getattr(b[c], field):
            out[c] = getattr(a[c], field) / getattr(b[c], field)
    return out


def round_ratios(num: Point, den: Point) -> list[float]:
    """num's throughput over den's, round by round (empty unless both have the same rounds, all non-zero)."""
    if not num.throughput_rounds or len(num.throughput_rounds) != len(den.throughput_rounds) \
            or not all(den.throughput_rounds):
        return []
    return [x / y for x, y in zip(num.throughput_rounds, den.throughput_rounds, strict=True)]


def against(res: SweepResult, num: str, den: str, target: float) -> dict[str, Any]:
    """num's throughput over den's against `target`: ratios, rounds, noise, verdict (docs/serving.md)."""
    a, b = _by_c(res, num), _by_c(res, den)
    common = sorted(set(a) & set(b))
    logs = {c: np.log(r) for c in common if (r := round_ratios(a[c], b[c])) and min(r) > 0}
    medians = _ratios(res, num, den)
    df = sum(len(v) - 1 for v in logs.values())
    short = [c for c, r in medians.items() if r < target]
    out: dict[str, Any] = {
        "ratios": medians, "target": target, "passed": bool(medians) and not short,
        "round_ratios": {c: [round(x, 4) for x in round_ratios(a[c], b[c])] for c in common},
        "median_ratios": {c: a[c].throughput_tok_s / b[c].throughput_tok_s for c in common if b[c].throughput_tok_s},
        "sigma_log": None, "below": [], "within_noise": []}
    if df == 0:
        out["verdict"] = "fail" if short or not medians else "pass"
        return out
    sigma = float(np.sqrt(sum(((v - v.mean()) ** 2).sum() for v in logs.values()) / df))
    out["sigma_log"] = sigma
    for c in short:
        se = sigma / np.sqrt(len(logs[c])) if c in logs else 0.0
        below = c not in logs or logs[c].mean() + 2 * se < np.log(target)
        out["below" if below else "within_noise"].append(c)
    # rounds at which two standard errors shrink to the target's margin under 1 (a ratio of 1 then resolves)
    out["rounds_to_resolve"] = int(np.ceil((2 * sigma / -np.log(target)) ** 2)) if target < 1 else None
    out["verdict"] = "pass" if not short and medians else "fail" if out["below"] else "within noise"
    return out


def pool_rounds(sweeps: list[dict[str, Any]], check: str, names: list[str] | None = None, *, resamples: int = 4000,
                seed: int = 0) -> dict[int, dict[str, float]]:
    """One check's round ratios pooled over sweep JSONs: per c median and geomean, bootstrap 95%."""
    pooled: dict[int, list[float]] = {}
    for i, sweep in enumerate(sweeps):
        if check not in sweep.get("checks", {}):
            known = ", ".join(sorted(sweep.get("checks", {}))) or "none"
            raise ValueError(f"{names[i] if names else i} has no check {check!r} (it has: {known})")
        for c, ratios in sweep["checks"][check]["round_ratios"].items():
            pooled.setdefault(int(c), []).extend(float(r) for r in ratios if r > 0)
    rng = np.random.default_rng(seed)
    out = {}
    for c in sorted(pooled):
        v = np.asarray(pooled[c])
        if not v.size:
            continue
        draws = v[rng.integers(0, v.size, (resamples, v.size))]
        medians, means = np.median(draws, axis=1), np.exp(np.log(draws).mean(axis=1))
        out[c] = {"rounds": int(v.size), "median": float(np.median(v)),
                  "median_lo": float(np.percentile(medians, 2.5)), "median_hi": float(np.percentile(medians, 97.5)),
                  "geomean": float(np.exp(np.log(v).mean())),
                  "geomean_lo": float(np.percentile(means, 2.5)), "geomean_hi": float(np.percentile(means, 97.5))}
    return out


def checks(res: SweepResult) -> dict[str, Any]:
    """The acceptance checks, as measured ratios (no check is run without both of its placements)."""
    out: dict[str, Any] = {}
    limits = {p: s["concurrency_limit"] for p, s in res.servers.items()}
    if "device" in limits and "host" in limits:
        out["host_vs_device"] = against(res, "host", "device", HOST_TARGET)
        offloaded = [p.throughput_tok_s for p in res.points if p.placement == "host"]
        resident = [p.throughput_tok_s for p in res.points if p.placement == "device"]
        if offloaded and resident:
            out["budget"] = {"binds": limits["device"] < limits["host"], "device_limit": limits["device"],
                             "host_limit": limits["host"], "host_max_tok_s": max(offloaded),
                             "device_max_tok_s": max(resident), "ratio": max(offloaded) / max(resident)}
    cfg = res.config
    for name, variant in cfg.variants.items():  # each variant against the server it copies
        if name in limits and variant.base in limits:
            out[f"{name}_vs_{variant.base}"] = {"ratios": _ratios(res, name, variant.base),
                                                "cpu_per_token": _ratios(res, name, variant.base, "cpu_ms_per_token")}
    for label in (lb for lb in limits if cfg.kind_of(lb) == "file"):
        ref = getattr(cfg.variants.get(label), "reference", None) or "host"
        if ref not in limits:
            continue
        target = FILE_TARGET if cfg.base_of(label) != "file-big" else BIG_TARGET
        out[f"{label}_vs_{ref}"] = {  # file_vs_host, file-10%_vs_host, file-t1_vs_host-t1, ...
            **against(res, label, ref, target), "reference": ref, "cache_fraction": _fraction(res, label),
            "cache_bytes": res.servers[label]["cache_bytes"],
            "file_mode": res.servers[label].get("file_mode"),  # buffered: O_DIRECT refused, reads via the page cache
            "table_bytes": res.servers[label].get("table_bytes"),
            "file_pages_per_s": {c: p.file_pages_per_s for c, p in _by_c(res, label).items()},
            "cpu_per_token_vs_host": _ratios(res, label, ref, "cpu_ms_per_token"),
            **disk_figures(res, label, target, ref)}
    return out


# a server reading this much faster than the disk's limit for new pages was served by a cache under the disk
ABOVE_LIMIT = 1.25


def disk_figures(res: SweepResult, label: str, target: float, ref: str) -> dict[str, Any]:
    """The disk's limits on `label`'s tables, points read past them, and the share of them it needs."""
    big = res.config.base_of(label) == "file-big" and res.big_disk_pages_per_s
    measured = res.big_disk_pages_per_s if big else res.disk_pages_per_s
    out: dict[str, Any] = {"disk_pages_per_s": measured, "disk_share_needed": {}, "above_disk_limit": []}
    if limits := [v for v in measured.values() if v]:
        file, host = _by_c(res, label), _by_c(res, ref)
        mean = sum(limits) / len(limits)
        out["disk_share_needed"] = {c: file[c].file_pages_per_s / file[c].throughput_tok_s * target
                                    * host[c].throughput_tok_s / mean
                                    for c in sorted(set(file) & set(host)) if file[c].throughput_tok_s > 0}
        out["above_disk_limit"] = [c for c, p in sorted(file.items()) if p.file_pages_per_s > ABOVE_LIMIT * max(limits)]
    return out


BIG_TARGET = 0.80  # file on a table larger than RAM against host on the smaller tables


def _fraction(res: SweepResult, label: str) -> float:
    """The cache of a file server as a fraction of its tables (file-big: its cache bytes over its tables)."""
    label = res.config.base_of(label)  # a variant: its base's cache
    if label != "file-big":
        return res.config.cache_fraction if label == "file" else float(label[5:-1]) / 100  # file-N%
    s = res.servers[label]
    layers = len(layer_table_bytes(s["model_dir"]))
    return s["cache_bytes"] * layers / s["table_bytes"] if s.get("table_bytes") else float("nan")
