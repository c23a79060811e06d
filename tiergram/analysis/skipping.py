"""The skip trade-off: share of row reads skipped vs held-out loss increase, for the predictor and baselines.

A skipped read is a fetched row replaced by zeros (passed to the model as engram_rows=); a position whose
every row is skipped is skipped as a whole (its Engram value and output are zero, as when the layer is off
there), so skipping every read equals running without Engram. Thresholds are fixed on the fitting split
(validation) at target skip rates, then applied to the held-out split (test); the achieved rates are
reported. Baselines: oracle (the true gate, which needs the row: an upper bound), random positions, and
cold rows (lowest sketch access count first, the "hot rows are the useful ones" hypothesis).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tiergram.analysis.capacity import spearman
from tiergram.analysis.predictor import FEATURE_SETS, SkipPredictor, fit_predictor, loo_gates, target_gate
from tiergram.analysis.stats import Estimate, paired_ratio_delta, ratio_estimate
from tiergram.analysis.trace import EngramHooks, Trace
from tiergram.model.evaluate import batches
from tiergram.model.model import EngramLM
from tiergram.plots import save_figure, subplots

METHODS = ("predictor", "sketch-only", "oracle", "random", "cold")


@torch.no_grad()
def skip_losses(model: EngramLM, tr: Trace, masks: dict[str, dict[int, np.ndarray]], *,
                batch_size: int = 8, progress: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({config: per-document loss sums}, per-document token counts) over the trace's windows, where
    masks[config][layer] is a bool [N, H] over the trace's positions: True = that row read is skipped."""
    from tqdm import tqdm

    model.eval()
    device = next(model.parameters()).device
    starts = tr.window_starts()
    n_docs = max(w.doc for w in tr.windows) + 1
    sums = {name: np.zeros(n_docs) for name in masks}
    counts = np.zeros(n_docs)
    for idx, x, y in tqdm(list(batches(tr.windows, batch_size)), desc="skip eval", unit="batch",
                          disable=not progress):
        x, y = x.to(device), y.to(device)
        row_ids = model.engram_row_ids(x)
        fetched = {layer: model.blocks[layer].engram.table(row_ids[layer]) for layer in model.engram_layers}
        docs = [tr.windows[i].doc for i in idx]
        valid = (y != -100).cpu().numpy()
        for j, d in enumerate(docs):
            counts[d] += valid[j].sum()
        for name, per_layer in masks.items():
            rows, keep = {}, {}
            for layer, m in per_layer.items():
                skip = np.zeros(tuple(row_ids[layer].shape), dtype=bool)
                for j, i in enumerate(idx):
                    n = len(tr.windows[i].inputs)
                    skip[j, :n] = m[starts[i]:starts[i] + n]
                s = torch.from_numpy(skip).to(device)
                rows[layer] = fetched[layer].masked_fill(s[..., None], 0.0)
                keep[layer] = ~s.all(-1)
            hooks = EngramHooks(record=False, keep=keep)
            with hooks.installed(model):
                logits, _ = model(x, engram_rows=rows)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
            loss = (loss.double().cpu().numpy() * valid).sum(1)
            for j, d in enumerate(docs):
                sums[name][d] += loss[j]
    return sums, counts


@dataclass
class CurvePoint:
    """One method at one threshold on the held-out split."""

    method: str
    target_rate: float
    thresholds: dict[int, float]  # per layer: skip where score < threshold
    skipped_reads: float  # share of all row reads (every layer) skipped
    skipped_by_layer: dict[int, float]
    loss: Estimate
    delta: Estimate  # vs no skipping, paired over documents
    relative_increase: float  # delta / loss without skipping
    share_of_engram_effect: float  # delta / (loss with every read skipped - loss without skipping)


@dataclass
class SkipReport:
    """The whole study: predictor quality, the trade-off curve, and the target check."""

    model: str
    fit_split: str
    eval_split: str
    fit_positions: int
    eval_positions: int
    base_loss: Estimate
    off_loss: Estimate
    memory: dict[str, Any]  # predictor statistics bytes vs table bytes, per layer
    quality: dict[str, dict[int, float]]  # method -> layer -> Spearman(score, true gate) on the eval split
    curve: list[CurvePoint] = field(default_factory=list)
    target: str = ""


def method_scores(model: EngramLM, fit: Trace, held: Trace, method: str, predictors: dict[str, SkipPredictor],
                  seed: int = 0) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """({layer: score on fit positions}, {layer: score on held-out positions}); low score = skip first."""
    rng = np.random.default_rng(seed)
    fit_s, held_s = {}, {}
    for layer in held.layers:
        if method in ("predictor", "sketch-only"):
            p = predictors[method]
            fit_s[layer] = loo_gates(p, fit, layer)
            held_s[layer] = p.predict_gate(layer, held.row_ids[layer], held.pos)
        elif method == "oracle":
            fit_s[layer], held_s[layer] = target_gate(fit, layer), target_gate(held, layer)
        elif method == "random":
            fit_s[layer], held_s[layer] = rng.random(fit.n), rng.random(held.n)
        elif method == "cold":  # mean log access count of the position's rows in the fitting trace's sketch
            p = predictors["sketch-only"]
            lm = p.layers[layer]
            for tr, out, own in ((fit, fit_s, True), (held, held_s, False)):
                flat = tr.row_ids[layer] + lm.offsets
                c, _ = lm.sketch.query(flat, np.zeros(flat.size) if own else None)
                out[layer] = np.log1p(c.reshape(flat.shape)).mean(1) + rng.random(tr.n) * 1e-6
        else:
            raise ValueError(f"unknown method {method!r} (valid: {', '.join(METHODS)})")
    return fit_s, held_s


def skip_study(model: EngramLM, fit: Trace, held: Trace, *, rates: tuple[float, ...] = (0.3, 0.5, 0.7),
               methods: tuple[str, ...] = METHODS, batch_size: int = 8, sketch_width: int = 2**16,
               model_name: str = "", fit_split: str = "", eval_split: str = "",
               progress: bool = False) -> tuple[SkipReport, SkipPredictor]:
    """Fit the predictors on `fit`, evaluate every method at every rate on `held` (plus none/all skipped)."""
    predictors = {"predictor": fit_predictor(model, fit, "full", sketch_width=sketch_width),
                  "sketch-only": fit_predictor(model, fit, "sketch", sketch_width=sketch_width)}
    h = {layer: held.row_ids[layer].shape[1] for layer in held.layers}
    masks: dict[str, dict[int, np.ndarray]] = {
        "none": {layer: np.zeros((held.n, h[layer]), dtype=bool) for layer in held.layers},
        "all": {layer: np.ones((held.n, h[layer]), dtype=bool) for layer in held.layers}}
    meta: dict[str, tuple[str, float, dict[int, float]]] = {}
    quality: dict[str, dict[int, float]] = {}
    for method in methods:
        fit_s, held_s = method_scores(model, fit, held, method, predictors)
        quality[method] = {layer: spearman(held_s[layer], target_gate(held, layer)) for layer in held.layers}
        for rate in rates:
            thr = {layer: float(np.quantile(fit_s[layer], rate)) for layer in held.layers}
            name = f"{method}@{rate:g}"
            masks[name] = {layer: np.repeat((held_s[layer] < thr[layer])[:, None], h[layer], axis=1)
                           for layer in held.layers}
            meta[name] = (method, rate, thr)
    sums, counts = skip_losses(model, held, masks, batch_size=batch_size, progress=progress)
    base = ratio_estimate(sums["none"], counts)
    effect = ratio_estimate(sums["all"], counts).value - base.value
    report = SkipReport(model=model_name, fit_split=fit_split, eval_split=eval_split, fit_positions=fit.n,
                        eval_positions=held.n, base_loss=base, off_loss=ratio_estimate(sums["all"], counts),
                        memory=memory_summary(model, predictors["predictor"]), quality=quality)
    for name, (method, rate, thr) in meta.items():
        by_layer = {layer: float(m.mean()) for layer, m in masks[name].items()}
        delta = paired_ratio_delta(sums["none"], sums[name], counts)
        report.curve.append(CurvePoint(method=method, target_rate=rate, thresholds=thr,
                                       skipped_reads=float(np.mean(list(by_layer.values()))),
                                       skipped_by_layer=by_layer, loss=ratio_estimate(sums[name], counts),
                                       delta=delta, relative_increase=delta.value / base.value,
                                       share_of_engram_effect=delta.value / effect if effect else float("nan")))
    report.target = target_summary(report)
    return report, predictors["predictor"]


def memory_summary(model: EngramLM, pred: SkipPredictor) -> dict[str, Any]:
    """Bytes of the predictor's per-row statistics against the table's rows (fp32 here, 264 B at fp8)."""
    out = {}
    for layer, b in pred.nbytes().items():
        rows = int(sum(model.hasher.head_sizes(layer)))
        dim = model.config.engram.dim
        out[str(layer)] = {**b, "rows": rows, "table_fp8_bytes": rows * (dim + dim // 32),
                           "table_fp32_bytes": rows * dim * 4}
    return out


def target_summary(report: SkipReport, min_skip: float = 0.30, max_increase: float = 0.01) -> str:
    """Whether the predictor skips >= 30% of reads for <= 1% loss increase: the most it skips within 1% by the
    point estimate, and by the upper end of the 95% interval."""
    base = report.base_loss.value
    pts = [p for p in report.curve if p.method == "predictor"]
    best = max((p for p in pts if p.relative_increase <= max_increase), key=lambda p: p.skipped_reads, default=None)
    sure = max((p for p in pts if p.delta.ci95[1] / base <= max_increase), key=lambda p: p.skipped_reads,
               default=None)
    if best is None:
        return "target not met: no predictor point stays within a 1% loss increase"
    met = best.skipped_reads >= min_skip
    text = (f"{'target met' if met else 'target not met'}: the predictor skips {best.skipped_reads:.1%} of reads "
            f"for a {best.relative_increase:+.2%} loss increase (95% interval "
            f"[{best.delta.ci95[0] / base:+.2%}, {best.delta.ci95[1] / base:+.2%}])")
    if sure is not None and sure is not best:
        text += (f"; with the whole interval within 1%: {sure.skipped_reads:.1%} of reads "
                 f"({sure.relative_increase:+.2%}, up to {sure.delta.ci95[1] / base:+.2%})")
    elif sure is None:
        text += "; no point has its whole interval within 1%"
    return text


def to_markdown(report: SkipReport) -> str:
    """The trade-off table."""
    lines = [f"# Pre-retrieval skip predictor: {report.model}", "",
             f"Fitted on `{report.fit_split}` ({report.fit_positions} positions), evaluated on `{report.eval_split}` "
             f"({report.eval_positions} positions). Loss without skipping {report.base_loss.value:.4f} "
             f"[{report.base_loss.ci95[0]:.4f}, {report.base_loss.ci95[1]:.4f}]; with every read skipped (= Engram "
             f"off) {report.off_loss.value:.4f} [{report.off_loss.ci95[0]:.4f}, {report.off_loss.ci95[1]:.4f}].", "",
             f"**{report.target}.**", "",
             "Spearman(score, true gate) on the held-out split: " +
             "; ".join(f"{m} " + ", ".join(f"layer {la} {v:.3f}" for la, v in q.items())
                       for m, q in report.quality.items()) + ".", "",
             "| method | target rate | reads skipped | loss | Δ loss [95% CI] | relative | share of Engram's effect |",
             "|---|---|---|---|---|---|---|"]
    for p in sorted(report.curve, key=lambda p: (p.method, p.target_rate)):
        lines.append(f"| {p.method} | {p.target_rate:.0%} | {p.skipped_reads:.1%} | {p.loss.value:.4f} | "
                     f"{p.delta.value:+.5f} [{p.delta.ci95[0]:+.5f}, {p.delta.ci95[1]:+.5f}] | "
                     f"{p.relative_increase:+.3%} | {p.share_of_engram_effect:.1%} |")
    lines += ["", "Per-row statistics (bytes per layer): " + "; ".join(
        f"layer {la}: static {m['static']}, sketch {m['sketch']} vs table {m['table_fp8_bytes']} at fp8"
        for la, m in report.memory.items()) + ".", ""]
    return "\n".join(lines)


def plot(report: SkipReport, path: str) -> None:
    """Reads skipped vs relative loss increase, and vs share of Engram's effect lost, per method, to a PNG."""
    fig, axes = subplots(1, 2, figsize=(12, 4.5))
    base = report.base_loss.value
    effect = report.off_loss.value - base
    for method in dict.fromkeys(p.method for p in report.curve):
        pts = sorted((p for p in report.curve if p.method == method), key=lambda p: p.skipped_reads)
        x = [0.0] + [p.skipped_reads * 100 for p in pts]
        for ax, scale in ((axes[0], base), (axes[1], effect)):
            y = [0.0] + [p.delta.value / scale * 100 for p in pts]
            lo = [0.0] + [(p.delta.value - p.delta.ci95[0]) / scale * 100 for p in pts]
            hi = [0.0] + [(p.delta.ci95[1] - p.delta.value) / scale * 100 for p in pts]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=method)
    axes[0].set_ylabel("held-out loss increase (% of the loss)")
    axes[0].set_title(f"loss increase; every read skipped: {effect / base * 100:+.3f}%")
    axes[1].set_ylabel("loss increase (% of Engram's whole effect)")
    axes[1].set_title("share of Engram's effect lost")
    for ax in axes:
        ax.axvline(30.0, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("row reads skipped (%)")
        ax.legend()
    if effect / base * 100 >= 1.0:
        axes[0].axhline(1.0, color="grey", ls="--", lw=0.8)
    save_figure(fig, Path(path))


__all__ = ["FEATURE_SETS", "METHODS", "skip_losses", "skip_study", "to_markdown", "plot"]
