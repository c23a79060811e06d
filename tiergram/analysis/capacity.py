"""Capacity accounting (docs/findings.md section 3): which table rows a corpus touches, how often, from which kind of
text (hashing alone, so a whole split), and how a row's read count relates to its mean gate (a model trace)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tiergram.analysis.stats import Estimate, interval, md_table
from tiergram.analysis.trace import Trace
from tiergram.corpus import CATEGORIES
from tiergram.model.evaluate import Window, batches
from tiergram.model.model import EngramLM
from tiergram.plots import save_figure, subplots


@dataclass
class HeadCapacity:
    """Touch statistics of one hash head."""

    head: int
    order: int
    rows: int
    touched: int
    never_touched_fraction: float
    top1pct_access_share: float  # share of this head's accesses that go to its hottest 1% of touched rows


@dataclass
class LayerCapacity:
    """Touch statistics of one Engram layer's table."""

    layer: int
    rows: int
    accesses: int
    touched: int
    never_touched_fraction: float
    access_share: dict[str, float]  # category -> share of accesses (sums to 1)
    shared_rows: int  # rows touched by more than one category
    hot_access_share: dict[str, float]  # "top 1%"/"top 10%" of touched rows -> share of accesses
    heads: list[HeadCapacity] = field(default_factory=list)


@dataclass
class CapacityReport:
    """Capacity accounting of every Engram layer over one split."""

    model: str
    split: str
    positions: int
    gate_positions: int
    layers: list[LayerCapacity]
    # "trained" / "random-init" -> layer -> Spearman(row reads, mean gate) over rows with a gate observation, with a
    # 95% interval from resampling the gate trace's documents (the read counts, over the whole split, stay fixed)
    hotness_gate: dict[str, dict[int, Estimate]] = field(default_factory=dict)


@dataclass
class RowCounts:
    """Per-row access counts of one layer, by category: counts [C, rows]; offsets [H] into the flat row space."""

    counts: np.ndarray
    offsets: np.ndarray
    head_sizes: list[int]


def count_rows(model: EngramLM, windows: list[Window], batch: int = 256) -> dict[int, RowCounts]:
    """Access counts per layer, row and category over windows (hashing only: no forward pass)."""
    cat_index = {c: i for i, c in enumerate(CATEGORIES)}
    out = {}
    for layer in model.engram_layers:
        offsets, sizes = model.hasher.head_offsets(layer), model.hasher.head_sizes(layer)
        out[layer] = RowCounts(np.zeros((len(CATEGORIES), int(sum(sizes))), dtype=np.int64), offsets, sizes)
    for idx, x, y in batches(windows, batch):  # the padding after a window cannot change its n-grams
        valid = (y != -100).numpy()
        cats = np.repeat([cat_index[windows[i].category] for i in idx], x.shape[1]).reshape(valid.shape)[valid]
        for layer, rows in model.hasher.row_ids(x.numpy()).items():
            rc = out[layer]
            flat = cats[:, None] * rc.counts.shape[1] + rows[valid] + rc.offsets  # [n, H] into counts.ravel()
            rc.counts += np.bincount(flat.ravel(), minlength=rc.counts.size).reshape(rc.counts.shape)
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (nan when either side is constant or there are < 3 points)."""
    from scipy import stats

    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(stats.spearmanr(a, b).statistic)


def row_mean_gate(tr: Trace, layer: int, offsets: np.ndarray, n_rows: int,
                  weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bool [rows] read in the trace, mean gate of those rows), each read counted `weight` [N * H] times."""
    flat = (tr.row_ids[layer] + offsets).ravel()
    g = np.repeat(tr.gates[layer].mean(axis=1).astype(np.float64), tr.row_ids[layer].shape[1])
    seen = np.bincount(flat, weights=weight, minlength=n_rows)
    have = seen > 0
    return have, np.bincount(flat, weights=g if weight is None else g * weight, minlength=n_rows)[have] / seen[have]


def basic_interval(value: float, boot: list[float] | np.ndarray) -> list[float]:
    """95% basic bootstrap interval [2v - q97.5, 2v - q2.5] (corrects a shift the resampling causes)."""
    if len(boot) == 0:
        return [float("nan"), float("nan")]
    lo, hi = np.nanpercentile(boot, [2.5, 97.5])
    return [float(2 * value - hi), float(2 * value - lo)]


def hotness_gate(reads: np.ndarray, tr: Trace, layer: int, offsets: np.ndarray, *, resamples: int = 200,
                 seed: int = 0) -> Estimate:
    """Spearman(row reads [rows], mean gate in the trace), basic bootstrap interval over trace documents."""
    doc = np.repeat(tr.documents(), tr.row_ids[layer].shape[1])
    n_docs = int(doc.max()) + 1

    def rho(weight: np.ndarray | None) -> float:
        have, mean = row_mean_gate(tr, layer, offsets, len(reads), weight)
        return spearman(reads[have], mean)

    rng = np.random.default_rng(seed)
    boot = [rho(np.bincount(rng.integers(0, n_docs, n_docs), minlength=n_docs)[doc].astype(np.float64))
            for _ in range(resamples)]
    value = rho(None)
    return Estimate(value, basic_interval(value, boot), n_docs)


def layer_capacity(layer: int, rc: RowCounts, orders: list[int]) -> LayerCapacity:
    """The accounting of one layer."""
    total = rc.counts.sum(0)
    touched = total > 0
    n_acc = int(total.sum())

    def top_share(t: np.ndarray, percent: float) -> float:
        hot = np.sort(t[t > 0])[::-1]
        return float(hot[:max(1, int(np.ceil(len(hot) * percent / 100)))].sum() / max(int(t.sum()), 1))

    heads = [HeadCapacity(head=h, order=orders[h], rows=size, touched=int((total[off:off + size] > 0).sum()),
                          never_touched_fraction=float((total[off:off + size] == 0).mean()),
                          top1pct_access_share=top_share(total[off:off + size], 1))
             for h, (off, size) in enumerate(zip(rc.offsets, rc.head_sizes, strict=True))]
    return LayerCapacity(layer=layer, rows=int(len(total)), accesses=n_acc, touched=int(touched.sum()),
                         never_touched_fraction=float(1 - touched.mean()),
                         access_share={c: float(rc.counts[i].sum() / max(n_acc, 1)) for i, c in enumerate(CATEGORIES)},
                         shared_rows=int(((rc.counts > 0).sum(0) > 1).sum()),
                         hot_access_share={f"top {p}%": top_share(total, p) for p in (1, 10)}, heads=heads)


def head_orders(model: EngramLM) -> list[int]:
    """The n-gram order of each head (order-2 heads first)."""
    h = model.hasher
    return [n for n in range(2, h.max_ngram_size + 1) for _ in range(h.n_head_per_ngram)]


def analyze(model: EngramLM, windows: list[Window], tr: Trace | None, *, model_name: str = "",
            split: str = "", null: Trace | None = None, resamples: int = 0
            ) -> tuple[CapacityReport, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """(report, {layer: (reads, mean gate) of rows the trace reads}); Spearman(reads, gate) of `tr` and `null`."""
    orders = head_orders(model)
    report = CapacityReport(model=model_name, split=split, positions=int(sum(len(w.inputs) for w in windows)),
                            gate_positions=tr.n if tr is not None else 0, layers=[])
    points = {}
    for layer, rc in count_rows(model, windows).items():
        report.layers.append(layer_capacity(layer, rc, orders))
        reads = rc.counts.sum(0)
        if tr is not None:
            have, mean = row_mean_gate(tr, layer, np.asarray(rc.offsets), len(reads))
            points[layer] = (reads[have], mean)
        for name, t in (("trained", tr), ("random-init", null)):
            if t is not None:
                report.hotness_gate.setdefault(name, {})[layer] = hotness_gate(
                    reads, t, layer, np.asarray(rc.offsets), resamples=resamples)
    return report, points


def plot(points: dict[int, tuple[np.ndarray, np.ndarray]], path: str) -> None:
    """Hexbin of log10 access count vs mean gate, one panel per layer, to a PNG."""
    fig, axes = subplots(1, max(1, len(points)), figsize=(5.5 * max(1, len(points)), 4.2), squeeze=False)
    for ax, (layer, (count, gate)) in zip(axes[0], sorted(points.items()), strict=False):
        hb = ax.hexbin(np.log10(np.maximum(count, 1)), gate, gridsize=40, bins="log", mincnt=1, cmap="viridis")
        ax.set_xlabel("log10 accesses of the row")
        ax.set_ylabel("mean gate at the row's accesses")
        ax.set_title(f"layer {layer}: Spearman {spearman(count, gate):.3f} ({len(count)} rows)")
        fig.colorbar(hb, ax=ax, label="rows")
    save_figure(fig, Path(path))


def hotness_markdown(hotness: dict[str, dict[int, Estimate]]) -> str:
    """Spearman(row reads, mean gate) per model and layer, with its document-bootstrap interval."""
    return md_table(["model", "layer", "Spearman(row reads, mean gate) [95% CI]", "gate-trace documents"],
                    ([name, layer, interval(e, "+.3f"), e.n] for name, by_layer in hotness.items()
                     for layer, e in by_layer.items())) + "\n"


def to_markdown(report: CapacityReport) -> str:
    """The accounting as markdown tables."""
    lines = [f"# Capacity accounting: {report.model}", "",
             f"Split `{report.split}`: {report.positions} positions hashed; gates from {report.gate_positions} "
             "positions.", "",
             md_table(["layer", "rows", "touched", "never touched", "accesses", "top 1% rows' accesses", "top 10%"],
                      ([lc.layer, lc.rows, lc.touched, f"{lc.never_touched_fraction:.3f}", lc.accesses,
                        f"{lc.hot_access_share['top 1%']:.3f}", f"{lc.hot_access_share['top 10%']:.3f}"]
                       for lc in report.layers))]
    if report.hotness_gate:
        lines += ["", hotness_markdown(report.hotness_gate).rstrip()]
    lines += ["", md_table(["layer", "category", "share of accesses"],
                           [row for lc in report.layers for row in
                            [*([lc.layer, c, f"{lc.access_share[c]:.3f}"] for c in CATEGORIES),
                             [lc.layer, "(shared)", f"{lc.shared_rows} rows touched by several"]]]),
              "", md_table(["layer", "head", "order", "rows", "touched", "never touched", "top 1% rows' accesses"],
                           ([lc.layer, h.head, h.order, h.rows, h.touched, f"{h.never_touched_fraction:.3f}",
                             f"{h.top1pct_access_share:.3f}"] for lc in report.layers for h in lc.heads))]
    return "\n".join(lines) + "\n"
