"""`tiergram bench serve`'s output: the checks in words, the plot, the markdown table, JSON and text."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tiergram.bench.serve_stats import ABOVE_LIMIT, SweepResult
from tiergram.plan.predict import SWEEP_SCHEMA
from tiergram.plots import save_figure, subplots


def rounds_lines(check: dict) -> list[str]:
    """A check's ratio in each round (and the ratio of the medians) per concurrency, and its noise."""
    medians = check["median_ratios"]
    rounds = "; ".join(f"c={c} " + "/".join(f"{x:.2f}" for x in rs) + (f" (medians' ratio {medians[c]:.3f})"
                                                                       if c in medians else "")
                       for c, rs in check["round_ratios"].items() if rs) or "no rounds recorded"
    return [f"    round by round: {rounds}", f"    noise: {noise_text(check)}"]


def noise_text(check: dict) -> str:
    """How far this run's rounds resolve the check's ratio, and which points missed the target within that."""
    sigma = check["sigma_log"]
    if sigma is None:
        return "no point has two rounds: no noise estimate (the verdict is the medians')"
    n = max((len(r) for r in check["round_ratios"].values()), default=1)
    text = (f"one round's ratio spreads sigma {sigma:.3f} (log, pooled over the points), so a point of {n} rounds "
            f"resolves about +-{100 * (np.exp(2 * sigma / np.sqrt(n)) - 1):.0f}% (two standard errors)")
    if check.get("within_noise"):
        text += (f"; below the target within that: {', '.join(f'c={c}' for c in check['within_noise'])} (about "
                 f"{check['rounds_to_resolve']} rounds would resolve the {1 - check['target']:.0%} margin)")
    if check.get("below"):
        text += f"; below it by more: {', '.join(f'c={c}' for c in check['below'])}"
    return text


def checks_text(res: SweepResult) -> str:
    """The acceptance checks in words, with the measured ratios."""
    ck, lines = res.checks, ["acceptance checks (ratios of throughput measured in this run; at each concurrency the "
                             "median over rounds of the ratio within a round):"]

    def rs(r: dict[int, float]) -> str:
        return ", ".join(f"c={c} {v:.3f}" for c, v in r.items()) or "no common concurrency"

    if "host_vs_device" in ck:
        h = ck["host_vs_device"]
        note = " (the device budget binds: compared where both ran)" if ck.get("budget", {}).get("binds") else ""
        lines.append(f"  host >= {h['target']:.0%} of resident (device) at every concurrency{note}: "
                     f"{h['verdict'].upper()} [{rs(h['ratios'])}]")
        lines += rounds_lines(h)
    if "budget" in ck:
        b = ck["budget"]
        if b["binds"]:
            lines.append(f"  binding device budget: resident reaches c={b['device_limit']}, host c={b['host_limit']}; "
                         f"front max throughput host {b['host_max_tok_s']:.1f} vs resident {b['device_max_tok_s']:.1f}"
                         f" tok/s = {b['ratio']:.3f}x ({100 * (b['ratio'] - 1):+.1f}%)")
        else:
            lines.append(f"  device budget does not bind (both reach c={b['device_limit']}); max throughput host/"
                         f"resident = {b['ratio']:.3f}; pass --device-memory to make it bind")
    for key, f in ck.items():
        if "cache_fraction" not in f:  # the file servers' checks
            continue
        ref = f.get("reference", "host")
        label = key.removesuffix(f"_vs_{ref}")
        tb = f.get("table_bytes") or 0
        size = (f" on {tb / 2**30:.1f} GiB tables" if tb >= 2**30 else f" on {tb / 2**20:.1f} MiB tables") if tb else ""
        lines.append(f"  {label}{size} (host cache {f['cache_fraction']:.1%} of the tables, {f['cache_bytes']} B per "
                     f"layer) >= {f['target']:.0%} of {ref} at every concurrency: {f['verdict'].upper()} "
                     f"[{rs(f['ratios'])}]")
        reads = ", ".join(f"c={c} {v:.0f}" for c, v in f["file_pages_per_s"].items())
        disk = " and ".join(f"{v:.0f} {k}" for k, v in f["disk_pages_per_s"].items())
        limit = (f"the disk's limit (QD128, O_DIRECT), pages/s: {disk} the sweep" if disk else
                 "no disk limit (O_DIRECT refused: the reads went through the page cache)")
        lines += rounds_lines(f)
        lines.append(f"    file tier reads ({f.get('file_mode') or 'mode not recorded'}), pages/s: {reads}; {limit}")
        lines.append(f"    server CPU per token, {label} / {ref}: {rs(f['cpu_per_token_vs_host'])}")
        if f.get("above_disk_limit"):
            lines.append(f"    WARNING: {label} read faster than {ABOVE_LIMIT:.2f}x the disk's limit for new pages at "
                         + ", ".join(f"c={c}" for c in f["above_disk_limit"]) + ": a cache under the disk served "
                         "them; re-create the tables (init-model) for the disk's figure")
        if f.get("disk_share_needed"):
            lines.append(f"    share of the disk's limit {label} needs to reach {f['target']:.0%} of {ref} at its "
                         f"pages per token (>= 1: the disk binds): {rs(f['disk_share_needed'])}")
    for name, v in res.config.variants.items():
        if (f := ck.get(f"{name}_vs_{v.base}")) is not None:
            changed = ", ".join(f"{k} {val}" for k, val in v.engine.items())
            lines.append(f"  {name} / {v.base} (the same server, {changed or 'nothing'} changed): "
                         f"throughput [{rs(f['ratios'])}], server CPU per token [{rs(f['cpu_per_token'])}]")
    peaks = ", ".join(f"{pl} {s_['peak_rss_bytes'] / 2**30:.2f} GiB" for pl, s_ in res.servers.items()
                      if s_.get("peak_rss_bytes"))
    if peaks:
        lines.append(f"  servers' peak RSS: {peaks}")
    preloads = ", ".join(f"{pl} {s_['hot_rows_preloaded']:,} rows in {s_['hot_rows_preload_s']:.1f} s"
                         for pl, s_ in res.servers.items() if s_.get("hot_rows_preloaded"))
    if preloads:
        lines.append(f"  hot-rows preload at start: {preloads}")
    if len(lines) == 1:
        lines.append("  none (they need device+host or host+file placements)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- output

def plot(res: SweepResult, path: Path) -> Path:
    """Throughput against interactivity: every point faint, each placement's front as a line, as a PNG."""
    fig, ax = subplots(figsize=(6.4, 4.4))
    for placement in res.config.labels():
        pts = sorted((p for p in res.points if p.placement == placement), key=lambda p: p.concurrency)
        if not pts:
            continue
        front = [p for p in pts if p.concurrency in res.fronts.get(placement, [])]
        line, = ax.plot([p.interactivity_p90 for p in front], [p.throughput_tok_s for p in front], marker="o",
                        label=f"{placement} (front)")
        ax.scatter([p.interactivity_p90 for p in pts], [p.throughput_tok_s for p in pts], color=line.get_color(),
                   alpha=0.35, s=18)
        for p in front:
            ax.annotate(str(p.concurrency), (p.interactivity_p90, p.throughput_tok_s), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("interactivity (tokens/s per user, at ITL p90)")
    ax.set_ylabel("throughput (tokens/s, prompt + output)")
    ax.set_title(f"{Path(res.config.model_dir).name}: input {res.config.input_len}, output {res.config.output_len}"
                 " (labels: concurrency)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def to_markdown(res: SweepResult) -> str:
    """A markdown table of every point (front points marked)."""
    head = ("| placement | concurrency | throughput tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
            "E2E p90 ms | tok/s/user p90 | cache hit | file pages/s | stall s | CPU ms/token | peak RSS GiB | front |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for p in res.points:
        hit = "-" if p.engram_cache_hit_rate is None else f"{100 * p.engram_cache_hit_rate:.1f}%"
        front = "yes" if p.concurrency in res.fronts.get(p.placement, []) else ""
        lines.append(f"| {p.placement} | {p.concurrency} | {p.throughput_tok_s:.1f} | {p.ttft_p50_ms:.1f} / "
                     f"{p.ttft_p90_ms:.1f} / {p.ttft_p99_ms:.1f} | {p.itl_p50_ms:.1f} / {p.itl_p90_ms:.1f} / "
                     f"{p.itl_p99_ms:.1f} | {p.e2e_p90_ms:.0f} | {p.interactivity_p90:.1f} | {hit} | "
                     f"{p.file_pages_per_s:.0f} | {p.exposed_stall_s:.3f} | {p.cpu_ms_per_token:.2f} | "
                     f"{p.server_peak_rss_bytes / 2**30:.2f} | {front} |")
    return "\n".join(lines) + "\n"


def to_json(res: SweepResult) -> str:
    """One JSON object: its schema version (what `plan validate` reads), points, fronts, checks, servers, config."""
    return json.dumps({"schema": SWEEP_SCHEMA, **asdict(res)}, indent=2, default=str)


def to_text(res: SweepResult) -> str:
    """The table, the checks and where the plot is."""
    return "\n".join([f"trace: {res.source}", to_markdown(res).rstrip(), checks_text(res), f"plot: {res.plot}"])
