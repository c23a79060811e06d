"""The skip trade-off at matched skip rates (docs/findings.md section 4): every method ranks the held-out positions
and skips the lowest `rate` share of them in every layer, so all skip the same share of row reads; their losses
are paired over documents. A skipped read is a fetched row replaced by zeros; skipping every read = Engram off."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tiergram.analysis.capacity import spearman
from tiergram.analysis.predictor import SkipPredictor, fit_predictor, target_gate
from tiergram.analysis.stats import Estimate, interval, md_table, paired_ratio_delta, ratio_estimate, yerr
from tiergram.analysis.trace import EngramHooks, Trace
from tiergram.analysis.training_rows import TrainingRows
from tiergram.model.evaluate import EvalDoc, eval_batches
from tiergram.model.model import EngramLM
from tiergram.plots import save_figure, subplots

METHODS = ("predictor", "oracle", "train-rare", "train-gate", "random")
BASELINES = ("train-rare", "train-gate", "random")  # the fair ones: nothing read from the evaluation text
RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@torch.no_grad()
def skip_losses(model: EngramLM, tr: Trace, masks: dict[str, dict[int, np.ndarray]], *,
                batch_size: int = 8, progress: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({config: per-document loss sums}, token counts), masks[config][layer] bool [N, H]: True = read skipped."""
    starts = tr.window_starts()
    n_docs = max(w.doc for w in tr.windows) + 1
    sums = {name: np.zeros(n_docs) for name in masks}
    counts = np.zeros(n_docs)
    for idx, x, y in eval_batches(model, tr.windows, batch_size, f"skip eval ({len(masks)} configs)", progress):
        row_ids = model.engram_row_ids(x)
        fetched = {layer: model.blocks[layer].engram.table(row_ids[layer]) for layer in model.engram_layers}
        docs = [tr.windows[i].doc for i in idx]
        valid = (y != -100).cpu().numpy()
        np.add.at(counts, docs, valid.sum(1))
        where = np.concatenate([starts[i] + np.arange(len(tr.windows[i].inputs)) for i in idx])  # the valid positions
        for name, per_layer in masks.items():
            rows, keep = {}, {}
            for layer, m in per_layer.items():
                skip = np.zeros(tuple(row_ids[layer].shape), dtype=bool)
                skip[valid] = m[where]
                s = torch.from_numpy(skip).to(x.device)
                rows[layer] = fetched[layer].masked_fill(s[..., None], 0.0)
                keep[layer] = ~s.all(-1)
            hooks = EngramHooks(record=False, keep=keep)
            with hooks.installed(model):
                logits, _ = model(x, engram_rows=rows)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
            np.add.at(sums[name], docs, (loss.double().cpu().numpy() * valid).sum(1))
    return sums, counts


def spread_documents(docs: list[EvalDoc], doc_tokens: int, tokens_per_category: int | None) -> list[EvalDoc]:
    """The documents cut to doc_tokens each, in order until a category has tokens_per_category (None: all)."""
    if doc_tokens < 1:
        raise ValueError(f"doc_tokens must be >= 1, got {doc_tokens}")
    taken: dict[str, int] = {}
    out = []
    for d in docs:
        room = doc_tokens if tokens_per_category is None else min(doc_tokens,
                                                                  tokens_per_category - taken.get(d.category, 0))
        if room > 0 and len(d.tokens) > 1:
            out.append(EvalDoc(d.category, d.tokens[:room + 1]))
            taken[d.category] = taken.get(d.category, 0) + len(out[-1].tokens) - 1
    return out


def lowest_share(score: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Bool [N]: True at the round(rate * N) positions of lowest score [N], ties broken at random."""
    order = np.lexsort((rng.random(len(score)), score))
    out = np.zeros(len(score), dtype=bool)
    out[order[:int(round(rate * len(score)))]] = True
    return out


def config_name(method: str, rate: float, seed: int | None = None) -> str:
    """Key of one (method, rate[, seed]) in the per-document sums: 'train-rare@0.3', 'random#2@0.3'."""
    return f"{method}{'' if seed is None else f'#{seed}'}@{rate:g}"


@dataclass
class CurvePoint:
    """One method (one seed, for random) at one skip rate on the held-out split."""

    method: str
    seed: int | None
    rate: float  # the requested share of positions skipped in every layer
    skipped_reads: float  # the share of all row reads (every layer) actually skipped: round(rate * N) / N
    thresholds: dict[int, float]  # per layer: the score at the cut (for a predictor: skip where gate < this)
    loss: Estimate
    delta: Estimate  # vs no skipping, paired over documents
    relative_increase: float  # delta / loss without skipping


@dataclass
class MatchedRow:
    """One skip rate: every method's loss increase and the predictor minus the best fair baseline."""

    rate: float
    delta: dict[str, Estimate]  # method -> Δ loss vs no skipping (random: over the seed-mean sums)
    random_spread: list[float]  # [min, max] of the single random seeds' Δ
    best_baseline: str  # the fair baseline with the lowest Δ at this rate (chosen after the fact)
    predictor_minus_best: Estimate  # paired over documents; an interval below 0 = the predictor wins
    predictor_minus: dict[str, Estimate]  # against every fair baseline


@dataclass
class SkipReport:
    """The whole study: the fitted predictor's quality and the matched-rate comparison, with per-document sums."""

    model: str
    fit_split: str
    eval_split: str
    fit_positions: int
    eval_positions: int
    training_rows: dict[str, Any]  # where the train-* baselines' statistics come from
    methods: list[str]  # in the order of the table's columns (random last)
    rates: list[float]
    random_seeds: list[int]
    base_loss: Estimate
    off_loss: Estimate
    memory: dict[str, Any]  # predictor statistics bytes vs table bytes, per layer
    quality: dict[str, dict[int, float]]  # method -> layer -> Spearman(score, true gate) on the eval split
    curve: list[CurvePoint] = field(default_factory=list)
    matched: list[MatchedRow] = field(default_factory=list)
    target: str = ""
    doc_counts: list[float] = field(default_factory=list)  # tokens scored per held-out document
    doc_sums: dict[str, list[float]] = field(default_factory=dict)  # config -> per-document loss sums


def method_scores(model: EngramLM, held: Trace, method: str, predictor: SkipPredictor, train: TrainingRows | None,
                  seed: int = 0) -> dict[int, np.ndarray]:
    """{layer: score [N] of every held-out position}; low score = skip first."""
    out = {}
    for layer in held.layers:
        offsets = np.asarray(model.hasher.head_offsets(layer), dtype=np.int64)
        if method == "predictor":
            out[layer] = predictor.predict_gate(layer, held.row_ids[layer], held.pos)
        elif method == "oracle":
            out[layer] = target_gate(held, layer)
        elif method == "random":
            out[layer] = np.random.default_rng([seed, layer]).random(held.n)
        elif method in ("train-rare", "train-gate"):
            if train is None:
                raise ValueError(f"method {method!r} needs the training-split row statistics")
            score = train.rare_score if method == "train-rare" else train.gate_score
            out[layer] = score(layer, offsets, held.row_ids[layer])
        else:
            raise ValueError(f"unknown method {method!r} (valid: {', '.join(METHODS)})")
    return out


def check_settings(rates: tuple[float, ...], methods: tuple[str, ...], random_seeds: int) -> None:
    """ValueError unless the methods are known and include 'predictor', rates lie in (0, 1) and random_seeds >= 1."""
    bad = [m for m in methods if m not in METHODS]
    if bad or "predictor" not in methods:
        raise ValueError(f"methods must include 'predictor' and come from {', '.join(METHODS)}; got {methods}")
    if not rates or any(not 0 < r < 1 for r in rates) or random_seeds < 1:
        raise ValueError(f"rates must lie strictly between 0 and 1 and random_seeds be >= 1 ({rates}, {random_seeds})")


def skip_study(model: EngramLM, fit: Trace, held: Trace, train: TrainingRows | None = None, *,
               rates: tuple[float, ...] = RATES, methods: tuple[str, ...] = ("predictor", *BASELINES, "oracle"),
               random_seeds: int = 5, batch_size: int = 8, sketch_width: int = 2**16, model_name: str = "",
               fit_split: str = "", eval_split: str = "", progress: bool = False) -> tuple[SkipReport, SkipPredictor]:
    """Fit the predictor on `fit`, skip every method's lowest-scored share of `held` per rate, score all at once."""
    predictor = fit_predictor(model, fit, sketch_width=sketch_width)
    h = {layer: held.row_ids[layer].shape[1] for layer in held.layers}
    masks: dict[str, dict[int, np.ndarray]] = {
        "none": {layer: np.zeros((held.n, h[layer]), dtype=bool) for layer in held.layers},
        "all": {layer: np.ones((held.n, h[layer]), dtype=bool) for layer in held.layers}}
    meta: dict[str, tuple[str, int | None, float, dict[int, float]]] = {}
    quality: dict[str, dict[int, float]] = {}
    seeds = list(range(random_seeds))
    tie_break = np.random.default_rng(12345)  # fixed: a rerun skips the same positions
    for method in methods:
        for seed in seeds if method == "random" else [None]:
            scores = method_scores(model, held, method, predictor, train, 0 if seed is None else seed)
            if method != "random":
                quality[method] = {layer: spearman(scores[layer], target_gate(held, layer)) for layer in held.layers}
            for rate in rates:
                skip = {layer: lowest_share(s, rate, tie_break) for layer, s in scores.items()}
                name = config_name(method, rate, seed)
                masks[name] = {layer: np.repeat(skip[layer][:, None], h[layer], axis=1) for layer in held.layers}
                thr = {layer: float(scores[layer][skip[layer]].max()) if skip[layer].any() else float("-inf")
                       for layer in held.layers}
                meta[name] = (method, seed, rate, thr)
    sums, counts = skip_losses(model, held, masks, batch_size=batch_size, progress=progress)
    sums = {name: np.round(s, 4) for name, s in sums.items()}  # what the JSON keeps is what the tables use
    base, off = ratio_estimate(sums["none"], counts), ratio_estimate(sums["all"], counts)
    order = [m for m in methods if m != "random"] + (["random"] if "random" in methods else [])
    rows_used = {} if train is None else {
        "source": train.source, "tokens_counted": train.tokens_counted, "tokens_gated": train.tokens_gated,
        "rows_never_read": {str(la): float((c == 0).mean()) for la, c in train.counts.items()}}
    report = SkipReport(model=model_name, fit_split=fit_split, eval_split=eval_split, fit_positions=fit.n,
                        eval_positions=held.n, methods=order,
                        rates=[float(r) for r in rates], random_seeds=seeds,
                        base_loss=base, off_loss=off, memory=memory_summary(model, predictor),
                        quality=quality, doc_counts=counts.tolist(),
                        doc_sums={name: s.tolist() for name, s in sums.items()}, training_rows=rows_used)
    for name, (method, seed, rate, thr) in meta.items():
        delta = paired_ratio_delta(sums["none"], sums[name], counts)
        reads = float(np.mean([m.mean() for m in masks[name].values()]))
        report.curve.append(CurvePoint(method=method, seed=seed, rate=rate, skipped_reads=reads, thresholds=thr,
                                       loss=ratio_estimate(sums[name], counts), delta=delta,
                                       relative_increase=delta.value / base.value))
    report.matched = matched_rows(report.doc_sums, report.doc_counts, report.rates, seeds, order)
    report.target = target_summary(report)
    return report, predictor


def matched_rows(doc_sums: dict[str, list[float]], doc_counts: list[float], rates: tuple[float, ...] | list[float],
                 seeds: list[int], methods: list[str]) -> list[MatchedRow]:
    """The matched-rate comparison from per-document loss sums alone (so a test can recompute it from the JSON)."""
    counts = np.asarray(doc_counts)
    none = np.asarray(doc_sums["none"])
    out = []
    for rate in rates:
        per = {m: np.asarray(doc_sums[config_name(m, rate)]) for m in methods if m != "random"}
        spread = []
        if "random" in methods:
            single = [np.asarray(doc_sums[config_name("random", rate, s)]) for s in seeds]
            per["random"] = np.mean(single, axis=0)
            deltas = [paired_ratio_delta(none, s, counts).value for s in single]
            spread = [min(deltas), max(deltas)]
        delta = {m: paired_ratio_delta(none, s, counts) for m, s in per.items()}
        fair = [m for m in BASELINES if m in per]
        if not fair:
            raise ValueError("the matched comparison needs at least one of " + ", ".join(BASELINES))
        best = min(fair, key=lambda m: delta[m].value)
        vs = {m: paired_ratio_delta(per[m], per["predictor"], counts) for m in fair}
        out.append(MatchedRow(rate=float(rate), delta=delta, random_spread=spread, best_baseline=best,
                              predictor_minus_best=vs[best], predictor_minus=vs))
    return out


def memory_summary(model: EngramLM, pred: SkipPredictor) -> dict[str, Any]:
    """Bytes of the predictor's per-row statistics against the table's rows (fp32 here, 264 B at fp8)."""
    out = {}
    for layer, b in pred.nbytes().items():
        rows = int(sum(model.hasher.head_sizes(layer)))
        dim = model.config.engram.dim
        out[str(layer)] = {**b, "rows": rows, "table_fp8_bytes": rows * (dim + dim // 32)}
    return out


def target_summary(report: SkipReport, min_skip: float = 0.30, max_increase: float = 0.01) -> str:
    """Whether the predictor skips >= 30% of reads for <= 1% loss increase: the most it skips within 1%."""
    base = report.base_loss.value
    pts = [p for p in report.curve if p.method == "predictor" and p.relative_increase <= max_increase]
    best = max(pts, key=lambda p: p.rate, default=None)
    if best is None:
        return "target not met: no predictor point stays within a 1% loss increase"
    return (f"{'target met' if best.rate >= min_skip else 'target not met'}: the predictor skips {best.rate:.0%} of "
            f"reads for a {best.relative_increase:+.2%} loss increase (95% interval "
            f"[{best.delta.ci95[0] / base:+.2%}, {best.delta.ci95[1] / base:+.2%}])")


def matched_markdown(rows: list[MatchedRow]) -> str:
    """The matched-rate table: Δ loss (nats) per method, and the predictor minus the best fair baseline."""
    methods = list(rows[0].delta)

    def cell(r: MatchedRow, m: str) -> str:
        spread = f"; {r.random_spread[0]:+.4f} … {r.random_spread[1]:+.4f}" if m == "random" and r.random_spread else ""
        return interval(r.delta[m]) + spread

    return md_table(["reads skipped", *(f"{m} Δ" + (" (seed mean; seed range)" if m == "random" else "")
                                       for m in methods), "predictor − best baseline"],
                    ([f"{r.rate:.0%}", *(cell(r, m) for m in methods),
                      f"{interval(r.predictor_minus_best)} vs {r.best_baseline}"] for r in rows)) + "\n"


def seeds_markdown(runs: dict[str, list[MatchedRow]]) -> str:
    """Predictor minus the best fair baseline at every rate, one column per run (e.g. per training seed)."""
    names = list(runs)
    rates = [r.rate for r in runs[names[0]]]
    if any([r.rate for r in rows] != rates for rows in runs.values()):
        raise ValueError("the runs were measured at different skip rates")
    return md_table(["reads skipped", *names],
                    ([f"{rate:.0%}", *(f"{interval(runs[n][i].predictor_minus_best)} vs {runs[n][i].best_baseline}"
                                       for n in names)] for i, rate in enumerate(rates))) + "\n"


def to_markdown(report: SkipReport) -> str:
    """The report: setting, target check, the matched-rate table, predictor quality and memory."""
    tr = report.training_rows
    lines = [f"# Pre-retrieval skip predictor: {report.model}", "",
             f"Fitted on `{report.fit_split}` ({report.fit_positions} positions), evaluated on `{report.eval_split}` "
             f"({report.eval_positions} positions, {len(report.doc_counts)} documents). Loss without skipping "
             f"{interval(report.base_loss, '.4f')}; with every read skipped (= Engram off) "
             f"{interval(report.off_loss, '.4f')}."]
    if tr:
        lines += ["", f"Training-split statistics: counts from the {tr['source']} ({tr['tokens_counted']} tokens), "
                      f"mean gates from the first {tr['tokens_gated']} of those tokens."]
    lines += ["", f"**{report.target}.**", "",
              "Every method skips the same share of positions (all rows of a skipped position) in every layer; "
              f"Δ loss in nats vs no skipping, 95% paired bootstrap intervals over documents; random: "
              f"{len(report.random_seeds)} seeds.", "", matched_markdown(report.matched).rstrip(), "",
              "Spearman(score, true gate) on the held-out split: " +
              "; ".join(f"{m} " + ", ".join(f"layer {la} {v:.3f}" for la, v in q.items())
                        for m, q in report.quality.items()) + ".", "",
              "Per-row statistics (bytes per layer): " + "; ".join(
                  f"layer {la}: static {m['static']}, sketch {m['sketch']} vs table {m['table_fp8_bytes']} at fp8"
                  for la, m in report.memory.items()) + ".", ""]
    return "\n".join(lines)


def plot(report: SkipReport, path: str) -> None:
    """Reads skipped vs loss increase per method (random: seed mean, with its seed range shaded), to a PNG."""
    fig, axes = subplots(1, 2, figsize=(12, 4.5))
    rows = report.matched
    x = [0.0] + [r.rate * 100 for r in rows]
    for m in rows[0].delta:
        est = [Estimate(0.0, [0.0, 0.0], 0)] + [r.delta[m] for r in rows]
        axes[0].errorbar(x, [e.value for e in est], yerr=yerr(est), marker="o", capsize=3, label=m)
        if m == "random" and rows[0].random_spread:
            axes[0].fill_between(x, [0.0] + [r.random_spread[0] for r in rows],
                                 [0.0] + [r.random_spread[1] for r in rows], alpha=0.15, color="grey")
    d = [r.predictor_minus_best for r in rows]
    axes[1].errorbar(x[1:], [e.value for e in d], yerr=yerr(d), marker="o", capsize=3)
    axes[1].axhline(0.0, color="grey", lw=0.8)
    axes[0].set_ylabel("held-out loss increase (nats/token)")
    axes[0].set_title(f"every read skipped: {report.off_loss.value - report.base_loss.value:+.4f} nats")
    axes[1].set_ylabel("predictor − best fair baseline (nats/token)")
    axes[1].set_title("below 0: the predictor wins")
    for ax in axes:
        ax.set_xlabel("row reads skipped (%)")
    axes[0].legend()
    save_figure(fig, Path(path))

