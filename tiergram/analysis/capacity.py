"""Capacity accounting: which table rows a corpus touches, how often, from which kind of text; hotness vs gate.

Access counts come from hashing alone (row ids depend only on token ids), so they can cover a whole split;
mean gates per row come from a model trace (a subset). A row touched by several categories is shared
between them in proportion to its accesses, so the touched-row shares, like the access shares, add up to 1.
"""

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
    accesses: int
    never_touched_fraction: float
    top1pct_access_share: float  # share of this head's accesses that go to its hottest 1% of touched rows


@dataclass
class LayerCapacity:
    """Touch statistics of one Engram layer's table, and hotness vs gate."""

    layer: int
    rows: int
    accesses: int
    touched: int
    never_touched_fraction: float
    access_share: dict[str, float]  # category -> share of accesses (sums to 1)
    touched_row_share: dict[str, float]  # category -> share of touched rows, shared rows split (sums to 1)
    exclusive_rows: dict[str, int]  # category -> rows touched by that category only
    rows_per_1k_accesses: dict[str, float]  # category -> distinct rows it touches per 1000 of its accesses
    shared_rows: int  # rows touched by more than one category
    hot_access_share: dict[str, float]  # "top 1%"/"top 10%" of touched rows -> share of accesses
    gate_rows: int  # rows with at least one gate observation
    spearman_count_gate: float  # over rows with a gate observation
    spearman_count_gate_min5: float  # over rows seen >= 5 times in the gate trace
    spearman_by_order: dict[int, float]
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
            flat = rows[valid] + rc.offsets  # [n, H]
            for c in range(len(CATEGORIES)):
                sel = flat[cats == c].ravel()
                if len(sel):
                    rc.counts[c] += np.bincount(sel, minlength=rc.counts.shape[1])
    return out


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their average rank."""
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    start = np.cumsum(counts) - counts
    return (start + (counts - 1) / 2.0)[inverse.reshape(-1)]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (nan when either side is constant or there are < 3 points)."""
    if len(a) < 3:
        return float("nan")
    ra, rb = rankdata(np.asarray(a)), rankdata(np.asarray(b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclass
class RowGates:
    """Per-row gate observations of one layer from a trace: sums and counts over the flat row space."""

    gate_sum: np.ndarray
    seen: np.ndarray


def row_gates(tr: Trace, layer: int, offsets: np.ndarray, total_rows: int) -> RowGates:
    """Sum of the gate (mean over branches) at every access of every row, and the number of accesses."""
    flat = (tr.row_ids[layer] + offsets).ravel()
    g = np.repeat(tr.gates[layer].mean(axis=1).astype(np.float64), tr.row_ids[layer].shape[1])
    return RowGates(np.bincount(flat, weights=g, minlength=total_rows), np.bincount(flat, minlength=total_rows))


def basic_interval(value: float, boot: list[float] | np.ndarray) -> list[float]:
    """95% basic bootstrap interval [2v - q97.5, 2v - q2.5]: unlike the percentile interval it corrects for a
    statistic the resampling itself shifts (a per-row mean from fewer distinct documents is noisier, which pulls a
    correlation over rows towards 0)."""
    if len(boot) == 0:
        return [float("nan"), float("nan")]
    lo, hi = np.nanpercentile(boot, [2.5, 97.5])
    return [float(2 * value - hi), float(2 * value - lo)]


def hotness_gate(reads: np.ndarray, tr: Trace, layer: int, offsets: np.ndarray, *, resamples: int = 200,
                 seed: int = 0) -> Estimate:
    """Spearman(row reads [rows], the row's mean gate in the trace) over rows the trace reads, with its basic
    bootstrap interval over resampled trace documents (a document's positions count as often as it is drawn)."""
    flat = (tr.row_ids[layer] + offsets).ravel()
    g = np.repeat(tr.gates[layer].mean(axis=1).astype(np.float64), tr.row_ids[layer].shape[1])
    doc = np.repeat(tr.documents(), tr.row_ids[layer].shape[1])
    n_docs = int(doc.max()) + 1

    def rho(weight: np.ndarray) -> float:
        seen = np.bincount(flat, weights=weight, minlength=len(reads))
        have = seen > 0
        mean = np.bincount(flat, weights=g * weight, minlength=len(reads))[have] / seen[have]
        return spearman(reads[have], mean)

    rng = np.random.default_rng(seed)
    boot = [rho(np.bincount(rng.integers(0, n_docs, n_docs), minlength=n_docs)[doc].astype(np.float64))
            for _ in range(resamples)]
    value = rho(np.ones(len(flat)))
    return Estimate(value, basic_interval(value, boot), n_docs)


def layer_capacity(layer: int, rc: RowCounts, rg: RowGates | None, orders: list[int]) -> LayerCapacity:
    """The accounting of one layer."""
    counts = rc.counts
    total = counts.sum(0)
    touched = total > 0
    n_acc = int(total.sum())
    acc_share = {c: float(counts[i].sum() / max(n_acc, 1)) for i, c in enumerate(CATEGORIES)}
    frac = counts[:, touched] / total[touched]
    row_share = {c: float(frac[i].sum() / max(int(touched.sum()), 1)) for i, c in enumerate(CATEGORIES)}
    by = counts > 0
    n_by = by.sum(0)
    exclusive = {c: int((by[i] & (n_by == 1)).sum()) for i, c in enumerate(CATEGORIES)}
    per_k = {c: float(1000 * by[i].sum() / max(int(counts[i].sum()), 1)) for i, c in enumerate(CATEGORIES)}
    hot = np.sort(total[touched])[::-1]
    hot_share = {f"top {p}%": float(hot[:max(1, int(np.ceil(len(hot) * p / 100)))].sum() / max(n_acc, 1))
                 for p in (1, 10)}
    heads = []
    for h, (off, size) in enumerate(zip(rc.offsets, rc.head_sizes, strict=True)):
        t = total[off:off + size]
        ht = np.sort(t[t > 0])[::-1]
        heads.append(HeadCapacity(head=h, order=orders[h], rows=size, touched=int((t > 0).sum()),
                                  accesses=int(t.sum()), never_touched_fraction=float((t == 0).mean()),
                                  top1pct_access_share=float(ht[:max(1, int(np.ceil(len(ht) / 100)))].sum()
                                                             / max(int(t.sum()), 1))))
    rho = rho5 = float("nan")
    by_order: dict[int, float] = {}
    gate_rows = 0
    if rg is not None:
        have = rg.seen > 0
        gate_rows = int(have.sum())
        mean_gate = np.divide(rg.gate_sum, np.maximum(rg.seen, 1))
        rho = spearman(total[have], mean_gate[have])
        five = rg.seen >= 5
        rho5 = spearman(total[five], mean_gate[five])
        order_of_row = np.repeat(np.array(orders), rc.head_sizes)
        for n in sorted(set(orders)):
            sel = have & (order_of_row == n)
            by_order[n] = spearman(total[sel], mean_gate[sel])
    return LayerCapacity(layer=layer, rows=int(len(total)), accesses=n_acc, touched=int(touched.sum()),
                         never_touched_fraction=float(1 - touched.mean()), access_share=acc_share,
                         touched_row_share=row_share, exclusive_rows=exclusive, rows_per_1k_accesses=per_k,
                         shared_rows=int((n_by > 1).sum()), hot_access_share=hot_share, gate_rows=gate_rows,
                         spearman_count_gate=rho, spearman_count_gate_min5=rho5, spearman_by_order=by_order,
                         heads=heads)


def head_orders(model: EngramLM) -> list[int]:
    """The n-gram order of each head (order-2 heads first)."""
    h = model.hasher
    return [n for n in range(2, h.max_ngram_size + 1) for _ in range(h.n_head_per_ngram)]


def analyze(model: EngramLM, windows: list[Window], tr: Trace | None, *, model_name: str = "",
            split: str = "", null: Trace | None = None, resamples: int = 0
            ) -> tuple[CapacityReport, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """(report, {layer: (access count, mean gate) of every row with a gate observation}) for the plot. With
    resamples, Spearman(reads, gate) gets its interval, for `tr` and for `null` (a random-init model's trace)."""
    counts = count_rows(model, windows)
    orders = head_orders(model)
    layers, points = [], {}
    report = CapacityReport(model=model_name, split=split, positions=int(sum(len(w.inputs) for w in windows)),
                            gate_positions=tr.n if tr is not None else 0, layers=layers)
    for layer, rc in counts.items():
        rg = row_gates(tr, layer, rc.offsets, rc.counts.shape[1]) if tr is not None else None
        layers.append(layer_capacity(layer, rc, rg, orders))
        if rg is not None:
            have = rg.seen > 0
            points[layer] = (rc.counts.sum(0)[have], rg.gate_sum[have] / rg.seen[have])
        for name, t in (("trained", tr), ("random-init", null)):
            if t is not None and resamples:
                report.hotness_gate.setdefault(name, {})[layer] = hotness_gate(
                    rc.counts.sum(0), t, layer, np.asarray(rc.offsets), resamples=resamples)
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
             md_table(["layer", "rows", "touched", "never touched", "accesses", "top 1% rows' accesses", "top 10%",
                       "Spearman(count, gate)", "rows seen ≥5"],
                      ([lc.layer, lc.rows, lc.touched, f"{lc.never_touched_fraction:.3f}", lc.accesses,
                        f"{lc.hot_access_share['top 1%']:.3f}", f"{lc.hot_access_share['top 10%']:.3f}",
                        f"{lc.spearman_count_gate:.3f}", f"{lc.spearman_count_gate_min5:.3f}"]
                       for lc in report.layers))]
    if report.hotness_gate:
        lines += ["", hotness_markdown(report.hotness_gate).rstrip()]
    by_category = []
    for lc in report.layers:
        by_category += [[lc.layer, c, f"{lc.access_share[c]:.3f}", f"{lc.touched_row_share[c]:.3f}",
                         lc.exclusive_rows[c], f"{lc.rows_per_1k_accesses[c]:.0f}"] for c in CATEGORIES]
        by_category.append([lc.layer, "(shared)", "", "", f"{lc.shared_rows} rows touched by several", ""])
    lines += ["", md_table(["layer", "category", "share of accesses", "share of touched rows",
                            "rows touched only by it", "distinct rows per 1000 accesses"], by_category),
              "", md_table(["layer", "head", "order", "rows", "touched", "never touched", "top 1% rows' accesses"],
                           ([lc.layer, h.head, h.order, h.rows, h.touched, f"{h.never_touched_fraction:.3f}",
                             f"{h.top1pct_access_share:.3f}"] for lc in report.layers for h in lc.heads))]
    return "\n".join(lines) + "\n"
