"""`tiergram bench split SWEEP_JSON`: a conversations sweep read as the split of one host budget between the Engram
tables and the host K/V tier, as a table and a plot (docs/findings.md, "K/V and Engram in one host memory")."""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path
from typing import Any

from tiergram.plots import save_figure, subplots

# a point's Engram reads bind when the forward waited on them this share of the measured wall time or more
STALL_BINDS = 0.10


def split_points(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Each server of a sweep JSON at each concurrency with its share of the host budget: its Engram tier (host, or
    file: SSD + a row cache), figures, stall share (exposed stall / wall time) and what binds; sorted by server."""
    servers = sweep["servers"]
    best_hit: dict[int, float] = {}
    for p in sweep["points"]:
        if p.get("prefix_hit_rate") is not None:
            best_hit[p["concurrency"]] = max(best_hit.get(p["concurrency"], 0.0), p["prefix_hit_rate"])
    out = []
    for p in sweep["points"]:
        engine = servers[p["placement"]]["settings"]["engine"]
        host = engine.get("host_memory")
        if host is None:
            raise ValueError(f"server {p['placement']!r} ran without host_memory: not a split of one host budget")
        f = float(engine.get("kv_host_fraction", 0.0))
        kv = int(host * f)
        stall = p["exposed_stall_s"] / p["duration_s"] if p["duration_s"] > 0 else 0.0
        hit = p.get("prefix_hit_rate")
        if stall >= STALL_BINDS:
            binds = "engram reads"
        elif hit is not None and hit < best_hit.get(p["concurrency"], 0.0) - 0.05:
            binds = "prefill (K/V misses)"
        else:
            binds = "compute"
        out.append({"server": p["placement"], "engram": engine["placement"], "kv_host_fraction": f,
                    "kv_host_bytes": kv, "engram_host_bytes": host - kv, "concurrency": p["concurrency"],
                    "throughput_tok_s": p["throughput_tok_s"], "ttft_p90_ms": p["ttft_p90_ms"], "prefix_hit_rate": hit,
                    "prefix_host_hit_rate": p.get("prefix_host_hit_rate"),
                    "engram_cache_hit_rate": p.get("engram_cache_hit_rate"), "stall_share": round(stall, 4),
                    "binds": binds})
    return sorted(out, key=lambda s: (s["engram"], s["kv_host_fraction"], s["server"], s["concurrency"]))


def best_split(points: list[dict[str, Any]]) -> dict[int, str]:
    """{concurrency: the server with the highest throughput there} (the first listed on a tie)."""
    by_c = groupby(sorted(points, key=lambda s: s["concurrency"]), key=lambda s: s["concurrency"])
    return {c: max(at, key=lambda s: s["throughput_tok_s"])["server"] for c, at in by_c}


def to_markdown(points: list[dict[str, Any]]) -> str:
    """The split table: one row per server and concurrency."""
    head = ("| server | Engram | K/V share | Engram MiB | K/V MiB | c | tok/s | TTFT p90 ms | prefix hit | from host | "
            "Engram cache hit | stall share | binds |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for s in points:
        lines.append(f"| {s['server']} | {s['engram']} | {100 * s['kv_host_fraction']:.0f}% | "
                     f"{s['engram_host_bytes'] / 2**20:.0f} | {s['kv_host_bytes'] / 2**20:.0f} | {s['concurrency']} | "
                     f"{s['throughput_tok_s']:.1f} | {s['ttft_p90_ms']:.0f} | {pct(s['prefix_hit_rate'])} | "
                     f"{pct(s['prefix_host_hit_rate'])} | {pct(s['engram_cache_hit_rate'])} | "
                     f"{pct(s['stall_share'])} | {s['binds']} |")
    best = ", ".join(f"c={c}: {name}" for c, name in best_split(points).items())
    return "\n".join(lines) + f"\n\nbest split by throughput: {best}\n"


def plot(points: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Throughput, TTFT p90 and prefix hit rate against the K/V share, a line per Engram tier and concurrency."""
    fig, axes = subplots(1, 3, figsize=(12.8, 4.0))
    ordered = sorted(points, key=lambda s: (s["engram"], s["concurrency"], s["kv_host_fraction"]))
    for (engram, c), line in groupby(ordered, key=lambda s: (s["engram"], s["concurrency"])):
        pts = list(line)
        x = [100 * s["kv_host_fraction"] for s in pts]
        style = "-o" if engram == "host" else "--s"
        axes[0].plot(x, [s["throughput_tok_s"] for s in pts], style, label=f"Engram {engram}, c={c}")
        axes[1].plot(x, [s["ttft_p90_ms"] for s in pts], style)
        axes[2].plot(x, [100 * (s["prefix_hit_rate"] or 0.0) for s in pts], style)
    for ax, label in zip(axes, ("throughput (tok/s)", "TTFT p90 (ms)", "prefix hit rate (%)"), strict=True):
        ax.set_xlabel("host K/V tier's share of the host budget (%)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def report(sweep_path: str | Path, plot_path: str | Path | None = None) -> tuple[list[dict[str, Any]], str]:
    """(points, markdown) of a sweep JSON file, the plot written beside it (or at plot_path)."""
    path = Path(sweep_path)
    sweep = json.loads(path.read_text())
    points = split_points(sweep)
    name = Path(sweep["config"]["model_dir"]).name
    plot(points, Path(plot_path) if plot_path else path.with_suffix(".split.png"),
         f"{name}: host budget split between Engram and K/V, {sweep['config']['workload']}")
    return points, to_markdown(points)


def to_json(points: list[dict[str, Any]]) -> str:
    """The points and the best split per concurrency as one JSON object."""
    return json.dumps({"points": points, "best": best_split(points)}, indent=2)
