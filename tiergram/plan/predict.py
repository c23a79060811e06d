"""Predicted fronts for a model on a machine: the placements to compare, the table, the plot, and validation
against a measured `tiergram bench serve` sweep."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.plan.model import (
    ENGRAM_SOURCE,
    Front,
    HardwareSpec,
    ModelSpec,
    Placement,
    Point,
    Workload,
    concurrency_limit,
    interpolate,
    predict_point,
    steps_per_request,
)
from tiergram.plan.prefix import Conversations, Reuse
from tiergram.plan.split import Split, conversations_workload, predict_conversations


def placements(cache_fractions: tuple[float, ...] = (0.01, 0.1), hot_rows: bool = False) -> list[Placement]:
    """device, host, file at each cache size (with hot_rows, each again preloaded), host with K/V offload."""
    return [Placement("device"), Placement("host"), *(Placement("file", cache_fraction=f) for f in cache_fractions),
            *(Placement("file", cache_fraction=f, hot_rows=True) for f in cache_fractions if hot_rows),
            Placement("host", kv_offload=True)]


def to_text(model: ModelSpec, hw: HardwareSpec, wl: Workload, fronts: list[Front]) -> str:
    """The prediction as a table: every point, its step time, what binds; each placement's limit and why."""
    lines = [f"PREDICTION (tiergram plan): {model.name} on {hw.name}",
             f"workload: input {wl.input_len:g}, output {wl.output_len:g} tokens (means), closed loop, "
             f"max_num_seqs {wl.max_num_seqs}, {wl.max_num_batched_tokens} tokens per step",
             f"{'placement':<26}{'c':>7}{'tok/s':>12}{'tok/s/user':>12}{'step ms':>10}  binds"]
    for f in fronts:
        front = {p.concurrency for p in f.pareto}
        for p in f.points:
            mark = "*" if p.concurrency in front else " "
            hit = f" (hit {p.hit_rate:.0%})" if p.hit_rate is not None else ""
            lines.append(f"{p.placement:<26}{p.concurrency:>7}{p.throughput_tok_s:>12,.0f}{p.interactivity:>12.1f}"
                         f"{p.step_s * 1e3:>10.2f} {mark}{p.binding}{hit}")
        if not f.points:
            lines.append(f"{f.placement.label:<26}  does not fit: {f.limit.binding} binds")
    lines.append("limits (the concurrency where each placement stops, and what binds there):")
    for f in fronts:
        at = f"; there the step is bound by {f.points[-1].binding}" if f.points else ""
        lines.append(f"  {f.placement.label:<26} c = {f.limit.concurrency:,} ({f.limit.binding}){at}")
    lines.append("(* = on the placement's pareto front)")
    if not model.hit_rate_curve and any(f.placement.kind == "file" for f in fronts):
        lines.append("note: the model spec has no hit_rate_curve: file placements assume no cache hits (worst case)")
    return "\n".join(lines)


def to_json(model: ModelSpec, hw: HardwareSpec, wl: Workload, fronts: list[Front]) -> str:
    """Every front, point and limit as JSON."""
    return json.dumps({"model": model.name, "hardware": hw.name, "workload": asdict(wl), "prediction": True,
                       "fronts": [{"placement": f.placement.label, "limit": asdict(f.limit),
                                   "pareto": [p.concurrency for p in f.pareto],
                                   "points": [asdict(p) for p in f.points]} for f in fronts]}, indent=2)


def label_axes(ax: Any, x: str, y: str, title: str, legend: int = 7) -> None:
    """Axis labels, title, a light grid and the legend of one plot panel."""
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=legend)


def plot(lines: dict[str, list[tuple[float, float]]], path: Path, title: str,
         measured: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    """Throughput against interactivity: predicted (interactivity, tok/s) as lines, measured as markers."""
    from tiergram.plots import save_figure, subplots

    fig, ax = subplots(figsize=(7.0, 4.6))
    colors: dict[str, Any] = {}
    for name, pts in lines.items():
        line, = ax.plot(*zip(*pts, strict=True), marker=".", label=f"{name} (predicted)")
        colors[name] = line.get_color()
    for name, pts in (measured or {}).items():
        ax.scatter(*zip(*pts, strict=True), marker="x", s=30, color=colors.get(name, "black"),
                   label=f"{name} (measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    label_axes(ax, "interactivity (output tokens/s per user)", "throughput (tokens/s, prompt + output)", title)
    return save_figure(fig, path)


# ------------------------------------------------------------------------------------------- validation

def sweep_workload(cfg: dict[str, Any]) -> Workload:
    """The closed loop a `bench serve` sweep ran: lengths uniform in [0.8 L, L], so the means are 0.9 L."""
    def mean(n: int) -> float:
        return (max(1, int(0.8 * n)) + n) / 2.0

    return Workload(input_len=mean(int(cfg["input_len"])), output_len=mean(int(cfg["output_len"])),
                    max_num_seqs=int(cfg.get("max_num_seqs", 64)),
                    max_num_batched_tokens=int(cfg.get("max_num_batched_tokens", 512)),
                    block_size=int(cfg.get("block_size", 16)), max_input_len=int(cfg["input_len"]),
                    max_output_len=int(cfg["output_len"]))


def sweep_conversations(cfg: dict[str, Any]) -> Conversations | None:
    """The conversations a `--workload conversations` sweep sent, as bench/load.py builds them (else None)."""
    if cfg.get("workload", "requests") != "conversations":
        return None
    n = int(cfg["input_len"])
    return Conversations(n, max(1, n // 8), int(cfg["output_len"]), int(cfg.get("turns", 4)), int(cfg.get("docs", 8)),
                         float(cfg.get("think_time_s", 0.0)))


def sweep_sessions(cfg: dict[str, Any], conv: Conversations, c: int) -> tuple[int, float]:
    """(sessions per round at c, sessions a server ran before the middle of that point: warm-ups and rounds)."""
    levels = sorted({int(p["concurrency"]) for p in cfg.get("_levels", [])} | {c})
    before = 0.0
    for lv in levels:  # sessions: each user's requests, whole conversations of `turns`
        warm = math.ceil(int(cfg.get("warmup_per_user", 1)) * lv / conv.turns)
        each = math.ceil(int(cfg.get("requests_per_user", 4)) * lv / conv.turns)
        if lv == c:
            return each, before + warm + int(cfg.get("rounds", 1)) * each / 2
        before += warm + int(cfg.get("rounds", 1)) * each
    raise AssertionError("unreachable")


def round_thinks(cfg: dict[str, Any], conv: Conversations, c: int) -> list[list[float]]:
    """Per round, each user's think seconds: the load generator's seeded draws, dealt to the users in turn."""
    each, _ = sweep_sessions(cfg, conv, c)
    out = []
    for r in range(int(cfg.get("rounds", 1))):
        draws = np.random.default_rng(int(cfg.get("seed", 0)) + r).exponential(conv.think_s, each * (conv.turns - 1))
        out.append([float(draws[u::c].sum()) for u in range(c)])
    return out


def predict_conversation_point(model: ModelSpec, hw: HardwareSpec, cfg: dict[str, Any], conv: Conversations,
                               split: Split, c: int, hit_rate: float | None = None) -> tuple[Point, Reuse]:
    """A conversations sweep's point: the median round, each with its own think draws (as `bench serve` reports)."""
    each, before = sweep_sessions(cfg, conv, c)
    thinks = round_thinks(cfg, conv, c) if conv.think_s > 0 else [[0.0] * c]
    mean_think = sum(map(sum, thinks)) / max(1, len(thinks) * each * conv.turns)
    base = conversations_workload(replace(conv, think_s=mean_think), int(cfg.get("max_num_seqs", 64)),
                                  int(cfg.get("max_num_batched_tokens", 512)), int(cfg.get("block_size", 16)))
    point, got = predict_conversations(model, hw, replace(conv, think_s=mean_think), split, c, base, before, hit_rate)
    request_s = point.cycle_s - mean_think
    tokens = each * sum(conv.prompt_len(k) + conv.answer_len for k in range(1, conv.turns + 1))
    walls = []
    for users in thinks:
        turns = [conv.turns * len(range(u, each, c)) for u in range(c)]  # sessions are dealt to users in turn
        walls.append(max(n * request_s + t for n, t in zip(turns, users, strict=True)))
    point.throughput_tok_s = float(np.median([tokens / w for w in walls]))
    return point, got


def _engine(sweep: dict[str, Any], label: str) -> dict[str, Any]:
    """The [engine] settings a sweep's server ran with."""
    return ((sweep.get("servers") or {}).get(label) or {}).get("settings", {}).get("engine") or {}


def sweep_split(sweep: dict[str, Any], label: str) -> Split:
    """The host budget a sweep's server ran with and its split."""
    engine = _engine(sweep, label)
    host = engine.get("host_memory") or sweep["config"].get("host_memory")
    if not host:
        raise ValueError(f"server {label!r} ran without host_memory: a conversations sweep is predicted per split of "
                         "one host budget (bench serve --config with [engine] host_memory)")
    return Split(float(host), float(engine.get("kv_host_fraction", 0.0)), engine.get("placement", label),
                 bool(engine.get("hot_rows")))


SWEEP_SCHEMA = 1  # the layout of `bench serve --json`: bench writes it, validate reads it


def read_sweep(path: Path) -> dict[str, Any]:
    """A `bench serve --json` sweep, its schema checked."""
    try:
        sweep = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the sweep JSON ({e})") from None
    if not isinstance(sweep, dict) or "config" not in sweep or "points" not in sweep:
        raise ValueError(f"{path}: not a `bench serve` sweep (no `config` and `points`)")
    if sweep.get("schema") != SWEEP_SCHEMA:
        raise ValueError(f"{path}: sweep schema {sweep.get('schema')!r}; this tiergram reads schema {SWEEP_SCHEMA} "
                         "(measure it again with `tiergram bench serve --json`)")
    return sweep


def sweep_base(cfg: dict[str, Any], label: str) -> str:
    """The placement server a sweep's server runs: a variant's base (the sweep's config names it), else itself."""
    return ((cfg.get("variants") or {}).get(label) or {}).get("base", label)


def sweep_placement(name: str, cfg: dict[str, Any]) -> Placement:
    """The placement a sweep server (or its variant's base) runs: device, host, file, file-N%, file-big."""
    base = sweep_base(cfg, name)
    kind, _, tail = base.partition("-")
    if base not in ("device", "host", "file", "file-big") and not (kind == "file" and tail.endswith("%")):
        raise ValueError(f"sweep point placement {name!r}: not device, host or file[-N%|-big]")
    if kind != "file":
        return Placement(kind)
    if tail.endswith("%"):
        return Placement("file", cache_fraction=float(tail[:-1]) / 100)
    fractions = cfg.get("cache_fractions") or [cfg.get("cache_fraction", 0.1)]
    return Placement("file", cache_fraction=float(min(fractions)))


def binds(engram: str, disk_share: float, stall_share: float) -> str:
    """What binds a point, by its evidence: the disk at its limit, the Engram source past 25% stall, else compute."""
    if disk_share >= 1 - 1e-9:  # the model's disk-bound step is its disk time exactly
        return "engram (disk)"
    return engram if stall_share > 0.25 else "compute"


def validate(sweep: dict[str, Any], model: ModelSpec, hw: HardwareSpec, host_traffic_bps: float = 0.0,
             rows_first: bool | None = None, disk_from: str = "sweep", speed_from: str = "sweep",
             naive: bool = False) -> dict[str, Any]:
    """Every measured point against its prediction (docs/planner.md, "Validation"): `disk_from` / `speed_from`
    "sweep" predict on the disk and CPU speed the sweep measured, "spec" on the spec's; `naive` adds the baseline."""
    if naive and not hw.serve_tok_s_curve:
        raise ValueError(f"hardware spec {hw.name!r} has no serve_tok_s_curve for the naive baseline: rerun "
                         "`tiergram plan calibrate` (without --no-serve), or refit with --measured")
    cfg = sweep["config"]
    conv = sweep_conversations(cfg)
    base_wl = replace(sweep_workload(cfg), host_traffic_bps=host_traffic_bps)
    if cfg.get("device_memory") is not None:
        hw = replace(hw, device_memory_bytes=float(cfg["device_memory"]))
    probes = [float(p["cpu_speed_ms"]) for p in sweep["points"] if p.get("cpu_speed_ms")]
    speed: dict[str, Any] = {"from": "spec", "spec_probe_ms": hw.cpu_speed_ms, "factor": 1.0}
    if speed_from == "sweep" and probes and hw.kind == "cpu" and hw.cpu_speed_ms > 0:
        swept = statistics.median(probes)
        hw = hw.at_speed(swept)
        speed |= {"from": "sweep", "sweep_probe_ms": round(swept, 3),
                  "factor": round(swept / speed["spec_probe_ms"], 4)}
    rows: list[dict[str, Any]] = []  # one measured point next to its prediction
    skipped: set[str] = set()
    disks: dict[str, float] = {}  # file server -> the disk's pages/s at QD 128 its points were predicted on
    disk_sources: dict[str, str] = {}  # file server -> "sweep" or "spec": where that figure came from
    limits: dict[str, dict[str, Any]] = {}
    for pt in sweep["points"]:
        name = pt["placement"]
        try:
            pl = sweep_placement(name, cfg)
        except ValueError:
            skipped.add(name)  # a placement the planner does not model (e.g. mooncake, a remote store)
            continue
        kind = pl.kind
        source = first = None
        # prompt_rows_first where the server read rows ahead (its variant's setting, else the sweep's)
        variant = ((cfg.get("variants") or {}).get(name) or {}).get("engine") or {}
        ahead = bool(variant.get("read_ahead", (cfg.get("engine") or {}).get("read_ahead", True)))
        wl = replace(base_wl, prompt_rows_first=ahead if rows_first is None else rows_first and ahead)
        # the disk's limit (pages/s, QD 128) the sweep measured on this server's tables (0: none)
        key = "big_disk_pages_per_s" if sweep_base(cfg, name) == "file-big" else "disk_pages_per_s"
        disk_limit = min((sweep.get(key) or {}).values(), default=0.0)
        hw_pt = hw
        if kind == "file":
            if model.hit_rate_curve:  # a server that preloaded hot rows reads the hot curve, where the spec has one
                hot = bool(_engine(sweep, name).get("hot_rows") or cfg.get("hot_rows")) and bool(
                    model.hot_hit_rate_curve)
                pl = replace(pl, hot_rows=hot)
                source = "model spec" + (" (hot rows)" if hot else "")
            elif pt.get("file_pages_per_s") and pt.get("throughput_tok_s"):
                # pages per row served: read-ahead counts the rows it warmed as hits, though they were read
                rows_per_s = float(pt["throughput_tok_s"]) * model.engram.rows_per_token
                pl = replace(pl, hit_rate=max(0.0, 1.0 - float(pt["file_pages_per_s"]) / rows_per_s))
                source = "sweep (pages read per row)"
            elif pt.get("engram_cache_hit_rate") is not None:
                pl = replace(pl, hit_rate=float(pt["engram_cache_hit_rate"]))
                source = "sweep (reported hit rate)"
            on_sweep = disk_from == "sweep" and bool(disk_limit)
            if on_sweep:
                hw_pt = replace(hw, disk=hw.disk.at_limit(disk_limit, wl.queue_depth))
            disks[name] = hw_pt.disk.pages_per_s(wl.queue_depth)  # new pages: the probe's and the curve's
            disk_sources[name] = "sweep" if on_sweep else "spec"
            first = pt.get("file_first_read_share") if disk_from == "sweep" else None
            if first is not None:  # re-reads at the rate of a cache under the disk
                hw_pt = replace(hw_pt, disk=hw_pt.disk.with_rereads(1.0 - float(first)))
        got = None
        if conv is not None:
            p, got = predict_conversation_point(model, hw_pt, {**cfg, "_levels": sweep["points"]}, conv,
                                                sweep_split(sweep, name), int(pt["concurrency"]), pl.hit_rate)
            p.placement = name
        else:
            p = predict_point(model, hw_pt, wl, pl, int(pt["concurrency"]))
        measured = float(pt["throughput_tok_s"])
        inter = pt.get("interactivity_p50")
        stall = float(pt.get("exposed_stall_s") or 0.0) / max(1e-9, float(pt.get("duration_s") or 0.0) or 1e9)
        disk = float(pt.get("file_pages_per_s") or 0.0) / disk_limit if disk_limit else 0.0
        past = {c for key, check in sweep.get("checks", {}).items() if key.startswith(f"{name}_vs_host")
                for c in check.get("above_disk_limit") or []}  # read past the disk's new-page limit
        seen = ENGRAM_SOURCE[kind]
        # the prediction's side by the same rule, from its own disk share and stall (the engine's wait) share
        p_stall = p.terms.get("engram wait", p.terms.get("engram exposed", 0.0)) / p.step_s if p.step_s > 0 else 0.0
        p_disk = p.terms.get("disk busy", 0.0) / p.step_s if p.step_s > 0 else 0.0
        # with think time a user's cycle holds the steps run while it thinks, as the server counts
        steps = round(p.cycle_s / p.step_s if got else steps_per_request(wl, p.concurrency, hw), 2)
        rows.append({
            "placement": name, "concurrency": p.concurrency, "predicted_tok_s": p.throughput_tok_s,
            "measured_tok_s": measured, "ratio": measured / p.throughput_tok_s,
            "predicted_binding": binds(seen, p_disk, p_stall), "predicted_interactivity": p.interactivity,
            "measured_interactivity": float(inter) if inter is not None else None, "hit_rate": p.hit_rate,
            "hit_rate_source": source, "measured_binding": binds(seen, disk, stall), "stall_share": round(stall, 4),
            "predicted_stall_share": round(p_stall, 4), "disk_share": round(disk, 4),  # of the disk's limit
            "first_read_share": None if first is None else round(float(first), 4),  # of the file tier's page reads
            "predicted_step_ms": round(p.step_s * 1e3, 3), "measured_step_ms": pt.get("server_step_ms"),
            "predicted_steps_per_request": steps, "measured_steps_per_request": pt.get("steps_per_request"),
            "past_disk_limit": int(pt["concurrency"]) in past,
            "naive_tok_s": round(interpolate(hw.serve_tok_s_curve, p.concurrency, log_x=True), 1) if naive else None,
            "predicted_prefix_hit": None if got is None else round(got.hit_rate, 4),
            "measured_prefix_hit": pt.get("prefix_hit_rate")})
        if name not in limits:
            lim = concurrency_limit(model, hw, wl, pl)
            limits[name] = {"predicted": lim.concurrency, "predicted_binding": lim.binding,
                            "measured": (sweep.get("servers", {}).get(name) or {}).get("concurrency_limit")}
    errs = [abs(r["ratio"] - 1) for r in rows]
    prefix = [abs(r["predicted_prefix_hit"] - r["measured_prefix_hit"]) * 100 for r in rows
              if r["predicted_prefix_hit"] is not None and r["measured_prefix_hit"] is not None]
    naive_errs = [abs(r["measured_tok_s"] / r["naive_tok_s"] - 1) for r in rows if r["naive_tok_s"]]
    on_disk = [abs(r["ratio"] - 1) for r in rows if not r["past_disk_limit"]]
    step_errs = [abs(r["measured_step_ms"] / r["predicted_step_ms"] - 1) for r in rows
                 if r["measured_step_ms"] and r["predicted_step_ms"] > 0]

    def within(xs: list[float]) -> int:
        return sum(e <= 0.15 for e in xs)

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    summary = {"points": len(rows), "within_15pct": within(errs),
               "binding_named": sum(r["predicted_binding"] == r["measured_binding"] for r in rows),
               "max_abs_error": max(errs) if errs else None, "mean_abs_error": mean(errs),
               "prefix_mean_abs_points": mean(prefix), "steps_compared": len(step_errs),
               "step_within_15pct": within(step_errs), "step_mean_abs_error": mean(step_errs),
               "past_disk_limit": len(rows) - len(on_disk), "within_15pct_on_disk": within(on_disk)}
    if naive:
        summary |= {"naive_within_15pct": within(naive_errs), "naive_mean_abs_error": mean(naive_errs)}
    return {"prediction": True, "model": model.name, "hardware": hw.name, "workload": asdict(base_wl),
            "points": rows, "limits": limits,
            "skipped_placements": sorted(skipped), "disk": {"from": disk_sources, "pages_per_s": disks},
            "speed": speed, "best_split": best_of(rows) if conv is not None else {}, "summary": summary}


def best_of(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per concurrency, the server with the most throughput, predicted and measured, each with its margin."""
    from tiergram.plan.split import best_splits

    def points(key: str) -> dict[str, list[Point]]:
        out: dict[str, list[Point]] = {}
        for r in rows:
            out.setdefault(r["placement"], []).append(Point(r["placement"], r["concurrency"], 0.0, r[key], 0.0, ""))
        return out

    pred, meas = best_splits(points("predicted_tok_s")), best_splits(points("measured_tok_s"))
    return {c: {"predicted": pred[c][0], "predicted_margin": round(pred[c][1], 4), "measured": meas[c][0],
                "measured_margin": round(meas[c][1], 4)} for c in pred}


def validate_text(res: dict[str, Any]) -> str:
    """The comparison as a table."""
    lines = [f"predicted vs measured: {res['model']} on {res['hardware']}",
             f"{'placement':<10}{'c':>4}{'predicted':>12}{'measured':>12}{'meas/pred':>11}  predicted binding "
             "(measured: stall share, disk share of its limit)"]
    for r in res["points"]:
        hit = f" (hit {r['hit_rate']:.0%} from {r['hit_rate_source']})" if r["hit_rate"] is not None else ""
        if r.get("first_read_share") is not None:
            hit += f" ({r['first_read_share']:.0%} of its pages first reads)"
        if r.get("predicted_prefix_hit") is not None and r.get("measured_prefix_hit") is not None:
            hit += f"; prefix hit {r['measured_prefix_hit']:.1%} [predicted {r['predicted_prefix_hit']:.1%}]"
        if r.get("naive_tok_s"):
            hit += f"; naive {r['naive_tok_s']:,.0f} ({r['measured_tok_s'] / r['naive_tok_s']:.3f})"
        if r.get("measured_step_ms"):  # measured / predicted, where the sweep has the server's counters
            hit += (f"; step {r['measured_step_ms']:.1f}/{r['predicted_step_ms']:.1f} ms x "
                    f"{r['measured_steps_per_request']:.1f}/{r['predicted_steps_per_request']:.1f} steps per request")
        if r.get("past_disk_limit"):
            hit += " [read past the disk's new-page limit: a cache under the disk]"
        lines.append(f"{r['placement']:<10}{r['concurrency']:>4}{r['predicted_tok_s']:>12,.1f}"
                     f"{r['measured_tok_s']:>12,.1f}{r['ratio']:>11.3f}  {r['predicted_binding']} (measured "
                     f"{r['measured_binding']}: stall {r['stall_share']:.1%} "
                     f"[predicted {r['predicted_stall_share']:.1%}], disk {r['disk_share']:.0%}){hit}")
    for kind, lim in res["limits"].items():
        lines.append(f"limit {kind}: predicted c = {lim['predicted']} ({lim['predicted_binding']}), "
                     f"measured c = {lim['measured']}")
    if res.get("disk", {}).get("pages_per_s"):
        lines.append("disk predicted on (QD 128, new pages; re-reads at the cache's rate where the spec has one): "
                     + ", ".join(f"{k} {v:,.0f} pages/s (the {res['disk']['from'][k]}'s)"
                                 for k, v in res["disk"]["pages_per_s"].items()))
    sp = res.get("speed")
    if sp and sp["from"] == "sweep":
        lines.append(f"CPU costs at the sweep's speed: its probes' median {sp['sweep_probe_ms']:.2f} ms against the "
                     f"calibration's {sp['spec_probe_ms']:.2f} ms ({sp['factor']:.2f}x the spec's CPU time)")
    if res.get("skipped_placements"):
        lines.append(f"not modelled, skipped: {', '.join(res['skipped_placements'])}")
    s = res["summary"]
    if s["points"]:
        lines.append(f"{s['within_15pct']}/{s['points']} points within 15%; mean |error| {s['mean_abs_error']:.1%}, "
                     f"max {s['max_abs_error']:.1%}; binding named as measured at {s['binding_named']}/{s['points']}")
    if s.get("naive_mean_abs_error") is not None:
        lines.append(f"naive baseline (calibration's own throughput at each c): {s['naive_within_15pct']}/"
                     f"{s['points']} within 15%, mean |error| {s['naive_mean_abs_error']:.1%} (the planner's "
                     f"{s['mean_abs_error']:.1%})")
    lines += _best_split_lines(res)
    if s.get("prefix_mean_abs_points") is not None:
        lines.append(f"prefix-cache hit rate: mean |predicted - measured| {s['prefix_mean_abs_points']:.1f} points")
    if s.get("past_disk_limit"):
        lines.append(f"{s['past_disk_limit']} points read past the disk's new-page limit (a cache under the disk "
                     f"served them: not the disk's); without them {s['within_15pct_on_disk']}/"
                     f"{s['points'] - s['past_disk_limit']} within 15%")
    if s.get("steps_compared"):
        lines.append(f"the server's mean step within 15% of the predicted step at {s['step_within_15pct']}/"
                     f"{s['steps_compared']} points (mean |error| {s['step_mean_abs_error']:.1%})")
    return "\n".join(lines)


def validate_markdown(res: dict[str, Any]) -> str:
    """The comparison as a markdown table (naive and prefix-hit columns where present), its summary below."""
    from tiergram.analysis.stats import md_table  # (tiergram.analysis imports torch: only where a table is written)

    conv = any(r.get("predicted_prefix_hit") is not None for r in res["points"])
    naive = any(r.get("naive_tok_s") for r in res["points"])
    head = ["server", "c", "predicted tok/s", "measured tok/s", "measured / predicted"]
    head += ["naive tok/s", "measured / naive"] if naive else []
    head += ["prefix hit, predicted", "measured"] if conv else []
    rows = []
    for r in res["points"]:
        row = [r["placement"], r["concurrency"], f"{r['predicted_tok_s']:,.0f}", f"{r['measured_tok_s']:,.0f}",
               f"{r['ratio']:.3f}"]
        if naive:
            row += [f"{r['naive_tok_s']:,.0f}", f"{r['measured_tok_s'] / r['naive_tok_s']:.3f}"]
        if conv:
            row += [f"{100 * r['predicted_prefix_hit']:.1f}%", f"{100 * (r['measured_prefix_hit'] or 0):.1f}%"]
        rows.append(row)
    s = res["summary"]
    naive_line = (f"; naive: {s['naive_within_15pct']}/{s['points']}, {s['naive_mean_abs_error']:.1%}"
                  if s.get("naive_mean_abs_error") is not None else "")
    return "\n".join([md_table(head, rows), "", f"planner: {s['within_15pct']}/{s['points']} within ±15%, "
                      f"mean |error| {s['mean_abs_error']:.1%}{naive_line}", *_best_split_lines(res)])


def _best_split_lines(res: dict[str, Any]) -> list[str]:
    """Per concurrency, the best split predicted and measured, each by its margin over the next best."""
    return [f"best split at c = {c}: predicted {b['predicted']} (by {b['predicted_margin'] - 1:.1%}), measured "
            f"{b['measured']} (by {b['measured_margin'] - 1:.1%})" for c, b in res.get("best_split", {}).items()]
