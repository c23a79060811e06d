"""What an allocation sweep shows (docs/findings.md section 6): loss per share, the controls, Engram off, equal
compute, power, and the result files whose dicts alone render each table."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.analysis.allocation import Point, StepRatio, SweepRun
from tiergram.analysis.stats import (
    Estimate,
    interval,
    md_table,
    paired_ratio_delta,
    ratio_estimate,
    seed_cells,
    seed_delta,
    yerr,
)
from tiergram.plots import save_figure, subplots

PAPER_U_DEPTH = 0.014  # nats: the DeepSeek Engram paper's U, best share against the ends


@dataclass
class ShareResult:
    """A share over its seeds: loss of the seed-mean per-document sums, and its paired delta against the best share."""

    share: float
    actual_share: float
    n_experts: int
    rows_per_head: int
    loss: Estimate
    seed_losses: list[float]
    seed_sd: float | None = None  # sample SD of the per-seed losses (None below 2 seeds)
    delta_vs_best: Estimate | None = None


@dataclass
class Comparison:
    """loss(subject) - loss(reference) at one share, paired over documents; negative: the subject is better."""

    what: str  # engram_vs_control | control_vs_share0 | engram_vs_share0 | engram_off | off_vs_control |
    # engram_vs_compute
    share: float
    n_experts: int
    subject: str  # run name without the seed suffix ("share80", "moe03", "share80 (Engram off)")
    reference: str
    seeds: list[int]
    delta: Estimate  # of the seed-mean per-document sums, document-bootstrap 95%
    seed_deltas: list[float]
    seed_ci95: list[float] | None = None  # t interval over seeds (None below 2 seeds)


@dataclass
class Power:
    """Seeds per share a two-sided two-sample t test on per-seed losses needs to detect `delta` nats."""

    delta: float
    alpha: float
    power: float
    seed_sd: dict[str, float]  # per share (percent) the sample SD over seeds
    seeds_per_share: int  # seeds behind each SD (the smallest)
    pooled_sd: float
    pooled_df: int
    pooled_sd_upper95: float  # one-sided 95% upper bound (chi-square)
    seeds_needed: int  # per share, at the pooled SD
    seeds_needed_upper: int  # per share, at the upper bound
    seeds_needed_normal: float  # the normal approximation 2 (z_{1-a/2} + z_{power})^2 sd^2 / delta^2
    detectable_now: float  # the difference detectable with 80% power at the seeds run
    minutes_per_model: float  # median training wall time of the sweep's models here (one run slowed by other work
    # on the machine moves a mean, not the median)
    shares: int


@dataclass
class AllocationReport:
    """The sweep's points, the per-share summary, the controls, the power analysis and the verdict."""

    config: dict[str, Any]
    budget: int
    points: list[Point]
    shares: list[ShareResult] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    step_ratios: list[StepRatio] = field(default_factory=list)
    power: Power | None = None
    verdict: str = ""
    missing: list[str] = field(default_factory=list)


def _stem(run: str) -> str:
    """share80-s0 -> share80, moe03-compute-s1 -> moe03-compute."""
    return run.rsplit("-s", 1)[0]


def compare(result: SweepRun, what: str, share: float, subject: dict[int, str], reference: dict[int, str],
            subject_key: str = "on") -> Comparison | None:
    """The paired comparison of two sets of runs (seed -> run; the subject's Engram on or off) over common seeds."""
    seeds = sorted(s for s in subject if s in reference and subject[s] in result.sums
                   and reference[s] in result.sums and subject_key in result.sums[subject[s]])
    if not seeds:
        return None
    delta, per, ci = seed_delta([result.sums[reference[s]]["on"] for s in seeds],
                                [result.sums[subject[s]][subject_key] for s in seeds], result.counts)
    point = next(p for p in result.points if p.run == subject[seeds[0]])
    off = " (Engram off)" if subject_key == "off" else ""
    return Comparison(what=what, share=share, n_experts=point.n_experts, subject=_stem(subject[seeds[0]]) + off,
                      reference=_stem(reference[seeds[0]]), seeds=seeds, delta=delta, seed_deltas=per, seed_ci95=ci)


def comparisons(result: SweepRun) -> list[Comparison]:
    """Per share > 0: Engram vs its controls and share 0, the control vs share 0, and Engram off."""
    runs: dict[tuple[str, float], dict[int, str]] = {}
    for p in result.points:
        runs.setdefault((p.kind, p.share), {})[p.seed] = p.run
    base = runs.get(("sweep", 0.0), {})
    out = []
    for share in sorted({p.share for p in result.points if p.share > 0}):
        engram, control, compute = (runs.get((kind, share), {}) for kind in ("sweep", "tokens", "compute"))
        for what, subject, reference, key in (
                ("engram_vs_control", engram, control, "on"), ("control_vs_share0", control, base, "on"),
                ("engram_vs_share0", engram, base, "on"), ("engram_off", engram, engram, "off"),
                ("off_vs_control", engram, control, "off"), ("engram_vs_compute", engram, compute, "on")):
            c = compare(result, what, share, subject, reference, key)
            if c is not None:
                out.append(c)
    return out


def summarize_shares(result: SweepRun) -> list[ShareResult]:
    """Per-share losses (seed-mean per-document sums) and paired deltas against the best share."""
    shares, mean_sums = [], {}
    for share in result.cfg.shares:
        mine = [p for p in result.points if p.kind == "sweep" and p.share == share]
        if not mine:
            continue
        mean_sums[share] = np.mean([result.sums[p.run]["on"] for p in mine], axis=0)
        losses = [p.loss.value for p in mine]
        shares.append(ShareResult(share=share, actual_share=mine[0].actual_share, n_experts=mine[0].n_experts,
                                  rows_per_head=mine[0].rows_per_head,
                                  loss=ratio_estimate(mean_sums[share], result.counts), seed_losses=losses,
                                  seed_sd=float(np.std(losses, ddof=1)) if len(losses) > 1 else None))
    if shares:
        best = min(shares, key=lambda s: s.loss.value)
        for s in shares:
            s.delta_vs_best = paired_ratio_delta(mean_sums[best.share], mean_sums[s.share], result.counts)
    return shares


def t_test_power(delta: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of a two-sided two-sample t test with n per group to detect a difference `delta` at SD `sd`."""
    from scipy import stats

    df, ncp = 2 * n - 2, delta / (sd * np.sqrt(2 / n))
    crit = stats.t.ppf(1 - alpha / 2, df)
    lower = float(np.nan_to_num(stats.nct.cdf(-crit, df, ncp)))  # scipy gives NaN far out in the tail, where it is 0
    return float(stats.nct.sf(crit, df, ncp)) + lower


def seeds_for_power(sd: float, delta: float, alpha: float = 0.05, power: float = 0.8, limit: int = 100000) -> int:
    """Smallest seeds per group for a two-sided two-sample t test (equal groups) to reach `power` at `delta`."""
    for n in range(2, limit):
        if t_test_power(delta, sd, n, alpha) >= power:
            return n
    raise ValueError(f"more than {limit} seeds per group for a difference of {delta} at SD {sd}")


def power_analysis(shares: list[ShareResult], points: list[Point], delta: float = PAPER_U_DEPTH, alpha: float = 0.05,
                   power: float = 0.8, grid: int | None = None) -> Power | None:
    """Seeds per share that detect `delta` at the pooled seed SD; `grid` shares price the machine time."""
    from scipy import optimize, stats

    spread = [s for s in shares if s.seed_sd is not None]
    if not spread:
        return None
    df = sum(len(s.seed_losses) - 1 for s in spread)
    pooled = float(np.sqrt(sum((len(s.seed_losses) - 1) * s.seed_sd ** 2 for s in spread) / df))
    upper = float(pooled * np.sqrt(df / stats.chi2.ppf(0.05, df)))
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n_now = min(len(s.seed_losses) for s in spread)

    detectable = float(optimize.brentq(lambda d: t_test_power(d, pooled, n_now, alpha) - power, 1e-9, 100 * pooled))
    sweep = [p for p in points if p.kind == "sweep"]
    return Power(delta=delta, alpha=alpha, power=power,
                 seed_sd={f"{s.share * 100:.0f}": s.seed_sd for s in spread}, seeds_per_share=n_now,
                 pooled_sd=pooled, pooled_df=df, pooled_sd_upper95=upper,
                 seeds_needed=seeds_for_power(pooled, delta, alpha, power),
                 seeds_needed_upper=seeds_for_power(upper, delta, alpha, power),
                 seeds_needed_normal=float(2 * z ** 2 * pooled ** 2 / delta ** 2), detectable_now=detectable,
                 minutes_per_model=float(np.median([p.elapsed_s for p in sweep]) / 60) if sweep else 0.0,
                 shares=grid or len(shares))


def verdict(shares: list[ShareResult], n_seeds: int) -> str:
    """Whether a U appears: an interior minimum with both end points worse by a 95% interval above zero."""
    if len(shares) < 3:
        return f"{len(shares)} shares cannot show a U (at least 3 are needed)"
    ordered = sorted(shares, key=lambda s: s.share)
    best = min(ordered, key=lambda s: s.loss.value)
    noise = "" if n_seeds > 1 else " (one seed: the intervals are over validation documents only)"
    where = f"the lowest loss is at Engram share {best.share:.0%} ({best.loss.value:.4f} nats)"
    if best in (ordered[0], ordered[-1]):
        return f"no U: {where}, an end of the sweep{noise}"
    worse = sum(s.delta_vs_best.ci95[0] > 0 for s in (ordered[0], ordered[-1]))
    return (f"{'a U appears' if worse == 2 else 'no clear U'}: {where}; {worse} of 2 end points worse by more than "
            f"the 95% interval{noise}")


def build_report(result: SweepRun) -> AllocationReport:
    """The report of a swept folder: shares, comparisons, step-time ratios, power and verdict."""
    cfg = result.cfg
    shares = summarize_shares(result)
    seeds = len({p.seed for p in result.points if p.kind == "sweep"})
    return AllocationReport(config=cfg.public(), budget=cfg.budget, points=result.points, shares=shares,
                            comparisons=comparisons(result), step_ratios=result.step_ratios,
                            power=power_analysis(shares, result.points, grid=len(cfg.shares)),
                            verdict=verdict(shares, seeds),
                            missing=result.missing)


# ---- result files and their tables: each table is a function of its result file's dict, nothing else ----

RESULT_FILES = ("sweep", "controls", "engram-off", "equal-compute", "power")
_WHAT = {"controls": ("engram_vs_control", "control_vs_share0", "engram_vs_share0"),
         "engram-off": ("engram_off", "off_vs_control"),
         "equal-compute": ("engram_vs_compute", "engram_vs_control")}


def result_files(report: AllocationReport) -> dict[str, dict[str, Any]]:
    """{name: contents} of the small result files (sweep, controls, engram-off, equal-compute, power)."""
    r = asdict(report)
    head = {"config": r["config"], "budget": r["budget"]}
    kinds = {"sweep": ("sweep",), "controls": ("tokens",), "engram-off": ("sweep",), "equal-compute": ("compute",)}
    out = {}
    for name in RESULT_FILES[:-1]:
        points = [p for p in r["points"] if p["kind"] in kinds[name]]
        if name == "engram-off":
            points = [p for p in points if p["loss_off"] is not None]
        out[name] = head | {"points": points}
    out["sweep"] |= {"shares": r["shares"], "verdict": r["verdict"], "missing": r["missing"]}
    for name, whats in _WHAT.items():
        out[name]["comparisons"] = [c for c in r["comparisons"] if c["what"] in whats]
    out["equal-compute"]["step_ratios"] = r["step_ratios"]
    out["power"] = head | {"power": r["power"]}
    return out


def _seeds(c: dict[str, Any]) -> str:
    return seed_cells(c["delta"], c["seed_deltas"], c["seed_ci95"])


def _by(data: dict[str, Any], what: str) -> dict[float, dict[str, Any]]:
    return {c["share"]: c for c in data["comparisons"] if c["what"] == what}


def _deltas(data: dict[str, Any], what: str) -> dict[float, str]:
    return {share: interval(c["delta"]) for share, c in _by(data, what).items()}


SEED_COLUMNS = ["per seed", "over seeds (t 95%)"]  # after a seed-mean Δ column: the cells of _seeds


def sweep_table(data: dict[str, Any]) -> str:
    """Loss per share over its seeds, the paired delta against the best share, the seed SD and the per-seed losses."""
    return md_table(["Engram share (actual)", "experts per block", "rows per head", "validation loss, seed mean",
                     "Δ vs best (paired)", "seed SD", "per seed"],
                    ([f"{s['share']:.0%} ({s['actual_share']:.1%})", s["n_experts"], f"{s['rows_per_head']:,}",
                      interval(s["loss"], ".4f"), interval(s["delta_vs_best"]) if s["delta_vs_best"]["value"] else "0",
                      "–" if s["seed_sd"] is None else f"{s['seed_sd']:.4f}",
                      ", ".join(f"{v:.4f}" for v in s["seed_losses"])] for s in data["shares"])) + "\n"


def controls_table(data: dict[str, Any]) -> str:
    """Per share: Engram − its MoE-only control (same experts, same tokens), and each against share 0."""
    fewer, total = _deltas(data, "control_vs_share0"), _deltas(data, "engram_vs_share0")
    return md_table(["Engram share", "experts per block", "Engram − MoE-only (same experts), seed mean", *SEED_COLUMNS,
                     "MoE-only − share 0", "Engram − share 0"],
                    ([f"{share:.0%}", c["n_experts"], _seeds(c), fewer.get(share, "–"), total.get(share, "–")]
                     for share, c in sorted(_by(data, "engram_vs_control").items()))) + "\n"


def engram_off_table(data: dict[str, Any]) -> str:
    """Per share: loss with Engram on and off, off − on, and off − the MoE-only control."""
    on = {}
    for p in data["points"]:
        on.setdefault(p["share"], []).append((p["loss"]["value"], p["loss_off"]["value"]))
    control = _deltas(data, "off_vs_control")
    return md_table(["Engram share", "on, seed mean", "off, seed mean", "off − on, seed mean", *SEED_COLUMNS,
                     "off − MoE-only (same experts)"],
                    ([f"{share:.0%}", *(f"{v:.4f}" for v in np.mean(on[share], axis=0)), _seeds(c),
                      control.get(share, "–")] for share, c in sorted(_by(data, "engram_off").items()))) + "\n"


def equal_compute_table(data: dict[str, Any]) -> str:
    """Per share: the measured step-time ratio, the equal-compute control's tokens, Engram − that control."""
    ratios = {r["share"]: r["ratio"] for r in data["step_ratios"]}
    tokens = {}
    for p in data["points"]:
        tokens.setdefault(p["share"], set()).add(p["tokens"])
    same = _deltas(data, "engram_vs_control")
    return md_table(["Engram share", "experts per block", "step time, Engram / MoE-only", "MoE-only tokens",
                     "Engram − MoE-only (equal compute), seed mean", *SEED_COLUMNS, "at equal tokens"],
                    ([f"{share:.0%}", c["n_experts"], f"{ratios[share]:.3f}",
                      ", ".join(f"{t:,}" for t in sorted(tokens[share])), _seeds(c), same.get(share, "–")]
                     for share, c in sorted(_by(data, "engram_vs_compute").items()))) + "\n"


def power_table(data: dict[str, Any]) -> str:
    """The seed spread and the seeds per share a difference of the paper's U depth needs."""
    p = data["power"]
    sds = ", ".join(f"{k}%: {v:.4f}" for k, v in p["seed_sd"].items())

    def hours(n: float) -> float:
        return n * p["shares"] * p["minutes_per_model"] / 60

    return "\n".join([
        "| quantity | value |", "|---|---|",
        f"| seed SD of the validation loss per share ({p['seeds_per_share']} seeds) | {sds} |",
        f"| pooled seed SD (df {p['pooled_df']}) [one-sided 95% upper bound] | {p['pooled_sd']:.4f} "
        f"[{p['pooled_sd_upper95']:.4f}] |",
        f"| difference to detect (the paper's U depth) | {p['delta']:.3f} nats |",
        f"| seeds per share, two-sided two-sample t test, α {p['alpha']}, power {p['power']:.0%} | "
        f"{p['seeds_needed']} (normal approximation {p['seeds_needed_normal']:.1f}); {p['seeds_needed_upper']} at the "
        "upper bound |",
        f"| this machine's time for {p['shares']} shares at that many seeds ({p['minutes_per_model']:.1f} min a "
        f"model) | {hours(p['seeds_needed']):.0f} h; {hours(p['seeds_needed_upper']):.0f} h at the upper bound |",
        f"| difference detectable with 80% power at {p['seeds_per_share']} seeds per share | "
        f"{p['detectable_now']:.3f} nats |", ""])


TABLES = {"sweep": sweep_table, "controls": controls_table, "engram-off": engram_off_table,
          "equal-compute": equal_compute_table, "power": power_table}


def to_markdown(report: AllocationReport) -> str:
    """The whole report as markdown: one section per result file's table, then the verdict."""
    c = report.config
    files = result_files(report)
    lines = [f"# Allocation sweep: {report.budget / 1e6:.2f}M sparse parameters, {c['tokens']:,} tokens per model",
             "", f"d_model {c['d_model']}, {c['n_layers']} blocks, MoE in blocks {list(range(1, c['n_layers']))} "
                 f"(top-{c['top_k']} of N experts of width {c['expert_ffn']}), seeds {list(c['seeds'])}; "
                 f"validation loss in nats/token over {c['eval_tokens']} tokens per category, 95% document-bootstrap "
                 "intervals; Δ = loss(first) − loss(second), paired over documents.", ""]
    for name, table in TABLES.items():
        shown = {"sweep": "shares", "power": "power"}.get(name)
        if files[name].get(shown) if shown else any(c["what"] == _WHAT[name][0] for c in files[name]["comparisons"]):
            lines += [f"## {name}", "", table(files[name])]
    lines += [f"**{report.verdict}.**", ""]
    if report.missing:
        lines += [f"Not finished (not in the tables): {', '.join(report.missing)}.", ""]
    return "\n".join(lines)


def plot(report: AllocationReport, path: str | os.PathLike) -> None:
    """Loss vs actual Engram share (Engram models, MoE-only controls) and Engram − control, to a PNG."""
    fig, (ax, bx) = subplots(1, 2, figsize=(11, 4.2))
    actual = {s.share: s.actual_share * 100 for s in report.shares}
    x = np.array([s.actual_share * 100 for s in report.shares])
    est = [s.loss for s in report.shares]
    ax.errorbar(x, [e.value for e in est], yerr=yerr(est), fmt="o-", capsize=4, label="Engram share s")
    for s in report.shares:
        ax.plot([s.actual_share * 100] * len(s.seed_losses), s.seed_losses, "k.", alpha=0.5)
    for kind, style, label in (("tokens", "s--", "MoE-only, same experts, same tokens"),
                               ("compute", "^:", "MoE-only, same experts, same compute")):
        pts = [p for p in report.points if p.kind == kind and p.share in actual]
        xs = sorted({p.share for p in pts})
        if xs:
            ax.plot([actual[s] for s in xs], [np.mean([p.loss.value for p in pts if p.share == s]) for s in xs],
                    style, label=label + " (seed mean)")
    ax.set_xlabel("Engram share of the sparse parameters (%)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.legend(fontsize=7)
    for what, style, label in (("engram_vs_control", "s", "same tokens"), ("engram_vs_compute", "^", "same compute")):
        cs = [c for c in report.comparisons if c.what == what and c.share in actual]
        if cs:
            xs = np.array([actual[c.share] for c in cs]) + (0.8 if what == "engram_vs_compute" else 0)
            bx.errorbar(xs, [c.delta.value for c in cs], yerr=yerr([c.delta for c in cs]), fmt=style, capsize=4,
                        label=f"Engram − MoE-only, {label}")
            for xi, c in zip(xs, cs, strict=True):
                bx.plot([xi] * len(c.seed_deltas), c.seed_deltas, "k.", alpha=0.5)
    bx.set_xlim(ax.get_xlim())
    bx.axhline(0, color="gray", lw=0.8)
    bx.set_xlabel("Engram share of the sparse parameters (%)")
    bx.set_ylabel("Δ loss, paired over documents (dots: seeds)")
    bx.legend(fontsize=7)
    fig.suptitle(f"{report.budget / 1e6:.2f}M sparse parameters, {report.config['tokens']:,} tokens per model, "
                 f"seeds {list(report.config['seeds'])}", fontsize=9)
    save_figure(fig, Path(path))

