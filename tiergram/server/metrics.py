"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

Server-side request metrics (counts by status, TTFT, inter-token and end-to-end latency histograms) are
recorded by the HTTP layer; engine gauges and counters come from the latest EngineMetrics snapshot.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


def _fmt(value: float) -> str:
    """A sample value as Prometheus writes it."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _labels(labels: dict[str, str]) -> str:
    """{a="x",b="y"} with values escaped, or ''."""
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


@dataclass
class Histogram:
    """Cumulative-bucket histogram of seconds."""

    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float, times: int = 1) -> None:
        """Record value (times times)."""
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += times
                break
        self.total += value * times
        self.n += times

    def lines(self) -> list[str]:
        """Exposition lines (HELP, TYPE, cumulative buckets, sum, count)."""
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts, strict=True):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {cum}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.n}', f"{self.name}_sum {_fmt(self.total)}",
                f"{self.name}_count {self.n}"]
        return out


def _family(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    """A counter or gauge family."""
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    out += [f"{name}{_labels(labels)} {_fmt(value)}" for labels, value in samples]
    return out


class ServerMetrics:
    """Request-level metrics of the HTTP server (thread-safe) and the rendering of /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status code) -> count
        self.finished: dict[str, int] = {}  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("tiergram_time_to_first_token_seconds", "Time from request arrival to first token.")
        self.itl = Histogram("tiergram_inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = Histogram("tiergram_e2e_request_latency_seconds", "Time from request arrival to its last token.")

    def count_request(self, endpoint: str, status: int) -> None:
        """One answered request (status: the HTTP status it got)."""
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_tokens(self, gap_s: float, n: int) -> None:
        """n tokens arrived gap_s after the previous ones: n inter-token gaps of gap_s / n."""
        with self._lock:
            self.itl.observe(gap_s / n, n)

    def observe_finished(self, reason: str, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        """A generation ended; only completed ones (length, stop) enter the end-to-end histogram."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if reason in ("length", "stop"):
                self.e2e.observe(e2e_s)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens

    def render(self, engine: Any | None, *, in_flight: int = 0, draining: bool = False,
               cache_counts: tuple[int, int] | None = None) -> str:
        """The /metrics text: server metrics plus the engine snapshot (an EngineMetrics or None)."""
        with self._lock:
            lines = _family("tiergram_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
                            [({"endpoint": e, "status": s}, v) for (e, s), v in sorted(self.requests.items())])
            lines += _family("tiergram_request_finished_total", "counter", "Generations finished, by reason.",
                             [({"reason": r}, v) for r, v in sorted(self.finished.items())])
            lines += _family("tiergram_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                             [({}, self.prompt_tokens)])
            lines += _family("tiergram_generation_tokens_total", "counter", "Tokens generated by finished requests.",
                             [({}, self.generation_tokens)])
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.lines()
        lines += _family("tiergram_requests_in_flight", "gauge", "HTTP generation requests being served.",
                         [({}, in_flight)])
        lines += _family("tiergram_draining", "gauge", "1 while the server drains before exiting.",
                         [({}, int(draining))])
        if engine is not None:
            lines += engine_lines(engine)
        if cache_counts is not None:
            lines += _family("tiergram_engram_cache_hits_total", "counter", "Engram hot-row cache hits.",
                             [({}, cache_counts[0])])
            lines += _family("tiergram_engram_cache_probes_total", "counter", "Engram hot-row cache probes "
                             "(hits + misses).", [({}, cache_counts[1])])
        return "\n".join(lines) + "\n"


def engine_lines(m: Any) -> list[str]:
    """Gauges and counters of an EngineMetrics snapshot."""
    engram = m.engram or {}
    gauges = [
        ("tiergram_num_requests_running", "Sequences in the running batch.", m.num_running),
        ("tiergram_num_requests_waiting", "Sequences waiting to be scheduled.", m.num_waiting),
        ("tiergram_kv_blocks_total", "K/V cache blocks the budget allows.", m.kv_blocks_total),
        ("tiergram_kv_blocks_used", "K/V cache blocks in use.", m.kv_blocks_used),
        ("tiergram_kv_cache_usage_ratio", "Fraction of K/V cache blocks in use.", m.kv_usage),
        ("tiergram_engram_cache_hit_rate", "Hit rate of the Engram hot-row cache since start.",
         engram.get("cache_hit_rate") or 0.0),
        ("tiergram_engram_last_step_stall_seconds", "Prefetch stall exposed in the last step.", m.last_step_stall_s),
        ("tiergram_kv_blocks_affordable", "K/V blocks the device budget could buy.",
         (m.budget or {}).get("kv_blocks_affordable", 0)),
        ("tiergram_device_table_bytes", "Engram table bytes resident in device memory.",
         (m.budget or {}).get("device_table_bytes", 0)),
        ("tiergram_degrade_level", "Degrade level: 0 normal, 1 decode Engram reads skipped, 2 also predicted-useless "
         "prefill reads.", getattr(m, "degrade_level", 0)),
    ]
    lines: list[str] = []
    for name, help_, value in gauges:
        lines += _family(name, "gauge", help_, [({}, float(value or 0))])
    counters = [
        ("tiergram_num_preemptions_total", "Sequences preempted for K/V space.", m.num_preemptions),
        ("tiergram_engine_steps_total", "Engine steps run.", m.steps),
        ("tiergram_engram_pages_read_total", "Table pages read from storage.", engram.get("pages_read") or 0),
        ("tiergram_engram_exposed_stall_seconds_total", "Time the forward waited on Engram rows (not hidden by "
         "prefetch).", m.exposed_stall_s),
        ("tiergram_engine_step_seconds_total", "Wall time inside steps that ran the model.", m.step_time_s),
        ("tiergram_engine_computed_tokens_total", "Tokens run through the model (recomputation included).",
         m.computed_tokens),
        ("tiergram_engram_skipped_rows_total", "Engram rows the degrade policy did not fetch.",
         getattr(m, "skipped_rows", 0)),
        ("process_cpu_seconds_total", "CPU time of the server process, every thread, user + system.",
         time.process_time()),
    ]
    for name, help_, value in counters:
        lines += _family(name, "counter", help_, [({}, float(value or 0))])
    tiers = sorted((engram.get("bytes_read") or {}).items())
    lines += _family("tiergram_engram_bytes_read_total", "counter", "Engram table bytes read, by tier.",
                     [({"tier": t}, float(v)) for t, v in tiers])
    levels = sorted((getattr(m, "degrade_steps", None) or {}).items())
    lines += _family("tiergram_degrade_steps_total", "counter", "Engine steps run at each degrade level.",
                     [({"level": str(k)}, float(v)) for k, v in levels])
    return lines


def parse(text: str) -> dict[str, float]:
    """Samples of an exposition text as {'name{labels}': value} (for clients and tests)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
